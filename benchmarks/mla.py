"""MLA: what the latent cache saves, and how decode cost grows with the context.

Part 1, KV-cache bytes per token and layer at DeepSeek-V3's attention dimensions (128 heads, kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, bf16), read off real cache buffers: the etblocks latent
cache (what `etblocks.swap` builds for DeepSeek) against a full per-head K/V cache of the same attention.

Part 2, decode time per token at contexts 64, 256 and 1024 on a small DeepSeek-V3-shaped model (random weights,
fp32, dense layers), side by side:
  a  etblocks, exported to XNNPACK, absorbed attention (W_UK folded into the query; the latent is never expanded)
  b  etblocks, exported to XNNPACK, expanded attention (kv_b_proj re-expands every cached latent each step)
  c  transformers eager with its own cache (caches the latent, re-expands the whole cache each step)
Rows a and b are exported once per context with a cache of exactly that context (plus the timed steps): a
static cache is attended or expanded over all its rows. Each context is filled by a prefill, then `--steps`
greedy decode steps are timed; rows are interleaved in `--rounds` rounds and the median per token is
reported, with each row's growth from the shortest to the longest context and its ratio to row a.

    python benchmarks/mla.py               # full run (a few minutes)
    python benchmarks/mla.py --layers 1 --contexts 64,256 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

import etblocks
from etblocks.attention.mla import MLAttention
from etblocks.state import StaticKVCache

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


class ExportedRow:
    def __init__(self, model, absorb: bool, max_seq_len: int, out: Path) -> None:
        etblocks.swap(model, backend="xnnpack", max_seq_len=max_seq_len)
        for block in model.modules():
            if isinstance(block, MLAttention):
                block.absorb = absorb
        start = time.perf_counter()
        self.result = etblocks.export(model, backend="xnnpack", out=out)
        self.export_s = time.perf_counter() - start
        self.runner = etblocks.Runner(self.result.path)

    def time_decode(self, prompt: list[int], steps: int) -> float:
        self.runner.reset()
        logits = self.runner.forward(prompt)
        times = []
        for _ in range(steps):
            token = int(torch.argmax(logits))
            start = time.perf_counter()
            logits = self.runner.forward([token])
            times.append(time.perf_counter() - start)
        return statistics.median(times)


class EagerRow:
    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def time_decode(self, prompt: list[int], steps: int) -> float:
        out = self.model(torch.tensor([prompt]), use_cache=True)
        cache, times = out.past_key_values, []
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            out = self.model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache = out.past_key_values
        return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per context and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]

    latent, full = cache_bytes_per_token()
    a = V3_ATTENTION
    print(
        f"KV cache per token and layer, DeepSeek-V3 attention ({a['n_heads']} heads, kv_lora_rank {a['kv_lora_rank']}, "
        f"rope {a['qk_rope_head_dim']}, nope {a['qk_nope_head_dim']}, v {a['v_head_dim']}), bf16:"
    )
    print(f"  etblocks latent cache    {latent:>7} bytes")
    print(f"  full per-head K/V cache  {full:>7} bytes  ({full / latent:.1f}x the latent)")
    print(f"  61 layers x 4096 tokens: {61 * 4096 * latent / 2**30:.2f} GiB vs {61 * 4096 * full / 2**30:.2f} GiB\n")

    # Each exported program's cache holds exactly the context plus the timed steps: a static cache is attended
    # (absorbed) or expanded (non-absorbed) over all its rows, so its length is the context being measured.
    base = small_model(args.layers, max_positions=max(contexts) + args.steps + 1)
    vocab = base.config.vocab_size
    paths = {"a etblocks absorbed (xnnpack)": True, "b etblocks expanded (xnnpack)": False}
    with tempfile.TemporaryDirectory() as tmp:
        rows = {
            (name, c): ExportedRow(copy.deepcopy(base), absorb, c + args.steps + 1, Path(tmp) / f"{absorb}_{c}.pte")
            for name, absorb in paths.items()
            for c in contexts
        }
        rows.update({("c transformers eager", c): EagerRow(base) for c in contexts})
        generator = torch.Generator().manual_seed(0)
        prompts = {c: torch.randint(3, vocab, (c,), generator=generator).tolist() for c in contexts}
        samples: dict[str, dict[int, list[float]]] = {}
        for _ in range(args.rounds):
            for (name, context), row in rows.items():
                samples.setdefault(name, {}).setdefault(context, []).append(row.time_decode(prompts[context], args.steps))

    medians = {name: {c: statistics.median(v) * 1e3 for c, v in per.items()} for name, per in samples.items()}
    first, last = contexts[0], contexts[-1]
    reference = medians["a etblocks absorbed (xnnpack)"]
    print(
        f"decode ms/token on a {args.layers}-layer DeepSeek-V3-shaped model (hidden 512, 16 heads, kv_lora_rank 256), "
        f"medians of {args.rounds} rounds x {args.steps} steps; (ratio to a)"
    )
    print(f"{'path':32}" + "".join(f"{'ctx ' + str(c):>18}" for c in contexts) + f"{'growth ' + str(first) + '->' + str(last):>20}")
    for name, per in medians.items():
        cells = "".join(f"{per[c]:>9.2f} ({per[c] / reference[c]:>4.1f}x)" for c in contexts)
        print(f"{name:32}{cells}{per[last] / per[first]:>19.2f}x")


if __name__ == "__main__":
    main()
