"""The thin layer between transformers' attention call and etblocks attention blocks."""

from __future__ import annotations

import torch

from etblocks.attention.mha import Attention, GatedAttention
from etblocks.attention.sha import SingleHeadAttention
from etblocks.attention.shared import KVSharedAttention
from etblocks.mixers.gated_deltanet import GatedDeltaNet
from etblocks.mixers.mamba2 import Mamba2
from etblocks.mixers.short_conv import ShortConv


class FedPositions:
    """Mixin: absolute positions for a block that upstream calls without `position_ids`. `take_positions`, a
    forward pre-hook (`feed_positions`) on the module that does receive them, hands them over for the one call that
    follows: a stale position never starts (or continues) a sequence."""

    _fed_positions: torch.Tensor | None = None

    def take_positions(self, module, args, kwargs) -> None:
        self._fed_positions = kwargs.get("position_ids")

    def take_given_positions(self, module, args, kwargs) -> None:
        """`take_positions` from a module called inside the model's call: keeps the model's when it has none."""
        if kwargs.get("position_ids") is not None:
            self._fed_positions = kwargs["position_ids"]

    def call_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        """`position_ids [1, T]` as given, else as handed over; `ValueError` if neither or for a batch."""
        if position_ids is None:
            position_ids = self._fed_positions
        self._fed_positions = None
        if position_ids is None:
            raise ValueError(
                f"{type(self).__name__} needs position_ids: call the swapped model with position_ids, or the block "
                "with position_ids=..."
            )
        if position_ids.shape[0] != 1:
            raise ValueError(f"etblocks state holds one sequence; got position_ids of shape {tuple(position_ids.shape)}")
        return position_ids


class HFCall(FedPositions):
    """Mixin: accept transformers' attention call, run the mixer (`etblocks.state.mixer`), return `(output, None)`.

    Put it before any mixer class (`class HFMyMixer(HFCall, MyMixer)`) to call the mixer where transformers calls
    an attention module. The mixer keeps its own state (or gets caller-owned state bound by the static program):
    transformers' `cache` argument is ignored, and the absolute positions come from `position_ids` (`[1, T]`), which the HF
    decoder layers pass down (or, where they do not, the model's own call: `FedPositions`). `position_embeddings` are the `(cos, sin)` the HF model computed for this layer,
    so every rope variant the model knows is reproduced exactly. `use_rope=False` marks a layer without
    rotation (SmolLM3's NoPE layers). `rope_tables` says how the model lays its tables out:
    - "halves": `cat(f, f)` for rotate-half pairs `(i, i + R/2)` (Llama), as the blocks take them;
    - "half_width": `f` alone (GPT-OSS rotates the halves `(x1, x2)` to `(x1 cos - x2 sin, x2 cos + x1 sin)`),
      doubled to `cat(f, f)`;
    - "pairs": `f0, f0, f1, f1, ...` for interleaved pairs `(2i, 2i + 1)` (Cohere), as given to a block whose
      `interleaved` is set;
    - "halves_as_pairs": `cat(f, f)`, of which the model rotates interleaved pairs with the first half repeated
      (GLM, ERNIE 4.5): turned into "pairs";
    - "halves_reversed": `cat(f, f)`, rotated the other way (NanoChat's rotate-half flips the signs): `sin`
      negated;
    - "none": the layer does not rotate (what `use_rope=False` also says).
    """

    use_rope: bool = True
    rope_tables: str = "halves"

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        position_ids = self.call_positions(position_ids)
        rope = position_embeddings if self.use_rope else None
        if rope is not None and self.rope_tables == "half_width":
            rope = tuple(torch.cat((t, t), dim=-1) for t in rope)
        elif rope is not None and self.rope_tables == "halves_as_pairs":
            rope = tuple(torch.stack((t[..., : t.shape[-1] // 2],) * 2, dim=-1).flatten(-2) for t in rope)
        elif rope is not None and self.rope_tables == "halves_reversed":
            rope = (rope[0], -rope[1])
        return super().forward(hidden_states, position_ids[0], rope), None


class HFAttention(HFCall, Attention):
    """An `Attention` block called the transformers way. Parameter names stay the upstream ones (`q_proj`,
    `o_proj`, `q_norm`, ...), so state dicts and adapter targets do not change."""


class HFGatedAttention(HFCall, GatedAttention):
    """A `GatedAttention` block called the transformers way (Qwen3.5's full-attention layers)."""


class HFKVSharedAttention(HFCall, KVSharedAttention):
    """A `KVSharedAttention` block called the transformers way (Gemma 3n's layers that reuse keys and values;
    transformers' `shared_kv_states` argument is ignored: the block reads its source's `KVShare`)."""


class HFSingleHeadAttention(HFCall, SingleHeadAttention):
    """A `SingleHeadAttention` block called the transformers way (the qnn recipe's attention)."""


class HFStateCall(FedPositions):
    """Mixin: accept transformers' call of a mixer that is not attention (a short convolution, linear attention):
    `forward(hidden_states, cache=None, attention_mask=None, **kwargs) -> output`, run the mixer
    (`etblocks.state.mixer`). The mixer keeps its own state; `cache` is ignored.

    transformers hands such layers no positions, but the mixer needs them (a call at position 0 starts a
    sequence): the decoder layer holding it gets `position_ids` and hands them over (`FedPositions`). A 2-D
    `attention_mask` (padding) zeroes padded inputs, as upstream does.
    """

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
        position_ids = self.call_positions(position_ids)
        if attention_mask is not None and attention_mask.ndim == 2:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        return super().forward(hidden_states, position_ids[0])


def feed_positions(model: torch.nn.Module) -> None:
    """Hook every `FedPositions` block of `model` to where its positions come from: the model itself (families
    with absolute position embeddings, GPT-BigCode, XGLM, pass attention none), and for a state layer also the
    decoder layer holding it (its parent), which gets the positions the model computes when it was given none
    (Qwen3.5, LFM2; Granite 4.0-H hands its layers none)."""
    for name, module in model.named_modules():
        if isinstance(module, FedPositions):
            model.register_forward_pre_hook(module.take_positions, with_kwargs=True)
            if isinstance(module, HFStateCall):
                parent = model.get_submodule(name.rpartition(".")[0])
                parent.register_forward_pre_hook(module.take_given_positions, with_kwargs=True)


class HFShortConv(HFStateCall, ShortConv):
    """A `ShortConv` called the transformers way (LFM2's `conv` layers)."""


class HFGatedDeltaNet(HFStateCall, GatedDeltaNet):
    """A `GatedDeltaNet` called the transformers way (Qwen3.5's `linear_attn` layers)."""


class HFMamba2(HFStateCall, Mamba2):
    """A `Mamba2` mixer called the transformers way (Granite 4.0-H's `mamba` layers)."""
