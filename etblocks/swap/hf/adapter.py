"""The thin layer between transformers' attention call and etblocks attention blocks."""

from __future__ import annotations

import torch

from etblocks.attention.mha import Attention
from etblocks.attention.sha import SingleHeadAttention


class HFCall:
    """Mixin: accept transformers' attention call, run the mixer (`etblocks.state.mixer`), return `(output, None)`.

    Put it before any mixer class (`class HFMyMixer(HFCall, MyMixer)`) to call the mixer where transformers calls
    an attention module. The mixer keeps its own state (or gets caller-owned state bound by the static program):
    transformers' `cache` argument is ignored, and the absolute positions come from `position_ids` (`[1, T]`), which the HF
    decoder layers pass down. `position_embeddings` are the `(cos, sin)` the HF model computed for this layer,
    so every rope variant the model knows is reproduced exactly. `use_rope=False` marks a layer without
    rotation (SmolLM3's NoPE layers). `half_rope_tables=True` marks tables of `Dh/2` frequencies (GPT-OSS
    rotates the halves `(x1, x2)` to `(x1 cos - x2 sin, x2 cos + x1 sin)`): that is rotate-half with the tables
    doubled to the `cat(f, f)` layout the blocks take.
    """

    use_rope: bool = True
    half_rope_tables: bool = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if position_ids is None:
            raise ValueError(
                "etblocks attention needs position_ids from the decoder layer; this model does not pass them"
            )
        if position_ids.shape[0] != 1:
            raise ValueError(f"etblocks caches hold one sequence; got position_ids of shape {tuple(position_ids.shape)}")
        rope = position_embeddings if self.use_rope else None
        if rope is not None and self.half_rope_tables:
            rope = tuple(torch.cat((t, t), dim=-1) for t in rope)
        return super().forward(hidden_states, position_ids[0], rope), None


class HFAttention(HFCall, Attention):
    """An `Attention` block called the transformers way. Parameter names stay the upstream ones (`q_proj`,
    `o_proj`, `q_norm`, ...), so state dicts and adapter targets do not change."""


class HFSingleHeadAttention(HFCall, SingleHeadAttention):
    """A `SingleHeadAttention` block called the transformers way (the qnn recipe's attention)."""
