"""Speculative decoding's decode speed: plain greedy beside prompt lookup and a draft model, on a model trained here.

Models: quant.py's small Llama (4 layers, hidden 256, vocabulary 512) trained for `--train-steps` at context
`--max-seq-len` on quant.py's synthetic corpus (words of 2-5 tokens in bigram order; with chance 0.1 per word an
earlier span of 3-8 words is repeated), and a draft of `--draft-layers` layers with the same widths trained on the
same batches. Both swapped and exported into one dynamic XNNPACK program with `max_draft=--max-draft` (the draft's
methods beside the target's: `export(..., draft=)`).

Prompts: two sets of `--prompts` held-out texts of `--prompt-len` tokens from the same generator: (i) repeating, as
the model was trained (copied spans), and (ii) non-repeating (no copied spans). Each prompt generates
`--new-tokens` greedily; every row gives every prompt's tokens.

Rows: (a) plain greedy decoding; (b) prompt lookup (`speculate="prompt_lookup"`); (c) the draft model
(`speculate="draft"`); (d) the worst case: proposals that are always wrong (each is the reference's token +
1), so every check keeps none and the runner's back-off (`LookupDrafter`) asks for proposals ever more rarely.
Decode tok/s of a set: its prompts' tokens after the first / the seconds from each first token to its last (the
target's and the draft's prefill are left out), timed in a fresh process that loads the program (torch's MKL on
one thread there, as `harness.in_fresh_process` sets it), rows rotated from round to round; medians [min-max] of
`--rounds`; speed-up: the median of per-round ratios to (a). Acceptance: proposed tokens kept / proposed; tokens per
call: generated tokens / program calls after the prompt's.

Call cost: one call's time by the tokens it takes (`forward` with 1, `verify` with 1 .. max_draft + 1), relative
to `forward` with one, for the trained model and (`--cost-shape`) the SmolLM2-135M shape with random weights, which
is too large to train here: what a call that checks proposals costs where decode reads weights from memory.

Checked: every row's tokens for every prompt equal transformers' `generate()` on the trained model; otherwise the
script exits 1. Targets (printed PASS/FAIL): (b) >= 1.8x (a) on (i) and >= 0.95x on (ii).
Results: benchmarks/results/speculate.json.

    python benchmarks/speculate.py            # 300 training steps, 8 prompts per set, 5 rounds
    python benchmarks/speculate.py --smoke    # 1 layer, 5 training steps, 2 prompts, 1 round
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    SHAPES,
    Bench,
    Checks,
    add_run_args,
    aligned_table,
    build_hf_model,
    check_tokens,
    describe_cpu,
    finish,
    in_fresh_process,
    load_runtime_program,
    paired_median,
    parse_with_smoke,
    spread,
    spread_record,
    timing_mkl_threads,
)
from quant import COPY_PROB, TRAINED_SHAPE, Corpus, Training, train_model

import etblocks  # noqa: E402

_STARTED = time.perf_counter()
SETS = {"i": "repeating", "ii": "non-repeating"}
COPY_PROBS = {"i": COPY_PROB, "ii": 0.0}
ROWS = {"a": "plain greedy", "b": "prompt lookup", "c": "draft model", "d": "always-wrong proposals (worst case)"}
TARGETS = {"i": 1.8, "ii": 0.95}  # row (b)'s decode speed-up over (a)


def log(message: str) -> None:
    print(f"[speculate bench {time.perf_counter() - _STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Models and prompts


def export_trained(target: Training, draft: Training, path: Path, max_draft: int) -> Path:
    """The trained target and draft swapped (in place) and exported into one dynamic XNNPACK program with `verify`
    methods."""
    for training in (target, draft):
        etblocks.swap(training.model, backend="xnnpack", max_seq_len=training.shape.max_seq_len)
    with torch.no_grad():
        return etblocks.export(target.model, backend="xnnpack", out=path, max_draft=max_draft, draft=draft.model).path


def prompt_sets(corpus: Corpus, count: int, length: int, seed: int) -> dict[str, list[list[int]]]:
    """Per set, `count` texts of `length` tokens from the training text's generator (seeds apart from training's)."""
    rng = random.Random(seed + 7)
    return {key: [corpus.sample(length, rng, COPY_PROBS[key])[0][:length] for _ in range(count)] for key in SETS}


@torch.no_grad()
def reference_tokens(model: torch.nn.Module, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate()` of each prompt."""
    out = []
    for prompt in prompts:
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
    return out


# --------------------------------------------------------------------------------------------------
# Timing (in a fresh process)


class WrongProposals:
    """Proposals that are never right: the reference's next tokens, each + 1 (the sequence so far says which
    prompt and position it is; the prompt of the previous call is tried first, to keep this proposer cheap)."""

    def __init__(self, prompts: Sequence[list[int]], references: Sequence[list[int]], vocab: int) -> None:
        self.pairs = list(zip(prompts, references))
        self.vocab = vocab

    def __call__(self, history: Sequence[int], limit: int) -> list[int]:
        for index, (prompt, reference) in enumerate(self.pairs):
            if history[: len(prompt)] == prompt:
                self.pairs.insert(0, self.pairs.pop(index))
                done = len(history) - len(prompt)
                return [(t + 1) % self.vocab for t in reference[done : done + limit]]
        raise AssertionError("a sequence that starts with no prompt of the set")


@dataclass
class RowRun:
    """One row on one prompt set in one round: decode tok/s, the tokens per prompt, what speculation did."""

    tps: float
    tokens: list[list[int]]
    drafted: int = 0
    accepted: int = 0
    calls: int = 0
    generated: int = 0


def run_row(runner: etblocks.Runner, prompts: Sequence[list[int]], new_tokens: int, max_draft: int,
            speculate: Any) -> RowRun:
    """Generate every prompt (no EOS) and time the tokens after the first."""
    seconds, tokens, totals = 0.0, [], [0, 0, 0, 0]
    for prompt in prompts:
        stream = runner.stream(prompt, max_new_tokens=new_tokens, eos=[], speculate=speculate, max_draft=max_draft)
        out = [next(stream)]
        start = time.perf_counter()
        out.extend(stream)
        seconds += time.perf_counter() - start
        tokens.append(out)
        stats = runner.last_speculation
        if stats is not None:
            for i, value in enumerate((stats.drafted, stats.accepted, stats.calls, stats.tokens - 1)):
                totals[i] += value
    return RowRun(sum(len(t) - 1 for t in tokens) / seconds, tokens, *totals)


def time_rows(path: Path, prompts: dict[str, list[list[int]]], references: dict[str, list[list[int]]],
              new_tokens: int, max_draft: int, rounds: int) -> dict[str, dict[str, list[RowRun]]]:
    """Every row on every set, `rounds` times, rows rotated from round to round; one untimed run of each first."""
    runner = etblocks.Runner(path)
    runs: dict[str, dict[str, list[RowRun]]] = {s: {r: [] for r in ROWS} for s in SETS}
    for round_index in range(rounds + 1):
        for set_key in SETS:
            keys = list(ROWS)
            keys = keys[round_index % len(keys):] + keys[: round_index % len(keys)]
            for key in keys:
                speculate = {"a": None, "b": "prompt_lookup", "c": "draft",
                             "d": WrongProposals(prompts[set_key], references[set_key], runner.vocab_size)}[key]
                run = run_row(runner, prompts[set_key], new_tokens, max_draft, speculate)
                if round_index:  # the first is the warm-up
                    runs[set_key][key].append(run)
    return runs


def call_costs(paths: dict[str, Path], max_verify: int, position: int, calls: int,
               rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per program, seconds per call of `forward` with one token and `verify` with 1 .. max_verify tokens, at
    `position` (the same rows rewritten), `calls` calls per figure, programs and lengths interleaved per round."""
    from etblocks.export.runner import run_method
    from etblocks.export.speculate import VERIFY_METHOD
    from etblocks.ops import load_kernels

    load_kernels()
    programs = {name: load_runtime_program(path) for name, path in paths.items()}
    methods = {name: {"forward": p.load_method("forward"), VERIFY_METHOD: p.load_method(VERIFY_METHOD)}
               for name, p in programs.items()}
    columns = ["forward", *(f"verify {t}" for t in range(1, max_verify + 1))]
    seconds: dict[str, dict[str, list[float]]] = {name: {c: [] for c in columns} for name in paths}
    pos = torch.tensor([position], dtype=torch.long)
    for round_index in range(rounds + 1):
        for name, method in methods.items():
            for column in columns:
                length = 1 if column == "forward" else int(column.split()[1])
                call = method["forward" if column == "forward" else VERIFY_METHOD]
                tokens = torch.ones(1, length, dtype=torch.long)
                start = time.perf_counter()
                for _ in range(calls):
                    run_method(call, [tokens, pos])
                if round_index:
                    seconds[name][column].append((time.perf_counter() - start) / calls)
    return seconds


def export_cost_model(shape_name: str, out_dir: Path, max_draft: int, seed: int) -> Path:
    """A random-weight transformers Llama of the named shape, swapped and exported like the trained model."""
    shape = dataclasses.replace(SHAPES[shape_name], max_seq_len=TRAINED_SHAPE.max_seq_len * 2)
    model = build_hf_model(Bench(shape, [], 0, 0, out_dir, seed, 0.02))
    etblocks.swap(model, backend="xnnpack", max_seq_len=shape.max_seq_len)
    with torch.no_grad():
        return etblocks.export(model, backend="xnnpack", out=out_dir / f"cost_{shape_name}.pte", max_draft=max_draft).path


def time_everything(path: Path, cost_paths: dict[str, Path], prompts: dict[str, list[list[int]]],
                    references: dict[str, list[list[int]]], args: argparse.Namespace) -> tuple[Any, Any]:
    """The fresh process's work: the rows (as dictionaries: this module is `__mp_main__` there), then the call
    costs."""
    runs = time_rows(path, prompts, references, args.new_tokens, args.max_draft, args.rounds)
    costs = call_costs(cost_paths, args.max_draft + 1, args.prompt_len, args.cost_calls, args.rounds)
    return {s: {r: [dataclasses.asdict(run) for run in row_runs] for r, row_runs in set_runs.items()}
            for s, set_runs in runs.items()}, costs


# --------------------------------------------------------------------------------------------------
# Tables


def speed_up(runs: dict[str, dict[str, list[RowRun]]], set_key: str, key: str) -> float:
    """Row `key`'s decode speed over plain decoding's on one prompt set: the median of per-round ratios."""
    return paired_median([r.tps for r in runs[set_key][key]], [r.tps for r in runs[set_key]["a"]])


def speed_table(runs: dict[str, dict[str, list[RowRun]]], prompt_count: int, new_tokens: int) -> str:
    headers = ["prompts", "row", "decode tok/s", "speed-up", "proposed", "kept", "acceptance", "tokens/call"]
    lines = []
    for set_key, name in SETS.items():
        for key, row_name in ROWS.items():
            row_runs = runs[set_key][key]
            tps = [r.tps for r in row_runs]
            first = row_runs[0]
            speculative = key != "a"
            lines.append([
                f"({set_key}) {name}", f"({key}) {row_name}", spread(tps, ".0f"),
                f"{speed_up(runs, set_key, key):.2f}x",
                str(first.drafted) if speculative else "-", str(first.accepted) if speculative else "-",
                f"{first.accepted / first.drafted:.0%}" if speculative and first.drafted else "-",
                f"{first.generated / first.calls:.2f}" if speculative and first.calls else "1.00",
            ])
    title = (f"decode tok/s of {prompt_count} prompts per set, {new_tokens} new tokens each (greedy), medians "
             "[min-max]; speed-up: median of per-round ratios to (a); proposed / kept: tokens over the set")
    return f"{title}\n{aligned_table(headers, lines)}"


def cost_table(costs: dict[str, dict[str, list[float]]], labels: dict[str, str]) -> str:
    columns = list(next(iter(costs.values())))
    headers = ["program", "forward 1 token ms", *(c + " / forward" for c in columns[1:])]
    lines = []
    for name, seconds in costs.items():
        base = statistics.median(seconds["forward"])
        lines.append([labels[name], spread([s * 1e3 for s in seconds["forward"]], ".2f"),
                      *(f"{statistics.median(seconds[c]) / base:.2f}" for c in columns[1:])])
    return ("one call's time by the tokens it takes, relative to forward with one token (medians)\n"
            + aligned_table(headers, lines))


def target_lines(runs: dict[str, dict[str, list[RowRun]]]) -> str:
    out = ["targets (row (b), prompt lookup; median of per-round ratios to (a)):"]
    for set_key, goal in TARGETS.items():
        ratio = speed_up(runs, set_key, "b")
        verdict = "PASS" if ratio >= goal else "FAIL"
        out.append(f"  {verdict}  ({set_key}) {SETS[set_key]}: {ratio:.2f}x (goal >= {goal}x)")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# Main

SMOKE = {"train_steps": 5, "layers": 1, "prompts": 2, "prompt_len": 16, "new_tokens": 8, "rounds": 1,
         "max_seq_len": 64, "cost_shape": "none", "cost_calls": 2}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=300, help="AdamW steps of each model")
    parser.add_argument("--layers", type=int, default=TRAINED_SHAPE.layers, help="the target's layers")
    parser.add_argument("--draft-layers", type=int, default=1, help="the draft model's layers")
    parser.add_argument("--max-seq-len", type=int, default=256, help="context of training and of the programs")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
    parser.add_argument("--prompt-len", type=int, default=96, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--max-draft", type=int, default=4, help="tokens proposed per call at most")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one untimed before)")
    parser.add_argument("--cost-shape", choices=["none", *SHAPES], default="smollm2-135m",
                        help="a random-weight shape whose call costs are measured too ('none': only the trained model)")
    parser.add_argument("--cost-calls", type=int, default=20, help="calls per call-cost figure and round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None, help="where the programs go (default: a temp dir)")
    add_run_args(parser, "speculate", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    if args.prompt_len + args.new_tokens > args.max_seq_len:
        parser.error(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceed --max-seq-len "
                     f"{args.max_seq_len}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="etblocks_speculate_bench_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = dataclasses.replace(TRAINED_SHAPE, layers=args.layers, max_seq_len=args.max_seq_len)

    trained: dict[str, Training] = {}
    for name, layers in (("target", args.layers), ("draft", args.draft_layers)):
        log(f"training the {name} ({layers} layers, {args.train_steps} steps)")
        trained[name] = train_model(dataclasses.replace(shape, layers=layers), args.train_steps, 16, args.seed)
    prompts = prompt_sets(trained["target"].corpus, args.prompts, args.prompt_len, args.seed)
    references = {key: reference_tokens(trained["target"].model, ps, args.new_tokens) for key, ps in prompts.items()}
    descriptions = {name: t.describe() for name, t in trained.items()}
    path = export_trained(trained["target"], trained["draft"], out_dir / "speculate.pte", args.max_draft)
    cost_paths = {"trained": path}
    labels = {"trained": f"trained target ({args.layers} layers, hidden {shape.hidden}, vocab {shape.vocab})"}
    if args.cost_shape != "none":
        log(f"exporting the {args.cost_shape} shape for the call costs")
        cost_paths[args.cost_shape] = export_cost_model(args.cost_shape, out_dir, args.max_draft, args.seed)
        labels[args.cost_shape] = f"{SHAPES[args.cost_shape].name} shape, random weights"
    del trained
    gc.collect()

    log("timing in a fresh process")
    run_dicts, costs = in_fresh_process(time_everything, path, cost_paths, prompts, references, args)
    runs = {s: {r: [RowRun(**run) for run in row_runs] for r, row_runs in set_runs.items()}
            for s, set_runs in run_dicts.items()}

    checks = Checks()
    for set_key in SETS:
        expected = [t for tokens in references[set_key] for t in tokens]
        for key in ROWS:  # every round's tokens; the check of the first round that disagrees, else the last
            rounds = [check_tokens(key, [t for tokens in run.tokens for t in tokens], expected,
                                   f"transformers generate ({set_key})") for run in runs[set_key][key]]
            checks.add(next((check for check in rounds if not check.ok), rounds[-1]))

    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    header = "\n".join([
        f"Speculative decoding, dynamic XNNPACK programs with max_draft {args.max_draft}; {_threadpool_get_thread_count()} "
        f"ExecuTorch threads; {args.rounds} rounds",
        describe_cpu(),
        f"timing process: MKL_NUM_THREADS={timing_mkl_threads()} (ExecuTorch's attention kernel calls torch's "
        "MKL from inside its own thread pool; see etblocks/threads.py)",
        f"target: {descriptions['target']}",
        f"draft: {descriptions['draft']}",
    ])
    speed = speed_table(runs, args.prompts, args.new_tokens)
    targets = target_lines(runs)
    costs_text = cost_table(costs, labels)
    for text in (header, speed, targets, costs_text):
        print("\n" + text)

    records = {set_key: {key: {"name": ROWS[key], "decode_tps": spread_record([r.tps for r in row_runs]),
                               "speed_up": speed_up(runs, set_key, key),
                               "drafted": row_runs[0].drafted, "accepted": row_runs[0].accepted,
                               "calls": row_runs[0].calls, "generated": row_runs[0].generated}
                         for key, row_runs in set_runs.items()} for set_key, set_runs in runs.items()}
    cost_records = {name: {column: spread_record([s * 1e3 for s in values]) for column, values in seconds.items()}
                    for name, seconds in costs.items()}
    return finish("speculate", args, checks, {"speed": "\n".join([header, speed, targets]), "call costs": costs_text},
                  started, models=descriptions, prompts=prompts, reference_tokens=references, rows=records,
                  call_costs_ms=cost_records)


if __name__ == "__main__":
    sys.exit(main())
