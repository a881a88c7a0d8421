"""Lossless speculative decoding: propose tokens cheaply, check them all in one call of the program, keep what the
program agrees with.

A decode step reads every weight to produce one token; a call that checks k proposed tokens reads them once too.
The program's logits after each proposed token say which of them it would have produced itself: at temperature 0
the longest prefix equal to its own greedy choices is kept, plus its own next token, so the output is token for
token plain greedy decoding. When sampling, a proposed token d drawn from a proposal q is kept with probability
min(1, p(d) / q(d)), and at the first rejection the next token is drawn from max(0, p - q) renormalised: the
standard speculative sampling rule, whose output has exactly the program's distribution p. Prompt lookup proposes
deterministically (q is one-hot), so d is kept with probability p(d) and a rejection draws from p without d.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy
import torch

from etblocks.errors import ConfigError
from etblocks.export.sampling import distribution, draw, greedy_token, sample

SPECULATE_MODES = ("prompt_lookup", "draft")
# A dynamic program exported with `max_draft` has this method: `verify(tokens [1, T], input_pos [1]) -> logits
# [1, T, V]`, T up to the value of the constant method MAX_VERIFY_METHOD, over the same state as `forward`.
VERIFY_METHOD = "verify"
MAX_VERIFY_METHOD = "get_max_verify_len"
MAX_NGRAM = 3  # the longest suffix prompt lookup matches
MAX_LOOKUP_PAUSE = 16  # the longest back-off of a proposer function after proposals with nothing kept (steps)
# A draft model exported into the target's file (`export(..., draft=...)`): its methods and constants, this prefix
# before their names (`draft_forward`, `draft_verify`, `draft_get_max_seq_len`, ...).
DRAFT_PREFIX = "draft_"


@dataclass
class SpeculationStats:
    """What one speculative generation did: program calls that checked proposals, tokens proposed and kept, and
    the tokens produced in all (plain one-token calls included)."""

    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    calls: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Proposed tokens the program agreed with, of all proposed."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Generated tokens per program call after the prompt's."""
        return self.tokens / self.calls if self.calls else 0.0


# A proposer: (the sequence so far, the most tokens to propose) -> the proposed tokens (maybe none).
Proposer = Callable[[Sequence[int], int], Sequence[int]]


class Drafter(Protocol):
    """Where proposals come from. `start` sees the prompt once the program has taken it; `propose` returns up to
    `limit` tokens to follow `history` (prompt and generated tokens), with the distribution each was drawn from
    (None: proposed deterministically); `kept(n)` says the program kept the first `n` of them."""

    def start(self, prompt_ids: list[int]) -> None: ...

    def propose(self, history: Sequence[int], limit: int) -> tuple[list[int], list[numpy.ndarray] | None]: ...

    def kept(self, n: int) -> None: ...


class LookupDrafter:
    """A `Drafter` from a proposer function (prompt lookup, or the caller's own) that backs off when it is wrong.

    A checking call costs more than a one-token step (the verify call-cost table in docs/speculation.md), so a
    proposal with nothing kept is a loss. After one, the proposer is not asked for the next `pause` steps, and each
    further all-wrong proposal in a row doubles the pause, up to `MAX_LOOKUP_PAUSE` steps; a proposal with any token
    kept ends the back-off. Proposals that are never right then cost one rejected check every `MAX_LOOKUP_PAUSE + 1`
    steps instead of one every step. The output is the same either way."""

    def __init__(self, propose: Proposer) -> None:
        self._propose = propose
        self._skip = 0  # steps left in the current pause
        self._pause = 1  # the next pause, in steps

    def start(self, prompt_ids: list[int]) -> None:
        self._skip, self._pause = 0, 1

    def propose(self, history: Sequence[int], limit: int) -> tuple[list[int], None]:
        if self._skip:
            self._skip -= 1
            return [], None
        return [int(t) for t in self._propose(history, limit)][:limit], None

    def kept(self, n: int) -> None:
        if n:
            self._pause = 1
        else:
            self._skip, self._pause = self._pause, min(2 * self._pause, MAX_LOOKUP_PAUSE)


def check_max_draft(max_draft: int) -> None:
    if not isinstance(max_draft, int) or isinstance(max_draft, bool) or max_draft < 1:
        raise ConfigError(f"max_draft={max_draft!r} is not accepted; give an integer >= 1 (tokens proposed per call)")


def lookup_drafter(speculate: str | Proposer) -> LookupDrafter:
    """The drafter of `speculate="prompt_lookup"` or of a proposer function."""
    if callable(speculate):
        return LookupDrafter(speculate)
    if speculate == "prompt_lookup":
        return LookupDrafter(prompt_lookup)
    raise ConfigError(
        f"speculate={speculate!r} is not accepted; give one of {list(SPECULATE_MODES)}, a draft Runner, a callable "
        "(tokens so far, max tokens) -> proposed tokens, or None"
    )


def prompt_lookup(history: Sequence[int], max_draft: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to `max_draft` tokens that followed the latest earlier occurrence of the sequence's last n tokens (the
    longest n up to `max_ngram` that occurred before), or none when not even the last token did. One comparison
    over the sequence finds where the last token occurred before; each longer suffix only checks those places."""
    tokens = numpy.asarray(history, dtype=numpy.int64)
    ends = numpy.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier match would end: a token follows it
    if not ends.size:
        return []
    end = ends[-1]
    for n in range(2, min(max_ngram, tokens.size - 1) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[-n]]
        if not ends.size:
            break
        end = ends[-1]
    return tokens[end + 1 : end + 1 + max_draft].tolist()


def accept(
    logits: torch.Tensor,
    draft: Sequence[int],
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    draft_probs: Sequence[numpy.ndarray] | None = None,
) -> list[int]:
    """The tokens a checked proposal yields: the kept prefix of `draft`, then the program's own next token (its
    choice at the first rejection, or one more after the whole draft).

    `logits [len(draft) + 1, V]`: the program's logits after the token before the draft and after each drafted
    token. `draft_probs`: the proposal's distribution for each drafted token (None: proposed deterministically).
    """
    for i, token in enumerate(draft):
        if temperature == 0:
            own = greedy_token(logits[i])
            if own != token:
                return [*draft[:i], own]
            continue
        p = distribution(logits[i], temperature, top_p)
        q_token = 1.0 if draft_probs is None else float(draft_probs[i][token])
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if u * q_token < p[token]:  # kept with probability min(1, p / q)
            continue
        residual = p.astype(numpy.float64)
        if draft_probs is None:
            residual[token] = 0.0
        else:
            residual = numpy.maximum(residual - draft_probs[i], 0.0)
        if residual.sum() <= 0:  # p <= q everywhere means p == q, where nothing is rejected: rounding only
            residual = p.astype(numpy.float64)
        return [*draft[:i], draw(residual, generator)]
    return [*draft, sample(logits[len(draft)], temperature, top_p, generator)]
