"""transformers MoE blocks to `etblocks.moe.MoE`, in the strategy the recipe picks (`moe="dense"|"gather"`).

transformers 5.x keeps experts as fused 3-D parameters dispatched by `ExpertsInterface`; its default kernels
either do not lower (`grouped_mm`) or do not export (the eager loop over hit experts is data-dependent). The
converters read the fused weights once into the block's layout; routers and shared experts keep their weights.
"""

from __future__ import annotations

import torch
from torch import nn

from etblocks.moe import EXPERT_STRATEGIES, ClampedSwiGLU, Experts, GroupedTopKRouter, MoE, SwiGLU, TopKRouter
from etblocks.swap.hf import upstream_class
from etblocks.swap.registry import MODULES, SwapContext


class HFMoEWithScores(MoE):
    """GPT-OSS's decoder layer unpacks `(hidden_states, router_scores)` from its MLP; the scores are unused."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


def _experts(upstream: nn.Module, ctx: SwapContext) -> Experts:
    """Mixtral-style fused experts: `gate_up_proj [E, 2I, D]` (gate rows first), `down_proj [E, D, I]`."""
    gate, up = upstream.gate_up_proj.detach().chunk(2, dim=1)
    return EXPERT_STRATEGIES[ctx.recipe.moe].from_weights(gate, up, upstream.down_proj.detach(), activation=SwiGLU(upstream.act_fn))


def convert_softmax_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """Mixtral and Qwen3.5-MoE (always renormalised), Qwen2-MoE (gated shared expert), Qwen3-MoE and OLMoE
    (`norm_topk_prob`)."""
    gate = module.gate
    router = TopKRouter(gate.weight, gate.top_k, renormalize=getattr(gate, "norm_topk_prob", True))
    return MoE(router, _experts(module.experts, ctx), getattr(module, "shared_expert", None), getattr(module, "shared_expert_gate", None))


def convert_deepseek_v3_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    gate = module.gate
    router = GroupedTopKRouter(
        gate.weight,
        gate.e_score_correction_bias,
        gate.top_k,
        n_group=gate.num_group,
        topk_group=gate.topk_group,
        renormalize=gate.norm_topk_prob,
        routed_scaling_factor=gate.routed_scaling_factor,
    )
    return MoE(router, _experts(module.experts, ctx), module.shared_experts)


def convert_deepseek_v2_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """Softmax scores, top-k over all experts ("greedy") or within the best groups by their max expert score
    ("group_limited_greedy"), no renormalisation, routed scaling; an ungated shared expert."""
    gate = module.gate
    if gate.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method={gate.topk_method!r} is not supported; accepted: 'greedy', 'group_limited_greedy'")
    grouped = gate.topk_method == "group_limited_greedy"
    router = GroupedTopKRouter(
        gate.weight,
        None,
        gate.top_k,
        n_group=gate.num_group if grouped else 1,
        topk_group=gate.topk_group if grouped else 1,
        renormalize=False,
        routed_scaling_factor=gate.routed_scaling_factor,
        scoring="softmax",
        group_top=1,
    )
    return MoE(router, _experts(module.experts, ctx), module.shared_experts)


def convert_gpt_oss_moe(module: nn.Module, ctx: SwapContext) -> HFMoEWithScores:
    """GPT-OSS stores experts transposed (`[E, D, 2I]`, `[E, I, D]`) with gate and up interleaved, and biases."""
    experts = module.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, D]
    bias = experts.gate_up_proj_bias.detach()
    routed = EXPERT_STRATEGIES[ctx.recipe.moe].from_weights(
        gate_up[:, 0::2],
        gate_up[:, 1::2],
        experts.down_proj.detach().transpose(1, 2),
        gate_bias=bias[:, 0::2],
        up_bias=bias[:, 1::2],
        down_bias=experts.down_proj_bias.detach(),
        activation=ClampedSwiGLU(experts.alpha, experts.limit),
    )
    router = TopKRouter(module.router.weight, module.router.top_k, bias=module.router.bias, renormalize=True)
    return HFMoEWithScores(router, routed)


# model_type -> (MoE block class, converter)
MOE_FAMILIES = {
    "mixtral": ("MixtralSparseMoeBlock", convert_softmax_moe),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", convert_softmax_moe),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", convert_softmax_moe),
    "qwen3_5_moe": ("Qwen3_5MoeSparseMoeBlock", convert_softmax_moe),
    "olmoe": ("OlmoeSparseMoeBlock", convert_softmax_moe),
    "deepseek_v2": ("DeepseekV2Moe", convert_deepseek_v2_moe),
    "deepseek_v3": ("DeepseekV3MoE", convert_deepseek_v3_moe),
    "gpt_oss": ("GptOssMLP", convert_gpt_oss_moe),
}


def register_moe_families() -> None:
    for model_type, (class_name, converter) in MOE_FAMILIES.items():
        MODULES.register(upstream_class(model_type, class_name), replace=False)(converter)
