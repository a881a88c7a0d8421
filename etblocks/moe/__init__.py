"""Exportable mixture-of-experts: routers, experts in a dense or a gather strategy, and the block."""

from etblocks.moe.block import MoE
from etblocks.moe.experts import EXPERT_STRATEGIES, ClampedSwiGLU, DenseExperts, Experts, GatherExperts, SwiGLU
from etblocks.moe.router import GroupedTopKRouter, TopKRouter

__all__ = [
    "MoE",
    "Experts",
    "DenseExperts",
    "GatherExperts",
    "EXPERT_STRATEGIES",
    "SwiGLU",
    "ClampedSwiGLU",
    "TopKRouter",
    "GroupedTopKRouter",
]
