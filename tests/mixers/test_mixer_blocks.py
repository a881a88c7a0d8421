"""`ShortConv` and `GatedDeltaNet` against the upstream transformers modules (LFM2's `Lfm2ShortConv`, Qwen3.5's
`Qwen3_5GatedDeltaNet`) holding the same weights: a whole prompt in one call, and the same prompt as a prefill
followed by one-token calls carrying the state; both forms of the delta rule, including prompts longer than the
chunked form's 64-token sub-chunks and the dynamic-length form with a fixed number of doublings."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import Lfm2Config, Qwen3_5TextConfig
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, torch_recurrent_gated_delta_rule

from etblocks.mixers import ChunkedDeltaRule, FusedDeltaRule, GatedDeltaNet, ShortConv
from etblocks.mixers.delta_rule import CHUNK
from etblocks.mixers.gated_deltanet import softplus
from etblocks.state import RecurrentState, WindowState

TOL = 1e-4  # relative to the output's largest magnitude, fp32
LENGTH = 150  # three sub-chunks of the chunked form
PREFILL = 100


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def prefill_then_decode(block, x: torch.Tensor) -> torch.Tensor:
    """The block's output over `x [1, T, D]`: the first `PREFILL` tokens in one call, the rest one by one."""
    outputs = [block(x[:, :PREFILL], torch.arange(PREFILL))]
    outputs += [block(x[:, t : t + 1], torch.tensor([t])) for t in range(PREFILL, x.shape[1])]
    return torch.cat(outputs, dim=1)


@pytest.fixture(scope="module")
def deltanet() -> Qwen3_5GatedDeltaNet:
    config = Qwen3_5TextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        num_hidden_layers=2,
    )
    torch.manual_seed(0)
    module = Qwen3_5GatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.3)  # decays and write strengths well away from 0 and 1
    return module


def deltanet_block(upstream: Qwen3_5GatedDeltaNet, rule) -> GatedDeltaNet:
    return GatedDeltaNet(
        upstream.in_proj_qkv, upstream.in_proj_z, upstream.in_proj_b, upstream.in_proj_a, upstream.conv1d,
        upstream.A_log, upstream.dt_bias, upstream.norm, upstream.out_proj,
        n_k_heads=upstream.num_k_heads, n_v_heads=upstream.num_v_heads, k_head_dim=upstream.head_k_dim,
        v_head_dim=upstream.head_v_dim, rule=rule,
    )


@pytest.mark.parametrize("rule", [ChunkedDeltaRule(256), FusedDeltaRule()], ids=["chunked", "fused"])
@torch.no_grad()
def test_gated_deltanet_matches_upstream(deltanet, rule):
    block = deltanet_block(deltanet, rule)
    assert isinstance(block.conv_state, WindowState) and isinstance(block.recurrent_state, RecurrentState)
    x = torch.randn(1, LENGTH, 64, generator=torch.Generator().manual_seed(1))
    expected = deltanet(x)
    assert relative_error(block(x, torch.arange(LENGTH)), expected) <= TOL
    assert relative_error(prefill_then_decode(block, x), expected) <= TOL
    # A call at position 0 starts over: what the last sequence left is not read.
    assert relative_error(block(x[:, :PREFILL], torch.arange(PREFILL)), expected[:, :PREFILL]) <= TOL


@torch.no_grad()
def test_delta_rule_forms_match_the_recurrence():
    """Both forms against upstream's token-by-token recurrence from a non-zero state; the chunked form also with
    the doublings of a longer maximum (what a dynamic-length program runs) and past one sub-chunk."""
    generator = torch.Generator().manual_seed(2)
    b, h, t, dk, dv = 1, 3, CHUNK + 9, 8, 5
    q, k = (F.normalize(torch.randn(b, h, t, dk, generator=generator), dim=-1) for _ in range(2))
    v = torch.randn(b, h, t, dv, generator=generator)
    g = -torch.rand(b, h, t, generator=generator)
    beta = torch.rand(b, h, t, generator=generator)
    state = torch.randn(b, h, dk, dv, generator=generator)
    # Upstream takes [B, T, H, D] and scales q by Dk^-1/2 itself.
    expected, expected_state = torch_recurrent_gated_delta_rule(
        *(x.transpose(1, 2) for x in (q * dk**0.5, k, v, g, beta)), initial_state=state, output_final_state=True
    )
    forms = {
        "fused": FusedDeltaRule()(q, k, v, g, beta, state),
        "chunked": ChunkedDeltaRule(t)(q, k, v, g, beta, state),
        "one chunk, 2048-token doublings": ChunkedDeltaRule.chunk(q, k, v, g, beta, state, steps=11),
    }
    for name, (o, new_state) in forms.items():
        assert relative_error(o.transpose(1, 2), expected) <= TOL, name
        assert relative_error(new_state, expected_state) <= TOL, name


def test_softplus_is_torchs():
    x = torch.linspace(-100, 100, 2001)
    assert torch.allclose(softplus(x), F.softplus(x), rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_short_conv_matches_upstream():
    config = Lfm2Config(hidden_size=32, conv_L_cache=3, layer_types=["conv", "full_attention"], num_hidden_layers=2, conv_bias=True)
    torch.manual_seed(3)
    upstream = Lfm2ShortConv(config, 0).eval()
    block = ShortConv(upstream.in_proj, upstream.conv, upstream.out_proj)
    assert block.conv_state.specs()[0].shape == (1, 2, 32)  # the last L_cache - 1 gated inputs
    x = torch.randn(1, LENGTH, 32, generator=torch.Generator().manual_seed(4))
    expected = upstream(x)
    assert relative_error(block(x, torch.arange(LENGTH)), expected) <= TOL
    assert relative_error(prefill_then_decode(block, x), expected) <= TOL


def test_short_conv_refuses_a_dense_convolution():
    conv = torch.nn.Conv1d(8, 8, 3, groups=1)
    with pytest.raises(ValueError, match="depthwise"):
        ShortConv(torch.nn.Linear(8, 24), conv, torch.nn.Linear(8, 8))
