"""Where a 4-bit decode step's time goes: etblocks' 8da4w program beside ExecuTorch's own, with ETDump.

Rows, the SmolLM2-135M-shape Llama with the same random weights, 8da4w in groups of 32: (a) etblocks (swap + export
with `quantize_weights="8da4w"`), (b) ExecuTorch's llama example as export_llama_lib exports it with `-qmode 8da4w`
(`harness.export_llama_example`). First decode.py's speed table (fresh process, interleaved rounds, medians
[min-max], roofline from the bytes a step reads); each of a row's greedy tokens must be among the `--top-k` of
the transformers model, its weights quantized as the row quantizes them (`harness.quantized_reference`: etblocks'
torchao configs for (a), ExecuTorch's `quantize()` for (b)) and fed the row's earlier tokens (`harness.check_ranks`),
or the script exits 1. Then each program runs `--profile-steps` decode steps with ETDump, in a fresh process of its
own as the timed rounds do, and the mean step is split into XNNPACK operators, delegate call overhead, CPU
operators, the rest of `Method::execute`, and Python. Profiling adds time to every event it records, so the split
overstates the small per-call items; step_breakdown.py times the parts unprofiled. Results:
benchmarks/results/decode_profile.json.

    python benchmarks/decode_profile.py            # 30 layers
    python benchmarks/decode_profile.py --smoke    # 1 layer, 1 round, 2 profiled steps
"""

from __future__ import annotations

import collections
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    GROUP_SIZE,
    Bench,
    Checks,
    Driver,
    Option,
    PathSpec,
    Row,
    TokensPosDriver,
    add_run_args,
    aligned_table,
    argument_parser,
    build_hf_model,
    bytes_per_token,
    check_each_row,
    check_ranks,
    describe_run,
    eager_reference_tokens,
    export_llama_example,
    export_with_etblocks,
    finish,
    format_table,
    in_fresh_process,
    make_bench,
    parse_with_smoke,
    quantized_reference,
    prepare_path,
    row_record,
    select_paths,
    spread_record,
    time_in_fresh_process,
)

OPTION = Option("e", "8da4w", quantize="8da4w")  # quant.py's row (e): its bytes per step
FILES = {"a": "a_etblocks_8da4w.pte", "b": "b_llama_example_8da4w.pte"}
SCHEMES = {"a": "etblocks", "b": "example"}  # how each row quantizes its weights (`harness.quantized_reference`)
CPU_EVENT_PREFIXES = ("native_call_", "llama::", "quantized_decomposed::")
RUNTIME_EVENTS = {"Method::execute", "DELEGATE_CALL", "OPERATOR_CALL"}


def path_etblocks_8da4w(bench: Bench, row: Row) -> Driver:
    driver, _ = export_with_etblocks(bench, row, build_hf_model, FILES["a"],
                                     export_options=OPTION.export_options())
    return driver


def path_llama_example_8da4w(bench: Bench, row: Row) -> Driver:
    return export_llama_example(bench, row, FILES["b"], quantize="8da4w", group_size=GROUP_SIZE)


PATHS = [PathSpec("a", "etblocks 8da4w", path_etblocks_8da4w),
         PathSpec("b", "ExecuTorch llama example 8da4w", path_llama_example_8da4w)]


@dataclass
class StepProfile:
    """Mean milliseconds per profiled decode step, by where they went (see the module docstring)."""

    python_step: float
    execute: float
    xnnpack_ops: float
    delegate_calls: float
    delegates_per_step: int
    cpu_ops: dict[str, float]

    @property
    def delegate_overhead(self) -> float:
        return self.delegate_calls - self.xnnpack_ops

    @property
    def execute_other(self) -> float:
        return self.execute - self.delegate_calls - sum(self.cpu_ops.values())


def profile_decode(path: Path, bench: Bench, steps: int) -> StepProfile:
    """Prefill the prompt, decode `steps` tokens untimed (warm-up), then `steps` timed ones with ETDump on, and
    average the timed steps' events. Run in a fresh process (`in_fresh_process`), as the timed rounds are: in the
    process that exported the programs, torch's MKL runs on every core, and `llama::custom_sdpa`, which calls it
    from inside ExecuTorch's own thread pool, takes several times as long there."""
    from executorch.devtools import Inspector

    driver = TokensPosDriver(path, enable_etdump=True, debug_buffer_size=0)
    token = driver.prefill(bench.prompt)
    python_ms = []
    for i in range(2 * steps):
        start = time.perf_counter()
        token = driver.decode(token, len(bench.prompt) + i)
        python_ms.append((time.perf_counter() - start) * 1e3)
    python_ms = python_ms[steps:]
    etdump = path.with_suffix(".etdp")
    driver.method.etblocks_program.write_etdump_result_to_file(str(etdump), str(path.with_suffix(".debug")))
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for block in Inspector(etdump_path=str(etdump)).event_blocks:
        for event in block.events:
            if event.perf_data is None or block.name == "Default":  # "Default": load_method and init
                continue
            raw = event.perf_data.raw  # one entry per occurrence, in order: the prefill's, then each step's
            per_call = len(raw) // (2 * steps + 1)
            decode_times = raw[len(raw) - per_call * steps :]
            totals[event.name] += sum(decode_times) / steps
            counts[event.name] += per_call
    xnnpack = sum(ms for name, ms in totals.items()
                  if name not in RUNTIME_EVENTS and not name.startswith(CPU_EVENT_PREFIXES))
    cpu = {name: ms for name, ms in totals.items() if name.startswith(CPU_EVENT_PREFIXES)}
    return StepProfile(statistics.mean(python_ms), totals["Method::execute"], xnnpack, totals["DELEGATE_CALL"],
                       counts["DELEGATE_CALL"], cpu)


def format_profiles(profiles: dict[str, StepProfile], names: dict[str, str], weight_ms: float) -> str:
    """One column per row: ms per decode step and each part's share of the Python step."""
    def cell(profile: StepProfile, ms: float) -> str:
        return f"{ms:.3f} ({100 * ms / profile.python_step:.0f}%)"

    top_cpu = sorted({n for p in profiles.values() for n in p.cpu_ops},
                     key=lambda n: -max(p.cpu_ops.get(n, 0.0) for p in profiles.values()))[:3]
    lines = [["Python step (decode call)", *(f"{p.python_step:.3f}" for p in profiles.values())],
             ["  Method::execute", *(cell(p, p.execute) for p in profiles.values())],
             ["    XNNPACK operators", *(cell(p, p.xnnpack_ops) for p in profiles.values())],
             ["    delegate call overhead", *(cell(p, p.delegate_overhead) for p in profiles.values())],
             ["    delegate calls per step", *(f"{p.delegates_per_step:.0f}" for p in profiles.values())],
             ["    CPU operators", *(cell(p, sum(p.cpu_ops.values())) for p in profiles.values())]]
    lines += [[f"      {name}", *(cell(p, p.cpu_ops.get(name, 0.0)) for p in profiles.values())] for name in top_cpu]
    lines += [["    Method::execute other", *(cell(p, p.execute_other) for p in profiles.values())],
              ["  Python and pybind", *(cell(p, p.python_step - p.execute) for p in profiles.values())],
              ["weights at the roofline bandwidth", *(cell(p, weight_ms) for p in profiles.values())]]
    return aligned_table(["ms per decode step", *(f"({k}) {names[k]}" for k in profiles)], lines)


SMOKE = {"shape": "tiny", "layers": 1, "rounds": 1, "profile_steps": 2, "decode_steps": 4, "prompt_len": 8, "max_seq_len": 32}


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argument_parser(PATHS, __doc__)
    parser.add_argument("--profile-steps", type=int, default=32, help="decode steps recorded with ETDump")
    parser.add_argument("--top-k", type=int, default=10,
                        help="each of a row's greedy tokens must be among its eager reference's top k, fed the row's "
                             "earlier tokens (rounding moves near-ties of random weights' flat logits a few places; "
                             "a broken program's tokens rank far down)")
    add_run_args(parser, "decode_profile", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    bench = make_bench(args)
    try:
        specs = select_paths(args.rows, PATHS)
        models = {spec.key: quantized_reference(build_hf_model(bench), SCHEMES[spec.key], OPTION.quantize)
                  for spec in specs}
        reference = {key: eager_reference_tokens(bench, lambda b, model=model: model) for key, model in models.items()}
        step_bytes = bytes_per_token(bench, OPTION)
        prepared = [prepare_path(spec, bench) for spec in specs]
        rows, bandwidths = time_in_fresh_process(prepared, bench, warm_prefill=True)
        bandwidth = statistics.median(bandwidths)
        header = describe_run("8da4w decode: etblocks and ExecuTorch's llama example, XNNPACK", bench, bandwidths)
        header += f"roofline: that bandwidth / {step_bytes / 1e6:.1f} MB read per decode step (quant.py's count)\n"
        table = format_table(rows, bandwidth / step_bytes, reference, reference_label="eager")
        note = ("tokens=eager: leading greedy tokens equal to the transformers model's, its weights quantized as the "
                "row's; XNNPACK's dynamic int8 activations round differently from torchao's eager ones and random "
                "weights give flat distributions (quant.py measures accuracy on a trained model), so the check "
                f"is that model's rank of each of the row's tokens, fed the row's earlier ones: each < {args.top_k}")
        print(header)
        print(table)
        print(note)
        checks = Checks()
        check_each_row(checks, rows, lambda row: check_ranks(row.key, row.tokens, models[row.key], bench.prompt,
                                                             args.top_k))
        profiles = {row.key: in_fresh_process(profile_decode, bench.out_dir / FILES[row.key], bench,
                                              args.profile_steps) for row in rows if row.status == "ok"}
        profile_title = (f"ETDump of {args.profile_steps} decode steps (after the prompt and {args.profile_steps} "
                         "untimed steps), mean ms per step (share of the Python step):")
        profile_table = format_profiles(profiles, {row.key: row.name for row in rows}, step_bytes / bandwidth * 1e3)
        print("\n" + profile_title)
        print(profile_table)
    finally:
        if args.out_dir is None:
            shutil.rmtree(bench.out_dir, ignore_errors=True)
    return finish("decode_profile", args, checks,
                  {"speed": "\n".join([header.strip(), table, note]), "profile": f"{profile_title}\n{profile_table}"},
                  started, shape=vars(bench.shape), reference_tokens=reference, bytes_per_step=step_bytes,
                  bandwidths_gbs=spread_record([b / 1e9 for b in bandwidths]), rows=[row_record(r) for r in rows],
                  profiles={key: {**vars(p), "delegate_overhead": p.delegate_overhead,
                                  "execute_other": p.execute_other} for key, p in profiles.items()})


if __name__ == "__main__":
    sys.exit(main())
