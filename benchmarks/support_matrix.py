"""Every architecture in transformers' causal-LM auto mapping against etblocks on XNNPACK.

For each model type: build the tiny config of `tests/hf_matrix.py` (or record why transformers cannot), swap a copy
for XNNPACK (with the probe), export it, and compare the program's greedy tokens with upstream `generate`. Each
family runs in its own process (a crash or a hang is recorded as a raw failure of that family, not of the run).
Statuses:
- `token-exact`: the exported program's tokens equal `generate`'s;
- `refused`: `swap` or `export` refused the model with a typed etblocks error (the reason is kept);
- `not buildable`: transformers itself cannot build or run the tiny config here (the reason is kept);
- `wrong tokens` / `raw exception` / `crashed`: bugs; the script exits 1 when any family has one.

    python benchmarks/support_matrix.py                       # the whole matrix -> benchmarks/results/support_matrix.json
    python benchmarks/support_matrix.py --families llama,glm  # some families (merged into the results file)
    python benchmarks/support_matrix.py --render              # rewrite docs/transformers.md from the results file
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sweeps import CRASHED, ROOT, add_sweep_args, commit_label, git_commit, one_case_or_page, run_isolated, table_cell, versions

RESULTS = ROOT / "benchmarks" / "results" / "support_matrix.json"
PAGE = ROOT / "docs" / "transformers.md"
NEW_TOKENS = 8
PROMPT_LEN = 12
MAX_SEQ_LEN = 64
FAMILY_TIMEOUT_S = 900
OK, REFUSED, NOT_BUILDABLE = "token-exact", "refused", "not buildable"
BUGS = ("wrong tokens", "raw exception", CRASHED)


def run_family(model_type: str, workdir: Path) -> dict:
    """Swap, export and compare one family (in this process)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from hf_matrix import NOT_BUILDABLE as UNBUILDABLE
    from hf_matrix import tiny_matrix_model

    import etblocks
    from etblocks.errors import EtblocksError

    if model_type in UNBUILDABLE:
        return {"status": NOT_BUILDABLE, "reason": UNBUILDABLE[model_type]}
    model = tiny_matrix_model(model_type)
    record = {"architecture": type(model).__name__}
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)[0, PROMPT_LEN:].tolist()
    swapped = copy.deepcopy(model)
    step = "swap"
    try:
        etblocks.swap(swapped, backend="xnnpack", max_seq_len=MAX_SEQ_LEN)
        step = "export"  # a typed refusal here is still a refusal, but one swap should have given
        result = etblocks.export(swapped, backend="xnnpack", out=workdir / f"{model_type}.pte")
        step = "run"
        actual = etblocks.Runner(result.path).generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS)
    except EtblocksError as exc:
        where = "" if step == "swap" else f"at {step}: "
        return {**record, "status": REFUSED, "reason": f"{where}{type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - what the matrix exists to find
        return {**record, "status": "raw exception", "reason": f"at {step}: {type(exc).__name__}: {exc}"[:2000]}
    converted = sorted({type(m).__name__ for m in swapped.modules() if type(m).__module__.startswith("etblocks")})
    record.update(expected=expected, actual=actual, blocks=converted)
    if actual != expected:
        first = next(i for i, (a, b) in enumerate(zip(actual, expected)) if a != b) if len(actual) == len(expected) else 0
        return {**record, "status": "wrong tokens", "reason": f"first difference at token {first}"}
    return {**record, "status": OK}


def with_run(record: dict, commit: dict, transformers_version: str) -> dict:
    """Each family keeps the commit (and whether the tree had changes) and transformers version it ran with: a run
    over some families merges into an earlier whole run."""
    return {**record, "git_commit": commit["commit"], "git_dirty": commit["dirty"], "transformers": transformers_version}


def all_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def runs(results: dict) -> list[str]:
    """The commits and transformers versions the families ran with, with how many each, most first."""
    counted: dict[str, int] = {}
    for record in results["families"].values():
        version = record.get("transformers") or results["versions"]["transformers"]
        key = f"{commit_label(record if record.get('git_commit') else results)} with transformers {version}"
        counted[key] = counted.get(key, 0) + 1
    return [f"{c} ({n} families)" for c, n in sorted(counted.items(), key=lambda item: -item[1])]


def render(results: dict) -> str:
    families = results["families"]
    counts = {status: sum(1 for r in families.values() if r["status"] == status) for status in (OK, REFUSED, NOT_BUILDABLE, *BUGS)}
    lines = [
        "# Every transformers causal LM",
        "",
        "<!-- generated by benchmarks/support_matrix.py --render from benchmarks/results/support_matrix.json -->",
        "",
        (f"Each architecture in transformers {results['versions']['transformers']}'s causal-LM auto mapping, as a tiny "
        f"random-weight config (`tests/hf_matrix.py`), swapped for XNNPACK with `etblocks.swap` (every replacement "
        f"checked by the probe, prefill and decode), exported, and run: **{NEW_TOKENS} greedy tokens of the program "
        f"against transformers' `generate`** from a {PROMPT_LEN}-token prompt. Run with "
        f"`python benchmarks/support_matrix.py` (commits {', '.join(runs(results))}; torch "
        f"{results['versions']['torch']}, executorch {results['versions']['executorch']})."),
        "",
        "| status | architectures |",
        "|---|---|",
        *(f"| {status} | {n} |" for status, n in counts.items() if n or status == OK),
        "",
        ("`refused`: `swap` (or `export`) raised a typed etblocks error and left the model untouched; the reason is "
        "its message. `not buildable`: transformers itself cannot build or run the tiny config here."),
        "",
        "| model type | architecture | status | etblocks blocks / reason |",
        "|---|---|---|---|",
    ]
    for model_type, record in sorted(families.items()):
        detail = ", ".join(record.get("blocks", [])) if record["status"] == OK else record.get("reason", "")
        detail = table_cell(detail)
        lines.append(f"| `{model_type}` | {record.get('architecture', '')} | {record['status']} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated model types (default: all); merged into the results file")
    parser.add_argument("--jobs", type=int, default=2, help="families run at once (default 2)")
    add_sweep_args(parser, RESULTS, PAGE)
    args = parser.parse_args(argv)
    done = one_case_or_page(args, run_family, render, PAGE)
    if done is not None:
        return done

    model_types = args.families.split(",") if args.families else all_model_types()
    results = json.loads(args.out.read_text()) if args.families and args.out.exists() else {"families": {}}
    start, commit, installed = time.perf_counter(), git_commit(), versions()
    with ThreadPoolExecutor(args.jobs) as pool:
        records = pool.map(lambda model_type: run_isolated(Path(__file__), model_type, FAMILY_TIMEOUT_S), model_types)
        for model_type, record in zip(model_types, records):
            results["families"][model_type] = with_run(record, commit, installed["transformers"])
            print(f"{model_type:28s} {record['status']:15s} {record.get('reason', '')[:150]}", flush=True)
    results.update(versions=installed, git_commit=commit["commit"], git_dirty=commit["dirty"], wall_s=round(time.perf_counter() - start))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    bugs = sorted(t for t, r in results["families"].items() if r["status"] in BUGS)
    print(f"{sum(r['status'] == OK for r in results['families'].values())} token-exact; bugs: {bugs or 'none'}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
