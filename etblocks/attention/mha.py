"""One attention block for MHA, GQA and MQA."""

from __future__ import annotations

import functools

from typing import Literal

import torch
from torch import nn

from etblocks.attention.rope import RotaryEmbedding, apply_rotary, rotation_matrix
from etblocks.attention.sdpa import SDPA
from etblocks.state.io import IOKVCache
from etblocks.state.kv import KVCache
from etblocks.state.mixer import call_with_state
from etblocks.state.shared import KVShare

QKNormLayout = Literal["head", "full", "heads_first"]
GateActivation = Literal["sigmoid", "softplus"]
GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "softplus": torch.nn.functional.softplus}


def check_sinks(sinks: torch.Tensor | None, n_heads: int, sdpa: SDPA) -> None:
    """Sinks must be one logit per query head, for an SDPA that can apply them."""
    if sinks is None:
        return
    if tuple(sinks.shape) != (n_heads,):
        raise ValueError(f"sinks must have shape [{n_heads}] (one per query head); got {tuple(sinks.shape)}")
    if not sdpa.supports_sinks:
        raise ValueError(f"{type(sdpa).__name__} cannot apply attention sinks; use DynamicSDPA or StaticSDPA")


def check_rope(rope: RotaryEmbedding | None, head_dim: int) -> None:
    """An interleaved rope must rotate the whole head (partial rotary is a rotate-half scheme)."""
    if rope is not None and rope.interleaved and rope.rotary_dim != head_dim:
        raise ValueError(f"an interleaved rope must cover the whole head_dim={head_dim}; it covers {rope.rotary_dim}")


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, rotary embeddings and an owned or caller-owned KV cache.

    `forward(x [B, T, D], input_pos [T]) -> [B, T, D]`, where `input_pos` holds the absolute positions of the
    T tokens (consecutive): the mixer contract of `etblocks.state.mixer`. A caller-owned cache (`IOKVCache`)
    reads the caches and mask its static program binds; called by hand, the block takes them as
    `kv=(k_cache, v_cache)` (the tensors the cache declares: six for a `QuantizedIOKVCache`) and `mask`, and
    returns `(y, *new_rows)`.

    Projections are `q_proj`, `k_proj`, `v_proj` (or one fused `qkv_proj`, its rows `[q | k | v]` with
    `qkv_layout="blocks"` or `[q_h | k_h | v_h]` per head with `"heads"`) and `o_proj`. Optional `q_norm` /
    `k_norm` apply per head (`"head"`), over the whole projection (`"full"`) or on a `[B, H, T, D]` view
    (`"heads_first"`), before rope or, per head, after it (`qk_norm_after_rope`: NanoChat). An optional `o_norm`
    normalises the heads' output before `o_proj` (BitNet's sub-norm), an optional `v_norm` each value head before
    the cache (Gemma 3n, Gemma 4); `values_from_keys` takes the values from the key projection, before its norm
    and rope (Gemma 4's K=V layers). `kv_share`, when set, publishes what the block attends over in each call for
    the blocks that share its keys and values (`KVSharedAttention`). Optional `sinks [H]` are per-head sink
    logits (GPT-OSS): the block owns them, like its
    projections, so they keep the upstream key `<block>.sinks`, and hands them to its SDPA. `interleaved` says
    which dims rotary tables pair: `(i, i + R/2)` (rotate-half, False) or `(2i, 2i + 1)` (True); by default the
    layout of the block's own `rope`. Subclasses change one step by overriding `project_qkv`, `normalize_qk`,
    `rotate` or `attend`.
    """

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        sdpa: SDPA,
        kv_cache: KVCache | IOKVCache | None,
        q_proj: nn.Module | None,
        k_proj: nn.Module | None,
        v_proj: nn.Module | None,
        o_proj: nn.Module,
        qkv_proj: nn.Module | None = None,
        rope: RotaryEmbedding | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        qk_norm_layout: QKNormLayout = "head",
        sinks: nn.Parameter | None = None,
        interleaved: bool | None = None,
        qkv_layout: str = "blocks",
        qk_norm_after_rope: bool = False,
        o_norm: nn.Module | None = None,
        v_norm: nn.Module | None = None,
        values_from_keys: bool = False,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        check_sinks(sinks, n_heads, sdpa)
        check_rope(rope, head_dim)
        if (qkv_proj is None) == (q_proj is None):
            raise ValueError("give either q_proj, k_proj and v_proj, or one fused qkv_proj")
        if values_from_keys and (v_proj is not None or qkv_proj is not None):
            raise ValueError("values_from_keys=True takes the values from k_proj: give no v_proj and no fused qkv_proj")
        self.values_from_keys = values_from_keys
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        if qkv_layout not in ("blocks", "heads") or (qkv_layout == "heads" and n_kv_heads != n_heads):
            raise ValueError(f"qkv_layout={qkv_layout!r} with {n_kv_heads} of {n_heads} kv heads is not supported; accepted: 'blocks', or 'heads' without grouping")
        self.qkv_layout = qkv_layout
        self.q_proj, self.k_proj, self.v_proj, self.qkv_proj, self.o_proj = q_proj, k_proj, v_proj, qkv_proj, o_proj
        self.q_norm, self.k_norm, self.v_norm, self.o_norm = q_norm, k_norm, v_norm, o_norm
        self.qk_norm_layout = qk_norm_layout
        self.qk_norm_after_rope = qk_norm_after_rope
        self.rope = rope
        self.interleaved = rope is not None and rope.interleaved if interleaved is None else interleaved
        # Interleaved pairs rotate through a constant linear map; rotate-half through slices and a concat (as SHA
        # does). In XNNPACK programs of dynamic length those slices run on CPU, and still decoded and prefilled faster
        # than the same rotation as a [Dh, Dh] linear inside the delegate (SmolLM2's shape, fp32 and 8da4w).
        rotation = rotation_matrix(head_dim, interleaved=True) if self.interleaved else None
        self.register_buffer("rotation", rotation, persistent=False)
        self.sdpa = sdpa
        self.kv_cache = kv_cache
        self.register_parameter("sinks", sinks)
        self.kv_share: KVShare | None = None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x [B, T, D]` -> flat `q [B, T, H*Dh]`, `k, v [B, T, Hkv*Dh]`."""
        if self.qkv_proj is None:
            k = self.k_proj(x)
            return self.q_proj(x), k, k if self.values_from_keys else self.v_proj(x)
        qkv = self.qkv_proj(x)
        if self.qkv_layout == "heads":  # [q_h | k_h | v_h] per head (GPT-NeoX)
            bsz, dh, width = x.shape[0], self.head_dim, self.n_heads * self.head_dim
            heads = qkv.view(bsz, -1, self.n_heads, 3 * dh)
            return tuple(heads[..., i * dh : (i + 1) * dh].reshape(bsz, -1, width) for i in range(3))
        q_width = self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * self.head_dim
        # workaround(executorch 1.5.1): slices, not split(): split on the last dim can freeze a dynamic sequence
        # length in to_edge.
        return qkv[..., :q_width], qkv[..., q_width : q_width + kv_width], qkv[..., q_width + kv_width :]

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply q/k norms; called once on the flat projections and once on `[B, T, H, Dh]` views."""
        if self.q_norm is None or (self.qk_norm_layout == "full") == per_head:
            return q, k
        if self.qk_norm_layout == "heads_first":
            return self.q_norm(q.transpose(1, 2)).transpose(1, 2), self.k_norm(k.transpose(1, 2)).transpose(1, 2)
        return self.q_norm(q), self.k_norm(k)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor | None, input_pos: torch.Tensor, position_embeddings=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotary embeddings from the given `(cos, sin)` or from this block's own `rope` (whose layout `rotation`
        follows); none if neither. `k` may be None (a block that reads shared keys rotates only its queries)."""
        if position_embeddings is None:
            if self.rope is None:
                return q, k
            position_embeddings = self.rope(input_pos)
        cos, sin = position_embeddings
        rotate = functools.partial(apply_rotary, cos=cos, sin=sin, rotation=self.rotation, interleaved=self.interleaved)
        return rotate(q), None if k is None else rotate(k)

    def attend(self, q, k, v, q_pos, k_pos, mask=None) -> torch.Tensor:
        return self.sdpa(q, k, v, q_pos, k_pos, mask, sinks=self.sinks)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None, kv=None, mask=None):
        if kv is not None:
            return call_with_state(self.kv_cache, kv, mask, lambda: self.forward(x, input_pos, position_embeddings))
        q, k, v = self.project_qkv(x)
        return self.project_out(self.attend_heads(q, k, v, input_pos, position_embeddings, mask))

    def project_out(self, heads: torch.Tensor) -> torch.Tensor:
        """The heads' output `[B, T, H*Dh]` -> `[B, T, D]`: `o_norm` (if any), then `o_proj`."""
        return self.o_proj(heads if self.o_norm is None else self.o_norm(heads))

    def attend_heads(self, q, k, v, input_pos, position_embeddings=None, mask=None) -> torch.Tensor:
        """Flat projections `q [B, T, H*Dh]`, `k, v [B, T, Hkv*Dh]` -> the heads' outputs `[B, T, H*Dh]`: norms,
        rotation, the cache and SDPA (everything between the projections)."""
        bsz = q.shape[0]
        q, k = self.normalize_qk(q, k, per_head=False)
        # -1 rather than the (dynamic) length: XNNPACK delegates reshapes whose only non-constant size is inferred.
        q = q.view(bsz, -1, self.n_heads, self.head_dim)
        k = k.view(bsz, -1, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, -1, self.n_kv_heads, self.head_dim)
        if not self.qk_norm_after_rope:
            q, k = self.normalize_qk(q, k, per_head=True)
        q, k = self.rotate(q, k, input_pos, position_embeddings)
        if self.qk_norm_after_rope:
            q, k = self.normalize_qk(q, k, per_head=True)
        if self.v_norm is not None:
            v = self.v_norm(v)

        if self.kv_cache is None:
            k_all, v_all, k_pos = k, v, input_pos
        else:
            k_all, v_all, k_pos = self.kv_cache.update(input_pos, k, v)
            mask = self.kv_cache.mask if mask is None else mask
        if self.kv_share is not None:
            self.kv_share.publish(k_all, v_all, k_pos, mask)
        y = self.attend(q, k_all, v_all, input_pos, k_pos, mask)
        return y.reshape(bsz, -1, self.n_heads * self.head_dim)


class GatedAttention(Attention):
    """Attention with an output gate, `y = o_proj(heads * act(gate))`: from `q_proj`, which gives each head's
    query and gate side by side (`[q_h | gate_h]`, 2 * Dh rows per head: Qwen3-Next, Qwen3.5), or from its own
    `gate_proj` (`[B, T, D] -> [B, T, H*Dh]`: AFMoE; `[B, T, H]`, one gate per head, with `gate_per_head`: LFM3,
    Laguna). `gate_activation` is "sigmoid" or "softplus" (Laguna). Separate q/k/v projections only; everything
    else as in `Attention`."""

    def __init__(
        self, *args, gate_proj: nn.Module | None = None, gate_per_head: bool = False,
        gate_activation: GateActivation = "sigmoid", **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.qkv_proj is not None:
            raise ValueError("GatedAttention takes separate q_proj (queries and gates), k_proj and v_proj, not a fused qkv_proj")
        if gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_activation={gate_activation!r} is not supported; accepted: {sorted(GATE_ACTIVATIONS)}")
        if gate_per_head and gate_proj is None:
            raise ValueError("gate_per_head=True needs a gate_proj giving one gate per head")
        self.gate_proj = gate_proj
        self.gate_per_head = gate_per_head
        self.gate_activation = gate_activation

    def query_and_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [B, T, D]` -> flat `q [B, T, H*Dh]` and the gate's logits (`[B, T, H*Dh]`, or `[B, T, H]` per head)."""
        if self.gate_proj is not None:
            return self.q_proj(x), self.gate_proj(x)
        bsz, width = x.shape[0], self.n_heads * self.head_dim
        both = self.q_proj(x).view(bsz, -1, self.n_heads, 2 * self.head_dim)
        return both[..., : self.head_dim].reshape(bsz, -1, width), both[..., self.head_dim :].reshape(bsz, -1, width)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None, kv=None, mask=None):
        if kv is not None:
            return super().forward(x, input_pos, position_embeddings, kv, mask)
        q, gate = self.query_and_gate(x)
        y = self.attend_heads(q, self.k_proj(x), self.v_proj(x), input_pos, position_embeddings, mask)
        gate = GATE_ACTIVATIONS[self.gate_activation](gate)
        if self.gate_per_head:
            bsz = x.shape[0]
            gated = y.view(bsz, -1, self.n_heads, self.head_dim) * gate.unsqueeze(-1)
            return self.project_out(gated.view(bsz, -1, self.n_heads * self.head_dim))
        return self.project_out(y * gate)
