"""Asymmetric int4 weights (a scale and a low value per group, as GGUF's Q4_1 and Q4_K blocks) on XNNPACK, whose
int4 GEMM is symmetric (one scale per group, no zero point).

A group's weights `w = scale * q + low` (q in 0..15) are `scale * (q - 8) + centre` with `centre = low + 8 * scale`,
so `w . x` is a symmetric int4 product plus, per group, `centre` times the sum of the group's inputs: two XNNPACK
GEMMs (`AsymmetricInt4Linear`). Weights that were int4 groups already (a GGUF file's Q4_0, Q4_1, Q4_K blocks as
transformers dequantizes them, found by `on_grid`) keep their values, where a symmetric scheme would round them a
second time; other weights get the min-max rounding GGUF's Q4_1 makes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

LEVELS = 16  # int4
MIDDLE = 8  # q - MIDDLE is XNNPACK's symmetric int4 in [-8, 7]
INT8_MAX = 127  # the centres are symmetric int8 per output row


@dataclass(frozen=True)
class Int4Groups:
    """`weight [out, in] ~= scale * q + low` per group of `group` inputs: `q` int8 in 0..15 `[out, in]`, `scale` and
    `low` float32 `[out, in // group]`."""

    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    group: int

    def dequantized(self) -> torch.Tensor:
        out, width = self.q.shape
        values = self.q.reshape(out, -1, self.group).float() * self.scale[..., None] + self.low[..., None]
        return values.reshape(out, width)


def on_grid(weight: torch.Tensor, group: int) -> Int4Groups | None:
    """The int4 groups `weight` already is, if each group of `group` inputs holds at most 16 equally spaced values
    (a GGUF Q4_0 / Q4_1 / Q4_K tensor as transformers dequantizes it); None otherwise.

    A group's step is the smallest gap between its distinct values; a group whose values do not all sit on
    `low + step * q` with q <= 15 (within 16 float32 roundings of its largest magnitude) makes the tensor off the grid."""
    grouped = _grouped(weight.detach().float(), group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    span = high - low
    ordered = grouped.sort(-1).values
    gaps = ordered.diff(dim=-1)
    distinct = gaps > span[..., None] * 1e-4
    step = torch.where(distinct, gaps, torch.full_like(gaps, float("inf"))).amin(-1)
    step = torch.where(torch.isfinite(step), step, torch.ones_like(step))  # a constant group: any step holds it
    step = torch.where(span > 0, span / torch.round(span / step).clamp(min=1), step)  # from the span: less rounding
    q = torch.round((grouped - low[..., None]) / step[..., None])
    error = (low[..., None] + q * step[..., None] - grouped).abs().amax(-1)
    tolerance = grouped.abs().amax(-1) * 16 * torch.finfo(torch.float32).eps
    if not bool(((q.amax(-1) <= LEVELS - 1) & (error <= tolerance)).all()):
        return None
    return Int4Groups(q.to(torch.int8).reshape(weight.shape), step, low, group)


def min_max_groups(weight: torch.Tensor, group: int) -> Int4Groups:
    """`weight` rounded to int4 groups spanning each group's minimum to maximum (GGUF's Q4_1 rounding)."""
    grouped = _grouped(weight.detach().float(), group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / (LEVELS - 1)).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.clamp(torch.round((grouped - low[..., None]) / scale[..., None]), 0, LEVELS - 1)
    return Int4Groups(q.to(torch.int8).reshape(weight.shape), scale, low, group)


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    out, width = weight.shape
    return weight.reshape(out, width // group, group)


@functools.lru_cache(maxsize=None)
def _sum_matrix(in_features: int, group: int) -> torch.Tensor:
    """`[in // group, in]` 0/1: row g sums group g's inputs. One tensor per shape, shared by every linear of that
    width (and stored once in a program: XNNPACK names constants by their bytes' hash)."""
    rows = torch.zeros(in_features // group, in_features)
    for g in range(in_features // group):
        rows[g, g * group : (g + 1) * group] = 1.0
    return rows


class AsymmetricInt4Linear(nn.Module):
    """`forward(x [..., in]) -> [..., out]`: a linear whose weight is `groups` (asymmetric int4 `scale * q + low`),
    as XNNPACK's kernels run it: the symmetric int4 GEMM of `q - 8` plus the product of the input's group sums
    with each group's centre (`low + 8 * scale`), both GEMMs with int8 dynamically quantized activations
    (torchao's `IntxUnpackedToInt8Tensor`, the pattern XNNPACK's partitioner takes), the centres int8 per output
    row; the group sums are an fp32 product with a fixed 0/1 matrix."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None) -> None:
        super().__init__()
        out, width = groups.q.shape
        scale = groups.scale.to(torch.bfloat16).float()  # XNNPACK's int4 GEMM stores group scales as bf16
        symmetric = groups.q.float().reshape(out, -1, groups.group) - MIDDLE
        # low + 8 * scale, less the mean of the bf16 rounding over the group (what is left is at most 1.6% of a step)
        centre = (groups.dequantized().reshape(out, -1, groups.group) - scale[..., None] * symmetric).mean(-1)
        self.weight = nn.Parameter(intx_tensor(symmetric.reshape(out, width), scale, torch.int4, groups.group), requires_grad=False)
        centre_scale = (centre.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        centre_q = torch.clamp(torch.round(centre / centre_scale), -INT8_MAX, INT8_MAX)
        self.centres = nn.Parameter(intx_tensor(centre_q, centre_scale, torch.int8, centre.shape[1]), requires_grad=False)
        self.register_buffer("sums", _sum_matrix(width, groups.group), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = nn.functional.linear(nn.functional.linear(x, self.sums), self.centres)
        return nn.functional.linear(x, self.weight, self.bias) + centred


def intx_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group: int) -> torch.Tensor:
    """torchao's weight tensor of symmetric integers `q [out, in]` (values of `dtype`) with one `scale` per `group`
    inputs, whose linear quantizes its input to int8 per token: what XNNPACK runs as a dynamically quantized GEMM."""
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8Tensor,
        IntxUnpackedToInt8TensorActivationQuantization,
    )

    return IntxUnpackedToInt8Tensor(
        q.to(torch.int8), scale, torch.zeros_like(scale, dtype=torch.int8), dtype, (1, group), torch.float32,
        IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN,
    )
