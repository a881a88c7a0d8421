"""The mixture-of-experts feed-forward: a router, routed experts, and optionally a shared expert."""

from __future__ import annotations

import torch
from torch import nn

from etblocks.moe.experts import Experts


class MoE(nn.Module):
    """`x [..., D] -> [..., D]`: `experts(x, *router(x))`, plus `shared_expert(x)` when given, scaled by
    `sigmoid(shared_expert_gate(x))` when that is given too (Qwen2-MoE; DeepSeek's shared experts are ungated).

    The router is any module `x [N, D] -> (weights [N, k], indices [N, k])` with a `dense_weights(x) -> [N, E]`
    method (see `etblocks.moe.router`); the experts pick the strategy and which of the two they take.
    """

    def __init__(
        self,
        router: nn.Module,
        experts: Experts,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("shared_expert_gate needs a shared_expert to gate")
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.experts.routing == "dense":
            out = self.experts(flat, self.router.dense_weights(flat))
        else:
            out = self.experts(flat, *self.router(flat))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(x.shape)
