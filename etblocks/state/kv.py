"""What every in-place KV cache offers: an update that returns what attention reads, plus reset and resize."""

from __future__ import annotations

import torch

from etblocks.state.base import State
from etblocks.state.spec import ROWS, StateSpec


class KVCache(State):
    """A cache owned by one attention block, updated in place. Layout `[B, S, Hkv, D]` (sequence at dim 1, as
    ExecuTorch's ops). `v_cache` may have its own last dim `v_head_dim` (default `head_dim`), e.g. MLA's latent and
    roped key.

    `update(input_pos [T], k [B,T,Hkv,D], v) -> (k_all [B,S',Hkv,D], v_all, k_pos [S'])`, where `k_pos` is the
    absolute position held in each returned slot (-1 for empty). Stale rows of an earlier sequence need no
    clearing: attention masks them by position.
    """

    update_kind = ROWS

    def __init__(
        self,
        max_batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.dtype = dtype
        self._allocate(max_seq_len)

    @property
    def max_seq_len(self) -> int:
        return self.length

    def specs(self) -> list[StateSpec]:
        rows = (self.max_batch_size, self.length, self.n_kv_heads)
        return [
            StateSpec("k_cache", (*rows, self.head_dim), self.dtype, self.update_kind),
            StateSpec("v_cache", (*rows, self.v_head_dim), self.dtype, self.update_kind),
        ]

    def _allocate(self, length: int) -> None:
        self.length = length
        self.register_declared()

    def resize(self, max_seq_len: int) -> None:
        """Reallocate for a new context length (contents are dropped)."""
        self._allocate(max_seq_len)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        raise NotImplementedError
