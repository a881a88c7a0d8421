"""RingKVCache: an `Attention` with a ring cache of W rows + DynamicSDPA(sliding_window=W) (or, in the XNNPACK
recipe's form, MaskedCustomSDPA over a ring written with `update_cache_with_indices` that reads only its filled
slots), fed in chunks of any size (shorter than, equal to and longer than W, then many decode steps past W), matches a full-context
reference computed at once: the same projections, HF's rotary tables and `apply_rotary_pos_emb`, and torch
SDPA with an explicit sliding-window causal mask (HF `sliding_window_causal_mask_function`). fp32, atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from etblocks.attention import Attention, DynamicSDPA, MaskedCustomSDPA, RotaryEmbedding, default_inv_freq
from etblocks.state import RingKVCache

ATOL = 1e-5
HEADS, KV_HEADS, HEAD_DIM, DIM, BASE = 4, 2, 8, 32, 10000.0
SCALE = 0.4
FORMS = ("dynamic", "custom")  # DynamicSDPA over the whole ring; the xnnpack recipe's custom ops over filled slots


def make_block(window: int, bsz: int = 1, seed: int = 0, form: str = "dynamic") -> Attention:
    g = torch.Generator().manual_seed(seed)

    def lin(i, o, bias=False):
        m = nn.Linear(i, o, bias=bias)
        with torch.no_grad():
            m.weight.copy_(torch.randn(o, i, generator=g) / i**0.5)
            if bias:
                m.bias.copy_(0.1 * torch.randn(o, generator=g))
        return m

    custom = form == "custom"
    return Attention(
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        MaskedCustomSDPA(SCALE, sliding_window=window) if custom else DynamicSDPA(SCALE, sliding_window=window),
        RingKVCache(bsz, window, KV_HEADS, HEAD_DIM, use_custom_op=custom, read_filled=custom),
        lin(DIM, HEADS * HEAD_DIM, bias=True),
        lin(DIM, KV_HEADS * HEAD_DIM, bias=True),
        lin(DIM, KV_HEADS * HEAD_DIM, bias=True),
        lin(HEADS * HEAD_DIM, DIM),
        rope=RotaryEmbedding(default_inv_freq(HEAD_DIM, BASE)),
    ).eval()


HF_ROPE = LlamaRotaryEmbedding(
    LlamaConfig(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": BASE},
    )
)


def full_context_reference(block: Attention, x: torch.Tensor, window: int) -> torch.Tensor:
    """The whole sequence at once, [B, H, T, D] layout, explicit sliding-window causal mask."""
    bsz, seq, _ = x.shape
    q = block.q_proj(x).view(bsz, seq, HEADS, HEAD_DIM).transpose(1, 2)
    k = block.k_proj(x).view(bsz, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = block.v_proj(x).view(bsz, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
    cos, sin = HF_ROPE(x, torch.arange(seq)[None].expand(bsz, -1))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    mask = sdpa_mask(
        batch_size=bsz,
        q_length=seq,
        kv_length=seq,
        mask_function=sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False,
    )
    assert mask.shape == (bsz, 1, seq, seq)
    groups = HEADS // KV_HEADS
    y = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask, scale=SCALE
    )
    return block.o_proj(y.transpose(1, 2).reshape(bsz, seq, -1))


def run_chunks(block: Attention, x: torch.Tensor, chunks) -> torch.Tensor:
    cache = block.kv_cache
    window = cache.window
    outs, start = [], 0
    for n in chunks:
        outs.append(block(x[:, start : start + n], torch.arange(start, start + n)))
        start += n
        # Memory stays W rows whatever the chunk size, and the ring holds exactly the last W positions.
        assert cache.k_cache.shape == cache.v_cache.shape == (x.shape[0], window, KV_HEADS, HEAD_DIM)
        assert cache.slot_positions.shape == (window,)
        kept = torch.arange(max(0, start - window), start)
        expected_slots = torch.full((window,), -1)
        expected_slots[kept % window] = kept
        assert torch.equal(cache.slot_positions, expected_slots)
    return torch.cat(outs, dim=1)


def assert_ring_matches_full_context(
    window: int, chunks: list[int], bsz: int = 1, seed: int = 0, form: str = "dynamic"
) -> None:
    """Chunked decoding through the ring equals one full-context pass with a sliding-window mask."""
    torch.manual_seed(seed)
    block = make_block(window, bsz=bsz, seed=seed, form=form)
    x = torch.randn(bsz, sum(chunks), DIM)
    with torch.no_grad():
        out = run_chunks(block, x, chunks)
        ref = full_context_reference(block, x, window)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "window, chunks",
    [
        (4, [3, 6, 1, 1, 1, 1, 1, 1, 1, 1, 5, 2]),  # short, longer than W, many decode steps past W
        (4, [4, 4, 4, 1, 1]),  # exactly W
        (5, [1] * 23),  # token by token, far past W
        (3, [17, 1, 1, 9]),  # chunks much longer than W
        (6, [2, 2, 2, 2, 2, 2, 2, 2]),
        (1, [3, 1, 2]),  # window 1: each token sees only itself
        (16, [5, 7, 1, 3]),  # window longer than the sequence: plain causal
    ],
)
@pytest.mark.parametrize("form", FORMS)
def test_chunked_ring_matches_full_context_sliding_window(window, chunks, form):
    assert_ring_matches_full_context(window, chunks, bsz=2, form=form)


def test_window_matters():
    """The same inputs with a larger window give a different answer once the sequence exceeds the small one."""
    torch.manual_seed(1)
    x = torch.randn(1, 10, DIM)
    with torch.no_grad():
        small = run_chunks(make_block(3), x, [10])
        large = run_chunks(make_block(8), x, [10])
    torch.testing.assert_close(small[:, :3], large[:, :3], rtol=0, atol=ATOL)
    assert not torch.allclose(small[:, 3:], large[:, 3:], atol=1e-3)


@settings(max_examples=15, deadline=None, database=None)
@given(
    window=st.integers(1, 6),
    chunks=st.lists(st.integers(1, 13), min_size=1, max_size=8),
    seed=st.integers(0, 1000),
    form=st.sampled_from(FORMS),
)
def test_random_chunking_matches_full_context(window, chunks, seed, form):
    assert_ring_matches_full_context(window, chunks, seed=seed, form=form)


def test_update_returns_ring_then_new_rows():
    cache = RingKVCache(1, 3, 1, 2)
    k = torch.arange(5, dtype=torch.float32).view(1, 5, 1, 1).expand(1, 5, 1, 2)
    k_all, v_all, k_pos = cache.update(torch.arange(5), k, k)
    assert k_all.shape == (1, 3 + 5, 1, 2)
    assert torch.equal(k_pos, torch.tensor([-1, -1, -1, 0, 1, 2, 3, 4]))
    assert torch.equal(k_all[0, 3:, 0, 0], torch.arange(5.0))
    # Slot p % 3 holds position p for the last 3 positions.
    assert torch.equal(cache.slot_positions, torch.tensor([3, 4, 2]))
    assert torch.equal(cache.k_cache[0, :, 0, 0], torch.tensor([3.0, 4.0, 2.0]))
    k_all, _, k_pos = cache.update(torch.tensor([5]), k[:, :1] + 10, k[:, :1] + 10)
    assert torch.equal(k_pos, torch.tensor([3, 4, 2, 5]))
    assert torch.equal(cache.slot_positions, torch.tensor([3, 4, 5]))
    assert cache.k_cache[0, 2, 0, 0] == 10.0


def test_update_reads_only_the_slots_filled_before_the_ring_wraps():
    cache = RingKVCache(1, 8, 1, 2, read_filled=True)
    k = torch.randn(1, 3, 1, 2)
    k_all, _, k_pos = cache.update(torch.arange(2), k[:, :2], k[:, :2])
    assert torch.equal(k_pos, torch.tensor([-1, 0, 1]))  # at position 0 one (empty) slot: never a zero-length slice
    k_all, _, k_pos = cache.update(torch.tensor([2]), k[:, 2:], k[:, 2:])
    assert torch.equal(k_pos, torch.tensor([0, 1, 2]))
    assert torch.equal(k_all, k)


def test_reset_and_resize_keep_the_window():
    torch.manual_seed(2)
    block = make_block(4)
    x = torch.randn(1, 9, DIM)
    with torch.no_grad():
        first = run_chunks(block, x, [6, 3])
        block.kv_cache.reset()
        assert torch.equal(block.kv_cache.slot_positions, torch.full((4,), -1))
        assert not block.kv_cache.k_cache.any()
        again = run_chunks(block, x, [2, 7])
        block.kv_cache.resize(1024)  # a context length does not change the ring
        assert block.kv_cache.window == 4 and block.kv_cache.k_cache.shape[1] == 4
        assert torch.equal(block.kv_cache.slot_positions, torch.full((4,), -1))
        third = run_chunks(block, x, [9])
    torch.testing.assert_close(again, first, rtol=0, atol=ATOL)
    torch.testing.assert_close(third, first, rtol=0, atol=ATOL)
    assert block.kv_cache.state_dict() == {}


@pytest.mark.parametrize("form", FORMS)
def test_a_new_sequence_never_reads_rows_left_by_the_last_one(form):
    """The runner restarts at position 0 without clearing state (ExecuTorch keeps mutable buffers): a second
    sequence fed into a ring that holds a longer first one gives what it gives in a fresh ring."""
    torch.manual_seed(3)
    x = torch.randn(1, 7, DIM)
    used = make_block(4, form=form)
    with torch.no_grad():
        run_chunks(used, torch.randn(1, 6, DIM), [5, 1])  # slot 2 keeps position 2 of this sequence
        reused = torch.cat([used(x[:, a:b], torch.arange(a, b)) for a, b in ((0, 2), (2, 3), (3, 7))], dim=1)
        expected = run_chunks(make_block(4, form=form), x, [2, 1, 4])
    torch.testing.assert_close(reused, expected, rtol=0, atol=ATOL)
