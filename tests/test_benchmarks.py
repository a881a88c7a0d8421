"""Every benchmark's `--smoke` run, with one row's outputs corrupted (`ETBLOCKS_BENCH_BREAK_ROW`, applied inside the
harness's check): the script exits 1 naming that row and the first differing index, every other comparison of the
run agrees, and the results file holds what `benchmarks/harness.py` records. One run per script shows both that the
script works and that it fails when its outputs are wrong (a smoke with nothing corrupted, for a row no other smoke
runs, must pass instead)."""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# script and options -> the check key of the row its smoke run corrupts (None: nothing corrupted, the run must pass);
# every smoke compares at least one other row
SCRIPTS = {
    "sampling": "a@1/0.9",
    "mla": "a@16",
    "moe": "gather@4",
    "decode": "a",
    "torchtune_decode": "a",
    "quant": "e",
    # the example's 8da4w program and etblocks' fp32 one, whose tokens must equal eager transformers'
    "decode_profile --rows b,c": "c",
    "step_breakdown": "c",
    "lora": "a",
    # Qwen3.5 (a DeltaNet and an attention layer): the chunked delta rule's program against the eager model's row
    # (etblocks' default program is in the Granite 4.0-H smoke below)
    "hybrid": "f",
    "speculate": "b",
    # fp32 and int8 KV caches, etblocks and ExecuTorch's llama example, at contexts 16 and 32: (b), an int8-KV row
    # (required to agree on the first token only), fails at both
    "long_context": "b",
    # ExecuTorch's Gemma 4 example alone on a tiny 6-layer stack (one KV-shared layer), prompt longer than the
    # window: nothing broken, its tokens must equal transformers' (etblocks' row (a) is the other hybrid smokes')
    "hybrid --family gemma4 --layers 6 --rows b --max-seq-len 1024 --prompts 12": None,
    # Granite 4.0-H (one Mamba2 and one attention layer): etblocks' program against the eager model's row
    "hybrid --family granitemoehybrid --rows a,g": "g",
}
VERSIONS = {"torch", "executorch", "torchao", "transformers", "etblocks"}
CPU_FLAGS = {"avx2", "avx512f", "avx512_vnni", "amx_int8"}


def benchmark_module(name: str):
    """A module of benchmarks/ (not a package: the scripts import each other from their own folder)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def run_smoke(smoke: str, out: Path, break_row: str) -> subprocess.CompletedProcess:
    script, *options = smoke.split()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["ETBLOCKS_BENCH_BREAK_ROW"] = break_row
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke", *options, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    print(f"{smoke} --smoke (row {break_row} broken): exit {done.returncode} in {time.perf_counter() - start:.0f} s")
    return done


def timings(value: object) -> list[dict]:
    """Every {"runs": [...], "median", "min", "max"} record inside a results entry."""
    found = []
    if isinstance(value, dict):
        if isinstance(value.get("runs"), list) and {"median", "min", "max"} <= value.keys():
            found.append(value)
        for item in value.values():
            found += timings(item)
    elif isinstance(value, list):
        for item in value:
            found += timings(item)
    return found


def the_entry(out: Path) -> dict:
    results = json.loads(out.read_text())
    (entry,) = results["runs"].values()
    return entry


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_checks_its_outputs_and_writes_results(script, tmp_path):
    out = tmp_path / "results.json"
    row = SCRIPTS[script]
    done = run_smoke(script, out, break_row=row or "")
    if row is None:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    else:
        assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-5000:]
        assert f"({row})" in done.stdout and "first differing index 0" in done.stdout, done.stdout[-3000:]

    entry = the_entry(out)
    assert entry["ok"] is (row is None)
    broken = [c for c in entry["checks"] if c["row"] == row]
    others = [c for c in entry["checks"] if c["row"] != row]
    assert row is None or (broken and all(not c["ok"] and c["first_difference"] == 0 for c in broken)), broken
    assert others, "the smoke run compared no other row"
    for check in others:
        assert check["ok"] and check["compared"] > 0 and check["matching"] >= check["required"], check
    assert len(entry["problems"]) == len(broken), entry["problems"]

    assert entry["git_commit"] and len(entry["git_commit"]) == 40
    assert set(entry["versions"]) >= VERSIONS and entry["versions"]["torch"]
    assert entry["cpu"] and set(entry["cpu_flags"]) == CPU_FLAGS
    assert entry["args"]["smoke"] is True
    records = [r for r in timings(entry) if r["runs"]]  # a script may leave a row that disagrees untimed
    assert records, "no per-round timings"
    for r in records:
        assert r["min"] <= r["median"] <= r["max"]
    assert entry["tables"]


def test_rendered_docs_are_current():
    """docs/benchmarks.md's generated tables are what `benchmarks/render.py` makes of the committed results files."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "render.py"), "--check"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_backend_matrix_page_is_what_the_results_give():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "backend_matrix.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, "docs/backend_matrix.md is stale: run python benchmarks/backend_matrix.py --render"


@pytest.mark.parametrize("option, value, known", [("--families", "llama,nope", "gemma4_text"),
                                                  ("--backends", "qnn,coreml", "portable static")])
def test_backend_matrix_names_what_it_knows_for_an_unknown_cell(option, value, known, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark_module("backend_matrix").main([option, value])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert f"{option}: unknown ['{value.split(',')[1]}']" in message and known in message


def test_token_check_and_its_break_switch(monkeypatch):
    harness = benchmark_module("harness")
    monkeypatch.delenv(harness.BREAK_ROW_ENV, raising=False)
    check = harness.check_tokens("a", [5, 6, 7], [5, 6, 8], "eager")
    assert (check.ok, check.matching, check.first_difference) == (False, 2, 2)
    assert harness.check_tokens("a", [5, 6, 7], [5, 6, 8], "eager", required=1).ok
    assert harness.check_tokens("a", [5, 6, 7], [5, 6, 7], "eager").first_difference is None
    monkeypatch.setenv(harness.BREAK_ROW_ENV, "a")
    broken = harness.check_tokens("a", [5, 6, 7], [5, 6, 7], "eager", required=1)
    assert (broken.ok, broken.first_difference) == (False, 0)
    assert harness.check_tokens("b", [5, 6, 7], [5, 6, 7], "eager").ok
    checks = harness.Checks()
    checks.add(broken)
    assert not checks.ok and "(a) vs eager: first differing index 0" in checks.report()


def test_rank_check_takes_near_ties_and_refuses_tokens_ranked_far_down(monkeypatch, tmp_path):
    """`check_ranks` (decode_profile.py's check of quantized rows): the model's greedy tokens pass; a third-ranked
    token passes with top_k=3 and fails at its index with top_k=2; the break switch fails the first token."""
    harness = benchmark_module("harness")
    monkeypatch.delenv(harness.BREAK_ROW_ENV, raising=False)
    bench = tiny_bench(tmp_path)
    model = harness.build_hf_model(bench)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([bench.prompt]), max_new_tokens=4, do_sample=False)[0, 12:].tolist()
        order = model(torch.tensor([bench.prompt + greedy[:2]])).logits[0, -1].argsort(descending=True).tolist()
    assert harness.check_ranks("a", greedy, model, bench.prompt, 1).ok
    third = [*greedy[:2], order[2]]
    assert harness.check_ranks("a", third, model, bench.prompt, 3).ok
    refused = harness.check_ranks("a", third, model, bench.prompt, 2)
    assert (refused.ok, refused.matching, refused.first_difference) == (False, 2, 2)
    assert refused.expected[:3] == [*greedy[:2], order[0]] and "[0, 0, 2]" in refused.note
    monkeypatch.setenv(harness.BREAK_ROW_ENV, "a")
    broken = harness.check_ranks("a", greedy, model, bench.prompt, 5)
    assert (broken.ok, broken.first_difference) == (False, 0)


def test_kv_sharing_report_counts_the_caches_of_each_program(tmp_path):
    """The memory report (no outputs to compare): its smoke run writes, per E2B-shaped decoder and program, one K/V
    pair per source layer (Gemma 3n E2B: 20 of 30 layers, Gemma 4 E2B: 15 of 35) against one per layer."""
    out = tmp_path / "kv_sharing.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "kv_sharing.py"), "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    entry = json.loads(out.read_text())["runs"]["smoke"]
    figures = entry["figures"]
    assert len(figures) == 4
    for name, figure in figures.items():
        sources, layers = (20, 30) if name.startswith("gemma3n") else (15, 35)
        assert figure["tensors"] == [2 * sources, 2 * layers], name
        assert figure["shared_bytes"] < figure["per_layer_bytes"], name


def test_hybrid_state_bytes_are_what_a_swapped_granite_program_keeps():
    """`benchmarks/hybrid.py`'s state table for Granite 4.0-H: a Mamba2 layer's formula (conv window of d_conv - 1
    rows over x/B/C, fp32 SSM state) and a full-attention layer's K/V rows equal the bytes of the states etblocks
    declares for those layers of the swapped tiny model, at the context it is swapped for."""
    hybrid = benchmark_module("hybrid")
    import etblocks
    from etblocks.state.base import State

    family = hybrid.FAMILIES["granitemoehybrid"]
    layer_types, _ = hybrid.cut_layer_types(family, 2)
    bench = hybrid.HybridBench(benchmark_module("harness").Shape(), [], 1, 1, Path(), 0, 0.02, family=family.key,
                               tiny=True, layer_types=layer_types)
    model = hybrid.build_model(bench)
    config = model.config
    etblocks.swap(model, backend="xnnpack", max_seq_len=64)
    kept = {}
    for name, module in model.named_modules():
        if isinstance(module, State):
            layer = int(name.split("layers.")[1].split(".")[0])
            kept[layer] = kept.get(layer, 0) + sum(s.zeros().nbytes for s in module.specs())
    assert layer_types == ("linear_attention", "full_attention")
    assert kept[0] == hybrid.state_bytes(config, "linear_attention", 64)
    width = hybrid.kv_widths(bench)["full_attention"]
    assert kept[1] == hybrid.state_bytes(config, "full_attention", 64, width)


def test_runs_on_another_host_kind_sit_beside_the_usual_hosts_entry(tmp_path):
    harness = benchmark_module("harness")
    vnni = {"avx2": True, "avx512f": True, "avx512_vnni": True, "amx_int8": False}
    avx2 = {**vnni, "avx512f": False, "avx512_vnni": False}
    assert harness.host_key("--rows a,e", vnni) == "--rows a,e"
    assert harness.host_key("--rows a,e", avx2) == "--rows a,e (AVX2-only host)"
    assert harness.host_kind(dict.fromkeys(vnni)) == platform.machine()  # /proc/cpuinfo without x86 flags
    assert harness.host_kind({**avx2, "avx2": False}) == "x86 without AVX2"
    out = tmp_path / "quant.json"
    for flags, tps in ((vnni, 250.0), (avx2, 120.0)):
        harness.write_results(out, harness.host_key("--rows a,e", flags), {"tps": tps})
    assert json.loads(out.read_text())["runs"] == {"--rows a,e": {"tps": 250.0},
                                                  "--rows a,e (AVX2-only host)": {"tps": 120.0}}


def test_llama_cpp_build_flags_follow_the_cpu_but_leave_out_amx(tmp_path):
    llamacpp = benchmark_module("llamacpp")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx f16c fma bmi2 avx2 avx512f amx_tile amx_int8\n")
    args = llamacpp.cmake_args(cpuinfo).split()
    wanted = {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"}
    assert wanted <= set(args)
    assert "-DGGML_AVX512=OFF" in args  # avx512f alone is not the five subsets ggml compiles GGML_AVX512 for
    assert "-DGGML_AVX512_VNNI=OFF" in args
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\n")  # Arm: llama.cpp's own native build
    assert llamacpp.cmake_args(cpuinfo) == ""


def test_llama_cpp_rows_name_the_install_they_need_when_it_is_missing(monkeypatch):
    llamacpp = benchmark_module("llamacpp")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(llamacpp.Unavailable, match=r"\.\[bench\]"):
        llamacpp.import_llama_cpp()
    with pytest.raises(ValueError, match="file_type='Q5_K'"):
        llamacpp.llama_cpp_path("Q5_K")


@pytest.mark.slow
def test_llama_cpp_rows_are_unavailable_without_the_bench_extra(tmp_path):
    """quant.py with llama.cpp's rows where neither llama-cpp-python nor gguf imports: those rows say what they need
    and the script exits 0. Its own rows alone: the others are the quant smoke run's."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    for module in ("llama_cpp", "gguf"):
        (shadow / f"{module}.py").write_text(f"raise ImportError('{module} is shadowed by the test')\n")
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), str(ROOT)]))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "quant.py"), "--smoke", "--rows", "h,i", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = {row["key"]: row for row in the_entry(out)["rows"]}
    for key in ("h", "i"):
        assert rows[key]["status"].startswith("unavailable: needs llama-cpp-python"), rows[key]


def tiny_bench(tmp_path, init_range: float = 0.3):
    """A 2-layer tiny Llama whose weights are large enough that its greedy tokens vary."""
    import dataclasses

    harness = benchmark_module("harness")
    shape = dataclasses.replace(harness.SHAPES["tiny"], layers=2, max_seq_len=64)
    prompt = torch.randint(1, shape.vocab, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return harness.Bench(shape, prompt, 10, 1, tmp_path, 0, init_range)


def test_gguf_conversion_gives_transformers_logits_and_tokens_in_llama_cpp(tmp_path):
    """The F32 GGUF run by llama.cpp against the transformers model it was written from: last-position logits of a
    prompt, then greedy tokens equal `generate()`'s; the Q8_0 and Q4_0 files hold every matrix in their type."""
    pytest.importorskip("llama_cpp", reason='llama.cpp rows need the bench extra: pip install -e ".[bench]"')
    gguf = pytest.importorskip("gguf")
    llamacpp = benchmark_module("llamacpp")
    bench = tiny_bench(tmp_path)
    model = benchmark_module("harness").build_hf_model(bench)
    path = tmp_path / "model.gguf"
    llamacpp.write_gguf(model, path)

    driver = llamacpp.LlamaCppDriver(path, context=64, threads=2)
    first = driver.prefill(bench.prompt)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([bench.prompt])).logits[0, -1]
    torch.testing.assert_close(torch.from_numpy(driver.last_logits().copy()), expected, atol=1e-3, rtol=1e-3)
    tokens = [first]
    for i in range(bench.decode_steps):
        tokens.append(driver.decode(tokens[-1], len(bench.prompt) + i))
    reference = benchmark_module("harness").eager_reference_tokens(bench)
    assert len(set(reference)) > 3, reference  # the weights give varied tokens, so the check can tell rope layouts
    assert tokens == reference

    for file_type in ("Q8_0", "Q4_0"):
        quantized = tmp_path / f"{file_type}.gguf"
        llamacpp.quantize_gguf(path, quantized, file_type)
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(quantized)).tensors if len(t.shape) == 2}
        assert set(types.values()) == {file_type}, types  # pure: the tied embedding / lm_head too
        assert len(types) == 1 + 7 * bench.shape.layers
        driver = llamacpp.LlamaCppDriver(quantized, context=64, threads=2)
        driver.prefill(bench.prompt)
        rounded = llamacpp.rounded_through(model, file_type)  # what the file's blocks hold
        with torch.no_grad():
            wanted = rounded(input_ids=torch.tensor([bench.prompt])).logits[0, -1]
        got = torch.from_numpy(driver.last_logits().copy())
        # llama.cpp also rounds activations to q8_0 blocks; 4 bits of this model alone move the logits far more
        # (cosine 0.86 against the fp32 model's)
        assert torch.nn.functional.cosine_similarity(got, wanted, dim=0) > 0.999, file_type
