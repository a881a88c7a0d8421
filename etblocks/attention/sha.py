"""Single-head attention (SHA): every head is its own 3-D computation, for Qualcomm HTP-style NPUs.

HTP runs many small `[B, T, Dh]` matmuls faster than one multi-head attention with its 4-D reshapes and
transposes, so this block projects, normalizes, rotates and attends one head at a time. It computes what
`Attention` computes with an `IOKVCache` (caller-owned caches, caller's additive mask) or with no cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

from etblocks.attention.conv import Conv2dLinear
from etblocks.attention.masks import additive_mask
from etblocks.attention.mha import GATE_ACTIVATIONS, Attention, GateActivation, GatedAttention, check_rope, check_sinks
from etblocks.attention.rope import RotaryEmbedding, rotate_half, rotate_pairs
from etblocks.attention.sdpa import SDPA, softmax_with_sinks
from etblocks.state.io import IOKVCache
from etblocks.state.mixer import call_with_state
from etblocks.state.shared import KVShare

RotaryTables = tuple[torch.Tensor, torch.Tensor]


def apply_rotary_3d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate one head `x [B, T, Dh]` by `cos, sin [T, R]` (or `[B, T, R]`), R <= Dh; dims R: pass through.
    `interleaved` tables rotate pairs `(2i, 2i + 1)` (of the first R dims)."""
    rotary_dim = cos.shape[-1]
    partner = rotate_pairs if interleaved else rotate_half
    if rotary_dim == x.shape[-1]:
        return x * cos + partner(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + partner(x_rot) * sin, x_pass), dim=-1)


def _linear_view(weight: torch.Tensor, bias: torch.Tensor | None, conv2d: bool) -> nn.Module:
    """A Linear (or Conv2dLinear) whose parameters are the given views: no copy of the original weights."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=weight.requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)
    return Conv2dLinear.from_linear(linear) if conv2d else linear


def _as_linear(proj: nn.Module | None, name: str) -> nn.Linear:
    if not isinstance(proj, nn.Linear):
        raise TypeError(f"SingleHeadAttention.from_attention slices nn.Linear weights; {name} is {type(proj).__name__}")
    return proj


class ProjectionPart(NamedTuple):
    """Submodule `module` (a path inside the block, e.g. `q_heads.1`) computes output rows `[start, stop)` of
    the projection it was split from; `rows=None`: all of them (a projection the block only renamed)."""

    module: str
    rows: tuple[int, int] | None


def head_parts(heads: str, start: int, n_heads: int, head_dim: int, stride: int | None = None) -> list[ProjectionPart]:
    """Head h of the ModuleList `heads` computes rows `start + h*stride : start + h*stride + Dh` (stride: Dh)."""
    stride = head_dim if stride is None else stride
    return [ProjectionPart(f"{heads}.{h}", (start + h * stride, start + h * stride + head_dim)) for h in range(n_heads)]


def _head_views(proj: nn.Linear, parts: list[ProjectionPart], conv2d: bool) -> list[nn.Module]:
    """One module per part over its rows of `proj`'s weight and bias."""
    heads = []
    for part in parts:
        rows = slice(*part.rows)
        bias = None if proj.bias is None else proj.bias[rows]
        heads.append(_linear_view(proj.weight[rows], bias, conv2d))
    return heads


class SingleHeadAttention(nn.Module):
    """Attention as H single-head computations on `[B, T, Dh]` tensors; GQA by reading KV head `h // (H / Hkv)`.

    `forward(x [B, T, D], input_pos [T], position_embeddings=None, kv=None, mask=None) -> y [B, T, D]`:
    - with an `IOKVCache`: it reads the caches `[B, S, Hkv, Dh]` and mask `[T, S + T]` its static program binds
      and emits the new rows `[B, T, Hkv, Dh]`; called by hand it takes them as `kv=(k_cache, v_cache)` and
      `mask` and returns `(y, k_new, v_new)`.
    - with no cache: `mask [T, T]`.
    The mask is additive (a boolean one is converted); it alone decides which keys are read, so a sliding
    window lives in the caller's mask (`sdpa.sliding_window` is kept for callers that build it).

    `q_heads`, `k_heads`, `v_heads` map `[B, T, D] -> [B, T, Dh]`; `o_proj` maps the concatenated heads
    `[B, T, H*Dh] -> [B, T, D]`. `q_norm` / `k_norm` are shared by all heads. Scale and softcap come from
    `sdpa`; optional `sinks [H]` give head h the sink logit `sinks[h]`. Subclasses change one step by
    overriding `project_head`, `rotate_head` or `attend_head`. Optional `gate_heads` (`[B, T, D] -> [B, T, Dh]`,
    or `[B, T, 1]` for one gate per head) gate each head's output by `act(gate_heads[h](x))` (the output gate of
    `GatedAttention`, `act` its `gate_activation`). An optional `o_norm` normalises the concatenated heads
    before `o_proj`, as `Attention`'s does; `v_norm` and `values_from_keys` act as `Attention`'s do. `kv_share`
    publishes the per-head keys and values (lists) and the mask of each call; a block given `reads` has no k/v heads
    and no cache and attends over what that share holds (`KVSharedAttention`'s per-head form).

    `projection_parts[name]` says where projection `name` of the attention the heads were split from went, as
    `ProjectionPart(submodule, rows)` per head, so what is keyed by the original projection (LoRA adapters)
    still finds it. The default, `None`, means heads of separate `q_proj`, `k_proj`, `v_proj`; `o_proj` is not
    split and keeps its name.
    """

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        sdpa: SDPA,
        kv_cache: IOKVCache | None,
        q_heads: Sequence[nn.Module],
        k_heads: Sequence[nn.Module],
        v_heads: Sequence[nn.Module],
        o_proj: nn.Module,
        rope: RotaryEmbedding | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        sinks: nn.Parameter | None = None,
        projection_parts: Mapping[str, list[ProjectionPart]] | None = None,
        gate_heads: Sequence[nn.Module] | None = None,
        interleaved: bool | None = None,
        o_norm: nn.Module | None = None,
        gate_activation: GateActivation = "sigmoid",
        v_norm: nn.Module | None = None,
        values_from_keys: bool = False,
        reads: KVShare | None = None,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        check_sinks(sinks, n_heads, sdpa)
        check_rope(rope, head_dim)
        n_k = 0 if reads is not None else n_kv_heads
        n_v = 0 if reads is not None or values_from_keys else n_kv_heads
        if (len(q_heads), len(k_heads), len(v_heads)) != (n_heads, n_k, n_v):
            raise ValueError(
                f"need {n_heads} q_heads, {n_k} k_heads and {n_v} v_heads (none that another block's keys and values "
                f"or the keys make); got {len(q_heads)}, {len(k_heads)}, {len(v_heads)}"
            )
        if reads is not None and kv_cache is not None:
            raise ValueError("a SingleHeadAttention that reads another block's keys and values holds no cache")
        if kv_cache is not None and not isinstance(kv_cache, IOKVCache):
            raise ValueError(f"SingleHeadAttention takes an IOKVCache or no cache; got {type(kv_cache).__name__}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.sdpa = sdpa
        self.kv_cache = kv_cache
        self.q_heads = nn.ModuleList(q_heads)
        self.k_heads = nn.ModuleList(k_heads)
        self.v_heads = nn.ModuleList(v_heads)
        self.o_proj = o_proj
        self.rope = rope
        self.interleaved = rope is not None and rope.interleaved if interleaved is None else interleaved
        self.q_norm, self.k_norm, self.v_norm, self.o_norm = q_norm, k_norm, v_norm, o_norm
        self.values_from_keys = values_from_keys
        self.reads = reads
        self.kv_share: KVShare | None = None
        self.register_parameter("sinks", sinks)
        if gate_heads is not None and len(gate_heads) != n_heads:
            raise ValueError(f"need {n_heads} gate_heads; got {len(gate_heads)}")
        self.gate_heads = None if gate_heads is None else nn.ModuleList(gate_heads)
        self.gate_activation = gate_activation
        if projection_parts is None:
            projection_parts = {
                "q_proj": head_parts("q_heads", 0, n_heads, head_dim),
                "k_proj": head_parts("k_heads", 0, n_kv_heads, head_dim),
                "v_proj": head_parts("v_heads", 0, n_kv_heads, head_dim),
            }
        self.projection_parts = dict(projection_parts)

    @classmethod
    def from_attention(cls, attn: Attention, conv2d: bool = False) -> SingleHeadAttention:
        """The same attention as `attn`, split per head. Head weights are views of `attn`'s (no copy); norms,
        rope, SDPA, cache, sinks and the keys and values it shares or reads (`kv_share`, a `KVSharedAttention`'s
        `reads`) are `attn`'s own. `conv2d=True` makes every projection a `Conv2dLinear`."""
        if (attn.q_norm is not None or attn.k_norm is not None) and attn.qk_norm_layout != "head":
            raise ValueError(
                f"qk_norm_layout={attn.qk_norm_layout!r} is not supported: SingleHeadAttention needs per-head "
                "q/k norms (layout 'head') that apply to each [B, T, Dh] head"
            )
        if attn.qk_norm_after_rope:
            raise ValueError("q/k norms after rope are not supported: SingleHeadAttention normalises each head as it projects it")
        if attn.qkv_proj is not None and attn.qkv_layout != "blocks":
            raise ValueError(f"qkv_layout={attn.qkv_layout!r} is not supported: SingleHeadAttention splits a fused qkv_proj laid out in 'blocks'")
        heads, kv_heads, dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
        gated = isinstance(attn, GatedAttention)
        packed = gated and attn.gate_proj is None  # a gated q_proj holds [q_h | gate_h] per head
        reads = getattr(attn, "reads", None)  # a `KVSharedAttention`: queries only, over its source's keys and values
        skipped = {"k_heads", "v_heads"} if reads is not None else {"v_heads"} if attn.values_from_keys else set()
        if not gated:
            skipped.add("gate_heads")
        fields = ("q_heads", "k_heads", "v_heads", "gate_heads")
        counts, strides = (heads, kv_heads, kv_heads, heads), (2 * dh if packed else dh, dh, dh, 2 * dh if packed else dh)
        if attn.qkv_proj is None:
            names = ("q_proj", "k_proj", "v_proj", "q_proj" if packed else "gate_proj")
            starts = (0, 0, 0, dh if packed else 0)
        else:  # rows [q | k | v] of the fused projection
            names, starts = ("qkv_proj",) * 3, (0, heads * dh, (heads + kv_heads) * dh)
        sizes = (dh, dh, dh, 1 if gated and attn.gate_per_head else dh)  # rows per head of each projection
        split, projection_parts = {}, {}
        for field, n, name, start, stride, size in zip(fields, counts, names, starts, strides, sizes):
            if field in skipped:
                continue
            parts = head_parts(field, start, n, size, stride if size == dh else size)
            split[field] = _head_views(_as_linear(getattr(attn, name), name), parts, conv2d)
            projection_parts.setdefault(name, []).extend(parts)
        o_proj = Conv2dLinear.from_linear(_as_linear(attn.o_proj, "o_proj")) if conv2d else attn.o_proj
        block = cls(
            heads, kv_heads, dh, attn.sdpa, attn.kv_cache, split["q_heads"], split.get("k_heads", []),
            split.get("v_heads", []), o_proj, rope=attn.rope, q_norm=attn.q_norm, k_norm=attn.k_norm, sinks=attn.sinks,
            projection_parts=projection_parts, gate_heads=split.get("gate_heads"), interleaved=attn.interleaved,
            o_norm=attn.o_norm, gate_activation=attn.gate_activation if gated else "sigmoid", v_norm=attn.v_norm,
            values_from_keys=attn.values_from_keys, reads=reads,
        )
        block.kv_share = attn.kv_share
        return block

    def project_head(self, proj: nn.Module, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """`x [B, T, D]` -> one head `[B, T, Dh]`, normalized by `norm` if given."""
        y = proj(x)
        return y if norm is None else norm(y)

    def rotary_tables(self, input_pos: torch.Tensor, position_embeddings: RotaryTables | None) -> RotaryTables | None:
        """`(cos, sin) [T, R]` from the caller or this block's own `rope`; None (no rotation) if neither."""
        if position_embeddings is None:
            if self.rope is None:
                return None
            position_embeddings = self.rope(input_pos)
        return position_embeddings

    def rotate_head(self, x: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        """Rotary embedding of one q or k head `[B, T, Dh]`, in this block's pair layout (`interleaved`)."""
        if tables is None:
            return x
        return apply_rotary_3d(x, *tables, interleaved=self.interleaved)

    def attend_head(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`q [B, T, Dh]` over `k, v [B, S, Dh]` with the additive `mask [T, S]` and the head's `sink [1]` logit
        (if any) -> `[B, T, Dh]`."""
        # bmm, not matmul: matmul decomposes into expands that XNNPACK leaves on CPU.
        scores = torch.bmm(q, k.transpose(1, 2)) * self.sdpa.scale  # [B, T, S]
        if self.sdpa.softcap is not None:
            scores = torch.tanh(scores / self.sdpa.softcap) * self.sdpa.softcap
        probs = softmax_with_sinks(scores + mask, sink).to(v.dtype)
        return torch.bmm(probs, v)

    def forward(
        self,
        x: torch.Tensor,
        input_pos: torch.Tensor,
        position_embeddings: RotaryTables | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if kv is not None:
            return call_with_state(self.kv_cache, kv, mask, lambda: self.forward(x, input_pos, position_embeddings))
        caches = None if self.kv_cache is None else self.kv_cache.bound()
        if mask is None and self.kv_cache is not None:
            mask = self.kv_cache.mask
        if self.reads is not None:  # another block's keys and values, as it attended over them
            keys, values, _, source_mask = self.reads.read()
            mask = source_mask if mask is None else mask
        if mask is None:
            raise ValueError("SingleHeadAttention is a static block: it needs the caller's additive `mask` [T, S]")
        if mask.dtype == torch.bool:
            mask = additive_mask(mask, x.dtype)
        tables = self.rotary_tables(input_pos, position_embeddings)
        if tables is not None:
            tables = tuple(t.to(x.dtype) for t in tables)

        if self.reads is None:
            if self.values_from_keys:  # values are the keys' projection, before its norm and rope
                k_raw = [self.project_head(proj, x) for proj in self.k_heads]
                k_new = [self.rotate_head(k if self.k_norm is None else self.k_norm(k), tables) for k in k_raw]
                v_new = [k if self.v_norm is None else self.v_norm(k) for k in k_raw]
            else:
                k_new = [self.rotate_head(self.project_head(proj, x, self.k_norm), tables) for proj in self.k_heads]
                v_new = [self.project_head(proj, x, self.v_norm) for proj in self.v_heads]
            if caches is None:
                keys, values = k_new, v_new
            else:
                k_cache, v_cache = caches
                keys = [torch.cat((k_cache[:, :, j], k), dim=1) for j, k in enumerate(k_new)]
                values = [torch.cat((v_cache[:, :, j], v), dim=1) for j, v in enumerate(v_new)]
            if self.kv_share is not None:
                self.kv_share.publish(keys, values, None, mask)

        groups = self.n_heads // self.n_kv_heads
        heads = []
        for h, proj in enumerate(self.q_heads):
            q = self.rotate_head(self.project_head(proj, x, self.q_norm), tables)
            args = (q, keys[h // groups], values[h // groups], mask)
            # No sink argument without sinks: `attend_head` overrides written for (q, k, v, mask) keep working.
            # workaround(executorch 1.5.1): a `[1]` slice, not a 0-d `sinks[h]`: QNN's export passes break on the
            # expanded 0-d constant.
            head = self.attend_head(*args) if self.sinks is None else self.attend_head(*args, self.sinks[h : h + 1])
            heads.append(head if self.gate_heads is None else head * GATE_ACTIVATIONS[self.gate_activation](self.gate_heads[h](x)))
        y = torch.cat(heads, dim=-1)
        y = self.o_proj(y if self.o_norm is None else self.o_norm(y))
        if caches is not None:
            self.kv_cache.emit(torch.stack(k_new, dim=2), torch.stack(v_new, dim=2))
        return y
