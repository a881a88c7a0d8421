"""torchao weight quantization of XNNPACK programs (`etblocks.export(..., quantize_weights="8da4w" | "8da8w",
quantize_embedding="int8")`) against torchao's own eager quantization of the untouched transformers model.

Reference: the HF model quantized in place by torchao's `quantize_` with the configs written out below (the
scheme of ExecuTorch's LLM export: int8 per-token asymmetric activations, symmetric int4 weights per group or
int8 per channel, HQQ scales; 8da4w scales in bf16, the precision XNNPACK stores them in), and a PEFT model for
the LoRA program. Code under test: `swap` + `export` + `Runner`.

The model is a tiny llama with tied embeddings (the lm_head is quantized as a linear, which unties it) and random
RMSNorm weights: with unit norm weights an int8 embedding row makes a token's normed activations integer
multiples of one unit, which puts dynamic activation quantization on exact .5 ties that XNNPACK and torchao round
to different neighbours.
"""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from hf_models import hf_greedy, tiny_model
from peft_refs import ADAPTERS, make_adapter
from quant_refs import (
    ONE_ROUNDING_TOL,
    PROMPT,
    assert_matches_torchao,
    embedding_config,
    hf_prefix_logits,
    linear_config,
    program_prefix_logits,
    torchao_quantized,
)
from torch import nn

import etblocks
from etblocks.errors import ConfigError

MAX_SEQ_LEN = 32
NEW_TOKENS = 16
# name: (export options, swap options, whether a LoRA adapter is loaded). Each export costs about 25 s here.
PROGRAMS = {
    "8da4w-g32+emb": (dict(quantize_weights="8da4w", group_size=32, quantize_embedding="int8"), {}, False),
    "8da8w+lora": (dict(quantize_weights="8da8w"), {}, True),
    "emb": (dict(quantize_embedding="int8"), {}, False),
    "static-8da4w-g64": (dict(quantize_weights="8da4w", group_size=64), dict(shapes="static", chunk=8), False),
}
RECORDED = {
    "8da4w-g32+emb": "8da4w-g32, int8 embedding",
    "8da8w+lora": "8da8w",
    "emb": "int8 embedding",
    "static-8da4w-g64": "8da4w-g64",
}

Exported = namedtuple("Exported", "result model parameters_before")


def reference_for(name: str, base: nn.Module) -> nn.Module:
    options = PROGRAMS[name][0]
    linear = linear_config(options["quantize_weights"], options.get("group_size", 32)) if "quantize_weights" in options else None
    embedding = embedding_config() if "quantize_embedding" in options else None
    return torchao_quantized(base, linear, embedding)


@pytest.fixture(scope="module")
def base() -> nn.Module:
    model = tiny_model("llama", tie_word_embeddings=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.fixture(scope="module")
def adapter_dir(base, tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapter") / "A"
    make_adapter(base, directory, 0, **ADAPTERS["A"])
    return directory


@pytest.fixture(scope="module")
def programs(base, adapter_dir, tmp_path_factory):
    """`programs(name)`: the program of `PROGRAMS[name]`, exported once per module on first use."""
    out = tmp_path_factory.mktemp("programs")
    cache: dict[str, Exported] = {}

    def get(name: str) -> Exported:
        if name not in cache:
            options, swap_options, with_adapter = PROGRAMS[name]
            model = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=MAX_SEQ_LEN, **swap_options)
            if with_adapter:
                etblocks.load_adapter(model, adapter_dir, name="A")
            parameters = model.named_parameters(remove_duplicate=False)
            before = {param: (p, p.detach().clone()) for param, p in parameters}
            result = etblocks.export(model, backend="xnnpack", out=out / f"{name}.pte", **options)
            cache[name] = Exported(result, model, before)
        return cache[name]

    return get


# ----------------------------------------------------------------------------------------------- numerics


@pytest.mark.slow
@pytest.mark.parametrize("name", ["8da4w-g32+emb", "emb", "static-8da4w-g64"])
def test_program_matches_torchao_eager(programs, base, name):
    exported = programs(name)
    assert exported.result.quantize == RECORDED[name]
    got = program_prefix_logits(etblocks.Runner(exported.result.path))
    assert_matches_torchao(got, hf_prefix_logits(reference_for(name, base)))


@pytest.fixture(scope="module")
def peft_8da8w(base, adapter_dir):
    """PEFT with adapter "A" over the base whose linears (not the adapter's) torchao quantized to 8da8w."""
    from peft import PeftModel

    reference = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir, adapter_name="A")
    reference = torchao_quantized(reference, linear_config("8da8w"))
    assert type(reference.base_model.model.model.layers[0].self_attn.q_proj.lora_A["A"].weight) is nn.Parameter
    return reference


@pytest.mark.slow
def test_lora_slots_stay_float_over_quantized_base(programs, peft_8da8w):
    """The base linears are 8da8w; the adapter's path is float, switched at run time: the program equals PEFT
    over the torchao-quantized base with the adapter off and on."""
    exported = programs("8da8w+lora")
    assert exported.result.quantize == RECORDED["8da8w+lora"]
    runner = etblocks.Runner(exported.result.path, adapters=exported.result.adapters)
    with peft_8da8w.disable_adapter():
        off = hf_prefix_logits(peft_8da8w)
    runner.set_adapter(None)
    assert_matches_torchao(program_prefix_logits(runner), off)
    peft_8da8w.set_adapter("A")
    on = hf_prefix_logits(peft_8da8w)
    assert (on - off).abs().max() > 0.1 * off.abs().max()  # the adapter matters
    runner.set_adapter("A")
    assert_matches_torchao(program_prefix_logits(runner), on)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, max_error, min_top1",
    [
        # int8 weights per channel lose little (measured: 0.06 of the scale, top-1 1.0)
        ("8da8w+lora", 0.1, 0.9),
        # int4 weights on random Gaussian weights of a 2-layer model with a large init (chosen for varied greedy
        # tokens) lose much, in torchao as here (measured: 0.6 of the scale, top-1 0.4)
        ("8da4w-g32+emb", 1.0, 0.25),
    ],
)
def test_program_loses_what_torchao_loses_against_fp32(programs, base, name, max_error, min_top1):
    fp32 = hf_prefix_logits(base)
    scale = fp32.abs().max()
    got = program_prefix_logits(etblocks.Runner(programs(name).result.path))  # LoRA programs start as the base
    torchao = hf_prefix_logits(reference_for(name, base))
    error, torchao_error = ((got - fp32).abs().max() / scale).item(), ((torchao - fp32).abs().max() / scale).item()
    top1, torchao_top1 = [(logits.argmax(-1) == fp32.argmax(-1)).float().mean().item() for logits in (got, torchao)]
    assert error <= max_error and top1 >= min_top1, (error, top1)
    assert abs(error - torchao_error) <= ONE_ROUNDING_TOL and abs(top1 - torchao_top1) <= 1 / len(fp32), (
        error, torchao_error, top1, torchao_top1,
    )


@pytest.mark.slow
def test_8da8w_greedy_tokens_match_torchao_generate(programs, peft_8da8w):
    """Token for token, without the adapter and with it (PEFT's `generate` over the torchao-quantized base)."""
    exported = programs("8da8w+lora")
    runner = etblocks.Runner(exported.result.path, adapters=exported.result.adapters)
    for adapter in (None, "A"):
        if adapter is None:
            with peft_8da8w.disable_adapter():
                expected = hf_greedy(peft_8da8w, PROMPT, NEW_TOKENS)
        else:
            peft_8da8w.set_adapter(adapter)
            expected = hf_greedy(peft_8da8w, PROMPT, NEW_TOKENS)
        assert len(set(expected)) > 3, f"degenerate reference: {expected}"
        runner.set_adapter(adapter)
        runner.reset()
        assert runner.generate(PROMPT[0].tolist(), max_new_tokens=NEW_TOKENS) == expected, adapter


# ----------------------------------------------------------------------------------------------- program


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_every_quantized_linear_runs_in_xnnpack(programs, name):
    """No linear, matmul or (de)quantize left on CPU; the quantized embedding is `embedding_byte` on CPU."""
    delegation = programs(name).result.delegation
    assert delegation.ops_per_delegate.get("XnnpackBackend", 0) > 0
    quantized_ops = ("linear", "mm", "quantize", "choose_qparams", "torchao")
    left = [op for op in delegation.cpu_ops if "embedding" not in op and any(part in op for part in quantized_ops)]
    assert not left, delegation
    embeddings = {op for op in delegation.cpu_ops if "embedding" in op}
    quantized_embedding = "quantize_embedding" in PROGRAMS[name][0]
    assert embeddings == ({"quantized_decomposed.embedding_byte.dtype"} if quantized_embedding else {"aten.embedding"})


def stored_bytes(result) -> int:
    """The program's file and its weights' (a tied model's go to `<stem>.ptd` by default)."""
    return result.path.stat().st_size + (result.data_path.stat().st_size if result.data_path else 0)


@pytest.mark.slow
def test_pte_shrinks_as_computed(programs, base):
    """Float linears vs 8da4w-g32 linears, both programs with the int8 embedding, from the model's shapes.

    XNNPACK stores fp32 weights as they are and int4 weights two per byte with a bf16 scale per group of 32. Each
    constant may be padded by up to 64 bytes, and a dynamically quantized linear also costs XNNPACK graph entries
    (the activation's convert node, its quantized values and their parameters; measured 400 bytes) that a float
    one does not. Each weight is stored once: a float copy of the tied lm_head left behind would cost 4 * V * D.
    """
    linears = [m for m in base.modules() if isinstance(m, nn.Linear)]  # the lm_head included
    n = sum(m.in_features * m.out_features for m in linears)
    expected = 4 * n - (n // 2 + 2 * n // 32)
    padding, quantized_entries = 64 * 2 * len(linears), 512 * len(linears)
    saved = stored_bytes(programs("emb").result) - stored_bytes(programs("8da4w-g32+emb").result)
    assert expected - quantized_entries - padding <= saved <= expected + padding, (saved, expected)


@pytest.mark.slow
def test_export_leaves_the_model_float(programs, base):
    """The same parameter objects with the same values, the tie intact, no quantized module left, and the same
    eager logits as a fresh swap of the base model."""
    from etblocks.export.weights import QuantizedEmbedding

    exported = programs("8da4w-g32+emb")
    model = exported.model
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == exported.parameters_before.keys()
    for name, (parameter, values) in exported.parameters_before.items():
        assert after[name] is parameter and type(parameter) is nn.Parameter, name
        assert torch.equal(parameter, values), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(isinstance(m, QuantizedEmbedding) for m in model.modules())
    assert all("extra_repr" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, _swapped(base)(PROMPT).logits)


# ----------------------------------------------------------------------------------------------- errors


def _swapped(base) -> nn.Module:
    return etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=MAX_SEQ_LEN)


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(backend="portable", quantize_weights="8da4w"), "quantize_weights='8da4w': backend='portable' has no kernels for it; backends that run it: ['xnnpack']"),
        (dict(backend="portable", quantize_embedding="int8"), "quantize_embedding='int8': backend='portable' has no kernels for it"),
        (dict(backend="openvino", quantize_weights="8da8w"), "quantize_weights='8da8w': backend='openvino' has no kernels for it"),
        (dict(quantize_weights="int4"), "quantize_weights='int4' (str) is not accepted; choose one of ['4bit', '8bit', '8da4w', '8da8w', 'none']"),
        (dict(quantize_embedding="int4"), "quantize_embedding='int4' (str) is not accepted; choose one of ['int8', 'none']"),
        (dict(quantize_weights="8da4w", group_size=48), "group_size=48 is not accepted; give a positive multiple of 32"),
        (dict(quantize_activations="16a8w", quantize_embedding="int8"), "quantize_activations='16a8w' applies to static programs"),
        (
            dict(quantize_weights="8da4w", group_size=96),
            "group_size=96 does not divide model.layers.0.self_attn.q_proj's in_features=64; group sizes that divide "
            "every quantized linear's in_features ([64, 128]) and XNNPACK takes: [32, 64]",
        ),
    ],
)
def test_bad_options_raise_before_any_work(base, tmp_path, options, expected):
    model = _swapped(base)
    parameters = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    modules = {name: type(m) for name, m in model.named_modules()}
    steps = []
    options = {"backend": "xnnpack", **options}
    with pytest.raises(ConfigError) as info:
        etblocks.export(model, out=tmp_path / "x.pte", progress=steps.append, **options)
    assert expected in str(info.value)
    assert not (tmp_path / "x.pte").exists()
    assert not any("lowering" in step or "quantized the weights" in step for step in steps), steps
    assert {name: type(m) for name, m in model.named_modules()} == modules
    assert all(p is parameters[name][0] and torch.equal(p, parameters[name][1]) for name, p in model.named_parameters())


@pytest.mark.slow
def test_runner_in_a_fresh_process_runs_the_int8_embedding(programs):
    """The runtime gets the `embedding_byte` kernel from `Runner` itself, not from an export done earlier."""
    import subprocess
    import sys

    path = programs("emb").result.path
    prompt = PROMPT[0].tolist()
    code = f"import etblocks; print(etblocks.Runner({str(path)!r}).generate({prompt}, max_new_tokens=8))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = etblocks.Runner(path).generate(prompt, max_new_tokens=8)
    assert proc.stdout.strip().splitlines()[-1] == str(expected)


class _ReadsAWeight(nn.Module):
    """Calls `proj` and reads `absorbed.weight` itself (as MLA's absorbed `kv_b_proj`): only `proj` is quantized."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)
        self.absorbed = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ self.absorbed.weight.view(4, 16, 64).sum(0).T


def test_only_called_linears_are_quantized_and_restored():
    from etblocks.export.weights import WeightQuantization, quantized_weights

    model = _ReadsAWeight().eval()
    weights = {name: p for name, p in model.named_parameters()}
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        before = model(x)
    with quantized_weights(model, model, (x,), WeightQuantization("8da8w")) as names:
        assert names == {"proj": "8da8w"}
        assert type(model.proj.weight) is not nn.Parameter and type(model.absorbed.weight) is nn.Parameter
        with torch.no_grad():
            assert not torch.equal(model(x), before)
    assert all(p is weights[name] for name, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_a_scheme_with_nothing_to_quantize_is_refused():
    from etblocks.export.weights import WeightQuantization, quantized_weights

    model = _ReadsAWeight().eval()
    with pytest.raises(ConfigError, match=r"quantize_embedding='int8' quantizes nn.Embedding modules; the program calls none"):
        with quantized_weights(model, model, (torch.randn(1, 3, 64),), WeightQuantization(embedding="int8")):
            pass
