"""LoRA over any linear-like module, unmerged: several named adapters over one base, one active at a time.

`y = base(x) + scale * (x @ A^T) @ B^T` with `A [r, in]`, `B [out, r]`. The base is an `nn.Linear` or an
`etblocks.attention.Conv2dLinear` (the qnn recipe's 1x1-conv projections: the LoRA path stays a pair of small
matmuls). Keeping adapters unmerged is what lets one base serve many of them; `merge` folds the active one into
the base weight when a single adapter is all a deployment needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class LoRATensors(NamedTuple):
    """One layer of an adapter as read from a file: `lora_A [r, in]`, `lora_B [out, r]` and the adapter's
    own scaling (`alpha / r`, or `alpha / sqrt(r)` with rsLoRA)."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scale: float


class LoRAWeights(nn.Module):
    """One adapter of one layer: `lora_A [r, in]`, `lora_B [out, r]` and its scale (`alpha / r`, or
    `alpha / sqrt(r)` with rsLoRA, times any user scale)."""

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> None:
        super().__init__()
        if lora_A.dim() != 2 or lora_B.dim() != 2 or lora_A.shape[0] != lora_B.shape[1]:
            raise ValueError(f"lora_A {tuple(lora_A.shape)} and lora_B {tuple(lora_B.shape)} are not [r, in] and [out, r]")
        self.lora_A = nn.Parameter(lora_A, requires_grad=False)
        self.lora_B = nn.Parameter(lora_B, requires_grad=False)
        self.scale = scale

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    def delta(self) -> torch.Tensor:
        """The update to the base weight, `[out, in]`."""
        return (self.lora_B @ self.lora_A) * self.scale

    def folded(self) -> LoRAWeights:
        """The same update with the scale in `lora_B` (new tensors; `lora_A` shared): one multiplication less."""
        return LoRAWeights(self.lora_A, self.lora_B * self.scale, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Two linears: exported with the adapter as constants (an adapter program), a delegate packs them once.
        A cast only where the dtypes differ: a no-op cast would export as a copy, which no longer is a constant."""
        lora_A, lora_B = (w if w.dtype == x.dtype else w.to(x.dtype) for w in (self.lora_A, self.lora_B))
        y = F.linear(F.linear(x, lora_A), lora_B)
        return y if self.scale == 1.0 else y * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


def batch_of_one(slot: torch.Tensor) -> torch.Tensor:
    """`slot` as `[1, *shape]` for `bmm`, by `view`: ExecuTorch runs a view of a buffer as an alias of it, where
    `slot[None]` (unsqueeze) would copy the whole slot on every call."""
    return slot.view(1, *slot.shape)


class SharedInput:
    """The LoRA layers of a program that read one input tensor (q/k/v, gate/up, a single-head block's per-head
    parts) and so share one `x @ A^T`: their `slot_a` holds every target's A side by side and each layer's
    `slot_b` its own B in its target's rows (zeros elsewhere). The first layer called computes the product and
    the others reuse it while their input is that same tensor object and the slot is unchanged: an input
    computed anew is projected anew, so a reuse is never stale. `owner` holds the group's `slot_a` buffer
    (dynamic programs; a static program passes it with every call)."""

    def __init__(self, owner: LoRALinear | None = None) -> None:
        self.owner = owner
        self._last: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None = None

    def project(self, x: torch.Tensor, flat: torch.Tensor, slot_a: torch.Tensor) -> torch.Tensor:
        """`flat @ slot_a` (`flat` is `x` as `[1, N, in]`), computed once per input `x` and slot."""
        last = self._last
        if last is not None and last[0] is x and last[1] is slot_a and last[2] == slot_a._version:
            return last[3]
        projected = torch.bmm(flat, batch_of_one(slot_a))
        self._last = (x, slot_a, slot_a._version, projected)
        return projected


class LoRALinear(nn.Module):
    """`base(x) + active_adapter(x)`; with no active adapter (`active is None`) exactly `base(x)`.

    `x [..., in] -> [..., out]`. Adapters live in `adapters[name]`; `set_adapter(name | None)` switches.
    `target` names the upstream module whose adapter tensors this layer takes (adapter files are keyed by it)
    and `rows` the part of that module's output rows it computes (`None`: all), e.g. one head of `q_proj` in
    single-head attention.
    """

    def __init__(self, base: nn.Module, target: str | None = None, rows: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.rows = rows
        self.slot_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shared_input: SharedInput | None = None
        self.adapters = nn.ModuleDict()
        self.active: str | None = None
        self.merged: str | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def add_adapter(self, name: str, weights: LoRAWeights) -> None:
        expected = (weights.rank, self.in_features), (self.out_features, weights.rank)
        if (tuple(weights.lora_A.shape), tuple(weights.lora_B.shape)) != expected:
            raise ValueError(
                f"adapter {name!r} has lora_A {tuple(weights.lora_A.shape)} and lora_B {tuple(weights.lora_B.shape)}; "
                f"this layer ({self.in_features} -> {self.out_features}) needs {expected[0]} and {expected[1]}"
            )
        self.adapters[name] = weights

    def set_adapter(self, name: str | None) -> None:
        if self.merged is not None:
            raise ValueError(f"adapter {self.merged!r} is merged into the base; unmerge() before switching")
        if name is not None and name not in self.adapters:
            raise KeyError(f"no adapter {name!r} on this layer; it has {sorted(self.adapters)}")
        self.active = name

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the active adapter into the base weight (`W += scale * B @ A`); forward then runs the base only."""
        if self.active is None or self.merged is not None:
            return
        self._base_weight().add_(self._delta_like_base(self.adapters[self.active]))
        self.merged = self.active

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take a merged adapter back out of the base weight (exact up to float rounding)."""
        if self.merged is None:
            return
        self._base_weight().sub_(self._delta_like_base(self.adapters[self.merged]))
        self.merged = None

    def _base_weight(self) -> torch.Tensor:
        return self.base.weight

    def _delta_like_base(self, weights: LoRAWeights) -> torch.Tensor:
        weight = self._base_weight()
        return weights.delta().to(weight.dtype).view(weight.shape)  # Conv2dLinear keeps [out, in, 1, 1]

    @property
    def max_rank(self) -> int:
        return max((weights.rank for weights in self.adapters.values()), default=0)

    def add_slot(self, rank: int, owns_a: bool = True) -> None:
        """Run the LoRA path from zeroed buffers, `slot_a [in, rank]` (A^T) and `slot_b [rank, out]` (scale *
        B^T), instead of the named adapters: an exported program keeps them as mutable state that a method fills
        at run time with any adapter of rank <= `rank` (zero-padded; all zeros is the base model). A layer whose
        `shared_input` another layer owns (`owns_a=False`) reads that layer's `slot_a`."""
        if self.merged is not None:
            raise ValueError(f"adapter {self.merged!r} is merged into the base; unmerge() before adding a slot")
        dtype = self._base_weight().dtype
        if owns_a:
            self.register_buffer("slot_a", torch.zeros(self.in_features, rank, dtype=dtype), persistent=False)
        self.register_buffer("slot_b", torch.zeros(rank, self.out_features, dtype=dtype), persistent=False)

    def remove_slot(self) -> None:
        self._buffers.pop("slot_a", None)
        del self.slot_b
        self.shared_input = None

    @property
    def has_slot(self) -> bool:
        return "slot_b" in self._buffers

    def _slots(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`slot_inputs` (a static program's inputs, set by the program for one call), else the slot buffers."""
        if self.slot_inputs is not None:
            return self.slot_inputs
        if not self.has_slot:
            return None
        owner = self if self.shared_input is None or self.shared_input.owner is None else self.shared_input.owner
        return owner.slot_a, self.slot_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The slots (see `_slots`) come first, then the named adapters."""
        y = self.base(x)
        slots = self._slots()
        if slots is not None:  # batched matmuls over views of the slots: a delegate takes them as inputs, not constants
            slot_a, slot_b = slots
            flat = x if x.dim() == 3 and x.shape[0] == 1 else x.reshape(1, -1, x.shape[-1])
            shared = self.shared_input
            projected = torch.bmm(flat, batch_of_one(slot_a)) if shared is None else shared.project(x, flat, slot_a)
            delta = torch.bmm(projected, batch_of_one(slot_b))
            return y + (delta if flat is x else delta.view(y.shape))
        if self.active is None or self.merged is not None:
            return y
        return y + self.adapters[self.active](x)

    def extra_repr(self) -> str:
        slot = f", slot_rank={self.slot_b.shape[0]}" if self.has_slot else ""  # a grouped layer may own no slot_a
        return f"adapters={sorted(self.adapters)}, active={self.active!r}, merged={self.merged!r}{slot}"
