"""Int8 KV caches: ExecuTorch's scheme (asymmetric int8, one scale and zero point per token and KV head), in
place, as a ring, or caller-owned.

A cache row costs `D + 5` bytes instead of `4 * D` (fp32): 3.7x less memory at head_dim 64. Every key and value
attention reads is the quantized one, the rows of the current call included, so a sequence gives the same
attention whether it was fed in one call or token by token. Each cache declares six tensors: int8 `k_cache`,
float32 `k_scales` and int8 `k_zero_points` (`[B, L, Hkv, 1]`), and the same for v.
"""

from __future__ import annotations

import torch

from etblocks.ops import (
    QuantizedRows,
    concat_rows,
    dequantize_rows,
    dequantize_rows_aten,
    load_quantized_ops,
    quantize_rows,
    quantize_rows_aten,
)
from etblocks.state.io import IOKVCache
from etblocks.state.ring import RingKVCache
from etblocks.state.spec import StateSpec
from etblocks.state.static import StaticKVCache

KV_QUANTIZE = ("int8",)


def int8_specs(specs: list[StateSpec]) -> list[StateSpec]:
    """The int8 form of float `k_cache`, `v_cache` declarations: each as int8 values, float32 scales and int8 zero
    points, one per row and head."""
    int8 = []
    for spec in specs:
        kv = spec.name.removesuffix("_cache")
        per_row = (*spec.shape[:-1], 1)
        int8 += [
            StateSpec(spec.name, spec.shape, torch.int8, spec.update),
            StateSpec(f"{kv}_scales", per_row, torch.float32, spec.update),
            StateSpec(f"{kv}_zero_points", per_row, torch.int8, spec.update),
        ]
    return int8


class _Int8Buffers:
    """Declares a cache's tensors in int8 (a mixin before `StaticKVCache` or `RingKVCache`, whose other buffers
    stay as they are)."""

    def specs(self) -> list[StateSpec]:
        return int8_specs(super().specs())

    @property
    def k_rows(self) -> QuantizedRows:
        return QuantizedRows(self.k_cache, self.k_scales, self.k_zero_points)

    @property
    def v_rows(self) -> QuantizedRows:
        return QuantizedRows(self.v_cache, self.v_scales, self.v_zero_points)


class QuantizedKVCache(_Int8Buffers, StaticKVCache):
    """`StaticKVCache` in int8: position i in row i, written with `llama::update_cache` or `index_copy_`.

    `update` returns the dequantized caches (`dtype`) for any SDPA, or with `dequantize=False` the int8 rows
    themselves (`QuantizedRows`) for `QuantizedCustomSDPA`, which reads them without a float copy.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        use_custom_op: bool = False,
        dequantize: bool = True,
    ) -> None:
        load_quantized_ops()
        super().__init__(max_batch_size, max_seq_len, n_kv_heads, head_dim, dtype, use_custom_op)
        self.dequantize = dequantize

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.write(input_pos, list(zip((*self.k_rows, *self.v_rows), (*quantize_rows(k), *quantize_rows(v)))))
        if not self.dequantize:
            return self.k_rows, self.v_rows, self.positions
        return dequantize_rows(self.k_rows, self.dtype), dequantize_rows(self.v_rows, self.dtype), self.positions


class QuantizedRingKVCache(_Int8Buffers, RingKVCache):
    """`RingKVCache` in int8; `update` returns the dequantized ring and new rows for a position-masked SDPA."""

    def __init__(
        self,
        max_batch_size: int,
        window: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        use_custom_op: bool = False,
        read_filled: bool = False,
    ) -> None:
        load_quantized_ops()
        super().__init__(max_batch_size, window, n_kv_heads, head_dim, dtype, use_custom_op, read_filled)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        new_rows = (*quantize_rows(k), *quantize_rows(v))
        read, k_pos = self.read_then_write(input_pos, list(zip((*self.k_rows, *self.v_rows), new_rows)))
        k_all, v_all = QuantizedRows(*read[:3]), QuantizedRows(*read[3:])
        return dequantize_rows(k_all, self.dtype), dequantize_rows(v_all, self.dtype), k_pos


class QuantizedIOKVCache(IOKVCache):
    """`IOKVCache` in int8: the caller owns, per layer, `k_cache`, `k_scales`, `k_zero_points`, `v_cache`,
    `v_scales`, `v_zero_points` (`[B, S, Hkv, D]` int8, `[B, S, Hkv, 1]` float32 and int8) and gets the new
    rows back in the same six tensors. Attention reads the dequantized caches and new rows (`dtype`). Core aten
    ops only: static programs go to NPU delegates, which know no `quantized_decomposed` op."""

    def __init__(self, n_kv_heads: int, head_dim: int, *, max_seq_len: int | None = None, window: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        load_quantized_ops()
        super().__init__(n_kv_heads, head_dim, max_seq_len=max_seq_len, window=window, dtype=dtype)

    def specs(self) -> list[StateSpec]:
        return int8_specs(super().specs())

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        caches = self.bound()
        k_new, v_new = quantize_rows_aten(k), quantize_rows_aten(v)
        self.emit(*k_new, *v_new)
        k_all = concat_rows(QuantizedRows(*caches[:3]), k_new)
        v_all = concat_rows(QuantizedRows(*caches[3:]), v_new)
        return dequantize_rows_aten(k_all, self.dtype), dequantize_rows_aten(v_all, self.dtype), None
