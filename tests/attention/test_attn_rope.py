"""Rotary embeddings: parity with transformers' rotary tables and `apply_rotary_pos_emb`.

Layouts: etblocks rotates `[B, T, H, D]` with tables `[T, R]`; HF rotates `[B, H, T, D]` with `[B, T, R]`.
All fp32; tolerances are stated per assertion.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, StableLmConfig
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

from etblocks.attention import RotaryEmbedding, apply_rotary, default_inv_freq, llama3_inv_freq

ATOL = 1e-5
POSITIONS = torch.tensor([0, 1, 2, 3, 17, 100, 255, 1023, 4095])


def llama_config(head_dim: int, n_heads: int = 4, **rope) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * n_heads,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        head_dim=head_dim,
        num_hidden_layers=1,
        max_position_embeddings=8192,
        rope_parameters=rope,
    )


def hf_tables(rotary: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF tables for one batch row: `[T, R]`."""
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_default_tables_match_llama_rotary(head_dim, base):
    hf = LlamaRotaryEmbedding(llama_config(head_dim, rope_type="default", rope_theta=base))
    ours = RotaryEmbedding(default_inv_freq(head_dim, base))
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, rtol=1e-6, atol=0)
    assert ours.rotary_dim == head_dim
    cos, sin = ours(POSITIONS)
    hf_cos, hf_sin = hf_tables(hf, POSITIONS)
    assert cos.shape == (len(POSITIONS), head_dim)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=ATOL)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "head_dim, base, factor, low, high, original",
    [
        (16, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 constants, small head
        (64, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 constants
        (32, 10000.0, 4.0, 2.0, 8.0, 512),
    ],
)
def test_llama3_tables_match_hf_llama3_rope(head_dim, base, factor, low, high, original):
    hf = LlamaRotaryEmbedding(
        llama_config(
            head_dim,
            rope_type="llama3",
            rope_theta=base,
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
    )
    inv_freq = llama3_inv_freq(head_dim, base, factor, low, high, original)
    # The case must exercise all three regimes (kept, smoothed, divided), or it proves little.
    wavelen = 2 * math.pi / default_inv_freq(head_dim, base)
    assert (wavelen < original / high).any(), "no high-frequency (kept) band"
    assert ((wavelen >= original / high) & (wavelen <= original / low)).any(), "no smoothed band"
    assert (wavelen > original / low).any(), "no low-frequency (divided) band"
    assert hf.attention_scaling == 1.0

    torch.testing.assert_close(inv_freq, hf.inv_freq, rtol=1e-6, atol=0)
    ours = RotaryEmbedding(inv_freq)
    cos, sin = ours(POSITIONS)
    hf_cos, hf_sin = hf_tables(hf, POSITIONS)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=ATOL)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=ATOL)
    # And it really is not the default table.
    assert not torch.allclose(inv_freq, default_inv_freq(head_dim, base))


def test_attention_scaling_multiplies_tables_like_hf_yarn():
    """YaRN folds a magnitude correction into cos/sin; RotaryEmbedding's `attention_scaling` must do the same."""
    cfg = llama_config(
        32, rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024
    )
    hf = LlamaRotaryEmbedding(cfg)
    assert hf.attention_scaling != 1.0
    ours = RotaryEmbedding(hf.inv_freq, attention_scaling=hf.attention_scaling)
    cos, sin = ours(POSITIONS)
    hf_cos, hf_sin = hf_tables(hf, POSITIONS)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=ATOL)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=ATOL)


def test_apply_rotary_matches_hf_with_layout_transpose():
    torch.manual_seed(0)
    bsz, seq, heads, kv_heads, head_dim = 2, 7, 4, 2, 32
    hf_rope = LlamaRotaryEmbedding(llama_config(head_dim, rope_type="default", rope_theta=10000.0))
    positions = torch.tensor([3, 4, 5, 6, 7, 8, 9])
    q = torch.randn(bsz, seq, heads, head_dim)
    k = torch.randn(bsz, seq, kv_heads, head_dim)

    cos, sin = RotaryEmbedding(default_inv_freq(head_dim, 10000.0))(positions)
    q_ours, k_ours = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    hf_cos, hf_sin = hf_rope(q, positions[None, :].expand(bsz, -1))
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)
    torch.testing.assert_close(q_ours, q_hf.transpose(1, 2), rtol=0, atol=ATOL)
    torch.testing.assert_close(k_ours, k_hf.transpose(1, 2), rtol=0, atol=ATOL)
    assert not torch.allclose(q_ours, q, atol=1e-2)  # the rotation did something


def test_apply_rotary_accepts_per_batch_tables():
    """Tables shaped `[B, T, R]` (different positions per batch row), as HF's rotary module returns them."""
    torch.manual_seed(1)
    bsz, seq, heads, head_dim = 3, 5, 2, 16
    hf_rope = LlamaRotaryEmbedding(llama_config(head_dim, rope_type="default", rope_theta=10000.0))
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [7, 3, 99, 2, 0]])
    x = torch.randn(bsz, seq, heads, head_dim)
    cos, sin = hf_rope(x, position_ids)
    ours = apply_rotary(x, cos, sin)
    ref, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    torch.testing.assert_close(ours, ref.transpose(1, 2), rtol=0, atol=ATOL)


@pytest.mark.parametrize("partial_rotary_factor", [0.25, 0.5])
def test_partial_rotary_matches_stablelm_and_neox(partial_rotary_factor):
    """Partial rotary: tables from StableLM's rotary module, application vs GPT-NeoX's partial-aware
    `apply_rotary_pos_emb` (the code path StableLM/Phi/NeoX run)."""
    torch.manual_seed(2)
    bsz, seq, heads, head_dim, base = 2, 6, 4, 32, 10000.0
    cfg = StableLmConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": base, "partial_rotary_factor": partial_rotary_factor},
    )
    hf_rope = StableLmRotaryEmbedding(cfg)
    rotary_dim = int(head_dim * partial_rotary_factor)
    ours_rope = RotaryEmbedding(default_inv_freq(rotary_dim, base))
    assert ours_rope.rotary_dim == rotary_dim == 2 * hf_rope.inv_freq.numel()

    positions = torch.tensor([0, 5, 6, 7, 300, 301])
    q = torch.randn(bsz, seq, heads, head_dim)
    k = torch.randn(bsz, seq, heads, head_dim)
    cos, sin = ours_rope(positions)
    hf_cos, hf_sin = hf_rope(q, positions[None, :].expand(bsz, -1))
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=ATOL)

    q_ours, k_ours = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q_hf, k_hf = neox_apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)
    torch.testing.assert_close(q_ours, q_hf.transpose(1, 2), rtol=0, atol=ATOL)
    torch.testing.assert_close(k_ours, k_hf.transpose(1, 2), rtol=0, atol=ATOL)

    # The same thing through the full-width HF function applied only on the first R dims.
    q_rot_hf, _ = apply_rotary_pos_emb(
        q[..., :rotary_dim].transpose(1, 2), k[..., :rotary_dim].transpose(1, 2), hf_cos, hf_sin
    )
    torch.testing.assert_close(q_ours[..., :rotary_dim], q_rot_hf.transpose(1, 2), rtol=0, atol=ATOL)
    assert torch.equal(q_ours[..., rotary_dim:], q[..., rotary_dim:]), "pass-through dims must be untouched"
    assert not torch.allclose(q_ours[:, 1:, :, :rotary_dim], q[:, 1:, :, :rotary_dim], atol=1e-3)


@settings(max_examples=25, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**16),
    half_rotary=st.integers(1, 16),
    extra_dims=st.sampled_from([0, 2, 8]),
    positions=st.lists(st.integers(0, 8191), min_size=1, max_size=9),
    base=st.sampled_from([10000.0, 1000000.0]),
)
def test_apply_rotary_property_matches_neox(seed, half_rotary, extra_dims, positions, base):
    """Any positions (not necessarily consecutive), any rotary dim <= head dim."""
    torch.manual_seed(seed)
    rotary_dim = 2 * half_rotary
    head_dim = rotary_dim + extra_dims
    positions = torch.tensor(positions)
    x = torch.randn(1, len(positions), 3, head_dim)
    cos, sin = RotaryEmbedding(default_inv_freq(rotary_dim, base))(positions)
    ours = apply_rotary(x, cos, sin)
    ref, _ = neox_apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos[None], sin[None])
    torch.testing.assert_close(ours, ref.transpose(1, 2), rtol=0, atol=ATOL)
    # A rotation keeps the norm of every rotated pair.
    torch.testing.assert_close(ours.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope_class", ["RotaryPositionalEmbeddings", "Llama3ScaledRoPE", "Qwen2RotaryPositionalEmbeddings"])
def test_rope_from_torchtune_theta_matches_torchtune(rope_class):
    """torchtune's rotary modules applied by the blocks' two paths (MHA's rotation matrix, SHA's per-head
    rotation): interleaved pairs for torchtune's own rope and Llama 3's scaled one, rotate-half for Qwen2's."""
    from etblocks.attention import apply_rotary_3d, rotation_matrix
    from etblocks.torchtune_compat import import_torchtune

    import_torchtune()
    from torchtune.models.llama3_1 import Llama3ScaledRoPE
    from torchtune.models.qwen2 import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import RotaryPositionalEmbeddings

    classes = {c.__name__: c for c in (RotaryPositionalEmbeddings, Llama3ScaledRoPE, Qwen2RotaryPositionalEmbeddings)}
    head_dim, interleaved = 32, rope_class != "Qwen2RotaryPositionalEmbeddings"
    upstream = classes[rope_class](dim=head_dim, max_seq_len=4096)
    x = torch.randn(1, len(POSITIONS), 3, head_dim, generator=torch.Generator().manual_seed(0))
    expected = upstream(x, input_pos=POSITIONS[None, :])
    rope = RotaryEmbedding(upstream.theta, interleaved=interleaved)
    cos, sin = rope(POSITIONS)
    torch.testing.assert_close(apply_rotary(x, cos, sin, rotation_matrix(head_dim, interleaved)), expected, atol=ATOL, rtol=0)
    heads = [apply_rotary_3d(x[:, :, h], cos, sin, interleaved=interleaved) for h in range(3)]
    torch.testing.assert_close(torch.stack(heads, dim=2), expected, atol=ATOL, rtol=0)
    assert (apply_rotary(x, cos, sin, rotation_matrix(head_dim, not interleaved)) - expected).abs().max() > 0.1
