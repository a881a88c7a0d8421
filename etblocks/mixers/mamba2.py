"""Mamba2's mixer: a selective state-space layer (Granite 4.0-H, the Mamba2 hybrids).

Per head h (head size P, state size N), with `a_t = dt_t A_h` (A < 0) and `B_t, C_t [N]` shared by the heads of a
group, token t does
    S = exp(a_t) S + dt_t x_t B_t^T;   y_t = S C_t + D_h x_t          (S [P, N]).
`ssd_scan` computes a call's tokens at once (the chunked, state-space-dual form, for any T and every backend);
`ssd_step` is the same recurrence for one token.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from etblocks.mixers.gated_deltanet import softplus
from etblocks.mixers.short_conv import causal_depthwise_conv
from etblocks.state.recurrent import RecurrentState
from etblocks.state.window import WindowState


def heads_of_groups(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """`[B, T, G, N]` -> `[B, H, T, N]`: each group's rows for the `H / G` heads it serves."""
    bsz, _, groups, size = t.shape
    per_group = n_heads // groups
    return t.transpose(1, 2).unsqueeze(2).expand(bsz, groups, per_group, -1, size).reshape(bsz, n_heads, -1, size)


# Sub-chunks of a static length: the [T, T] terms stay small and running sums short (upstream chunks too).
CHUNK = 64


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over a call's T tokens, in blocks of tokens at once (fp32).

    `x [B, T, H, P]`, `dt [B, T, H]` (after bias, softplus and limits), `A [H]`, `B, C [B, T, G, N]`, `state
    [B, H, P, N]` before the call -> `(y [B, T, H, P]` without the `D` skip, state after the call). A static T
    runs in sub-chunks of 64 tokens whose decays come from running sums taken by a matmul with a causal mask
    (matmuls and elementwise ops only: what NPU compilers take); a dynamic T (CPU programs) runs as one block
    whose decays are sums over exactly the tokens between two positions (`cumsum`, as upstream), since
    differences of long running sums lose precision.
    """
    length = x.shape[1]
    if isinstance(length, torch.SymInt):
        return ssd_block(x, dt, A, B, C, state, exact_sums=True)
    outputs = []
    for start in range(0, length, CHUNK):
        part = slice(start, min(start + CHUNK, length))
        y, state = ssd_block(x[:, part], dt[:, part], A, B[:, part], C[:, part], state, exact_sums=False)
        outputs.append(y)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), state


def ssd_block(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
    exact_sums: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_scan` over one block of tokens (the state-space dual form: attention-like scores `C_t . B_s` times the
    decay from s to t, plus the state carried in)."""
    n_heads = x.shape[2]
    idx = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)  # float: NPUs hold no int64
    causal = (idx[:, None] >= idx[None, :]).to(x.dtype)  # [T, T]: 1 where t may read s
    log_decay = (dt * A).transpose(1, 2)  # [B, H, T], <= 0
    if exact_sums:
        # between[t, s] = sum of log_decay[r] for s < r <= t (and 0 above the diagonal, masked below).
        strict = (idx[:, None] > idx[None, :]).to(x.dtype)
        between = torch.cumsum(log_decay[..., :, None] * strict, dim=-2)
        running = torch.cumsum(log_decay, dim=-1)
    else:
        running = torch.matmul(log_decay, causal.transpose(0, 1))  # sum of log_decay[r] for r <= t
        between = (running[..., :, None] - running[..., None, :]).clamp(max=0)  # the upper triangle never overflows
    decay = torch.exp(between) * causal  # [B, H, T, T]
    B_h, C_h = heads_of_groups(B, n_heads), heads_of_groups(C, n_heads)  # [B, H, T, N]
    xdt = (x * dt[..., None]).transpose(1, 2)  # [B, H, T, P]
    scores = torch.matmul(C_h, B_h.transpose(-1, -2)) * decay  # [B, H, T, T]
    y = torch.matmul(scores, xdt) + torch.matmul(C_h, state.transpose(-1, -2)) * torch.exp(running)[..., None]
    last = running[..., -1:]  # [B, H, 1]
    to_end = torch.exp(last - running)  # [B, H, T]: decay from each token to the block's end
    new_state = state * torch.exp(last)[..., None] + torch.matmul((xdt * to_end[..., None]).transpose(-1, -2), B_h)
    return y.transpose(1, 2), new_state


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_scan` for a call of one token, as the recurrence itself (no `[T, T]` terms)."""
    n_heads = x.shape[2]
    B_h, C_h = heads_of_groups(B, n_heads), heads_of_groups(C, n_heads)  # [B, H, 1, N]
    decay = torch.exp(dt * A).transpose(1, 2)[..., None]  # [B, H, 1, 1]
    xdt = (x * dt[..., None]).transpose(1, 2)  # [B, H, 1, P]
    new_state = state * decay + xdt.transpose(-1, -2) * B_h  # [B, H, P, N]
    y = torch.matmul(C_h, new_state.transpose(-1, -2))  # [B, H, 1, P]
    return y.transpose(1, 2), new_state


class GroupedGatedRMSNorm(nn.Module):
    """Mamba2's output norm: `x * silu(gate)` RMS-normalised over each of `groups` equal slices of the last dim, times
    `weight`, in fp32. `[B, T, I] -> [B, T, I]`.

    The weight multiplies before the normalising scale: written as upstream writes it (`weight * (x * rsqrt(...))`
    after a view), QNN's RMSNorm recomposition matches it and normalises over the whole width, not per group."""

    def __init__(self, weight: nn.Parameter, groups: int, eps: float = 1e-6) -> None:
        super().__init__()
        if weight.shape[-1] % groups:
            raise ValueError(f"groups={groups} must divide the norm's width {weight.shape[-1]}")
        self.weight = weight
        self.groups = groups
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        gated = x.float() * F.silu(gate.float())
        grouped = gated.view(x.shape[0], -1, self.groups, width // self.groups)
        scale = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        weighted = grouped * self.weight.float().view(self.groups, -1)
        return (weighted * scale).view(x.shape[0], -1, width)


class Mamba2(nn.Module):
    """Mamba2's mixer: `in_proj(x)` gives the gate `z [B, T, I]`, `xBC [B, T, I + 2 G N]` and `dt [B, T, H]`; a
    causal depthwise convolution (+ SiLU) over `xBC` gives `x` (H heads of P = I / H), `B` and `C` (G groups of
    N); the selective scan (see the module docstring) with `dt = softplus(dt + dt_bias)` clamped to
    `time_step_limit` and `A = -exp(A_log)` gives `y`; then `out_proj(norm(y, z))` (the gated RMSNorm per group,
    `GroupedGatedRMSNorm`).

    `forward(x [B, T, D], input_pos [T], position_embeddings=None) -> [B, T, D]` (the mixer contract of
    `etblocks.state.mixer`; no rope). States: `conv_state`, a `WindowState` of the last K - 1 `xBC` rows, and
    `ssm_state`, a `RecurrentState` `[B, H, P, N]` in fp32; caller-owned, it skips padding (tokens at position
    -1 get `dt = 0`: no decay, no write), so static programs pad short calls. A call of one token at a static
    length (eager, or a static program's `decode`) runs the recurrence step; any other the chunked scan.

    Modules keep the upstream names (`in_proj`, `conv1d`, `A_log`, `D`, `dt_bias`, `norm`, `out_proj`), so state
    dicts and adapter targets are the upstream ones.
    """

    def __init__(
        self,
        in_proj: nn.Module,
        conv1d: nn.Conv1d,
        A_log: nn.Parameter,
        D: nn.Parameter,
        dt_bias: nn.Parameter,
        norm: nn.Module,
        out_proj: nn.Module,
        *,
        n_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        caller_owned: bool = False,
        max_batch_size: int = 1,
    ) -> None:
        super().__init__()
        if n_heads % n_groups:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_groups={n_groups}")
        inner = n_heads * head_dim
        channels = inner + 2 * n_groups * state_size
        if conv1d.in_channels != channels or conv1d.groups != channels:
            raise ValueError(
                f"conv1d must be depthwise over the {channels} x/B/C channels; got in_channels={conv1d.in_channels}, "
                f"groups={conv1d.groups}"
            )
        for name, param in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
            if tuple(param.shape) != (n_heads,):
                raise ValueError(f"{name} must have shape [{n_heads}] (one per head); got {tuple(param.shape)}")
        self.n_heads, self.head_dim, self.n_groups, self.state_size = n_heads, head_dim, n_groups, state_size
        self.time_step_limit = tuple(time_step_limit)
        self.in_proj, self.conv1d, self.norm, self.out_proj = in_proj, conv1d, norm, out_proj
        self.A_log, self.D, self.dt_bias = A_log, D, dt_bias
        owned = dict(caller_owned=caller_owned)
        self.conv_state = WindowState(
            conv1d.kernel_size[0] - 1, channels, conv1d.weight.dtype, max_batch_size=max_batch_size, name="conv_state", **owned
        )
        batch = 1 if caller_owned else max_batch_size
        self.ssm_state = RecurrentState(
            (batch, n_heads, head_dim, state_size), torch.float32, name="ssm_state", skips_padding=caller_owned, **owned
        )

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        return F.silu(causal_depthwise_conv(window, self.conv1d))

    def time_steps(self, dt: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """`dt [B, T, H]` from the projection -> the scan's steps: bias, softplus, limits; 0 for padding."""
        dt = softplus(dt.float() + self.dt_bias.float())
        low, high = self.time_step_limit
        if (low, high) != (0.0, float("inf")):
            dt = torch.clamp(dt, min=low, max=high)
        if self.ssm_state.skips_padding:
            dt = dt * (input_pos >= 0).to(dt.dtype)[None, :, None]
        return dt

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        bsz = x.shape[0]
        inner = self.n_heads * self.head_dim
        groups_width = self.n_groups * self.state_size
        projected = self.in_proj(x)
        # workaround(executorch 1.5.1): slices, not split(): a split on the last dim can freeze a dynamic sequence
        # length in to_edge.
        gate = projected[..., :inner]
        xbc = self.convolve(self.conv_state.update(input_pos, projected[..., inner : 2 * inner + 2 * groups_width]))
        dt = self.time_steps(projected[..., 2 * inner + 2 * groups_width :], input_pos)
        heads = xbc[..., :inner].reshape(bsz, -1, self.n_heads, self.head_dim).float()
        B = xbc[..., inner : inner + groups_width].reshape(bsz, -1, self.n_groups, self.state_size).float()
        C = xbc[..., inner + groups_width :].reshape(bsz, -1, self.n_groups, self.state_size).float()
        A = -torch.exp(self.A_log.float())
        one_token = isinstance(x.shape[1], int) and x.shape[1] == 1
        scan = ssd_step if one_token else ssd_scan
        y, state = scan(heads, dt, A, B, C, self.ssm_state.read(input_pos))
        self.ssm_state.write(state)
        y = y + heads * self.D.float()[:, None]
        y = self.norm(y.reshape(bsz, -1, inner), gate)  # in fp32, as upstream
        return self.out_proj(y.to(x.dtype))
