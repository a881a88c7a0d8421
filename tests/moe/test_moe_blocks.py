"""MoE blocks against transformers' own routers and MoE blocks (fp32, atol 1e-5), for both strategies, and what
each strategy leaves on CPU after XNNPACK lowering."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from transformers import AutoConfig
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as deepseek_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek_v3
from transformers.models.gemma4 import modeling_gemma4 as gemma4
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
from transformers.models.mixtral import modeling_mixtral as mixtral
from transformers.models.olmoe import modeling_olmoe as olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

from etblocks.export.delegation import summarize
from etblocks.moe import DenseExperts, GatherExperts, GroupedTopKRouter, MoE, SwiGLU, TopKRouter
from etblocks.moe.router import kth_largest
from etblocks.swap.hf.moe import MOE_FAMILIES, convert_generic_experts, generic_experts_layout
from etblocks.swap.recipes import resolve_recipe
from etblocks.swap.registry import SwapContext

ATOL = 1e-5
D, E, K = 32, 8, 2
STRATEGIES = ("dense", "gather")

# model_type -> (upstream MoE class, config overrides)
UPSTREAM = {
    "mixtral": (mixtral.MixtralSparseMoeBlock, dict(num_local_experts=E, intermediate_size=24)),
    "qwen2_moe": (
        qwen2_moe.Qwen2MoeSparseMoeBlock,
        dict(num_experts=E, moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=False),
    ),
    "qwen3_moe": (qwen3_moe.Qwen3MoeSparseMoeBlock, dict(num_experts=E, moe_intermediate_size=24, norm_topk_prob=True)),
    "olmoe": (olmoe.OlmoeSparseMoeBlock, dict(num_experts=E, intermediate_size=24)),
    "deepseek_v2": (
        deepseek_v2.DeepseekV2Moe,
        dict(
            n_routed_experts=E, moe_intermediate_size=24, n_group=4, topk_group=2, topk_method="group_limited_greedy",
            n_shared_experts=1, routed_scaling_factor=1.5,
        ),
    ),
    "deepseek_v3": (
        deepseek_v3.DeepseekV3MoE,
        dict(n_routed_experts=E, moe_intermediate_size=24, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5),
    ),
    "gpt_oss": (gpt_oss.GptOssMLP, dict(num_local_experts=E, intermediate_size=24)),
}
# Families whose own router sits in front of transformers' generic experts, converted whole (their routers in
# etblocks' form, so the dense strategy holds no int64 index): model_type -> (block class name, config overrides)
ROUTED = {
    "glm4_moe": ("Glm4MoeMoE", dict(n_routed_experts=E, moe_intermediate_size=24, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)),
    "dots1": ("Dots1MoE", dict(n_routed_experts=E, moe_intermediate_size=24, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)),
    "solar_open": ("SolarOpenMoE", dict(n_routed_experts=E, moe_intermediate_size=24, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5)),
    "exaone_moe": ("ExaoneMoeSparseMoEBlock", dict(num_experts=E, moe_intermediate_size=24, n_group=2, topk_group=1, num_shared_experts=1, routed_scaling_factor=2.5)),
    "ernie4_5_moe": ("Ernie4_5_MoeSparseMoeBlock", dict(moe_num_experts=E, moe_k=K, moe_intermediate_size=24, moe_num_shared_experts=1)),
    "lfm2_moe": ("Lfm2MoeSparseMoeBlock", dict(num_experts=E, moe_intermediate_size=24, routed_scaling_factor=1.5, norm_topk_prob=True)),
    "minimax_m2": ("MiniMaxM2SparseMoeBlock", dict(num_local_experts=E, intermediate_size=24)),
    "hy_v3": ("HYV3MoE", dict(num_local_experts=E, moe_intermediate_size=24, num_shared_experts=1, router_scaling_factor=2.5)),
    "afmoe": ("AfmoeSparseMoeBlock", dict(num_experts=E, moe_intermediate_size=24, num_shared_experts=1, route_scale=1.5)),
    "flint": ("FlintSparseMoeBlock", dict(num_experts=E, moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=True)),
    "flex_olmo": ("FlexOlmoSparseMoeBlock", dict(num_experts=E, intermediate_size=24, norm_topk_prob=False)),
    "mellum": ("MellumSparseMoeBlock", dict(num_experts=E, moe_intermediate_size=24, norm_topk_prob=True)),
    "lara_mini": ("LaraMiniSparseMoeBlock", dict(num_experts=E, moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=True)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Moe", dict(num_experts=E, moe_topk=K, intermediate_size=24)),
    "granitemoe_swa": ("GraniteMoeSWAMoE", dict(num_local_experts=E, intermediate_size=24)),
}


def upstream_moe(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A transformers MoE block with every parameter and buffer random (std 0.5), so routing and biases matter."""
    if model_type in ROUTED:
        name, overrides = ROUTED[model_type]
        cls = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), name)
    else:
        cls, overrides = UPSTREAM[model_type]
    config = AutoConfig.for_model(model_type, hidden_size=D, num_experts_per_tok=K, **overrides)
    return upstream_moe_from(cls, config, seed)


def upstream_moe_from(cls: type, config, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = cls(config).eval()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.normal_(0, 0.5)
    return module


def convert(module: torch.nn.Module, model_type: str, strategy: str) -> MoE:
    ctx = SwapContext(recipe=resolve_recipe("xnnpack", moe=strategy), max_seq_len=64)
    return MOE_FAMILIES[model_type][1](copy.deepcopy(module), ctx)


def first(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_type", sorted([*UPSTREAM, *ROUTED]))
def test_moe_matches_upstream(model_type, strategy):
    upstream = upstream_moe(model_type)
    block = convert(upstream, model_type, strategy)
    assert isinstance(block.experts, DenseExperts if strategy == "dense" else GatherExperts)
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        expected, actual = first(upstream(x)), first(block(x))
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= ATOL * max(1.0, expected.abs().max().item())


def _dense(router_output) -> torch.Tensor:
    """Top-k `(weights, indices)` as `[N, E]`: independent of the order topk returns them in."""
    weights, indices = router_output
    return torch.zeros(indices.shape[0], E).scatter(1, indices, weights.float())


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_generic_experts_match_upstream_experts(model_type, strategy):
    """transformers' generic experts module converted without its family's converter, called as upstream calls it
    (`experts(x, top_k_index, top_k_weights)`): Mixtral's layout (`[gate; up]`, default gate) and GPT-OSS's
    (interleaved, transposed, biased, its own clamped gate through `UpstreamGate`)."""
    experts = upstream_moe(model_type).experts
    assert generic_experts_layout(experts) is convert_generic_experts
    ctx = SwapContext(recipe=resolve_recipe("xnnpack", moe=strategy), max_seq_len=64)
    converted = convert_generic_experts(experts, ctx)
    assert converted.experts.strategy == strategy
    assert not any(type(m).__module__.startswith("transformers") and any(m.parameters()) for m in converted.modules())
    torch.manual_seed(1)
    x = torch.randn(6, D)
    weights, index = torch.randn(6, E).softmax(-1).topk(K)
    with torch.no_grad():
        torch.testing.assert_close(converted(x, index, weights), experts(x, index, weights), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "upstream_cls, model_type, renormalize",
    [
        (mixtral.MixtralTopKRouter, "mixtral", True),
        (qwen2_moe.Qwen2MoeTopKRouter, "qwen2_moe", False),
        (gpt_oss.GptOssTopKRouter, "gpt_oss", True),
    ],
)
def test_softmax_router_matches_upstream(upstream_cls, model_type, renormalize):
    config = AutoConfig.for_model(model_type, hidden_size=D, num_experts_per_tok=K, num_local_experts=E, num_experts=E)
    torch.manual_seed(1)
    upstream = upstream_cls(config)
    with torch.no_grad():
        for p in upstream.parameters():
            p.normal_(0, 0.5)
    router = TopKRouter(upstream.weight, K, bias=getattr(upstream, "bias", None), renormalize=renormalize)
    x = torch.randn(16, D)
    with torch.no_grad():
        _, weights, indices = upstream(x)
        expected = _dense((weights, indices))
        actual = _dense(router(x))
        dense = router.dense_weights(x)
    for form in (actual, dense):
        assert torch.equal(form > 0, expected > 0)  # the same experts
        assert (form - expected).abs().max().item() <= ATOL
    if renormalize:
        assert torch.allclose(actual.sum(-1), torch.ones(16))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gemma4_router_and_experts_match_upstream(strategy):
    """Gemma 4's layer calls its router and its generic experts apart: the converted router (scaled input, top-k
    renormalised, times `per_expert_scale`) feeds the converted experts in either form, and the dense form hands
    them no index at all. Upstream's parameters are all random, `per_expert_scale` included."""
    config = AutoConfig.for_model("gemma4_text", hidden_size=D, num_experts=E, top_k_experts=K, moe_intermediate_size=24, enable_moe_block=True)
    torch.manual_seed(6)
    router, experts = gemma4.Gemma4TextRouter(config), gemma4.Gemma4TextExperts(config)
    with torch.no_grad():
        for p in [*router.parameters(), *experts.parameters()]:
            p.normal_(0, 0.5)
    ctx = SwapContext(recipe=resolve_recipe("xnnpack", moe=strategy), max_seq_len=64)
    new_router = MOE_FAMILIES["gemma4"][1](router, ctx)
    new_experts = convert_generic_experts(experts, ctx)
    x = torch.randn(16, D)
    with torch.no_grad():
        probabilities, weights, index = router(x)
        expected = experts(x, index, weights)
        new_probabilities, new_weights, new_index = new_router(x)
        actual = new_experts(x, new_index, new_weights)
    torch.testing.assert_close(new_probabilities, probabilities, atol=ATOL, rtol=0)
    if strategy == "dense":
        assert new_index is None and new_weights.shape == (16, E)
        assert (new_weights - _dense((weights, index))).abs().max().item() <= ATOL
    else:
        assert (_dense((new_weights, new_index)) - _dense((weights, index))).abs().max().item() <= ATOL
    assert not torch.allclose(router.per_expert_scale, torch.ones(E))
    assert (actual - expected).abs().max().item() <= ATOL * max(1.0, expected.abs().max().item())


def test_grouped_router_matches_upstream_and_keeps_to_chosen_groups():
    config = AutoConfig.for_model(
        "deepseek_v3", hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    torch.manual_seed(2)
    upstream = deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        upstream.weight.normal_(0, 0.5)
        upstream.e_score_correction_bias.normal_(0, 1.0)  # large enough to change choices
    router = GroupedTopKRouter(
        upstream.weight, upstream.e_score_correction_bias, K, n_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5
    )
    x = torch.randn(32, D)
    with torch.no_grad():
        _, weights, indices = upstream(x)
        expected, actual, dense = _dense((weights, indices)), _dense(router(x)), router.dense_weights(x)
        plain = torch.sigmoid(x @ upstream.weight.T).topk(K).indices
    for form in (actual, dense):
        assert torch.equal(form > 0, expected > 0)
        assert (form - expected).abs().max().item() <= ATOL
    assert not torch.equal(torch.sort(plain).values, torch.sort(router(x)[1]).values), "bias and groups never mattered"


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router_matches_upstream(topk_method):
    config = AutoConfig.for_model(
        "deepseek_v2", hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
        topk_method=topk_method, routed_scaling_factor=1.5,
    )
    torch.manual_seed(5)
    upstream = deepseek_v2.DeepseekV2TopkRouter(config)
    with torch.no_grad():
        upstream.weight.normal_(0, 0.5)
    block = convert(upstream_moe_from(deepseek_v2.DeepseekV2Moe, config), "deepseek_v2", "gather")
    block.router.weight = upstream.weight
    x = torch.randn(32, D)
    with torch.no_grad():
        _, weights, indices = upstream(x)
        expected = _dense((weights, indices))
        for form in (_dense(block.router(x)), block.router.dense_weights(x)):
            assert torch.equal(form > 0, expected > 0)
            assert (form - expected).abs().max().item() <= ATOL


def test_gather_reads_only_the_chosen_experts():
    """Changing an expert no token chose leaves the output as it was; changing a chosen one does not."""
    torch.manual_seed(3)
    gate, up, down = torch.randn(E, 16, D), torch.randn(E, 16, D), torch.randn(E, D, 16)
    experts = GatherExperts.from_weights(gate, up, down)
    x, weights = torch.randn(4, D), torch.rand(4, K)
    indices = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    before = experts(x, weights, indices)
    with torch.no_grad():
        experts.down_proj[5].fill_(100.0)
        untouched = experts(x, weights, indices)
        experts.down_proj[1].fill_(100.0)
        touched = experts(x, weights, indices)
    assert torch.equal(untouched, before)
    assert not torch.allclose(touched, before)


def test_strategies_agree_on_the_same_weights():
    torch.manual_seed(4)
    tensors = dict(gate=torch.randn(E, 16, D), up=torch.randn(E, 16, D), down=torch.randn(E, D, 16))
    biases = dict(gate_bias=torch.randn(E, 16), up_bias=torch.randn(E, 16), down_bias=torch.randn(E, D))
    x, weights = torch.randn(5, D), torch.rand(5, K)
    indices = torch.stack([torch.randperm(E)[:K] for _ in range(5)])
    for extra in ({}, biases):
        dense = DenseExperts.from_weights(**tensors, **extra)(x, _dense((weights, indices)))
        gather = GatherExperts.from_weights(**tensors, **extra)(x, weights, indices)
        assert (dense - gather).abs().max().item() <= ATOL * dense.abs().max().item()


def test_kth_largest_equals_topk():
    values = torch.randn(6, 3, E)
    for k in (1, 2, 5, E):
        assert torch.equal(kth_largest(values, k), values.topk(k, dim=-1).values[..., -1:])


def _lowered_cpu_ops(block: MoE, tokens: int) -> dict:
    program = torch.export.export(block, (torch.randn(1, tokens, D),))
    lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    return summarize(lowered.exported_program().graph_module)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_xnnpack_takes_every_expert_matmul(strategy):
    """Dense: no index tensors at all (HTP holds no int64). Gather: top-k and the weight gathers stay on CPU, and
    nothing transposes the gathered weights."""
    for model_type in ("qwen2_moe", "deepseek_v3"):
        block = convert(upstream_moe(model_type), model_type, strategy)
        summary = _lowered_cpu_ops(block, tokens=4)
        assert summary.ops_per_delegate["XnnpackBackend"] > 0
        assert not any(op in summary.cpu_ops for op in ("aten.mm", "aten.bmm", "aten.addmm", "aten.linear"))
        indexing = {op for op in summary.cpu_ops if op in ("aten.index.Tensor", "aten.gather", "aten.topk")}
        if strategy == "dense":
            assert indexing == set(), model_type
        else:
            assert {"aten.index.Tensor", "aten.topk"} <= indexing, model_type
            # the gathered weights go to bmm as stored: a transpose of them costs as much as the gather (einsum did)
            assert "aten.permute_copy" not in summary.delegated_ops | summary.cpu_ops, model_type


def test_bad_blocks_are_refused():
    weight = torch.nn.Parameter(torch.randn(E, D))
    with pytest.raises(ValueError, match="top_k=9"):
        TopKRouter(weight, 9, renormalize=True)
    with pytest.raises(ValueError, match="expert_scale has shape \\(4,\\)"):
        TopKRouter(weight, K, renormalize=True, expert_scale=torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(ValueError, match="n_group=3"):
        GroupedTopKRouter(weight, torch.zeros(E), K, n_group=3, topk_group=1, renormalize=True, routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="top_k=5"):
        GroupedTopKRouter(weight, torch.zeros(E), 5, n_group=4, topk_group=2, renormalize=True, routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="expert shapes"):
        DenseExperts.from_weights(torch.randn(E, 16, D), torch.randn(E, 16, D), torch.randn(E, 16, D))
    with pytest.raises(ValueError, match="together"):
        GatherExperts.from_weights(torch.randn(E, 16, D), torch.randn(E, 16, D), torch.randn(E, D, 16), gate_bias=torch.randn(E, 16))
    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoE(TopKRouter(weight, K, renormalize=True), GatherExperts.from_weights(
            torch.randn(E, 16, D), torch.randn(E, 16, D), torch.randn(E, D, 16), activation=SwiGLU()),
            shared_expert_gate=torch.nn.Linear(D, 1))


def test_grouped_router_renormalises_with_the_familys_epsilon_and_floor():
    """`norm_eps` is added to the chosen scores' sum and `norm_min` floors it (ERNIE's `moe_norm_min`), in both forms:
    against the scores computed here with plain torch."""
    torch.manual_seed(7)
    weight = torch.nn.Parameter(torch.randn(E, D))
    x = torch.randn(6, D)
    scores = torch.softmax(x @ weight.T, dim=-1)
    top = scores.topk(K).values
    for eps, floor, denominator in ((0.5, None, top.sum(-1, keepdim=True) + 0.5), (0.0, 3.0, torch.full((6, 1), 3.0))):
        router = GroupedTopKRouter(
            weight, None, K, n_group=1, topk_group=1, renormalize=True, routed_scaling_factor=1.0, scoring="softmax",
            norm_eps=eps, norm_min=floor,
        )
        with torch.no_grad():
            weights, _ = router(x)
            dense = router.dense_weights(x)
        torch.testing.assert_close(weights.sort(-1).values, (top / denominator).sort(-1).values, atol=1e-6, rtol=0)
        torch.testing.assert_close(dense.sort(-1).values[:, -K:], (top / denominator).sort(-1).values, atol=1e-6, rtol=0)
