"""`SingleHeadAttention` (and `Conv2dLinear`) vs transformers attention modules holding the same weights.

Families, each exercising one feature through `SingleHeadAttention.from_attention(Attention(...))`:
- llama:  GQA, biases on q/k/v/o
- qwen3:  per-head q/k RMSNorm (one module shared by all heads)
- gemma2: softcap and a scale that is not head_dim**-0.5
- phi3:   fused qkv_proj, partial rotary 50%

HF runs eager attention over the whole sequence with an explicit causal additive mask; the SHA block runs
the whole sequence without a cache, and chunk by chunk with IO caches the test owns (it writes back the
returned rows and masks the empty slots, which hold noise). Both with nn.Linear and with conv2d=True.
fp32, atol 1e-5. Then: the block exports at fixed shapes, lowers to XNNPACK and runs in the ExecuTorch runtime.
"""

from __future__ import annotations

import pytest
import torch
from attention_refs import Family, causal_mask, hf_forward, io_mask, make_hf
from torch import nn
from transformers import Gemma2Config, LlamaConfig, Phi3Config, Qwen3Config
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RMSNorm, Qwen3RotaryEmbedding

from etblocks.attention import (
    Attention,
    Conv2dLinear,
    RotaryEmbedding,
    SingleHeadAttention,
    StaticSDPA,
    default_inv_freq,
)
from etblocks.state import IOKVCache, StaticKVCache

ATOL = 1e-5
DIM, HEADS, KV_HEADS = 64, 4, 2
SEQ = 11
CHUNKS = [4, 1, 3, 1, 1, 1]  # prefill chunks interleaved with decode steps; sums to SEQ
CACHE_LEN = 16  # more slots than SEQ: the last chunks still see empty slots


FAMILIES = [
    Family("llama", LlamaConfig, LlamaAttention, LlamaRotaryEmbedding, dict(attention_bias=True, head_dim=16)),
    Family("qwen3", Qwen3Config, Qwen3Attention, Qwen3RotaryEmbedding, dict(head_dim=16)),
    Family(
        "gemma2",
        Gemma2Config,
        Gemma2Attention,
        Gemma2RotaryEmbedding,
        dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0),
    ),
    Family("phi3", Phi3Config, Phi3Attention, Phi3RotaryEmbedding, dict(partial_rotary_factor=0.5), fused=True),
]


def sha_from_hf(family: Family, cfg, hf: nn.Module, io_cache: bool = False, conv2d: bool = False):
    """An `Attention` over the HF module's own weights, split into a SHA block."""
    head_dim = hf.head_dim
    rotary_dim = int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    norms = dict(q_norm=hf.q_norm, k_norm=hf.k_norm) if hasattr(hf, "q_norm") else {}
    projections = (
        dict(q_proj=None, k_proj=None, v_proj=None, qkv_proj=hf.qkv_proj)
        if family.fused
        else dict(q_proj=hf.q_proj, k_proj=hf.k_proj, v_proj=hf.v_proj)
    )
    attention = Attention(
        HEADS,
        KV_HEADS,
        head_dim,
        StaticSDPA(hf.scaling, softcap=getattr(hf, "attn_logit_softcapping", None)),
        IOKVCache(KV_HEADS, head_dim) if io_cache else None,
        o_proj=hf.o_proj,
        rope=RotaryEmbedding(default_inv_freq(rotary_dim, cfg.rope_parameters["rope_theta"])),
        **projections,
        **norms,
    )
    return SingleHeadAttention.from_attention(attention, conv2d=conv2d).eval()


@pytest.fixture(params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request):
    return request.param


CONV = pytest.mark.parametrize("conv2d", [False, True], ids=["linear", "conv2d"])


@CONV
@pytest.mark.parametrize("rope_source", ["own_rope", "hf_tables"])
def test_full_sequence_without_cache_matches_hf(family, conv2d, rope_source):
    cfg, hf, rotary = make_hf(family)
    x = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    block = sha_from_hf(family, cfg, hf, conv2d=conv2d)
    pos = torch.arange(SEQ)
    tables = None
    if rope_source == "hf_tables":
        cos, sin = rotary(x, pos[None])
        tables = (cos[0], sin[0])  # [T, R]
        block.rope = None
    with torch.no_grad():
        ref = hf_forward(hf, rotary, x)
        out = block(x, pos, position_embeddings=tables, mask=causal_mask(SEQ))
    assert out.shape == ref.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


@CONV
def test_chunked_io_cache_matches_hf_full_sequence(family, conv2d):
    cfg, hf, rotary = make_hf(family, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, SEQ, DIM, generator=g)
    block = sha_from_hf(family, cfg, hf, io_cache=True, conv2d=conv2d)
    # Noise in the empty slots: only the mask keeps it out.
    k_cache = torch.randn(2, CACHE_LEN, KV_HEADS, hf.head_dim, generator=g)
    v_cache = torch.randn(2, CACHE_LEN, KV_HEADS, hf.head_dim, generator=g)
    outs, start = [], 0
    with torch.no_grad():
        ref = hf_forward(hf, rotary, x)
        for n in CHUNKS:
            pos = torch.arange(start, start + n)
            mask = io_mask(start, n, CACHE_LEN)
            y, k_new, v_new = block(x[:, start : start + n], pos, kv=(k_cache, v_cache), mask=mask)
            assert k_new.shape == v_new.shape == (2, n, KV_HEADS, hf.head_dim)
            k_cache[:, start : start + n] = k_new
            v_cache[:, start : start + n] = v_new
            outs.append(y)
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=0, atol=ATOL)


def test_equals_attention_with_io_cache_rows_included():
    """The returned rows are `Attention`'s own new k/v rows (cache layout `[B, T, Hkv, Dh]`)."""
    cfg, hf, _ = make_hf(FAMILIES[1], seed=4)
    block = sha_from_hf(FAMILIES[1], cfg, hf, io_cache=True)
    attention = Attention(
        HEADS, KV_HEADS, hf.head_dim, block.sdpa, block.kv_cache, hf.q_proj, hf.k_proj, hf.v_proj, hf.o_proj,
        rope=block.rope, q_norm=hf.q_norm, k_norm=hf.k_norm,
    )
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 3, DIM, generator=g)
    kv = (torch.randn(1, 6, KV_HEADS, hf.head_dim, generator=g), torch.randn(1, 6, KV_HEADS, hf.head_dim, generator=g))
    args = (x, torch.arange(4, 7))
    with torch.no_grad():
        mask = io_mask(4, 3, 6)
        for got, want in zip(block(*args, kv=kv, mask=mask), attention(*args, kv=kv, mask=mask)):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@CONV
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_head_weights_are_views_of_the_attention_weights(conv2d, fused):
    family = FAMILIES[3] if fused else FAMILIES[0]
    cfg, hf, _ = make_hf(family, seed=6)
    block = sha_from_hf(family, cfg, hf, conv2d=conv2d)
    dh = hf.head_dim
    if fused:
        q_src = k_src = v_src = hf.qkv_proj
        k_row, v_row = HEADS * dh, (HEADS + KV_HEADS) * dh
    else:
        (q_src, k_src, v_src), k_row, v_row = (hf.q_proj, hf.k_proj, hf.v_proj), 0, 0
    for h, head in enumerate(block.q_heads):
        assert head.weight.data_ptr() == q_src.weight[h * dh].data_ptr()
    for j in range(KV_HEADS):
        assert block.k_heads[j].weight.data_ptr() == k_src.weight[k_row + j * dh].data_ptr()
        assert block.v_heads[j].weight.data_ptr() == v_src.weight[v_row + j * dh].data_ptr()
    assert block.o_proj.weight.data_ptr() == hf.o_proj.weight.data_ptr()
    assert isinstance(block.o_proj, Conv2dLinear) == conv2d
    assert all(isinstance(m, Conv2dLinear) == conv2d for m in [*block.q_heads, *block.k_heads, *block.v_heads])
    with torch.no_grad():  # a view follows its source
        q_src.weight[dh + 1, 2] += 1.0
    assert block.q_heads[1].weight.flatten(1)[1, 2] == q_src.weight[dh + 1, 2]
    if not fused:
        assert block.k_heads[1].bias.data_ptr() == hf.k_proj.bias[dh].data_ptr()


def test_conv2d_linear_equals_linear_and_shares_its_parameters():
    torch.manual_seed(7)
    linear = nn.Linear(12, 20)
    conv = Conv2dLinear.from_linear(linear)
    assert (conv.in_features, conv.out_features) == (12, 20)
    assert conv.weight.shape == (20, 12, 1, 1) and conv.weight.data_ptr() == linear.weight.data_ptr()
    assert conv.bias is linear.bias
    x = torch.randn(3, 5, 12)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), linear(x), rtol=0, atol=ATOL)
    assert Conv2dLinear.from_linear(nn.Linear(12, 20, bias=False)).bias is None


def test_attend_head_hook_sees_3d_heads():
    class Counting(SingleHeadAttention):
        shapes = []

        def attend_head(self, q, k, v, mask):
            type(self).shapes.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
            return super().attend_head(q, k, v, mask)

    cfg, hf, _ = make_hf(FAMILIES[0], seed=8)
    block = Counting.from_attention(Attention(
        HEADS, KV_HEADS, 16, StaticSDPA(0.25), None, hf.q_proj, hf.k_proj, hf.v_proj, hf.o_proj,
    ))
    assert type(block) is Counting
    with torch.no_grad():
        block(torch.randn(1, 5, DIM), torch.arange(5), mask=causal_mask(5))
    assert Counting.shapes == [((1, 5, 16), (1, 5, 16), (1, 5, 16))] * HEADS


@pytest.mark.parametrize("layout", ["full", "heads_first"])
def test_rejects_non_per_head_qk_norms(layout):
    lin = nn.Linear(32, 32)
    attention = Attention(
        4, 4, 8, StaticSDPA(1.0), None, lin, lin, lin, lin,
        q_norm=Qwen3RMSNorm(32), k_norm=Qwen3RMSNorm(32), qk_norm_layout=layout,
    )
    with pytest.raises(ValueError, match=rf"{layout}.*per-head"):
        SingleHeadAttention.from_attention(attention)


def test_boolean_mask_equals_additive_mask():
    cfg, hf, _ = make_hf(FAMILIES[2], seed=12)
    block = sha_from_hf(FAMILIES[2], cfg, hf)
    x = torch.randn(1, 6, DIM)
    with torch.no_grad():
        boolean = block(x, torch.arange(6), mask=torch.ones(6, 6, dtype=torch.bool).tril())
        torch.testing.assert_close(boolean, block(x, torch.arange(6), mask=causal_mask(6)), rtol=0, atol=0)


def test_rejects_positional_caches():
    lin = nn.Linear(16, 16)
    attention = Attention(2, 2, 8, StaticSDPA(1.0), StaticKVCache(1, 8, 2, 8), lin, lin, lin, lin)
    with pytest.raises(ValueError, match="IOKVCache or no cache"):
        SingleHeadAttention.from_attention(attention)


def test_rejects_missing_mask_and_mismatched_kv():
    lin = nn.Linear(16, 16)
    attention = Attention(2, 2, 8, StaticSDPA(1.0), None, lin, lin, lin, lin)
    block = SingleHeadAttention.from_attention(attention)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="mask"):
        block(x, torch.arange(3))
    kv = (torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8))
    with pytest.raises(ValueError, match="IOKVCache"):
        block(x, torch.arange(3), kv=kv, mask=io_mask(0, 3, 4))


# --- export -------------------------------------------------------------------------------------------------

EXPORT_T, EXPORT_CACHE = 3, 8


class StaticProgram(nn.Module):
    """The static program contract: `(x, input_pos, k_cache, v_cache, mask) -> (y, k_new, v_new)`, flat inputs."""

    def __init__(self, block: SingleHeadAttention) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, input_pos, k_cache, v_cache, mask):
        return self.block(x, input_pos, kv=(k_cache, v_cache), mask=mask)


def export_inputs(head_dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(9)
    start = 5
    return (
        torch.randn(1, EXPORT_T, DIM, generator=g),
        torch.arange(start, start + EXPORT_T),
        torch.randn(1, EXPORT_CACHE, KV_HEADS, head_dim, generator=g),
        torch.randn(1, EXPORT_CACHE, KV_HEADS, head_dim, generator=g),
        io_mask(start, EXPORT_T, EXPORT_CACHE),
    )


def test_exported_graph_keeps_heads_3d():
    """The point of SHA: no 4-D head tensors in the graph; only the cache inputs and the returned rows are 4-D."""
    cfg, hf, _ = make_hf(FAMILIES[1], seed=10)
    program = StaticProgram(sha_from_hf(FAMILIES[1], cfg, hf, io_cache=True))
    with torch.no_grad():
        ep = torch.export.export(program, export_inputs(hf.head_dim), strict=False)
    four_d = {
        n.target for n in ep.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 4
    }
    assert four_d <= {torch.ops.aten.stack.default}, four_d


@CONV
def test_exports_lowers_to_xnnpack_and_runs_like_eager(conv2d):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    cfg, hf, _ = make_hf(FAMILIES[0], seed=11)  # GQA with biases
    program = StaticProgram(sha_from_hf(FAMILIES[0], cfg, hf, io_cache=True, conv2d=conv2d)).eval()
    inputs = export_inputs(hf.head_dim)
    with torch.no_grad():
        want = program(*inputs)
        ep = torch.export.export(program, inputs, strict=False)
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    left_on_cpu = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    assert any("call_delegate" in op for op in left_on_cpu)
    heavy = ("convolution", "linear", "addmm", ".mm.", "bmm", "softmax")
    assert not [op for op in left_on_cpu if any(h in op for h in heavy)], left_on_cpu
    # Keep the buffer and the Program alive while the Method runs: the Method points into both.
    buffer = edge.to_executorch().buffer
    et_program = Runtime.get().load_program(buffer)
    got = et_program.load_method("forward").execute(list(inputs))
    assert len(got) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)
