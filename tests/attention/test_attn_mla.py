"""`MLAttention` vs transformers' DeepSeek-V2/V3 attention modules holding the same weights.

Families:
- v3-interleave: low-rank query, interleaved rope pairs, YaRN with mscale != mscale_all_dim (scale != Dh^-0.5,
  rope tables scaled)
- v3-rotate-half: full-rank q_proj, rotate-half rope, YaRN with mscale == mscale_all_dim
- v2: full-rank q_proj, complex `freqs_cis` rope (converted with `cos_sin_from_complex`), YaRN

HF runs eager attention over the whole sequence with an explicit causal additive mask; etblocks runs the whole
sequence without a cache, chunk by chunk with a StaticKVCache (index_copy_ and llama::update_cache) and chunk by
chunk with caller-owned IO caches, each absorbed and expanded. fp32, atol 1e-5.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from attention_refs import Family, hf_attention, io_mask, make_hf
from torch import nn
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from etblocks.attention import MLAttention, RotaryEmbedding, cos_sin_from_complex
from etblocks.state import IOKVCache, StaticKVCache

ATOL = 1e-5
SEQ = 11
CHUNKS = [4, 1, 3, 1, 1, 1]  # prefill chunks interleaved with decode steps; sums to SEQ
CACHE_LEN = 16
HEADS, RANK, NOPE, ROPE, V = 4, 32, 16, 8, 12


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    return dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=32,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


@dataclass
class MLAFamily(Family):
    complex_rope: bool = False

    @property
    def interleave(self) -> bool:
        return self.config.get("rope_interleave", True)


FAMILIES = [
    MLAFamily(
        "v3-interleave",
        DeepseekV3Config,
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
        dict(q_lora_rank=24, rope_interleave=True, rope_parameters=yarn(0.707, 1.0)),
    ),
    MLAFamily(
        "v3-rotate-half",
        DeepseekV3Config,
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
        dict(q_lora_rank=None, rope_interleave=False, rope_parameters=yarn(1.0, 1.0)),
    ),
    MLAFamily(
        "v2",
        DeepseekV2Config,
        DeepseekV2Attention,
        DeepseekV2RotaryEmbedding,
        dict(q_lora_rank=None, rope_parameters=yarn(0.707, 0.707)),
        complex_rope=True,
    ),
]


def randomize(module: nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform and norms are far from identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=g))


def make_mla(family: MLAFamily, seed: int = 0):
    """`(attention, rotary)` of `family` at this file's MLA sizes."""
    _, attn, rotary = make_hf(
        family, seed, randomize=randomize, num_key_value_heads=HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V, max_position_embeddings=128,
    )
    return attn, rotary


def hf_tables(family: MLAFamily, rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor):
    """The rotary input HF's attention takes, and the `(cos, sin)` `[1, T, R]` etblocks takes."""
    tables = rotary(x, positions[None])
    return tables, (cos_sin_from_complex(tables) if family.complex_rope else tables)


def mla_from_hf(family: MLAFamily, hf: nn.Module, rotary: nn.Module, kv_cache=None, absorb: bool = True) -> MLAttention:
    query = (
        dict(q_proj=hf.q_proj)
        if hf.q_lora_rank is None
        else dict(q_a_proj=hf.q_a_proj, q_a_norm=hf.q_a_layernorm, q_b_proj=hf.q_b_proj)
    )
    return MLAttention(
        HEADS, RANK, NOPE, ROPE, V, hf.scaling,
        kv_a_proj=hf.kv_a_proj_with_mqa,
        kv_a_norm=hf.kv_a_layernorm,
        kv_b_proj=hf.kv_b_proj,
        o_proj=hf.o_proj,
        kv_cache=kv_cache,
        rope=RotaryEmbedding(rotary.inv_freq, rotary.attention_scaling),
        rope_interleave=family.interleave,
        absorb=absorb,
        **query,
    ).eval()


def hf_forward(family: MLAFamily, hf, rotary, x: torch.Tensor) -> torch.Tensor:
    tables, _ = hf_tables(family, rotary, x, torch.arange(x.shape[1]))
    return hf_attention(hf, x, tables)


@pytest.fixture(params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request):
    return request.param


ABSORB = pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])


def test_scale_differs_from_head_dim_rule():
    """The YaRN families really exercise the mscale correction of the softmax scale."""
    hf, _ = make_mla(FAMILIES[0])
    assert abs(hf.scaling - (NOPE + ROPE) ** -0.5) > 0.01


@ABSORB
def test_full_sequence_matches_hf(family, absorb):
    """No cache, HF's rotary tables passed in (`[1, T, R]`, as the HF model computes them)."""
    hf, rotary = make_mla(family)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    block = mla_from_hf(family, hf, rotary, absorb=absorb)
    block.rope = None
    _, tables = hf_tables(family, rotary, x, torch.arange(SEQ))
    with torch.no_grad():
        ref = hf_forward(family, hf, rotary, x)
        out = block(x, torch.arange(SEQ), position_embeddings=tables)
    assert out.shape == ref.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


@ABSORB
@pytest.mark.parametrize("custom", [False, True], ids=["index_copy", "update_cache"])
def test_chunked_static_cache_matches_hf_full_sequence(family, absorb, custom):
    hf, rotary = make_mla(family, seed=2)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(3))
    cache = StaticKVCache(2, CACHE_LEN, 1, RANK, use_custom_op=custom, v_head_dim=ROPE)
    block = mla_from_hf(family, hf, rotary, kv_cache=cache, absorb=absorb)
    outs, start = [], 0
    with torch.no_grad():
        ref = hf_forward(family, hf, rotary, x)
        for n in CHUNKS:
            outs.append(block(x[:, start : start + n], torch.arange(start, start + n)))
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=0, atol=ATOL)
    # Only the compressed latent and the shared roped key are cached.
    assert cache.k_cache.shape == (2, CACHE_LEN, 1, RANK) and cache.v_cache.shape == (2, CACHE_LEN, 1, ROPE)


@ABSORB
def test_chunked_io_cache_matches_hf_full_sequence(family, absorb):
    """The caller keeps the caches, passes them with the mask and writes back the rows the block returns."""
    hf, rotary = make_mla(family, seed=4)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(5))
    block = mla_from_hf(family, hf, rotary, kv_cache=IOKVCache(1, RANK, v_head_dim=ROPE), absorb=absorb)
    latent_cache, rope_cache = torch.zeros(2, CACHE_LEN, 1, RANK), torch.zeros(2, CACHE_LEN, 1, ROPE)
    outs, start = [], 0
    with torch.no_grad():
        ref = hf_forward(family, hf, rotary, x)
        for n in CHUNKS:
            y, latent_new, rope_new = block(
                x[:, start : start + n],
                torch.arange(start, start + n),
                kv=(latent_cache, rope_cache),
                mask=io_mask(start, n, CACHE_LEN),
            )
            assert latent_new.shape == (2, n, 1, RANK) and rope_new.shape == (2, n, 1, ROPE)
            latent_cache[:, start : start + n] = latent_new
            rope_cache[:, start : start + n] = rope_new
            outs.append(y)
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=0, atol=ATOL)


def test_absorbed_path_never_expands_the_cache():
    hf, rotary = make_mla(FAMILIES[0], seed=6)
    calls = []
    hf.kv_b_proj.register_forward_hook(lambda *args: calls.append(1))
    cache = StaticKVCache(1, CACHE_LEN, 1, RANK, v_head_dim=ROPE)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        mla_from_hf(FAMILIES[0], hf, rotary, kv_cache=cache, absorb=True)(x, torch.arange(5))
        assert not calls
        mla_from_hf(FAMILIES[0], hf, rotary, absorb=False)(x, torch.arange(5))
    assert calls


def test_absorbed_weights_are_views_of_kv_b_proj():
    """W_UK / W_UV share kv_b_proj's storage, and the state dict keeps only the upstream names."""
    hf, rotary = make_mla(FAMILIES[0], seed=7)
    block = mla_from_hf(FAMILIES[0], hf, rotary)
    weight = hf.kv_b_proj.weight
    assert block.w_uk.data_ptr() == weight.data_ptr()
    assert block.w_uk.shape == (HEADS, NOPE, RANK) and block.w_uv_t.shape == (HEADS, RANK, V)
    torch.testing.assert_close(block.w_uv_t[1].T, weight[(NOPE + V) + NOPE : 2 * (NOPE + V)], rtol=0, atol=0)
    upstream = {k for k in hf.state_dict()}
    renamed = {"kv_a_proj." + k.split(".", 1)[1] if k.startswith("kv_a_proj_with_mqa") else k for k in upstream}
    renamed = {k.replace("kv_a_layernorm", "kv_a_norm").replace("q_a_layernorm", "q_a_norm") for k in renamed}
    assert set(block.state_dict()) == renamed


def test_own_rope_equals_hf_tables(family):
    """`cos_sin_from_complex` (V2) and HF's `cat(freqs, freqs)` tables equal the block's own RotaryEmbedding."""
    hf, rotary = make_mla(family, seed=8)
    block = mla_from_hf(family, hf, rotary)
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(9))
    pos = torch.arange(3, 9)
    _, (cos, sin) = hf_tables(family, rotary, x, pos)
    own_cos, own_sin = block.rope(pos)
    torch.testing.assert_close(cos[0], own_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], own_sin, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(block(x, pos, position_embeddings=(cos[0], sin[0])), block(x, pos), rtol=0, atol=ATOL)


class Wrapper(nn.Module):
    """`forward(x [1, T, D], start [1])`: positions are `start + arange(T)`, as in the dynamic program contract."""

    def __init__(self, attention: MLAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return self.attention(x, torch.arange(x.shape[1]) + start[0])


@pytest.mark.parametrize("custom", [True, False], ids=["update_cache", "index_copy"])
def test_exports_with_dynamic_length_lowers_to_xnnpack_and_runs_like_eager(custom):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    context = 8
    hf, rotary = make_mla(FAMILIES[0], seed=10)
    cache = StaticKVCache(1, context, 1, RANK, use_custom_op=custom, v_head_dim=ROPE)
    module = Wrapper(mla_from_hf(FAMILIES[0], hf, rotary, kv_cache=cache)).eval()
    eager = copy.deepcopy(module)
    seq = torch.export.Dim("T", min=1, max=context)
    with torch.no_grad():
        ep = torch.export.export(module, (torch.randn(1, 4, 64), torch.tensor([0])), dynamic_shapes=({1: seq}, None), strict=False)
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    left_on_cpu = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    assert any("call_delegate" in op for op in left_on_cpu)
    heavy = ("linear", "addmm", ".mm.", "bmm", "matmul", "softmax")
    assert not [op for op in left_on_cpu if any(h in op for h in heavy)], left_on_cpu
    # Keep the buffer and the Program alive while the Method runs: the Method points into both.
    buffer = edge.to_executorch().buffer
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for start, length in [(0, 3), (3, 1), (4, 4)]:
            x = torch.randn(1, length, 64, generator=g)
            got = method.execute([x, torch.tensor([start])])[0]
            torch.testing.assert_close(got, eager(x, torch.tensor([start])), rtol=0, atol=ATOL)


@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
def test_program_holds_absorbed_weights_as_contiguous_constants(backend):
    """After the passes `etblocks.export` runs before lowering, the program holds W_UK `[H, nope, r]` and W_UV^T
    `[H, r, v]` as contiguous constants in place of kv_b_proj.weight, so no call slices or transposes a weight;
    lowered, it runs like eager. The block itself keeps reading views of the weight."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from etblocks.backends import get_backend

    hf, rotary = make_mla(FAMILIES[0], seed=12)
    block = mla_from_hf(FAMILIES[0], hf, rotary, kv_cache=StaticKVCache(1, 8, 1, RANK, v_head_dim=ROPE))
    module, eager = Wrapper(block).eval(), copy.deepcopy(Wrapper(block)).eval()
    seq = torch.export.Dim("T", min=1, max=8)
    with torch.no_grad():
        ep = torch.export.export(module, (torch.randn(1, 4, 64), torch.tensor([0])), dynamic_shapes=({1: seq}, None), strict=False)
    get_backend(backend).apply_passes(ep)
    assert not [name for name in ep.state_dict if "kv_b_proj" in name]
    constants = {tuple(c.shape): c for c in ep.constants.values()}
    for expected in (block.w_uk, block.w_uv_t):
        assert constants[tuple(expected.shape)].is_contiguous()
        torch.testing.assert_close(constants[tuple(expected.shape)], expected.detach(), rtol=0, atol=0)
    assert block.w_uk.data_ptr() == hf.kv_b_proj.weight.data_ptr()
    signature = ep.graph_signature
    weights = {**signature.inputs_to_parameters, **signature.inputs_to_lifted_tensor_constants}
    aten = torch.ops.aten
    relayout = {aten.view.default, aten.reshape.default, aten.slice.Tensor, aten.transpose.int, aten.permute.default}
    relaid = [(n.name, str(u.target)) for n in ep.graph.nodes if n.name in weights for u in n.users if u.target in relayout]
    assert not relaid, relaid
    partitioners = get_backend(backend).partitioners({})
    buffer = to_edge_transform_and_lower(ep, partitioner=partitioners).to_executorch().buffer
    program = Runtime.get().load_program(buffer)  # kept alive while the Method runs
    method = program.load_method("forward")
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for start, length in [(0, 3), (3, 1), (4, 4)]:
            x = torch.randn(1, length, 64, generator=g)
            torch.testing.assert_close(method.execute([x, torch.tensor([start])])[0], eager(x, torch.tensor([start])), rtol=0, atol=ATOL)


def test_constructor_rejects_bad_configurations():
    def build(**overrides):
        args = dict(
            n_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, scale=0.3,
            kv_a_proj=nn.Linear(16, 12), kv_a_norm=nn.Identity(), kv_b_proj=nn.Linear(8, 16, bias=False),
            o_proj=nn.Linear(8, 16), kv_cache=None, q_proj=nn.Linear(16, 16),
        )
        args.update(overrides)
        return MLAttention(**args)

    build()
    with pytest.raises(ValueError, match="not both"):
        build(q_a_proj=nn.Linear(16, 6), q_a_norm=nn.Identity(), q_b_proj=nn.Linear(6, 16))
    with pytest.raises(ValueError, match="not both"):
        build(q_proj=None)
    with pytest.raises(ValueError, match="needs all"):
        build(q_proj=None, q_a_proj=nn.Linear(16, 6), q_b_proj=nn.Linear(6, 16))
    with pytest.raises(ValueError, match="even"):
        build(qk_rope_head_dim=3, kv_a_proj=nn.Linear(16, 11))
    with pytest.raises(ValueError, match="rope covers"):
        build(rope=RotaryEmbedding(torch.ones(3)))
    with pytest.raises(ValueError, match="kv_b_proj must be"):
        build(kv_b_proj=nn.Linear(8, 12, bias=False))
    with pytest.raises(ValueError, match="no bias"):
        build(kv_b_proj=nn.Linear(8, 16))
    with pytest.raises(ValueError, match="one head"):
        build(kv_cache=StaticKVCache(1, 4, 1, 8))  # v_head_dim defaults to head_dim, not the rope dim
    with pytest.raises(ValueError, match="needs position_embeddings"):
        build()(torch.randn(1, 2, 16), torch.arange(2))
    with pytest.raises(ValueError, match="IOKVCache is caller-owned and was not given its tensors"):
        build(kv_cache=IOKVCache(1, 8, v_head_dim=4), rope=RotaryEmbedding(torch.ones(2)))(torch.randn(1, 2, 16), torch.arange(2))
