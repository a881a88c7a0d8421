"""The Runner's token choice against torch's: `greedy_token` (numpy's argmax, for speed) must pick what
`torch.argmax` picks, ties and non-fp32 logits included."""

from __future__ import annotations

import pytest
import torch

from etblocks.export.runner import greedy_token, sample


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
