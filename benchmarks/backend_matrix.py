"""Every family etblocks converts (the tests' `FAMILIES` table) on every backend that runs or checks here, and the
families of `MATRIX_FAMILIES` whose code paths on NPUs no `FAMILIES` entry reaches (MoE routers: ERNIE 4.5's softmax
with a correction bias, LFM2-MoE's sigmoid one, GLM-4.5's within groups), as `tests/hf_matrix.py` configures them.

Each cell swaps the family's tiny config (`tests/hf_models.py`, random weights) for one backend, exports it and
checks the program against the untouched transformers model:
- `xnnpack`: the dynamic program; `xnnpack static`, `portable static`, `openvino`: the static prefill/decode program
  (chunk 8, context 96), run by `etblocks.Runner`. The greedy tokens of prompts of 13 tokens (a padded prefill
  tail) and 17 (a tail through decode) against `generate`'s.
- `qnn`: the qnn recipe (per-head attention, 1x1-conv projections) quantized 16a8w with QnnQuantizer and checked by
  `check_readiness` (a QNN builder for every op, static shapes, no float64 or int64), prefill and decode; with 2
  query heads over 1 KV head, as the suite's checks, since the per-head graph grows with the heads.
The suite runs a fixed subset of these cells, one per code path (`tests/export/test_static_programs.py`,
`tests/export/test_hybrid_programs.py`, ...); this script runs them all, each in its own process. Statuses:
- `token-exact` (or `ready` for `qnn`): as above;
- `refused`: `swap` or `export` refused the family with a typed etblocks error (the reason is kept);
- `wrong tokens`, `not ready`, `raw exception`, `crashed`: bugs; the script exits 1 when any cell has one.

    python benchmarks/backend_matrix.py                                 # every cell -> benchmarks/results/backend_matrix.json
    python benchmarks/backend_matrix.py --families lfm2 --backends qnn  # some cells (merged into the results file)
    python benchmarks/backend_matrix.py --render                        # rewrite docs/backend_matrix.md from the results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sweeps import CRASHED, ROOT, add_sweep_args, commit_label, git_commit, one_case_or_page, run_isolated, table_cell, versions

RESULTS = ROOT / "benchmarks" / "results" / "backend_matrix.json"
PAGE = ROOT / "docs" / "backend_matrix.md"
BACKENDS = ("xnnpack", "xnnpack static", "portable static", "openvino", "qnn")
PROMPT_LENGTHS = (13, 17)
NEW_TOKENS = 16
CELL_TIMEOUT_S = 1200
OK, READY, REFUSED = "token-exact", "ready", "refused"
BUGS = ("wrong tokens", "not ready", "raw exception", CRASHED)


# model type -> overrides of its `tests/hf_matrix.py` config (GLM-4.5's router within 2 of 4 groups)
MATRIX_FAMILIES = {"ernie4_5_moe": {}, "glm4_moe": dict(n_group=4, topk_group=2), "lfm2_moe": {}}


def family_table() -> dict:
    """The tests' `FAMILIES` and the `MATRIX_FAMILIES` entries, `name -> (model_type, config overrides)`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_matrix import config_kwargs
    from hf_models import FAMILIES

    return {**FAMILIES, **{name: (name, {**config_kwargs(name), **extra}) for name, extra in MATRIX_FAMILIES.items()}}


def families() -> list[str]:
    return list(family_table())


def run_cell(name: str, backend: str, workdir: Path) -> dict:
    """Swap, export and check one family on one backend (in this process)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_models import FEW_HEADS, hf_greedy, prompt_ids, swapped_family
    from static_refs import CHUNK, CONTEXT

    import etblocks
    from etblocks.errors import EtblocksError
    from etblocks.export import check_readiness

    target, _, shapes = backend.partition(" ")
    options = {"max_seq_len": CONTEXT} if backend == "xnnpack" else {"max_seq_len": CONTEXT, "chunk": CHUNK}
    if shapes:
        options["shapes"] = shapes
    table = family_table()
    model_type, overrides = table[name]
    if target == "qnn":
        table = {name: (model_type, {**overrides, **FEW_HEADS})}
    step = "swap"
    try:
        original, swapped = swapped_family(name, target, table, **options)
        converted = sorted({type(m).__name__ for m in swapped.modules() if type(m).__module__.startswith("etblocks")})
        record = {"blocks": converted}
        if target == "qnn":
            step = "check_readiness"
            report = check_readiness(swapped, "qnn")
            if all(r.ready for r in report.values()):
                return {**record, "status": READY}
            return {**record, "status": "not ready", "reason": "; ".join(readiness_problems(report))[:2000]}
        step = "export"
        result = etblocks.export(swapped, backend=target, out=workdir / "model.pte")
        step = "run"
        runner = etblocks.Runner(result.path)
        for length in PROMPT_LENGTHS:
            prompt = prompt_ids(length)
            expected = hf_greedy(original, prompt, NEW_TOKENS)
            runner.reset()
            actual = runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS)
            if actual != expected:
                first = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), len(expected))
                return {**record, "status": "wrong tokens",
                        "reason": f"prompt of {length} tokens: first difference at token {first}"}
        return {**record, "status": OK, "delegated": dict(result.delegation.ops_per_delegate),
                "cpu_ops": result.delegation.n_cpu_ops}
    except EtblocksError as exc:
        where = "" if step == "swap" else f"at {step}: "
        return {"status": REFUSED, "reason": f"{where}{type(exc).__name__}: {exc}"[:2000]}
    except Exception as exc:  # noqa: BLE001 - what the matrix exists to find
        return {"status": "raw exception", "reason": f"at {step}: {type(exc).__name__}: {exc}"[:2000]}


def readiness_problems(report: dict) -> list[str]:
    """What keeps each method of a QNN readiness report from lowering, one line per kind of problem."""
    problems = []
    for method, readiness in report.items():
        if readiness.uncovered:
            problems.append(f"{method}: no QNN builder for {', '.join(sorted(readiness.uncovered))}")
        for kind, nodes in (("dynamic shapes", readiness.dynamic), ("dtypes HTP cannot hold", readiness.bad_dtypes)):
            if nodes:
                problems.append(f"{method}: {kind} at {len(nodes)} nodes, e.g. {nodes[0]}")
        if readiness.build_error:
            problems.append(f"{method}: graph build failed: {readiness.build_error}")
    return problems


def cell_key(name: str, backend: str) -> str:
    return f"{name}/{backend}"


def render(results: dict) -> str:
    cells = results["cells"]
    names = sorted({key.split("/")[0] for key in cells})
    counts: dict[str, int] = {}
    for record in cells.values():
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    commits = sorted({commit_label(record) for record in cells.values()})
    lines = [
        "# Families on every backend",
        "",
        "<!-- generated by benchmarks/backend_matrix.py --render from benchmarks/results/backend_matrix.json -->",
        "",
        (f"Each family etblocks converts, as the tests' tiny random-weight config (`tests/hf_models.py`; "
         f"{', '.join(f'`{n}`' for n in MATRIX_FAMILIES)} as `tests/hf_matrix.py` configures them, GLM-4.5's router "
         f"over 2 of 4 expert groups), swapped for "
         f"each backend with `etblocks.swap`, exported, and checked against the untouched transformers model: the "
         f"programs' greedy tokens against `generate` for prompts of {' and '.join(map(str, PROMPT_LENGTHS))} tokens "
         f"({NEW_TOKENS} new tokens; static programs of chunk 8 and context 96, so one prompt leaves a padded "
         f"prefill tail and the other a tail through `decode`), and for `qnn` the readiness check of the 16a8w "
         f"prefill and decode programs (a QNN builder for every op, static shapes; lowering needs the Qualcomm "
         f"SDK). The suite runs one cell per code path; `python benchmarks/backend_matrix.py` runs them all "
         f"(commits {', '.join(commits)}; transformers {results['versions']['transformers']}, torch "
         f"{results['versions']['torch']}, executorch {results['versions']['executorch']})."),
        "",
        "| status | cells |",
        "|---|---|",
        *(f"| {status} | {n} |" for status, n in sorted(counts.items())),
        "",
        "A family not run yet is missing, a cell not run yet blank. Reasons of refusals and failures are below the table.",
        "",
        "| family | " + " | ".join(BACKENDS) + " |",
        "|---|" + "---|" * len(BACKENDS),
    ]
    notes = []
    for name in names:
        row = []
        for backend in BACKENDS:
            record = cells.get(cell_key(name, backend))
            row.append("" if record is None else record["status"])
            if record is not None and record["status"] not in (OK, READY):
                notes.append(f"- `{name}` on `{backend}`: {table_cell(record.get('reason', ''))}")
        lines.append(f"| `{name}` | " + " | ".join(row) + " |")
    return "\n".join([*lines, "", *notes]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated names of the tests' FAMILIES or MATRIX_FAMILIES (default: all)")
    parser.add_argument("--backends", help=f"comma-separated, of {', '.join(BACKENDS)} (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="cells run at once (default 2)")
    add_sweep_args(parser, RESULTS, PAGE)
    args = parser.parse_args(argv)
    done = one_case_or_page(args, lambda key, workdir: run_cell(*key.split("/"), workdir), render, PAGE)
    if done is not None:
        return done

    known = families()
    names = args.families.split(",") if args.families else known
    backends = args.backends.split(",") if args.backends else list(BACKENDS)
    for given, allowed, option in ((names, known, "--families"), (backends, BACKENDS, "--backends")):
        unknown = [v for v in given if v not in allowed]
        if unknown:
            parser.error(f"{option}: unknown {unknown}; known: {', '.join(allowed)}")
    keys = [cell_key(n, b) for n in names for b in backends]
    results = json.loads(args.out.read_text()) if args.out.exists() else {"cells": {}}
    start, commit, installed = time.perf_counter(), git_commit(), versions()
    with ThreadPoolExecutor(args.jobs) as pool:
        records = pool.map(lambda key: run_isolated(Path(__file__), key, CELL_TIMEOUT_S), keys)
        for key, record in zip(keys, records):
            results["cells"][key] = {**record, "git_commit": commit["commit"], "git_dirty": commit["dirty"]}
            print(f"{key:40s} {record['status']:15s} {record.get('reason', '')[:150]}", flush=True)
    results.update(versions=installed, wall_s=round(time.perf_counter() - start))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    bugs = sorted(k for k in keys if results["cells"][k]["status"] in BUGS)
    print(f"{sum(results['cells'][k]['status'] in (OK, READY) for k in keys)} of {len(keys)} cells pass; "
          f"bugs: {bugs or 'none'}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
