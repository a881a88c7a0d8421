"""Nucleus sampling's cost per token: etblocks' `sample` beside the textbook torch form, over a 49k vocabulary.

Rows, both drawing from the same nucleus (`tests/export/test_sampling.py` checks etblocks' against the sorted
definition):

  a  etblocks.export.runner.sample   numpy: the nucleus from a partial sort of the top 256 tokens, or from a sort
                                     of the probabilities' values when it is larger; one uniform draw through
                                     the nucleus's CDF
  b  torch sort + multinomial        softmax, a sort of the whole vocabulary, cumsum, masked_fill, multinomial
                                     (what etblocks' Runner did before)

Columns per case (logits = N(0, 1) * scale over the vocabulary; a larger scale is a more peaked distribution, a
smaller nucleus): the nucleus size, microseconds per token (median of `--rounds` interleaved rounds of `--draws`
draws) and (b) / (a).

    python benchmarks/sampling.py                 # ~20 s

Run here (2 vCPUs, numpy 2.3.5), microseconds per token, (a) / (b) / ratio: flat logits (scale 1, top_p 0.9,
a 25k-token nucleus) 2663 / 5456 / 2.0x; scale 4, top_p 0.9 (90 tokens) 637 / 5291 / 8.3x; scale 12, top_p 0.9
(3 tokens) 759 / 5852 / 7.7x; top_p 1 (no nucleus to find) 266-312 / 5291-5657 / 18-20x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from decode import aligned_table  # benchmarks/ is not a package: Python puts this script's folder first on sys.path

from etblocks.export.runner import sample

VOCAB = 49152  # SmolLM2's
CASES = [(scale, top_p) for scale in (1.0, 4.0, 12.0) for top_p in (0.9, 1.0)]  # flat to peaked
TEMPERATURE = 0.8


def sorted_nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's probabilities, sorted, with those outside the nucleus zeroed, and the token order."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    return sorted_probs.masked_fill(outside, 0.0), order


def torch_sort_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Nucleus sampling as it is usually written in torch."""
    probs, order = sorted_nucleus(logits, temperature, top_p)
    return int(order[torch.multinomial(probs / probs.sum(), 1, generator=generator)])


SAMPLERS: dict[str, Callable[..., int]] = {"(a) etblocks sample": sample, "(b) torch sort + multinomial": torch_sort_sample}


def microseconds_per_draw(sampler: Callable[..., int], logits: torch.Tensor, top_p: float, draws: int) -> float:
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(draws):
        sampler(logits, TEMPERATURE, top_p, generator)
    return (time.perf_counter() - start) / draws * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=50, help="draws per sampler per case per round")
    args = parser.parse_args(argv)
    lines = []
    for scale, top_p in CASES:
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * scale
        nucleus = int(torch.count_nonzero(sorted_nucleus(logits, TEMPERATURE, top_p)[0]))
        runs: dict[str, list[float]] = {name: [] for name in SAMPLERS}
        for _ in range(args.rounds):
            for name, sampler in SAMPLERS.items():
                runs[name].append(microseconds_per_draw(sampler, logits, top_p, args.draws))
        ours, theirs = (statistics.median(r) for r in runs.values())
        lines.append([f"{scale:g}", f"{top_p:g}", str(nucleus), f"{ours:.0f}", f"{theirs:.0f}", f"{theirs / ours:.1f}x"])
        print(f"[sampling bench] scale {scale:g}, top_p {top_p:g}: {ours:.0f} vs {theirs:.0f} us", file=sys.stderr,
              flush=True)
    print(f"Nucleus sampling over {VOCAB} logits ~ N(0, 1) * scale at temperature {TEMPERATURE} (torch with "
          f"{torch.get_num_threads()} threads); medians of {args.rounds} interleaved rounds of {args.draws} draws\n")
    print(aligned_table(["scale", "top_p", "nucleus tokens", "(a) us/token", "(b) us/token", "(b) / (a)"], lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
