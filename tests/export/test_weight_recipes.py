"""The weight recipes (`quantize_weights="4bit"` / `"8bit"`) and weights apart in `<stem>.ptd`, against an
upstream transformers model holding what the recipe stores, written out independently here.

Reference: the untouched HF model with (a) the linears of layer 0 on GGUF Q4_1 blocks made by the `gguf`
package (llama.cpp's reference), which the recipe must keep, and layer 1's random weights rounded by gguf's Q4_1
too (the recipe's min-max rounding, but for gguf's fp16 scale and minimum); (b) the tied embedding / output
weight rounded to int8 per row at its largest magnitude; (c) every linear's input rounded to int8 per token,
asymmetric (the activations of XNNPACK's dynamically quantized GEMMs). Code under test: `swap` + `export` + `Runner`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_models import SCORE_ATOL, hf_greedy, hf_log_probs, prompt_ids, tiny_model
from quant_refs import hf_prefix_logits, program_prefix_logits
from torch import nn

import etblocks
from etblocks.errors import ConfigError

gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) makes the reference blocks")

MAX_SEQ_LEN = 32
VOCAB = 2048  # the embedding outweighs the linears, so storing it twice would show in the file sizes
KEPT, MIN_MAX, OUTPUT, EMBEDDING = "int4 groups, kept", "int4 groups, min-max", "int8 rows (output layer)", "int8 rows (embedding)"
# Program vs reference: the recipe also rounds each group's centre (int8 per row) and each group's input sum (int8
# per token) and stores the int4 scales as bf16, and gguf rounds layer 1 from fp16 scales: measured <= 3.7% of the
# logits' largest on this model (each linear alone ~0.5%, test_int4); tokens equal on every prefix but at most one.
RECIPE_TOL = 0.05


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType.Q4_1
    values = weight.detach().numpy().astype(np.float32)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind).reshape(values.shape))


def int8_per_row(weight: torch.Tensor) -> torch.Tensor:
    scale = (weight.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)  # a padding row is all zeros
    return torch.round(weight / scale) * scale


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = (high - low) / 255
    zero = torch.round(-128 - low / scale)
    return (torch.clamp(torch.round(x / scale) + zero, -128, 127) - zero) * scale


@pytest.fixture(scope="module")
def base() -> nn.Module:
    """Tied, random norms (see test_weight_quant), layer 0's linears on gguf Q4_1 blocks."""
    model = tiny_model("llama", tie_word_embeddings=True, vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
        for module in model.model.layers[0].modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(q4_1(module.weight))
    return model


def reference(base: nn.Module, linears: str) -> nn.Module:
    """`base` holding what the recipe stores (`linears`: "q4_1" or "int8"), its linears fed int8 activations."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(int8_per_row(model.model.embed_tokens.weight))  # the lm_head's too
        for module in model.model.layers.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(q4_1(module.weight) if linears == "q4_1" else int8_per_row(module.weight))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(lambda m, args: (int8_per_token(args[0]),))
    return model.eval()


def layer_linears(model: nn.Module, layer: int) -> list[str]:
    return [f"model.layers.{layer}.{name}" for name, m in model.model.layers[layer].named_modules() if isinstance(m, nn.Linear)]


@pytest.fixture(scope="module")
def program_4bit(base, tmp_path_factory):
    model = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=MAX_SEQ_LEN)
    return etblocks.export(model, backend="xnnpack", out=tmp_path_factory.mktemp("p") / "m.pte", quantize_weights="4bit")


@pytest.mark.slow
def test_4bit_keeps_the_gguf_blocks_and_says_so(program_4bit, base):
    quantized = program_4bit.quantized
    assert {quantized[name] for name in layer_linears(base, 0)} == {KEPT}
    assert {quantized[name] for name in layer_linears(base, 1)} == {MIN_MAX}
    assert quantized["lm_head"] == OUTPUT and quantized["model.embed_tokens"] == EMBEDDING
    assert program_4bit.quantize == "4bit recipe (int4 groups of 32, int8 output layer), int8 embedding"


@pytest.mark.slow
def test_4bit_program_computes_the_reference(program_4bit, base):
    got = program_prefix_logits(etblocks.Runner(program_4bit.path))
    expected = hf_prefix_logits(reference(base, "q4_1"))
    errors = (got - expected).abs().amax(-1) / expected.abs().max()
    assert errors.max() <= RECIPE_TOL, errors
    assert (got.argmax(-1) == expected.argmax(-1)).sum() >= len(got) - 1
    # and it is not the float model: the reference's rounding is what the program holds
    float_logits = hf_prefix_logits(base)
    assert ((got - float_logits).abs().amax(-1) / float_logits.abs().max()).max() > errors.max()


@pytest.mark.slow
def test_4bit_linears_run_in_xnnpack_and_the_tied_rows_are_stored_once(program_4bit, base):
    delegation = program_4bit.delegation
    left = [op for op in delegation.cpu_ops if any(part in op for part in ("linear", "mm", "quantize", "choose_qparams", "torchao"))
            and "embedding" not in op]
    assert not left, delegation
    assert "quantized_decomposed.embedding_byte.dtype" in delegation.cpu_ops
    # weights apart by default for a tied model: the int8 rows once (V * D bytes), then everything else, smaller
    assert program_4bit.data_path is not None and program_4bit.data_path.is_file()
    rows = VOCAB * base.config.hidden_size
    linears = sum(m.weight.numel() for m in base.model.layers.modules() if isinstance(m, nn.Linear))
    assert rows < program_4bit.data_path.stat().st_size < rows + linears, (program_4bit.data_path.stat().st_size, rows)


@pytest.mark.slow
def test_tied_float_program_stores_the_checkpoint_once(base, tmp_path):
    """fp32: the `.ptd` holds the checkpoint's tensors once (<= 1.02x its safetensors), greedy tokens as upstream."""
    checkpoint = tmp_path / "checkpoint"
    base.save_pretrained(checkpoint)
    size = sum(file.stat().st_size for file in checkpoint.glob("*.safetensors"))
    model = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=MAX_SEQ_LEN)
    result = etblocks.export(model, backend="xnnpack", out=tmp_path / "f.pte")
    assert result.data_path is not None
    assert result.data_path.stat().st_size <= 1.02 * size, (result.data_path.stat().st_size, size)
    prompt = prompt_ids(8)
    runner = etblocks.Runner(result.path)
    assert runner.generate(prompt[0].tolist(), max_new_tokens=8) == hf_greedy(base, prompt, 8)
    ids = prompt_ids(20, seed=3)[0].tolist()  # no verify method: scored one token per call
    torch.testing.assert_close(runner.score(ids), hf_log_probs(base, ids), rtol=0, atol=SCORE_ATOL)


def test_8bit_computes_the_reference_and_keeps_int4_groups(base):
    """Eager (the modules the program is exported from): layer 0 kept as int4 groups, layer 1 int8 rows."""
    from etblocks.backends import get_backend
    from etblocks.export.weights import quantized_weights, weight_quantization

    plan = weight_quantization(get_backend("xnnpack"), "8bit", 32, None)
    model = copy.deepcopy(base)
    with quantized_weights(model, model, (prompt_ids(4),), plan) as record:
        got = hf_prefix_logits(model)
    assert {record[name] for name in layer_linears(base, 0)} == {KEPT}
    assert {record[name] for name in layer_linears(base, 1)} == {"int8 rows"}
    expected = reference(base, "int8")
    with torch.no_grad():  # layer 0 is on Q4_1 blocks already: the reference's rounding would change it, so undo
        for name in layer_linears(base, 0):
            expected.get_submodule(name).weight.copy_(base.get_submodule(name).weight)
    expected = hf_prefix_logits(expected)
    errors = (got - expected).abs().amax(-1) / expected.abs().max()
    assert errors.max() <= RECIPE_TOL, errors


@pytest.mark.parametrize(
    "options, swap_options, expected",
    [
        (dict(quantize_weights="4bit", group_size=48), {}, "group_size=48 is not accepted"),
        (dict(quantize_weights="4bit", backend="portable"), {}, "quantize_weights='4bit': backend='portable' has no kernels"),
        (dict(external_weights="yes"), {}, "external_weights='yes' is not accepted"),
        (dict(external_weights=True, backend="openvino"), dict(shapes="static", chunk=8), "external_weights=True: backend='openvino' keeps weights"),
        (dict(external_weights=True), dict(shapes="static", chunk=8), "external_weights=True takes dynamic programs"),
    ],
)
def test_bad_options_raise_before_any_work(base, tmp_path, options, swap_options, expected):
    model = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=MAX_SEQ_LEN, **swap_options)
    options = {"backend": "xnnpack", **options}
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace("[", r"\[")):
        etblocks.export(model, out=tmp_path / "x.pte", **options)
    assert not (tmp_path / "x.pte").exists()


def word_tokenizer():
    """Words `t0` .. `t{VOCAB - 1}`, one id each."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    raw = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    raw.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw)


@pytest.mark.slow
def test_check_accuracy_reports_and_refuses_a_broken_recipe(base, tmp_path, monkeypatch):
    """fp32: the program scores as its model (within float error); a recipe broken on purpose (every int8 row's
    scale doubled) is refused beyond the limit, and none of its files is left."""
    import importlib

    generator = torch.Generator().manual_seed(2)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (200,), generator=generator)))
    model = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=64)
    tokenizer = word_tokenizer()
    result = etblocks.export(model, backend="xnnpack", out=tmp_path / "ok.pte", tokenizer=tokenizer, check_accuracy=text,
                             max_perplexity_increase=1e-3)
    assert result.accuracy.tokens == 3 * 63 + 7  # windows of the context: 64, 64, 64 and 8 tokens
    assert abs(result.accuracy.increase) <= 1e-4 and result.accuracy.top1_agreement == 1.0
    assert result.accuracy.mean_kl <= 1e-6
    weights = importlib.import_module("etblocks.export.weights")
    rows = weights.int8_rows
    monkeypatch.setattr(weights, "int8_rows", lambda weight: (rows(weight)[0], 2 * rows(weight)[1]))
    with pytest.raises(ConfigError, match=r"max_perplexity_increase=0.05: the program's perplexity is \+"):
        etblocks.export(model, backend="xnnpack", out=tmp_path / "broken.pte", tokenizer=tokenizer, quantize_weights="8bit",
                        check_accuracy=text, max_perplexity_increase=0.05)
    assert not list(tmp_path.glob("broken*"))


@pytest.mark.slow
def test_the_program_records_its_quantization_and_eval_reports_it(program_4bit, base, tmp_path, capsys):
    """The record travels in the program (`Runner.quantization`); `etblocks eval` prints it and the perplexity of
    the text in windows, which is transformers' on the reference model within the recipe's tolerance."""
    from etblocks.cli import main

    runner = etblocks.Runner(program_4bit.path)
    assert runner.quantization == {"scheme": program_4bit.quantize, "modules": program_4bit.quantized}
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, VOCAB, (40,), generator=generator).tolist()
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in ids))
    word_tokenizer().save_pretrained(tmp_path / "tokenizer")
    assert main(["eval", "--pte", str(program_4bit.path), "--text", str(text), "--tokenizer", str(tmp_path / "tokenizer"),
                 "--window", "20"]) == 0
    out = capsys.readouterr().out
    assert f"weights: {program_4bit.quantize}; 7 int4 groups, kept, 7 int4 groups, min-max, 1 {OUTPUT}, 1 {EMBEDDING}" in out
    reported = float(out.split("perplexity ")[1].split()[0])
    model = reference(base, "q4_1")
    nll = -torch.cat([hf_log_probs(model, ids[:20]), hf_log_probs(model, ids[20:])]).double().mean()
    assert "over 38 tokens" in out and reported == pytest.approx(float(nll.exp()), rel=0.05)
