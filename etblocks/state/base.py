"""`State`: what one mixer keeps between calls, in place or owned by the program's caller."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from etblocks.state.spec import StateSpec


class State(nn.Module):
    """One state of a mixer: one or more tensors, each declared by a `StateSpec` (`specs()`, in program order).

    In place (`caller_owned` False: dynamic programs, and static ones that keep state inside): the tensors are
    non-persistent buffers named as declared, which the mixer's call updates; ExecuTorch keeps them as mutable
    buffers (a swapped model's state dict stays the upstream one).

    Caller-owned (`caller_owned` True: static programs for NPUs, which hold nothing between calls): the program
    binds the caller's tensors before a call (`bind`), the mixer reads them (`bound`) and emits one update per
    declared tensor (`emit`), which the program returns to the caller (`take`). A positional state (`rows`,
    `ring`) is bound with the caller's additive mask `[T, L + T]` over its rows and the call's new rows: only the
    caller knows which rows are filled.
    """

    caller_owned: bool = False

    def __init__(self) -> None:
        super().__init__()
        self._bound: tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None = None
        self._updates: tuple[torch.Tensor, ...] | None = None

    def specs(self) -> list[StateSpec]:
        """The tensors of this state, in the order a static program takes them."""
        raise NotImplementedError

    def reset(self) -> None:
        """Zero the declared buffers of an in-place state (caller-owned state holds none)."""
        if not self.caller_owned:
            for spec in self.specs():
                getattr(self, spec.name).zero_()

    def resize(self, max_seq_len: int) -> None:
        """Follow a new context length (contents are dropped); state that does not grow with the context keeps its size."""
        self.reset()

    def register_declared(self) -> None:
        """Register a zeroed non-persistent buffer per declared tensor (in place), under its declared name."""
        for spec in self.specs():
            self.register_buffer(spec.name, spec.zeros(), persistent=False)

    # The caller-owned protocol: bind before a call, take after it.

    def bind(self, tensors: Sequence[torch.Tensor], mask: torch.Tensor | None = None) -> None:
        """Inputs of the next call: one tensor per declared one (and a positional state's mask)."""
        self._bound = (tuple(tensors), mask)
        self._updates = None

    def bound(self) -> tuple[torch.Tensor, ...]:
        if self._bound is None:
            raise ValueError(
                f"this {type(self).__name__} is caller-owned and was not given its tensors for this call; run the "
                "model through its static program (etblocks.export), or call the block with its state (kv=..., mask=...)"
            )
        return self._bound[0]

    @property
    def mask(self) -> torch.Tensor | None:
        """The caller's mask bound for this call (None: in place, or not given)."""
        return None if self._bound is None else self._bound[1]

    def emit(self, *updates: torch.Tensor) -> None:
        """The call's update of each declared tensor (see `etblocks.state.spec` for what each kind returns)."""
        self._updates = updates

    def take(self) -> tuple[torch.Tensor, ...]:
        """The updates of the last call; unbinds the inputs."""
        if self._updates is None:
            raise ValueError(f"take() before the mixer holding this {type(self).__name__} ran: bind its tensors and call it first")
        updates = self._updates
        self.unbind()
        return updates

    def unbind(self) -> None:
        self._bound = self._updates = None


def zero_at_start(state: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """`state`, or zeros when the call starts a sequence (first position 0), so what an earlier sequence left is
    never read. A product with a 0/1 flag, not a branch, so it exports for any position; not a `where`: XNNPACK
    leaves that to the portable kernel, which is slow on a state as large as a DeltaNet's recurrent matrix."""
    return state * (input_pos[:1] > 0).to(state.dtype)


def find_states(module: nn.Module) -> list[State]:
    """Every `State` in `module`, in module order (the order a static program takes them)."""
    return [m for m in module.modules() if isinstance(m, State)]


def reset_states(module: nn.Module) -> None:
    for state in find_states(module):
        if not state.caller_owned:
            state.reset()
