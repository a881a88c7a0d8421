"""Caller-owned KV cache: caches come in as inputs and only the new rows go out (static NPU programs)."""

from __future__ import annotations

import torch

from etblocks.state.base import State
from etblocks.state.spec import RING, ROWS, StateSpec


class IOKVCache(State):
    """Holds no state between calls: the caller binds its caches `k_cache`, `v_cache` `[1, L, Hkv, D]` and the
    additive mask `[T, L + T]` before a call (`bind`, done by the static program), `update` appends the call's
    new rows `[B, T, Hkv, D]` after them for attention to read, and the new rows go back to the caller, who
    writes them into its caches (`take`). Only the caller knows which rows are filled, hence its mask.

    It declares `L = max_seq_len` rows (`rows` update: position p in row p) or, with a sliding `window`, `L = window`
    rows (`ring` update: position p in row p % window); `max_seq_len` may be left out for a block called directly
    with its caches (`kv=`), whatever their length. `v_head_dim` (default `head_dim`) is the last dim of
    `v_cache` when it differs from `k_cache`'s (MLA). Subclasses with more tensors per row (int8) extend `specs`.
    """

    caller_owned = True

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        max_seq_len: int | None = None,
        window: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.max_seq_len = max_seq_len
        self.window = window
        self.dtype = dtype

    def resize(self, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len

    def _rows(self) -> tuple[int, str]:
        if self.window is not None:
            return self.window, RING
        if self.max_seq_len is None:
            raise ValueError("this IOKVCache was built without max_seq_len, so it declares no rows; give max_seq_len=")
        return self.max_seq_len, ROWS

    def specs(self) -> list[StateSpec]:
        length, update = self._rows()
        rows = (1, length, self.n_kv_heads)
        return [
            StateSpec("k_cache", (*rows, self.head_dim), self.dtype, update),
            StateSpec("v_cache", (*rows, self.v_head_dim), self.dtype, update),
        ]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """-> `(k_all, v_all, None)`: the bound caches followed by the new rows (their positions are the mask's
        business), and the new rows emitted for the caller."""
        k_cache, v_cache = self.bound()
        self.emit(k, v)
        return torch.cat((k_cache, k), dim=1), torch.cat((v_cache, v), dim=1), None
