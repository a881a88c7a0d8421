"""MoE decode cost against the number of experts: etblocks' gather and dense strategies vs transformers' export.

A small random Qwen3-MoE model (4 layers, hidden 256, expert intermediate 512, vocab 1024, top-2 routing, fp32) is
built with each `--experts` count and exported three ways to XNNPACK: `gather` (swap(moe="gather"): each token reads
its top-k experts), `dense` (swap(moe="dense"): every expert on every token) and transformers' own export
(`batched_mm` experts, `TorchExportableModuleForDecoderOnlyLM`). Every program's first greedy tokens must equal
transformers' `generate()` on the same model before it is timed; one that disagrees is not timed and the script
exits 1. Decode is a T=1 step at a fixed position after a 16-token prefill, fed a seeded token stream (routing
changes every step); programs are timed in `--rounds` interleaved rounds in a fresh process
(`harness.in_fresh_process`: loaded anew from their files, MKL on one thread); cells are medians [min-max] of each
round's median ms per step, ratios medians of per-round ratios. Ends with PASS/FAIL on the gather strategy's growth
from the fewest to the most experts (< 1.3x) and what each program leaves on CPU. Results:
benchmarks/results/moe.json.

    python benchmarks/moe.py            # 8, 16, 32, 64 experts
    python benchmarks/moe.py --quick    # 8 and 64 experts, 20 steps, 2 rounds
    python benchmarks/moe.py --smoke    # 4 experts, 1 layer, 1 round
"""

from __future__ import annotations

import argparse
import copy
import gc
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Deferred,
    Checks,
    TokensPosDriver,
    add_run_args,
    aligned_table,
    check_tokens,
    finish,
    in_fresh_process,
    lower_to_xnnpack,
    matching_prefix,
    paired_median,
    parse_with_smoke,
    pte_megabytes,
    spread,
    spread_record,
    timing_mkl_threads,
)

STRATEGIES = ("gather", "dense")
PATHS = (*STRATEGIES, "transformers")
GROWTH_LIMIT = 1.3  # the gather strategy's decode cost may grow by less than this from the fewest to the most experts


@dataclass(frozen=True)
class Shape:
    """The model shape (everything but the number of experts) and the benchmark's sequence settings."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    expert_intermediate: int = 512
    vocab: int = 1024
    top_k: int = 2
    prompt_len: int = 16
    check_tokens: int = 8
    max_seq_len: int = 64


@dataclass
class Program:
    """One exported program (or why there is none), its greedy check and its timings."""

    path: str
    experts: int
    status: str = "ok"
    driver: TokensPosDriver | None = None
    export_s: float | None = None
    pte_mb: float | None = None
    delegation: Any = None  # etblocks.export.delegation.DelegationSummary
    tokens: list[int] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)  # median ms per decode step, one per round

    @property
    def ms(self) -> float | None:
        return statistics.median(self.round_ms) if self.round_ms else None


def build_model(shape: Shape, n_experts: int, seed: int = 0) -> torch.nn.Module:
    """A random Qwen3-MoE causal LM, every layer sparse, fp32, eval; same seed for every expert count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.expert_intermediate,
        moe_intermediate_size=shape.expert_intermediate,
        num_experts=n_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4 * shape.max_seq_len,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,  # greedy runs always produce every token
        initializer_range=0.1,  # the 0.02 default makes tiny random models repeat one token
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(torch.float32).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def export_etblocks(model: torch.nn.Module, strategy: str, shape: Shape, out: Path, program: Program) -> None:
    """Swap attention and MoE blocks (in place) and export `forward(tokens [1,T], input_pos [1])`."""
    import etblocks

    with torch.no_grad():
        etblocks.swap(model, backend="xnnpack", max_seq_len=shape.max_seq_len, moe=strategy)
        result = etblocks.export(model, backend="xnnpack", out=out)
    program.delegation = result.delegation
    program.driver = TokensPosDriver(Path(result.path))


def export_transformers(model: torch.nn.Module, shape: Shape, out: Path, program: Program) -> None:
    """transformers' static-cache export with `batched_mm` experts, lowered to XNNPACK."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from etblocks.export.delegation import summarize

    model.set_experts_implementation("batched_mm")
    model.generation_config.cache_implementation = "static"
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=shape.max_seq_len)
    with torch.no_grad():
        exported = wrapper.export(
            input_ids=torch.tensor([[1]], dtype=torch.long),
            cache_position=torch.tensor([0], dtype=torch.long),
            strict=True,
        )
        program.delegation = lower_to_xnnpack(
            exported, out, inspect=lambda edge: summarize(edge.exported_program().graph_module)
        )
    program.driver = TokensPosDriver(out, token_by_token=True)  # static [1,1] shapes: prefill token by token


def greedy(driver: TokensPosDriver, prompt: list[int], n: int) -> list[int]:
    """The prefill's next token, then greedy decode: `n` tokens."""
    tokens = [driver.prefill(prompt)]
    while len(tokens) < n:
        tokens.append(driver.decode(tokens[-1], len(prompt) + len(tokens) - 1))
    return tokens


def prepare(path: str, n_experts: int, base: torch.nn.Module, shape: Shape, prompt: list[int],
            reference: list[int], out_dir: Path) -> Program:
    """Export, load and check one program; a failure becomes the program's status."""
    print(f"[moe bench] {n_experts} experts, {path}: export ...", file=sys.stderr, flush=True)
    program = Program(path, n_experts)
    out = out_dir / f"{path}_{n_experts}.pte"
    start = time.perf_counter()
    model = None
    try:
        model = copy.deepcopy(base)
        if path == "transformers":
            export_transformers(model, shape, out, program)
        else:
            export_etblocks(model, path, shape, out, program)
        program.export_s = time.perf_counter() - start
        program.pte_mb = pte_megabytes(out)
        program.tokens = greedy(program.driver, prompt, len(reference))
    except Exception as e:  # one broken program must not hide the others
        traceback.print_exc()
        program.status = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
        program.driver = None
    del model
    gc.collect()
    print(f"[moe bench] {n_experts} experts, {path}: {program.status} ({time.perf_counter() - start:.0f} s)",
          file=sys.stderr, flush=True)
    return program


def time_round(driver: TokensPosDriver, prompt: list[int], stream: list[int], warmup: int) -> float:
    """Re-prefill, then T=1 steps at the fixed position `len(prompt)` feeding `stream`; median ms of the timed
    steps (all but the first `warmup`)."""
    pos = len(prompt)
    driver.prefill(prompt)
    times = []
    for token in stream:
        start = time.perf_counter()
        driver.decode(token, pos)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[warmup:])


def time_rounds(drivers: dict[tuple[int, str], TokensPosDriver], prompt: list[int], stream: list[int], warmup: int,
                rounds: int) -> dict[tuple[int, str], list[float] | str]:
    """Every program in `rounds` interleaved rounds (`time_round`), run by `harness.in_fresh_process`: the drivers
    arrive there from `harness.Deferred` constructor calls and load their programs anew from their files, away from
    the exports; per program its ms per round, or why timing it failed."""
    results: dict[tuple[int, str], list[float] | str] = {key: [] for key in drivers}
    for r in range(rounds):
        for (e, path), driver in drivers.items():
            if isinstance(results[e, path], str):
                continue
            try:
                results[e, path].append(time_round(driver, prompt, stream, warmup))
            except Exception as ex:
                traceback.print_exc()
                results[e, path] = f"failed while timing: {type(ex).__name__}"
                continue
            print(f"[moe bench] round {r + 1}/{rounds}, {e} experts, {path}: {results[e, path][-1]:.2f} ms",
                  file=sys.stderr, flush=True)
    return results


def paired(a: Program | None, b: Program | None) -> float | None:
    """Median over rounds of a's ms / b's ms (rounds run the programs back to back, under the same load)."""
    return paired_median(a.round_ms, b.round_ms) if a is not None and b is not None else None


def format_table(programs: dict[tuple[int, str], Program], experts: list[int]) -> str:
    headers = ["experts", "etblocks gather ms", "etblocks dense ms", "transformers ms", "gather/transformers",
               "dense/transformers"]
    rows = []
    for e in experts:
        cells = [str(e)]
        for path in PATHS:
            p = programs[e, path]
            cells.append(spread(p.round_ms, ".2f") if p.round_ms else p.status)
        tf = programs[e, "transformers"]
        for strategy in STRATEGIES:
            ratio = paired(programs[e, strategy], tf)
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        rows.append(cells)
    first = experts[0]
    for e in experts[1:]:
        cells = [f"growth {first}->{e}"]
        for path in PATHS:
            ratio = paired(programs[e, path], programs[first, path])
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        rows.append(cells + ["", ""])
    return aligned_table(headers, rows)


SMOKE = {"experts": "4", "layers": 1, "steps": 4, "warmup": 1, "rounds": 1}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 and 64 experts, 20 steps, 2 rounds")
    parser.add_argument("--experts", default=None, help="comma-separated expert counts (default 8,16,32,64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per round (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed decode steps per round")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the .pte files go (kept); default: a temp dir, deleted at the end")
    add_run_args(parser, "moe", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    args.experts = [int(e) for e in (args.experts or ("8,64" if args.quick else "8,16,32,64")).split(",")]
    args.steps = args.steps or (20 if args.quick else 40)
    args.rounds = args.rounds or (2 if args.quick else 3)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shape = Shape(layers=args.layers)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(3, shape.vocab, (shape.prompt_len,), generator=generator).tolist()
    stream = torch.randint(3, shape.vocab, (args.warmup + args.steps,), generator=generator).tolist()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="etblocks_moe_bench_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    programs: dict[tuple[int, str], Program] = {}
    references: dict[int, list[int]] = {}
    checks = Checks()
    try:
        for e in args.experts:
            base = build_model(shape, e, args.seed)
            references[e] = hf_greedy(base, prompt, shape.check_tokens)
            for path in PATHS:
                program = programs[e, path] = prepare(path, e, base, shape, prompt, references[e], out_dir)
                if program.status != "ok":
                    checks.fail(f"{e} experts, {path}: {program.status}")
                    continue
                if not checks.add(check_tokens(f"{path}@{e}", program.tokens, references[e], "transformers")).ok:
                    program.status = "wrong tokens: not timed"
                    program.driver = None
            del base
            gc.collect()
        deferred = {key: Deferred(p.driver.__reduce__()) for key, p in programs.items() if p.status == "ok"}
        for p in programs.values():  # this process's loaded programs go before the timing process loads its own
            p.driver = None
        gc.collect()
        for key, result in in_fresh_process(time_rounds, deferred, prompt, stream, args.warmup, args.rounds).items():
            if isinstance(result, str):
                programs[key].status = result
                checks.fail(f"{key[0]} experts, {key[1]}: {result}")
            else:
                programs[key].round_ms = result
    finally:
        for p in programs.values():
            p.driver = None
        if args.out_dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)

    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    s = shape
    header = (f"MoE decode ms per token, Qwen3-MoE shape: {s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} "
              f"heads (head_dim {s.head_dim}), expert intermediate {s.expert_intermediate}, top-{s.top_k}, vocab "
              f"{s.vocab}, fp32, random weights (seed {args.seed}), XNNPACK\nT=1 at position {s.prompt_len} after a "
              f"{s.prompt_len}-token prefill; cells are medians of {args.rounds} interleaved rounds x {args.steps} steps "
              f"({args.warmup} warmup) [min-max]; ratios are medians of per-round ratios; torch {torch.__version__}, "
              f"{_threadpool_get_thread_count()} ExecuTorch threads, timed in a fresh process with MKL on "
              f"{timing_mkl_threads()} thread(s)\n")
    table = format_table(programs, args.experts)
    print("\n" + header)
    print(table)

    greedy_lines = [f"greedy check: first {s.check_tokens} tokens vs transformers generate() on the same model"]
    for e in args.experts:
        cells = []
        for path in PATHS:
            p = programs[e, path]
            n = matching_prefix(p.tokens, references[e])
            cells.append(f"{path} {n}/{len(references[e])}" if p.tokens else f"{path} -")
        greedy_lines.append(f"  {e:>3} experts: " + ", ".join(cells))
    print("\n" + "\n".join(greedy_lines))

    export_lines = ["export+lower s / .pte MB"]
    for e in args.experts:
        cells = [f"{path} {_num(programs[e, path].export_s, '.0f')} s / {_num(programs[e, path].pte_mb, '.0f')} MB"
                 for path in PATHS]
        export_lines.append(f"  {e:>3} experts: " + ", ".join(cells))
    print("\n" + "\n".join(export_lines))

    delegation_lines = ["delegation (XNNPACK partitions and ops left on the portable CPU kernels):"]
    for path in PATHS:
        seen: dict[str, list[int]] = {}
        for e in args.experts:
            p = programs[e, path]
            if p.delegation is not None:
                seen.setdefault(str(p.delegation), []).append(e)
        for text, es in seen.items():
            delegation_lines.append(f"  {path} ({', '.join(map(str, es))} experts): {text}")
    print("\n" + "\n".join(delegation_lines))

    first, last = args.experts[0], args.experts[-1]
    growth = paired(programs[last, "gather"], programs[first, "gather"])
    if first == last:
        verdict = "  n/a   etblocks gather decode growth (needs at least two expert counts)"
    elif growth is None:
        verdict = f"  n/a   etblocks gather decode growth {first}->{last} experts (no timings)"
    else:
        verdict = (f"  {'PASS' if growth < GROWTH_LIMIT else 'FAIL'}  etblocks gather decode growth {first}->{last} "
                   f"experts: {growth:.2f}x (goal < {GROWTH_LIMIT}x)")
    print("\nrequirement:\n" + verdict)
    records = [{"experts": e, "path": path, "status": p.status, "export_s": p.export_s, "pte_mb": p.pte_mb,
                "delegation": None if p.delegation is None else str(p.delegation), "tokens": p.tokens,
                "timings": {"decode_ms": spread_record(p.round_ms)}} for (e, path), p in programs.items()]
    tables = {"moe": "\n".join([header, table, "", *greedy_lines, "", *export_lines, "", *delegation_lines, "",
                                 "requirement:", verdict])}
    return finish("moe", args, checks, tables, start, prompt=prompt, stream=stream, reference_tokens=references,
                  gather_growth=growth, rows=records)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
