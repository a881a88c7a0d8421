"""`Mamba2` against transformers' Mamba2 mixer (Granite 4.0-H's `GraniteMoeHybridMambaLayer`) holding the same
weights: a whole prompt in one call (upstream's chunked scan over several of its chunks), the same prompt as a
prefill then one-token calls carrying the state (the recurrent step), and calls of mixed lengths; the two scan
forms against upstream's own token-by-token `mamba2_selective_state_update` from a non-zero state; padding."""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
    mamba2_selective_state_update,
)

from etblocks.mixers import GroupedGatedRMSNorm, Mamba2
from etblocks.mixers.mamba2 import ssd_block, ssd_scan, ssd_step
from etblocks.state import RecurrentState, WindowState

TOL = 1e-4  # relative to the output's largest magnitude, fp32
LENGTH = 150  # upstream chunks of 16 and two of our static sub-chunks of 64 and a partial one
PREFILL = 100
HEADS, GROUPS, STATE = 4, 2, 8


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module")
def upstream() -> GraniteMoeHybridMambaLayer:
    config = GraniteMoeHybridConfig(
        hidden_size=32, mamba_n_heads=HEADS, mamba_n_groups=GROUPS, mamba_d_state=STATE, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, num_hidden_layers=1, layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    module = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.3)
        module.A_log.copy_(torch.linspace(-1.0, 1.0, HEADS))  # decays from slow to fast
    return module


def block_of(upstream: GraniteMoeHybridMambaLayer, **options) -> Mamba2:
    return Mamba2(
        upstream.in_proj, upstream.conv1d, upstream.A_log, upstream.D, upstream.dt_bias, upstream.norm,
        upstream.out_proj, n_heads=upstream.num_heads, head_dim=upstream.head_dim, n_groups=upstream.n_groups,
        state_size=upstream.ssm_state_size, time_step_limit=upstream.time_step_limit, **options,
    )


def run_calls(block: Mamba2, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    outputs, start = [], 0
    for length in lengths:
        outputs.append(block(x[:, start : start + length], torch.arange(start, start + length)))
        start += length
    return torch.cat(outputs, dim=1)


@torch.no_grad()
def test_mamba2_matches_upstream(upstream):
    block = block_of(upstream)
    assert isinstance(block.conv_state, WindowState) and isinstance(block.ssm_state, RecurrentState)
    x = torch.randn(1, LENGTH, 32, generator=torch.Generator().manual_seed(1))
    expected = upstream(x)
    assert relative_error(block(x, torch.arange(LENGTH)), expected) <= TOL
    assert relative_error(run_calls(block, x, [PREFILL] + [1] * (LENGTH - PREFILL)), expected) <= TOL
    assert relative_error(run_calls(block, x, [5, 1, 17, 2, 1, 70, 54]), expected) <= TOL
    # A call at position 0 starts over: what the last sequence left is not read.
    assert relative_error(block(x[:, :PREFILL], torch.arange(PREFILL)), expected[:, :PREFILL]) <= TOL


@torch.no_grad()
def test_scan_forms_match_upstreams_recurrence():
    """`ssd_scan` over a call (sub-chunks of 64 and a partial one), the one-block form a dynamic length runs (exact
    sums) and `ssd_step` token by token, all from a non-zero state, against upstream's single-token kernel (which
    also takes the `D` skip, given here as 0)."""
    generator = torch.Generator().manual_seed(2)
    b, t, p = 1, 101, 6
    x = torch.randn(b, t, HEADS, p, generator=generator)
    dt = torch.nn.functional.softplus(torch.randn(b, t, HEADS, generator=generator))
    A = -torch.rand(HEADS, generator=generator) * 2
    B, C = (torch.randn(b, t, GROUPS, STATE, generator=generator) for _ in range(2))
    initial = torch.randn(b, HEADS, p, STATE, generator=generator)
    expected, state = [], initial.clone()
    for i in range(t):
        expected.append(mamba2_selective_state_update(
            state, x[:, i], dt[:, i, :, None].expand(-1, -1, p), A[:, None, None].expand(-1, p, STATE),
            B[:, i], C[:, i], torch.zeros(HEADS, p),
        ))
    expected = torch.stack(expected, dim=1)
    for y, final in (ssd_scan(x, dt, A, B, C, initial), ssd_block(x, dt, A, B, C, initial, exact_sums=True)):
        assert relative_error(y, expected) <= TOL and relative_error(final, state) <= TOL
    stepped, carried = [], initial
    for i in range(t):
        y_i, carried = ssd_step(x[:, i : i + 1], dt[:, i : i + 1], A, B[:, i : i + 1], C[:, i : i + 1], carried)
        stepped.append(y_i)
    assert relative_error(torch.cat(stepped, dim=1), expected) <= TOL and relative_error(carried, state) <= TOL


@torch.no_grad()
def test_padding_leaves_the_state_as_the_real_tokens_did(upstream):
    """Caller-owned, tokens at position -1 neither decay nor write the SSM state (static programs pad calls)."""
    block = block_of(upstream, caller_owned=True)
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(3))
    conv = torch.zeros(1, 3, block.conv_state.row_shape[0])
    ssm = torch.zeros(1, HEADS, block.head_dim, STATE)

    def call(rows, positions):
        block.conv_state.bind([conv]), block.ssm_state.bind([ssm])
        try:
            return block(rows, positions), block.conv_state.take(), block.ssm_state.take()
        finally:
            block.conv_state.unbind(), block.ssm_state.unbind()

    padded = torch.cat((x[:, :5], torch.zeros(1, 3, 32)), dim=1)
    y_padded, _, (ssm_padded,) = call(padded, torch.tensor([0, 1, 2, 3, 4, -1, -1, -1]))
    y_real, _, (ssm_real,) = call(x[:, :5], torch.arange(5))
    assert torch.allclose(y_padded[:, :5], y_real, atol=1e-6)
    assert torch.allclose(ssm_padded, ssm_real, atol=1e-6)


def test_refuses_parameters_of_the_wrong_shape(upstream):
    with pytest.raises(ValueError, match=r"A_log must have shape \[4\]"):
        Mamba2(
            upstream.in_proj, upstream.conv1d, torch.nn.Parameter(torch.zeros(3)), upstream.D, upstream.dt_bias,
            upstream.norm, upstream.out_proj, n_heads=HEADS, head_dim=upstream.head_dim, n_groups=GROUPS, state_size=STATE,
        )
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_groups=3"):
        Mamba2(
            upstream.in_proj, upstream.conv1d, upstream.A_log, upstream.D, upstream.dt_bias, upstream.norm,
            upstream.out_proj, n_heads=HEADS, head_dim=upstream.head_dim, n_groups=3, state_size=STATE,
        )


@torch.no_grad()
def test_grouped_gated_norm_matches_upstreams(upstream):
    """The norm the converter puts in (weight before the scale, so QNN's RMSNorm recomposition leaves it per group)
    against upstream's `GraniteMoeHybridRMSNormGated` over 2 groups."""
    norm = GroupedGatedRMSNorm(upstream.norm.weight, GROUPS, upstream.norm.variance_epsilon)
    generator = torch.Generator().manual_seed(4)
    x, gate = (torch.randn(1, 7, upstream.intermediate_size, generator=generator) for _ in range(2))
    assert relative_error(norm(x, gate), upstream.norm(x, gate)) <= 1e-6
    whole_width = GroupedGatedRMSNorm(upstream.norm.weight, 1, upstream.norm.variance_epsilon)
    assert relative_error(whole_width(x, gate), upstream.norm(x, gate)) > 1e-3  # the groups matter
