"""MLA: the latent cache's bytes, and decode time against the context (absorbed, expanded, transformers eager).

Part 1: KV-cache bytes per token and layer at DeepSeek-V3's attention dimensions (bf16), read off real cache buffers:
etblocks' latent cache against a full per-head K/V cache. Part 2: decode ms per token at each `--contexts` length on
a small DeepSeek-V3-shaped model (random weights, fp32): (a) etblocks absorbed (W_UK folded into the query), (b)
etblocks expanded (kv_b_proj re-expands the cached latents every step), both exported to XNNPACK with a cache of
exactly the context plus the timed steps, (c) transformers eager, and (d) row (a) exported without
`fold_weight_views`, so its program slices and transposes kv_b_proj.weight into W_UK and W_UV^T on every step
(etblocks' absorbed program before that pass): (d)'s ratio is the pass's speed-up, measured in the same rounds.
The .pte sizes of the exported rows go in the results too. Every row's greedy tokens (prefill, then `--steps`
steps) must equal transformers' `generate()` before the row is timed: rows (a), (b) and (d) set `absorb` on the
swapped blocks after the swap's probe, so their programs are checked here, and a row that disagrees is not timed
and the script exits 1. Rows are timed in a fresh process (`harness.in_fresh_process`), in `--rounds` interleaved
rounds; cells are medians [min-max] of the rounds. Results: benchmarks/results/mla.json.

    python benchmarks/mla.py            # 4 layers, contexts 64, 256, 1024
    python benchmarks/mla.py --smoke    # 1 layer, context 16, 1 round
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import etblocks
from etblocks.attention.mla import MLAttention
from etblocks.state import StaticKVCache

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Checks,
    add_run_args,
    aligned_table,
    check_tokens,
    finish,
    in_fresh_process,
    parse_with_smoke,
    spread,
    spread_record,
)

V3_ATTENTION = dict(n_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def cache_bytes_per_token() -> tuple[int, int]:
    """(latent, full per-head) bytes one token adds to one layer's cache, from allocated buffers."""
    a = V3_ATTENTION
    positions = 16
    latent = StaticKVCache(1, positions, 1, a["kv_lora_rank"], torch.bfloat16, v_head_dim=a["qk_rope_head_dim"])
    full = StaticKVCache(
        1, positions, a["n_heads"], a["qk_nope_head_dim"] + a["qk_rope_head_dim"], torch.bfloat16,
        v_head_dim=a["v_head_dim"],
    )

    def per_token(cache: StaticKVCache) -> int:
        return sum(b.numel() * b.element_size() for b in (cache.k_cache, cache.v_cache)) // positions

    return per_token(latent), per_token(full)


def small_model(layers: int, max_positions: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=192, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, head_dim=32, first_k_dense_replace=layers,
        max_position_embeddings=max_positions, initializer_range=0.1, pad_token_id=0, eos_token_id=None,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@contextlib.contextmanager
def weights_sliced_per_call():
    """etblocks' export without `fold_weight_views` (row d): the program reads W_UK and W_UV^T as slices of
    kv_b_proj.weight on every call."""
    from etblocks.backends import passes

    fold = passes.fold_weight_views
    passes.fold_weight_views = lambda exported: 0
    try:
        yield
    finally:
        passes.fold_weight_views = fold


def export_row(model, absorb: bool, max_seq_len: int, out: Path, fold: bool = True) -> etblocks.ExportResult:
    """Swap `model` for XNNPACK, set `absorb` on its MLA blocks, export it to `out`."""
    etblocks.swap(model, backend="xnnpack", max_seq_len=max_seq_len)
    for block in model.modules():
        if isinstance(block, MLAttention):
            block.absorb = absorb
    with contextlib.nullcontext() if fold else weights_sliced_per_call():
        return etblocks.export(model, backend="xnnpack", out=out)


class ProgramRow:
    def __init__(self, path: Path) -> None:
        self.runner = etblocks.Runner(path)

    def time_decode(self, prompt: list[int], steps: int) -> tuple[float, list[int]]:
        """Prefill, then `steps` timed greedy steps: the median seconds per step and the greedy tokens (the
        prefill's and one per step)."""
        self.runner.reset()
        logits = self.runner.forward(prompt)
        times, tokens = [], [int(torch.argmax(logits))]
        for _ in range(steps):
            start = time.perf_counter()
            logits = self.runner.forward([tokens[-1]])
            times.append(time.perf_counter() - start)
            tokens.append(int(torch.argmax(logits)))
        return statistics.median(times), tokens


class EagerRow:
    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def time_decode(self, prompt: list[int], steps: int) -> tuple[float, list[int]]:
        out = self.model(torch.tensor([prompt]), use_cache=True)
        cache, times, tokens = out.past_key_values, [], [int(out.logits[0, -1].argmax())]
        for _ in range(steps):
            start = time.perf_counter()
            out = self.model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
        return statistics.median(times), tokens


def time_rows(programs: dict[tuple[str, int], Path], model_args: tuple[int, int], prompts: dict[int, list[int]],
              references: dict[int, list[int]], steps: int, rounds: int):
    """The rows, in a fresh process as decode.py and quant.py time theirs (`harness.in_fresh_process`: programs
    loaded anew, MKL on one thread). Every row's greedy tokens are checked first, untimed: a program made with
    `absorb` set after the swap's probe is timed only once they equal transformers'. The eager row's model is
    built anew from `small_model(*model_args)` (seeded; its tokens are checked as the programs' are). Returns the
    checks, the tokens and the per-round ms by (row, context)."""
    base = small_model(*model_args)
    rows = {key: ProgramRow(path) for key, path in programs.items()} | {("c", c): EagerRow(base) for c in prompts}
    checks, tokens = [], {}
    for (key, c), row in list(rows.items()):
        _, tokens[key, c] = row.time_decode(prompts[c], steps)
        checks.append(check_tokens(f"{key}@{c}", tokens[key, c], references[c], "transformers"))
        if not checks[-1].ok:
            del rows[key, c]
    samples = {key: [] for key in rows}
    for _ in range(rounds):
        for (key, c), row in rows.items():
            samples[key, c].append(1e3 * row.time_decode(prompts[c], steps)[0])
    return checks, tokens, samples


@torch.no_grad()
def reference_tokens(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy `generate()`: the prefill's token and one per decode step."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, do_sample=False)
    return out[0, len(prompt):].tolist()


SMOKE = {"layers": 1, "contexts": "16", "steps": 4, "rounds": 1}


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per context and round")
    parser.add_argument("--rounds", type=int, default=3)
    add_run_args(parser, "mla", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    contexts = [int(c) for c in args.contexts.split(",")]

    latent, full = cache_bytes_per_token()
    a = V3_ATTENTION
    cache_lines = [
        f"KV cache per token and layer, DeepSeek-V3 attention ({a['n_heads']} heads, kv_lora_rank {a['kv_lora_rank']}, "
        f"rope {a['qk_rope_head_dim']}, nope {a['qk_nope_head_dim']}, v {a['v_head_dim']}), bf16:",
        f"  etblocks latent cache    {latent:>7} bytes",
        f"  full per-head K/V cache  {full:>7} bytes  ({full / latent:.1f}x the latent)",
        f"  61 layers x 4096 tokens: {61 * 4096 * latent / 2**30:.2f} GiB vs {61 * 4096 * full / 2**30:.2f} GiB",
    ]
    print("\n".join(cache_lines) + "\n")

    # Each exported program's cache holds exactly the context plus the timed steps: a static cache is attended
    # (absorbed) or expanded (non-absorbed) over all its rows, so its length is the context being measured.
    max_positions = max(contexts) + args.steps + 1
    base = small_model(args.layers, max_positions)
    vocab = base.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = {c: torch.randint(3, vocab, (c,), generator=generator).tolist() for c in contexts}
    references = {c: reference_tokens(base, prompts[c], args.steps) for c in contexts}
    paths = {"a": ("etblocks absorbed (xnnpack)", True, True), "b": ("etblocks expanded (xnnpack)", False, True),
             "d": ("etblocks absorbed, weights sliced per call", True, False)}
    names = {key: name for key, (name, _, _) in paths.items()} | {"c": "transformers eager"}
    names = {key: names[key] for key in sorted(names)}
    checks = Checks()
    samples: dict[str, dict[int, list[float]]] = {key: {c: [] for c in contexts} for key in names}
    tokens: dict[str, dict[int, list[int]]] = {key: {} for key in names}
    with tempfile.TemporaryDirectory() as tmp:
        exported = {}
        for key, (name, absorb, fold) in paths.items():
            for c in contexts:
                try:
                    exported[key, c] = export_row(copy.deepcopy(base), absorb, c + args.steps + 1,
                                                  Path(tmp) / f"{key}_{c}.pte", fold)
                except Exception as e:  # one broken row must not hide the others
                    checks.fail(f"({key}) {name}, context {c}: export failed: {type(e).__name__}: {e}")
        pte_mb = {key: result.size_mb for key, result in exported.items()}
        programs = {key: result.path for key, result in exported.items()}
        row_checks, row_tokens, row_samples = in_fresh_process(
            time_rows, programs, (args.layers, max_positions), prompts, references, args.steps, args.rounds)
    for check in row_checks:
        checks.add(check)
    for (key, c), found in row_tokens.items():
        tokens[key][c] = found
    for (key, c), found in row_samples.items():
        samples[key][c] = found

    medians = {key: {c: statistics.median(v) if v else None for c, v in per.items()} for key, per in samples.items()}
    first, last = contexts[0], contexts[-1]
    reference = medians["a"]
    title = (f"decode ms/token on a {args.layers}-layer DeepSeek-V3-shaped model (hidden 512, 16 heads, kv_lora_rank "
             f"256), medians [min-max] of {args.rounds} rounds, each the median of {args.steps} steps; (ratio to a)")
    lines = []
    for key, per in samples.items():
        cells = []
        for c in contexts:
            ms, ref = medians[key][c], reference[c]
            cells.append("not timed" if ms is None else
                         f"{spread(per[c], '.2f')} ({ms / ref:.1f}x)" if ref else spread(per[c], ".2f"))
        growth = medians[key][last] / medians[key][first] if medians[key][last] and medians[key][first] else None
        lines.append([f"({key}) {names[key]}", *cells, "-" if growth is None else f"{growth:.2f}x"])
    table = aligned_table(["path", *(f"ctx {c}" for c in contexts), f"growth {first}->{last}"], lines)
    print(title)
    print(table)
    records = [{"key": key, "name": names[key], "context": c, "tokens": tokens[key].get(c), "pte_mb": pte_mb.get((key, c)),
                "timings": {"decode_ms": spread_record(samples[key][c])}} for key in names for c in contexts]
    return finish("mla", args, checks, {"cache": "\n".join(cache_lines), "decode": f"{title}\n{table}"}, started,
                  cache_bytes_per_token={"latent": latent, "full": full}, reference_tokens=references,
                  rows=records)


if __name__ == "__main__":
    sys.exit(main())
