"""Caller-owned KV cache: caches come in as inputs and only the new rows go out (static NPU programs)."""

from __future__ import annotations

import torch
from torch import nn


class IOKVCache(nn.Module):
    """Holds no state between calls. `update(k, v, k_cache, v_cache) -> (k_all, v_all)` appends the new rows
    `[B, T, Hkv, D]` after the caller's cache `[B, S, Hkv, D]`; the caller writes the rows it gets back into its
    cache.

    Attention over `k_all` needs the caller's additive mask `[T, S + T]`, since only the caller knows which
    cache slots are filled.

    A program whose attention is called by code it does not own (a transformers decoder layer) hands each
    layer its inputs with `bind(k_cache, v_cache, mask)` before the call and collects the new rows with
    `take()` after it.

    `v_head_dim` (default `head_dim`) is the last dim of `v_cache` when it differs from `k_cache`'s (MLA).
    """

    def __init__(self, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self._bound: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._new_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat((k_cache, k), dim=1), torch.cat((v_cache, v), dim=1)

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor) -> None:
        """Inputs for the next call: caches `[B, S, Hkv, D]` and the additive mask `[T, S + T]`."""
        self._bound = (k_cache, v_cache, mask)
        self._new_rows = None

    def bound(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._bound is None:
            raise ValueError(
                "this attention has a caller-owned (IO) KV cache and was called without bind(k_cache, v_cache, mask); "
                "run the model through its static program (etblocks.export) or bind the caches first"
            )
        return self._bound

    def emit(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        self._new_rows = (k_new, v_new)

    def unbind(self) -> None:
        self._bound = self._new_rows = None

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new rows `[B, T, Hkv, D]` of the last call; unbinds the inputs."""
        if self._new_rows is None:
            raise ValueError("take() before the attention ran: bind the caches and call the model first")
        rows = self._new_rows
        self.unbind()
        return rows
