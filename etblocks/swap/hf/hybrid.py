"""The state layers of hybrid families: LFM2's short convolutions, Qwen3.5's gated DeltaNet and Mamba2 mixers.

A layer is recognised by its parts, not its class (`state_layout`), so families built from the same layer
(LFM2-MoE, LFM3, Qwen3.5-MoE) convert without a line of their own; `is_state_layer` finds every layer that keeps
state other than K/V rows, so one that does not convert is refused at swap time instead of failing in export.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from etblocks.mixers.delta_rule import ChunkedDeltaRule, DeltaRule, FusedDeltaRule
from etblocks.mixers.mamba2 import GroupedGatedRMSNorm
from etblocks.swap.hf.adapter import HFGatedDeltaNet, HFMamba2, HFShortConv
from etblocks.swap.registry import SwapContext

# How the class names of layers keeping recurrent or convolution state end (Mamba mixers, linear attention, ...):
# not their norms, MLPs or decoder layers.
STATE_LAYER_NAMES = re.compile(r"(DeltaNet|ShortConv|ShortConvolution|Mixer|LinearAttention|MambaLayer|RecurrentBlock|SSM|Retention)$")


def is_state_layer(module: nn.Module) -> bool:
    """Whether `module` is a token mixer keeping non-K/V state: it holds a depthwise `Conv1d` itself (the mark of
    short convolutions, DeltaNets and Mamba mixers), or its class name says so."""
    depthwise = any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels > 1 for c in module.children())
    return depthwise or bool(STATE_LAYER_NAMES.search(type(module).__name__))


def _has(module: nn.Module, linears: tuple[str, ...], others: tuple[str, ...] = ()) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in linears) and all(
        hasattr(module, name) for name in others
    )


def delta_rule_for(ctx: SwapContext) -> DeltaRule:
    return FusedDeltaRule() if ctx.recipe.delta_rule == "fused" else ChunkedDeltaRule(ctx.max_seq_len)


def short_conv(module: nn.Module, ctx: SwapContext) -> HFShortConv:
    """LFM2's `Lfm2ShortConv` layout: `in_proj` (D -> 3D: B, C, x), a depthwise `conv`, `out_proj`."""
    owned = dict(caller_owned=ctx.caller_owned, max_batch_size=ctx.max_batch_size)
    block = HFShortConv(module.in_proj, module.conv, module.out_proj, **owned)
    return block.to(module.in_proj.weight.device)


def gated_deltanet(module: nn.Module, ctx: SwapContext) -> HFGatedDeltaNet:
    """Qwen3.5's `Qwen3_5GatedDeltaNet` layout: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, a depthwise
    `conv1d` with SiLU, `A_log`, `dt_bias`, a gated `norm` and `out_proj`."""
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        raise ValueError(f"activation={module.activation!r} after the convolution is not supported; accepted: 'silu'")
    block = HFGatedDeltaNet(
        module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a, module.conv1d,
        module.A_log, module.dt_bias, module.norm, module.out_proj,
        n_k_heads=module.num_k_heads, n_v_heads=module.num_v_heads,
        k_head_dim=module.head_k_dim, v_head_dim=module.head_v_dim,
        rule=delta_rule_for(ctx), caller_owned=ctx.caller_owned, max_batch_size=ctx.max_batch_size,
    )
    return block.to(module.in_proj_qkv.weight.device)


def mamba2(module: nn.Module, ctx: SwapContext) -> HFMamba2:
    """The Mamba2 mixer layout (Granite 4.0-H's `GraniteMoeHybridMambaLayer` and the mixers built like it):
    `in_proj` (D -> gate, x/B/C, dt), a depthwise `conv1d` with SiLU, `A_log`, `D`, `dt_bias`, a gated `norm`
    (gate, then an RMSNorm per group: moved into a `GroupedGatedRMSNorm`) and `out_proj`."""
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        raise ValueError(f"activation={module.activation!r} after the convolution is not supported; accepted: 'silu'")
    if not isinstance(getattr(module.norm, "weight", None), torch.Tensor):
        raise ValueError(f"norm is {type(module.norm).__name__}, not a gated RMSNorm (Falcon-H1 without mamba_rms_norm)")
    if hasattr(module, "mup_vector"):
        raise ValueError("a mup_vector scaling the input projection (Falcon-H1's multipliers) is not supported")
    heads, head_dim, groups, state = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    expected = 2 * heads * head_dim + 2 * groups * state + heads
    if module.in_proj.out_features != expected:
        raise ValueError(
            f"in_proj gives {module.in_proj.out_features} features; the Mamba2 layout (gate, x, B, C, dt) gives {expected}"
        )
    width = heads * head_dim
    norm_groups = width // getattr(module.norm, "group_size", width)
    eps = getattr(module.norm, "variance_epsilon", getattr(module.norm, "eps", None))
    if eps is None:
        raise ValueError(f"norm {type(module.norm).__name__} names no epsilon (variance_epsilon or eps)")
    norm = GroupedGatedRMSNorm(module.norm.weight, norm_groups, eps)
    block = HFMamba2(
        module.in_proj, module.conv1d, module.A_log, module.D, module.dt_bias, norm, module.out_proj,
        n_heads=heads, head_dim=head_dim, n_groups=groups, state_size=state,
        time_step_limit=tuple(getattr(module, "time_step_limit", (0.0, float("inf")))),
        caller_owned=ctx.caller_owned, max_batch_size=ctx.max_batch_size,
    )
    return block.to(module.in_proj.weight.device)


def state_layout(module: nn.Module) -> Callable[[nn.Module, SwapContext], nn.Module] | None:
    """The converter for a state layer laid out as one etblocks converts, or None."""
    if _has(module, ("in_proj", "out_proj"), ("conv",)) and isinstance(module.conv, nn.Conv1d):
        if module.in_proj.out_features == 3 * module.conv.in_channels == 3 * module.out_proj.out_features:
            return short_conv
    gdn = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    others = ("conv1d", "A_log", "dt_bias", "norm", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    if _has(module, gdn, others):
        return gated_deltanet
    ssm = ("conv1d", "A_log", "D", "dt_bias", "norm", "num_heads", "head_dim", "n_groups", "ssm_state_size")
    if _has(module, ("in_proj", "out_proj"), ssm):
        return mamba2
    return None


class TextRotary(nn.Module):
    """Qwen3.5's multimodal rope (mrope) on text, where its three position rows are equal: the plain rope of the
    first row. One table instead of three recomposed by strided slices, which NPU compilers take as it is (and
    tiny configs whose sections overrun the table do not leave empty slices behind). `forward(x, position_ids
    [3, B, T] or [B, T]) -> (cos, sin) [B, T, R]`."""

    def __init__(self, upstream: nn.Module) -> None:
        super().__init__()
        self.register_buffer("inv_freq", upstream.inv_freq.detach().clone(), persistent=False)
        self.attention_scaling = upstream.attention_scaling

    def forward(self, x, position_ids):
        positions = position_ids[0] if position_ids.ndim == 3 else position_ids
        freqs = positions[..., None].float() * self.inv_freq
        table = torch.cat((freqs, freqs), dim=-1)
        return (table.cos() * self.attention_scaling).to(x.dtype), (table.sin() * self.attention_scaling).to(x.dtype)


def text_rotary(module: nn.Module, ctx: SwapContext) -> TextRotary:
    if module.rope_type != "default":
        raise ValueError(f"rope_type={module.rope_type!r} is not supported for this multimodal rope; accepted: 'default'")
    return TextRotary(module).to(module.inv_freq.device)
