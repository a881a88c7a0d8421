"""`allowed_keys` / `additive_mask` vs transformers' `masking_utils` mask functions.

HF evaluates `mask_function(batch_idx, head_idx, q_idx, kv_idx)` on absolute indices; etblocks evaluates on the
absolute positions held by each query and key slot, with `-1` marking an empty slot.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    padding_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
    sliding_window_overlay,
)

from etblocks.attention import additive_mask, allowed_keys


def hf_eval(mask_function, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Evaluate an HF mask function on a `[T, S]` grid of absolute positions."""
    zero = torch.zeros((), dtype=torch.long)
    return mask_function(zero, zero, q_pos[:, None], k_pos[None, :]).expand(len(q_pos), len(k_pos))


def hf_sdpa_mask(start: int, q_len: int, kv_len: int, mask_function) -> torch.Tensor:
    """transformers' boolean `[q_len, kv_len]` mask for queries starting at `start`."""
    return sdpa_mask(
        batch_size=1,
        q_length=q_len,
        kv_length=kv_len,
        q_offset=start,
        kv_offset=0,
        mask_function=mask_function,
        allow_is_causal_skip=False,
    )[0, 0]


@pytest.mark.parametrize("start, q_len, kv_len", [(0, 1, 1), (0, 6, 6), (5, 3, 8), (11, 1, 16), (4, 4, 16)])
def test_causal_matches_hf_sdpa_mask(start, q_len, kv_len):
    q_pos = torch.arange(start, start + q_len)
    k_pos = torch.arange(kv_len)
    ours = allowed_keys(q_pos, k_pos)
    hf = hf_sdpa_mask(start, q_len, kv_len, causal_mask_function)
    assert ours.dtype == torch.bool and ours.shape == (q_len, kv_len)
    assert torch.equal(ours, hf)


@pytest.mark.parametrize("window", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("start, q_len, kv_len", [(0, 7, 7), (5, 3, 8), (12, 1, 13), (3, 6, 10)])
def test_sliding_window_matches_hf(window, start, q_len, kv_len):
    q_pos = torch.arange(start, start + q_len)
    k_pos = torch.arange(kv_len)
    ours = allowed_keys(q_pos, k_pos, sliding_window=window)
    hf = hf_sdpa_mask(start, q_len, kv_len, sliding_window_causal_mask_function(window))
    assert torch.equal(ours, hf)
    # The overlay composed by hand gives the same.
    assert torch.equal(ours, hf_eval(and_masks(sliding_window_overlay(window), causal_mask_function), q_pos, k_pos))
    # Every query sees exactly min(window, pos + 1) keys when all keys up to it are present.
    if start + q_len <= kv_len:
        assert torch.equal(ours.sum(-1), torch.clamp(q_pos + 1, max=window))


@settings(max_examples=40, deadline=None, database=None)
@given(
    window=st.one_of(st.none(), st.integers(1, 12)),
    start=st.integers(0, 40),
    q_len=st.integers(1, 8),
    n_slots=st.integers(1, 12),
    data=st.data(),
)
def test_scrambled_slots_match_hf_with_padding(window, start, q_len, n_slots, data):
    """Ring-like key layouts: slots hold arbitrary past positions in any order, some empty (-1)."""
    last = start + q_len - 1
    k_list = data.draw(st.lists(st.integers(-1, last + 3), min_size=n_slots, max_size=n_slots))
    q_pos = torch.arange(start, start + q_len)
    k_pos = torch.tensor(k_list)
    filled = (k_pos >= 0)[None, :]  # HF's padding mask, indexed by slot
    causal = causal_mask_function if window is None else sliding_window_causal_mask_function(window)

    def on_positions(b, h, q_slot, kv_slot):
        # HF functions take indices; translate slots to the positions they hold.
        return causal(b, h, q_pos[q_slot], k_pos.clamp(min=0)[kv_slot])

    hf = hf_eval(and_masks(on_positions, padding_mask_function(filled)), torch.arange(q_len), torch.arange(n_slots))
    assert torch.equal(allowed_keys(q_pos, k_pos, sliding_window=window), hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_additive_mask_values_and_softmax_equivalence(dtype):
    torch.manual_seed(0)
    allowed = allowed_keys(torch.arange(3, 7), torch.tensor([0, 1, -1, 3, 4, 5, 6, 7]), sliding_window=3)
    mask = additive_mask(allowed, dtype=dtype)
    assert mask.dtype == dtype and mask.shape == allowed.shape
    assert torch.equal(mask[allowed], torch.zeros(int(allowed.sum()), dtype=dtype))
    assert torch.isneginf(mask[~allowed]).all()
    # Adding it to scores is the same as masking them out.
    scores = torch.randn(allowed.shape)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    torch.testing.assert_close(torch.softmax(scores + mask.float(), dim=-1), ref, rtol=0, atol=0)


def test_additive_mask_matches_hf_eager_conversion():
    """HF's eager path turns a boolean mask into `0 / finfo.min`; softmax results agree with etblocks' `-inf`."""
    allowed = allowed_keys(torch.arange(2, 6), torch.arange(8), sliding_window=2)
    hf_additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    scores = torch.randn(allowed.shape, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        torch.softmax(scores + additive_mask(allowed), -1), torch.softmax(scores + hf_additive, -1), rtol=0, atol=1e-7
    )
