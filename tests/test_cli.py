"""The `etblocks` command end to end: export the demo model, run it against HF `generate`, errors, backends."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from etblocks.cli import main
from etblocks.demo import demo_model
from etblocks.backends.probe import format_table, probe_backend

MAX_SEQ_LEN = 32
PROMPT = [1, 5, 9, 30, 7]


def etblocks_command() -> list[str]:
    exe = shutil.which("etblocks") or str(Path(sys.executable).with_name("etblocks"))
    assert Path(exe).is_file(), "the `etblocks` console script is not installed (pip install -e .)"
    return [exe]


def run_cli(args: list[str], cwd: Path, module: bool = False, timeout: int = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "etblocks"] if module else etblocks_command()
    return subprocess.run(command + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
        )
    return out[0, len(prompt):].tolist()


def error_line(stderr: str) -> str:
    """The CLI's one-line `error: ...` (the runtime's C++ logs may precede it on stderr)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def ids_line(stdout: str, label: str) -> list[int]:
    match = re.search(rf"^{label}: ([\d,]+)$", stdout, re.MULTILINE)
    assert match, f"no '{label}:' line in:\n{stdout}"
    return [int(t) for t in match.group(1).split(",")]


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory):
    """`etblocks export --model demo` once per module, in a subprocess. The config file's backend, out and
    max_seq_len are overridden by the flags."""
    work = tmp_path_factory.mktemp("export")
    (work / "export.yaml").write_text("backend: portable\nout: ignored.pte\nmax_seq_len: 64\nverify: true\n")
    proc = run_cli(
        ["export", "--config", "export.yaml", "--model", "demo", "--backend", "xnnpack", "--out", "out/demo.pte",
         "--max-seq-len", str(MAX_SEQ_LEN)],
        cwd=work,
    )
    return work, work / "out" / "demo.pte", proc


@pytest.fixture(scope="module")
def demo_hf():
    return demo_model(seed=0)


# ------------------------------------------------------------------------------------------ demo model


def test_demo_model_is_tiny_seeded_llama(demo_hf):
    from transformers import LlamaForCausalLM

    config = demo_hf.config
    assert isinstance(demo_hf, LlamaForCausalLM)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (2, 64, 4, 2)
    assert (config.vocab_size, config.max_position_embeddings) == (256, 512)
    again, other = demo_model(seed=0), demo_model(seed=1)
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again.state_dict()[weight], demo_hf.state_dict()[weight])
    assert not torch.equal(other.state_dict()[weight], demo_hf.state_dict()[weight])
    torch.manual_seed(123)  # building the demo does not disturb the caller's random stream
    first = torch.rand(1)
    torch.manual_seed(123)
    demo_model(seed=5)
    assert torch.equal(torch.rand(1), first)


# ------------------------------------------------------------------------------------------ export + run


@pytest.mark.slow
def test_export_demo_end_to_end(demo_export):
    work, pte, proc = demo_export
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert pte.is_file() and pte.stat().st_size > 100_000
    assert not (work / "ignored.pte").exists()  # --out overrode the config's out
    out = proc.stdout
    assert "random weights" in out.lower() and "demonstration" in out.lower()
    for step in ("loading", "swapping attention for xnnpack and verifying", "exporting", "lowering to xnnpack", "serializing"):
        assert re.search(rf"^\[ *\d+\.\ds\] {step}", proc.stderr, re.MULTILINE), f"no progress line for {step!r}:\n{proc.stderr}"
    assert f"exported out{os.sep}demo.pte" in out
    assert re.search(r"size\s+\d+\.\d+ MB", out)
    assert re.search(r"delegation\s+\d+ partitions \(XnnpackBackend: \d+ ops\)", out)
    assert f"get_max_seq_len={MAX_SEQ_LEN}," in out  # --max-seq-len overrode the config's 64
    assert "get_vocab_size=256" in out and "get_eos_ids=[2]" in out
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_run_prompt_ids_matches_hf_generate(demo_export, demo_hf):
    work, pte, export_proc = demo_export
    assert export_proc.returncode == 0, export_proc.stderr[-3000:]
    proc = run_cli(["run", "--pte", str(pte), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12"], cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    generated = ids_line(proc.stdout, "generated ids")
    expected = hf_greedy(demo_hf, PROMPT, 12)
    assert len(set(expected)) > 3, "the demo model should give varied greedy tokens"
    assert generated == expected
    assert ids_line(proc.stdout, "prompt ids") == PROMPT


# etblocks' own lines on stderr: progress, the one-line error, the summary after a streamed text reply.
OWN_STDERR_LINE = re.compile(r"\[ *\d+\.\ds\] |error: |\d+ tokens in \d+\.\d+ s ")


def dependency_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not OWN_STDERR_LINE.match(line)]


@pytest.mark.slow
def test_export_and_run_show_no_dependency_lines_unless_verbose(demo_export):
    """torchao's, torch's and ExecuTorch's lines (Python warnings, log records, the runtime's C++ logs) stay out of
    stderr; -v brings them back."""
    work, pte, export_proc = demo_export
    assert export_proc.returncode == 0, export_proc.stderr[-3000:]
    assert dependency_lines(export_proc.stderr) == []
    run = ["run", "--pte", str(pte), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    quiet, verbose = run_cli(run, cwd=work), run_cli([*run, "-v"], cwd=work)
    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert dependency_lines(quiet.stderr) == []
    assert dependency_lines(verbose.stderr), verbose.stderr  # here: ExecuTorch's "[cpuinfo_utils.cpp:NN] ..." lines
    assert ids_line(quiet.stdout, "generated ids") == ids_line(verbose.stdout, "generated ids")


def test_help_and_an_unknown_backend_answer_without_importing_torch(tmp_path):
    """Both come from the option declarations and the backend registry alone: torch, executorch and
    transformers (seconds of imports) stay unloaded, so the answer takes well under 2 s (asserted loosely)."""
    for args, code in ((["--help"], 0), (["export", "--model", "demo", "--backend", "nope"], 2)):
        start = time.perf_counter()
        proc = run_cli(args, cwd=tmp_path)
        assert proc.returncode == code, proc.stderr
        assert time.perf_counter() - start < 4, args
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom etblocks.cli import build_parser, main\nbuild_parser()\n"
         "assert main(['export', '--model', 'demo', '--backend', 'nope']) == 2\n"
         "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'executorch', 'transformers')))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert loaded == "[]"


@pytest.mark.slow
def test_run_asks_for_one_mkl_thread_before_torch_loads(demo_export):
    """`etblocks run` sets MKL_NUM_THREADS=1 before anything loads torch (ExecuTorch's attention kernel calls MKL from
    inside its own thread pool), keeps a value the user set, and cannot once torch is loaded (MKL has read it)."""
    from etblocks.threads import prefer_single_threaded_blas

    _, pte, _ = demo_export
    script = ("import os\nfrom etblocks.cli import main\n"
              f"assert main(['run', '--pte', {str(pte)!r}, '--prompt-ids', '1,2', '--max-new-tokens', '2']) == 0\n"
              "print('MKL_NUM_THREADS', os.environ.get('MKL_NUM_THREADS'))")
    for preset, expected in ((None, "1"), ("2", "2")):
        env = {k: v for k, v in os.environ.items() if k != "MKL_NUM_THREADS"}
        if preset is not None:
            env["MKL_NUM_THREADS"] = preset
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
        assert f"MKL_NUM_THREADS {expected}" in done.stdout, done.stdout
    environ: dict[str, str] = {}
    assert not prefer_single_threaded_blas(environ, {"torch": object()}) and environ == {}


@pytest.mark.slow
def test_run_text_prompt_with_tokenizer(demo_export, demo_hf, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    _, pte, _ = demo_export
    code = main(["run", "--pte", str(pte), "--prompt", "t1 t5 t9 t30", "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert code == 0
    expected = hf_greedy(demo_hf, [1, 5, 9, 30], 6)  # a tokenizer.json without a post-processor: no BOS
    assert out.splitlines()[-1] == " ".join(f"t{i}" for i in expected)  # the text, streamed


@pytest.mark.slow
def test_run_from_config_uses_export_out_and_flags_override(demo_export, demo_hf, tmp_path, capsys):
    _, pte, _ = demo_export
    config = tmp_path / "run.yaml"
    config.write_text(f"out: {pte}\nprompt_ids: [{', '.join(map(str, PROMPT))}]\nmax_new_tokens: 10\n")
    assert main(["run", "--config", str(config), "--max-new-tokens", "3"]) == 0
    assert ids_line(capsys.readouterr().out, "generated ids") == hf_greedy(demo_hf, PROMPT, 3)


@pytest.mark.slow
def test_run_sampling_is_reproducible_with_seed(demo_export, capsys):
    """One seed gives the same tokens twice; and sampling is on: the sampled tokens are not the greedy ones, and other
    seeds give other tokens (both would fail if `--temperature` / `--top-p` were ignored)."""
    _, pte, _ = demo_export
    greedy = ["run", "--pte", str(pte), "--prompt-ids", "1,2,3", "--max-new-tokens", "8"]

    def generated(*extra: str) -> list[int]:
        assert main([*greedy, *extra]) == 0
        return ids_line(capsys.readouterr().out, "generated ids")

    sampling = ("--temperature", "1.5", "--top-p", "0.95")
    first = generated(*sampling, "--seed", "7")
    assert generated(*sampling, "--seed", "7") == first
    assert first != generated()
    others = [generated(*sampling, "--seed", str(seed)) for seed in (8, 9)]
    assert any(tokens != first for tokens in others)


@pytest.mark.slow
def test_export_with_speculation_and_run_with_it(demo_hf, tmp_path, capsys):
    """`--max-draft` gives the program a verify method and `--draft-model` puts a one-layer checkpoint into the .pte
    as the draft (without `--max-draft` the export stops before loading anything). `run --speculate prompt_lookup`
    (flag or YAML key) and `run --speculate draft` print HF generate's greedy tokens and how many proposals the
    program kept."""
    from transformers import LlamaForCausalLM

    from etblocks.demo import demo_config

    config = demo_config()
    config.num_hidden_layers = 1
    draft_dir = tmp_path / "draft"
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(draft_dir)
    pte = tmp_path / "both.pte"
    assert main(["export", "--model", "demo", "--out", str(pte), "--max-seq-len", "64", "--draft-model", str(draft_dir)]) == 2
    assert "draft_model is set without max_draft" in error_line(capsys.readouterr().err)
    assert main(["export", "--model", "demo", "--out", str(pte), "--max-seq-len", "64", "--max-draft", "3",
                 "--draft-model", str(draft_dir)]) == 0
    out = capsys.readouterr().out
    assert "verify" in out and "draft_forward" in out
    kept = r"speculation: \d+ of [1-9]\d* proposed tokens kept \(\d+%\), \d+\.\d\d tokens per call"
    prompt = [5, 9, 30, 7, 11, 5, 9, 30, 7, 11, 5, 9]
    (tmp_path / "run.yaml").write_text(f"pte: {pte}\nspeculate: prompt_lookup\nmax_draft: 3\nmax_new_tokens: 24\n")
    for args in (["--pte", str(pte), "--speculate", "prompt_lookup", "--max-draft", "3", "--max-new-tokens", "24"],
                 ["--config", str(tmp_path / "run.yaml")]):
        assert main(["run", "--prompt-ids", ",".join(map(str, prompt)), *args]) == 0
        out = capsys.readouterr().out
        assert ids_line(out, "generated ids") == hf_greedy(demo_hf, prompt, 24)
        assert re.search(kept, out), out
    prompt = [5, 9, 30, 7, 11, 2, 40]
    assert main(["run", "--pte", str(pte), "--prompt-ids", ",".join(map(str, prompt)), "--speculate", "draft",
                 "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert ids_line(out, "generated ids") == hf_greedy(demo_hf, prompt, 24)
    assert re.search(kept, out), out


@pytest.mark.slow
def test_run_overflowing_the_context_exits_2(demo_export, capsys):
    _, pte, _ = demo_export
    code = main(["run", "--pte", str(pte), "--prompt-ids", "1,2,3", "--max-new-tokens", str(MAX_SEQ_LEN)])
    err = error_line(capsys.readouterr().err)
    assert code == 2
    assert f"context is {MAX_SEQ_LEN}" in err


@pytest.mark.slow
def test_export_local_checkpoint_dir_matches_hf(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from etblocks.export import Runner

    checkpoint = tmp_path / "tiny-llama"
    demo_model(seed=1).save_pretrained(checkpoint)
    assert (checkpoint / "config.json").is_file() and list(checkpoint.glob("*.safetensors"))
    out = tmp_path / "tiny.pte"
    code = main(["export", "--model", str(checkpoint), "--backend", "portable", "--out", str(out),
                 "--max-seq-len", str(MAX_SEQ_LEN), "--sdpa", "dynamic"])
    captured = capsys.readouterr()
    assert code == 0
    assert out.is_file()
    assert f"loading {checkpoint}" in captured.err and "random weights" not in (captured.out + captured.err).lower()
    assert "swapping attention for portable" in captured.err and "sdpa=dynamic" in captured.err

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    expected = hf_greedy(reference, PROMPT, 8)
    assert Runner(out).generate(PROMPT, max_new_tokens=8) == expected
    assert expected != hf_greedy(demo_model(seed=0), PROMPT, 8)  # the checkpoint, not the demo, was exported


# ------------------------------------------------------------------------------------------ errors


def test_malformed_yaml_exits_2_with_message(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: demo\nbackend: [xnnpack\n")
    proc = run_cli(["export", "--config", "bad.yaml"], cwd=tmp_path, module=True)  # also covers python -m etblocks
    assert proc.returncode == 2
    assert error_line(proc.stderr).startswith("error: config file 'bad.yaml' is not valid YAML, line 3")
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("*.pte"))


def test_unknown_key_in_config_exits_2(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("model: demo\nmax_len: 32\n")
    assert main(["export", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "line 2: unknown key 'max_len'" in err and "max_seq_len" in err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml' does not exist" in capsys.readouterr().err


def test_unknown_backend_exits_2_listing_accepted(tmp_path, capsys):
    code = main(["export", "--model", "demo", "--backend", "tpu", "--out", str(tmp_path / "x.pte")])
    captured = capsys.readouterr()
    assert code == 2
    assert error_line(captured.err).startswith("error: --backend: backend='tpu' is unknown; accepted: ")
    assert "'xnnpack'" in captured.err and "'portable'" in captured.err
    assert "loading" not in captured.err  # rejected before any model is loaded
    assert not (tmp_path / "x.pte").exists()


def test_unknown_backend_from_config_names_the_line(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("model: demo\nbackend: npu\n")
    assert main(["export", "--config", str(tmp_path / "c.yaml")]) == 2
    assert "c.yaml', line 2: backend='npu' is unknown; accepted" in capsys.readouterr().err


def test_bad_sdpa_exits_2(capsys):
    assert main(["export", "--model", "demo", "--sdpa", "flash"]) == 2
    assert "sdpa='flash'" in capsys.readouterr().err


@pytest.mark.slow
def test_export_moe_checkpoint_with_the_dense_strategy(tmp_path, capsys):
    from hf_models import FAMILIES, tiny_model
    from transformers import AutoModelForCausalLM

    from etblocks.export import Runner

    checkpoint = tmp_path / "tiny-mixtral"
    tiny_model(*FAMILIES["mixtral"][:1], **FAMILIES["mixtral"][1]).save_pretrained(checkpoint)
    out = tmp_path / "mixtral.pte"
    code = main(["export", "--model", str(checkpoint), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN), "--moe", "dense"])
    assert code == 0
    assert "2 MoE blocks (moe=dense)" in capsys.readouterr().err
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    assert Runner(out).generate(PROMPT, max_new_tokens=8) == hf_greedy(reference, PROMPT, 8)


def test_bad_moe_strategy_exits_2(capsys):
    assert main(["export", "--model", "demo", "--moe", "sparse"]) == 2
    err = capsys.readouterr().err
    assert "moe='sparse'" in err and "['dense', 'gather']" in err


def test_model_not_set_exits_2(capsys):
    assert main(["export"]) == 2
    assert "model is not set" in capsys.readouterr().err


def test_missing_model_dir_exits_2(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["export", "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err and "config.json" in err and "*.safetensors" in err


def test_model_dir_without_weights_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["export", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "has no *.safetensors" in err and "config.json" in err


def test_model_dir_with_invalid_files_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    assert main(["export", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"model='{tmp_path}' could not be loaded with AutoModelForCausalLM.from_pretrained" in err


def test_run_errors_exit_2(tmp_path, capsys):
    bogus = tmp_path / "bogus.pte"
    bogus.write_bytes(b"not a program at all")
    cases = [
        (["run", "--prompt-ids", "1"], "pte is not set"),
        (["run", "--pte", str(tmp_path / "none.pte"), "--prompt-ids", "1"], "none.pte does not exist; expected an ExecuTorch program"),
        (["run", "--pte", str(bogus), "--prompt-ids", "1"], "bogus.pte holds 20 bytes, fewer than the 64 of an ExecuTorch file's head"),
        (["run", "--pte", str(bogus)], "no prompt"),
        (["run", "--pte", str(bogus), "--prompt-ids", "1,-2"], "--prompt-ids: prompt_ids='1,-2'"),
    ]
    for args, expected in cases:
        assert main(args) == 2, args
        err = error_line(capsys.readouterr().err)
        assert expected in err, (args, err)


def test_prompt_and_prompt_ids_are_exclusive(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("prompt: hello\n")
    assert main(["run", "--config", str(config), "--pte", "x.pte", "--prompt-ids", "1"]) == 2
    assert "both prompt_ids (--prompt-ids) and prompt" in capsys.readouterr().err
    assert main(["run", "--pte", "x.pte", "--prompt", "a", "--prompt-ids", "1"]) == 2  # both as flags
    assert "both prompt_ids (--prompt-ids) and prompt (--prompt) are set; give one" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ backends


def test_probe_qnn_without_sdk(monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    report = probe_backend("qnn")
    assert report.lowers.ok is False and report.lowers.note.startswith("needs QNN_SDK_ROOT")
    assert report.runs.ok is None
    assert "needs QNN_SDK_ROOT" in format_table([report])


def test_backends_unknown_name_exits_2(capsys):
    assert main(["backends", "tpu"]) == 2
    assert "backend='tpu' is unknown; accepted:" in capsys.readouterr().err


@pytest.mark.slow
def test_backends_table(monkeypatch, capsys):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line and not line.startswith("[")}
    assert rows["backend"][:2] == ["backend", "installed"]
    for name in ("xnnpack", "portable"):
        assert rows[name][1:4] == ["yes", "yes", "yes"], out  # installed, lowers here, runs here
    assert "max abs err vs eager" in " ".join(rows["xnnpack"])
    assert set(rows) >= {"openvino", "coreml", "vulkan", "qnn"}
    assert rows["qnn"][2] == "no" and "needs QNN_SDK_ROOT" in " ".join(rows["qnn"])


# ------------------------------------------------------------------------------------------ adapters


@pytest.mark.slow
def test_export_and_run_with_adapters_matches_peft(demo_hf, tmp_path, capsys):
    """`export --adapter NAME=DIR` twice ships two .ptd files next to the .pte; `run --adapter NAME` generates
    PeftModel's tokens with that adapter, and `--adapter-scale 0` the base model's."""
    from peft_refs import ADAPTERS, make_adapters, peft_reference

    dirs = make_adapters(demo_hf, tmp_path)
    pte = tmp_path / "demo.pte"
    args = ["export", "--model", "demo", "--out", str(pte), "--max-seq-len", str(MAX_SEQ_LEN)]
    assert main(args + [f"--adapter={name}={path}" for name, path in dirs.items()]) == 0
    out = capsys.readouterr().out
    for name in ADAPTERS:
        assert (tmp_path / f"demo.{name}.ptd").is_file()
        assert re.search(rf"adapter\s+{name}: .*demo\.{name}\.ptd \(0\.\d+ MB\)", out), out
    reference = peft_reference(demo_hf, dirs)
    for name in ADAPTERS:
        reference.set_adapter(name)
        assert main(["run", "--pte", str(pte), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--adapter", name]) == 0
        assert ids_line(capsys.readouterr().out, "generated ids") == hf_greedy(reference, PROMPT, 12), name
    assert main(["run", "--pte", str(pte), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12",
                 "--adapter", f"B={tmp_path / 'demo.B.ptd'}", "--adapter-scale", "0"]) == 0
    assert ids_line(capsys.readouterr().out, "generated ids") == hf_greedy(demo_hf, PROMPT, 12)
    assert main(["run", "--pte", str(pte), "--prompt-ids", "1", "--adapter", "C"]) == 2
    err = error_line(capsys.readouterr().err)
    assert "demo.C.ptd does not exist" in err and f"adapters exported beside {pte}: {sorted(ADAPTERS)}" in err


@pytest.mark.slow
def test_export_adapter_programs_and_run_them_matches_peft(demo_hf, tmp_path, capsys):
    """`export --adapter-mode programs` ships the base weights as demo.ptd and each adapter as demo.NAME.pte;
    `run --adapter NAME` loads that program over demo.ptd and generates PeftModel's tokens with the adapter."""
    from peft import PeftModel
    from peft_refs import ADAPTERS, make_adapter

    make_adapter(demo_hf, tmp_path / "B", 1, **ADAPTERS["B"])
    pte = tmp_path / "demo.pte"
    assert main(["export", "--model", "demo", "--out", str(pte), "--max-seq-len", str(MAX_SEQ_LEN), "--adapter-mode",
                 "programs", f"--adapter=B={tmp_path / 'B'}"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"weights\s+{re.escape(str(tmp_path / 'demo.ptd'))} \(\d+\.\d+ MB\)", out), out
    assert re.search(r"adapter\s+B: .*demo\.B\.pte", out), out
    reference = PeftModel.from_pretrained(copy.deepcopy(demo_hf), tmp_path / "B").eval()
    assert main(["run", "--pte", str(pte), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12",
                 "--adapter", "B"]) == 0
    assert ids_line(capsys.readouterr().out, "generated ids") == hf_greedy(reference, PROMPT, 12)
    assert main(["run", "--pte", str(pte), "--prompt-ids", "1", "--adapter", "C"]) == 2
    err = error_line(capsys.readouterr().err)
    assert "demo.C.pte does not exist" in err and f"adapters exported beside {pte}: ['B']" in err


@pytest.mark.slow
def test_run_adapter_on_a_program_without_slots_says_how_to_export_it(demo_export, capsys):
    _, pte, _ = demo_export
    assert main(["run", "--pte", str(pte), "--prompt-ids", "1", "--adapter", "chat"]) == 2
    err = error_line(capsys.readouterr().err)
    assert "has no LoRA slots" in err and "export it with --adapter chat=DIR" in err
    assert "load_adapter" not in err  # the Python API's remedy, not the command's


def test_adapter_option_errors_exit_2(tmp_path, capsys):
    cases = [
        (["export", "--model", "demo", "--adapter", "=dir"], "--adapter: adapters=['=dir']"),
        (["export", "--model", "demo", "--adapter", "a=x", "--adapter", "a=y"], "adapter names must differ"),
        (["export", "--model", "demo", "--adapter", f"a={tmp_path / 'none'}"], "is not a directory"),
        (["run", "--pte", "x.pte", "--prompt-ids", "1", "--adapter", "a="], "--adapter: adapter='a='"),
        (["run", "--pte", str(tmp_path / "x.pte"), "--prompt-ids", "1", "--adapter-scale", "2"], "x.pte does not exist"),
    ]
    for args, expected in cases:
        assert main(args) == 2, args
        err = error_line(capsys.readouterr().err)
        assert expected in err, (args, err)


# ------------------------------------------------------------------------------------------ quantization


class _Stop(Exception):
    """Raised by a stand-in once it has recorded its call: the test needs the arguments, not the work."""


def _recorder(calls: list):
    def record(*args, **kwargs):
        calls.append(kwargs)
        raise _Stop

    return record


def test_weight_quantization_flags_and_keys_reach_export(tmp_path, monkeypatch):
    import etblocks

    calls = []
    monkeypatch.setattr(etblocks, "export", _recorder(calls))
    with pytest.raises(_Stop):
        main(["export", "--model", "demo", "--out", str(tmp_path / "q.pte"), "--max-seq-len", str(MAX_SEQ_LEN),
              "--quantize-weights", "8da4w", "--group-size", "64", "--quantize-embedding", "int8"])
    config = tmp_path / "q.yaml"
    config.write_text(f"model: demo\nmax_seq_len: {MAX_SEQ_LEN}\nquantize_weights: 8da8w\nquantize_embedding: int8\n")
    with pytest.raises(_Stop):
        main(["export", "--config", str(config)])
    flags, keys = calls
    assert (flags["quantize_weights"], flags["group_size"], flags["quantize_embedding"]) == ("8da4w", 64, "int8")
    assert (keys["quantize_weights"], keys["group_size"], keys["quantize_embedding"]) == ("8da8w", 32, "int8")  # 32: the default
    assert flags["quantize_activations"] == keys["quantize_activations"] == "auto"


def test_kv_quantize_flag_and_key_are_swap_overrides(tmp_path, monkeypatch):
    import etblocks

    calls = []
    monkeypatch.setattr(etblocks, "swap", _recorder(calls))
    with pytest.raises(_Stop):
        main(["export", "--model", "demo", "--kv-quantize", "int8", "--sdpa", "dynamic"])
    (tmp_path / "kv.yaml").write_text("model: demo\nkv_quantize: int8\n")
    with pytest.raises(_Stop):
        main(["export", "--config", str(tmp_path / "kv.yaml")])
    assert calls[0]["kv_quantize"] == "int8" and calls[0]["sdpa"] == "dynamic"
    assert calls[1]["kv_quantize"] == "int8" and "sdpa" not in calls[1]


def test_quantization_option_errors_exit_2_before_loading(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("model: demo\nbackend: portable\nquantize_weights: 8da8w\n")
    cases = [
        (["--quantize-weights", "8da4w", "--backend", "portable"],
         "--quantize-weights: quantize_weights='8da4w': backend='portable' has no kernels for it; backends that run it: ['xnnpack']"),
        (["--quantize-embedding", "int8", "--backend", "portable"], "--quantize-embedding: quantize_embedding='int8': backend='portable' has no kernels"),
        (["--quantize-weights", "8da4w", "--group-size", "48"],
         "--quantize-weights, --group-size: group_size=48 is not accepted; give a positive multiple of 32"),
        (["--quantize-embedding", "int4"], "--quantize-embedding: quantize_embedding='int4' (str) is not accepted; choose one of ['int8', 'none']"),
        (["--quantize-weights", "int4"], "--quantize-weights: quantize_weights='int4' (str) is not accepted; choose one of ['4bit', '8bit', '8da4w', '8da8w', 'none']"),
        (["--kv-quantize", "fp8"], "--kv-quantize: kv_quantize='fp8' (str) is not accepted; choose one of ['int8', 'none']"),
        (["--qnn-chipset", "SM8750"], "--qnn-chipset: qnn_chipset is an option of another backend, not of 'xnnpack'"),
        (["--check"], "--check: check is the readiness report of a backend that offers one (['qnn']), not backend='xnnpack'"),
        (["--config", str(tmp_path / "c.yaml")], "c.yaml', line 3: quantize_weights='8da8w': backend='portable' has no kernels"),
    ]
    for args, expected in cases:
        assert main(["export", "--model", "demo", "--out", str(tmp_path / "x.pte"), *args]) == 2, args
        captured = capsys.readouterr()
        assert expected in error_line(captured.err), (args, captured.err)
        assert "loading" not in captured.err, args
    assert not (tmp_path / "x.pte").exists()


def test_export_help_lists_both_quantization_families(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--quantize-activations SCHEME", "(qnn: 16a8w, 16a4w, 8a8w)", "--quantize-weights {4bit,8bit,8da4w,8da8w}",
                  "4bit (the default 4-bit recipe", "8da4w (int8 dynamic activations, symmetric int4 weights", "8da8w (int8 weights", "--group-size N",
                  "--quantize-embedding {int8}", "--kv-quantize {int8}", "--qnn-chipset SOC", "default: SM8650"):
        assert words in text, words
