"""Static programs run eagerly, fed the way `etblocks.Runner` feeds the exported ones."""

from __future__ import annotations

import torch

from etblocks.export.programs import static_program
from etblocks.export.feeders import StaticFeeder


def eager_feeder(swapped) -> StaticFeeder:
    """The static program run eagerly: the graph export would capture, fed like the Runner feeds it."""
    program = static_program(swapped)
    return StaticFeeder(program.contract, lambda method, inputs: program.module(*inputs))


def greedy(forward, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` from `forward(tokens) -> last logits` (a feeder's)."""
    logits, tokens = forward(prompt), []
    while len(tokens) < new_tokens:
        tokens.append(int(torch.argmax(logits)))
        logits = forward(tokens[-1:])
    return tokens
