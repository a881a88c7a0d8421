"""DeepSeek multi-head latent attention (MLA) with a cache that holds only the compressed latent."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from etblocks.attention.masks import allowed_keys
from etblocks.attention.rope import RotaryEmbedding, rotate_half_matrix
from etblocks.attention.sdpa import attention_math
from etblocks.state.io import IOKVCache
from etblocks.state.kv import KVCache
from etblocks.state.mixer import call_with_state


def cos_sin_from_complex(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's complex rotary table `[..., T, R/2]` -> HF's `(cos, sin)` `[..., T, R]` (`cat(f, f)` layout).

    V2 multiplies interleaved pairs by `freqs_cis` (attention scaling folded into its magnitude); that is the
    interleaved rotation by `(real, imag)`, which `MLAttention(rope_interleave=True)` applies.
    """
    cos, sin = freqs_cis.real, freqs_cis.imag
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def deinterleave_matrix(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`P [dim, dim]` with `x @ P == cat(x[..., 0::2], x[..., 1::2])`: DeepSeek's interleaved pairs moved into
    the rotate-half layout (what HF's `apply_rotary_pos_emb_interleave` outputs). A matmul, not strided slices
    and a concat, so XNNPACK can delegate it on a dynamic length."""
    half = dim // 2
    matrix = torch.zeros(dim, dim, dtype=dtype)
    matrix[2 * torch.arange(half), torch.arange(half)] = 1.0
    matrix[2 * torch.arange(half) + 1, torch.arange(half) + half] = 1.0
    return matrix


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention. `forward(x [B, T, D], input_pos [T]) -> [B, T, D]`.

    Per token the cache keeps `kv_lora_rank` (r) normed latent values and `qk_rope_head_dim` (R) values of the
    roped key shared by all heads, in a one-head cache: `k_cache [B, S, 1, r]` holds the latent, `v_cache
    [B, S, 1, R]` the roped key. An `IOKVCache` reads the caches and the additive `mask [T, S + T]` its static
    program binds; called by hand the block takes them as `kv=(latent_cache, rope_cache)` and `mask` and returns
    `(y, latent_new [B, T, 1, r], rope_new [B, T, 1, R])`.

    Two equal ways to attend over S keys (all slots of a StaticKVCache, filled or not) with H heads,
    n = qk_nope_head_dim, v = v_head_dim (multiply-adds):
    - absorbed (`absorb=True`): W_UK folds into the query and W_UV applies after attention, so the cache is
      never expanded: `T*H*r*(n + v)` for the two absorptions + `T*S*H*(2r + R)` for scores and values.
    - expanded (`absorb=False`): kv_b_proj expands every key: `S*H*r*(n + v)` + `T*S*H*(n + R + v)`.
    Both pay `r*(n + v)` per head once per query (absorbed) or once per key (expanded); per query-key pair the
    absorbed path costs `2r + R` against `n + R + v`. So absorb wins for decode and short chunks over a long
    cache (T << S); expanding wins for a prefill over a short or empty cache (T ~ S), e.g. DeepSeek-V3
    (r=512, n=v=128, R=64): absorbed when `T * (1 + 768 S / 131072) < S`, i.e. T < ~160 at S = 4096.

    The query comes from `q_proj`, or from the low-rank `q_a_proj -> q_a_norm -> q_b_proj`. Upstream modules are
    held as given (shared weights, upstream state-dict names). W_UK and W_UV are views of `kv_b_proj.weight` taken
    at call time, not buffers: they follow weight loads and dtype moves and add nothing to the state dict.
    `etblocks.export` stores them as contiguous constants in place of the weight (`fold_weight_views` in
    `etblocks.backends.passes`), so a program does not slice and transpose the weight on every call.

    `position_embeddings=(cos, sin)`, `[T, R]` or `[1, T, R]` in HF's `cat(freqs, freqs)` layout (attention scaling
    folded in), override the block's own `rope`. `rope_interleave` rotates DeepSeek's interleaved pairs
    `(x0, x1), (x2, x3)...`; False, the rotate-half layout.
    """

    def __init__(
        self,
        n_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        kv_a_proj: nn.Module,
        kv_a_norm: nn.Module,
        kv_b_proj: nn.Linear,
        o_proj: nn.Module,
        kv_cache: KVCache | IOKVCache | None,
        q_proj: nn.Module | None = None,
        q_a_proj: nn.Module | None = None,
        q_a_norm: nn.Module | None = None,
        q_b_proj: nn.Module | None = None,
        rope: RotaryEmbedding | None = None,
        rope_interleave: bool = True,
        absorb: bool = True,
    ) -> None:
        super().__init__()
        low_rank = (q_a_proj, q_a_norm, q_b_proj)
        if (q_proj is None) == all(m is None for m in low_rank):
            raise ValueError("give either q_proj or the low-rank query path q_a_proj, q_a_norm, q_b_proj (not both)")
        if q_proj is None and any(m is None for m in low_rank):
            raise ValueError("the low-rank query path needs all of q_a_proj, q_a_norm and q_b_proj")
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs); got {qk_rope_head_dim}")
        if rope is not None and rope.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"rope covers {rope.rotary_dim} dims but qk_rope_head_dim is {qk_rope_head_dim}")
        expected = (n_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)
        if not isinstance(kv_b_proj, nn.Linear) or tuple(kv_b_proj.weight.shape) != expected:
            raise ValueError(f"kv_b_proj must be an nn.Linear with weight {expected} (H*(nope+v), kv_lora_rank)")
        if kv_b_proj.bias is not None:
            raise ValueError("kv_b_proj must have no bias (as upstream): the absorbed path folds its weight only")
        if kv_cache is not None:
            dims = (kv_cache.n_kv_heads, kv_cache.head_dim, kv_cache.v_head_dim)
            if dims != (1, kv_lora_rank, qk_rope_head_dim):
                raise ValueError(
                    f"an MLA cache has one head, head_dim=kv_lora_rank ({kv_lora_rank}) and "
                    f"v_head_dim=qk_rope_head_dim ({qk_rope_head_dim}); got (n_kv_heads, head_dim, v_head_dim)={dims}"
                )
        self.n_heads = n_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.absorb = absorb
        self.rope_interleave = rope_interleave
        self.q_proj, self.q_a_proj, self.q_a_norm, self.q_b_proj = q_proj, q_a_proj, q_a_norm, q_b_proj
        self.kv_a_proj, self.kv_a_norm, self.kv_b_proj, self.o_proj = kv_a_proj, kv_a_norm, kv_b_proj, o_proj
        self.rope = rope
        self.kv_cache = kv_cache
        # Linear weights: F.linear(x, rope_rotation) is the rotate-half partner of the (de-interleaved) x;
        # F.linear(x, rope_deinterleave) moves the pairs.
        rotation = rotate_half_matrix(qk_rope_head_dim)
        deinterleave = deinterleave_matrix(qk_rope_head_dim) if rope_interleave else None
        rotation = rotation if deinterleave is None else deinterleave @ rotation
        self.register_buffer("rope_rotation", rotation.T.contiguous(), persistent=False)
        self.register_buffer("rope_deinterleave", None if deinterleave is None else deinterleave.T.contiguous(), persistent=False)

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, scale={self.scale:.4g}, "
            f"rope_interleave={self.rope_interleave}, absorb={self.absorb}"
        )

    @property
    def w_uk(self) -> torch.Tensor:
        """W_UK `[H, nope, r]`: the k_nope rows of kv_b_proj per head (a view, no copy)."""
        weight = self.kv_b_proj.weight.view(self.n_heads, -1, self.kv_lora_rank)
        return weight[:, : self.qk_nope_head_dim]

    @property
    def w_uv_t(self) -> torch.Tensor:
        """W_UV transposed `[H, r, v]`: the value rows of kv_b_proj per head (a view, no copy)."""
        weight = self.kv_b_proj.weight.view(self.n_heads, -1, self.kv_lora_rank)
        return weight[:, self.qk_nope_head_dim :].transpose(1, 2)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """`x [B, T, D]` -> `[B, T, H*(nope + rope)]`."""
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope on `x [B, T, h, R]` with `cos, sin [T, R]` or `[1, T, R]`; interleaved input pairs come out in the
        rotate-half layout (as HF's DeepSeek-V3), the same for queries and keys, so dot products are unchanged."""
        dim = self.qk_rope_head_dim
        cos = cos.reshape(-1, 1, dim).to(x.dtype)
        sin = sin.reshape(-1, 1, dim).to(x.dtype)
        rotated = F.linear(x, self.rope_rotation)  # linears take [B, T, h, R] as it is: delegable on a dynamic length
        if self.rope_deinterleave is not None:
            x = F.linear(x, self.rope_deinterleave)
        return x * cos + rotated * sin

    def attend_absorbed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """`q_nope [B, T, H, nope]`, `q_rope [B, T, H, R]` over `latent [B, S, 1, r]`, `k_rope [B, S, 1, R]`
        with `mask [T, S]` (boolean or additive) -> `[B, T, H*v]`, never expanding the cache.

        All heads read the one latent "head", so scores are one `[B, S, T*H]` bmm per part (MQA-like), then
        transposed; the head-wise absorptions are bmm's over H. Only 3-D matmuls, reshaped with an inferred T.
        """
        bsz, heads, rank = q_nope.shape[0], self.n_heads, self.kv_lora_rank
        latent = latent.reshape(bsz, -1, rank)
        k_rope = k_rope.reshape(bsz, -1, self.qk_rope_head_dim)
        q_latent = torch.bmm(q_nope.reshape(-1, heads, self.qk_nope_head_dim).transpose(0, 1), self.w_uk)  # [H, B*T, r]
        q_latent = q_latent.transpose(0, 1).reshape(bsz, -1, rank)  # [B, T*H, r], rows (t, h)
        q_rope = q_rope.reshape(bsz, -1, self.qk_rope_head_dim)
        # The cache as the left operand, read in place: as the right one it would be transposed and packed anew on
        # every call (XNNPACK packs a bmm's right operand when it arrives at run time); now the small query is packed.
        scores = torch.bmm(latent, q_latent.transpose(1, 2)) + torch.bmm(k_rope, q_rope.transpose(1, 2))
        scores = scores.transpose(1, 2)  # [B, T*H, S]
        keys = scores.shape[-1]
        if mask.dtype == torch.bool:  # additive on the small [T, S] table: the add on the scores stays delegable
            mask = torch.where(mask, 0.0, float("-inf"))
        scores = scores.view(bsz, -1, heads, keys) * self.scale + mask[:, None, :].to(scores.dtype)  # [B, T, H, S]
        probs = torch.softmax(scores.float(), dim=-1).to(latent.dtype).view(bsz, -1, keys)
        out_latent = torch.bmm(probs, latent)  # [B, T*H, r]
        out = torch.bmm(out_latent.reshape(-1, heads, rank).transpose(0, 1), self.w_uv_t)  # [H, B*T, v]
        return out.transpose(0, 1).reshape(bsz, -1, heads * self.v_head_dim)

    def attend_expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Same contract as `attend_absorbed`; expands every cached latent through kv_b_proj into per-head keys
        `[B, S, H, nope + R]` and values `[B, S, H, v]`, then runs standard attention."""
        bsz, heads = q_nope.shape[0], self.n_heads
        kv = self.kv_b_proj(latent.reshape(bsz, -1, self.kv_lora_rank))
        kv = kv.view(bsz, -1, heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim :]
        k = torch.cat((k_nope, k_rope.expand(-1, -1, heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return attention_math(q, k, v, mask, self.scale).reshape(bsz, -1, heads * self.v_head_dim)

    def forward(
        self,
        x: torch.Tensor,
        input_pos: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ):
        """`x [B, T, D]`, `input_pos [T]` -> `y [B, T, D]`; given `kv`, `(y, latent_new, rope_new)`."""
        if kv is not None:
            return call_with_state(self.kv_cache, kv, mask, lambda: self.forward(x, input_pos, position_embeddings))
        bsz, heads, nope, rank = x.shape[0], self.n_heads, self.qk_nope_head_dim, self.kv_lora_rank
        if position_embeddings is None:
            if self.rope is None:
                raise ValueError("MLAttention needs position_embeddings=(cos, sin) or a rope of its own")
            position_embeddings = self.rope(input_pos)
        cos, sin = position_embeddings

        q = self.project_q(x).view(bsz, -1, heads, nope + self.qk_rope_head_dim)
        q_nope, q_rope = q[..., :nope], self.rotate(q[..., nope:], cos, sin)
        compressed = self.kv_a_proj(x)  # [B, T, r + R]
        latent = self.kv_a_norm(compressed[..., :rank]).reshape(bsz, -1, 1, rank)
        k_rope = self.rotate(compressed[..., rank:].reshape(bsz, -1, 1, self.qk_rope_head_dim), cos, sin)

        attend = self.attend_absorbed if self.absorb else self.attend_expanded
        if self.kv_cache is None:
            latent_all, rope_all, k_pos = latent, k_rope, input_pos
        else:
            latent_all, rope_all, k_pos = self.kv_cache.update(input_pos, latent, k_rope)
            mask = self.kv_cache.mask if mask is None else mask
        if mask is None:
            if k_pos is None:
                raise ValueError("an MLAttention with a caller-owned cache needs the caller's additive mask")
            mask = allowed_keys(input_pos, k_pos)
        return self.o_proj(attend(q_nope, q_rope, latent_all, rope_all, mask))
