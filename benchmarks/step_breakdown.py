"""Where a decode step's time goes, by subtraction: XNNPACK's linears alone per weight scheme, then an 8da4w step
built up from them block by block.

`decode_profile.py` splits a step with ETDump, but profiling adds time to every event it records (a 4.2 ms step
profiles at 7.7 ms), so its split overstates the small per-call costs. Here every part is timed unprofiled, as a
program of its own: one token through `--layers` decoder layers of the SmolLM2-135M shape (q, k, v, o, gate, up,
down) and the lm_head, called with `x [1, 1, hidden]` and its position. Rows:

  linears alone, one XNNPACK delegate per program, chained as a decoder chains them
  (`x += o(q(x) + [k(x), v(x), k(x)])`, `x += down(silu(gate(x)) * up(x))`), quantized with the torchao configs of
  `etblocks.export`:
    a  fp32
    b  8da8w       int8 weights per output channel, int8 dynamic activations
    c  8da4w g32   int4 weights in groups of 32 (`etblocks.export(quantize_weights="8da4w")`'s default)
    d  8da4w g192  groups of 192, the largest dividing both 576 and 1536: 9% fewer bytes than g32
  the 8da4w g32 step built up from (c), lowered after the graph rewrites `etblocks.export` applies for XNNPACK (its
  RMSNorms stay inside the delegate):
    e  + RMSNorm   before the attention and the MLP, as in Llama
    f  + attention  etblocks' `Attention` instead of `o(q(x) + ...)`: rope (its tables computed once per step and
                   shared by the layers, as a swapped transformers model computes them), `StaticKVCache` written by
                   `llama::update_cache`, `CustomSDPA` (`llama::custom_sdpa`), as `swap(backend="xnnpack")` builds it;
                   the cache ops run on CPU, so the program has one delegate per layer
    g  etblocks' program  a transformers Llama swapped and exported by etblocks (`quant.py`'s row (e)); adds the
                   embedding and transformers' layer code, called with a token instead of `x`
  the attention's CPU kernels alone, beside (f) - (e):
    h  cache + SDPA kernels  per layer the `StaticKVCache`'s two `llama::update_cache` writes and `CustomSDPA`'s
                   `llama::custom_sdpa` (ExecuTorch's kernels), no linears, no rope, no delegate; the caches stay
                   in the CPU caches from call to call, which a real step's weights would evict

All programs are exported, then loaded in a fresh process (`decode.time_in_fresh_process` says why) and timed in
`--rounds` interleaved rounds of `--calls` calls each at positions 64 on (as `quant.py` decodes after its 64-token
prompt), through etblocks' `run_method`, the read bandwidth sampled every round (`decode.py`). Columns: the MB
of weights a call reads (`quant.py`'s count), ms per call (median [min-max]), those MB over that time in GB/s and as %
of the round's bandwidth (median of per-round ratios), the ms over the row above (median of per-round differences,
second table) and the ms relative to (c). A row's share of the bandwidth caps every program built on it: (c)'s is
the most an 8da4w step with these kernels can reach here.

    python benchmarks/step_breakdown.py                    # 30 layers: eight exports (~16 min), then timing
    python benchmarks/step_breakdown.py --layers 2 --rounds 2 --calls 10   # smoke run, ~2 min

Full default run (etblocks 3bce177 + the graph rewrites above, before rope was computed once per step in (f), before
row (h) and before fresh-process timing; this project's 2-core machine, 21 min; read bandwidth 36.0 GB/s, median of
the rounds [35.5-36.6]):

    linears alone, per weight scheme
    program         weights MB                 ms/call  GB/s  % of bandwidth  ms/(c)  export s
    (a) fp32             537.9  16.511 [16.458-17.254]  32.6             90%   6.55x        28
    (b) 8da8w            135.3     4.969 [4.575-5.377]  27.2             76%   1.97x       120
    (c) 8da4w g32         75.6     2.521 [2.439-2.709]  30.0             83%   1.00x       119
    (d) 8da4w g192        68.6     2.337 [2.283-2.631]  29.4             82%   0.93x       117

    the 8da4w g32 step built up from its linears
    program                weights MB              ms/call  GB/s  % of bandwidth  ms over above  ms/(c)  export s
    (c) 8da4w g32                75.6  2.521 [2.439-2.709]  30.0             83%              -   1.00x       119
    (e) + RMSNorm                75.6  3.047 [2.864-3.445]  24.8             68%         +0.546   1.21x       140
    (f) + attention              75.6  4.211 [4.062-4.618]  18.0             50%         +1.276   1.67x       169
    (g) etblocks' program        75.6  4.581 [4.276-5.021]  16.5             46%         +0.262   1.82x       294

Reading: the int4 linears alone read their weights at ~83% of the bandwidth, and g192's 9% fewer bytes buy only
0.93x: at one token the kernels are not bound by the bytes alone. The rest of the step costs 0.8x as much again,
paid per operator rather than per byte: 60 RMSNorms (~6 small XNNPACK operators each) 0.55 ms; the attention 1.28
ms, ~43 us per layer (rope, two `llama::update_cache` writes, `llama::custom_sdpa`, one delegate per layer); the
embedding, transformers' layer code and the token input 0.26 ms. fp32's 7x more bytes hide the same costs (90% for
its linears). The host swings these figures by +-20% from run to run (an earlier run without the graph rewrites,
bandwidth 33.3 GB/s, timed (c) at 3.02 ms and (g) at 5.87 ms), so compare rows within one run.

A full run of this version (etblocks 5beaa73) met a host running 2-4x slower than in the run above ((c) 9.5 ms
[4.7-13.4], quant.py's (e) program 6.1-10.5 ms a step right after it, against 4.7-5.9 an hour before), so its
milliseconds are not comparable. Within it, (h), the attention's CPU kernels alone, came to 64% of the attention's
increment (f) - (e) (median of per-round ratios; 52% in a 2-layer smoke run): the cache writes and
`llama::custom_sdpa` (which spends its time in MKL's generic sgemv on this AMD host) are half or more of the
attention's cost, rope and the delegate boundaries around them the rest.

Both runs predate the XNNPACK rewrites that took operators out of every layer (`etblocks.backends.passes`): each
RMSNorm's mean and its eps as one linear (5 delegated operators per norm, not 8), the rope rotation as a linear on
`[B, T, H, D]` (no views around it), and the rope tables' views that every layer repeated merged into one (41
delegated operators per layer, not 55). Rows (e)-(g) lower with them now. They bought no speed above the noise:
timed against the program before them in 15 interleaved rounds (30 layers, fresh processes, on the host below), a
step took 13.56 against 13.48 ms; a program of small delegated elementwise operators timed alone puts one at ~0.44
us, so the ~420 operators they remove are worth ~0.19 ms.

On an AVX2-only EPYC of the same machine kind (2026-12-02: no AVX-512 or VNNI, read bandwidth 18-25 GB/s,
`describe_cpu` heads the output), partial runs of (b)-(e) timed the linears alone at 9.7-11.6 ms for (b) (~60% of
the bandwidth), 8.1-10.9 ms for (c) (~40%) and 6.6-8.5 ms for (d), and (e) at 9.3-10.1 ms. `perf` puts the time in
XNNPACK's AVX2 qd8-f32-qb4w GEMM (per-block scales, 16-bit multiply-adds): compute-bound at one token, so on such
a host no 8da4w program built on ExecuTorch 1.5.1's XNNPACK kernels reaches 50% of its roofline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from decode import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Bench,
    Row as DecodeRow,
    Shape,
    _paired_median,
    _spread,
    aligned_table,
    build_hf_model,
    export_with_etblocks,
    describe_cpu,
    in_fresh_process,
    load_method,
    lower_to_xnnpack,
    measure_read_bandwidth,
)
from quant import GROUP_SIZE, weight_bytes_per_token

from etblocks.attention import Attention, CustomSDPA
from etblocks.attention.rope import RotaryEmbedding, default_inv_freq
from etblocks.backends import get_backend
from etblocks.export.runner import run_method
from etblocks.export.weights import WeightQuantization
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

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        position_embeddings = self.rope(input_pos) if self.rope is not None else None
        for layer in self.layers:
            h = layer["attention_norm"](x) if "attention_norm" in layer else x
            if "attention" in layer:
                x = x + layer["attention"](h, input_pos, position_embeddings)
            else:
                x = x + layer["o"](layer["q"](h) + torch.cat((layer["k"](h), layer["v"](h), layer["k"](h)), dim=-1))
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

    @property
    def ms(self) -> float:
        return statistics.median(self.ms_runs)


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
            exported = torch.export.export(module, (*inputs, torch.tensor([START_POS])))
        get_backend("xnnpack").apply_passes(exported)  # as etblocks.export lowers: the RMSNorms stay in the delegate
        lower_to_xnnpack(exported, path)
    mb = 0.0 if part.attention_ops else weight_bytes_per_token(shape, part.quantize, part.group_size or GROUP_SIZE) / 1e6
    program = Program(part, mb, time.perf_counter() - start, path, inputs)
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
        share = _paired_median([p.mb / ms for ms in p.ms_runs], [b / 1e9 for b in bandwidths])  # MB/ms = GB/s
        cells = [f"({p.part.key}) {p.part.name}", f"{p.mb:.1f}", _spread(p.ms_runs, ".3f"), f"{p.mb / p.ms:.1f}",
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
    lines = [[f"({p.part.key}) {p.part.name}", _spread(p.ms_runs, ".3f"), f"{1e3 * p.ms / layers:.1f}",
              f"{statistics.median(a / b for a, b in zip(p.ms_runs, increment)):.0%}"] for p in programs]
    return aligned_table(["program", "ms/call", "us per layer", "of (f) - (e)"], lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (2 for a smoke run)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds; medians are reported")
    parser.add_argument("--calls", type=int, default=64, help="timed calls per program per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = Shape(layers=args.layers)
    if START_POS + args.calls > shape.max_seq_len:
        raise SystemExit(f"--calls {args.calls}: positions from {START_POS} must stay below the context "
                         f"{shape.max_seq_len}")
    with tempfile.TemporaryDirectory(prefix="etblocks_step_breakdown_") as out_dir:
        programs = [build(part, shape, args.seed, Path(out_dir))
                    for part in (*SCHEME_PARTS, *STEP_PARTS, *ATTENTION_PARTS)]
        programs, bandwidths = in_fresh_process(time_programs, programs, args.rounds, args.calls)
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    by_key = {p.part.key: p for p in programs}
    reference = by_key[REFERENCE_KEY]
    gb = [b / 1e9 for b in bandwidths]
    print(f"\nOne decode token through {shape.layers} layers of the SmolLM2-135M shape (hidden {shape.hidden}, "
          f"{shape.heads}/{shape.kv_heads} heads, intermediate {shape.intermediate}) and the lm_head ({shape.vocab} x "
          f"{shape.hidden}), XNNPACK; {args.rounds} interleaved rounds of {args.calls} calls at positions "
          f"{START_POS}-{START_POS + args.calls - 1}, medians [min-max]; {_threadpool_get_thread_count()} ExecuTorch "
          "threads")
    print(describe_cpu())
    print(f"read bandwidth {statistics.median(gb):.1f} GB/s [{min(gb):.1f}-{max(gb):.1f}] (torch.sum over 1 GB of "
          "random fp32, sampled every round)\n")
    print("linears alone, per weight scheme")
    print(table([by_key[p.key] for p in SCHEME_PARTS], bandwidths, reference, increments=False))
    print("\nthe 8da4w g32 step built up from its linears")
    print(table([reference, *(by_key[p.key] for p in STEP_PARTS)], bandwidths, reference, increments=True))
    increment = [f - e for f, e in zip(by_key["f"].ms_runs, by_key["e"].ms_runs)]
    print(f"\nthe attention's CPU kernels alone ({shape.layers} x two llama::update_cache + llama::custom_sdpa), beside "
          f"the attention's increment (f) - (e), {statistics.median(increment):.3f} ms")
    print(attention_table([by_key[p.key] for p in ATTENTION_PARTS], increment, shape.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
