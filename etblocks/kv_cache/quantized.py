"""Int8 KV caches: ExecuTorch's scheme (asymmetric int8, one scale and zero point per token and KV head), in
place, as a ring, or caller-owned.

A cache row costs `D + 5` bytes instead of `4 * D` (fp32): 3.8x less memory at head_dim 64. Every key and value
attention reads is the quantized one, the rows of the current call included, so a sequence gives the same
attention whether it was fed in one call or token by token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from etblocks.kv_cache.io import IOKVCache
from etblocks.kv_cache.ring import RingKVCache
from etblocks.kv_cache.static import StaticKVCache

KV_QUANTIZE = ("int8",)
QMIN, QMAX = -128, 127


def load_quantized_ops() -> None:
    """Register ExecuTorch's `quantized_decomposed` ops: their out variants with torch (for export) and their
    kernels with the Python runtime (a program using them fails to load before this import)."""
    import executorch.kernels.quantized  # noqa: F401


class QuantizedRows(NamedTuple):
    """Int8 rows `values [B, S, H, D]` with `scales` (float32) and `zero_points` (int8), each `[B, S, H, 1]`."""

    values: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """Asymmetric int8 over the last dim of `x`, one scale and zero point per row."""
    x = x.float()
    scales, zero_points = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    values = torch.ops.quantized_decomposed.quantize_per_token(x, scales, zero_points, QMIN, QMAX, torch.int8)
    return QuantizedRows(values, scales.to(torch.float32), zero_points.to(torch.int8))


def dequantize_rows(rows: QuantizedRows, dtype: torch.dtype) -> torch.Tensor:
    values = torch.ops.quantized_decomposed.dequantize_per_token(
        rows.values, rows.scales, rows.zero_points.to(torch.int64), QMIN, QMAX, torch.int8, torch.float32
    )
    return values.to(dtype)


def quantize_rows_aten(x: torch.Tensor) -> QuantizedRows:
    """`quantize_rows` in core aten ops, for programs whose delegates know no `quantized_decomposed` op (Core ML,
    OpenVINO, Vulkan). ExecuTorch's reference implementation in float32 with two simplifications that delegates
    take: the zero point from the minimum only (the one from the maximum equals it whenever the range is not
    below float32's eps), and rounding half up (`floor(x + 0.5)`; `round` is half to even)."""
    x = x.float()
    low = torch.clamp(torch.amin(x, dim=-1, keepdim=True), max=0.0)
    high = torch.clamp(torch.amax(x, dim=-1, keepdim=True), min=0.0)
    scales = torch.clamp((high - low) / float(QMAX - QMIN), min=torch.finfo(torch.float32).eps)
    zero_points = torch.floor(torch.clamp(QMIN - low / scales, QMIN, QMAX) + 0.5)
    values = torch.clamp(torch.floor(x / scales + zero_points + 0.5), QMIN, QMAX).to(torch.int8)
    return QuantizedRows(values, scales, zero_points.to(torch.int8))


def dequantize_rows_aten(rows: QuantizedRows, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_rows` in core aten ops."""
    return ((rows.values.float() - rows.zero_points.float()) * rows.scales).to(dtype)


def concat_rows(cached: QuantizedRows, new: QuantizedRows) -> QuantizedRows:
    return QuantizedRows(*(torch.cat(pair, dim=1) for pair in zip(cached, new)))


class _Int8Buffers:
    """Makes a cache's `k_cache`/`v_cache` int8 and adds their scale and zero-point buffers (a mixin before
    `StaticKVCache` or `RingKVCache`, whose other buffers stay as they are)."""

    def _allocate(self, length: int) -> None:
        super()._allocate(length)
        shape = (self.max_batch_size, length, self.n_kv_heads)
        for name, dim in (("k", self.head_dim), ("v", self.v_head_dim)):
            self.register_buffer(f"{name}_cache", torch.zeros(*shape, dim, dtype=torch.int8), persistent=False)
            self.register_buffer(f"{name}_scales", torch.zeros(*shape, 1), persistent=False)
            self.register_buffer(f"{name}_zero_points", torch.zeros(*shape, 1, dtype=torch.int8), persistent=False)

    def reset(self) -> None:
        super().reset()
        for buffer in (self.k_scales, self.k_zero_points, self.v_scales, self.v_zero_points):
            buffer.zero_()

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
        self, max_batch_size: int, window: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32
    ) -> None:
        load_quantized_ops()
        super().__init__(max_batch_size, window, n_kv_heads, head_dim, dtype)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        k_all, v_all = concat_rows(self.k_rows, quantize_rows(k)), concat_rows(self.v_rows, quantize_rows(v))
        k_pos = self.write_ring(input_pos, list(zip((*self.k_rows, *self.v_rows), (*k_all, *v_all))))
        return dequantize_rows(k_all, self.dtype), dequantize_rows(v_all, self.dtype), k_pos


class QuantizedIOKVCache(IOKVCache):
    """`IOKVCache` in int8: the caller owns, per layer, `k_cache`, `k_scales`, `k_zero_points`, `v_cache`,
    `v_scales`, `v_zero_points` (`[B, S, Hkv, D]` int8, `[B, S, Hkv, 1]` float32 and int8) and gets the new
    rows back in the same six tensors. Attention reads the dequantized caches and new rows (`dtype`). Core aten
    ops only: static programs go to NPU delegates, which know no `quantized_decomposed` op."""

    kv_quantize = "int8"

    def __init__(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> None:
        load_quantized_ops()
        super().__init__(n_kv_heads, head_dim)
        self.dtype = dtype

    def update(self, k: torch.Tensor, v: torch.Tensor, *caches: torch.Tensor):
        k_new, v_new = quantize_rows_aten(k), quantize_rows_aten(v)
        k_all = concat_rows(QuantizedRows(*caches[:3]), k_new)
        v_all = concat_rows(QuantizedRows(*caches[3:]), v_new)
        return dequantize_rows_aten(k_all, self.dtype), dequantize_rows_aten(v_all, self.dtype), (*k_new, *v_new)
