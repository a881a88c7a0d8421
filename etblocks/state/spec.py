"""What a mixer declares about each tensor of state it keeps between calls, and what each kind of update means.

A declaration (`StateSpec`) is all a program, its contract and its runner need: dynamic programs hold the tensor
as a mutable buffer, static programs take it as an input and return its update, and the runner applies that
update (`apply_update`) without knowing which block the state belongs to.

Update kinds, for a call of T tokens at positions `pos .. pos + T - 1` (static programs may pad a call; `n <= T`
of its tokens are real):
- `rows`: `[B, L, ...]`, position p in row p (a K/V cache). The call's update is its T new rows; the caller
  writes the first n at rows `pos .. pos + n - 1`.
- `ring`: `[B, W, ...]`, position p in row `p % W`, the last W positions kept (a sliding-window K/V cache). The
  update is the T new rows; the caller writes the last `min(n, W)` real ones at their rows.
- `window`: `[B, K, ...]`, the last K inputs, oldest first (a causal convolution's state). The update is the T
  new rows; the caller appends the n real ones (to zeros at position 0) and keeps the last K.
- `replace`: any shape; the update is the state after the call, which replaces it whole (a recurrence's hidden
  state). A padded call would fold its padding in, so a program holding such state is padded only if the state
  `skips_padding`: its mixer leaves it unchanged by tokens at position -1, the position padded rows carry.
`rows` and `ring` hold positions: readers mask them by position, so they need no clearing between sequences.
`window` and `replace` state is read as zeros by a call that starts a sequence (first position 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS, RING, WINDOW, REPLACE = "rows", "ring", "window", "replace"
UPDATES = (ROWS, RING, WINDOW, REPLACE)
POSITIONAL = (ROWS, RING)
PADDABLE = (ROWS, RING, WINDOW)


@dataclass(frozen=True)
class StateSpec:
    """One state tensor: its `name` (unique within its state), full `shape` (batch first), `dtype` and `update` kind.
    For `rows`, `ring` and `window` dim 1 holds the rows (L, W or K of them). `skips_padding`: see `replace`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    update: str
    skips_padding: bool = False

    def __post_init__(self) -> None:
        if self.update not in UPDATES:
            raise ValueError(f"update={self.update!r} is not an update kind; accepted: {list(UPDATES)}")
        if self.update != REPLACE and len(self.shape) < 2:
            raise ValueError(f"{self.name}: a {self.update!r} state holds rows along dim 1; got shape {self.shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def positional(self) -> bool:
        return self.update in POSITIONAL

    @property
    def paddable(self) -> bool:
        """Whether a padded call leaves this state as its real tokens left it (once the caller applies the update)."""
        return self.update in PADDABLE or self.skips_padding

    @property
    def rows(self) -> int:
        """L, W or K: the rows it holds along dim 1."""
        if self.update == REPLACE:
            raise ValueError(f"{self.name} is replaced whole; it holds no rows")
        return self.shape[1]

    def update_shape(self, tokens: int) -> tuple[int, ...]:
        """The shape of a call's update for `tokens` tokens: new rows, or the whole state."""
        if self.update == REPLACE:
            return self.shape
        return (self.shape[0], tokens, *self.shape[2:])

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype)


def held_positions(update: str, length: int, pos: int) -> torch.Tensor:
    """`[length]`: the position each row of a positional (`rows` or `ring`) state holds once positions `0 .. pos - 1`
    are written (-1: empty)."""
    rows = torch.arange(length)
    if update == ROWS:
        return torch.where(rows < pos, rows, -1)
    if update != RING:
        raise ValueError(f"a {update!r} state holds no positions; only rows and ring states do")
    latest = (pos - 1) - torch.remainder(pos - 1 - rows, length)
    return torch.where(latest >= 0, latest, -1)


def apply_update(spec: StateSpec, state: torch.Tensor, update: torch.Tensor, pos: int, n: int) -> torch.Tensor:
    """The caller's side of a call: `state` after `update` (the call's output for it) from `n` real tokens at
    position `pos`. `rows` and `ring` state is written in place; the returned tensor is the state to keep."""
    if spec.update == ROWS:
        state[:, pos : pos + n] = update[:, :n]
        return state
    if spec.update == RING:
        keep = min(n, spec.rows)  # earlier rows of a long call would be overwritten within it anyway
        state[:, torch.arange(pos + n - keep, pos + n) % spec.rows] = update[:, n - keep : n]
        return state
    if spec.update == WINDOW:
        kept = state if pos > 0 else torch.zeros_like(state)  # a call at position 0 read zeros, not what was left
        return torch.cat((kept, update[:, :n]), dim=1)[:, -spec.rows :].contiguous()
    return update  # replace: the state after every token of the call (never a padded one)
