"""Caller-owned KV cache: caches come in as inputs and only the new rows go out (static NPU programs)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import nn


class CacheTensor(NamedTuple):
    """One caller-owned tensor of a layer's cache: its name, shape `[1, L, ...]` and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def io_cache_layout(
    n_kv_heads: int, k_dim: int, v_dim: int, length: int, dtype: torch.dtype, kv_quantize: str | None = None
) -> list[CacheTensor]:
    """The tensors of one layer's caller-owned cache of `length` rows, in program order: `k_cache`, `v_cache`
    (`dtype`); int8 caches (`kv_quantize="int8"`, see `QuantizedIOKVCache`) add per-row float32 `*_scales` and
    int8 `*_zero_points` after each."""
    rows = (1, length, n_kv_heads)
    if kv_quantize is None:
        return [CacheTensor("k_cache", (*rows, k_dim), dtype), CacheTensor("v_cache", (*rows, v_dim), dtype)]
    tensors = []
    for kv, dim in (("k", k_dim), ("v", v_dim)):
        tensors += [
            CacheTensor(f"{kv}_cache", (*rows, dim), torch.int8),
            CacheTensor(f"{kv}_scales", (*rows, 1), torch.float32),
            CacheTensor(f"{kv}_zero_points", (*rows, 1), torch.int8),
        ]
    return tensors


class IOKVCache(nn.Module):
    """Holds no state between calls. `update(k, v, k_cache, v_cache) -> (k_all, v_all)` appends the new rows
    `[B, T, Hkv, D]` after the caller's cache `[B, S, Hkv, D]`; the caller writes the rows it gets back into its
    cache.

    Attention over `k_all` needs the caller's additive mask `[T, S + T]`, since only the caller knows which
    cache slots are filled.

    A program whose attention is called by code it does not own (a transformers decoder layer) hands each
    layer its inputs with `bind(caches, mask)` before the call and collects the new rows with `take()` after
    it. `io_cache_layout` lists the tensors a layer's caches are made of (two here; more for an int8 cache).

    `v_head_dim` (default `head_dim`) is the last dim of `v_cache` when it differs from `k_cache`'s (MLA).
    """

    kv_quantize: str | None = None

    def __init__(self, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self._bound: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None
        self._new_rows: tuple[torch.Tensor, ...] | None = None

    def layout(self, length: int, dtype: torch.dtype) -> list[CacheTensor]:
        return io_cache_layout(self.n_kv_heads, self.head_dim, self.v_head_dim, length, dtype, self.kv_quantize)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """-> `(k_all, v_all, new_rows)`: what attention reads, and the rows the caller writes back (one per
        tensor of the layout)."""
        return torch.cat((k_cache, k), dim=1), torch.cat((v_cache, v), dim=1), (k, v)

    def bind(self, caches: Sequence[torch.Tensor], mask: torch.Tensor) -> None:
        """Inputs for the next call: the layer's caches (`k_cache, v_cache` `[B, S, Hkv, D]`, or the tensors of
        its `layout`) and the additive mask `[T, S + T]`."""
        self._bound = (tuple(caches), mask)
        self._new_rows = None

    def bound(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        if self._bound is None:
            raise ValueError(
                "this attention has a caller-owned (IO) KV cache and was called without bind(k_cache, v_cache, mask); "
                "run the model through its static program (etblocks.export) or bind the caches first"
            )
        return self._bound

    def emit(self, *new_rows: torch.Tensor) -> None:
        self._new_rows = new_rows

    def unbind(self) -> None:
        self._bound = self._new_rows = None

    def take(self) -> tuple[torch.Tensor, ...]:
        """The new rows `[B, T, ...]` of the last call, one per cache tensor; unbinds the inputs."""
        if self._new_rows is None:
            raise ValueError("take() before the attention ran: bind the caches and call the model first")
        rows = self._new_rows
        self.unbind()
        return rows
