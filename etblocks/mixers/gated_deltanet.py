"""Qwen3.5's gated DeltaNet: linear attention with a fixed-size state."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from etblocks.mixers.delta_rule import DeltaRule
from etblocks.mixers.short_conv import causal_depthwise_conv
from etblocks.state.recurrent import RecurrentState
from etblocks.state.window import WindowState


class GatedRMSNorm(nn.Module):
    """RMSNorm of `x [..., D]` in fp32, times `weight`, times `silu(gate)`: gated DeltaNet's output norm."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * x.to(dtype) * F.silu(gate.float())).to(dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """`log(1 + exp(x))` as `relu(x) + log(1 + exp(-|x|))`: stable for any x, in elementwise ops every backend has
    (`F.softplus` decomposes into a threshold compare that QNN has no builder for)."""
    return torch.relu(x) + torch.log(1 + torch.exp(-torch.abs(x)))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Qwen3.5's linear attention): a causal depthwise convolution (+ SiLU) over `in_proj_qkv(x)`
    gives `q, k [B, T, Hk, Dk]` and `v [B, T, Hv, Dv]`; `beta = sigmoid(in_proj_b(x))` and the log decay
    `g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)` `[B, T, Hv]` drive the gated delta rule over L2-normed
    q, k (each k head serving Hv / Hk v heads); the output `o [B, T, Hv, Dv]` goes through `norm(o, in_proj_z(x))`
    (a gated RMSNorm per head) and `out_proj`.

    `forward(x [B, T, D], input_pos [T], position_embeddings=None) -> [B, T, D]` (the mixer contract of
    `etblocks.state.mixer`; no rope). States: `conv_state`, a `WindowState` of the last K - 1 projected inputs
    `[B, K - 1, 2 Hk Dk + Hv Dv]`, and `recurrent_state`, a `RecurrentState` `[B, Hv, Dk, Dv]` in fp32; caller-owned,
    it skips padding (tokens at position -1), so static programs pad short calls.

    `rule` is the form of the recurrence (`ChunkedDeltaRule` for any backend, `FusedDeltaRule` for ExecuTorch's
    CPU kernel). Modules keep Qwen3.5's names (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`,
    `A_log`, `dt_bias`, `norm`, `out_proj`), so state dicts and adapter targets are the upstream ones.
    """

    def __init__(
        self,
        in_proj_qkv: nn.Module,
        in_proj_z: nn.Module,
        in_proj_b: nn.Module,
        in_proj_a: nn.Module,
        conv1d: nn.Conv1d,
        A_log: nn.Parameter,
        dt_bias: nn.Parameter,
        norm: nn.Module,
        out_proj: nn.Module,
        *,
        n_k_heads: int,
        n_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        rule: DeltaRule,
        caller_owned: bool = False,
        max_batch_size: int = 1,
    ) -> None:
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"n_v_heads={n_v_heads} must be a multiple of n_k_heads={n_k_heads}")
        channels = 2 * n_k_heads * k_head_dim + n_v_heads * v_head_dim
        if conv1d.in_channels != channels or conv1d.groups != channels:
            raise ValueError(
                f"conv1d must be depthwise over the {channels} q/k/v channels; got in_channels={conv1d.in_channels}, "
                f"groups={conv1d.groups}"
            )
        self.n_k_heads, self.n_v_heads = n_k_heads, n_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a = in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        self.conv1d, self.A_log, self.dt_bias, self.norm, self.out_proj = conv1d, A_log, dt_bias, norm, out_proj
        self.rule = rule
        owned = dict(caller_owned=caller_owned)
        self.conv_state = WindowState(
            conv1d.kernel_size[0] - 1, channels, conv1d.weight.dtype, max_batch_size=max_batch_size, name="conv_state", **owned
        )
        batch = 1 if caller_owned else max_batch_size
        self.recurrent_state = RecurrentState(
            (batch, n_v_heads, k_head_dim, v_head_dim), torch.float32, skips_padding=caller_owned, **owned
        )

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        return F.silu(causal_depthwise_conv(window, self.conv1d))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        bsz = x.shape[0]
        qkv = self.convolve(self.conv_state.update(input_pos, self.in_proj_qkv(x)))
        key_dim = self.n_k_heads * self.k_head_dim
        repeat = self.n_v_heads // self.n_k_heads
        q = l2_normalize(qkv[..., :key_dim].reshape(bsz, -1, self.n_k_heads, self.k_head_dim).float())
        k = l2_normalize(qkv[..., key_dim : 2 * key_dim].reshape(bsz, -1, self.n_k_heads, self.k_head_dim).float())
        v = qkv[..., 2 * key_dim :].reshape(bsz, -1, self.n_v_heads, self.v_head_dim).float()
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * softplus(self.in_proj_a(x).float() + self.dt_bias)
        q = q * self.k_head_dim**-0.5
        if self.recurrent_state.skips_padding:  # a padded token (position -1) neither decays nor writes the state
            real = (input_pos >= 0).to(g.dtype)[None, :, None]
            g, beta = g * real, beta * real
        o, state = self.rule(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2),
            self.recurrent_state.read(input_pos),
        )
        self.recurrent_state.write(state)
        z = self.in_proj_z(x).reshape(bsz, -1, self.n_v_heads, self.v_head_dim)
        o = self.norm(o.transpose(1, 2).to(x.dtype), z)
        return self.out_proj(o.reshape(bsz, -1, self.n_v_heads * self.v_head_dim))
