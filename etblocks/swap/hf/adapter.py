"""The thin layer between transformers' attention call and etblocks attention blocks."""

from __future__ import annotations

import torch

from etblocks.attention.mha import Attention, GatedAttention
from etblocks.attention.sha import SingleHeadAttention
from etblocks.mixers.gated_deltanet import GatedDeltaNet
from etblocks.mixers.short_conv import ShortConv


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


class HFGatedAttention(HFCall, GatedAttention):
    """A `GatedAttention` block called the transformers way (Qwen3.5's full-attention layers)."""


class HFSingleHeadAttention(HFCall, SingleHeadAttention):
    """A `SingleHeadAttention` block called the transformers way (the qnn recipe's attention)."""


class HFStateCall:
    """Mixin: accept transformers' call of a mixer that is not attention (a short convolution, linear attention):
    `forward(hidden_states, cache=None, attention_mask=None, **kwargs) -> output`, run the mixer
    (`etblocks.state.mixer`). The mixer keeps its own state; `cache` is ignored.

    transformers hands such layers no positions, but the mixer needs them (a call at position 0 starts a
    sequence): the decoder layer holding it gets `position_ids`, and `take_positions`, a forward pre-hook on that
    layer (`feed_positions`), passes them on for the one call that follows. A 2-D `attention_mask` (padding)
    zeroes padded inputs, as upstream does.
    """

    positions_from_layer = True
    _fed_positions: torch.Tensor | None = None

    def take_positions(self, layer, args, kwargs) -> None:
        self._fed_positions = kwargs.get("position_ids")

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
        if position_ids is None:
            position_ids = self._fed_positions
        self._fed_positions = None  # one call per hand-over: a stale position never starts (or continues) a sequence
        if position_ids is None:
            raise ValueError(
                f"{type(self).__name__} needs the decoder layer's position_ids: call the swapped model with "
                "position_ids, or the block with position_ids=..."
            )
        if position_ids.shape[0] != 1:
            raise ValueError(f"etblocks state holds one sequence; got position_ids of shape {tuple(position_ids.shape)}")
        if attention_mask is not None and attention_mask.ndim == 2:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        return super().forward(hidden_states, position_ids[0])


def feed_positions(model: torch.nn.Module) -> None:
    """Hook every `HFStateCall` mixer of `model` to the decoder layer holding it (its parent module)."""
    for name, module in model.named_modules():
        if isinstance(module, HFStateCall):
            parent = model.get_submodule(name.rpartition(".")[0])
            parent.register_forward_pre_hook(module.take_positions, with_kwargs=True)


class HFShortConv(HFStateCall, ShortConv):
    """A `ShortConv` called the transformers way (LFM2's `conv` layers)."""


class HFGatedDeltaNet(HFStateCall, GatedDeltaNet):
    """A `GatedDeltaNet` called the transformers way (Qwen3.5's `linear_attn` layers)."""
