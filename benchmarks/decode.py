"""Decode paths to ExecuTorch/XNNPACK on the SmolLM2-135M shape (fp32, random weights), side by side.

Rows: (a) etblocks (swap + export), (b) transformers' static-cache export (token-by-token prefill), (c) ExecuTorch's
llama example (custom SDPA and KV cache), (d) transformers' ExecutorchExporter (prefill.pte + decode.pte), (e) eager
PyTorch (not run by default), (f) llama.cpp on the same weights as an F32 GGUF with an F32 KV cache (`llamacpp`; needs
the `bench` extra, else the row says so). Each row is exported, then timed in a fresh process in `--rounds`
interleaved rounds (each round starting one row later) of one untimed prefill, one timed prefill of the prompt and
`--decode-steps` greedy steps (`harness`): decode and prefill tok/s, export seconds, .pte MB, ratios to (a), decode as
% of the memory roofline. Every row's greedy tokens must equal eager transformers' `generate()` on the same weights,
or the script exits 1. Results: benchmarks/results/decode.json.

    python benchmarks/decode.py            # 30 layers, rows a-d and f
    python benchmarks/decode.py --smoke    # 1 layer, rows a and b, 1 round

To add a row, write a `(Bench, Row) -> Driver` function (export, fill in `row.export_s` and `row.pte_mb`, return a
`RebuiltWhenPickled` driver) and add a `PathSpec` to `PATHS`; raise `Unavailable` when it cannot run here.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Bench,
    Checks,
    Driver,
    EagerDriver,
    PathSpec,
    RebuiltWhenPickled,
    Row,
    argmax_last,
    build_hf_model,
    check_rows,
    describe_run,
    eager_reference_tokens,
    export_hf_static,
    export_llama_example,
    export_with_etblocks,
    finish,
    format_table,
    load_method,
    make_bench,
    paired_median,
    parse_args,
    pte_megabytes,
    row_record,
    rows_ratio,
    run_method,
    run_paths,
    select_paths,
    spread_record,
    target_line,
)
from llamacpp import llama_cpp_path

SMOKE = {"shape": "tiny", "layers": 1, "rows": "a,b", "rounds": 1, "decode_steps": 4, "prompt_len": 8, "max_seq_len": 32}


class GenerationExportDriver(RebuiltWhenPickled):
    """transformers' `export_for_generation` programs: `prefill(input_ids, position_ids, cache...)` and
    `decode(input_ids, attention_mask, position_ids, cache...)`, the StaticCache's tensors flattened as
    graph inputs and returned as outputs, which the next call takes back."""

    def __init__(self, prefill_path: Path, decode_path: Path, prefill_leaves: int, decode_leaves: int, layers: int,
                 max_cache_len: int):
        self.prefill_method = load_method(prefill_path)
        self.decode_method = load_method(decode_path)
        self.prefill_leaves, self.decode_leaves = prefill_leaves, decode_leaves
        self.layers, self.max_cache_len = layers, max_cache_len
        self.cache: list[torch.Tensor] = []

    def prefill(self, prompt: list[int]) -> int:
        ids = torch.tensor([prompt], dtype=torch.long)
        positions = torch.arange(len(prompt), dtype=torch.long)[None]
        write_pointers = [torch.tensor(0, dtype=torch.long) for _ in range(self.layers)]
        outputs = run_method(self.prefill_method, [ids, positions, *write_pointers])
        logits, *self.cache = outputs[-self.prefill_leaves :]
        return argmax_last(logits)

    def decode(self, token: int, pos: int) -> int:
        mask = (torch.arange(self.max_cache_len) <= pos)[None, None, None]
        inputs = [torch.tensor([[token]], dtype=torch.long), mask, torch.tensor([[pos]], dtype=torch.long)]
        outputs = run_method(self.decode_method, [*inputs, *self.cache])
        logits, *self.cache = outputs[-self.decode_leaves :]
        return argmax_last(logits)


# --------------------------------------------------------------------------------------------------
# Paths: one function per row, `(bench, row) -> Driver`: export, fill in export_s and pte_mb, load


def path_etblocks(bench: Bench, row: Row) -> Driver:
    """(a) etblocks: swap the transformers model's blocks, export to XNNPACK, `forward(tokens, input_pos)`."""
    driver, _ = export_with_etblocks(bench, row, build_hf_model, "a_etblocks.pte")
    return driver


def path_hf_static(bench: Bench, row: Row) -> Driver:
    """(b) transformers `TorchExportableModuleForDecoderOnlyLM` lowered to XNNPACK (`harness.export_hf_static`)."""
    return export_hf_static(bench, row)


def path_llama_example(bench: Bench, row: Row) -> Driver:
    """(c) ExecuTorch's llama example as export_llama_lib runs it for XNNPACK fp32 with `--use_sdpa_with_kv_cache
    --xnnpack-extended-ops`: custom SDPA + custom KV cache, strict export with a dynamic token dim,
    RemoveRedundantTransposes, lowering, and ExecutorchBackendConfig(alloc_graph_input=False,
    ConstraintBasedSymShapeEvalPass), all through its LLMEdgeManager."""
    return export_llama_example(bench, row, "c_llama_example.pte")


def path_hf_exporter(bench: Bench, row: Row) -> Driver:
    """(d) transformers `ExecutorchExporter().export_for_generation`: captures a real static-cache `generate()`
    and exports `prefill` (static prompt length) and `decode` programs, each a separate .pte with its own
    copy of the weights, the KV cache passed in and out as graph inputs/outputs."""
    from transformers import GenerationConfig
    from transformers.exporters import ExecutorchExporter
    from transformers.exporters.configs import ExecutorchConfig
    from transformers.exporters.metadata import load_treespec

    row.note = "prefill.pte + decode.pte (weights twice); prefill static at the prompt length, full logits"
    s = bench.shape
    model = build_hf_model(bench)
    ids = torch.tensor([bench.prompt], dtype=torch.long)
    out = bench.out_dir / "d_hf_exporter"
    start = time.perf_counter()
    exported = ExecutorchExporter().export_for_generation(
        model,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        config=ExecutorchConfig(backend="xnnpack"),
        generation_config=GenerationConfig(cache_implementation="static", max_cache_len=s.max_seq_len),
    )
    exported.save_pretrained(out)
    row.export_s = time.perf_counter() - start
    leaves = {name: load_treespec(c.metadata.out_spec).num_leaves for name, c in exported.components.items()}
    del model, exported
    gc.collect()
    row.pte_mb = pte_megabytes(out / "prefill.pte", out / "decode.pte")
    return GenerationExportDriver(
        out / "prefill.pte", out / "decode.pte", leaves["prefill"], leaves["decode"], s.layers, s.max_seq_len
    )


def path_eager(bench: Bench, row: Row) -> Driver:
    """(e) eager PyTorch transformers with a DynamicCache: a reference, nothing exported."""
    row.note = "no export"
    return EagerDriver(build_hf_model, bench)


PATHS: list[PathSpec] = [
    PathSpec("a", "etblocks xnnpack", path_etblocks),
    PathSpec("b", "transformers static-cache export", path_hf_static),
    PathSpec("c", "ExecuTorch llama example", path_llama_example),
    PathSpec("d", "transformers ExecutorchExporter", path_hf_exporter),
    PathSpec("e", "eager PyTorch (reference)", path_eager, default=False),
    PathSpec("f", "llama.cpp F32", llama_cpp_path("F32")),
]


def format_targets(rows: list[Row], rooflines: list[float]) -> str:
    """PASS/FAIL/n/a for the project's targets on row (a), judged on the median of per-round ratios
    (`rooflines`: the roofline tok/s of each round)."""
    by_key = {r.key: r for r in rows if r.status == "ok"}
    a, b, c, f = by_key.get("a"), by_key.get("b"), by_key.get("c"), by_key.get("f")
    roofline_share = paired_median(a.decode_runs, rooflines) if a else None
    return "\n".join([
        "targets (median of per-round ratios):",
        target_line("(a) decode / (c) decode", rows_ratio(a, c, "decode_runs"), 1.0),
        target_line("(a) decode % roofline", 100 * roofline_share if roofline_share else None, 80, "%"),
        target_line("(a) prefill / (b) prefill", rows_ratio(a, b, "prefill_runs"), 20),
        target_line("(a) prefill / (c) prefill", rows_ratio(a, c, "prefill_runs"), 1.1),
        target_line("(a) decode / (f) llama.cpp decode", rows_ratio(a, f, "decode_runs"), 1.0),
        target_line("(a) prefill / (f) llama.cpp prefill", rows_ratio(a, f, "prefill_runs"), 1.0),
    ])


# --------------------------------------------------------------------------------------------------
# Main


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv, PATHS, __doc__, "decode", SMOKE)
    specs = select_paths(args.rows, PATHS)
    bench = make_bench(args)
    reference = eager_reference_tokens(bench)
    rows, bandwidths = run_paths(specs, bench, keep_files=args.out_dir is not None, warm_prefill=True)
    weight_bytes = bench.shape.weight_bytes_per_token()
    roofline_tps = statistics.median(bandwidths) / weight_bytes

    header = describe_run("LLM decode paths", bench, bandwidths)
    table = format_table(rows, roofline_tps, reference)
    notes = [f"  ({r.key}) {r.note}" for r in rows if r.note and r.status == "ok"]
    notes.append("  tokens=eager: leading greedy tokens equal to eager transformers generate() (same weights)")
    targets = format_targets(rows, [b / weight_bytes for b in bandwidths])
    print(header)
    print(table)
    print("notes:\n" + "\n".join(notes))
    print(targets)
    checks = Checks()
    check_rows(checks, rows, reference, "eager")
    return finish("decode", args, checks, {"decode": "\n".join([header.strip(), table, "notes:", *notes, targets])},
                  started, shape=vars(bench.shape), prompt=bench.prompt, reference_tokens=reference,
                  bandwidths_gbs=spread_record([b / 1e9 for b in bandwidths]), roofline_tps=roofline_tps,
                  rows=[row_record(r) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
