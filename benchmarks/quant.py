"""Quantization options side by side: decode speed on the SmolLM2-135M shape, accuracy on a small model trained here.

Options (`--rows`): (a) fp32, (b) fp32 + int8 KV cache, (c) 8da8w, (d) 8da8w + int8 KV, (e) 8da4w (groups of 32), (f)
8da4w + int8 KV, (g) 8da4w + int8 embedding; beside them llama.cpp on the same weights (`llamacpp`; speed only, needs
the `bench` extra): (h) Q8_0 beside (c), (i) Q4_0 beside (e), both with an F32 KV cache as etblocks' rows. Speed: each
option swapped and exported from a random-weight transformers Llama and timed as decode.py times (`harness`: fresh
process, interleaved rounds, medians [min-max]), with each row's roofline from the bytes a decode step reads
(`harness.bytes_per_token`: the linears as quantized, the lm_head, the KV cache at the mean decode position) and
PASS/FAIL on 8da4w reaching 70% of it on an AVX-512 VNNI host, 50% elsewhere. Tokens: each row's greedy tokens
against the transformers model's `generate()`, its weights quantized as the row quantizes them
(`harness.quantized_reference`; an int8 KV cache is not in it): fp32 rows must agree on all, the others on the first
`--quantized-min-match` (XNNPACK's dynamic int8 activations round differently from torchao's eager ones, and random
weights give flat distributions); otherwise the script exits 1.
llama.cpp's rows quantize in blocks of their own, so their reference is the transformers model with its matrices
rounded to the row's type and back by gguf-py's reference quantizer (`llamacpp.rounded_through`): (h) must share its
first `--quantized-min-match` tokens, (i)'s agreement is reported without a requirement (llama.cpp's 4-bit numerics
are its own). Accuracy: a small Llama (`--trained-layers`) trained for `--train-steps` on a synthetic corpus with
learnable structure (words, bigram order, copied spans), each option's program compared with the fp32 program by
`etblocks.export.next_token_agreement` (top-1 agreement, KL); row (a) compares the fp32 program with eager. Results:
benchmarks/results/quant.json.

    python benchmarks/quant.py            # 30 layers, 300 training steps
    python benchmarks/quant.py --smoke    # 1 layer, rows a and e, 5 training steps
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    GROUP_SIZE,
    Bench,
    Checks,
    Driver,
    Option,
    PathSpec,
    Row,
    USUAL_HOST,
    Shape,
    Unavailable,
    aligned_table,
    argument_parser,
    add_run_args,
    build_hf_model,
    bytes_per_token,
    check_rows,
    describe_run,
    eager_reference_tokens,
    export_with_etblocks,
    finish,
    format_table,
    host_kind,
    make_bench,
    paired_median,
    quantized_reference,
    parse_with_smoke,
    row_record,
    rows_ratio,
    run_paths,
    select_paths,
    spread_record,
    target_line,
    weight_bytes_per_token,
)
from llamacpp import gguf_weight_bytes_per_token, import_gguf, llama_cpp_path, rounded_through

import etblocks  # noqa: E402
from etblocks.export.accuracy import AccuracyReport, EagerModel, next_token_agreement  # noqa: E402

BYTES_READ = "MB read/token"
TARGET_KEY = "e"
# 8da4w decode's goal as a share of its roofline: 70% on a host with AVX-512 VNNI, 50% elsewhere (XNNPACK's int4
# GEMM measured compute-bound on a quiet AVX2-only host).
VNNI_SHARE, OTHER_SHARE = 0.7, 0.5
_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[quant bench {time.perf_counter() - _STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Options


OPTIONS = (
    Option("a", "fp32"),
    Option("b", "fp32, int8 KV", kv_quantize="int8"),
    Option("c", "8da8w", quantize="8da8w"),
    Option("d", "8da8w, int8 KV", quantize="8da8w", kv_quantize="int8"),
    Option("e", "8da4w", quantize="8da4w"),
    Option("f", "8da4w, int8 KV", quantize="8da4w", kv_quantize="int8"),
    Option("g", "8da4w, int8 embedding", quantize="8da4w", quantize_embedding="int8"),
)
REFERENCE = OPTIONS[0]  # fp32: what the accuracy table compares every other option with


def swapped(model: torch.nn.Module, option: Option, max_seq_len: int) -> torch.nn.Module:
    """`model` swapped for XNNPACK with the option's cache (in place)."""
    return etblocks.swap(model, backend="xnnpack", max_seq_len=max_seq_len, **option.swap_options())


# --------------------------------------------------------------------------------------------------
# Speed


def speed_path(option: Option) -> Callable[[Bench, Row], Driver]:
    """The `decode.py` path of an option: the benchmark-shape model swapped and exported with it."""

    def path(bench: Bench, row: Row) -> Driver:
        driver, _ = export_with_etblocks(bench, row, build_hf_model, f"{option.key}.pte", option.swap_options(),
                                         option.export_options())
        return driver

    return path


# llama.cpp rows: key -> (GGUF file type, the etblocks row compared with it, the decode ratio that row must reach)
LLAMA_CPP_ROWS = {"h": ("Q8_0", "c", 1.2), "i": ("Q4_0", "e", 1.3)}
SPEED_PATHS = [PathSpec(option.key, option.name, speed_path(option)) for option in OPTIONS] + [
    PathSpec(key, f"llama.cpp {file_type}", llama_cpp_path(file_type))
    for key, (file_type, _, _) in LLAMA_CPP_ROWS.items()]
PREFILL_GOAL = 1.2  # etblocks' prefill against llama.cpp's, each quantization


def reference_tokens(bench: Bench, options: Sequence[Option]) -> dict[str, list[int]]:
    """Each row's eager reference tokens: the fp32 transformers model's, or, for quantized weights, the same model
    quantized as the row's program quantizes it (one `generate()` per distinct weight scheme)."""
    by_weights: dict[tuple[str | None, str | None], list[int]] = {}
    for option in options:
        weights = (option.quantize, option.quantize_embedding)
        if weights not in by_weights:
            def build(b: Bench, option: Option = option) -> torch.nn.Module:
                return quantized_reference(build_hf_model(b), "etblocks", option.quantize, GROUP_SIZE,
                                           option.quantize_embedding)

            by_weights[weights] = eager_reference_tokens(bench, build_hf_model if weights == (None, None) else build)
    return {option.key: by_weights[(option.quantize, option.quantize_embedding)] for option in options}


def format_targets(rows: Sequence[Row], bandwidths: Sequence[float], row_bytes: Mapping[str, float]) -> str:
    """PASS/FAIL on the median of per-round ratios: 8da4w decode >= 70% of its roofline on an AVX-512 VNNI host,
    50% elsewhere, and each etblocks row against its llama.cpp row (`LLAMA_CPP_ROWS`: decode at the row's ratio,
    prefill at `PREFILL_GOAL`)."""
    by_key = {r.key: r for r in rows if r.status == "ok"}
    row = by_key.get(TARGET_KEY)
    share = paired_median(row.decode_runs, [b / row_bytes[TARGET_KEY] for b in bandwidths]) if row else None
    vnni = host_kind() == USUAL_HOST
    lines = ["targets (median of per-round ratios):", target_line(
        f"({TARGET_KEY}) 8da4w decode % of its roofline (host {'has' if vnni else 'lacks'} AVX-512 VNNI)",
        None if share is None else 100 * share, 100 * (VNNI_SHARE if vnni else OTHER_SHARE), "%")]
    for key, (file_type, ours, goal) in LLAMA_CPP_ROWS.items():
        theirs, mine = by_key.get(key), by_key.get(ours)
        lines.append(target_line(f"({ours}) decode / ({key}) llama.cpp {file_type} decode",
                                 rows_ratio(mine, theirs, "decode_runs"), goal))
        lines.append(target_line(f"({ours}) prefill / ({key}) llama.cpp {file_type} prefill",
                                 rows_ratio(mine, theirs, "prefill_runs"), PREFILL_GOAL))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Accuracy: a synthetic corpus and a small model trained on it

TRAINED_SHAPE = Shape(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=512,
                      max_seq_len=128)
LEXICON_WORDS, WORD_TOKENS = 256, (2, 5)
SUCCESSORS, SUCCESSOR_ALPHA = 4, 0.5  # each word's successors, and the Dirichlet concentration of their weights
COPY_PROB, COPY_WORDS = 0.1, (3, 8)  # chance per word of repeating an earlier span, and its length in words
BATCH, LEARNING_RATE, WARMUP_STEPS, INIT_STD = 32, 3e-3, 30, 0.02


@dataclass(frozen=True)
class Corpus:
    """The generator of the synthetic text: a lexicon of words (token tuples), each word's successors and their
    probabilities. Token 0 is never used."""

    words: tuple[tuple[int, ...], ...]
    successors: tuple[tuple[int, ...], ...]
    probabilities: tuple[tuple[float, ...], ...]

    @classmethod
    def make(cls, vocab: int, rng: random.Random) -> Corpus:
        words: set[tuple[int, ...]] = set()
        while len(words) < LEXICON_WORDS:
            words.add(tuple(rng.randrange(1, vocab) for _ in range(rng.randint(*WORD_TOKENS))))
        successors, probabilities = [], []
        for _ in range(LEXICON_WORDS):
            successors.append(tuple(rng.sample(range(LEXICON_WORDS), SUCCESSORS)))
            weights = [rng.gammavariate(SUCCESSOR_ALPHA, 1.0) + 1e-9 for _ in range(SUCCESSORS)]
            probabilities.append(tuple(w / sum(weights) for w in weights))
        return cls(tuple(sorted(words)), tuple(successors), tuple(probabilities))

    def sample(self, min_tokens: int, rng: random.Random, copy_prob: float = COPY_PROB) -> tuple[list[int], float]:
        """Whole words until there are at least `min_tokens` tokens, repeating an earlier span with chance
        `copy_prob` per word; returns the tokens and the nats of the random choices that made them (their -log
        probability under the generator)."""
        words = [rng.randrange(len(self.words))]
        nats = math.log(len(self.words))
        tokens = list(self.words[words[0]])
        while len(tokens) < min_tokens:
            chosen, choice_nats = self._next_words(words, rng, copy_prob)
            nats += choice_nats
            for word in chosen:
                words.append(word)
                tokens.extend(self.words[word])
        return tokens, nats

    def _next_words(self, words: list[int], rng: random.Random, copy_prob: float) -> tuple[list[int], float]:
        """A repeat of an earlier span (once enough words came before) or the previous word's bigram successor."""
        nats = 0.0
        if len(words) >= COPY_WORDS[1] and copy_prob > 0:
            repeat = rng.random() < copy_prob
            nats -= math.log(copy_prob if repeat else 1 - copy_prob)
            if repeat:
                length = rng.randint(*COPY_WORDS)
                start = rng.randrange(len(words) - length + 1)
                nats += math.log(COPY_WORDS[1] - COPY_WORDS[0] + 1) + math.log(len(words) - length + 1)
                return words[start : start + length], nats
        probabilities = self.probabilities[words[-1]]
        index = rng.choices(range(SUCCESSORS), weights=probabilities)[0]
        return [self.successors[words[-1]][index]], nats - math.log(probabilities[index])


def sample_sequences(corpus: Corpus, count: int, length: int, rng: random.Random) -> tuple[torch.Tensor, float]:
    """`count` sequences of `length` tokens `[count, length]`, and the generator's entropy in nats per token (the
    nats of its choices over the tokens they made, before the cut to `length`): an upper bound of the text's true
    entropy rate, so about the lowest loss a model can reach."""
    sequences, nats, tokens = [], 0.0, 0
    for _ in range(count):
        sequence, sequence_nats = corpus.sample(length, rng)
        sequences.append(sequence[:length])
        nats, tokens = nats + sequence_nats, tokens + len(sequence)
    return torch.tensor(sequences, dtype=torch.long), nats / tokens


@dataclass
class Training:
    """The trained model and what says it learned (nats per token)."""

    model: torch.nn.Module
    shape: Shape
    corpus: Corpus
    seconds: float
    steps: int
    heldout: torch.Tensor  # [sequences, length]
    heldout_loss: float
    unigram_loss: float
    generator_entropy: float

    def describe(self) -> str:
        s = self.shape
        return (f"trained model: {s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} heads (head_dim "
                f"{s.head_dim}), intermediate {s.intermediate}, vocab {s.vocab}, tied embedding, context "
                f"{s.max_seq_len}; {self.steps} AdamW steps of {BATCH}x{s.max_seq_len} tokens in {self.seconds:.0f}"
                f" s\nheld-out loss {self.heldout_loss:.3f} nats/token; unigram model {self.unigram_loss:.3f}, "
                f"uniform {math.log(s.vocab):.3f}, generator's entropy {self.generator_entropy:.3f} (about the "
                f"lowest reachable)")


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of the held-out tokens under the training set's token frequencies (add-one smoothed)."""
    counts = torch.bincount(train.flatten(), minlength=vocab).double() + 1
    return float(-(counts / counts.sum()).log()[heldout[:, 1:].flatten()].mean())


@torch.no_grad()
def language_model_loss(model: torch.nn.Module, sequences: torch.Tensor) -> float:
    return float(model(input_ids=sequences, labels=sequences).loss)


def train_model(shape: Shape, steps: int, heldout_count: int, seed: int) -> Training:
    """A Llama of `shape` trained with AdamW (warm-up, cosine decay) on fresh corpus batches."""
    rng = random.Random(seed)
    corpus = Corpus.make(shape.vocab, rng)
    length = shape.max_seq_len
    train, _ = sample_sequences(corpus, steps * BATCH, length, rng)
    heldout, entropy = sample_sequences(corpus, max(heldout_count, 64), length, random.Random(seed + 1))
    bench = Bench(shape, [], 0, 0, Path(), seed, INIT_STD)
    model = build_hf_model(bench).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * step / steps)))
    start = time.perf_counter()
    for step, batch in enumerate(train.split(BATCH)):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"training step {step + 1}/{steps}: loss {loss.item():.3f}")
    seconds = time.perf_counter() - start
    model.eval()
    return Training(model, shape, corpus, seconds, steps, heldout[:heldout_count], language_model_loss(model, heldout),
                    unigram_loss(train, heldout, shape.vocab), entropy)


def trained_runner(training: Training, option: Option, out_dir: Path) -> etblocks.Runner:
    """A copy of the trained model swapped and exported with the option, loaded."""
    model = swapped(copy.deepcopy(training.model), option, training.shape.max_seq_len)
    with torch.no_grad():
        result = etblocks.export(model, backend="xnnpack", out=out_dir / f"trained_{option.key}.pte",
                                 **option.export_options())
    return etblocks.Runner(result.path)


def measure_accuracy(training: Training, options: Sequence[Option], prefill: int,
                     out_dir: Path) -> dict[str, AccuracyReport | str]:
    """Each option's program against the fp32 program, and the fp32 program against the eager model; a failure
    becomes the row's text."""
    sequences = training.heldout.tolist()
    reference = trained_runner(training, REFERENCE, out_dir)
    reports: dict[str, AccuracyReport | str] = {}
    for option in options:
        log(f"accuracy ({option.key}) {option.name}")
        try:
            candidate = reference if option == REFERENCE else trained_runner(training, option, out_dir)
            baseline = EagerModel(training.model) if option == REFERENCE else reference
            reports[option.key] = next_token_agreement(baseline, candidate, sequences, prefill)
        except Exception as e:  # one broken option must not hide the others
            reports[option.key] = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    return reports


def format_accuracy(options: Sequence[Option], reports: Mapping[str, AccuracyReport | str]) -> str:
    headers = ["option", "against", "top-1 agree", "mean KL", "p99 KL", "max KL", "positions"]
    lines = []
    for option in options:
        report = reports[option.key]
        label = f"({option.key}) {option.name}"
        if isinstance(report, str):
            lines.append([label, report])
            continue
        against = "eager fp32" if option == REFERENCE else f"({REFERENCE.key}) program"
        lines.append([label, against, f"{report.top1_agreement:.4f}", f"{report.mean_kl:.2e}",
                      f"{report.p99_kl:.2e}", f"{report.max_kl:.2e}", str(report.positions)])
    return aligned_table(headers, lines)


# --------------------------------------------------------------------------------------------------
# Main


SMOKE = {"shape": "tiny", "layers": 1, "rows": "a,e", "rounds": 1, "decode_steps": 4, "prompt_len": 8, "max_seq_len": 32,
         "train_steps": 5, "trained_layers": 1, "accuracy_sequences": 2}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(SPEED_PATHS, __doc__)
    parser.add_argument("--train-steps", type=int, default=300, help="AdamW steps of the accuracy model")
    parser.add_argument("--trained-layers", type=int, default=TRAINED_SHAPE.layers, help="the accuracy model's layers")
    parser.add_argument("--accuracy-sequences", type=int, default=16, help="held-out sequences compared")
    parser.add_argument("--accuracy-prefill", type=int, default=32, help="tokens fed in one call before decoding")
    parser.add_argument("--quantized-min-match", type=int, default=1,
                        help="leading greedy tokens a quantized row must share with its eager reference (fp32 rows: all)")
    add_run_args(parser, "quant", SMOKE)
    return parse_with_smoke(parser, argv, SMOKE)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    specs = select_paths(args.rows, SPEED_PATHS)
    options = [o for spec in specs for o in OPTIONS if o.key == spec.key]
    llama_cpp_keys = [spec.key for spec in specs if spec.key in LLAMA_CPP_ROWS]
    bench = make_bench(args)

    reports: dict[str, AccuracyReport | str] = {}
    accuracy_title = "accuracy: no etblocks option among the rows, so no accuracy model trained"
    if options:  # llama.cpp's rows alone have nothing to measure on the trained model
        log(f"training the accuracy model ({args.train_steps} steps)")
        training = train_model(dataclasses.replace(TRAINED_SHAPE, layers=args.trained_layers), args.train_steps,
                               args.accuracy_sequences, args.seed)
        reports = measure_accuracy(training, options, args.accuracy_prefill, bench.out_dir)
        accuracy_title = (f"accuracy on the trained model, next-token distributions against fp32 over "
                          f"{args.accuracy_sequences} held-out sequences of {TRAINED_SHAPE.max_seq_len} tokens "
                          f"(prefill {args.accuracy_prefill}, then one token per call)\n{training.describe()}")
        del training
        gc.collect()

    log("speed: eager reference tokens, then the exports")
    reference = reference_tokens(bench, options)
    row_bytes = {option.key: bytes_per_token(bench, option) for option in options}
    # llama.cpp's rows: their weights as stored, plus what fp32's F32 cache reads
    fp32_cache_bytes = (bytes_per_token(bench, REFERENCE) - weight_bytes_per_token(bench.shape, None)
                        if llama_cpp_keys else 0.0)
    for key in llama_cpp_keys:
        file_type = LLAMA_CPP_ROWS[key][0]
        try:
            import_gguf()
            reference[key] = eager_reference_tokens(
                bench, lambda b, file_type=file_type: rounded_through(build_hf_model(b), file_type))
        except Unavailable:
            reference[key] = []  # the row itself says what it needs
        row_bytes[key] = fp32_cache_bytes + gguf_weight_bytes_per_token(bench.shape, file_type)
    rows, bandwidths = run_paths(specs, bench, keep_files=args.out_dir is not None, warm_prefill=True)
    for row in rows:
        row.extras[BYTES_READ] = f"{row_bytes[row.key] / 1e6:.1f}"
    rooflines = {key: statistics.median(bandwidths) / value for key, value in row_bytes.items()}

    header = describe_run("Quantization options, XNNPACK", bench, bandwidths).rstrip("\n")
    header += (f"\neach row's roofline: that bandwidth / its own {BYTES_READ} (weights as quantized + KV cache read at "
               f"the mean decode position); see the docstring\n")
    speed = format_table(rows, rooflines, reference, reference_label="eager", extra_headers=[BYTES_READ])
    notes = ("notes:\n  tokens=eager: leading greedy tokens equal to the transformers model's generate(), its weights "
             "quantized as the row's (torchao, etblocks' configs; no int8 KV cache); XNNPACK's dynamic int8 "
             "activations round differently from torchao's eager ones and random weights give flat distributions (the "
             "accuracy table below is on a trained model): a quantized row must agree on the first "
             f"{args.quantized_min_match}, an fp32 row on all; llama.cpp's rows against the model with its weights "
             f"rounded through gguf-py's reference quantizer, (h) Q8_0 on the first {args.quantized_min_match}, (i) "
             "Q4_0 reported only")
    notes += "".join(f"\n  ({r.key}) {r.note}" for r in rows if r.note and r.status == "ok")
    target = format_targets(rows, bandwidths, row_bytes)
    accuracy = format_accuracy(options, reports)
    print(header)
    print(speed)
    print(notes)
    print(target)
    print("\n" + accuracy_title)
    print(accuracy)

    checks = Checks()
    required = {o.key: args.quantized_min_match for o in options if not o.exact}
    required.update({key: args.quantized_min_match if file_type == "Q8_0" else 0
                     for key, (file_type, _, _) in LLAMA_CPP_ROWS.items()})
    check_rows(checks, rows, reference, "eager", required)
    for option in options:
        if isinstance(reports[option.key], str):
            checks.fail(f"accuracy ({option.key}) {option.name}: {reports[option.key]}")
    accuracy_records = {key: (report if isinstance(report, str) else {
        "top1_agreement": report.top1_agreement, "mean_kl": report.mean_kl, "p99_kl": report.p99_kl,
        "max_kl": report.max_kl, "positions": report.positions}) for key, report in reports.items()}
    return finish("quant", args, checks, {"speed": "\n".join([header, speed, notes, target]),
                                          "accuracy": f"{accuracy_title}\n{accuracy}"}, started,
                  shape=vars(bench.shape), reference_tokens=reference, bytes_per_token=row_bytes,
                  bandwidths_gbs=spread_record([b / 1e9 for b in bandwidths]), rows=[row_record(r) for r in rows],
                  accuracy=accuracy_records)


if __name__ == "__main__":
    sys.exit(main())
