"""What every in-graph KV cache offers: an update that returns what attention reads, plus reset and resize."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """A cache owned by one attention block. Layout `[B, S, Hkv, D]` (sequence at dim 1, as ExecuTorch's ops).
    `v_cache` may have its own last dim `v_head_dim` (default `head_dim`), e.g. MLA's latent and roped key.

    `update(input_pos [T], k [B,T,Hkv,D], v) -> (k_all [B,S',Hkv,D], v_all, k_pos [S'])`, where `k_pos` is the
    absolute position held in each returned slot (-1 for empty). Buffers are non-persistent: a swapped model's
    state dict stays the upstream one.
    """

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
        return self.k_cache.shape[1]

    def _allocate(self, length: int) -> None:
        shape = (self.max_batch_size, length, self.n_kv_heads)
        self.register_buffer("k_cache", torch.zeros(*shape, self.head_dim, dtype=self.dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(*shape, self.v_head_dim, dtype=self.dtype), persistent=False)

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()

    def resize(self, max_seq_len: int) -> None:
        """Reallocate for a new context length (contents are dropped)."""
        self._allocate(max_seq_len)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        raise NotImplementedError


def find_caches(module: nn.Module) -> list[KVCache]:
    return [m for m in module.modules() if isinstance(m, KVCache)]


def reset_caches(module: nn.Module) -> None:
    for cache in find_caches(module):
        cache.reset()
