"""Where a 4-bit decode step's time goes: etblocks' 8da4w program beside ExecuTorch's own, with ETDump.

Rows, both the SmolLM2-135M-shape Llama of `decode.py` (same random weights), 8da4w with groups of 32 (`quant.py`'s):

  a  etblocks 8da4w                 etblocks.swap(model, "xnnpack") + etblocks.export(quantize_weights="8da4w")
  b  ExecuTorch llama example 8da4w ExecuTorch's llama Transformer as export_llama_lib exports it with `-qmode 8da4w
                                    --group_size 32 --use_sdpa_with_kv_cache`: its `quantize()` (HQQ), custom SDPA and
                                    KV cache, XNNPACK (`decode.export_llama_example`)

First the speed table of `decode.py` (interleaved rounds, medians, ratios to (a), % of the memory roofline from the
bytes a step reads, as `quant.py` counts them for 8da4w). Then each program runs `--profile-steps` decode steps
with ETDump on (`Runtime.load_program(enable_etdump=True)`; the pip wheel records every XNNPACK operator too) and
the mean time per decode step is split into:

  XNNPACK operators       the time inside XNNPACK's operators (the GEMMs, mostly), summed over all delegates
  delegate call overhead  DELEGATE_CALL minus its operators: per call, XNNPACK's executor reshapes and sets up
                          every operator of the delegate again (so it grows with the operators, not the calls)
  CPU operators           the kernels outside the delegates (llama::custom_sdpa, update_cache, the embedding, ...)
  Method::execute other   ExecuTorch's own work between instructions
  Python and pybind       the Python step (perf_counter around the driver's decode call) minus Method::execute:
                          the input tensors, the output copy into a new tensor, the argmax

and the weights' bytes at the sampled bandwidth are printed beside it (what the step would take if it only read
them). Profiling adds time to every event it records, far more than a little: the (a) program's step took 7.7 ms
profiled and 4.2 ms timed on the same quiet host (2026-12-01). The split below therefore overstates the small
per-call items; `step_breakdown.py` times the parts unprofiled, each as a program of its own.

    python benchmarks/decode_profile.py                 # 30 layers: two exports (~6 and ~9 min), then timing
    python benchmarks/decode_profile.py --layers 2 --rounds 2 --profile-steps 4 --decode-steps 8   # smoke, ~2 min

Full default run (etblocks 434ab3a + this script, this project's 2-core machine, 17 min; read bandwidth 32.9 GB/s,
median of the rounds [31.6-34.1]; decode speed rose from round to round, 135 to 213 tok/s for (a), as it does on
this shared host):

    row                                 decode tok/s         prefill tok/s    export s  .pte MB  decode/(a)  %roof
    (a) etblocks 8da4w                  156.3 [135.3-213.2]  1083 [776-1165]       332      189       1.00x    38%
    (b) ExecuTorch llama example 8da4w  161.6 [142.8-186.3]  1013 [712-1124]       553      190       1.03x    39%

    ms per decode step (ETDump)         (a) etblocks 8da4w  (b) ExecuTorch llama example 8da4w
    Python step (decode call)                        6.088                               8.676
      Method::execute                          5.694 (94%)                         8.169 (94%)
        XNNPACK operators                      2.570 (42%)                         3.212 (37%)
        delegate call overhead                 1.671 (27%)                         2.144 (25%)
        delegate calls per step                         33                                 123
        CPU operators                          1.289 (21%)                         2.033 (23%)
          llama::custom_sdpa.out               1.127 (19%)                         1.467 (17%)
        Method::execute other                  0.163 (3%)                          0.780 (9%)
      Python and pybind                        0.394 (6%)                          0.507 (6%)
    weights at the roofline bandwidth          2.414 (40%)                         2.414 (28%)

Reading: both programs decode at the same speed. The profile's absolute split does not hold up unprofiled
(`step_breakdown.py`, 2026-12-01): the XNNPACK operators do not read the weights at ~94% of the bandwidth; the
linears alone, as one program, read them at ~83% (2.5 ms), and the rest of the step is paid per operator: the
RMSNorms add 0.55 ms (60 norms of ~6 small XNNPACK operators each) and the attention (rope, the
`llama::update_cache` writes, `llama::custom_sdpa`, one delegate per layer) 1.28 ms, ~43 us per layer. fp32 reads
6.8x the bytes for the same per-operator costs, hence its ~80% of roofline. ExecuTorch's own program makes 123
delegate calls per step (its RMSNorm's mean and some slices run on CPU) and profiles slower, but times the same
unprofiled. (The run above predates the rewrites that took 14 of the 55 operators out of every etblocks layer:
`step_breakdown.py` lists them, `quant.py` measures them.)
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

from decode import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Bench,
    Driver,
    PathSpec,
    Row,
    TokensPosDriver,
    aligned_table,
    argument_parser,
    build_hf_model,
    describe_run,
    eager_reference_tokens,
    export_llama_example,
    export_with_etblocks,
    format_table,
    make_bench,
    prepare_path,
    select_paths,
    time_in_fresh_process,
)
from quant import GROUP_SIZE, Option, bytes_per_token

OPTION = Option("e", "8da4w", quantize="8da4w")  # quant.py's row (e): its bytes per step
FILES = {"a": "a_etblocks_8da4w.pte", "b": "b_llama_example_8da4w.pte"}
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
    average the timed steps' events."""
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(PATHS, __doc__)
    parser.add_argument("--profile-steps", type=int, default=32, help="decode steps recorded with ETDump")
    args = parser.parse_args(argv)
    bench = make_bench(args)
    try:
        reference = eager_reference_tokens(bench)
        step_bytes = bytes_per_token(bench, OPTION)
        prepared = [prepare_path(spec, bench) for spec in select_paths(args.rows, PATHS)]
        rows, bandwidths = time_in_fresh_process(prepared, bench, warm_prefill=True)
        bandwidth = statistics.median(bandwidths)
        print(describe_run("8da4w decode: etblocks and ExecuTorch's llama example, XNNPACK", bench, bandwidths))
        print(f"roofline: that bandwidth / {step_bytes / 1e6:.1f} MB read per decode step (quant.py's count)\n")
        print(format_table(rows, bandwidth / step_bytes, reference, reference_label="fp32"))
        print("tokens=fp32: leading greedy tokens equal to the fp32 transformers model's; random weights give flat "
              "distributions, which 4-bit weights tip early (quant.py measures accuracy on a trained model)")
        profiles = {row.key: profile_decode(bench.out_dir / FILES[row.key], bench, args.profile_steps)
                    for row in rows if row.status == "ok"}
        print(f"\nETDump of {args.profile_steps} decode steps (after the prompt and {args.profile_steps} untimed "
              "steps), mean ms per step (share of the Python step):")
        print(format_profiles(profiles, {row.key: row.name for row in rows}, step_bytes / bandwidth * 1e3))
    finally:
        if args.out_dir is None:
            shutil.rmtree(bench.out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
