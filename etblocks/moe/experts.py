"""Routed experts with static shapes, in two strategies over the same weights.

`DenseExperts` runs every expert on every token and weights the results by the router (experts outside a
token's top-k get weight 0): two wide linears in and one out, no indexing, so NPUs and fixed-shape compilers take
it whole; cost grows with the number of experts. `GatherExperts` reads only the top-k experts' weights for each
token (`weight[indices]`, then batched matmuls), so decode cost stays flat as experts are added; it keeps
`[N * k, I, D]` gathered weights per call, so its memory grows with the tokens per call (dynamic programs cap
them, see `etblocks.export.programs.dynamic_program`).

`GatherExperts` takes the router's top-k form, `x [N, D], weights [N, k], indices [N, k] -> [N, D]`;
`DenseExperts` its dense form, `x [N, D], weights [N, E] -> [N, D]` (`routing` says which). Both are built from
per-expert tensors in the `nn.Linear` layout: `gate`/`up` `[E, I, D]`, `down` `[E, D, I]`, optional biases
`[E, I]`, `[E, I]`, `[E, D]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """`act(gate) * up`, SiLU by default (Mixtral, Qwen-MoE, OLMoE, DeepSeek)."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.act = act

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class ClampedSwiGLU(nn.Module):
    """GPT-OSS: gate clamped above and up on both sides at `limit`, `(up + 1) * gate * sigmoid(alpha * gate)`."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha = alpha
        self.limit = limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class Experts(nn.Module, ABC):
    """What both strategies share: sizes and the activation. Subclasses pack the weights their way."""

    strategy: str
    routing: str  # "topk": forward(x, weights [N, k], indices [N, k]); "dense": forward(x, weights [N, E])

    def __init__(self, n_experts: int, hidden: int, intermediate: int, activation: nn.Module | None) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.activation = activation if activation is not None else SwiGLU()

    @classmethod
    def from_weights(
        cls,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        *,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        activation: nn.Module | None = None,
    ) -> Experts:
        """Experts from per-expert `gate`/`up` `[E, I, D]` and `down` `[E, D, I]` (copied into this strategy's
        layout; give biases all three or none)."""
        n_experts, intermediate, hidden = gate.shape
        if up.shape != gate.shape or down.shape != (n_experts, hidden, intermediate):
            raise ValueError(f"expert shapes do not fit: gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}")
        biases = (gate_bias, up_bias, down_bias)
        if any(b is None for b in biases) != all(b is None for b in biases):
            raise ValueError("give gate_bias, up_bias and down_bias together, or none")
        experts = cls(n_experts, hidden, intermediate, activation)
        with torch.no_grad():
            experts._pack(gate, up, down, *biases)
        return experts

    @abstractmethod
    def _pack(self, gate, up, down, gate_bias, up_bias, down_bias) -> None:
        """Hold the per-expert tensors (and biases or None) in this strategy's layout."""

    @abstractmethod
    def forward(self, x: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        """`x [N, D]` and the router's output in this strategy's `routing` form -> the weighted sum `[N, D]`."""

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}, experts={self.n_experts}, hidden={self.hidden}, intermediate={self.intermediate}"


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous(), requires_grad=False)


class DenseExperts(Experts):
    """Every expert on every token. `gate`/`up` are one `Linear(D, E*I)` each, `down` one `Linear(E*I, D)` over the
    router-weighted activations (the weighted sum over experts is that matmul's reduction); output biases enter as
    `weights @ down_bias`."""

    strategy = "dense"
    routing = "dense"

    def _pack(self, gate, up, down, gate_bias, up_bias, down_bias) -> None:
        e, i, d = gate.shape
        has_bias = gate_bias is not None
        self.gate = nn.Linear(d, e * i, bias=has_bias)
        self.up = nn.Linear(d, e * i, bias=has_bias)
        self.down = nn.Linear(e * i, d, bias=False)
        self.gate.weight = _parameter(gate.reshape(e * i, d))
        self.up.weight = _parameter(up.reshape(e * i, d))
        self.down.weight = _parameter(down.permute(1, 0, 2).reshape(d, e * i))
        self.down_bias = None
        if has_bias:
            self.gate.bias = _parameter(gate_bias.reshape(e * i))
            self.up.bias = _parameter(up_bias.reshape(e * i))
            self.down_bias = nn.Linear(e, d, bias=False)
            self.down_bias.weight = _parameter(down_bias.T)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        dense = weights.to(x.dtype)  # [N, E]
        gate = self.gate(x).view(n, self.n_experts, self.intermediate)
        up = self.up(x).view(n, self.n_experts, self.intermediate)
        hidden = self.activation(gate, up) * dense[..., None]
        out = self.down(hidden.view(n, self.n_experts * self.intermediate))
        if self.down_bias is not None:
            out = out + self.down_bias(dense)
        return out


class GatherExperts(Experts):
    """Only the chosen experts: each token gathers its top-k experts' weights and runs batched matmuls on them."""

    strategy = "gather"
    routing = "topk"

    def _pack(self, gate, up, down, gate_bias, up_bias, down_bias) -> None:
        self.gate_proj = _parameter(gate)  # [E, I, D]
        self.up_proj = _parameter(up)  # [E, I, D]
        self.down_proj = _parameter(down)  # [E, D, I]
        self.gate_bias = self.up_bias = self.down_bias = None
        if gate_bias is not None:
            self.gate_bias, self.up_bias, self.down_bias = (_parameter(b) for b in (gate_bias, up_bias, down_bias))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        n, k = indices.shape
        # One row per (token, slot), `m = N * k`, and a flat index: ExecuTorch's portable `index.Tensor` copies
        # rows far faster with a 1-D index than with `[N, k]`, and the gathered weights need no reshape.
        flat = indices.reshape(-1)
        rows = x[:, None].expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1])
        # Gathered weights as bmm's left operand, `[m, I, D] @ [m, D, 1]`: XNNPACK reads them as stored, where
        # `einsum("md,mid->mi")` lowered to a bmm on their transpose, a copy as large as the gather. The trailing
        # 1 stays to the end (a squeeze is an operator XNNPACK leaves to the CPU).
        column = rows[..., None]  # [m, D, 1]
        gate = torch.bmm(self.gate_proj[flat], column)
        up = torch.bmm(self.up_proj[flat], column)
        if self.gate_bias is not None:
            gate = gate + self.gate_bias[flat][..., None]
            up = up + self.up_bias[flat][..., None]
        hidden = self.activation(gate, up)  # [m, I, 1]
        out = torch.bmm(self.down_proj[flat], hidden)  # [m, D, 1]
        if self.down_bias is not None:
            out = out + self.down_bias[flat][..., None]
        # The router-weighted sum over the k slots as one more bmm, `[n, 1, k] @ [n, k, D]`: XNNPACK has no sum.
        out = torch.bmm(weights.to(out.dtype).view(n, 1, k), out.view(n, k, -1))
        return out.view(n, -1).to(x.dtype)


EXPERT_STRATEGIES: dict[str, type[Experts]] = {"dense": DenseExperts, "gather": GatherExperts}
