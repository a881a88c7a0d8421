"""Asymmetric int4 groups (`etblocks.export.int4`) against GGUF's own block formats, made and read by the `gguf`
package (llama.cpp's Python reference of Q4_0, Q4_1, Q4_K, Q5_0, Q8_0).

Reference: `gguf.quants.quantize` / `dequantize`, and for Q4_K (which has no Python quantizer) random blocks
dequantized by it. Code under test: `on_grid`, `min_max_groups`, `AsymmetricInt4Linear` in eager mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from etblocks.export.int4 import AsymmetricInt4Linear, min_max_groups, on_grid

gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) makes the reference blocks")

SHAPE = (48, 256)  # one Q4_K super-block of 256 per row


def gguf_values(kind: str, weight: np.ndarray) -> torch.Tensor:
    """`weight` as a GGUF tensor of `kind` holds it, dequantized (what transformers' GGUF loader yields)."""
    kind = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight, kind), kind).reshape(weight.shape))


def random_q4_k(rows: int, seed: int = 0) -> torch.Tensor:
    """A random Q4_K tensor (super-blocks of 256: f16 scale and min, 6-bit sub-block scales and mins, 4-bit q)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.array([0.01, 0.02], dtype=np.float16).view(np.uint8)  # d and dmin, finite
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    return torch.from_numpy(values.reshape(rows, 256).astype(np.float32))


@pytest.fixture(scope="module")
def weight() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32) * 0.05


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_int4_blocks_are_kept_exactly(weight, kind):
    values = gguf_values(kind, weight)
    groups = on_grid(values, 32)
    assert groups is not None
    assert int(groups.q.min()) >= 0 and int(groups.q.max()) <= 15
    torch.testing.assert_close(groups.dequantized(), values, rtol=0, atol=1e-6 * float(values.abs().max()))


def test_q4_k_sub_blocks_are_kept_exactly():
    values = random_q4_k(SHAPE[0])
    groups = on_grid(values, 32)
    assert groups is not None
    torch.testing.assert_close(groups.dequantized(), values, rtol=0, atol=1e-6 * float(values.abs().max()))


@pytest.mark.parametrize("kind", ["Q5_0", "Q8_0", None])
def test_other_weights_are_not_taken_for_int4(weight, kind):
    values = torch.from_numpy(weight) if kind is None else gguf_values(kind, weight)
    assert on_grid(values, 32) is None


def test_min_max_rounding_is_gguf_q4_1(weight):
    """GGUF's Q4_1 rounds each block of 32 from its minimum in 15 steps to its maximum, as `min_max_groups`."""
    ours = min_max_groups(torch.from_numpy(weight), 32).dequantized()
    theirs = gguf_values("Q4_1", weight)
    step = float((torch.from_numpy(weight).abs().max()) * 2 / 15)
    # Q4_1 stores its scale and minimum as fp16, which moves a value by a small part of a step
    assert (ours - theirs).abs().max() <= 0.05 * step


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric int8 per row of `x`, dequantized: the activations of an 8da GEMM."""
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = (high - low) / 255
    zero = torch.round(-128 - low / scale)
    return (torch.clamp(torch.round(x / scale) + zero, -128, 127) - zero) * scale


@pytest.mark.parametrize("source", ["Q4_1", "Q4_K"])
def test_linear_computes_the_gguf_weights(weight, source):
    """The two GEMMs equal the dequantized GGUF weight times int8 activations, up to the int8 rounding of the
    group sums and of the centres: under 1% of an output's largest for Q4_1 blocks, 2% for random Q4_K blocks,
    whose minimums (6-bit multiples of a second scale) reach far more steps than a real model's."""
    values = gguf_values("Q4_1", weight) if source == "Q4_1" else random_q4_k(SHAPE[0])
    bias = torch.randn(SHAPE[0])
    linear = AsymmetricInt4Linear(on_grid(values, 32), bias)
    x = torch.randn(5, SHAPE[1])
    with torch.no_grad():
        got = linear(x)
    expected = torch.nn.functional.linear(per_token_int8(x), values, bias)
    error = (got - expected).abs().amax(-1) / expected.abs().amax(-1)
    assert error.max() <= (0.01 if source == "Q4_1" else 0.02), error
    assert linear.weight.qdata.min() >= -8 and linear.weight.qdata.max() <= 7  # XNNPACK's symmetric int4
