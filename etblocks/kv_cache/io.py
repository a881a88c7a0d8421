"""Caller-owned KV cache: caches come in as inputs and only the new rows go out (static NPU programs)."""

from __future__ import annotations

import torch
from torch import nn


class IOKVCache(nn.Module):
    """Holds no state. `update(k, v, k_cache, v_cache) -> (k_all, v_all)` appends the new rows `[B, T, Hkv, D]`
    after the caller's cache `[B, S, Hkv, D]`; the caller writes the rows it gets back into its cache.

    Attention over `k_all` needs the caller's additive mask `[T, S + T]`, since only the caller knows which
    cache slots are filled.
    """

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim

    def update(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat((k_cache, k), dim=1), torch.cat((v_cache, v), dim=1)
