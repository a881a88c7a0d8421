"""The last K inputs of a mixer: the state of a causal convolution over the sequence."""

from __future__ import annotations

import torch

from etblocks.state.base import State, zero_at_start
from etblocks.state.spec import WINDOW, StateSpec


class WindowState(State):
    """The last `length` rows `[B, length, *row_shape]` a mixer saw, oldest first (declared as a `window` update).

    `update(input_pos [T], rows [B, T, *row_shape]) -> [B, length + T, *row_shape]`: the kept rows followed by the
    call's rows, which is what a causal convolution of `length + 1` taps reads; the state then keeps the last
    `length` of them. A call starting a sequence (first position 0) reads zeros for the kept rows. In place it
    is a buffer; caller-owned, the kept rows are bound and the call's rows are emitted for the caller to append.
    """

    def __init__(
        self,
        length: int,
        row_shape: int | tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        *,
        caller_owned: bool = False,
        max_batch_size: int = 1,
        name: str = "conv_state",
    ) -> None:
        super().__init__()
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"length={length!r} is not accepted; give the number of rows kept, an integer >= 1")
        self.length = length
        self.row_shape = (row_shape,) if isinstance(row_shape, int) else tuple(row_shape)
        self.dtype = dtype
        self.caller_owned = caller_owned
        self.max_batch_size = 1 if caller_owned else max_batch_size
        self.name = name
        if not caller_owned:
            self.register_declared()

    def specs(self) -> list[StateSpec]:
        return [StateSpec(self.name, (self.max_batch_size, self.length, *self.row_shape), self.dtype, WINDOW)]

    def update(self, input_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        kept = self.bound()[0] if self.caller_owned else getattr(self, self.name)
        window = torch.cat((zero_at_start(kept, input_pos).to(rows.dtype), rows), dim=1)
        if self.caller_owned:
            self.emit(rows)
        else:
            getattr(self, self.name).copy_(window[:, -self.length :])
        return window

    def extra_repr(self) -> str:
        return f"length={self.length}, row_shape={self.row_shape}, caller_owned={self.caller_owned}"
