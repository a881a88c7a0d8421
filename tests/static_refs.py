"""Static programs run eagerly, fed the way `etblocks.Runner` feeds the exported ones."""

from __future__ import annotations

import torch
from hf_models import swapped_family

from etblocks.export.feeders import StaticFeeder
from etblocks.export.programs import static_program

CHUNK = 8
CONTEXT = 96  # room for the speculation tests: a 22-token prompt and 64 new tokens


def swap_static(name: str, backend: str, **options):
    """`swapped_family(name)` with a static program for `backend` (`shapes="static"` on the CPU backends) of chunk
    `CHUNK` and context `CONTEXT`."""
    if backend in ("xnnpack", "portable"):
        options = {"shapes": "static", **options}
    return swapped_family(name, backend, max_seq_len=CONTEXT, chunk=CHUNK, **options)


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
