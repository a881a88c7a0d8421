"""QNN without the Qualcomm SDK: readiness of static prefill/decode programs, and QnnQuantizer pt2e quantization.

The model is built here: embedding, one etblocks `Attention` over caller-owned caches (`IOKVCache` +
`StaticSDPA`), a SiLU-gated MLP, HF-style and torch RMSNorms, and an LM head. It is exported at two fixed
lengths, prefill (T=8) and decode (T=1), as a static NPU program would be.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from etblocks.attention import Attention, RotaryEmbedding, StaticSDPA, default_inv_freq
from etblocks.errors import ConfigError
from etblocks.backends.qnn.quantizer import PRECISIONS as QNN_PRECISIONS
from etblocks.backends.qnn.quantizer import qnn_quantizer
from etblocks.backends.qnn.readiness import format_readiness, qnn_readiness
from etblocks.export.quantize import quantize_programs, quantized_weight_constants, top1_agreement
from etblocks.state import IOKVCache

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 64, 32, 4, 2, 8, 64
CACHE, PREFILL = 16, 8  # cache slots S; prompt length T of the prefill method
MASKED = -255.0  # finite, as ExecuTorch's Qualcomm LLM examples use: -inf would break activation ranges


class HFRMSNorm(nn.Module):
    """RMSNorm as HF writes it (pow/mean/rsqrt): QNN recomposes it into one rms_norm op."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class TinyLM(nn.Module):
    """`(tokens [1,T], positions [T], mask [T,S+T], k_cache, v_cache [1,S,Hkv,D]) -> (logits, k_new, v_new)`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn_norm = HFRMSNorm(DIM)
        self.attn = Attention(
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            StaticSDPA(HEAD_DIM**-0.5),
            IOKVCache(KV_HEADS, HEAD_DIM),
            q_proj=nn.Linear(DIM, HEADS * HEAD_DIM, bias=False),
            k_proj=nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False),
            v_proj=nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False),
            o_proj=nn.Linear(HEADS * HEAD_DIM, DIM, bias=False),
            rope=RotaryEmbedding(default_inv_freq(HEAD_DIM, 10000.0)),
        )
        self.mlp_norm = nn.RMSNorm(DIM, eps=1e-6)
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = HFRMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        nn.init.normal_(self.lm_head.weight, std=1.0)  # peaked logits, so greedy tokens are not coin flips

    def forward(self, tokens, positions, mask, k_cache, v_cache):
        x = self.embed(tokens)
        h, k_new, v_new = self.attn(self.attn_norm(x), positions, kv=(k_cache, v_cache), mask=mask)
        x = x + h
        y = self.mlp_norm(x)
        x = x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))
        return self.lm_head(self.norm(x)), k_new, v_new


def step_inputs(tokens: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """Inputs for T tokens at positions `start..`: cache slots below `start` are filled, new keys causal."""
    t = tokens.shape[1]
    mask = torch.full((t, CACHE + t), MASKED)
    mask[:, :start] = 0.0
    mask[:, CACHE:] = torch.triu(torch.full((t, t), MASKED), diagonal=1)
    return tokens, torch.arange(start, start + t), mask, k_cache, v_cache


def empty_cache() -> torch.Tensor:
    return torch.zeros(1, CACHE, KV_HEADS, HEAD_DIM)


def generate(methods: dict, prompt: torch.Tensor, forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Prefill `prompt`, then decode to the end of the cache (greedy, or the `forced` tokens), writing each
    call's new keys/values into the caches as a runtime would. Returns all logits rows and the tokens fed."""
    k_cache, v_cache = empty_cache(), empty_cache()
    logits, k_new, v_new = methods["prefill"](*step_inputs(prompt, 0, k_cache, v_cache))
    rows, fed = [logits[0]], []
    for pos in range(PREFILL, CACHE):
        k_cache[:, pos - k_new.shape[1] : pos], v_cache[:, pos - v_new.shape[1] : pos] = k_new, v_new
        token = forced[len(fed)] if forced is not None else int(rows[-1][-1].argmax())
        fed.append(token)
        logits, k_new, v_new = methods["decode"](*step_inputs(torch.tensor([[token]]), pos, k_cache, v_cache))
        rows.append(logits[0])
    return torch.cat(rows), fed


def calibrate(methods: dict) -> None:
    """Two prompts, each a prefill and then decode steps, as quantize_programs' feeder would run them."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        generate(methods, torch.randint(0, VOCAB, (1, PREFILL), generator=generator))


@pytest.fixture(scope="module")
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().eval()


@pytest.fixture(scope="module")
def programs(model) -> dict[str, torch.export.ExportedProgram]:
    with torch.no_grad():
        return {
            name: torch.export.export(model, step_inputs(torch.zeros(1, t, dtype=torch.long), 0, empty_cache(), empty_cache()))
            for name, t in (("prefill", PREFILL), ("decode", 1))
        }


@pytest.fixture(scope="module", params=["16a8w", "16a4w"])
def quantized(request, programs) -> tuple[str, dict[str, torch.export.ExportedProgram]]:
    return request.param, quantize_programs(programs, qnn_quantizer(request.param), calibrate)


def test_static_block_is_ready(programs):
    report = qnn_readiness(programs)
    assert set(report) == {"prefill", "decode"}
    for readiness in report.values():
        assert readiness.ready, format_readiness(report)
        assert not readiness.uncovered and not readiness.dynamic and not readiness.bad_dtypes
        assert readiness.build_error is None  # QNN's preprocess passes and every op wrapper built
        # q, k, v, o, gate, up, down, lm_head (a rotate-half rope rotates with slices and a concat, no linear)
        assert readiness.ops["aten.linear.default"] == 8
        assert readiness.ops["aten.rms_norm.default"] == 3  # the HF-style norms were recomposed by QNN's pass
    table = format_readiness(report)
    assert "prefill" in table and "decode" in table and "NOT READY" not in table


class Gaps(nn.Module):
    """Two things QNN HTP cannot take: exact GELU written out with erf, as some models do (QNN has a gelu
    builder but none for erf), and a float64 computation."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return 0.5 * y * (1.0 + torch.erf(y * 2**-0.5)), y.double() * 2


def test_missing_op_float64_and_dynamic_shape_are_reported():
    x = torch.randn(1, 4, 8)
    report = qnn_readiness(
        {
            "static": torch.export.export(Gaps(), (x,)),
            "dynamic": torch.export.export(nn.Linear(8, 8), (x,), dynamic_shapes=({1: torch.export.Dim("T", max=64)},)),
        }
    )
    static = report["static"]
    assert static.uncovered == {"aten.erf.default": 1} and static.reasons["aten.erf.default"] == "no QNN builder"
    assert any("torch.float64" in entry for entry in static.bad_dtypes)
    assert not static.dynamic and not static.ready
    dynamic = report["dynamic"]
    assert not dynamic.uncovered and not dynamic.bad_dtypes
    assert re.fullmatch(r"input\w* \[1, s\d+, 8\]", dynamic.dynamic[0]) and not dynamic.ready  # the input comes first
    table = format_readiness(report)
    assert "uncovered aten.erf.default x1 (no QNN builder)" in table and "NOT READY" in table


def test_quantize_runs_and_stays_ready(quantized):
    precision, programs = quantized
    for name, program in programs.items():
        targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
        assert "quantized_decomposed.quantize_per_tensor.default" in targets, name
        assert "quantized_decomposed.dequantize_per_channel.default" in targets, name  # per-channel weights
    bits = {
        node.args[5]  # quant_max of the weight dequantizes: 4-bit weights for 16a4w
        for node in programs["decode"].graph.nodes
        if str(node.target) == "quantized_decomposed.dequantize_per_channel.default"
    }
    assert bits == ({7} if precision == "16a4w" else {127})
    # One method per precision keeps the test fast; both methods share one graph structure.
    method = "decode" if precision == "16a4w" else "prefill"
    report = qnn_readiness({method: programs[method]})
    assert report[method].ready, format_readiness(report)
    assert report[method].ops["quantized_decomposed.dequantize_per_channel.default"] > 0


def test_methods_share_encodings(quantized):
    _, programs = quantized
    prefill, decode = quantized_weight_constants(programs["prefill"]), quantized_weight_constants(programs["decode"])
    assert any(key.startswith("lm_head/") for key in prefill) and prefill.keys() == decode.keys()
    for layer, (ints, scale, zero_point) in prefill.items():  # one copy of each weight can serve both methods
        assert torch.equal(ints, decode[layer][0]), layer
        assert torch.equal(scale, decode[layer][1]) and torch.equal(zero_point, decode[layer][2]), layer

    def activation_encodings(program):
        return [
            (node.name, *node.args[1:])
            for node in program.graph.nodes
            if str(node.target) == "quantized_decomposed.quantize_per_tensor.default"
        ]

    # Prefill only ever sees an empty cache in calibration; shared ranges still give its cache inputs a real scale.
    assert activation_encodings(programs["prefill"]) == activation_encodings(programs["decode"])
    (k_cache_scale,) = [
        node.args[1]
        for node in programs["prefill"].graph.nodes
        if str(node.target) == "quantized_decomposed.quantize_per_tensor.default" and node.args[0].name == "k_cache"
    ]
    assert k_cache_scale > 1e-6


# Measured here (3 prompts, 8 prefill + 8 decode rows each, mean cosine per row): 16a8w cosine 0.9999,
# top-1 1.00; 16a4w cosine 0.995, top-1 0.875. Bounds leave margin for other torch/torchao versions.
BOUNDS = {"16a8w": (0.99, 0.9), "16a4w": (0.95, 0.75)}


def test_quantized_agrees_with_fp32(model, quantized):
    precision, programs = quantized
    runnable = {name: program.module() for name, program in programs.items()}
    fp32 = {"prefill": model, "decode": model}
    generator = torch.Generator().manual_seed(7)
    reference, other = [], []
    with torch.no_grad():
        for _ in range(3):
            prompt = torch.randint(0, VOCAB, (1, PREFILL), generator=generator)
            logits, tokens = generate(fp32, prompt)
            reference.append(logits)
            other.append(generate(runnable, prompt, forced=tokens)[0])
    reference, other = torch.cat(reference), torch.cat(other)
    cosine = nn.functional.cosine_similarity(reference, other, dim=-1).mean().item()
    top1 = top1_agreement(reference, other)
    print(f"{precision}: cosine {cosine:.4f}, top-1 agreement {top1:.3f} over {reference.shape[0]} rows")
    min_cosine, min_top1 = BOUNDS[precision]
    assert cosine > min_cosine and top1 >= min_top1


def test_bad_inputs_are_config_errors():
    with pytest.raises(ConfigError, match=r"precision='4a4w'.*\['16a8w', '16a4w', '8a8w'\]"):
        qnn_quantizer("4a4w")
    assert QNN_PRECISIONS == ("16a8w", "16a4w", "8a8w")
    with pytest.raises(ConfigError, match="equal shapes"):
        top1_agreement(torch.zeros(2, 4), torch.zeros(3, 4))
    assert top1_agreement(torch.eye(4), torch.eye(4).flip(0)) == 0.0

    x = torch.randn(1, 4, 8)
    static = torch.export.export(nn.Linear(8, 8), (x,))
    dynamic = torch.export.export(nn.Linear(8, 8), (x,), dynamic_shapes=({1: torch.export.Dim("T", max=64)},))
    quantizer = qnn_quantizer()
    with pytest.raises(ConfigError, match=r"method 'dynamic' has dynamic input shapes"):
        quantize_programs({"dynamic": dynamic}, quantizer, lambda methods: None)
    with pytest.raises(ConfigError, match=r"method 'b'.*saw no data"):
        quantize_programs({"a": static, "b": static}, quantizer, lambda methods: methods["a"](x))
    with pytest.raises(ConfigError, match=r"non-finite.*-255"):
        quantize_programs({"a": static}, quantizer, lambda methods: methods["a"](torch.full_like(x, float("-inf"))))


class MaskedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf"), 0.0, float("-inf")]))

    def forward(self, x):
        return self.proj(x) + self.mask


def test_quantize_leaves_the_callers_program_untouched():
    """QnnQuantizer clamps an -inf constant in place; the exported program handed in must keep it."""
    x = torch.randn(2, 4)
    program = torch.export.export(MaskedLinear(), (x,))
    quantized = quantize_programs({"forward": program}, qnn_quantizer(), lambda methods: methods["forward"](x))
    assert torch.isinf(program.state_dict["mask"]).sum() == 2
    assert not any(torch.isinf(t).any() for t in quantized["forward"].state_dict.values() if t.is_floating_point())


class RoutedBlock(nn.Module):
    """A 1x1-conv projection (as the qnn recipe's attention has) before a dense MoE behind one of etblocks' routers."""

    def __init__(self, router: str) -> None:
        super().__init__()
        from etblocks.attention import Conv2dLinear
        from etblocks.moe import DenseExperts, GroupedTopKRouter, MoE, TopKRouter

        experts, hidden = 8, 16
        self.proj = Conv2dLinear(DIM, DIM, bias=False)
        weight = nn.Parameter(torch.randn(experts, DIM))
        if router == "top-k":
            routing = TopKRouter(weight, 2, renormalize=True)
        else:  # sigmoid scores, a correction bias, 2 of 4 groups (GLM-4.5's, DeepSeek-V3's)
            routing = GroupedTopKRouter(weight, torch.randn(experts), 2, n_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5)
        self.moe = MoE(routing, DenseExperts.from_weights(
            torch.randn(experts, hidden, DIM), torch.randn(experts, hidden, DIM), torch.randn(experts, DIM, hidden)))

    def forward(self, x):
        return self.moe(self.proj(x))


@pytest.mark.parametrize("router", ["top-k", "grouped"])
def test_dense_moe_behind_each_router_is_ready_quantized(router):
    """Both routers' dense forms in a 16a8w program: every op has a QNN builder, no int64 anywhere. The grouped
    router once cast its fp32 weight to fp32, an exported copy that QNN's constant folding froze under a name
    its later passes mixed up with another constant: the convolution before it then had no builder."""
    torch.manual_seed(0)
    block = RoutedBlock(router).eval()
    with torch.no_grad():
        programs = {"forward": torch.export.export(block, (torch.randn(1, 4, DIM),))}

    def feed(methods):
        for seed in range(2):
            methods["forward"](torch.randn(1, 4, DIM, generator=torch.Generator().manual_seed(seed)))

    report = qnn_readiness(quantize_programs(programs, qnn_quantizer("16a8w"), feed))
    assert report["forward"].ready, format_readiness(report)
    assert report["forward"].ops["aten.convolution.default"] == 1
