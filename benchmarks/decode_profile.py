"""Where a decode step's and a prefill's time go: etblocks' program beside ExecuTorch's own, with ETDump.

Rows, the SmolLM2-135M-shape Llama with the same random weights: (a) etblocks 8da4w in groups of 32 (swap + export
with `quantize_weights="8da4w"`), (b) ExecuTorch's llama example as export_llama_lib exports it with `-qmode 8da4w`
(`harness.export_llama_example`); (c) and (d), not run unless asked, the same two in fp32. First decode.py's speed
table (fresh process, interleaved rounds, medians [min-max], roofline from the bytes a step reads). The fp32 rows'
greedy tokens must equal eager transformers'; each of an 8da4w row's must be among the `--top-k` of the
transformers model, its weights quantized as the row quantizes them (`harness.quantized_reference`: etblocks'
torchao configs for (a), ExecuTorch's `quantize()` for (b)) and fed the row's earlier tokens (`harness.check_ranks`);
else the script exits 1. Then each program, in a fresh process of its own as the timed rounds are, prefills the
prompt `--profile-steps` times and decodes `--profile-steps` steps with ETDump (each after as many untimed), and
the mean prefill call and decode step are split into XNNPACK operators (of which linears, XNNPACK's fully connected
operators), delegate call overhead, CPU operators, the rest of `Method::execute`, and Python. Profiling adds time to
every event it records, so the split overstates the small per-call items; step_breakdown.py times the parts
unprofiled. Results: benchmarks/results/decode_profile.json.

    python benchmarks/decode_profile.py                # 8da4w, 30 layers
    python benchmarks/decode_profile.py --rows c,d     # fp32
    python benchmarks/decode_profile.py --smoke        # 1 layer, 1 round, 2 profiled calls each
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
    check_tokens,
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

EIGHT_DA4W = Option("e", "8da4w", quantize="8da4w")  # quant.py's row (e)
FP32 = Option("a", "fp32")  # quant.py's row (a)


@dataclass(frozen=True)
class ProfiledRow:
    """What a row exports and how its tokens are checked: `scheme` is how it quantizes its weights
    (`harness.quantized_reference`), `file` its program."""

    option: Option
    scheme: str
    file: str


ROWS = {"a": ProfiledRow(EIGHT_DA4W, "etblocks", "a_etblocks_8da4w.pte"),
        "b": ProfiledRow(EIGHT_DA4W, "example", "b_llama_example_8da4w.pte"),
        "c": ProfiledRow(FP32, "etblocks", "c_etblocks_fp32.pte"),
        "d": ProfiledRow(FP32, "example", "d_llama_example_fp32.pte")}
CPU_EVENT_PREFIXES = ("native_call_", "llama::", "quantized_decomposed::")
RUNTIME_EVENTS = {"Method::execute", "DELEGATE_CALL", "OPERATOR_CALL"}
LINEAR_EVENT_PREFIX = "Fully Connected"  # XNNPACK's name for its linear operators (fp32 and quantized alike)
PHASES = {"prefill": "prefills", "decode": "decode steps"}  # what a profiled call is, by phase


def path_etblocks(bench: Bench, row: Row) -> Driver:
    driver, _ = export_with_etblocks(bench, row, build_hf_model, ROWS[row.key].file,
                                     export_options=ROWS[row.key].option.export_options())
    return driver


def path_llama_example(bench: Bench, row: Row) -> Driver:
    quantize = ROWS[row.key].option.quantize
    return export_llama_example(bench, row, ROWS[row.key].file, quantize=quantize,
                                group_size=GROUP_SIZE if quantize else None)


PATHS = [PathSpec("a", "etblocks 8da4w", path_etblocks),
         PathSpec("b", "ExecuTorch llama example 8da4w", path_llama_example),
         PathSpec("c", "etblocks fp32", path_etblocks, default=False),
         PathSpec("d", "ExecuTorch llama example fp32", path_llama_example, default=False)]


@dataclass
class CallProfile:
    """Mean milliseconds per profiled call (a prefill or a decode step), by where they went (see the module
    docstring)."""

    python_call: float
    execute: float
    xnnpack_ops: float
    linears: float
    delegate_calls: float
    delegates_per_call: int
    cpu_ops: dict[str, float]

    @property
    def delegate_overhead(self) -> float:
        return self.delegate_calls - self.xnnpack_ops

    @property
    def execute_other(self) -> float:
        return self.execute - self.delegate_calls - sum(self.cpu_ops.values())


def _call_profile(totals: dict[str, float], counts: collections.Counter, python_ms: list[float]) -> CallProfile:
    xnnpack = {name: ms for name, ms in totals.items()
               if name not in RUNTIME_EVENTS and not name.startswith(CPU_EVENT_PREFIXES)}
    return CallProfile(statistics.mean(python_ms), totals["Method::execute"], sum(xnnpack.values()),
                       sum(ms for name, ms in xnnpack.items() if name.startswith(LINEAR_EVENT_PREFIX)),
                       totals["DELEGATE_CALL"], counts["DELEGATE_CALL"],
                       {name: ms for name, ms in totals.items() if name.startswith(CPU_EVENT_PREFIXES)})


def profile_calls(path: Path, bench: Bench, calls: int) -> dict[str, CallProfile]:
    """Prefill the prompt 2 x `calls` times, then decode 2 x `calls` steps after it; each phase's last `calls`
    are profiled (the first are warm-up) and averaged, by phase. Every call of one program records the same events
    (the same graph runs whatever T is), in call order. Run in a fresh process (`in_fresh_process`), as the timed
    rounds are: in the process that exported the programs, torch's MKL runs on every core, and `llama::custom_sdpa`,
    which calls it from inside ExecuTorch's own thread pool, takes several times as long there."""
    from executorch.devtools import Inspector

    driver = TokensPosDriver(path, enable_etdump=True, debug_buffer_size=0)
    python_ms: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(2 * calls):
        start = time.perf_counter()
        token = driver.prefill(bench.prompt)  # rewrites the cache's first positions: every prefill starts at 0
        python_ms["prefill"].append((time.perf_counter() - start) * 1e3)
    for i in range(2 * calls):
        start = time.perf_counter()
        token = driver.decode(token, len(bench.prompt) + i)
        python_ms["decode"].append((time.perf_counter() - start) * 1e3)
    etdump = path.with_suffix(".etdp")
    driver.method.etblocks_program.write_etdump_result_to_file(str(etdump), str(path.with_suffix(".debug")))
    totals = {phase: collections.defaultdict(float) for phase in PHASES}
    counts = {phase: collections.Counter() for phase in PHASES}
    for block in Inspector(etdump_path=str(etdump)).event_blocks:
        for event in block.events:
            if event.perf_data is None or block.name == "Default":  # "Default": load_method and init
                continue
            raw = event.perf_data.raw  # one entry per occurrence, in call order
            per_call = len(raw) // (4 * calls)
            timed = {"prefill": raw[calls * per_call: 2 * calls * per_call], "decode": raw[-calls * per_call:]}
            for phase, times in timed.items():
                totals[phase][event.name] += sum(times) / calls
                counts[phase][event.name] += per_call
    return {phase: _call_profile(totals[phase], counts[phase], python_ms[phase][calls:]) for phase in PHASES}


def format_profiles(profiles: dict[str, CallProfile], names: dict[str, str], last_line: list[str]) -> str:
    """One column per row: ms per call and each part's share of the Python call; `last_line` closes the table."""
    def cell(profile: CallProfile, ms: float) -> str:
        return f"{ms:.3f} ({100 * ms / profile.python_call:.0f}%)"

    top_cpu = sorted({n for p in profiles.values() for n in p.cpu_ops},
                     key=lambda n: -max(p.cpu_ops.get(n, 0.0) for p in profiles.values()))[:3]
    lines = [["Python call", *(f"{p.python_call:.3f}" for p in profiles.values())],
             ["  Method::execute", *(cell(p, p.execute) for p in profiles.values())],
             ["    XNNPACK operators", *(cell(p, p.xnnpack_ops) for p in profiles.values())],
             ["      of which linears", *(cell(p, p.linears) for p in profiles.values())],
             ["    delegate call overhead", *(cell(p, p.delegate_overhead) for p in profiles.values())],
             ["    delegate calls per call", *(f"{p.delegates_per_call:.0f}" for p in profiles.values())],
             ["    CPU operators", *(cell(p, sum(p.cpu_ops.values())) for p in profiles.values())]]
    lines += [[f"      {name}", *(cell(p, p.cpu_ops.get(name, 0.0)) for p in profiles.values())] for name in top_cpu]
    lines += [["    Method::execute other", *(cell(p, p.execute_other) for p in profiles.values())],
              ["  Python and pybind", *(cell(p, p.python_call - p.execute) for p in profiles.values())],
              last_line]
    return aligned_table(["ms per call", *(f"({k}) {names[k]}" for k in profiles)], lines)


def prefill_gflops(bench: Bench) -> float:
    """The prefill's linear work in GFLOP: every layer's linears over the prompt, the lm_head over its last token
    (the programs return the last position's logits only)."""
    s = bench.shape
    layer = sum(out_features * in_features for out_features, in_features in s.linear_shapes())
    return 2 * (len(bench.prompt) * s.layers * layer + s.vocab * s.hidden) / 1e9


SMOKE = {"shape": "tiny", "layers": 1, "rounds": 1, "profile_steps": 2, "decode_steps": 4, "prompt_len": 8, "max_seq_len": 32}


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argument_parser(PATHS, __doc__)
    parser.add_argument("--profile-steps", type=int, default=32,
                        help="prefill calls and decode steps recorded with ETDump (each after as many untimed)")
    parser.add_argument("--top-k", type=int, default=10,
                        help="each of an 8da4w row's greedy tokens must be among its eager reference's top k, fed "
                             "the row's earlier tokens (rounding moves near-ties of random weights' flat logits a few "
                             "places; a broken program's tokens rank far down)")
    add_run_args(parser, "decode_profile", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    bench = make_bench(args)
    try:
        specs = select_paths(args.rows, PATHS)
        models = {spec.key: quantized_reference(build_hf_model(bench), ROWS[spec.key].scheme,
                                                ROWS[spec.key].option.quantize) for spec in specs}
        reference = {key: eager_reference_tokens(bench, lambda b, model=model: model) for key, model in models.items()}
        step_bytes = {spec.key: bytes_per_token(bench, ROWS[spec.key].option) for spec in specs}
        prepared = [prepare_path(spec, bench) for spec in specs]
        rows, bandwidths = time_in_fresh_process(prepared, bench, warm_prefill=True)
        bandwidth = statistics.median(bandwidths)
        header = describe_run("decode and prefill: etblocks and ExecuTorch's llama example, XNNPACK", bench, bandwidths)
        header += "roofline: that bandwidth / the MB a decode step reads (quant.py's count): " + ", ".join(
            f"({key}) {b / 1e6:.1f}" for key, b in step_bytes.items()) + "\n"
        table = format_table(rows, {key: bandwidth / b for key, b in step_bytes.items()}, reference,
                             ref_key=specs[0].key, reference_label="eager")
        note = ("tokens=eager: leading greedy tokens equal to the transformers model's, for 8da4w rows its weights "
                "quantized as the row's. fp32 rows must match every token. XNNPACK's dynamic int8 activations round "
                "differently from torchao's eager ones and random weights give flat distributions (quant.py measures "
                "accuracy on a trained model), so an 8da4w row's check is that model's rank of each of the row's "
                f"tokens, fed the row's earlier ones: each < {args.top_k}")
        print(header)
        print(table)
        print(note)
        checks = Checks()
        check_each_row(checks, rows, lambda row: (
            check_tokens(row.key, row.tokens, reference[row.key], "eager") if ROWS[row.key].option.exact
            else check_ranks(row.key, row.tokens, models[row.key], bench.prompt, args.top_k)))
        profiles = {row.key: in_fresh_process(profile_calls, bench.out_dir / ROWS[row.key].file, bench,
                                              args.profile_steps) for row in rows if row.status == "ok"}
        names = {row.key: row.name for row in rows}
        work = prefill_gflops(bench)
        titles = {phase: (f"ETDump of {args.profile_steps} {calls} (after as many untimed), mean ms per call (share "
                          f"of the Python call); {len(bench.prompt)}-token prompt") for phase, calls in PHASES.items()}
        roofline_ms = {key: step_bytes[key] / bandwidth * 1e3 for key in profiles}
        last_lines = {
            "prefill": [f"linears' GFLOP/s ({work:.2f} GFLOP a call)",
                        *(f"{work / p['prefill'].linears * 1e3:.0f}" for p in profiles.values())],
            "decode": ["weights at the roofline bandwidth",
                       *(f"{roofline_ms[key]:.3f} ({100 * roofline_ms[key] / p['decode'].python_call:.0f}%)"
                         for key, p in profiles.items())]}
        profile_tables = {phase: format_profiles({key: p[phase] for key, p in profiles.items()}, names,
                                                 last_lines[phase]) for phase in PHASES}
        for phase in PHASES:
            print(f"\n{titles[phase]}\n{profile_tables[phase]}")
    finally:
        if args.out_dir is None:
            shutil.rmtree(bench.out_dir, ignore_errors=True)
    return finish("decode_profile", args, checks,
                  {"speed": "\n".join([header.strip(), table, note]),
                   **{f"{phase} profile": f"{titles[phase]}\n{profile_tables[phase]}" for phase in PHASES}},
                  started, shape=vars(bench.shape), reference_tokens=reference, bytes_per_step=step_bytes,
                  bandwidths_gbs=spread_record([b / 1e9 for b in bandwidths]), rows=[row_record(r) for r in rows],
                  profiles={key: {phase: {**vars(p[phase]), "delegate_overhead": p[phase].delegate_overhead,
                                          "execute_other": p[phase].execute_other} for phase in PHASES}
                            for key, p in profiles.items()})


if __name__ == "__main__":
    sys.exit(main())
