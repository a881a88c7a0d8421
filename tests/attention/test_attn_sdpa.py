"""SDPA forms vs torch's `scaled_dot_product_attention` (with K/V repeated per group) and vs transformers'
gemma2 `eager_attention_forward` (softcap).

etblocks layout: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`; torch/HF layout `[B, H, T, D]`. fp32, atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager_attention_forward

from etblocks.attention import CustomSDPA, DynamicSDPA, StaticSDPA, additive_mask, allowed_keys, attention_math
from etblocks.state import StaticKVCache

ATOL = 1e-5
HEADS = [(4, 4), (4, 2), (6, 2), (4, 1)]  # MHA, GQA, GQA with 3 groups, MQA


def torch_reference(q, k, v, mask, scale):
    """torch SDPA on HF layout with K/V repeated to every query head; mask boolean or additive `[T, S]`."""
    groups = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(1, 2)


def qkv(bsz, q_len, kv_len, heads, kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(bsz, q_len, heads, head_dim, generator=g),
        torch.randn(bsz, kv_len, kv_heads, head_dim, generator=g),
        torch.randn(bsz, kv_len, kv_heads, head_dim, generator=g),
    )


@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_attention_math_boolean_mask_matches_torch_sdpa(heads, kv_heads):
    q, k, v = qkv(2, 5, 9, heads, kv_heads, 16, seed=heads * 10 + kv_heads)
    mask = allowed_keys(torch.arange(4, 9), torch.arange(9))
    mask[1, 0] = False  # not purely causal
    scale = 0.37
    out = attention_math(q, k, v, mask, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out, torch_reference(q, k, v, mask, scale), rtol=0, atol=ATOL)


@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_attention_math_additive_mask_matches_torch_sdpa(heads, kv_heads):
    q, k, v = qkv(2, 4, 7, heads, kv_heads, 8, seed=7)
    g = torch.Generator().manual_seed(1)
    mask = torch.randn(4, 7, generator=g)  # finite bias, e.g. ALiBi-like
    mask[:, 5:] = float("-inf")
    out = attention_math(q, k, v, mask, scale=0.2)
    torch.testing.assert_close(out, torch_reference(q, k, v, mask, 0.2), rtol=0, atol=ATOL)
    # The bias matters: a zero mask gives something else.
    assert not torch.allclose(out, attention_math(q, k, v, torch.zeros(4, 7), scale=0.2), atol=1e-3)


class _HFModuleStub(nn.Module):
    """What HF's eager attention reads from its `module` argument."""

    def __init__(self, groups: int, head_dim: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.head_dim = head_dim


@pytest.mark.parametrize("heads, kv_heads", HEADS)
@pytest.mark.parametrize("softcap", [50.0, 2.0])
def test_softcap_matches_gemma2_eager_attention(heads, kv_heads, softcap):
    q, k, v = qkv(2, 6, 10, heads, kv_heads, 16, seed=3)
    q = q * 3  # large scores, so the cap is active
    allowed = allowed_keys(torch.arange(4, 10), torch.arange(10), sliding_window=4)
    scale = 16**-0.5
    ours = attention_math(q, k, v, allowed, scale, softcap=softcap)
    hf, _ = gemma2_eager_attention_forward(
        _HFModuleStub(heads // kv_heads, 16).eval(),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attention_mask=additive_mask(allowed)[None, None],
        scaling=scale,
        softcap=softcap,
    )
    torch.testing.assert_close(ours, hf, rtol=0, atol=ATOL)
    if softcap == 2.0:
        assert not torch.allclose(ours, attention_math(q, k, v, allowed, scale), atol=1e-3), "cap had no effect"


@pytest.mark.parametrize("window", [None, 1, 3])
def test_dynamic_sdpa_builds_hf_mask_from_positions(window):
    heads, kv_heads, head_dim = 4, 2, 8
    q, k, v = qkv(1, 4, 11, heads, kv_heads, head_dim, seed=5)
    q_pos, k_pos = torch.arange(7, 11), torch.arange(11)
    out = DynamicSDPA(0.5, sliding_window=window)(q, k, v, q_pos, k_pos)
    fn = sliding_window_causal_mask_function(window) if window else None
    kwargs = {"mask_function": fn} if fn else {}
    hf_mask = sdpa_mask(
        batch_size=1, q_length=4, kv_length=11, q_offset=7, allow_is_causal_skip=False, **kwargs
    )[0, 0]
    torch.testing.assert_close(out, torch_reference(q, k, v, hf_mask, 0.5), rtol=0, atol=ATOL)


def test_dynamic_sdpa_uses_given_mask_over_positions():
    q, k, v = qkv(1, 3, 6, 2, 1, 8, seed=9)
    mask = torch.ones(3, 6, dtype=torch.bool)  # bidirectional: differs from the causal default
    out = DynamicSDPA(0.3)(q, k, v, torch.arange(3), torch.arange(6), mask)
    torch.testing.assert_close(out, torch_reference(q, k, v, mask, 0.3), rtol=0, atol=ATOL)


def test_static_sdpa_requires_mask_and_applies_it():
    q, k, v = qkv(1, 2, 5, 4, 2, 8, seed=11)
    sdpa = StaticSDPA(0.25, softcap=3.0)
    with pytest.raises(ValueError, match="mask"):
        sdpa(q, k, v, torch.arange(2), None, None)
    mask = additive_mask(allowed_keys(torch.tensor([3, 4]), torch.tensor([0, 1, 2, 3, 4])))
    torch.testing.assert_close(
        sdpa(q, k, v, torch.arange(3, 5), None, mask), attention_math(q, k, v, mask, 0.25, softcap=3.0), rtol=0, atol=0
    )
    torch.testing.assert_close(
        StaticSDPA(0.25)(q, k, v, None, None, mask), torch_reference(q, k, v, mask, 0.25), rtol=0, atol=ATOL
    )


@pytest.mark.parametrize("kwargs", [{"softcap": 30.0}, {"sliding_window": 8}])
def test_custom_sdpa_rejects_unsupported_options(kwargs):
    with pytest.raises(ValueError, match="CustomSDPA"):
        CustomSDPA(0.1, **kwargs)


def run_custom_sdpa_chunks(chunks, heads, kv_heads, head_dim, cache_len, scale, bsz=1, seed=0):
    """Feed random q/k/v through StaticKVCache(use_custom_op=True) + CustomSDPA chunk by chunk; return the
    concatenated outputs and the one-shot torch reference over the whole sequence."""
    total = sum(chunks)
    q, k, v = qkv(bsz, total, total, heads, kv_heads, head_dim, seed)
    cache = StaticKVCache(bsz, cache_len, kv_heads, head_dim, use_custom_op=True)
    sdpa = CustomSDPA(scale)
    outs, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        k_all, v_all, k_pos = cache.update(pos, k[:, start : start + n], v[:, start : start + n])
        assert k_all.shape == (bsz, cache_len, kv_heads, head_dim)
        outs.append(sdpa(q[:, start : start + n], k_all, v_all, pos, k_pos))
        start += n
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return torch.cat(outs, dim=1), torch_reference(q, k, v, causal, scale)


@pytest.mark.parametrize(
    "chunks",
    [
        [7],  # one prefill
        [5, 1, 1, 1, 1],  # prefill then decode
        [3, 4, 1, 6, 1, 1],  # chunked prefill interleaved with decode
        [1] * 9,  # token-by-token
        [16],  # the whole cache at once
        [10, 6],  # last chunk ends exactly at the cache end
    ],
)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_custom_sdpa_over_static_cache_matches_torch(chunks, heads, kv_heads):
    out, ref = run_custom_sdpa_chunks(chunks, heads, kv_heads, head_dim=16, cache_len=16, scale=0.21, bsz=2)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


def test_custom_sdpa_honours_scale():
    out, ref = run_custom_sdpa_chunks([4, 1], 4, 2, 8, cache_len=8, scale=0.9)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    _, ref_default = run_custom_sdpa_chunks([4, 1], 4, 2, 8, cache_len=8, scale=8**-0.5)
    assert not torch.allclose(out, ref_default, atol=1e-3)


@settings(max_examples=15, deadline=None, database=None)
@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_custom_sdpa_random_chunking_matches_torch(chunks, seed):
    out, ref = run_custom_sdpa_chunks(chunks, 6, 2, 8, cache_len=40, scale=0.3, seed=seed)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


class _KernelReached(Exception):
    pass


def test_custom_sdpa_refuses_overflow_before_the_kernel(monkeypatch):
    """The real kernel kills the interpreter on overflow, so it is replaced by a sentinel here: the block must
    refuse `start + T > S` itself (a RuntimeError from torch._check, or a ValueError) before calling it."""

    def kernel(*args, **kwargs):
        raise _KernelReached

    sdpa = CustomSDPA(0.5)
    monkeypatch.setattr(torch.ops.llama, "custom_sdpa", kernel)
    q, cache = torch.ones(1, 3, 1, 4), torch.zeros(1, 8, 1, 4)
    with pytest.raises(_KernelReached):  # the sentinel is in place: an in-range call reaches it
        sdpa(q, cache, cache, torch.arange(5, 8), None)
    with pytest.raises((RuntimeError, ValueError)):
        sdpa(q, cache, cache, torch.arange(6, 9), None)
