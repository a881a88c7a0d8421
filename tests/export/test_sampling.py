"""The Runner's token choice against its definitions: `greedy_token` (numpy's argmax, for speed) must pick what
`torch.argmax` picks, ties and non-fp32 logits included; `sample` must draw from the nucleus a whole-vocabulary
sort defines, in its proportions."""

from __future__ import annotations

import pytest
import torch

from etblocks.export.sampling import greedy_token, sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(49152,), (1, 1, 49152), (1, 7)])
def test_greedy_token_is_torch_argmax(dtype, shape):
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(shape, generator=generator).to(dtype)
        assert greedy_token(logits) == int(torch.argmax(logits))


def test_greedy_token_takes_the_first_of_tied_maxima_as_torch_does():
    logits = torch.zeros(100)
    logits[[17, 42, 90]] = 3.0
    assert greedy_token(logits) == int(torch.argmax(logits)) == 17


def test_temperature_zero_samples_greedily():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert sample(logits, temperature=0.0) == int(torch.argmax(logits))


def nucleus_reference(probs: torch.Tensor, top_p: float) -> dict[int, float]:
    """Nucleus sampling's distribution by its definition: sort the whole vocabulary, keep each token while the
    mass before it is below top_p (summed in float64), renormalize."""
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    sorted_probs = sorted_probs.double()
    kept = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
    kept_probs = sorted_probs[kept] / sorted_probs[kept].sum()
    return dict(zip(order[kept].tolist(), kept_probs.tolist()))


@pytest.mark.parametrize("top_p", [0.3, 0.8, 1.0])
def test_sampling_follows_the_nucleus_distribution(top_p):
    """Frequencies of 20000 seeded draws over a 40-token vocabulary are within 5 sigma of the nucleus's
    probabilities, and no token outside the nucleus is drawn."""
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2)) * 2
    expected = nucleus_reference(torch.softmax(logits.double() / 0.7, dim=-1), top_p)
    generator, draws = torch.Generator().manual_seed(3), 20000
    counts = torch.bincount(torch.tensor([sample(logits, 0.7, top_p, generator) for _ in range(draws)]), minlength=40)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(expected)
    for token, p in expected.items():
        assert abs(counts[token].item() / draws - p) <= 5 * (p * (1 - p) / draws) ** 0.5 + 1e-4, (token, p)


@pytest.mark.parametrize(
    "vocab,scale,top_p,beyond_first_k",
    [(49152, 1.0, 0.9, True), (49152, 8.0, 0.9, False), (5000, 0.1, 0.5, True), (1000, 0.5, 0.99, True), (100, 0.5, 0.99, False)],
)
def test_nucleus_is_the_sorted_definition(vocab, scale, top_p, beyond_first_k):
    """The nucleus is the whole-vocabulary sort's: small ones found among the first k tokens, large ones (flat
    logits) through the sort of the probabilities."""
    from etblocks.export.sampling import NUCLEUS_FIRST_K, _nucleus

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    probs = torch.softmax(logits, dim=-1)
    expected = nucleus_reference(probs, top_p)
    kept_probs, tokens = _nucleus(probs.numpy(), top_p)
    assert set(tokens.tolist()) == set(expected)  # the same tokens (equal probabilities may come in any order)
    assert (kept_probs == probs.numpy()[tokens]).all()
    assert (len(expected) > NUCLEUS_FIRST_K) == beyond_first_k


@pytest.mark.parametrize("vocab", [100, 1000])
def test_nucleus_of_tied_probabilities_takes_the_first_tokens(vocab):
    """A uniform distribution: the nucleus holds the first tokens by id, as a stable sort orders the tied."""
    from etblocks.export.sampling import _nucleus

    probs = torch.full((vocab,), 1.0 / vocab)
    expected = nucleus_reference(probs, 0.5003)
    _, tokens = _nucleus(probs.numpy(), 0.5003)
    assert sorted(tokens.tolist()) == sorted(expected) == list(range(len(expected)))


def test_seeded_sampling_repeats():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(4)) * 4
    first = [sample(logits, 0.8, 0.9, torch.Generator().manual_seed(7)) for _ in range(3)]
    draws = [sample(logits, 0.8, 0.9, generator) for generator in [torch.Generator().manual_seed(7)] for _ in range(20)]
    assert len(set(first)) == 1 and len(set(draws)) > 1
