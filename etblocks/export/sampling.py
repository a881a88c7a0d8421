"""Choosing the next token from logits: greedy, or nucleus sampling at a temperature; numpy does the arithmetic on
the calling thread (see `sample`)."""

from __future__ import annotations

import numpy
import torch


def greedy_token(logits: torch.Tensor) -> int:
    """Index of the largest logit (the first on ties), by numpy: torch.argmax over a vocabulary of tens of
    thousands is slower, most of all between decode steps."""
    return int(logits.detach().reshape(-1).float().numpy().argmax())  # .float() copies only non-fp32 logits


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling over `softmax(logits / temperature)`: the most likely
    tokens, each kept while the mass of those before it is below `top_p`, drawn in proportion to their
    probabilities by one uniform number from `generator` (torch's global one if None).

    numpy does the arithmetic, on this thread: torch's elementwise ops over a vocabulary this size run on its
    OpenMP threads, whose spinning slows the next decode step (see `run_method`).
    """
    if temperature == 0:
        return greedy_token(logits)
    probs = softmax(logits, temperature)
    if top_p >= 1:
        return draw(probs, generator)
    probs, tokens = _nucleus(probs, top_p)
    return int(tokens[draw(probs, generator)])


def softmax(logits: torch.Tensor, temperature: float) -> numpy.ndarray:
    """`softmax(logits / temperature)` as fp32 numpy, on this thread."""
    scaled = logits.detach().reshape(-1).float().numpy() / numpy.float32(temperature)
    probs = numpy.exp(scaled - scaled.max())
    return probs / probs.sum()


def distribution(logits: torch.Tensor, temperature: float, top_p: float) -> numpy.ndarray:
    """What `sample` draws from at `temperature` > 0 and `top_p`, over the whole vocabulary (zero outside the
    nucleus)."""
    probs = softmax(logits, temperature)
    if top_p >= 1:
        return probs
    kept, tokens = _nucleus(probs, top_p)
    full = numpy.zeros_like(probs)
    full[tokens] = kept
    return full / full.sum()


NUCLEUS_FIRST_K = 256


def _nucleus(probs: numpy.ndarray, top_p: float) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The nucleus's probabilities and token ids. Most nuclei end inside the k most likely tokens, found by a
    partial sort; a larger one (flat logits) takes a sort of the probabilities' values, not of their indices
    (sorting token ids by probability is several times slower; `benchmarks/sampling.py` times the sampler). The
    draw does not depend on the order they come in."""
    k = min(NUCLEUS_FIRST_K, probs.size)
    top = numpy.sort(numpy.argpartition(probs, probs.size - k)[probs.size - k :])  # tied tokens in id order
    top = top[numpy.argsort(-probs[top], kind="stable")]
    kept = _kept(probs[top], top_p)
    if not kept[-1] or k == probs.size:
        return probs[top[kept]], top[kept]
    descending = numpy.sort(probs)[::-1]
    size = int(numpy.count_nonzero(_kept(descending, top_p)))
    smallest = descending[size - 1]
    above = numpy.flatnonzero(probs > smallest)
    ties = numpy.flatnonzero(probs == smallest)[: size - above.size]  # as many of the tied as the nucleus holds
    tokens = numpy.concatenate([above, ties])
    return probs[tokens], tokens


def _kept(descending: numpy.ndarray, top_p: float) -> numpy.ndarray:
    """Which of these probabilities (descending) the nucleus keeps: those with less than top_p before them."""
    return numpy.cumsum(descending, dtype=numpy.float64) - descending < top_p


def draw(weights: numpy.ndarray, generator: torch.Generator | None) -> int:
    """An index into `weights`, with probability proportional to its weight (inverse CDF of one uniform draw)."""
    cdf = numpy.cumsum(weights, dtype=numpy.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64).item() * cdf[-1]
    return int(numpy.searchsorted(cdf, u, side="right"))
