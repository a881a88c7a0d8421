"""LoRA adapters switched at run time against one program per adapter, on the SmolLM2-135M shape (fp32, random
weights).

A seeded base (`harness.build_hf_model`) and two random PEFT LoRA adapters (A: r=16, alpha 32, all linears; B: r=8,
alpha 16, rsLoRA, q_proj and v_proj) become XNNPACK programs: base-only; slots (swap + `load_adapter` A and B +
export: LoRA slots and a `set_adapter` method, one .ptd per adapter); adapter programs (the same, exported with
`adapter_mode="programs"`: the base program, its weights in one .ptd, one small program per adapter reading them);
merged A and merged B (PEFT `merge_and_unload()`, then swap + export). Measured in one run: 1. the slot program's
and the adapter programs' greedy tokens after `Runner.set_adapter(A | B | None)`, and the base-only and merged
programs', against `PeftModel.generate` with that adapter (a disagreement exits 1; a wrong slot or adapter program
stops the run before anything is timed); 2. file sizes; 3. resident memory and 4. switch and load times, each in a
fresh child process; 5. decode and prefill tok/s of base-only, slots with None and with A, adapter program A,
merged A, in `--rounds` interleaved rounds in a fresh process (medians [min-max], ratios to base-only as medians of
per-round ratios), whose tokens are checked against PEFT too. Results: benchmarks/results/lora.json.

    python benchmarks/lora.py            # 30 layers
    python benchmarks/lora.py --smoke    # 1 layer, 1 round
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Bench,
    Checks,
    Shape,
    add_run_args,
    add_shape_arg,
    aligned_table,
    argmax_last,
    build_hf_model,
    check_tokens,
    finish,
    in_fresh_process,
    matching_prefix,
    paired_median,
    parse_with_smoke,
    spread,
    spread_record,
    time_round,
    warm_up,
    make_shape,
)


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter made for the benchmark's base (random weights, seeded)."""

    name: str
    r: int
    alpha: int
    targets: str | tuple[str, ...]
    rslora: bool = False
    seed: int = 1

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r ** 0.5 if self.rslora else self.r)

    def describe(self) -> str:
        targets = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        return (f"{self.name}: r={self.r}, alpha={self.alpha}{', rsLoRA' if self.rslora else ''} (scale "
                f"{self.scaling:.2f}), {targets}")


ADAPTERS = (
    Adapter("A", r=16, alpha=32, targets="all-linear", seed=1),
    Adapter("B", r=8, alpha=16, targets=("q_proj", "v_proj"), rslora=True, seed=2),
)
CYCLE = ("A", "B", None)  # the switch order
_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[lora bench {time.perf_counter() - _STARTED:4.0f} s] {message}", file=sys.stderr, flush=True)


@dataclass
class Program:
    """One row of the decode table: a program (the slot program serves two rows) and its timings."""

    key: str
    label: str
    path: Path  # the program, loaded where it is timed (`time_programs`)
    adapter: str | None = None  # for the rows with adapters: set before every round
    adapters: dict[str, Path] | None = None  # the adapter files or programs its runner is given
    pte_mb: float | None = None
    export_s: float | None = None
    decode_runs: list[float] = field(default_factory=list)
    prefill_runs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reference: str | None = None  # the reference tokens' key in `references`

    @property
    def decode_tps(self) -> float | None:
        return statistics.median(self.decode_runs) if self.decode_runs else None


class RunnerDriver:
    """`decode.Driver` over an `etblocks.Runner` (its `forward` keeps the position): every row runs through it."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def prefill(self, prompt: list[int]) -> int:
        self.runner.reset()
        return argmax_last(self.runner.forward(prompt))

    def decode(self, token: int, pos: int) -> int:
        assert pos == self.runner.pos, (pos, self.runner.pos)
        return argmax_last(self.runner.forward([token]))


def time_programs(programs: list[Program], bench: Bench) -> list[Program]:
    """Section 5 in a fresh process, as decode.py times (`harness.in_fresh_process`: programs loaded anew, MKL on
    one thread): each program loaded once (with its `adapters`; the slot program serves two rows), warmed, then
    `bench.rounds` interleaved rounds; returns `programs` with their timings and tokens."""
    import etblocks

    runners = {}
    for p in programs:
        if p.path not in runners:
            runners[p.path] = etblocks.Runner(p.path, adapters=p.adapters)
    for p in programs:
        if p.adapters:
            runners[p.path].set_adapter(p.adapter)
        warm_up(RunnerDriver(runners[p.path]), bench)
    for r in range(bench.rounds):
        for p in programs:
            if p.adapters:
                runners[p.path].set_adapter(p.adapter)
            prefill_tps, decode_tps, tokens = time_round(RunnerDriver(runners[p.path]), bench)
            if p.tokens and tokens != p.tokens:
                raise RuntimeError(f"[lora bench] ABORT: ({p.key}) greedy tokens differ between rounds")
            p.tokens = tokens
            p.decode_runs.append(decode_tps)
            p.prefill_runs.append(prefill_tps)
            log(f"round {r + 1}/{bench.rounds} ({p.key}): decode {decode_tps:.1f} tok/s, "
                f"prefill {prefill_tps:.0f} tok/s")
    return programs


# --------------------------------------------------------------------------------------------------
# Adapters, references, exports


def make_adapter(base: torch.nn.Module, spec: Adapter, directory: Path, std: float) -> Path:
    """Train nothing: random A and B (`init_lora_weights=False`, then N(0, std)) so the adapter changes the outputs."""
    from peft import LoraConfig, get_peft_model

    targets = spec.targets if isinstance(spec.targets, str) else list(spec.targets)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=targets, use_rslora=spec.rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    torch.manual_seed(spec.seed)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, std)
    peft_model.save_pretrained(directory)
    del peft_model
    return directory


def peft_tensor_bytes(directory: Path) -> tuple[int, int, int]:
    """(tensors, bytes of the lora_A / lora_B tensors, file size) of a saved PEFT adapter."""
    from safetensors.torch import load_file

    path = directory / "adapter_model.safetensors"
    tensors = [t for k, t in load_file(path).items() if "lora_A" in k or "lora_B" in k]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors), path.stat().st_size


@torch.no_grad()
def peft_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def peft_references(base: torch.nn.Module, dirs: dict[str, Path], prompt: list[int],
                    n: int) -> dict[str | None, list[int]]:
    """Greedy tokens of `PeftModel` with each adapter and with none (`disable_adapter()`)."""
    from peft import PeftModel

    names = list(dirs)
    model = PeftModel.from_pretrained(copy.deepcopy(base), dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    model.eval()
    references: dict[str | None, list[int]] = {}
    for name in names:
        model.set_adapter(name)
        references[name] = peft_greedy(model, prompt, n)
    with model.disable_adapter():
        references[None] = peft_greedy(model, prompt, n)
    del model
    gc.collect()
    return references


def export_program(model: torch.nn.Module, shape: Shape, out: Path, dirs: dict[str, Path] | None = None,
                   adapter_mode: str = "slots") -> Any:
    """Swap `model` (in place) for xnnpack, attach the adapters in `dirs` (if any), export; the ExportResult."""
    import etblocks

    with torch.no_grad():
        model = etblocks.swap(model, backend="xnnpack", max_seq_len=shape.max_seq_len) or model
        for name, directory in (dirs or {}).items():
            etblocks.load_adapter(model, directory, name=name)
        return etblocks.export(model, backend="xnnpack", out=out, adapter_mode=adapter_mode)


def merged_model(base: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """A copy of `base` with the adapter at `directory` merged into its weights by PEFT."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), directory).merge_and_unload()


def timed_export(label: str, model: torch.nn.Module, shape: Shape, out: Path, dirs=None,
                 adapter_mode: str = "slots") -> tuple[Any, float]:
    log(f"export {label} ...")
    start = time.perf_counter()
    result = export_program(model, shape, out, dirs, adapter_mode)
    seconds = time.perf_counter() - start
    log(f"export {label}: {seconds:.0f} s, {result.size_mb:.1f} MB; {result.delegation}")
    return result, seconds


# --------------------------------------------------------------------------------------------------
# Probes: memory and switch / load times, each in a fresh child process


def rss() -> dict[str, float]:
    """Resident memory in MB: VmRSS and its anonymous and file-backed parts (/proc/self/status; psutil elsewhere)."""
    try:
        fields = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024 / 1e6
        return {"rss": fields["VmRSS"], "anon": fields.get("RssAnon", float("nan")),
                "file": fields.get("RssFile", float("nan"))}
    except (OSError, KeyError):
        import psutil

        return {"rss": psutil.Process().memory_info().rss / 1e6, "anon": float("nan"), "file": float("nan")}


def mark(points: list, label: str) -> None:
    """Append the resident memory, after a collection, to `points` as `(label, rss())`."""
    gc.collect()
    points.append((label, rss()))


def time_switches(runner: Any, count: int, times: dict[str, list[float]]) -> None:
    """`count` calls of `runner.set_adapter`, going on through `CYCLE` from where `times` stops, each call's ms
    appended to `times[str(name)]`."""
    done = sum(len(ms) for ms in times.values())
    for i in range(done, done + count):
        name = CYCLE[i % len(CYCLE)]
        start = time.perf_counter()
        runner.set_adapter(name)
        times[str(name)].append(1e3 * (time.perf_counter() - start))


def probe_slots(spec: dict) -> dict:
    """Child process: one slot program, its adapters added, `switches` switches, a short generate."""
    import etblocks

    prompt, points, times = spec["prompt"], [], {str(n): [] for n in CYCLE}

    mark(points, "before loading (runtime + .ptd reader imported)")
    start = time.perf_counter()
    runner = etblocks.Runner(spec["pte"])
    load_ms = 1e3 * (time.perf_counter() - start)
    mark(points, "Runner(slot program): base loaded once")
    add_ms = {}
    for name, file in spec["adapters"].items():
        start = time.perf_counter()
        runner.add_adapter(name, file)
        add_ms[name] = 1e3 * (time.perf_counter() - start)
        mark(points, f"+ add_adapter({name!r})")
    half = spec["switches"] // 2
    time_switches(runner, half, times)
    if half:
        mark(points, f"+ {half} switches A->B->None")
    time_switches(runner, spec["switches"] - half, times)
    mark(points, f"+ {spec['switches'] - half} more switches ({spec['switches']} in all)")
    runner.set_adapter("A")
    runner.generate(prompt, max_new_tokens=8, eos=[])
    mark(points, "+ generate 8 tokens with A")
    slots = runner.adapter_table.slots
    return {"points": points, "first_load_ms": load_ms, "add_ms": add_ms, "switch_ms": times,
            "slots": len(slots), "slot_ranks": sorted({s.rank for s in slots}),
            "slot_mb": sum((s.in_features + s.out_features) * s.rank * 4 for s in slots) / 1e6}


def probe_programs(spec: dict) -> dict:
    """Child process: one program per adapter, the second loaded next to the first; then `Runner(path)` wall times
    of the merged programs and of the slot program, in interleaved rounds."""
    import etblocks

    points = []

    (first, first_path), (second, second_path) = list(spec["programs"].items())[:2]
    mark(points, "before loading (runtime + .ptd reader imported)")
    runners, first_load_ms = {}, []
    for name, path in ((first, first_path), (second, second_path)):
        start = time.perf_counter()
        runners[name] = etblocks.Runner(path)
        first_load_ms.append(1e3 * (time.perf_counter() - start))
        mark(points, f"+ Runner(merged {name})" + (" (second program)" if name == second else ""))
    del runners[first]
    mark(points, f"- drop merged {first} (only {second} loaded)")
    runners[second].generate(spec["prompt"], max_new_tokens=8, eos=[])
    mark(points, f"+ generate 8 tokens with merged {second}")
    runners.clear()
    load_ms: dict[str, list[float]] = {"merged": [], "slots": []}
    for _ in range(spec["loads"]):
        for kind, path in (("merged", first_path), ("slots", spec["slots"]), ("merged", second_path)):
            gc.collect()
            start = time.perf_counter()
            runner = etblocks.Runner(path)
            load_ms[kind].append(1e3 * (time.perf_counter() - start))
            del runner
    return {"points": points, "first_load_ms": first_load_ms, "load_ms": load_ms}


def probe_adapter_programs(spec: dict) -> dict:
    """Child process: the base program (weights in their .ptd), its adapter programs added, `switches` switches
    (each loads a program in place of the one running), a short generate."""
    import etblocks

    points, times = [], {str(n): [] for n in CYCLE}

    mark(points, "before loading (runtime + .ptd reader imported)")
    start = time.perf_counter()
    runner = etblocks.Runner(spec["pte"], adapters=spec["adapters"])
    load_ms = 1e3 * (time.perf_counter() - start)
    mark(points, "Runner(base program, adapter programs added)")
    time_switches(runner, spec["switches"], times)
    mark(points, f"+ {spec['switches']} switches A->B->None")
    runner.set_adapter("A")
    runner.generate(spec["prompt"], max_new_tokens=8, eos=[])
    mark(points, "+ generate 8 tokens with A")
    return {"points": points, "first_load_ms": load_ms, "switch_ms": times}


PROBES = {"slots": probe_slots, "programs": probe_programs, "adapter_programs": probe_adapter_programs}


def run_probe(kind: str, spec: dict) -> dict:
    """Run `probe_<kind>(spec)` in a fresh Python process; its result is the JSON on its last stdout line."""
    import etblocks

    env = dict(os.environ)
    root = str(Path(etblocks.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    log(f"probe {kind} (child process) ...")
    done = subprocess.run([sys.executable, __file__, "--probe", kind, json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"probe {kind} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_main(kind: str, spec_json: str) -> int:
    from executorch.runtime import Runtime

    from etblocks.ops import load_llama_custom_ops

    load_llama_custom_ops()
    Runtime.get()
    # What Runner.add_adapter imports to read a .ptd: imported before the first RSS mark, so that mark's step
    # counts the adapter's data rather than Python modules.
    import executorch.exir._serialize._cord  # noqa: F401
    import executorch.exir.tensor  # noqa: F401
    import executorch.extension.flat_tensor.serialize.serialize  # noqa: F401
    print(json.dumps(PROBES[kind](json.loads(spec_json))))
    return 0


# --------------------------------------------------------------------------------------------------
# Report


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def memory_table(points: list[tuple[str, dict]]) -> str:
    rows, previous, first = [], None, points[0][1]
    for label, m in points:
        step = "" if previous is None else f"{m['rss'] - previous['rss']:+.1f}"
        rows.append([label, f"{m['rss']:.1f}", step, f"{m['rss'] - first['rss']:+.1f}", f"{m['anon']:.1f}",
                     f"{m['file']:.1f}"])
        previous = m
    return aligned_table(["", "VmRSS MB", "step MB", "total MB", "anon MB", "file MB"], rows)


def print_report(args, shape: Shape, bench: Bench, programs: list[Program], references, checks, sizes, slots_probe,
                 programs_probe, adapter_programs_probe, delegations, started: float) -> None:
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    s = shape
    print(f"\nLoRA adapters switched at run time (slots; adapter programs) vs one program per adapter, {s.name} shape: {s.layers} layers, "
          f"hidden {s.hidden}, {s.heads}/{s.kv_heads} heads (head_dim {s.head_dim}), intermediate {s.intermediate}, "
          f"vocab {s.vocab}, tied embedding, fp32, random weights (seed {args.seed}, init std {args.init_range})")
    print(f"adapters (PEFT, random lora_A/lora_B, std {args.lora_std}): "
          + "; ".join(a.describe() for a in ADAPTERS))
    print(f"slot program: {slots_probe['slots']} LoRA slots, rank {'/'.join(map(str, slots_probe['slot_ranks']))} "
          f"(per layer, the largest rank loaded there), {slots_probe['slot_mb']:.1f} MB of slot buffers; context "
          f"{s.max_seq_len}; XNNPACK, torch {torch.__version__}, {_threadpool_get_thread_count()} ExecuTorch threads")

    print(f"\n1. greedy check: first {args.check_tokens} tokens vs PeftModel.generate(do_sample=False) with the same "
          "adapter")
    for line in checks:
        print("  " + line)

    print("\n2. sizes")
    print(aligned_table(["file", "bytes", "MB", "vs"], sizes))

    print("\n3. resident memory (fresh child process each; anon = RssAnon, file = RssFile)")
    print("slot program:")
    print(memory_table(slots_probe["points"]))
    print("adapter programs (one loaded at a time, the base weights in their .ptd):")
    print(memory_table(adapter_programs_probe["points"]))
    print("one program per adapter:")
    print(memory_table(programs_probe["points"]))

    switch_all = [t for ts in slots_probe["switch_ms"].values() for t in ts]
    loads = programs_probe["load_ms"]["merged"]
    slot_points = dict(slots_probe["points"])
    prog_points = programs_probe["points"]
    second_rss = prog_points[2][1]["rss"] - prog_points[1][1]["rss"]
    add_b = slot_points["+ add_adapter('B')"]["rss"] - slot_points["+ add_adapter('A')"]["rss"]
    print("\n4. time to switch")
    rows = [
        [f"Runner.set_adapter(name), {len(switch_all)} switches A->B->None", f"{statistics.median(switch_all):.3f}",
         f"{percentile(switch_all, 0.9):.3f}", f"{max(switch_all):.3f}", "1.0x"],
    ]
    for name, ts in slots_probe["switch_ms"].items():
        rows.append([f"  set_adapter({name if name == 'None' else repr(name)}) only ({len(ts)})",
                     f"{statistics.median(ts):.3f}", f"{percentile(ts, 0.9):.3f}", f"{max(ts):.3f}", ""])
    program_switches = [t for ts in adapter_programs_probe["switch_ms"].values() for t in ts]
    rows.append([f"adapter programs: Runner.set_adapter(name), {len(program_switches)} switches A->B->None",
                 f"{statistics.median(program_switches):.1f}", f"{percentile(program_switches, 0.9):.1f}",
                 f"{max(program_switches):.1f}",
                 f"{statistics.median(program_switches) / statistics.median(switch_all):.0f}x"])
    slot_loads = programs_probe["load_ms"]["slots"]
    for label, ms in ((f"Runner(merged program), {len(loads)} loads", loads),
                      (f"Runner(slot program), {len(slot_loads)} loads", slot_loads)):
        rows.append([label, f"{statistics.median(ms):.1f}", f"{percentile(ms, 0.9):.1f}", f"{max(ms):.1f}",
                     f"{statistics.median(ms) / statistics.median(switch_all):.0f}x"])
    first_a, first_b = programs_probe["first_load_ms"]
    rows.append(["first loads in a fresh process: slot program", f"{slots_probe['first_load_ms']:.0f}", "", "", ""])
    rows.append(["  merged A, then merged B (the second program)", f"{first_a:.0f}, {first_b:.0f}", "", "", ""])
    for name, ms in slots_probe["add_ms"].items():
        rows.append([f"Runner.add_adapter({name!r}), once", f"{ms:.1f}", "", "", ""])
    print(aligned_table(["", "median ms", "p90 ms", "max ms", "vs set_adapter"], rows))
    print(f"second adapter: add_adapter('B') {add_b:+.1f} MB RSS and {statistics.median(switch_all):.3f} ms per "
          f"switch, vs a second program {second_rss:+.1f} MB RSS and {statistics.median(loads):.0f} ms per load")

    print(f"\n5. decode: {bench.decode_steps} greedy steps after a {len(bench.prompt)}-token prompt; medians of "
          f"{bench.rounds} interleaved rounds [min-max]; ratios: medians of per-round ratios to (a)")
    ref = programs[0]
    rows = []
    for p in programs:
        ratio = paired_median(p.decode_runs, ref.decode_runs)
        pratio = paired_median(p.prefill_runs, ref.prefill_runs)
        n = matching_prefix(p.tokens, references[p.reference])
        rows.append([f"({p.key}) {p.label}", spread(p.decode_runs, ".1f"), "-" if ratio is None else f"{ratio:.2f}x",
                     spread(p.prefill_runs, ".0f"), "-" if pratio is None else f"{pratio:.2f}x",
                     f"{p.pte_mb:.1f}", f"{p.export_s:.0f}", f"{n}/{len(references[p.reference])}"])
    print(aligned_table(["program", "decode tok/s", "decode/(a)", "prefill tok/s", "prefill/(a)", ".pte MB", "export s",
                 "tokens=PEFT"], rows))
    print("delegation:")
    for label, text in delegations:
        print(f"  {label}: {text}")
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


# --------------------------------------------------------------------------------------------------
# Main


SMOKE = {"shape": "tiny", "layers": 1, "max_seq_len": 32, "prompt_len": 8, "decode_steps": 4, "rounds": 1, "check_tokens": 4,
         "switches": 6, "program_switches": 3, "loads": 1}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arg(parser)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers")
    parser.add_argument("--max-seq-len", type=int, default=256, help="context / KV cache length")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (prefill)")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed greedy decode steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved decode rounds; medians are reported")
    parser.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared with PEFT")
    parser.add_argument("--switches", type=int, default=200, help="timed set_adapter calls (A -> B -> None ...)")
    parser.add_argument("--program-switches", type=int, default=15,
                        help="timed set_adapter calls between adapter programs (each loads a program)")
    parser.add_argument("--loads", type=int, default=5,
                        help="interleaved timed loads: merged A, slot program, merged B, ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-range", type=float, default=0.1,
                        help="base weight init std; 0.02 (the default of transformers) makes greedy repeat one token")
    parser.add_argument("--lora-std", type=float, default=0.05, help="std of the random lora_A / lora_B weights")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where adapters and programs go (kept); default: a temp dir, deleted at the end")
    parser.add_argument("--probe", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)  # child process
    add_run_args(parser, "lora", SMOKE)
    return parse_with_smoke(parser, argv, SMOKE)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        return probe_main(*args.probe)
    started = time.perf_counter()
    shape = make_shape(args, layers=args.layers, max_seq_len=args.max_seq_len)
    prompt = torch.randint(1, shape.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed))
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="etblocks_lora_bench_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(shape, prompt.tolist(), args.decode_steps, args.rounds, out_dir, args.seed, args.init_range)
    try:
        return run(args, shape, bench, started)
    finally:
        if args.out_dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)


def run(args: argparse.Namespace, shape: Shape, bench: Bench, started: float) -> int:
    """The whole benchmark (module docstring); the exit code."""
    import etblocks

    out = bench.out_dir
    base = build_hf_model(bench)
    base.generation_config.eos_token_id = None  # greedy runs always produce every token
    dirs = {a.name: make_adapter(base, a, out / f"adapter_{a.name}", args.lora_std) for a in ADAPTERS}
    log("PEFT references ...")
    references = peft_references(base, dirs, bench.prompt, args.check_tokens)
    keys = list(references)
    same = [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if references[a] == references[b]]
    if same:
        log(f"WARNING: PEFT gives the same tokens for {same}; raise --lora-std so the check tells them apart")

    base_result, base_s = timed_export("base-only", copy.deepcopy(base), shape, out / "base.pte")
    slot_result, slot_s = timed_export("slots (A, B)", copy.deepcopy(base), shape, out / "lora.pte", dirs)
    programs_result, programs_s = timed_export("adapter programs (A, B)", copy.deepcopy(base), shape,
                                               out / "programs.pte", dirs, adapter_mode="programs")
    merged = {}
    for a in ADAPTERS:
        merged[a.name] = timed_export(f"merged {a.name}", merged_model(base, dirs[a.name]), shape,
                                      out / f"merged_{a.name}.pte")
    del base
    gc.collect()

    # 1. correctness: the slot program and the adapter programs through Runner.set_adapter, against PEFT
    log("greedy checks ...")
    verdicts = Checks()
    checks = []
    for key, label, result in (("slots", "slot program", slot_result), ("programs", "adapter programs", programs_result)):
        runner = etblocks.Runner(result.path, adapters=result.adapters)
        for name in CYCLE:
            runner.set_adapter(name)
            tokens = runner.generate(bench.prompt, max_new_tokens=args.check_tokens, eos=[])
            check = verdicts.add(check_tokens(f"{key}:{name}", tokens, references[name], f"PEFT {name!r}"))
            checks.append(f"{label}, set_adapter({name!r}): {check.matching}/{check.compared} {check.outputs}")
        del runner
    if not verdicts.ok:  # the slot and adapter programs are the subject: time nothing else when one is wrong
        print("\n".join(checks))
        return finish("lora", args, verdicts, {}, started, reference_tokens=references)
    base_runner = etblocks.Runner(base_result.path)
    merged_runners = {name: etblocks.Runner(result.path) for name, (result, _) in merged.items()}
    for key, label, runner, ref in [("base", "base-only program", base_runner, None),
                                    *((f"merged:{n}", f"merged {n} program", r, n) for n, r in merged_runners.items())]:
        tokens = runner.generate(bench.prompt, max_new_tokens=args.check_tokens, eos=[])
        check = verdicts.add(check_tokens(key, tokens, references[ref], f"PEFT {ref!r}"))
        checks.append(f"{label} vs PEFT {ref!r}: {check.matching}/{check.compared}"
                      + ("" if check.ok else f" (differs at index {check.first_difference})"))
    checks.append("PEFT references: " + ", ".join(f"{k!r} {v}" for k, v in references.items()))
    if same:
        checks.append(f"WARNING: PEFT gives the same tokens for {same}: the check cannot tell those apart")

    # 2. sizes
    base_bytes, slot_bytes = base_result.path.stat().st_size, slot_result.path.stat().st_size
    sizes = [
        ["base-only .pte", f"{base_bytes:,}", f"{base_bytes / 1e6:.2f}", ""],
        ["slot program .pte", f"{slot_bytes:,}", f"{slot_bytes / 1e6:.2f}",
         f"{(slot_bytes - base_bytes) / 1e3:+.1f} KB vs base-only"],
    ]
    for a in ADAPTERS:
        ptd = slot_result.adapters[a.name].stat().st_size
        count, tensor_bytes, safetensors = peft_tensor_bytes(dirs[a.name])
        sizes.append([f"adapter {a.name} .ptd", f"{ptd:,}", f"{ptd / 1e6:.2f}",
                      f"{ptd - tensor_bytes:+,} B vs its {count} tensors ({tensor_bytes:,} B); PEFT safetensors "
                      f"{safetensors:,} B"])
    programs_bytes, weights_bytes = programs_result.path.stat().st_size, programs_result.data_path.stat().st_size
    sizes.append(["adapter programs: base .pte", f"{programs_bytes:,}", f"{programs_bytes / 1e6:.2f}",
                  "the base program without its weights"])
    sizes.append(["  base weights .ptd", f"{weights_bytes:,}", f"{weights_bytes / 1e6:.2f}",
                  f"{(programs_bytes + weights_bytes - base_bytes) / 1e6:+.2f} MB, base .pte and .ptd vs base-only"])
    for a in ADAPTERS:
        size = programs_result.adapters[a.name].stat().st_size
        _, tensor_bytes, _ = peft_tensor_bytes(dirs[a.name])
        sizes.append([f"  adapter {a.name} .pte", f"{size:,}", f"{size / 1e6:.2f}",
                      f"{(size - programs_bytes - tensor_bytes) / 1e3:+.1f} KB vs the base .pte + its tensors"])
    for name, (result, _) in merged.items():
        size = result.path.stat().st_size
        sizes.append([f"merged {name} .pte", f"{size:,}", f"{size / 1e6:.2f}", "a whole program per adapter"])

    # 3., 4. memory and switch / load times, in child processes
    del base_runner, merged_runners
    gc.collect()
    slots_probe = run_probe("slots", {"pte": str(slot_result.path), "prompt": bench.prompt, "switches": args.switches,
                                      "adapters": {k: str(v) for k, v in slot_result.adapters.items()}})
    adapter_programs_probe = run_probe("adapter_programs", {
        "pte": str(programs_result.path), "prompt": bench.prompt, "switches": args.program_switches,
        "adapters": {k: str(v) for k, v in programs_result.adapters.items()}})
    programs_probe = run_probe("programs", {"prompt": bench.prompt, "loads": args.loads, "slots": str(slot_result.path),
                                            "programs": {n: str(r.path) for n, (r, _) in merged.items()}})

    # 5. decode speed
    merged_a, merged_a_s = merged["A"]
    programs = [
        Program("a", "base-only program", base_result.path, pte_mb=base_result.size_mb, export_s=base_s, reference=None),
        Program("b", "slot program, set_adapter(None)", slot_result.path, None, slot_result.adapters,
                slot_result.size_mb, slot_s, reference=None),
        Program("c", "slot program, set_adapter('A')", slot_result.path, "A", slot_result.adapters,
                slot_result.size_mb, slot_s, reference="A"),
        Program("d", "adapter program A (adapter_mode='programs')", programs_result.path, "A",
                programs_result.adapters, programs_result.adapters["A"].stat().st_size / 1e6, programs_s,
                reference="A"),
        Program("e", "merged A program (one per adapter)", merged_a.path, pte_mb=merged_a.size_mb,
                export_s=merged_a_s, reference="A"),
    ]
    programs = in_fresh_process(time_programs, programs, bench)
    delegations = [("base-only forward", str(base_result.delegations["forward"])),
                   ("slot program forward", str(slot_result.delegations["forward"])),
                   ("adapter programs, base forward", str(programs_result.delegations["forward"])),
                   ("adapter program A forward", str(programs_result.adapter_delegations["A"]["forward"])),
                   ("slot program set_adapter", str(slot_result.delegations["set_adapter"]))]
    for p in programs:
        verdicts.add(check_tokens(p.key, p.tokens, references[p.reference], f"PEFT {p.reference!r}"))
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        print_report(args, shape, bench, programs, references, checks, sizes, slots_probe, programs_probe,
                     adapter_programs_probe, delegations, started)
    print(report.getvalue(), end="")
    records = [{"key": p.key, "name": p.label, "adapter": p.adapter, "export_s": p.export_s, "pte_mb": p.pte_mb,
                "tokens": p.tokens, "timings": {"decode_tps": spread_record(p.decode_runs),
                                                "prefill_tps": spread_record(p.prefill_runs)}} for p in programs]
    switch_ms = {name: spread_record(ms) for name, ms in slots_probe["switch_ms"].items()}
    program_switch_ms = {name: spread_record(ms) for name, ms in adapter_programs_probe["switch_ms"].items()}
    load_ms = {kind: spread_record(ms) for kind, ms in programs_probe["load_ms"].items()}
    return finish("lora", args, verdicts, {"lora": report.getvalue().strip()}, started, prompt=bench.prompt,
                  reference_tokens={str(k): v for k, v in references.items()}, rows=records, sizes=sizes,
                  switch_ms=switch_ms, program_switch_ms=program_switch_ms, load_ms=load_ms,
                  memory={"slots": slots_probe["points"], "programs": programs_probe["points"],
                          "adapter_programs": adapter_programs_probe["points"]})


if __name__ == "__main__":
    sys.exit(main())
