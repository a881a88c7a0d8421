"""Every benchmark's `--smoke` run exits 0 and writes a results file with what `benchmarks/harness.py` records; with
one row's outputs corrupted (`ETBLOCKS_BENCH_BREAK_ROW`, applied inside the harness's check) it exits 1, naming the
row and the first differing index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# script -> the check key of one row that its smoke run compares (what ETBLOCKS_BENCH_BREAK_ROW corrupts)
SCRIPTS = {
    "sampling": "a@1/0.9",
    "mla": "a@16",
    "moe": "gather@4",
    "decode": "a",
    "torchtune_decode": "a",
    "quant": "a",
    "decode_profile": "a",
    "step_breakdown": "c",
    "lora": "a",
    "hybrid": "a",
}
VERSIONS = {"torch", "executorch", "torchao", "transformers", "etblocks"}
CPU_FLAGS = {"avx2", "avx512f", "avx512_vnni", "amx_int8"}


def run_smoke(script: str, out: Path, break_row: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("ETBLOCKS_BENCH_BREAK_ROW", None)
    if break_row is not None:
        env["ETBLOCKS_BENCH_BREAK_ROW"] = break_row
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1800, check=False)
    print(f"{script} --smoke{' (broken ' + break_row + ')' if break_row else ''}: exit {done.returncode} in "
          f"{time.perf_counter() - start:.0f} s")
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
def test_smoke_run_passes_and_writes_results(script, tmp_path):
    out = tmp_path / f"{script}.json"
    done = run_smoke(script, out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    entry = the_entry(out)
    assert entry["ok"] is True and entry["problems"] == []
    assert entry["git_commit"] and len(entry["git_commit"]) == 40
    assert set(entry["versions"]) >= VERSIONS and entry["versions"]["torch"]
    assert entry["cpu"] and set(entry["cpu_flags"]) == CPU_FLAGS
    assert entry["args"]["smoke"] is True
    assert entry["checks"], "the run compared no outputs"
    for check in entry["checks"]:
        assert check["ok"] and check["compared"] > 0 and check["matching"] >= check["required"], check
    records = timings(entry)
    assert records and all(r["runs"] for r in records), "no per-round timings"
    for r in records:
        assert r["min"] <= r["median"] <= r["max"]
    assert entry["tables"]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_broken_row_fails_the_run(script, tmp_path):
    out = tmp_path / f"{script}.json"
    row = SCRIPTS[script]
    done = run_smoke(script, out, break_row=row)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-5000:]
    assert f"({row})" in done.stdout and "first differing index 0" in done.stdout, done.stdout[-3000:]
    entry = the_entry(out)
    assert entry["ok"] is False
    (failed,) = [c for c in entry["checks"] if not c["ok"]]
    assert failed["row"] == row and failed["first_difference"] == 0


def test_rendered_docs_are_current():
    """docs/benchmarks.md's generated tables are what `benchmarks/render.py` makes of the committed results files."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "render.py"), "--check"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_token_check_and_its_break_switch(monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import harness
    finally:
        sys.path.remove(str(BENCHMARKS))
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
