"""IOKVCache: caller-owned caches, as static NPU programs use them.

The test owns the caches and their slot positions, builds the additive mask with
`additive_mask(allowed_keys(q_pos, cat(slot_positions, q_pos)))`, calls an `Attention` with IOKVCache +
StaticSDPA, and writes the returned new rows. It must match, step by step, an `Attention` with the same
weights and an in-graph cache (StaticKVCache, or RingKVCache for a sliding window). fp32, atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from etblocks.attention import Attention, DynamicSDPA, RotaryEmbedding, StaticSDPA, additive_mask, allowed_keys, default_inv_freq
from etblocks.state import IOKVCache, RingKVCache, StaticKVCache

ATOL = 1e-5
HEADS, KV_HEADS, HEAD_DIM, DIM = 6, 2, 8, 24
SCALE = 0.3


def projections(seed: int):
    g = torch.Generator().manual_seed(seed)

    def lin(i, o):
        m = nn.Linear(i, o)
        with torch.no_grad():
            m.weight.copy_(torch.randn(o, i, generator=g) / i**0.5)
            m.bias.copy_(0.1 * torch.randn(o, generator=g))
        return m

    return [lin(DIM, HEADS * HEAD_DIM), lin(DIM, KV_HEADS * HEAD_DIM), lin(DIM, KV_HEADS * HEAD_DIM), lin(HEADS * HEAD_DIM, DIM)]


def pair(cache_len: int, bsz: int = 1, window: int | None = None, seed: int = 0):
    """(io_block, reference_block) sharing every weight."""
    projs = projections(seed)
    rope = RotaryEmbedding(default_inv_freq(HEAD_DIM, 10000.0))
    io = Attention(HEADS, KV_HEADS, HEAD_DIM, StaticSDPA(SCALE), IOKVCache(KV_HEADS, HEAD_DIM), *projs, rope=rope)
    if window is None:
        cache = StaticKVCache(bsz, cache_len, KV_HEADS, HEAD_DIM)
    else:
        cache = RingKVCache(bsz, window, KV_HEADS, HEAD_DIM)
    ref = Attention(HEADS, KV_HEADS, HEAD_DIM, DynamicSDPA(SCALE, sliding_window=window), cache, *projs, rope=rope)
    return io.eval(), ref.eval()


class CallerCaches:
    """What a static-program runner owns: fixed-size K/V caches and the position held by each slot."""

    def __init__(self, bsz: int, slots: int, ring: bool = False, window: int | None = None) -> None:
        self.k = torch.zeros(bsz, slots, KV_HEADS, HEAD_DIM)
        self.v = torch.zeros(bsz, slots, KV_HEADS, HEAD_DIM)
        self.positions = torch.full((slots,), -1)
        self.ring, self.window = ring, window

    def mask(self, q_pos: torch.Tensor) -> torch.Tensor:
        return additive_mask(allowed_keys(q_pos, torch.cat((self.positions, q_pos)), self.window))

    def write(self, q_pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, valid: int) -> None:
        slots_n = self.positions.numel()
        for i in range(valid):
            slot = int(q_pos[i]) % slots_n if self.ring else int(q_pos[i])
            self.k[:, slot] = k_new[:, i]
            self.v[:, slot] = v_new[:, i]
            self.positions[slot] = q_pos[i]


def run_io(io: Attention, caches: CallerCaches, x: torch.Tensor, start: int, n: int, pad_to: int | None = None):
    """One call of a (possibly fixed-shape) program; returns the `n` valid output rows."""
    length = pad_to or n
    chunk = torch.zeros(x.shape[0], length, DIM)
    chunk[:, :n] = x[:, start : start + n]
    q_pos = torch.arange(start, start + length)  # padded rows get the following positions: causally invisible
    mask = caches.mask(q_pos)
    assert mask.shape == (length, caches.positions.numel() + length)
    y, k_new, v_new = io(chunk, q_pos, kv=(caches.k, caches.v), mask=mask)
    assert y.shape == (x.shape[0], length, DIM)
    assert k_new.shape == v_new.shape == (x.shape[0], length, KV_HEADS, HEAD_DIM)
    caches.write(q_pos, k_new, v_new, valid=n)
    return y[:, :n]


@pytest.mark.parametrize("chunks", [[6, 1, 1, 1], [1] * 8, [3, 4, 1, 5, 1, 2]])
def test_io_cache_matches_static_cache_step_by_step(chunks):
    torch.manual_seed(0)
    total = sum(chunks)
    io, ref = pair(cache_len=total, bsz=2)
    caches = CallerCaches(2, total)
    x = torch.randn(2, total, DIM)
    assert_chunks_match(io, ref, caches, x, chunks)
    # The rows the caller wrote are the rows the in-graph cache wrote.
    torch.testing.assert_close(caches.k, ref.kv_cache.k_cache, rtol=0, atol=ATOL)
    torch.testing.assert_close(caches.v, ref.kv_cache.v_cache, rtol=0, atol=ATOL)


def assert_chunks_match(io, ref, caches, x, chunks) -> None:
    """Feed `x` chunk by chunk to the caller-owned block and to the in-graph reference; outputs must agree."""
    start = 0
    with torch.no_grad():
        for n in chunks:
            got = run_io(io, caches, x, start, n)
            want = ref(x[:, start : start + n], torch.arange(start, start + n))
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
            start += n


def test_fixed_shape_prefill_chunks_with_padding_then_decode():
    """The static-program contract: prefill in fixed chunks of C (last one padded), decode with T = 1."""
    torch.manual_seed(1)
    chunk, prompt, decode_steps, slots = 4, 10, 5, 16
    io, ref = pair(cache_len=slots)
    caches = CallerCaches(1, slots)
    x = torch.randn(1, prompt + decode_steps, DIM)
    with torch.no_grad():
        for start in range(0, prompt, chunk):
            n = min(chunk, prompt - start)
            got = run_io(io, caches, x, start, n, pad_to=chunk)
            want = ref(x[:, start : start + n], torch.arange(start, start + n))
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        for pos in range(prompt, prompt + decode_steps):
            got = run_io(io, caches, x, pos, 1)
            want = ref(x[:, pos : pos + 1], torch.tensor([pos]))
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    # Padded rows were never written.
    assert torch.equal(caches.positions[: prompt + decode_steps], torch.arange(prompt + decode_steps))
    assert (caches.positions[prompt + decode_steps :] == -1).all()


@settings(max_examples=10, deadline=None, database=None)
@given(window=st.integers(1, 5), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=8), seed=st.integers(0, 100))
def test_caller_owned_ring_matches_ring_cache(window, chunks, seed):
    """Sliding window with a caller-owned ring of W slots (slot = p % W) vs RingKVCache + DynamicSDPA."""
    torch.manual_seed(seed)
    io, ref = pair(cache_len=window, window=window, seed=seed)
    caches = CallerCaches(1, window, ring=True, window=window)
    x = torch.randn(1, sum(chunks), DIM)
    assert_chunks_match(io, ref, caches, x, chunks)
    assert torch.equal(caches.positions, ref.kv_cache.slot_positions)


def test_the_mask_is_what_hides_empty_slots():
    """With a mask that ignores slot positions (every cache slot readable), zero-filled empty slots leak in."""
    torch.manual_seed(2)
    io, ref = pair(cache_len=8)
    caches = CallerCaches(1, 8)
    x = torch.randn(1, 3, DIM)
    with torch.no_grad():
        want = ref(x, torch.arange(3))
        q_pos = torch.arange(3)
        causal_only = additive_mask(allowed_keys(q_pos, torch.cat((torch.arange(8) * 0, q_pos))))
        y, _, _ = io(x, q_pos, kv=(caches.k, caches.v), mask=causal_only)
        good, _, _ = io(x, q_pos, kv=(caches.k, caches.v), mask=caches.mask(q_pos))
    torch.testing.assert_close(good, want, rtol=0, atol=ATOL)
    assert not torch.allclose(y, want, atol=1e-3)


def test_update_appends_rows_and_keeps_no_state():
    cache = IOKVCache(KV_HEADS, HEAD_DIM, max_seq_len=5)
    assert list(cache.buffers()) == [] and cache.state_dict() == {}
    assert [(s.name, s.shape, s.update) for s in cache.specs()] == [
        ("k_cache", (1, 5, KV_HEADS, HEAD_DIM), "rows"), ("v_cache", (1, 5, KV_HEADS, HEAD_DIM), "rows")
    ]
    assert [(s.shape, s.update) for s in IOKVCache(KV_HEADS, HEAD_DIM, max_seq_len=5, window=3).specs()] == [
        ((1, 3, KV_HEADS, HEAD_DIM), "ring")
    ] * 2
    k_cache, v_cache = torch.zeros(1, 5, KV_HEADS, HEAD_DIM), torch.ones(1, 5, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(1, 2, KV_HEADS, HEAD_DIM), torch.randn(1, 2, KV_HEADS, HEAD_DIM)
    cache.bind((k_cache, v_cache))
    k_all, v_all, k_pos = cache.update(torch.arange(5, 7), k, v)
    new_rows = cache.take()
    assert k_pos is None  # the caller's mask says which rows are filled
    assert k_all.shape == v_all.shape == (1, 7, KV_HEADS, HEAD_DIM)
    assert new_rows[0] is k and new_rows[1] is v
    assert torch.equal(k_all[:, 5:], k) and torch.equal(v_all[:, :5], v_cache)
    assert not k_cache.any()  # the caller's cache is not written


def test_io_attention_requires_kv_and_mask():
    io, _ = pair(cache_len=4)
    x = torch.randn(1, 2, DIM)
    kv = (torch.zeros(1, 4, KV_HEADS, HEAD_DIM), torch.zeros(1, 4, KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="IOKVCache is caller-owned and was not given its tensors"):
        io(x, torch.arange(2), mask=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="StaticSDPA needs the caller's additive mask"):
        io(x, torch.arange(2), kv=kv)
