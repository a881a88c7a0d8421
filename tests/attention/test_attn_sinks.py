"""Attention sinks (GPT-OSS): etblocks blocks vs transformers' `GptOssAttention` holding the same weights.

GPT-OSS attention adds to llama's: one learned sink logit per head (a softmax column that is dropped), biases
on q/k/v/o, a sliding window on some layers, and `(cos, sin)` tables of Dh/2 frequencies. Each test runs a
sliding and a full layer (GQA, biases, sinks with std 1 so they move the output).

- `Attention`: whole sequence; chunked through the in-place cache (ring / static, DynamicSDPA); chunked with
  IO caches (StaticSDPA, caller's mask). `SingleHeadAttention`: whole sequence and IO caches. fp32, atol 1e-5.
- Export: a block with sinks at dynamic T lowers to XNNPACK with every matmul and softmax delegated, and the
  program runs like eager in the ExecuTorch runtime.
- Swap: a tiny GPT-OSS model swapped for xnnpack matches upstream logits (1e-4); the qnn (SHA) swap passes its
  probe check.
"""

from __future__ import annotations

import copy

import pytest
import torch
from attention_refs import causal_mask, hf_forward, io_mask, randomize_weights
from hf_models import prompt_ids, tiny_model
from test_attn_export import HEADS as EXPORT_HEADS
from test_attn_export import SCHEDULES, assert_matches_eager, export_dynamic, make
from torch import nn
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

import etblocks
from etblocks.attention import (
    Attention,
    CustomSDPA,
    DynamicSDPA,
    RotaryEmbedding,
    SingleHeadAttention,
    StaticSDPA,
)
from etblocks.state import IOKVCache, RingKVCache, StaticKVCache
from etblocks.swap.hf.adapter import HFAttention, HFSingleHeadAttention

ATOL = 1e-5
LOGIT_ATOL = 1e-4
DIM, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 4, 2, 16, 6
SEQ = 11  # longer than the window
CHUNKS = [4, 1, 3, 1, 1, 1]  # prefill chunks interleaved with decode steps; sums to SEQ
CACHE_LEN = 16
LAYER_TYPES = ["sliding_attention", "full_attention"]

CONFIG = GptOssConfig(
    hidden_size=DIM,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    sliding_window=WINDOW,
    layer_types=LAYER_TYPES,
    num_hidden_layers=2,
    attn_implementation="eager",
)
ROTARY = GptOssRotaryEmbedding(CONFIG)  # YaRN by default: attention_scaling != 1

LAYERS = pytest.mark.parametrize("layer_idx", [0, 1], ids=LAYER_TYPES)


def randomize(param: torch.Tensor, seed: int, std: float = 1.0) -> None:
    with torch.no_grad():
        param.copy_(std * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))


def make_hf(layer_idx: int, seed: int = 0) -> GptOssAttention:
    attn = GptOssAttention(CONFIG, layer_idx).eval()
    randomize_weights(attn, seed)
    randomize(attn.sinks, seed + 100)
    return attn


def block_from_hf(hf: GptOssAttention, io_cache: bool = False, kv_cache=None, sinks: bool = True) -> Attention:
    """An `Attention` over the HF module's own weights and sinks, with our rope on GPT-OSS's frequencies."""
    window = hf.sliding_window
    sdpa = StaticSDPA(hf.scaling, sliding_window=window) if io_cache else DynamicSDPA(hf.scaling, sliding_window=window)
    return Attention(
        HEADS, KV_HEADS, HEAD_DIM, sdpa, IOKVCache(KV_HEADS, HEAD_DIM) if io_cache else kv_cache,
        hf.q_proj, hf.k_proj, hf.v_proj, hf.o_proj,
        rope=RotaryEmbedding(ROTARY.inv_freq, ROTARY.attention_scaling),
        sinks=hf.sinks if sinks else None,
    ).eval()


def inputs(seed: int) -> torch.Tensor:
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(seed))


@LAYERS
@pytest.mark.parametrize("rope_source", ["own_rope", "hf_half_tables"])
def test_full_sequence_matches_hf(layer_idx, rope_source):
    hf = make_hf(layer_idx)
    x = inputs(1)
    block = block_from_hf(hf)
    tables = None
    if rope_source == "hf_half_tables":  # GPT-OSS's (x1 cos - x2 sin, x2 cos + x1 sin) is rotate-half on cat(f, f)
        cos, sin = ROTARY(x, torch.arange(SEQ)[None])
        tables = (torch.cat((cos[0], cos[0]), dim=-1), torch.cat((sin[0], sin[0]), dim=-1))
        block.rope = None
    with torch.no_grad():
        ref = hf_forward(hf, ROTARY, x, hf.sliding_window)
        out = block(x, torch.arange(SEQ), position_embeddings=tables)
        without_sinks = block_from_hf(hf, sinks=False)(x, torch.arange(SEQ))
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    assert (without_sinks - ref).abs().max() > 0.05, "the sinks do not change the output: the test proves nothing"


@LAYERS
def test_chunked_inplace_cache_matches_hf_full_sequence(layer_idx):
    hf = make_hf(layer_idx, seed=2)
    x = inputs(3)
    if hf.sliding_window is None:
        cache = StaticKVCache(2, CACHE_LEN, KV_HEADS, HEAD_DIM)
    else:
        cache = RingKVCache(2, hf.sliding_window, KV_HEADS, HEAD_DIM)
    block = block_from_hf(hf, kv_cache=cache)
    outs, start = [], 0
    with torch.no_grad():
        ref = hf_forward(hf, ROTARY, x, hf.sliding_window)
        for n in CHUNKS:
            outs.append(block(x[:, start : start + n], torch.arange(start, start + n)))
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=0, atol=ATOL)


@LAYERS
@pytest.mark.parametrize("form", ["mha", "sha"])
def test_chunked_io_cache_matches_hf_full_sequence(layer_idx, form):
    hf = make_hf(layer_idx, seed=4)
    g = torch.Generator().manual_seed(5)
    x = inputs(6)
    block = block_from_hf(hf, io_cache=True)
    if form == "sha":
        block = SingleHeadAttention.from_attention(block)
    # Noise in the empty slots: only the mask keeps it out.
    k_cache = torch.randn(2, CACHE_LEN, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(2, CACHE_LEN, KV_HEADS, HEAD_DIM, generator=g)
    outs, start = [], 0
    with torch.no_grad():
        ref = hf_forward(hf, ROTARY, x, hf.sliding_window)
        for n in CHUNKS:
            mask = io_mask(start, n, CACHE_LEN, hf.sliding_window)
            positions = torch.arange(start, start + n)
            y, k_new, v_new = block(x[:, start : start + n], positions, kv=(k_cache, v_cache), mask=mask)
            k_cache[:, start : start + n] = k_new
            v_cache[:, start : start + n] = v_new
            outs.append(y)
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=0, atol=ATOL)


@LAYERS
def test_sha_full_sequence_matches_hf(layer_idx):
    hf = make_hf(layer_idx, seed=7)
    x = inputs(8)
    block = SingleHeadAttention.from_attention(block_from_hf(hf))
    assert block.sinks is hf.sinks
    with torch.no_grad():
        ref = hf_forward(hf, ROTARY, x, hf.sliding_window)
        out = block(x, torch.arange(SEQ), mask=causal_mask(SEQ, hf.sliding_window))
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


def test_sinks_keep_the_upstream_state_dict_key():
    hf = make_hf(1, seed=9)
    block = block_from_hf(hf)
    assert block.sinks is hf.sinks  # moved, not copied
    assert "sinks" in block.state_dict() and "sinks" in SingleHeadAttention.from_attention(block).state_dict()
    assert "sinks" not in block_from_hf(hf, sinks=False).state_dict()


def test_rejects_sinks_the_sdpa_cannot_apply_or_of_the_wrong_shape():
    lin = nn.Linear(16, 16)
    with pytest.raises(ValueError, match="CustomSDPA cannot apply attention sinks"):
        Attention(2, 2, 8, CustomSDPA(1.0), None, lin, lin, lin, lin, sinks=nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError, match=r"sinks must have shape \[2\]"):
        Attention(2, 1, 8, DynamicSDPA(1.0), None, lin, lin, lin, lin, sinks=nn.Parameter(torch.zeros(1)))


# --- export -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["portable", "ring"], ids=["static_cache", "ring_cache"])
def test_exported_block_with_sinks_delegates_matmuls_to_xnnpack_and_runs_like_eager(kind):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from etblocks.export.delegation import summarize

    module = make(kind)  # test_attn_export's block (dynamic T up to its cache length), given sinks
    module.attention.sinks = nn.Parameter(torch.randn(EXPORT_HEADS, generator=torch.Generator().manual_seed(10)))
    eager = copy.deepcopy(module)
    ep, _ = export_dynamic(module, edge=False)
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    summary = summarize(edge.exported_program().graph_module)
    assert summary.ops_per_delegate.get("XnnpackBackend", 0) > 0
    heavy = ("linear", "addmm", "mm", "bmm", "softmax", "_softmax")
    assert not [op for op in summary.cpu_ops if op.split(".")[1] in heavy], summary
    # Keep the buffer and the Program alive while the Method runs: the Method points into both.
    buffer = edge.to_executorch().buffer
    method = Runtime.get().load_program(buffer).load_method("forward")
    assert_matches_eager(lambda x, start: method.execute([x, start])[0], eager, SCHEDULES[kind])


# --- swap ---------------------------------------------------------------------------------------------------


def tiny_gpt_oss(seed: int = 11) -> nn.Module:
    """Tiny GPT-OSS (upstream MoE) with sinks (std 1) and attention biases that matter."""
    model = tiny_model(
        "gpt_oss", intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
    )
    for i, layer in enumerate(model.model.layers):
        randomize(layer.self_attn.sinks, seed + 10 * i)
        for j, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
            randomize(getattr(layer.self_attn, name).bias, seed + 10 * i + j + 1, std=0.2)
    return model


def test_swap_xnnpack_converts_every_attention_and_matches_upstream_logits():
    original = tiny_gpt_oss()
    swapped = copy.deepcopy(original)
    etblocks.swap(swapped, backend="xnnpack", max_seq_len=64, verify=True)
    sliding, full = (layer.self_attn for layer in swapped.model.layers)
    assert isinstance(sliding, HFAttention) and isinstance(full, HFAttention)
    assert isinstance(sliding.kv_cache, RingKVCache) and sliding.sdpa.sliding_window == WINDOW
    assert type(full.sdpa) is DynamicSDPA and isinstance(full.kv_cache, StaticKVCache)  # CustomSDPA has no sinks
    state = swapped.state_dict()
    for i in range(2):
        key = f"model.layers.{i}.self_attn.sinks"
        torch.testing.assert_close(state[key], original.state_dict()[key], rtol=0, atol=0)

    tokens = prompt_ids(20)
    with torch.no_grad():
        expected = original(tokens).logits
        actual = swapped(tokens).logits
        assert (actual - expected).abs().max().item() <= LOGIT_ATOL
        chunks = []
        for start, end in ((0, 7), (7, 8), (8, 20)):  # through the ring and static caches, past the window
            positions = torch.arange(start, end)[None]
            chunks.append(swapped(input_ids=tokens[:, start:end], position_ids=positions, use_cache=False).logits)
    assert (torch.cat(chunks, dim=1) - expected).abs().max().item() <= LOGIT_ATOL


def test_swap_qnn_single_head_blocks_pass_the_probe():
    model = tiny_gpt_oss()
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    etblocks.swap(model, backend="qnn", max_seq_len=64)  # verify=True: each block is checked on a probe
    blocks = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(b, HFSingleHeadAttention) for b in blocks)
    assert all(b.sinks is s for b, s in zip(blocks, sinks))
