"""The kernels etblocks programs call outside ExecuTorch's portable set, and ExecuTorch's int8 row scheme.

The bottom of the package: it imports nothing of etblocks. Loading a kernel module registers its ops with torch
(for export) and its kernels with this process's ExecuTorch runtime (a program calling one fails to load before).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

QMIN, QMAX = -128, 127


def load_llama_custom_ops() -> None:
    """Register `llama::custom_sdpa`, `llama::update_cache`, their quantized forms and `llama::gated_delta_rule`."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401


def load_quantized_ops() -> None:
    """Register the `quantized_decomposed` ops (int8 rows, the int8 embedding): their definitions are torch's,
    ExecuTorch's kernels library adds only its out-variants, so a process that imported nothing else that defines
    them (torchao does) would find `choose_qparams_per_token_asymmetric` without its default overload."""
    import executorch.kernels.quantized  # noqa: F401
    import torch.ao.quantization.fx._decomposed  # noqa: F401


def load_kernels() -> None:
    """Every kernel an etblocks program may call: the llama custom ops and `quantized_decomposed`."""
    load_llama_custom_ops()
    load_quantized_ops()


class QuantizedRows(NamedTuple):
    """Int8 rows `values [B, S, H, D]` with `scales` (float32) and `zero_points` (int8), each `[B, S, H, 1]`."""

    values: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """Asymmetric int8 over the last dim of `x`, one scale and zero point per row (ExecuTorch's scheme)."""
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
