"""Quantization options side by side: speed on the SmolLM2-135M shape, accuracy on a small model trained here.

Options (the same letters in both tables; `--rows` picks some):

  a  fp32                      etblocks.swap(model, "xnnpack") + etblocks.export()
  b  fp32, int8 KV             swap(kv_quantize="int8"): int8 cache, one scale and zero point per token and KV head,
                               read by ExecuTorch's `llama::custom_quantized_sdpa`
  c  8da8w                     export(quantize_weights="8da8w"): int8 weights per output channel, int8 dynamic activations
  d  8da8w, int8 KV            c + b
  e  8da4w                     export(quantize_weights="8da4w", group_size=32): int4 weights in groups of 32
  f  8da4w, int8 KV            e + b
  g  8da4w, int8 embedding     e + export(quantize_embedding="int8")

Speed (`decode.py`'s machinery): a transformers Llama at the SmolLM2-135M shape (30 layers, random weights, fp32)
swapped and exported per option; all programs are loaded anew in a fresh process (`decode.time_in_fresh_process`
says why) and warmed up, then timed there in `--rounds` interleaved rounds
(a, b, ..., g, a, b, ...), each a prefill of the `--prompt-len`-token prompt and `--decode-steps` greedy decode
steps (each row runs one untimed prefill right before its timed one, as torchtune_decode.py explains); medians
[min-max]. Columns: decode and prefill tok/s, export+lower s (swap + quantize + export + lowering), .pte MB, their
ratios to (a), decode as % of the row's own memory roofline, the MB the row reads per decoded token (below), and
how many greedy tokens equal the fp32 transformers model's (random weights: quantization can change them).

Roofline: read bandwidth (sampled every round, as decode.py) / the bytes one decode step reads, per row:

    bytes/token = layers * sum over q,k,v,o,gate,up,down of W(out, in) + W(vocab, hidden) [lm_head]
                  + kv_bytes_per_position * (prompt + (decode_steps + 1) / 2)
    W(out, in)  = 4 * out * in                          fp32
                = out * in + 4 * out                    8da8w: int8 data, one fp32 scale per output channel
                = out * in / 2 + 2 * out * in / 32      8da4w: two int4 per byte, one bf16 scale per group of 32

The scale dtypes are how ExecuTorch 1.5.1 serialises them for XNNPACK (`backends/xnnpack/operators/
node_visitor.py`: per-channel-group scales cast to bf16, per-channel ones kept fp32); XNNPACK's packed layout adds a
few words per output channel (bias, sums) that are left out (<3% at these shapes), as are the embedding row, the
norms and the activations. The lm_head is quantized like the other linears (`etblocks.export.weights` gives a tied
one its own quantized weight; the .pte sizes agree with these counts plus the embedding). `kv_bytes_per_position` is
measured, not assumed: the bytes per position of every cache buffer of a swapped one-layer model (fp32 keys and
values: 2 * 3 heads * 64 * 4 B; int8: 2 * 3 * (64 + 4 + 1) B with the fp32 scale and int8 zero point) times the
layers; a decode step at position p reads the p + 1 cached positions (custom SDPA reads no further), and the
prompt + (steps + 1) / 2 is their mean over the timed steps. The target (PASS/FAIL) is judged on the median of
per-round ratios of decode tok/s to that round's roofline.

Accuracy: a small Llama (4 layers, hidden 256, 4/2 heads, intermediate 768, vocab 512, context 128) trained here
for `--train-steps` AdamW steps on a synthetic corpus with structure a model can learn: words of 2-5 tokens from
a fixed lexicon (deterministic spelling: peaked distributions), word order from a sparse random bigram model
(moderately peaked), and spans of earlier words repeated (copying: only attention over the KV cache predicts them,
so a quantized cache shows). Its held-out loss is printed beside a unigram model's and the generator's entropy.
Every option is swapped and exported from the trained model and compared with the fp32 program by
`etblocks.export.next_token_agreement` on `--accuracy-sequences` held-out sequences of 128 tokens: a prefill of
`--accuracy-prefill` tokens, then one token per call, the next-token distributions compared after every call.
Columns: top-1 agreement (fraction of positions whose argmax agrees), mean, 99th percentile and max of KL(P_fp32 ||
P_option) in nats, and the positions compared. Row (a) compares the fp32 program with the eager transformers model
(no cache, whole sequence every call): the sanity row, about 1.0 and 0.

    python benchmarks/quant.py        # full run: 14 exports (7 at 30 layers) and 300 training steps, 45-65 min
    python benchmarks/quant.py --layers 2 --rounds 2 --train-steps 10 --accuracy-sequences 4   # smoke run, ~10 min

`--layers` sets the speed model's layers only; the accuracy model is always the one above.

Full default run (etblocks 5beaa73, this project's 2-core machine, 61 min; read bandwidth 51.0 GB/s median of the
rounds [26.9-57.4], against 31-36 GB/s in earlier runs, so the %roof column came out low):

    row                        decode tok/s         prefill tok/s    export s  .pte MB  decode/(a)  %roof  MB/token
    (a) fp32                      47.4 [44.0-59.6]     467 [358-560]        189      652       1.00x    50%     541.6
    (b) fp32, int8 KV             43.1 [40.9-52.2]     294 [256-335]        225      652       0.91x    45%     538.9
    (c) 8da8w                    124.7 [113.5-135.3]   943 [634-1104]       410      249       2.63x    34%     139.0
    (d) 8da8w, int8 KV            86.9 [79.0-101.8]    451 [361-510]        470      249       1.83x    23%     136.3
    (e) 8da4w                    157.1 [147.5-197.9]   923 [725-1052]       416      189       3.31x    24%      79.4
    (f) 8da4w, int8 KV           106.6 [101.8-125.9]   449 [407-512]        444      189       2.25x    16%      76.6
    (g) 8da4w, int8 embedding    163.6 [149.9-203.4]   833 [685-1146]       435      105       3.45x    25%      79.4
    FAIL  (e) 8da4w decode % of its roofline: 27% (median of per-round ratios; goal >= 50%)
    (an (e) program exported earlier, timed alone in a fresh process right after: 4.7-5.9 ms a step at 29-33 GB/s,
    44-51%; benchmarks/decode_profile.py profiles (e) beside ExecuTorch's own 8da4w export, and
    benchmarks/step_breakdown.py times its parts unprofiled: see their docstrings)

    trained model: held-out loss 0.413 nats/token (unigram 5.719, uniform 6.238, generator's entropy 0.348)
    option                     against      top-1 agree   mean KL    p99 KL    max KL  positions
    (a) fp32                   eager fp32        1.0000  3.42e-13  4.49e-12  1.28e-11       1552
    (b) fp32, int8 KV          (a) program       1.0000  2.21e-07  2.84e-06  3.32e-05       1552
    (c) 8da8w                  (a) program       1.0000  1.70e-05  1.80e-04  4.34e-04       1552
    (d) 8da8w, int8 KV         (a) program       0.9994  1.63e-05  1.63e-04  4.95e-04       1552
    (e) 8da4w                  (a) program       0.9916  5.68e-04  4.98e-03  1.15e-02       1552
    (f) 8da4w, int8 KV         (a) program       0.9910  5.69e-04  4.85e-03  1.28e-02       1552
    (g) 8da4w, int8 embedding  (a) program       0.9910  5.70e-04  4.77e-03  1.16e-02       1552

At context 256 the int8 KV cache costs decode speed in every row (0.92x, 0.83x, 0.66x): the cache read at the mean
decode position is 3.7 MB of fp32 against 79-539 MB of weights, so its quantization on CPU (choose_qparams +
quantize for K, V and the queries, in every layer) costs more than the bytes it saves; it pays in memory (3.8x
smaller caches) and at long contexts.
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
from typing import Any

import torch

from decode import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Bench,
    Driver,
    PathSpec,
    Row,
    Shape,
    _paired_median,
    aligned_table,
    argument_parser,
    build_hf_model,
    describe_run,
    eager_reference_tokens,
    export_with_etblocks,
    format_table,
    make_bench,
    run_paths,
    select_paths,
)

import etblocks  # noqa: E402
from etblocks.export.accuracy import AccuracyReport, EagerModel, next_token_agreement  # noqa: E402
from etblocks.state import find_states  # noqa: E402

GROUP_SIZE = 32
BYTES_READ = "MB read/token"
TARGET_KEY, TARGET_SHARE = "e", 0.5  # 8da4w decode >= 50% of its roofline
_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[quant bench {time.perf_counter() - _STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class Option:
    """One quantization choice, as the keyword arguments it adds to `etblocks.swap` and `etblocks.export`."""

    key: str
    name: str
    quantize: str | None = None  # export(quantize_weights=...): the linear weights
    kv_quantize: str | None = None  # swap(kv_quantize=...)
    quantize_embedding: str | None = None  # export(quantize_embedding=...)

    def swap_options(self) -> dict[str, Any]:
        return {"kv_quantize": self.kv_quantize}

    def export_options(self) -> dict[str, Any]:
        return {"quantize_weights": self.quantize, "group_size": GROUP_SIZE, "quantize_embedding": self.quantize_embedding}


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
# Roofline


def linear_bytes(out_features: int, in_features: int, quantize: str | None, group_size: int = GROUP_SIZE) -> float:
    """Bytes of one linear's weight as XNNPACK reads it (see the module docstring); `group_size`: 8da4w's groups."""
    if quantize is None:
        return 4 * out_features * in_features
    if quantize == "8da8w":
        return out_features * in_features + 4 * out_features
    if quantize == "8da4w":
        return out_features * in_features / 2 + 2 * out_features * in_features / group_size
    raise ValueError(f"no byte count for quantize={quantize!r}")


def weight_bytes_per_token(shape: Shape, quantize: str | None, group_size: int = GROUP_SIZE) -> float:
    """Linear weights (every layer) plus the lm_head, quantized as `quantize` (`group_size`: 8da4w's groups) says."""
    layer = sum(linear_bytes(out_features, in_features, quantize, group_size) for out_features, in_features in
                shape.linear_shapes())
    return shape.layers * layer + linear_bytes(shape.vocab, shape.hidden, quantize, group_size)


@torch.no_grad()
def kv_bytes_per_position(bench: Bench, option: Option) -> float:
    """Bytes all layers' caches hold per position: every declared state tensor (keys, values, scales, zero points)
    of a one-layer model swapped with the option, divided by its rows, times the layers."""
    one_layer = dataclasses.replace(bench, shape=dataclasses.replace(bench.shape, layers=1))
    model = swapped(build_hf_model(one_layer), option, bench.shape.max_seq_len)
    per_layer = sum(spec.zeros().nbytes / spec.rows for state in find_states(model) for spec in state.specs())
    return per_layer * bench.shape.layers


def bytes_per_token(bench: Bench, option: Option) -> float:
    """What one timed decode step reads on average: weights plus the cached positions (module docstring)."""
    mean_positions = len(bench.prompt) + (bench.decode_steps + 1) / 2
    return weight_bytes_per_token(bench.shape, option.quantize) + kv_bytes_per_position(bench, option) * mean_positions


# --------------------------------------------------------------------------------------------------
# Speed


def speed_path(option: Option) -> Callable[[Bench, Row], Driver]:
    """The `decode.py` path of an option: the benchmark-shape model swapped and exported with it."""

    def path(bench: Bench, row: Row) -> Driver:
        driver, _ = export_with_etblocks(bench, row, build_hf_model, f"{option.key}.pte", option.swap_options(),
                                         option.export_options())
        return driver

    return path


SPEED_PATHS = [PathSpec(option.key, option.name, speed_path(option)) for option in OPTIONS]


def format_target(rows: Sequence[Row], bandwidths: Sequence[float], row_bytes: Mapping[str, float]) -> str:
    """PASS/FAIL of "8da4w decode >= 50% of its roofline" on the median of per-round ratios."""
    row = next((r for r in rows if r.key == TARGET_KEY and r.status == "ok"), None)
    label = f"({TARGET_KEY}) 8da4w decode % of its roofline"
    share = _paired_median(row.decode_runs, [b / row_bytes[TARGET_KEY] for b in bandwidths]) if row else None
    if share is None:
        return f"target (median of per-round ratios):\n  n/a   {label} (row ({TARGET_KEY}) has no figures)"
    verdict = "PASS" if share >= TARGET_SHARE else "FAIL"
    return (f"target (median of per-round ratios):\n  {verdict}  {label}: {100 * share:.0f}% "
            f"(goal >= {100 * TARGET_SHARE:.0f}%)")


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

    def sample(self, min_tokens: int, rng: random.Random) -> tuple[list[int], float]:
        """Whole words until there are at least `min_tokens` tokens; returns the tokens and the nats of the random
        choices that made them (their -log probability under the generator)."""
        words = [rng.randrange(len(self.words))]
        nats = math.log(len(self.words))
        tokens = list(self.words[words[0]])
        while len(tokens) < min_tokens:
            chosen, choice_nats = self._next_words(words, rng)
            nats += choice_nats
            for word in chosen:
                words.append(word)
                tokens.extend(self.words[word])
        return tokens, nats

    def _next_words(self, words: list[int], rng: random.Random) -> tuple[list[int], float]:
        """A repeat of an earlier span (once enough words came before) or the previous word's bigram successor."""
        nats = 0.0
        if len(words) >= COPY_WORDS[1]:
            repeat = rng.random() < COPY_PROB
            nats -= math.log(COPY_PROB if repeat else 1 - COPY_PROB)
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
    seconds: float
    steps: int
    heldout: torch.Tensor  # [sequences, length]
    heldout_loss: float
    unigram_loss: float
    generator_entropy: float

    def describe(self) -> str:
        s = TRAINED_SHAPE
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


def train_model(steps: int, heldout_count: int, seed: int) -> Training:
    """A `TRAINED_SHAPE` Llama trained with AdamW (warm-up, cosine decay) on fresh corpus batches."""
    rng = random.Random(seed)
    corpus = Corpus.make(TRAINED_SHAPE.vocab, rng)
    length = TRAINED_SHAPE.max_seq_len
    train, _ = sample_sequences(corpus, steps * BATCH, length, rng)
    heldout, entropy = sample_sequences(corpus, max(heldout_count, 64), length, random.Random(seed + 1))
    bench = Bench(TRAINED_SHAPE, [], 0, 0, Path(), seed, INIT_STD)
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
    return Training(model, seconds, steps, heldout[:heldout_count], language_model_loss(model, heldout),
                    unigram_loss(train, heldout, TRAINED_SHAPE.vocab), entropy)


def trained_runner(training: Training, option: Option, out_dir: Path) -> etblocks.Runner:
    """A copy of the trained model swapped and exported with the option, loaded."""
    model = swapped(copy.deepcopy(training.model), option, TRAINED_SHAPE.max_seq_len)
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(SPEED_PATHS, __doc__)
    parser.add_argument("--train-steps", type=int, default=300, help="AdamW steps of the accuracy model")
    parser.add_argument("--accuracy-sequences", type=int, default=16, help="held-out sequences compared")
    parser.add_argument("--accuracy-prefill", type=int, default=32, help="tokens fed in one call before decoding")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    specs = select_paths(args.rows, SPEED_PATHS)
    options = [next(o for o in OPTIONS if o.key == spec.key) for spec in specs]
    bench = make_bench(args)

    log(f"training the accuracy model ({args.train_steps} steps)")
    training = train_model(args.train_steps, args.accuracy_sequences, args.seed)
    reports = measure_accuracy(training, options, args.accuracy_prefill, bench.out_dir)
    trained = training.describe()
    del training
    gc.collect()

    log("speed: eager reference tokens, then the exports")
    reference = eager_reference_tokens(bench)
    row_bytes = {option.key: bytes_per_token(bench, option) for option in options}
    rows, bandwidths = run_paths(specs, bench, keep_files=args.out_dir is not None, warm_prefill=True)
    for row in rows:
        row.extras[BYTES_READ] = f"{row_bytes[row.key] / 1e6:.1f}"
    rooflines = {key: statistics.median(bandwidths) / value for key, value in row_bytes.items()}

    print(describe_run("Quantization options, XNNPACK", bench, bandwidths).rstrip("\n"))
    print(f"each row's roofline: that bandwidth / its own {BYTES_READ} (weights as quantized + KV cache read at the "
          f"mean decode position); see the docstring\n")
    print(format_table(rows, rooflines, reference, reference_label="fp32", extra_headers=[BYTES_READ]))
    print("notes:\n  tokens=fp32: leading greedy tokens equal to the fp32 transformers model's generate(); random "
          "weights give flat distributions, which quantization tips early (the accuracy table below is on a trained "
          "model)")
    print(format_target(rows, bandwidths, row_bytes))
    print(f"\naccuracy on the trained model, next-token distributions against fp32 over {args.accuracy_sequences} "
          f"held-out sequences of {TRAINED_SHAPE.max_seq_len} tokens (prefill {args.accuracy_prefill}, then one "
          f"token per call)")
    print(trained)
    print(format_accuracy(options, reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
