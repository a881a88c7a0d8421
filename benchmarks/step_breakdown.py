"""Where a decode step's time goes, by subtraction: XNNPACK's linears alone per weight scheme, then an 8da4w step
built up from them block by block, each part timed unprofiled as a program of its own.

Programs: one token through `--layers` decoder layers of the SmolLM2-135M shape and the lm_head, called with `x
[1, 1, hidden]` and its position. Linears alone, chained as a decoder chains them: (a) fp32, (b) 8da8w, (c) 8da4w
g32, (d) 8da4w g192; the 8da4w g32 step built up from (c), lowered with etblocks' XNNPACK graph rewrites: (e) +
RMSNorm, (f) + etblocks' attention (rope, `StaticKVCache`, `CustomSDPA`), (g) etblocks' whole program; (h) the
attention's CPU kernels alone (`llama::update_cache`, `llama::custom_sdpa`). Each program's output for one call is
checked against its eager module's (max abs error / max abs output within `TOLERANCE`; (g) is checked by decode.py
and quant.py), or the script exits 1. All programs are timed in a fresh process in `--rounds` interleaved rounds of
`--calls` calls: ms per call (median [min-max]), the weights' MB over it in GB/s and as % of the round's read
bandwidth, increments over the row above, and the ratio to (c). Results: benchmarks/results/step_breakdown.json.

    python benchmarks/step_breakdown.py            # 30 layers
    python benchmarks/step_breakdown.py --smoke    # 1 layer, 1 round, 4 calls
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    BANDWIDTH_PROBE,
    GROUP_SIZE,
    Bench,
    Checks,
    Row as DecodeRow,
    Shape,
    add_run_args,
    add_shape_arg,
    aligned_table,
    build_hf_model,
    check_values,
    describe_cpu,
    export_with_etblocks,
    finish,
    in_fresh_process,
    load_method,
    lower_to_xnnpack,
    measure_read_bandwidth,
    paired_median,
    parse_with_smoke,
    spread,
    spread_record,
    weight_bytes_per_token,
    make_shape,
)

from etblocks.attention import Attention, CustomSDPA
from etblocks.attention.rope import RotaryEmbedding, default_inv_freq
from etblocks.backends import get_backend
from etblocks.export.runner import run_method
from etblocks.export.weights import WeightQuantization
from etblocks.ops import load_kernels
from etblocks.state import StaticKVCache

START_POS = 64  # quant.py's prompt length: decode reads about as many cached positions


@dataclass(frozen=True)
class Part:
    """One program: the weight scheme (`etblocks.export`'s `quantize`, `group_size`; None: fp32) and what it holds
    besides the linears."""

    key: str
    name: str
    quantize: str | None = None
    group_size: int | None = None
    norms: bool = False
    attention: bool = False
    etblocks_program: bool = False
    attention_ops: bool = False  # no linears: only the attention's CPU kernels (AttentionOps)


G32 = dict(quantize="8da4w", group_size=32)
SCHEME_PARTS = (
    Part("a", "fp32"),
    Part("b", "8da8w", "8da8w"),
    Part("c", "8da4w g32", **G32),
    Part("d", "8da4w g192", "8da4w", 192),
)
STEP_PARTS = (
    Part("e", "+ RMSNorm", norms=True, **G32),
    Part("f", "+ attention", norms=True, attention=True, **G32),
    Part("g", "etblocks' program", etblocks_program=True, **G32),
)
ATTENTION_PARTS = (Part("h", "cache + SDPA kernels", attention_ops=True),)
REFERENCE_KEY = "c"
# A program's output against its eager module's, max abs error / max abs output: fp32 programs compute what eager
# does up to float rounding; quantized ones also differ in how XNNPACK rounds the dynamic int8 activations.
TOLERANCE = {None: 1e-4, "8da8w": 0.1, "8da4w": 0.1}
SMOKE = {"shape": "tiny", "layers": 1, "rounds": 1, "calls": 4}


class DecoderParts(nn.Module):
    """`layers` decoder layers of the benchmark shape and an lm_head, with or without RMSNorms and attention.
    `forward(x [1, 1, hidden], input_pos [1]) -> logits [1, 1, vocab]`."""

    def __init__(self, shape: Shape, norms: bool, attention: bool) -> None:
        super().__init__()
        names = ("q", "k", "v", "o", "gate", "up", "down")
        self.layers = nn.ModuleList()
        for _ in range(shape.layers):
            layer = nn.ModuleDict({name: nn.Linear(i, o, bias=False) for name, (o, i) in zip(names, shape.linear_shapes())})
            if norms:
                layer["attention_norm"] = nn.RMSNorm(shape.hidden, eps=shape.norm_eps)
                layer["mlp_norm"] = nn.RMSNorm(shape.hidden, eps=shape.norm_eps)
            if attention:  # the projections move into the block (one owner each, so quantize_ sees them once)
                layer["attention"] = Attention(
                    shape.heads, shape.kv_heads, shape.head_dim, CustomSDPA(shape.head_dim**-0.5),
                    StaticKVCache(1, shape.max_seq_len, shape.kv_heads, shape.head_dim, use_custom_op=True),
                    *(layer.pop(name) for name in ("q", "k", "v", "o")),
                )
            self.layers.append(layer)
        # One rope table per step, shared by the layers, as a swapped transformers model computes it.
        self.rope = RotaryEmbedding(default_inv_freq(shape.head_dim, shape.rope_theta)) if attention else None
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.groups = shape.heads // shape.kv_heads

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        position_embeddings = self.rope(input_pos) if self.rope is not None else None
        for layer in self.layers:
            h = layer["attention_norm"](x) if "attention_norm" in layer else x
            if "attention" in layer:
                x = x + layer["attention"](h, input_pos, position_embeddings)
            else:
                kv = layer["k"](h) + layer["v"](h)  # q's width is kv's times the query heads per K/V head
                x = x + layer["o"](layer["q"](h) + torch.cat([kv] * self.groups, dim=-1))
            h = layer["mlp_norm"](x) if "mlp_norm" in layer else x
            x = x + layer["down"](nn.functional.silu(layer["gate"](h)) * layer["up"](h))
        return self.lm_head(x)


class AttentionOps(nn.Module):
    """Only the CPU kernels of `layers` layers' decode attention, as `swap(backend="xnnpack")` builds it: the
    `StaticKVCache`'s two `llama::update_cache` writes and `CustomSDPA`'s `llama::custom_sdpa`, without linears or
    rope. `forward(q [1, 1, heads, head_dim], kv [1, 1, kv_heads, head_dim], input_pos [1]) -> q's shape`."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.caches = nn.ModuleList(
            StaticKVCache(1, shape.max_seq_len, shape.kv_heads, shape.head_dim, use_custom_op=True)
            for _ in range(shape.layers)
        )
        self.sdpa = CustomSDPA(shape.head_dim**-0.5)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        for cache in self.caches:
            k_all, v_all, k_pos = cache.update(input_pos, kv, kv)
            q = self.sdpa(q, k_all, v_all, input_pos, k_pos)
        return q


@dataclass
class Program:
    """An exported part: its .pte and the inputs its calls take before the position."""

    part: Part
    mb: float
    export_s: float
    path: Path
    inputs: list[torch.Tensor]
    ms_runs: list[float] = field(default_factory=list)
    error: float | None = None  # max abs error / max abs output against the eager module (None: not compared)

    @property
    def ms(self) -> float:
        return statistics.median(self.ms_runs)


def fitted(part: Part, shape: Shape) -> Part:
    """The part with its 8da4w group narrowed to one that divides every linear's input width (g192 is 64 at
    `--shape tiny`)."""
    if part.quantize != "8da4w":
        return part
    group = math.gcd(part.group_size, *(in_features for _, in_features in shape.linear_shapes()))
    return part if group == part.group_size else dataclasses.replace(part, name=f"8da4w g{group}", group_size=group)


def build(part: Part, shape: Shape, seed: int, out_dir: Path) -> Program:
    """Export the part's program."""
    start = time.perf_counter()
    path = out_dir / f"{part.key}.pte"
    if part.etblocks_program:
        bench = Bench(shape, [1] * START_POS, 1, 1, out_dir, seed, init_range=0.1)
        export = {"quantize_weights": part.quantize, "group_size": part.group_size}
        export_with_etblocks(bench, DecodeRow(part.key, part.name), build_hf_model, path.name, export_options=export)
        inputs = [torch.tensor([[1]], dtype=torch.long)]
    else:
        if part.attention_ops:
            module = AttentionOps(shape).eval()
            inputs = [torch.randn(1, 1, shape.heads, shape.head_dim), torch.randn(1, 1, shape.kv_heads, shape.head_dim)]
        else:
            from torchao.quantization import quantize_

            torch.manual_seed(seed)
            module = DecoderParts(shape, part.norms, part.attention).eval()
            if part.quantize is not None:
                quantize_(module, WeightQuantization(part.quantize, part.group_size).linear_config(),
                          filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
            inputs = [torch.randn(1, 1, shape.hidden)]
        with torch.no_grad():
            load_kernels()  # the eager module calls the llama cache and SDPA ops too
            expected = copy.deepcopy(module)(*inputs, torch.tensor([START_POS]))
            exported = torch.export.export(module, (*inputs, torch.tensor([START_POS])))
        get_backend("xnnpack").apply_passes(exported)  # as etblocks.export lowers: the RMSNorms stay in the delegate
        lower_to_xnnpack(exported, path)
    export_s = time.perf_counter() - start
    error = None
    if not part.etblocks_program:  # (g) is etblocks' whole program, checked by decode.py and quant.py
        (got,) = run_method(load_method(path), [*inputs, torch.tensor([START_POS])])
        error = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
    mb = 0.0 if part.attention_ops else weight_bytes_per_token(shape, part.quantize, part.group_size or GROUP_SIZE) / 1e6
    program = Program(part, mb, export_s, path, inputs, error=error)
    print(f"[step breakdown] ({part.key}) {part.name}: exported in {program.export_s:.0f} s", file=sys.stderr, flush=True)
    return program


def time_calls(method, program: Program, calls: int) -> float:
    """ms per call over `calls` calls at positions START_POS on, after five untimed ones just before them."""
    def call(pos: int) -> None:
        run_method(method, [*program.inputs, torch.tensor([pos], dtype=torch.long)])

    for pos in range(START_POS - 5, START_POS):
        call(pos)
    start = time.perf_counter()
    for pos in range(START_POS, START_POS + calls):
        call(pos)
    return (time.perf_counter() - start) / calls * 1e3


def time_programs(programs: list[Program], rounds: int, calls: int) -> tuple[list[Program], list[float]]:
    """Load every program and time them in interleaved rounds, the read bandwidth sampled every round; meant to
    run in a fresh process (`decode.time_in_fresh_process` says why)."""
    methods = [load_method(p.path) for p in programs]
    bandwidths = []
    for round_index in range(rounds):
        for program, method in zip(programs, methods):
            program.ms_runs.append(time_calls(method, program, calls))
        bandwidths.append(measure_read_bandwidth(reps=2))
        print(f"[step breakdown] round {round_index + 1}/{rounds}: "
              + ", ".join(f"({p.part.key}) {p.ms_runs[-1]:.3f} ms" for p in programs)
              + f"; read bandwidth {bandwidths[-1] / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
    return programs, bandwidths


def table(programs: Sequence[Program], bandwidths: Sequence[float], reference: Program, increments: bool) -> str:
    lines = []
    for index, p in enumerate(programs):
        share = paired_median([p.mb / ms for ms in p.ms_runs], [b / 1e9 for b in bandwidths])  # MB/ms = GB/s
        cells = [f"({p.part.key}) {p.part.name}", f"{p.mb:.1f}", spread(p.ms_runs, ".3f"), f"{p.mb / p.ms:.1f}",
                 f"{100 * share:.0f}%"]
        if increments:
            previous = programs[index - 1] if index else None
            cells.append("-" if previous is None else
                         f"{statistics.median(a - b for a, b in zip(p.ms_runs, previous.ms_runs)):+.3f}")
        lines.append([*cells, f"{p.ms / reference.ms:.2f}x", f"{p.export_s:.0f}"])
    headers = ["program", "weights MB", "ms/call", "GB/s", "% of bandwidth", *(["ms over above"] if increments else []),
               f"ms/({REFERENCE_KEY})", "export s"]
    return aligned_table(headers, lines)


def attention_table(programs: Sequence[Program], increment: Sequence[float], layers: int) -> str:
    """The attention kernels alone beside the attention's share of the step, (f) - (e) per round."""
    lines = [[f"({p.part.key}) {p.part.name}", spread(p.ms_runs, ".3f"), f"{1e3 * p.ms / layers:.1f}",
              f"{statistics.median(a / b for a, b in zip(p.ms_runs, increment)):.0%}"] for p in programs]
    return aligned_table(["program", "ms/call", "us per layer", "of (f) - (e)"], lines)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arg(parser)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds; medians are reported")
    parser.add_argument("--calls", type=int, default=64, help="timed calls per program per round")
    parser.add_argument("--seed", type=int, default=0)
    add_run_args(parser, "step_breakdown", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    shape = make_shape(args, layers=args.layers)
    if START_POS + args.calls > shape.max_seq_len:
        raise SystemExit(f"--calls {args.calls}: positions from {START_POS} must stay below the context "
                         f"{shape.max_seq_len}")
    with tempfile.TemporaryDirectory(prefix="etblocks_step_breakdown_") as out_dir:
        programs = [build(fitted(part, shape), shape, args.seed, Path(out_dir))
                    for part in (*SCHEME_PARTS, *STEP_PARTS, *ATTENTION_PARTS)]
        programs, bandwidths = in_fresh_process(time_programs, programs, args.rounds, args.calls)
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    by_key = {p.part.key: p for p in programs}
    reference = by_key[REFERENCE_KEY]
    gb = [b / 1e9 for b in bandwidths]
    header = "\n".join([
        f"One decode token through {shape.layers} layers of the {shape.name} shape (hidden {shape.hidden}, "
        f"{shape.heads}/{shape.kv_heads} heads, intermediate {shape.intermediate}) and the lm_head ({shape.vocab} x "
        f"{shape.hidden}), XNNPACK; {args.rounds} interleaved rounds of {args.calls} calls at positions "
        f"{START_POS}-{START_POS + args.calls - 1}, medians [min-max]; {_threadpool_get_thread_count()} ExecuTorch "
        "threads",
        describe_cpu(),
        f"read bandwidth {statistics.median(gb):.1f} GB/s [{min(gb):.1f}-{max(gb):.1f}] ({BANDWIDTH_PROBE}, sampled "
        "every round)\n"])
    schemes = "linears alone, per weight scheme\n" + table([by_key[p.key] for p in SCHEME_PARTS], bandwidths,
                                                           reference, increments=False)
    steps = "the 8da4w g32 step built up from its linears\n" + table(
        [reference, *(by_key[p.key] for p in STEP_PARTS)], bandwidths, reference, increments=True)
    increment = [f - e for f, e in zip(by_key["f"].ms_runs, by_key["e"].ms_runs)]
    attention = (f"the attention's CPU kernels alone ({shape.layers} x two llama::update_cache + llama::custom_sdpa), "
                 f"beside the attention's increment (f) - (e), {statistics.median(increment):.3f} ms\n"
                 + attention_table([by_key[p.key] for p in ATTENTION_PARTS], increment, shape.layers))
    print("\n" + header)
    print(schemes)
    print("\n" + steps)
    print("\n" + attention)
    checks = Checks()
    for p in programs:
        if p.error is not None:
            checks.add(check_values(p.part.key, [p.error], [0.0], "eager module", TOLERANCE[p.part.quantize],
                                    note="max abs error / max abs output of one call at position "
                                         f"{START_POS}, tolerance {TOLERANCE[p.part.quantize]}"))
    records = [{"key": p.part.key, "name": p.part.name, "weights_mb": p.mb, "export_s": p.export_s,
                "error_vs_eager": p.error, "timings": {"ms_per_call": spread_record(p.ms_runs)}} for p in programs]
    return finish("step_breakdown", args, checks, {"schemes": f"{header}\n{schemes}", "step": steps,
                                                   "attention": attention}, started,
                  shape=vars(shape), bandwidths_gbs=spread_record(gb), rows=records)


if __name__ == "__main__":
    sys.exit(main())
