"""Scaled dot-product attention in three forms, all on `[B, T, H, D]` queries and `[B, S, Hkv, D]` keys/values.

- `CustomSDPA`: ExecuTorch's `llama::custom_sdpa` over a positional cache (fast XNNPACK/CPU decode);
  `QuantizedCustomSDPA` is `llama::custom_quantized_sdpa` over an int8 one; `MaskedCustomSDPA` is the same kernel
  with a mask from positions, for rings and sliding windows.
- `DynamicSDPA`: plain torch; builds its mask from positions, so it also serves ring caches and softcaps.
- `StaticSDPA`: plain torch over a fixed-size cache with an additive mask the caller gives (static programs).

GQA is computed by grouping queries per KV head, never by repeating K/V. The plain-torch forms also take
attention sinks (GPT-OSS): one learned logit per head that takes probability mass but reads no value.
"""

from __future__ import annotations

import torch
from torch import nn

from etblocks.attention.masks import additive_mask, allowed_keys
from etblocks.ops import load_llama_custom_ops, quantize_rows


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 softmax over the last dim of `scores [..., S]`; `sinks` (broadcastable to `[..., 1]`) is one more
    logit per row whose probability is dropped, so the row's weights sum to less than 1.

    The sink is concatenated as a column, softmaxed with the row and sliced off, as upstream GPT-OSS does.
    XNNPACK takes the concat and softmax; at a dynamic T only the slice stays on CPU (it slices static shapes
    only), where the equal rescale by `sigmoid(logsumexp - sink)` leaves its max and sum reductions there.
    """
    scores = scores.float()
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1).narrow(-1, 0, scores.shape[-1])


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention. `mask` is boolean (True = attend) or additive, shaped `[T, S]`; `sinks [H]` are
    optional per-head sink logits.

    `q [B, T, H, D]`, `k [B, S, Hkv, D]`, `v [B, S, Hkv, Dv]` -> `[B, T, H, Dv]` (Dv may differ from D, as in MLA).
    """
    bsz, q_len, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    v_head_dim = v.shape[-1]
    groups = n_heads // n_kv_heads
    # [B, Hkv, G*T, D]: the G query heads that share one KV head attend as one longer query block.
    q = q.view(bsz, q_len, n_kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4).reshape(bsz, n_kv_heads, groups * q_len, head_dim)
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, G*T, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if groups > 1:
        mask = mask.repeat(groups, 1)  # row g*T + t of the block is query t of group g
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        probs = softmax_with_sinks(scores)
    else:  # row g*T + t of KV head j is query head j*G + g
        column = sinks.view(n_kv_heads, groups, 1, 1).expand(-1, -1, q_len, -1).reshape(1, n_kv_heads, -1, 1)
        probs = softmax_with_sinks(scores, column)
    out = torch.matmul(probs.to(v.dtype), v)  # [B, Hkv, G*T, Dv]
    return out.view(bsz, n_kv_heads, groups, q_len, v_head_dim).permute(0, 3, 1, 2, 4).reshape(bsz, q_len, n_heads, v_head_dim)


class SDPA(nn.Module):
    """Interface: `forward(q, k, v, q_pos [T], k_pos [S], mask=None, sinks=None) -> [B, T, H, D]`.

    `k_pos` holds the absolute position of every key slot (-1 for an empty slot). `sinks [H]` are the block's
    sink logits (the block owns them, as it owns its projections); `supports_sinks` says whether a form takes them.
    """

    supports_sinks: bool = True

    def __init__(self, scale: float, softcap: float | None = None, sliding_window: int | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.softcap = softcap
        self.sliding_window = sliding_window

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4g}, softcap={self.softcap}, sliding_window={self.sliding_window}"


class DynamicSDPA(SDPA):
    """Plain-torch attention whose mask comes from positions: works for any cache and any T."""

    def forward(self, q, k, v, q_pos, k_pos, mask=None, sinks=None):
        if mask is None:
            mask = allowed_keys(q_pos, k_pos, self.sliding_window)
        return attention_math(q, k, v, mask, self.scale, self.softcap, sinks)


class StaticSDPA(SDPA):
    """Attention over a fixed-size cache with an additive `[T, S]` mask supplied by the caller."""

    def forward(self, q, k, v, q_pos, k_pos, mask=None, sinks=None):
        if mask is None:
            raise ValueError("StaticSDPA needs the caller's additive mask `[T, S]`; got mask=None")
        return attention_math(q, k, v, mask, self.scale, self.softcap, sinks)


class CustomSDPA(SDPA):
    """`llama::custom_sdpa`: causal attention over a positional cache, GQA native, offset by the start position.

    It reads keys `[0, start + T)` of the cache, so it needs a positional (not ring) cache, equal q/k/v head
    dims, and no softcap, sliding window or sinks.
    """

    supports_sinks = False

    def __init__(self, scale: float, softcap: float | None = None, sliding_window: int | None = None) -> None:
        if softcap is not None or sliding_window is not None:
            raise ValueError(
                f"CustomSDPA supports neither softcap nor sliding_window; got softcap={softcap}, "
                f"sliding_window={sliding_window}. Use DynamicSDPA."
            )
        super().__init__(scale)
        load_llama_custom_ops()

    def forward(self, q, k, v, q_pos, k_pos, mask=None, sinks=None):
        if sinks is not None:
            raise ValueError("CustomSDPA cannot apply attention sinks; use DynamicSDPA or StaticSDPA")
        start = q_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + q.shape[1] <= k.shape[1])  # the kernel aborts the process past the cache
        return torch.ops.llama.custom_sdpa(q, k, v, start, None, 0, True, self.scale)


class MaskedCustomSDPA(SDPA):
    """`llama::custom_sdpa` with an additive mask built from positions: any cache layout (a ring's slots followed
    by the call's rows), sliding windows, GQA native. With a mask the kernel reads every key it is given, so the
    cache decides how many rows a step costs. No softcap or sinks."""

    supports_sinks = False

    def __init__(self, scale: float, softcap: float | None = None, sliding_window: int | None = None) -> None:
        if softcap is not None:
            raise ValueError(f"MaskedCustomSDPA does not support softcap; got softcap={softcap}. Use DynamicSDPA.")
        super().__init__(scale, sliding_window=sliding_window)
        load_llama_custom_ops()

    def forward(self, q, k, v, q_pos, k_pos, mask=None, sinks=None):
        if sinks is not None:
            raise ValueError("MaskedCustomSDPA cannot apply attention sinks; use DynamicSDPA or StaticSDPA")
        if mask is None:
            mask = allowed_keys(q_pos, k_pos, self.sliding_window)
        if mask.dtype == torch.bool:  # the kernel takes float32 or float16 masks
            mask = additive_mask(mask, torch.float16 if q.dtype == torch.float16 else torch.float32)
        return torch.ops.llama.custom_sdpa(q, k, v, 0, mask, 0, False, self.scale)


class QuantizedCustomSDPA(CustomSDPA):
    """`llama::custom_quantized_sdpa` over an int8 positional cache (`QuantizedKVCache(dequantize=False)`): `k` and
    `v` are its `QuantizedRows`, read without a float copy of the cache. The op takes int8 queries too, so `q` is
    quantized per token and head the same way. Returns `q`'s dtype."""

    def forward(self, q, k, v, q_pos, k_pos, mask=None, sinks=None):
        if sinks is not None:
            raise ValueError("QuantizedCustomSDPA cannot apply attention sinks; use DynamicSDPA or StaticSDPA")
        start = q_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + q.shape[1] <= k.values.shape[1])  # the kernel aborts the process past the cache
        q_rows = quantize_rows(q)
        out = torch.ops.llama.custom_quantized_sdpa(
            q_rows.values, k.values, v.values, start, None, 0, True, self.scale,
            q_rows.zero_points, q_rows.scales, k.zero_points, k.scales, v.zero_points, v.scales,
        )
        return out.to(q.dtype)
