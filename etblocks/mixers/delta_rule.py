"""The gated delta rule: the recurrence of gated DeltaNet layers, in forms for different programs.

For each head, with state `S [Dk, Dv]`, decay `a_t = exp(g_t)` and write strength `beta_t`, token t does
    S = a_t S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
A `DeltaRule` maps `q, k [B, H, T, Dk]`, `v [B, H, T, Dv]`, `g, beta [B, H, T]` (fp32, q already scaled) and the
state before the call `[B, H, Dk, Dv]` to `(o [B, H, T, Dv], state after the call)`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from etblocks.ops import load_llama_custom_ops

# Sub-chunks of the chunked form: the WY system of a longer span loses precision (the same size upstream uses).
CHUNK = 64


class DeltaRule(nn.Module):
    """A form of the gated delta rule (see the module docstring)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class FusedDeltaRule(DeltaRule):
    """ExecuTorch's `llama::gated_delta_rule` kernel: one operator for any T, running the recurrence token by token
    on CPU. For dynamic CPU programs (XNNPACK, portable); NPUs cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        load_llama_custom_ops()

    def forward(self, q, k, v, g, beta, state):
        return torch.ops.llama.gated_delta_rule.default(q, k, v, torch.exp(g), beta, state)


def gated_delta_rule_steps(tokens: int) -> int:
    """Doublings that invert the unit lower-triangular system of `tokens` tokens: `ceil(log2(tokens))`."""
    return max(0, math.ceil(math.log2(tokens))) if tokens > 1 else 0


class ChunkedDeltaRule(DeltaRule):
    """The chunked (WY) form: a call's tokens at once, in matmuls, elementwise ops and constant masks only (no
    `cumsum`, `tril` or triangular solve), so NPU compilers and every CPU delegate can take it.

    Within a chunk the rule is `U = (I + A)^-1 [beta v, beta exp(G) k]` with `A` the strictly lower-triangular
    decayed `beta k k^T` and `G` the running sum of `g`; the inverse is the product `(I - N)(I + N^2)(I + N^4)...`
    of `N = -A` (nilpotent: `ceil(log2(T))` doublings are exact). A static length runs in sub-chunks of 64
    tokens; a dynamic one (T known only at run time) runs as one chunk with the doublings of `max_tokens`.
    """

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = max_tokens

    def forward(self, q, k, v, g, beta, state):
        tokens = q.shape[2]
        if isinstance(tokens, torch.SymInt):
            return self.chunk(q, k, v, g, beta, state, gated_delta_rule_steps(self.max_tokens))
        outputs = []
        for start in range(0, tokens, CHUNK):
            part = slice(start, min(start + CHUNK, tokens))
            o, state = self.chunk(q[:, :, part], k[:, :, part], v[:, :, part], g[..., part], beta[..., part], state,
                                  gated_delta_rule_steps(part.stop - part.start))
            outputs.append(o)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)), state

    @staticmethod
    def chunk(q, k, v, g, beta, state, steps: int):
        tokens = q.shape[2]
        idx = torch.arange(tokens, dtype=q.dtype, device=q.device)  # float: NPUs hold no int64
        causal = (idx[:, None] >= idx[None, :]).to(q.dtype)  # [T, T], 1 where key j <= query i
        strict = (idx[:, None] > idx[None, :]).to(q.dtype)
        cum = g @ causal.T  # [B, H, T]: G_i = sum_{j <= i} g_j, a matmul instead of cumsum
        # exp(G_i - G_j) for j <= i; clamped first so the (masked) upper triangle never overflows.
        decay = torch.exp((cum[..., :, None] - cum[..., None, :]).clamp(max=0)) * causal
        k_beta = k * beta[..., None]
        n = -(k_beta @ k.transpose(-1, -2)) * decay * strict  # N = -A
        rhs = torch.cat((v * beta[..., None], k_beta * torch.exp(cum)[..., None]), dim=-1)
        power = n
        for step in range(steps):  # rhs = (I + N + ... + N^(2^steps - 1)) rhs = (I - N)^-1 rhs
            rhs = rhs + power @ rhs
            if step + 1 < steps:
                power = power @ power
        dv = v.shape[-1]
        values, k_decayed = rhs[..., :dv], rhs[..., dv:]
        new_values = values - k_decayed @ state  # [B, H, T, Dv]
        o = (q * torch.exp(cum)[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ new_values
        last = cum[..., -1:]  # [B, H, 1]
        state = state * torch.exp(last)[..., None] + (k * torch.exp(last - cum)[..., None]).transpose(-1, -2) @ new_values
        return o, state
