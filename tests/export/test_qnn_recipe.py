"""The qnn recipe without the Qualcomm SDK: SHA + 1x1-conv projections + IO caches, quantized with QnnQuantizer
(annotate, calibrate through prefill and decode, convert), checked op by op against ExecuTorch's QNN builders,
and run on the host as a quantized portable program against untouched transformers.

SHA's fp32 parity with HF is in test_static_programs.py (`test_static_eager_matches_hf[qnn-*]`).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import FEW_HEADS, hf_greedy, prompt_ids, family_variant, swapped_family, tiny_model

import etblocks
from etblocks.cli import main
from etblocks.errors import BackendUnavailableError
from etblocks.export import check_readiness
from etblocks.backends.qnn.readiness import format_readiness

# Measured with default (random-id) calibration on llama with 2 heads over 1 (FEW_HEADS): 16a8w teacher-forced
# top-1 agreement 0.906 for the base, 0.969 and 0.875 with adapters A and B.
MIN_TOP1_16A8W = 0.7


def swap_qnn(name: str, **config):
    """The family with `FEW_HEADS` (and `config`) and its qnn-swapped copy."""
    return swapped_family(name, "qnn", family_variant(name, **FEW_HEADS, **config), max_seq_len=64, chunk=8)


# The layers each readiness check needs. gpt_oss: per-head attention with sinks, on one sliding layer (its full
# layers add the sinks to a full cache's mask, the per-head layout Gemma 4's check has), and the dense MoE. Llama's
# check is the command line's (`test_cli_check_prints_the_report`); per-head sliding and full layers with q/k norms
# are Gemma 4's (tests/export/test_kv_shared_programs.py); every family's, all its layers: `benchmarks/backend_matrix.py`.
COVERED = {"gpt_oss": dict(num_hidden_layers=1, layer_types=["sliding_attention"])}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COVERED))
def test_quantized_qnn_program_is_fully_covered(name):
    _, swapped = swap_qnn(name, **COVERED[name])
    assert any(getattr(m, "sinks", None) is not None for m in swapped.modules())
    report = check_readiness(swapped, "qnn")  # 16a8w, the recipe's default
    text = format_readiness(report)
    print(text)
    assert set(report) == {"prefill", "decode"}
    for method, readiness in report.items():
        assert readiness.ready, f"{name} {method}:\n{text}"
        assert not readiness.uncovered and not readiness.dynamic and not readiness.bad_dtypes
        assert readiness.ops["aten.convolution.default"] > 0  # the per-head 1x1-conv projections reached QNN
        assert any("dequantize" in op for op in readiness.ops)


def test_lowering_needs_the_sdk(monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    _, swapped = swap_qnn("llama")
    with pytest.raises(BackendUnavailableError, match="QNN_SDK_ROOT"):
        etblocks.export(swapped, backend="qnn", out="unused.pte")


def teacher_forced_top1(runner: etblocks.Runner, original, prompts, new_tokens: int) -> float:
    """Fraction of steps where the program's argmax is HF's greedy token, feeding HF's tokens throughout."""
    agree = total = 0
    for prompt in prompts:
        expected = hf_greedy(original, prompt, new_tokens)
        runner.reset()
        logits = runner.forward(prompt[0].tolist())
        for token in expected:
            agree += int(torch.argmax(logits)) == token
            total += 1
            logits = runner.forward([token])
    return agree / total


@pytest.mark.slow
def test_quantized_program_with_adapters_runs_on_the_host(tmp_path):
    """`export(..., backend="portable", quantize_activations="16a8w")` runs the NPU's quantized graph here, its LoRA
    slots inputs too: calibrated with each adapter and with none, the base agrees with HF and each adapter with
    PeftModel (teacher-forced top-1)."""
    from peft_refs import ADAPTERS, make_adapters, peft_reference

    original, swapped = swap_qnn("llama")
    dirs = make_adapters(original, tmp_path)
    for name in ADAPTERS:
        etblocks.load_adapter(swapped, dirs[name], name=name)
    reference = peft_reference(original, dirs)
    result = etblocks.export(swapped, backend="portable", quantize_activations="16a8w", out=tmp_path / "q.pte")
    assert result.quantize == "16a8w"
    assert result.delegation.cpu_ops["quantized_decomposed.quantize_per_tensor"] > 0
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    assert runner.contract.mask_value == -255.0  # -inf has no quantized form
    prompts = [prompt_ids(13, seed=seed) for seed in range(4)]
    for name in (None, *ADAPTERS):
        runner.set_adapter(name)
        if name is not None:
            reference.set_adapter(name)
        agreement = teacher_forced_top1(runner, original if name is None else reference, prompts, 16)
        print(f"16a8w with adapter {name} vs {'HF' if name is None else 'PeftModel'}: teacher-forced top-1 "
              f"agreement {agreement:.3f}")
        assert agreement >= MIN_TOP1_16A8W, name


@pytest.mark.slow
def test_cli_check_prints_the_report(capsys, tmp_path):
    checkpoint = tmp_path / "llama"  # the demo model's shape would make the check 3x slower (hf_models.FEW_HEADS)
    tiny_model("llama", num_hidden_layers=1, **FEW_HEADS).save_pretrained(checkpoint)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,5,9,30,41,2,7\n\n3,4,5,6,7,8,9,10,11,12,13\n")
    args = ["--backend", "qnn", "--check", "--max-seq-len", "64", "--chunk", "8", "--calibration", str(prompts)]
    code = main(["export", "--model", str(checkpoint), *args])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "QNN HTP readiness" in out
    assert "on 2 calibration prompts" in err  # a progress line
    verdicts = [line.split()[-1] for line in out.splitlines() if line.split()[:1] in (["prefill"], ["decode"])]
    assert verdicts == ["ready", "ready"], out
    op_rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("aten.", "quantized"))}
    assert int(op_rows["aten.convolution.default"][0]) > 0  # the per-head 1x1-conv projections reached QNN
    assert any("dequantize" in op for op in op_rows)


def test_cli_check_needs_qnn(capsys):
    assert main(["export", "--model", "demo", "--backend", "xnnpack", "--check"]) == 2
    assert "check is the readiness report of a backend that offers one (['qnn']), not backend='xnnpack'" in capsys.readouterr().err


def test_cli_bad_calibration_file_names_the_line(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,2,3\n4,x,6\n")
    assert main(["export", "--model", "demo", "--backend", "qnn", "--check", "--calibration", str(prompts)]) == 2
    assert "line 2: '4,x,6' is not accepted" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_qnn_swap_exports_unquantized_to_host_backends(backend, tmp_path):
    """The SHA + conv graph the NPU gets, fp32 (quantize defaults to None off the recipe's backend), generates
    HF's greedy tokens on the host."""
    original, swapped = swap_qnn("qwen3")
    result = etblocks.export(swapped, backend=backend, out=tmp_path / "sha.pte")
    assert result.quantize is None
    runner = etblocks.Runner(result.path)
    for length in (13, 5):
        prompt = prompt_ids(length)
        runner.reset()
        assert runner.generate(prompt[0].tolist(), max_new_tokens=32) == hf_greedy(original, prompt, 32)
