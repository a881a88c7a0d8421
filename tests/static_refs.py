"""Static programs run eagerly, driven the way `etblocks.Runner` drives the exported ones."""

from __future__ import annotations

import torch

from etblocks.export.programs import static_program
from etblocks.export.static_driver import StaticDriver


def eager_driver(swapped) -> StaticDriver:
    """The static program run eagerly: the graph export would capture, driven like the Runner drives it."""
    program = static_program(swapped)
    return StaticDriver(program.contract, lambda method, inputs: program.module(*inputs))


def greedy(forward, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` from `forward(tokens) -> last logits` (a driver's)."""
    logits, tokens = forward(prompt), []
    while len(tokens) < new_tokens:
        tokens.append(int(torch.argmax(logits)))
        logits = forward(tokens[-1:])
    return tokens
