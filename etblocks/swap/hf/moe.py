"""transformers MoE blocks to `etblocks.moe.MoE`, in the strategy the recipe picks (`moe="dense"|"gather"`).

transformers 5.x keeps experts as fused 3-D parameters dispatched by `ExpertsInterface`; its default kernels
either do not lower (`grouped_mm`) or do not export (the eager loop over hit experts is data-dependent). The
converters read the fused weights once into the block's layout; routers and shared experts keep their weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from etblocks.moe import EXPERT_STRATEGIES, ClampedSwiGLU, Experts, GroupedTopKRouter, MoE, SwiGLU, TopKRouter
from etblocks.swap.hf import upstream_class
from etblocks.swap.registry import MODULES, SwapContext


class HFMoEWithScores(MoE):
    """GPT-OSS's decoder layer unpacks `(hidden_states, router_scores)` from its MLP; the scores are unused."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


def _shared(module: nn.Module) -> nn.Module | None:
    """The block's shared expert, added ungated to the routed experts' output (each family names it its own way)."""
    found = (getattr(module, name, None) for name in ("shared_experts", "shared_expert", "shared_mlp"))
    return next((shared for shared in found if shared is not None), None)


def convert_softmax_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """Softmax over the experts, top-k, renormalised where the router says so (`norm_topk_prob`; Mixtral, Qwen3.5-
    MoE and HunYuan always): Mixtral, Qwen2-MoE (its shared expert gated), Qwen3-MoE, OLMoE, FlexOlmo, Mellum,
    Lara-mini, HunYuan-MoE (their shared expert, if any, ungated)."""
    gate = module.gate
    weight = gate.wg.weight if hasattr(gate, "wg") else gate.weight
    router = TopKRouter(weight, gate.top_k, renormalize=getattr(gate, "norm_topk_prob", True))
    return MoE(router, generic_experts(module.experts, ctx), _shared(module), getattr(module, "shared_expert_gate", None))


def convert_granite_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """Granite MoE, MoE-shared, 4.0-H and SWA: a softmax over the top-k router logits (the shared MLP is the decoder
    layer's). Converted whole, not as generic experts behind the family's router: that router's `topk` indices are
    int64, which NPUs such as Qualcomm HTP do not hold, and the dense strategy needs none
    (`TopKRouter.dense_weights`); so are the families below."""
    router = TopKRouter(module.router.weight, module.router.top_k, renormalize=True)
    return MoE(router, generic_experts(module.experts, ctx))


def convert_deepseek_v3_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """Sigmoid scores, chosen with a correction bias within the best groups, renormalised, scaled; ungated shared
    experts: DeepSeek-V3 and the families that copy its router (GLM-4.5, dots1, Solar Open, EXAONE-MoE)."""
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
    return MoE(router, generic_experts(module.experts, ctx), module.shared_experts)


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
    return MoE(router, generic_experts(module.experts, ctx), module.shared_experts)


def convert_lfm2_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """LFM2-MoE: sigmoid scores, chosen with the block's `expert_bias` when it uses one, renormalised (+1e-6) where
    `norm_topk_prob`, scaled by `routed_scaling_factor`."""
    gate = module.gate
    bias = module.expert_bias if module.use_expert_bias else None
    router = GroupedTopKRouter(
        gate.weight, bias, gate.top_k, renormalize=gate.norm_topk_prob, routed_scaling_factor=gate.routed_scaling_factor, norm_eps=1e-6
    )
    return MoE(router, generic_experts(module.experts, ctx))


def convert_minimax_m2_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """MiniMax-M2: sigmoid scores, chosen with the block's correction bias, always renormalised."""
    router = GroupedTopKRouter(module.gate.weight, module.e_score_correction_bias, module.gate.top_k, renormalize=True, norm_eps=0.0)
    return MoE(router, generic_experts(module.experts, ctx))


def convert_hy_v3_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """Hy-V3: MiniMax-M2's router (+1e-20) scaled by `router_scaling_factor`; ungated shared experts."""
    gate = module.gate
    router = GroupedTopKRouter(
        gate.weight, module.e_score_correction_bias, gate.top_k, renormalize=True, routed_scaling_factor=gate.router_scaling_factor
    )
    return MoE(router, generic_experts(module.experts, ctx), _shared(module))


def convert_afmoe_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """AFMoE: sigmoid scores chosen with the block's `expert_bias`, renormalised (+1e-20), times `route_scale`;
    ungated shared experts."""
    upstream = module.router
    router = GroupedTopKRouter(
        upstream.gate.weight, module.expert_bias.detach(), upstream.top_k, renormalize=True, routed_scaling_factor=upstream.route_scale
    )
    return MoE(router, generic_experts(module.experts, ctx), _shared(module))


def convert_flint_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """Flint: sigmoid scores without a bias, renormalised where `norm_topk_prob`; an ungated shared expert."""
    gate = module.gate
    router = GroupedTopKRouter(gate.weight, None, gate.top_k, renormalize=gate.norm_topk_prob, norm_eps=0.0)
    return MoE(router, generic_experts(module.experts, ctx), _shared(module))


def convert_ernie4_5_moe(module: nn.Module, ctx: SwapContext) -> MoE:
    """ERNIE 4.5: a softmax over the experts (fp32), chosen with a correction bias, renormalised by the sum
    clamped below at `moe_norm_min`; ungated shared experts when the config has them."""
    gate = module.gate
    router = GroupedTopKRouter(
        gate.weight,
        gate.moe_statics.e_score_correction_bias.detach().reshape(-1),
        gate.top_k,
        renormalize=True,
        scoring="softmax",
        norm_eps=0.0,
        norm_min=gate.norm_min,
    )
    return MoE(router, generic_experts(module.experts, ctx), _shared(module))


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


class HFRouter(nn.Module):
    """An etblocks `TopKRouter` where a family's decoder layer calls its own router and hands the result to its
    generic experts (Gemma 4): `forward(hidden_states [N, D]) -> (probabilities [N, E], weights, index)`, the
    family's contract. In the top-k form (`dense=False`) weights and index are `[N, k]`; in the dense form the
    weights are `[N, E]`, zero outside the top-k, and the index is None, for `HFExperts`' dense strategy. The
    probabilities (a softmax over every expert, what upstream records as router logits) are what the swap's probe
    compares; the layers discard them, and export drops them. `prepare` maps the hidden states to the router's
    input (Gemma 4 scales them first)."""

    def __init__(self, router: TopKRouter, *, dense: bool, prepare: nn.Module | None = None) -> None:
        super().__init__()
        self.router = router
        self.dense = dense
        self.prepare = prepare

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = hidden_states if self.prepare is None else self.prepare(hidden_states)
        logits = self.router.logits(x)
        probabilities = torch.softmax(logits.float(), dim=-1)
        if self.dense:
            return probabilities, self.router.dense_of(logits), None
        return probabilities, *self.router.top_k_of(logits)


class Gemma4RouterInput(nn.Module):
    """Gemma 4's router input: a scale-free RMSNorm (upstream's module), times a learned scale and `hidden**-0.5`,
    in upstream's order of operations."""

    def __init__(self, upstream: nn.Module) -> None:
        super().__init__()
        self.norm = upstream.norm
        self.scale = upstream.scale
        self.root_size = upstream.scalar_root_size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states) * self.scale * self.root_size


def convert_gemma4_router(module: nn.Module, ctx: SwapContext) -> HFRouter:
    """Gemma 4: softmax over all experts, top-k, renormalised, times the chosen experts' `per_expert_scale`. Its
    layer calls router and experts apart (on differently normalised inputs), so the router is converted alone,
    in the strategy's form; left upstream, its `topk` index would be int64 in every program."""
    router = TopKRouter(module.proj.weight, module.config.top_k_experts, renormalize=True, expert_scale=module.per_expert_scale)
    return HFRouter(router, dense=ctx.recipe.moe == "dense", prepare=Gemma4RouterInput(module))


def int64_index_users(replacements: list[tuple[str, nn.Module]]) -> list[tuple[str, str, str]]:
    """`(name, why, remedy)` of the replacements whose programs would hold an int64 top-k index: experts of the
    gather strategy, and generic experts fed by their family's router left upstream (no dense `HFRouter` beside
    them)."""
    routers = {name.rpartition(".")[0] for name, block in replacements if isinstance(block, HFRouter) and block.dense}
    found = []
    for name, block in replacements:
        if any(isinstance(m, Experts) and m.routing == "topk" for m in block.modules()):
            found.append((name, "its experts take the gather strategy, which picks them by top-k index", "swap with moe='dense'"))
        elif isinstance(block, HFExperts) and name.rpartition(".")[0] not in routers:
            found.append((
                name,
                "its family's router, which etblocks does not convert, hands it a top-k index",
                "register a converter for the family's MoE block returning an etblocks.moe.MoE (router and experts "
                "in etblocks' form, as etblocks.swap.hf.moe.MOE_FAMILIES does), or for its router returning an "
                "etblocks.swap.hf.moe.HFRouter (whose dense form hands the experts no index)",
            ))
    return found


def is_generic_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module behind `ExpertsInterface` (`@use_experts_implementation`)."""
    return hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(module, "config")


class HFExperts(nn.Module):
    """etblocks experts called where transformers calls its generic experts module: `forward(hidden_states [N, D],
    top_k_index [N, k], top_k_weights [N, k]) -> [N, D]`, behind the family's router. The dense strategy spreads the
    top-k weights over all experts (`[N, E]`, zeros elsewhere) with a comparison, not a scatter, which fixed-shape
    compilers take. Behind an `HFRouter` in the dense strategy the index is None and the weights are that `[N, E]`
    already: no int64 tensor anywhere, which NPUs such as Qualcomm HTP need."""

    def __init__(self, experts: Experts) -> None:
        super().__init__()
        self.experts = experts
        self.register_buffer("expert_ids", torch.arange(experts.n_experts), persistent=False)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        weights = top_k_weights.to(hidden_states.dtype)
        if self.experts.routing == "topk":
            return self.experts(hidden_states, weights, top_k_index)
        if top_k_index is None:
            return self.experts(hidden_states, weights)
        dense = ((top_k_index[..., None] == self.expert_ids).to(weights.dtype) * weights[..., None]).sum(dim=1)
        return self.experts(hidden_states, dense)


class UpstreamGate(nn.Module):
    """The family's own `_apply_gate` over `[gate | up]` (or interleaved pairs), for experts that override
    transformers' `act(gate) * up`. It keeps a weightless copy of the experts module (its settings, not its
    tensors), outside the module tree."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        shell = copy.copy(experts)
        shell.__dict__.update(_parameters={}, _buffers={}, _modules={k: m for k, m in experts._modules.items() if not any(m.parameters())})
        self.__dict__["shell"] = shell
        self.concatenated = experts.is_concatenated

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        both = torch.cat((gate, up), dim=-1) if self.concatenated else torch.stack((gate, up), dim=-1).flatten(-2)
        return type(self.shell)._apply_gate(self.shell, both)


def generic_experts_layout(module: nn.Module):
    """The converter for a transformers generic experts module etblocks takes (gated experts, concatenated or
    interleaved, transposed or not, with or without biases), or None: experts without a gate or with a norm after
    each expert stay upstream, where `TransformersKind.check` asks for an implementation that exports."""
    if not is_generic_experts(module) or not module.has_gate or module.has_post_expert_norm:
        return None
    return convert_generic_experts


def _gate_and_up(tensor: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Split `[E, 2I, ...]` into gate and up rows: `[gate; up]` halves or `[g0, u0, g1, u1, ...]` pairs."""
    return tuple(tensor.chunk(2, dim=1)) if concatenated else (tensor[:, 0::2], tensor[:, 1::2])


def generic_experts(module: nn.Module, ctx: SwapContext) -> Experts:
    """etblocks experts in the recipe's strategy from a transformers generic experts module, in any of its layouts
    (gate and up concatenated or interleaved, transposed or not, with or without biases, the family's own gate)."""
    from transformers.integrations.moe import _default_apply_gate

    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    if module.is_transposed:  # [E, D, 2I] and [E, I, D]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = _gate_and_up(gate_up, module.is_concatenated)
    biases = {}
    if module.has_bias:
        gate_bias, up_bias = _gate_and_up(module.gate_up_proj_bias.detach(), module.is_concatenated)
        biases = dict(gate_bias=gate_bias, up_bias=up_bias, down_bias=module.down_proj_bias.detach())
    default_gate = getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate
    activation = SwiGLU(module.act_fn) if default_gate else UpstreamGate(module)
    return EXPERT_STRATEGIES[ctx.recipe.moe].from_weights(gate, up, down, activation=activation, **biases).to(gate_up.device)


def convert_generic_experts(module: nn.Module, ctx: SwapContext) -> HFExperts:
    return HFExperts(generic_experts(module, ctx))


# model_type -> (upstream MoE block class, or the router class of a layer that calls router and experts apart; converter)
MOE_FAMILIES = {
    "mixtral": ("MixtralSparseMoeBlock", convert_softmax_moe),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", convert_softmax_moe),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", convert_softmax_moe),
    "qwen3_5_moe": ("Qwen3_5MoeSparseMoeBlock", convert_softmax_moe),
    "olmoe": ("OlmoeSparseMoeBlock", convert_softmax_moe),
    "flex_olmo": ("FlexOlmoSparseMoeBlock", convert_softmax_moe),
    "mellum": ("MellumSparseMoeBlock", convert_softmax_moe),
    "lara_mini": ("LaraMiniSparseMoeBlock", convert_softmax_moe),
    "hunyuan_v1_moe": ("HunYuanMoEV1Moe", convert_softmax_moe),
    "deepseek_v2": ("DeepseekV2Moe", convert_deepseek_v2_moe),
    "deepseek_v3": ("DeepseekV3MoE", convert_deepseek_v3_moe),
    "glm4_moe": ("Glm4MoeMoE", convert_deepseek_v3_moe),
    "dots1": ("Dots1MoE", convert_deepseek_v3_moe),
    "solar_open": ("SolarOpenMoE", convert_deepseek_v3_moe),
    "exaone_moe": ("ExaoneMoeSparseMoEBlock", convert_deepseek_v3_moe),
    "ernie4_5_moe": ("Ernie4_5_MoeSparseMoeBlock", convert_ernie4_5_moe),
    "lfm2_moe": ("Lfm2MoeSparseMoeBlock", convert_lfm2_moe),
    "minimax_m2": ("MiniMaxM2SparseMoeBlock", convert_minimax_m2_moe),
    "hy_v3": ("HYV3MoE", convert_hy_v3_moe),
    "afmoe": ("AfmoeSparseMoeBlock", convert_afmoe_moe),
    "flint": ("FlintSparseMoeBlock", convert_flint_moe),
    "gpt_oss": ("GptOssMLP", convert_gpt_oss_moe),
    "granitemoe": ("GraniteMoeMoE", convert_granite_moe),
    "granitemoeshared": ("GraniteMoeSharedMoE", convert_granite_moe),
    "granitemoehybrid": ("GraniteMoeHybridMoE", convert_granite_moe),
    "granitemoe_swa": ("GraniteMoeSWAMoE", convert_granite_moe),
    "gemma4": ("Gemma4TextRouter", convert_gemma4_router),
}


def reads_its_experts(block: nn.Module) -> bool:
    """Whether etblocks reads `block`'s experts: not when they are transformers' generic experts in a form etblocks'
    experts do not compute (no gate, a norm after each expert). Such a block stays upstream, where
    `TransformersKind.check` asks for an experts implementation that exports."""
    experts = getattr(block, "experts", None)
    return experts is None or not is_generic_experts(experts) or generic_experts_layout(experts) is not None


def register_moe_families() -> None:
    for model_type, (class_name, converter) in MOE_FAMILIES.items():
        MODULES.register(upstream_class(model_type, class_name), replace=False, when=reads_its_experts)(converter)
