"""Decode at long contexts (256, 2048 and 8192 positions), fp32 against int8 KV caches: etblocks beside ExecuTorch's
llama example.

At context 256 the weights are most of what a decode step reads; at 2k-8k the KV cache read rivals them (SmolLM2-135M
shape, fp32: 377 MB of fp32 cache at 8192 positions against 540 MB of weights), which is where an int8 cache (D + 5
bytes a row, a scale and zero point per token and head, instead of 4D) should pay.

Rows (`--rows`), on the SmolLM2-135M shape (30 layers, fp32 weights, random, built as decode.py builds them), XNNPACK:
(a) etblocks, fp32 KV cache (decode.py's row a); (b) etblocks, int8 KV cache (`swap(kv_quantize="int8")`, quant.py's
row b); (c) ExecuTorch's llama example, custom SDPA + custom KV cache, fp32 (decode.py's row c,
`harness.export_llama_example`); (d) (c) with its int8 KV cache, as export_llama_lib's `--quantize_kv_cache` makes it
(`replace_kv_cache_with_quantized_kv_cache`, then `replace_sdpa_with_quantized_sdpa`: `llama::custom_quantized_sdpa`
over the int8 rows; the same layout and bytes as (b)); (e) llama.cpp on the same weights as an F32 GGUF with an f32 KV
cache, (f) the same with a q8_0 KV cache (34 bytes per 32 values, within 2% of (b)'s bytes; flash attention, which
llama.cpp needs for it) (`llamacpp`; they need the `bench` extra, else they say so).

Method: each row is exported once, its caches sized to the largest context (`--max-seq-len`, default the largest of
`--contexts`); etblocks' dynamic program and ExecuTorch's custom SDPA read only the filled positions, so one program
serves every context. For each context C of `--contexts`, the prompt is the first C - `--decode-steps` - 8 tokens of
one seeded prompt (prefill fills most of the context; the decode steps end 8 short of C; `--prompt-len` is refused);
each context is timed in a fresh process of its own (`harness.time_in_fresh_process`: programs loaded anew, MKL on one
thread) in `--rounds` interleaved rounds, each starting one row later, of an untimed prefill, a timed prefill and
`--decode-steps` timed greedy steps. Reported per context: decode and prefill tok/s (medians [min-max]), the ratios
(b)/(a), (d)/(c), (a)/(c), (a)/(e) and (f)/(e) (medians of per-round ratios), and each cache's decode roofline: the
read bandwidth sampled every round over the bytes a decode step reads (`harness.bytes_per_token`: fp32 linears and
lm_head, plus the cache's bytes per position, `harness.kv_bytes_per_position`, at the mean decode position).

Target: (b) int8 KV / (a) fp32 KV decode >= 1.2x at the largest context (PASS/FAIL on the median of per-round ratios).

Tokens, at every context: the fp32-cache rows (a), (c) and (e) must equal eager transformers' `generate()` on the same
weights, every token; the int8-cache rows (b), (d) and (f) must agree with it on the first `--quantized-min-match`
(default 1), the rule quant.py applies to its int8-KV row (b) (a quantized row agrees on the first
`--quantized-min-match` greedy tokens: random weights give flat distributions that the cache's rounding tips), and
their agreement is printed; otherwise the script exits 1. Results: benchmarks/results/long_context.json.

    python benchmarks/long_context.py            # 30 layers, contexts 256, 2048, 8192 (caches of 8192), rows a-f
    python benchmarks/long_context.py --smoke    # tiny shape, 1 layer, contexts 16 and 32 (caches of 64), 1 round
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Deferred,
    Bench,
    Checks,
    Driver,
    Option,
    PathSpec,
    Row,
    add_run_args,
    aligned_table,
    argument_parser,
    build_hf_model,
    bytes_per_token,
    check_rows,
    describe_run,
    eager_reference_tokens,
    export_llama_example,
    finish,
    format_table,
    make_bench,
    matching_prefix,
    paired_median,
    parse_with_smoke,
    prepare_path,
    row_record,
    select_paths,
    spread_record,
    time_in_fresh_process,
)
from llamacpp import llama_cpp_path
from quant import speed_path  # etblocks' swap + export with an `Option`'s cache and weights

FP32_KV = Option("a", "fp32 KV")
INT8_KV = Option("b", "int8 KV", kv_quantize="int8")  # quant.py's row (b)
KV_CACHES = (FP32_KV, INT8_KV)
PROMPT_MARGIN = 8  # positions left free after the last decode step
TARGET_RATIO = 1.2  # (b) / (a) decode at the largest context
BYTES_READ = "MB read/token"
SMOKE = {"shape": "tiny", "layers": 1, "rows": "a,b,c,d", "rounds": 1, "decode_steps": 4, "contexts": "16,32",
         "max_seq_len": 64}

# --------------------------------------------------------------------------------------------------
# Rows


def example_path(filename: str, quantize_kv_cache: bool) -> Callable[[Bench, Row], Driver]:
    """ExecuTorch's llama example (`harness.export_llama_example`), its KV cache in int8 when `quantize_kv_cache`."""

    def path(bench: Bench, row: Row) -> Driver:
        return export_llama_example(bench, row, filename, quantize_kv_cache=quantize_kv_cache)

    return path


PATHS = [
    PathSpec("a", "etblocks, fp32 KV", speed_path(FP32_KV)),
    PathSpec("b", "etblocks, int8 KV", speed_path(INT8_KV)),
    PathSpec("c", "ExecuTorch llama example, fp32 KV", example_path("c_llama_example.pte", False)),
    PathSpec("d", "ExecuTorch llama example, int8 KV", example_path("d_llama_example_int8_kv.pte", True)),
    PathSpec("e", "llama.cpp F32, f32 KV", llama_cpp_path("F32", "f32")),
    PathSpec("f", "llama.cpp F32, q8_0 KV", llama_cpp_path("F32", "q8_0")),
]
# each row's cache: its bytes, whether exact (llama.cpp's q8_0 cache counted at the int8 cache's bytes)
CACHES = {"a": FP32_KV, "b": INT8_KV, "c": FP32_KV, "d": INT8_KV, "e": FP32_KV, "f": INT8_KV}
RATIOS = (("b", "a"), ("d", "c"), ("a", "c"), ("a", "e"), ("f", "e"))

# --------------------------------------------------------------------------------------------------
# Prompts, references, timing


def prompt_length(context: int, decode_steps: int) -> int:
    """The prompt that fills context `context` but for the decode steps and `PROMPT_MARGIN`."""
    return context - decode_steps - PROMPT_MARGIN


def context_prompts(bench: Bench, contexts: Sequence[int]) -> dict[int, list[int]]:
    """Each context's prompt: a prefix of the seeded prompt `make_bench` drew for the largest context."""
    return {context: bench.prompt[:prompt_length(context, bench.decode_steps)] for context in sorted(contexts)}


@torch.no_grad()
def reference_tokens(bench: Bench, prompts: Mapping[int, list[int]]) -> dict[int, list[int]]:
    """Eager transformers' greedy tokens for each context's prompt (one model built for all)."""
    model = build_hf_model(bench)
    return {context: eager_reference_tokens(dataclasses.replace(bench, prompt=prompt), lambda _: model)
            for context, prompt in prompts.items()}


def time_contexts(specs: Sequence[PathSpec], bench: Bench, prompts: Mapping[int, list[int]],
                  keep_files: bool) -> tuple[dict[int, list[Row]], dict[int, list[float]]]:
    """Export every row once (loaded and warmed up here on the shortest prompt, then released), then time each
    context's prompt in a fresh process of its own; returns the rows and the read bandwidths per context. The output
    directory is deleted at the end unless `keep_files`."""
    shortest = dataclasses.replace(bench, prompt=prompts[min(prompts)])
    exported: list[tuple[Row, Deferred | None]] = []
    rows, bandwidths = {}, {}
    try:
        for spec in specs:
            row, driver = prepare_path(spec, shortest)
            exported.append((row, Deferred(driver.__reduce__()) if driver is not None else None))
            del driver
            gc.collect()
        for context, prompt in prompts.items():
            print(f"[long_context bench] context {context}: {len(prompt)}-token prompt, timed in a fresh process",
                  file=sys.stderr, flush=True)
            prepared = [(copy.deepcopy(row), deferred) for row, deferred in exported]
            rows[context], bandwidths[context] = time_in_fresh_process(
                prepared, dataclasses.replace(bench, prompt=prompt), warm_prefill=True)
    finally:
        if not keep_files:
            shutil.rmtree(bench.out_dir, ignore_errors=True)
    return rows, bandwidths


def read_bytes(bench: Bench, prompts: Mapping[int, list[int]]) -> dict[int, dict[str, float]]:
    """Bytes a decode step reads at each context, per cache (`harness.bytes_per_token`), by cache key."""
    return {context: {option.key: bytes_per_token(dataclasses.replace(bench, prompt=prompt), option)
                      for option in KV_CACHES} for context, prompt in prompts.items()}


# --------------------------------------------------------------------------------------------------
# Report


def decode_ratio(rows: Sequence[Row], key: str, ref_key: str) -> float | None:
    """Median of per-round decode ratios of row `key` to row `ref_key`, None without both."""
    by_key = {r.key: r for r in rows if r.status == "ok"}
    if key not in by_key or ref_key not in by_key:
        return None
    return paired_median(by_key[key].decode_runs, by_key[ref_key].decode_runs)


def summary_table(rows: Mapping[int, list[Row]], bandwidths: Mapping[int, list[float]],
                  row_bytes: Mapping[int, Mapping[str, float]], prompts: Mapping[int, list[int]],
                  keys: Sequence[str]) -> str:
    """The long-context table: per context, each row's median decode tok/s, the ratios (medians of per-round ratios)
    and each cache's decode roofline (the per-context tables below give the ranges)."""
    headers = ["context", "prompt", *(f"({k}) decode tok/s" for k in keys), *(f"({k})/({r})" for k, r in RATIOS),
               *(f"{o.name} roofline tok/s" for o in KV_CACHES)]
    lines = []
    for context, context_rows in rows.items():
        bandwidth = statistics.median(bandwidths[context])
        by_key = {r.key: r for r in context_rows}
        ratios = [decode_ratio(context_rows, k, r) for k, r in RATIOS]
        lines.append([
            str(context), str(len(prompts[context])),
            *(f"{by_key[k].decode_tps:.1f}" if by_key[k].decode_tps else by_key[k].status.split(":")[0] for k in keys),
            *("-" if ratio is None else f"{ratio:.2f}x" for ratio in ratios),
            *(f"{bandwidth / row_bytes[context][o.key]:.1f}" for o in KV_CACHES),
        ])
    return aligned_table(headers, lines)


def context_table(context: int, rows: list[Row], bandwidths: list[float], row_bytes: Mapping[str, float],
                  reference: list[int], bench: Bench, prompt: list[int]) -> str:
    """`harness.format_table` of one context (prefill, export, .pte size, % of each cache's roofline, tokens)."""
    rooflines = {}
    for row in rows:
        cache_bytes = row_bytes[CACHES[row.key].key]
        row.extras[BYTES_READ] = f"{cache_bytes / 1e6:.1f}"
        rooflines[row.key] = statistics.median(bandwidths) / cache_bytes
    gb = [b / 1e9 for b in bandwidths]
    title = (f"context {context}: {len(prompt)}-token prompt + {bench.decode_steps} decode steps; read bandwidth "
             f"{statistics.median(gb):.1f} GB/s [{min(gb):.1f}-{max(gb):.1f}]")
    table = format_table(rows, rooflines, reference, ref_key=rows[0].key, reference_label="eager",
                         extra_headers=[BYTES_READ])
    return f"{title}\n{table}"


def agreement(rows: Mapping[int, list[Row]], references: Mapping[int, list[int]]) -> list[str]:
    """How many leading greedy tokens each int8-cache row shares with eager fp32, per context."""
    lines = []
    for key in sorted({r.key for context_rows in rows.values() for r in context_rows}):
        if CACHES[key].exact:
            continue
        cells = [f"{context}: {matching_prefix(r.tokens, references[context])}/{len(references[context])}"
                 for context, context_rows in rows.items() for r in context_rows if r.key == key and r.status == "ok"]
        lines.append(f"  ({key}) leading tokens equal to eager fp32: {', '.join(cells) or '-'}")
    return lines


def format_target(rows: Mapping[int, list[Row]]) -> tuple[str, float | None]:
    """PASS/FAIL of "(b) / (a) decode at the largest context >= 1.2x", and the ratio."""
    largest = max(rows)
    value = decode_ratio(rows[largest], "b", "a")
    label = f"(b) int8 KV / (a) fp32 KV decode at context {largest}"
    if value is None:
        return f"target (median of per-round ratios):\n  n/a   {label} (needs rows a and b)", None
    verdict = "PASS" if value >= TARGET_RATIO else "FAIL"
    return (f"target (median of per-round ratios):\n  {verdict}  {label}: {value:.2f}x (goal >= {TARGET_RATIO}x)",
            value)


# --------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """harness' options, with `--contexts` in place of `--prompt-len` and `--max-seq-len` defaulting to the largest
    context."""
    parser = argument_parser(PATHS, __doc__)
    parser.add_argument("--contexts", default="256,2048,8192",
                        help="comma-separated contexts: each is timed with a prompt of C - decode steps - "
                             f"{PROMPT_MARGIN} tokens")
    parser.add_argument("--quantized-min-match", type=int, default=1,
                        help="leading greedy tokens an int8-cache row must share with eager fp32 (fp32 rows: all)")
    parser.set_defaults(max_seq_len=None, prompt_len=None)
    add_run_args(parser, "long_context", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    args.contexts = sorted({int(c) for c in str(args.contexts).split(",") if c.strip()})
    if args.prompt_len is not None:
        parser.error("--prompt-len: each context sets its own prompt (see --contexts)")
    args.max_seq_len = args.max_seq_len or max(args.contexts)
    if args.max_seq_len < max(args.contexts) or prompt_length(min(args.contexts), args.decode_steps) < 1:
        parser.error(f"contexts {args.contexts} need --max-seq-len >= {max(args.contexts)} and each more than "
                     f"--decode-steps + {PROMPT_MARGIN} positions")
    args.prompt_len = prompt_length(max(args.contexts), args.decode_steps)  # make_bench's prompt: the longest
    return args


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    specs = select_paths(args.rows, PATHS)
    keys = [spec.key for spec in specs]
    bench = make_bench(args)
    prompts = context_prompts(bench, args.contexts)
    references = reference_tokens(bench, prompts)
    row_bytes = read_bytes(bench, prompts)
    rows, bandwidths = time_contexts(specs, bench, prompts, keep_files=args.out_dir is not None)

    largest = max(prompts)
    header = describe_run("Long-context decode, XNNPACK", dataclasses.replace(bench, prompt=prompts[largest]),
                          [b for context in prompts for b in bandwidths[context]]).rstrip("\n")
    header += (f"\ncontexts {', '.join(map(str, prompts))}, each timed in its own fresh process with a prompt of "
               f"C - {bench.decode_steps} - {PROMPT_MARGIN} tokens; every program's caches hold "
               f"{bench.shape.max_seq_len} positions; rooflines: bandwidth / (fp32 weights + the cache at the mean "
               f"decode position)\n")
    summary = summary_table(rows, bandwidths, row_bytes, prompts, keys)
    details = [context_table(context, rows[context], bandwidths[context], row_bytes[context], references[context],
                             bench, prompts[context]) for context in prompts]
    notes = ["notes:", *(f"  ({r.key}) {r.note}" for r in rows[largest] if r.note and r.status == "ok"),
             "  tokens=eager: leading greedy tokens equal to eager transformers generate() (same fp32 weights, no "
             f"int8 cache); fp32-cache rows must agree on all, int8-cache rows on the first {args.quantized_min_match}"
             " (quant.py's rule for its int8-KV row)", *agreement(rows, references)]
    target, target_value = format_target(rows)
    print(header)
    print(summary)
    for detail in details:
        print("\n" + detail)
    print("\n".join(notes))
    print(target)

    checks = Checks()
    required = {key: args.quantized_min_match for key in keys if not CACHES[key].exact}
    for context, context_rows in rows.items():
        check_rows(checks, context_rows, references[context], "eager", required,
                   {key: f"context {context}" for key in keys})
    tables = {"long_context": "\n".join([header, summary, *("\n" + d for d in details), *notes, target])}
    return finish("long_context", args, checks, tables, started, shape=vars(bench.shape), contexts=list(prompts),
                  prompt_lengths={str(c): len(p) for c, p in prompts.items()},
                  reference_tokens={str(c): t for c, t in references.items()},
                  bytes_per_token={str(c): {o.name: b[o.key] for o in KV_CACHES} for c, b in row_bytes.items()},
                  bandwidths_gbs={str(c): spread_record([b / 1e9 for b in bw]) for c, bw in bandwidths.items()},
                  decode_ratios={str(c): {f"{k}/{r}": decode_ratio(rows[c], k, r) for k, r in RATIOS}
                                 for c in rows},
                  target={"ratio": target_value, "goal": TARGET_RATIO, "context": largest},
                  rows={str(c): [row_record(r) for r in context_rows] for c, context_rows in rows.items()})


if __name__ == "__main__":
    sys.exit(main())
