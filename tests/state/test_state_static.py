"""StaticKVCache: `llama::update_cache` and `index_copy_` both give exactly the contents of a direct reference
write (`cache[:, start:start+T] = k`), for any chunking; plus reset / resize / state-dict behaviour."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from etblocks.state import KVCache, StaticKVCache, find_states, reset_states

BSZ, LEN, KV_HEADS, HEAD_DIM = 2, 24, 3, 8


def write_chunks(cache: StaticKVCache, chunks, seed: int = 0):
    """Write random rows chunk by chunk; return the reference buffers written by plain slicing."""
    g = torch.Generator().manual_seed(seed)
    ref_k = torch.zeros(BSZ, LEN, KV_HEADS, HEAD_DIM)
    ref_v = torch.zeros(BSZ, LEN, KV_HEADS, HEAD_DIM)
    start = 0
    for n in chunks:
        k = torch.randn(BSZ, n, KV_HEADS, HEAD_DIM, generator=g)
        v = torch.randn(BSZ, n, KV_HEADS, HEAD_DIM, generator=g)
        k_all, v_all, k_pos = cache.update(torch.arange(start, start + n), k, v)
        # What attention reads is the whole in-place buffer, with slot i holding position i.
        assert k_all is cache.k_cache and v_all is cache.v_cache
        assert torch.equal(k_pos, torch.arange(LEN))
        ref_k[:, start : start + n] = k
        ref_v[:, start : start + n] = v
        start += n
    return ref_k, ref_v


@pytest.mark.parametrize("use_custom_op", [False, True], ids=["index_copy", "update_cache"])
@pytest.mark.parametrize("chunks", [[24], [1] * 24, [5, 1, 1, 7], [10, 3, 1, 1, 9]])
def test_cache_contents_match_reference_write(use_custom_op, chunks):
    cache = StaticKVCache(BSZ, LEN, KV_HEADS, HEAD_DIM, use_custom_op=use_custom_op)
    assert cache.k_cache.shape == cache.v_cache.shape == (BSZ, LEN, KV_HEADS, HEAD_DIM)
    ref_k, ref_v = write_chunks(cache, chunks)
    assert torch.equal(cache.k_cache, ref_k)
    assert torch.equal(cache.v_cache, ref_v)


@settings(max_examples=20, deadline=None, database=None)
@given(chunks=st.lists(st.integers(1, 8), min_size=1, max_size=8).filter(lambda c: sum(c) <= LEN), seed=st.integers(0, 99))
def test_custom_op_and_index_copy_agree_bitwise(chunks, seed):
    custom = StaticKVCache(BSZ, LEN, KV_HEADS, HEAD_DIM, use_custom_op=True)
    portable = StaticKVCache(BSZ, LEN, KV_HEADS, HEAD_DIM, use_custom_op=False)
    ref_k, ref_v = write_chunks(custom, chunks, seed)
    write_chunks(portable, chunks, seed)
    for cache in (custom, portable):
        assert torch.equal(cache.k_cache, ref_k) and torch.equal(cache.v_cache, ref_v)
    # Unwritten slots stay zero.
    assert not cache.k_cache[:, sum(chunks) :].any()


@pytest.mark.parametrize("use_custom_op", [False, True], ids=["index_copy", "update_cache"])
def test_non_contiguous_rows_are_written_correctly(use_custom_op):
    """Rows sliced out of a fused projection are strided views; the write must not assume contiguity."""
    fused = torch.randn(BSZ, 4, KV_HEADS * HEAD_DIM * 3)
    k = fused[..., : KV_HEADS * HEAD_DIM].view(BSZ, 4, KV_HEADS, HEAD_DIM)
    v = fused[..., KV_HEADS * HEAD_DIM : 2 * KV_HEADS * HEAD_DIM].view(BSZ, 4, KV_HEADS, HEAD_DIM)
    assert not k.is_contiguous()
    cache = StaticKVCache(BSZ, LEN, KV_HEADS, HEAD_DIM, use_custom_op=use_custom_op)
    cache.update(torch.arange(6, 10), k, v)
    assert torch.equal(cache.k_cache[:, 6:10], k) and torch.equal(cache.v_cache[:, 6:10], v)


@pytest.mark.parametrize(
    "use_custom_op", [False, True], ids=["index_copy", "update_cache"]
)
def test_writing_past_the_end_raises(use_custom_op):
    cache = StaticKVCache(1, 8, 1, 4, use_custom_op=use_custom_op)
    k = torch.ones(1, 3, 1, 4)
    with pytest.raises((RuntimeError, IndexError)):
        cache.update(torch.arange(6, 9), k, k)


def test_buffers_are_non_persistent_and_reset_zeroes():
    cache = StaticKVCache(BSZ, LEN, KV_HEADS, HEAD_DIM)
    assert cache.state_dict() == {}  # a swapped model's state dict stays the upstream one
    write_chunks(cache, [5])
    assert cache.k_cache.any()
    cache.reset()
    assert not cache.k_cache.any() and not cache.v_cache.any()
    assert torch.equal(cache.positions, torch.arange(LEN))


def test_resize_reallocates_with_positions():
    cache = StaticKVCache(BSZ, LEN, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    cache.resize(40)
    assert cache.max_seq_len == 40
    assert cache.k_cache.shape == (BSZ, 40, KV_HEADS, HEAD_DIM) and cache.k_cache.dtype == torch.float16
    assert torch.equal(cache.positions, torch.arange(40))
    _, _, k_pos = cache.update(torch.arange(30, 33), torch.ones(BSZ, 3, KV_HEADS, HEAD_DIM, dtype=torch.float16), torch.ones(BSZ, 3, KV_HEADS, HEAD_DIM, dtype=torch.float16))
    assert k_pos.shape == (40,) and cache.k_cache[:, 30:33].eq(1).all()


def test_find_and_reset_states_in_a_module_tree():
    model = nn.ModuleDict(
        {"a": StaticKVCache(1, 4, 1, 2), "b": nn.Sequential(nn.Linear(2, 2), StaticKVCache(1, 6, 1, 2))}
    )
    caches = find_states(model)
    assert len(caches) == 2 and all(isinstance(c, KVCache) for c in caches)
    for c in caches:
        c.k_cache.fill_(1.0)
        c.v_cache.fill_(1.0)
    reset_states(model)
    assert all(not c.k_cache.any() and not c.v_cache.any() for c in caches)
