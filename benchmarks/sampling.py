"""Nucleus sampling's cost per token: etblocks' `sample` beside the textbook torch form, over a 49k vocabulary.

Rows: (a) `etblocks.export.sampling.sample` (numpy: the nucleus from a partial sort of the top 256 tokens, or a sort of
the probabilities' values when it is larger; one uniform draw through its CDF) and (b) torch's softmax, sort of the
whole vocabulary, cumsum, masked_fill and multinomial. Per case (logits = N(0, 1) * scale; larger scale, smaller
nucleus): the nucleus size and microseconds per token, medians [min-max] of `--rounds` interleaved rounds of
`--draws` draws, and (b) / (a). Checked: every draw of both rows lies in the nucleus the whole-vocabulary sort
defines, and (a)'s nucleus is that one; otherwise the script exits 1. Results: benchmarks/results/sampling.json.

    python benchmarks/sampling.py            # 6 cases, 5 rounds of 50 draws
    python benchmarks/sampling.py --smoke    # 1 round of 5 draws
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Checks,
    add_run_args,
    aligned_table,
    check_members,
    check_values,
    finish,
    parse_with_smoke,
    spread,
    spread_record,
)

from etblocks.export.sampling import _nucleus, sample

VOCAB = 49152  # SmolLM2's
CASES = [(scale, top_p) for scale in (1.0, 4.0, 12.0) for top_p in (0.9, 1.0)]  # flat to peaked
TEMPERATURE = 0.8


def sorted_nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's probabilities, sorted, with those outside the nucleus zeroed, and the token order."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    return sorted_probs.masked_fill(outside, 0.0), order


def reference_nucleus(probs: torch.Tensor, top_p: float) -> list[int]:
    """The nucleus's token ids by its definition, as tests/export/test_sampling.py computes it: the whole vocabulary
    sorted (stable), each token kept while the mass before it (summed in float64) is below top_p."""
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    sorted_probs = sorted_probs.double()
    kept = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
    return sorted(order[kept].tolist())


def torch_sort_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Nucleus sampling as it is usually written in torch."""
    probs, order = sorted_nucleus(logits, temperature, top_p)
    return int(order[torch.multinomial(probs / probs.sum(), 1, generator=generator)])


SAMPLERS: dict[str, Callable[..., int]] = {"(a) etblocks sample": sample, "(b) torch sort + multinomial": torch_sort_sample}


def microseconds_per_draw(sampler: Callable[..., int], logits: torch.Tensor, top_p: float,
                          draws: int) -> tuple[float, list[int]]:
    """Microseconds per draw over `draws` seeded draws, and the tokens drawn."""
    generator = torch.Generator().manual_seed(0)
    tokens = []
    start = time.perf_counter()
    for _ in range(draws):
        tokens.append(sampler(logits, TEMPERATURE, top_p, generator))
    return (time.perf_counter() - start) / draws * 1e6, tokens


SMOKE = {"rounds": 1, "draws": 5}


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=50, help="draws per sampler per case per round")
    add_run_args(parser, "sampling", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    checks = Checks()
    lines, records = [], []
    for scale, top_p in CASES:
        case = f"scale {scale:g}, top_p {top_p:g}"
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * scale
        probs = torch.softmax(logits.float() / TEMPERATURE, dim=-1)
        nucleus = reference_nucleus(probs, top_p)
        if top_p < 1:  # (a)'s own nucleus against the definition's, as sorted token ids
            ours = sorted(_nucleus(probs.numpy(), top_p)[1].tolist())
            checks.add(check_values(f"a nucleus@{scale:g}/{top_p:g}", ours, nucleus, "sorted nucleus",
                                    note=f"{case}: nucleus token ids"))
        runs: dict[str, list[float]] = {name: [] for name in SAMPLERS}
        drawn: dict[str, list[int]] = {name: [] for name in SAMPLERS}
        for _ in range(args.rounds):
            for name, sampler in SAMPLERS.items():
                us, tokens = microseconds_per_draw(sampler, logits, top_p, args.draws)
                runs[name].append(us)
                drawn[name] += tokens
        # (b)'s own nucleus is the float32 one it computes, which may differ from the float64 one at its edge.
        kept, order = sorted_nucleus(logits, TEMPERATURE, top_p)
        nuclei = {"a": nucleus, "b": order[kept > 0].tolist()}
        for name, tokens in drawn.items():
            checks.add(check_members(f"{name[1]}@{scale:g}/{top_p:g}", tokens, nuclei[name[1]], "sorted nucleus",
                                     note=f"{case}: draws inside the nucleus"))
        (a_name, a_runs), (b_name, b_runs) = runs.items()
        ours, theirs = statistics.median(a_runs), statistics.median(b_runs)
        per_round = statistics.median(b / a for a, b in zip(a_runs, b_runs))
        lines.append([f"{scale:g}", f"{top_p:g}", str(len(nucleus)), spread(a_runs, ".0f"), spread(b_runs, ".0f"),
                      f"{per_round:.1f}x"])
        records.append({"scale": scale, "top_p": top_p, "nucleus": len(nucleus),
                        "timings": {"a_us": spread_record(a_runs), "b_us": spread_record(b_runs)}})
        print(f"[sampling bench] {case}: {ours:.0f} vs {theirs:.0f} us", file=sys.stderr, flush=True)
    title = (f"Nucleus sampling over {VOCAB} logits ~ N(0, 1) * scale at temperature {TEMPERATURE} (torch with "
             f"{torch.get_num_threads()} threads); medians [min-max] of {args.rounds} interleaved rounds of "
             f"{args.draws} draws; (b) / (a): median of per-round ratios\n")
    table = aligned_table(["scale", "top_p", "nucleus tokens", "(a) us/token", "(b) us/token", "(b) / (a)"], lines)
    print(title)
    print(table)
    return finish("sampling", args, checks, {"sampling": f"{title}\n{table}"}, started, rows=records)


if __name__ == "__main__":
    sys.exit(main())
