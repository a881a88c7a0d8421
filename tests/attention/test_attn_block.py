"""The `Attention` block vs transformers attention modules holding the same weights.

Each family exercises one block feature:
- llama:    GQA, q/k/v biases, no q/k norm
- qwen3:    per-head q/k RMSNorm before rope           -> qk_norm_layout="head"
- olmo2:    q/k RMSNorm over the full projection width -> qk_norm_layout="full"
- stablelm: per-head LayerNorms on a [B, H, T, D] view -> qk_norm_layout="heads_first", partial rotary 25%
- phi3:     fused qkv_proj, partial rotary 50%

HF runs eager attention over the whole sequence with an explicit causal additive mask; etblocks runs the
whole sequence without a cache, and chunk by chunk with a StaticKVCache (index_copy_ + DynamicSDPA, and
llama::update_cache + CustomSDPA). fp32, atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from attention_refs import Family, hf_forward, make_hf, randomize_weights
from torch import nn
from transformers import LlamaConfig, Olmo2Config, Phi3Config, Qwen3Config, StableLmConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention, Olmo2RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.models.stablelm.modeling_stablelm import StableLmAttention, StableLmRotaryEmbedding

from etblocks.attention import Attention, CustomSDPA, DynamicSDPA, GatedAttention, RotaryEmbedding, default_inv_freq
from etblocks.state import StaticKVCache

ATOL = 1e-5
SEQ = 11
CHUNKS = [4, 1, 3, 1, 1, 1]  # prefill chunks interleaved with decode steps; sums to SEQ


FAMILIES = [
    Family("llama", LlamaConfig, LlamaAttention, LlamaRotaryEmbedding, dict(attention_bias=True, head_dim=16)),
    Family("qwen3", Qwen3Config, Qwen3Attention, Qwen3RotaryEmbedding, dict(head_dim=16), layout="head"),
    Family("olmo2", Olmo2Config, Olmo2Attention, Olmo2RotaryEmbedding, dict(), layout="full"),
    Family(
        "stablelm",
        StableLmConfig,
        StableLmAttention,
        StableLmRotaryEmbedding,
        dict(qk_layernorm=True, partial_rotary_factor=0.25),
        layout="heads_first",
    ),
    Family("phi3", Phi3Config, Phi3Attention, Phi3RotaryEmbedding, dict(partial_rotary_factor=0.5), fused=True),
]


def block_from_hf(family: Family, cfg, hf: nn.Module, kv_cache=None, custom: bool = False) -> Attention:
    head_dim = hf.head_dim
    base = cfg.rope_parameters["rope_theta"]
    rotary_dim = int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    norms = {}
    if hasattr(hf, "q_norm"):
        norms = dict(q_norm=hf.q_norm, k_norm=hf.k_norm)
    elif getattr(hf, "qk_layernorm", False):
        norms = dict(q_norm=hf.q_layernorm, k_norm=hf.k_layernorm)
    projections = (
        dict(q_proj=None, k_proj=None, v_proj=None, qkv_proj=hf.qkv_proj)
        if family.fused
        else dict(q_proj=hf.q_proj, k_proj=hf.k_proj, v_proj=hf.v_proj)
    )
    sdpa = CustomSDPA(hf.scaling) if custom else DynamicSDPA(hf.scaling)
    return Attention(
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        head_dim,
        sdpa,
        kv_cache,
        o_proj=hf.o_proj,
        rope=RotaryEmbedding(default_inv_freq(rotary_dim, base)),
        qk_norm_layout=family.layout,
        **projections,
        **norms,
    ).eval()


@pytest.fixture(params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request):
    return request.param


def test_full_sequence_matches_hf(family):
    cfg, hf, rotary = make_hf(family)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    block = block_from_hf(family, cfg, hf)
    with torch.no_grad():
        ref = hf_forward(hf, rotary, x)
        out = block(x, torch.arange(SEQ))
    assert out.shape == ref.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("custom", [False, True], ids=["index_copy+DynamicSDPA", "custom_ops+CustomSDPA"])
def test_chunked_static_cache_matches_hf_full_sequence(family, custom):
    cfg, hf, rotary = make_hf(family, seed=2)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(3))
    cache = StaticKVCache(2, 16, cfg.num_key_value_heads, hf.head_dim, use_custom_op=custom)
    block = block_from_hf(family, cfg, hf, kv_cache=cache, custom=custom)
    outs, start = [], 0
    with torch.no_grad():
        ref = hf_forward(hf, rotary, x)
        for n in CHUNKS:
            outs.append(block(x[:, start : start + n], torch.arange(start, start + n)))
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=0, atol=ATOL)


def test_position_embeddings_argument_overrides_own_rope(family):
    """`forward(..., position_embeddings=(cos, sin))` with HF's tables equals the block's own rope."""
    cfg, hf, rotary = make_hf(family, seed=4)
    block = block_from_hf(family, cfg, hf)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(5)
    cos, sin = rotary(x, pos[None])
    with torch.no_grad():
        given = block(x, pos, position_embeddings=(cos[0], sin[0]))
        own = block(x, pos)
        block.rope = None
        no_rope = block(x, pos)
        given_without_own = block(x, pos, position_embeddings=(cos[0], sin[0]))
    torch.testing.assert_close(given, own, rtol=0, atol=ATOL)
    torch.testing.assert_close(given_without_own, own, rtol=0, atol=ATOL)
    assert not torch.allclose(no_rope, own, atol=1e-3)


def test_heads_first_with_a_last_dim_norm_equals_head_layout():
    """A norm over the last dim does not care whether heads come first; only the view differs."""
    torch.manual_seed(6)
    q_norm, k_norm = Qwen3RMSNorm(8), Qwen3RMSNorm(8)
    randomize_weights(q_norm, 1)
    randomize_weights(k_norm, 2)
    projections = [nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 32)]
    for p in projections:
        randomize_weights(p, 3)

    def block(layout, with_norm=True):
        q, k, v, o = projections
        norms = dict(q_norm=q_norm, k_norm=k_norm) if with_norm else {}
        return Attention(4, 2, 8, DynamicSDPA(0.3), None, q, k, v, o, qk_norm_layout=layout, **norms)

    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        head = block("head")(x, torch.arange(6))
        torch.testing.assert_close(block("heads_first")(x, torch.arange(6)), head, rtol=0, atol=ATOL)
        assert not torch.allclose(block("head", with_norm=False)(x, torch.arange(6)), head, atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_equals_separate_projections(bias):
    """Same weights, fused into one qkv_proj or split into three: identical outputs (and both match phi3)."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim, dim = 6, 2, 8, 40
    q, k, v = nn.Linear(dim, heads * head_dim, bias), nn.Linear(dim, kv_heads * head_dim, bias), nn.Linear(dim, kv_heads * head_dim, bias)
    o = nn.Linear(heads * head_dim, dim, bias=False)
    for m in (q, k, v, o):
        randomize_weights(m, 8)
    fused = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        if bias:
            fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
    rope = RotaryEmbedding(default_inv_freq(head_dim, 10000.0))
    separate = Attention(heads, kv_heads, head_dim, DynamicSDPA(0.35), None, q, k, v, o, rope=rope)
    one = Attention(heads, kv_heads, head_dim, DynamicSDPA(0.35), None, None, None, None, o, qkv_proj=fused, rope=rope)
    x = torch.randn(2, 7, dim)
    with torch.no_grad():
        torch.testing.assert_close(one(x, torch.arange(3, 10)), separate(x, torch.arange(3, 10)), rtol=0, atol=1e-6)
        pq, pk, pv = one.project_qkv(x)
    assert pq.shape[-1] == heads * head_dim and pk.shape[-1] == pv.shape[-1] == kv_heads * head_dim


def small_block(cls=Attention, rope=True, seed=9):
    torch.manual_seed(seed)
    projections = [nn.Linear(32, 32, bias=False), nn.Linear(32, 16, bias=False), nn.Linear(32, 16, bias=False), nn.Linear(32, 32, bias=False)]
    for p in projections:
        randomize_weights(p, seed)
    rotary = RotaryEmbedding(default_inv_freq(8, 10000.0)) if rope else None
    return cls(4, 2, 8, DynamicSDPA(8**-0.5), None, *projections, rope=rotary)


def test_subclass_attend_hook_is_used():
    class Doubling(Attention):
        calls = 0

        def attend(self, q, k, v, q_pos, k_pos, mask=None):
            type(self).calls += 1
            assert q.shape[1:] == (5, 4, 8) and k.shape[2] == 2  # [B, T, H, D] and un-repeated KV heads
            return 2 * super().attend(q, k, v, q_pos, k_pos, mask)

    base, sub = small_block(), small_block(Doubling)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        y_sub = sub(x, torch.arange(5))
        y_base = base(x, torch.arange(5))
    assert Doubling.calls == 1
    torch.testing.assert_close(y_sub, 2 * y_base, rtol=0, atol=ATOL)  # o_proj has no bias: linear in y


def test_subclass_rotate_and_project_hooks_are_used():
    class NoRotation(Attention):
        def rotate(self, q, k, input_pos, position_embeddings=None):
            return q, k

    class ZeroValues(Attention):
        def project_qkv(self, x):
            q, k, v = super().project_qkv(x)
            return q, k, torch.zeros_like(v)

    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            small_block(NoRotation)(x, torch.arange(6)), small_block(rope=False)(x, torch.arange(6)), rtol=0, atol=0
        )
        assert not torch.allclose(small_block()(x, torch.arange(6)), small_block(rope=False)(x, torch.arange(6)), atol=1e-3)
        assert torch.equal(small_block(ZeroValues)(x, torch.arange(6)), torch.zeros(1, 6, 32))


def test_constructor_rejects_bad_configurations():
    lin = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="multiple"):
        Attention(3, 2, 4, DynamicSDPA(1.0), None, lin, lin, lin, lin)
    with pytest.raises(ValueError, match="fused"):
        Attention(2, 2, 4, DynamicSDPA(1.0), None, lin, lin, lin, lin, qkv_proj=lin)
    with pytest.raises(ValueError, match="fused"):
        Attention(2, 2, 4, DynamicSDPA(1.0), None, None, None, None, lin)
    with pytest.raises(ValueError, match="gate_activation='tanh'.*accepted"):
        GatedAttention(2, 2, 4, DynamicSDPA(1.0), None, lin, lin, lin, lin, gate_proj=lin, gate_activation="tanh")
    with pytest.raises(ValueError, match="gate_per_head=True needs a gate_proj"):
        GatedAttention(2, 2, 4, DynamicSDPA(1.0), None, lin, lin, lin, lin, gate_per_head=True)
