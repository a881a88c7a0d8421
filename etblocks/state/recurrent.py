"""A tensor a mixer replaces whole at every call: the hidden state of a recurrence."""

from __future__ import annotations

import torch

from etblocks.state.base import State, zero_at_start
from etblocks.state.spec import REPLACE, StateSpec


class RecurrentState(State):
    """A state tensor of any `shape` (batch first) that each call replaces whole (declared as a `replace` update).

    `read(input_pos [T])` gives the state before the call (zeros when the call starts a sequence, first position
    0); `write(new)` sets the state after it. In place it is a buffer; caller-owned, the state is bound and the
    new one emitted. Its update folds in every token of the call: `skips_padding=True` declares that the mixer
    leaves it unchanged by tokens at position -1 (padding), which lets static programs pad a short call.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        *,
        caller_owned: bool = False,
        name: str = "recurrent_state",
        skips_padding: bool = False,
    ) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.dtype = dtype
        self.caller_owned = caller_owned
        self.name = name
        self.skips_padding = skips_padding
        if not caller_owned:
            self.register_declared()

    def specs(self) -> list[StateSpec]:
        return [StateSpec(self.name, self.shape, self.dtype, REPLACE, self.skips_padding)]

    def read(self, input_pos: torch.Tensor) -> torch.Tensor:
        state = self.bound()[0] if self.caller_owned else getattr(self, self.name)
        return zero_at_start(state, input_pos)

    def write(self, state: torch.Tensor) -> None:
        if self.caller_owned:
            self.emit(state)
        else:
            getattr(self, self.name).copy_(state)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, dtype={self.dtype}, caller_owned={self.caller_owned}"
