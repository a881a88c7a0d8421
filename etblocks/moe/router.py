"""Routers: which `k` experts each token goes to, and with what weight. Static shapes throughout.

Each router gives the top-k form, `forward(x) -> (weights [N, k], indices [N, k])`, for the gather strategy, and
the dense form, `dense_weights(x) -> [N, E]` (zero outside the top-k), for the dense strategy. The dense form
uses no index tensors at all (thresholds from repeated `amax`, no `topk`/`scatter`; `where`, not `~mask`): NPUs
such as Qualcomm HTP hold no int64 tensors and QNN has no bitwise-not. Exact ties at the k-th score admit every
tied expert there; `topk` would pick one.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest of `values [..., E]` along the last dim, `[..., 1]`, without `topk` (no index output)."""
    for _ in range(k - 1):
        values = values.masked_fill(values >= values.amax(dim=-1, keepdim=True), float("-inf"))
    return values.amax(dim=-1, keepdim=True)


def in_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fp32, with no cast where it already is.

    workaround(executorch 1.5.1): a no-op `.float()` of a weight exports as a copy that QNN's constant folding
    turns into a frozen parameter, whose placeholder a later pass maps to another constant (`b__frozen_param0`
    to a quantization scale): the 16a8w program's convolutions then have no QNN builder
    (`tests/export/test_qnn.py::test_dense_moe_behind_each_router_is_ready_quantized`)."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


class TopKRouter(nn.Module):
    """Softmax top-k (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, Gemma 4): `x [N, D] -> (weights [N, k], indices [N, k])`.

    With `renormalize`, the weights are a softmax over the top-k logits only: it equals "softmax over all
    experts, take the top-k, divide by their sum" (Mixtral, `norm_topk_prob`) and is GPT-OSS's own form, and it
    skips the softmax over all experts. `expert_scale [E]` multiplies each chosen expert's weight afterwards
    (Gemma 4's `per_expert_scale`). Weights come back in fp32, as upstream computes them.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        top_k: int,
        *,
        bias: nn.Parameter | None = None,
        renormalize: bool,
        expert_scale: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= weight.shape[0]:
            raise ValueError(f"top_k={top_k} must be in 1..{weight.shape[0]} (the number of experts)")
        if expert_scale is not None and expert_scale.shape != weight.shape[:1]:
            raise ValueError(f"expert_scale has shape {tuple(expert_scale.shape)}; it needs one value per expert, ({weight.shape[0]},)")
        self.weight = weight  # [E, D]
        self.bias = bias  # [E] or None
        self.expert_scale = expert_scale  # [E] or None
        self.top_k = top_k
        self.renormalize = renormalize

    @property
    def n_experts(self) -> int:
        return self.weight.shape[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.top_k_of(self.logits(x))

    def dense_weights(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_of(self.logits(x))

    def top_k_of(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k form from the router's logits (callers that also need the logits compute them once)."""
        if self.renormalize:
            top, indices = logits.topk(self.top_k, dim=-1)
            weights = torch.softmax(top.float(), dim=-1)
        else:
            weights, indices = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        return (weights if self.expert_scale is None else weights * self.expert_scale[indices]), indices

    def dense_of(self, logits: torch.Tensor) -> torch.Tensor:
        """The dense form from the router's logits."""
        logits = logits.float()
        chosen = logits >= kth_largest(logits, self.top_k)
        if self.renormalize:
            weights = torch.softmax(torch.where(chosen, logits, float("-inf")), dim=-1)
        else:
            weights = torch.softmax(logits, dim=-1) * chosen
        return weights if self.expert_scale is None else weights * self.expert_scale


class GroupedTopKRouter(nn.Module):
    """Top-k on scores in fp32, `scoring="sigmoid"` (DeepSeek-V3, GLM-4.5, LFM2-MoE, MiniMax-M2) or `"softmax"`
    (DeepSeek-V2, ERNIE 4.5). Experts are chosen on `score + e_score_correction_bias` (None: on the score) within
    the `topk_group` best of `n_group` groups, a group scoring the sum of its best `group_top` (V3: 2; V2: 1, the
    max); they are weighted by the plain scores, optionally renormalised by `max(sum + norm_eps, norm_min)` (each
    family's own epsilon or floor), then scaled by `routed_scaling_factor`. `n_group=1` (the default) is plain top-k.

    `x [N, D] -> (weights fp32 [N, k], indices [N, k])`.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        e_score_correction_bias: torch.Tensor | None,
        top_k: int,
        *,
        renormalize: bool,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        scoring: Literal["sigmoid", "softmax"] = "sigmoid",
        group_top: int = 2,
        norm_eps: float = 1e-20,
        norm_min: float | None = None,
    ) -> None:
        super().__init__()
        n_experts = weight.shape[0]
        if n_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group={n_group}, topk_group={topk_group} do not split {n_experts} experts into groups")
        if not 1 <= top_k <= n_experts // n_group * topk_group:
            raise ValueError(f"top_k={top_k} must be in 1..{n_experts // n_group * topk_group} (experts in the chosen groups)")
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring={scoring!r} is not accepted; choose 'sigmoid' or 'softmax'")
        self.weight = weight  # [E, D]
        self.register_buffer("e_score_correction_bias", e_score_correction_bias)  # [E] or None
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.renormalize = renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.scoring = scoring
        self.group_top = min(group_top, n_experts // n_group)
        self.norm_eps = norm_eps
        self.norm_min = norm_min

    @property
    def n_experts(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, choice = self._scores(x)
        indices = choice.topk(self.top_k, dim=-1).indices
        return self._finish(scores.gather(1, indices)), indices

    def dense_weights(self, x: torch.Tensor) -> torch.Tensor:
        scores, choice = self._scores(x)
        return self._finish(scores * (choice >= kth_largest(choice, self.top_k)))

    def _scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores `[N, E]` and the (biased) scores experts are chosen on, `-inf` outside the chosen groups."""
        logits = F.linear(in_fp32(x), in_fp32(self.weight))
        scores = logits.sigmoid() if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group == 1:
            return scores, choice
        n, per_group = x.shape[0], self.n_experts // self.n_group
        grouped = choice.view(n, self.n_group, per_group)
        group_scores = grouped.amax(dim=-1)
        for k in range(2, self.group_top + 1):
            group_scores = group_scores + kth_largest(grouped, k)[..., 0]
        in_chosen = group_scores >= kth_largest(group_scores, self.topk_group)  # [N, G]
        return scores, torch.where(in_chosen[..., None], grouped, float("-inf")).view(n, self.n_experts)

    def _finish(self, weights: torch.Tensor) -> torch.Tensor:
        if self.renormalize:
            total = weights.sum(dim=-1, keepdim=True) + self.norm_eps
            weights = weights / (total if self.norm_min is None else total.clamp(min=self.norm_min))
        return weights * self.routed_scaling_factor
