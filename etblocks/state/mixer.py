"""The contract of a token mixer: the block of a decoder layer that mixes information across positions.

Attention (`Attention`, `SingleHeadAttention`, `MLAttention`) and the mixers that keep other state (convolutions,
recurrences) all implement it, and everything above the blocks (swap, programs, contract, runner) relies on it
alone, never on a block's type:

- `forward(x [B, T, D], input_pos [T], position_embeddings=None) -> y [B, T, D]`: `input_pos` holds the absolute
  positions of the T tokens (consecutive); a call whose first position is 0 starts a sequence. Optional
  `position_embeddings` are rotary tables the caller computed.
- Its state is the `State` modules it holds (`etblocks.state`), each declaring its tensors (`StateSpec`: name,
  shape, dtype, update kind). The mixer builds them in the form its recipe asks for: in place (a dynamic
  program's mutable buffers) or caller-owned (a static program's inputs and outputs, which the program binds
  around the call). One mixer call updates each of its states once.
- Optional: `projection_parts` maps a projection the block split (single-head attention's per-head views) to
  its parts, so what is keyed by the upstream projection (LoRA adapters) still finds it.

Blocks expose their steps as methods (projection, rotation, attention) that subclasses override; a call adapter
(`etblocks.swap.HFCall`, `etblocks.swap.TuneCall`) takes the upstream model's call signature.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from etblocks.state.base import State


class Mixer(Protocol):
    """What `etblocks.register` converters return (the contract above)."""

    def forward(
        self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor: ...


def call_with_state(
    state: State | None, tensors: Sequence[torch.Tensor], mask: torch.Tensor | None, call: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """`(y, *updates)` of `call()` with the caller-owned `state` bound to `tensors` (and `mask`) for this one call:
    how a block is called with its state by hand, outside a static program."""
    if state is None or not state.caller_owned:
        raise ValueError(
            f"state tensors were given to a block whose cache is {type(state).__name__}; only a caller-owned cache "
            "(IOKVCache) takes them"
        )
    state.bind(tensors, mask)
    try:
        y = call()
        return (y, *state.take())
    finally:
        state.unbind()
