"""How far a quantized (or otherwise changed) program's next-token distributions are from a reference's.

Two measures, over every position of teacher-forced sequences (both models see the same tokens, so one early
difference does not make every later position differ, as it would in free generation):

- top-1 agreement: the fraction of positions where both pick the same most likely token, i.e. where greedy
  decoding would continue alike. It ignores everything but the top token.
- KL(P_ref || P_cand) of the softmax distributions, in nats, computed in float64: how much probability the
  candidate moves, weighted by where the reference puts it, so it also sees changes that do not flip the top token
  (what sampling at temperature 1 would notice). The mean says how much on average; the 99th percentile and the
  maximum say whether a few positions break badly, which a mean hides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from etblocks.errors import ConfigError
from etblocks.progress import Progress, reporting

KL_PERCENTILE = 0.99


class LogitsModel(Protocol):
    """What the comparison drives: `etblocks.Runner`, `EagerModel`, or anything alike."""

    def reset(self) -> None: ...

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed `tokens` after those fed since `reset()`; return the logits `[V]` after the last one."""
        ...


@dataclass(frozen=True)
class AccuracyReport:
    """Next-token agreement of a candidate with a reference over `positions` compared distributions."""

    positions: int
    top1_agreement: float  # fraction of positions whose argmax agrees
    mean_kl: float  # nats, KL(P_ref || P_cand)
    p99_kl: float
    max_kl: float


@dataclass(frozen=True)
class Perplexity:
    """`value`: exp of the mean negative log-probability of `tokens` scored tokens (`Runner.perplexity`)."""

    value: float
    tokens: int
    mean_nll: float  # nats per token

    @classmethod
    def of(cls, log_probs: torch.Tensor) -> Perplexity:
        nll = -float(log_probs.double().mean())
        return cls(float(torch.tensor(nll, dtype=torch.float64).exp()), int(log_probs.numel()), nll)

    def __str__(self) -> str:
        return f"perplexity {self.value:.4f} over {self.tokens} tokens ({self.mean_nll:.4f} nats per token)"


@dataclass(frozen=True)
class ProgramAccuracy:
    """A program scored against its unquantized model on the same text (`export(..., check_accuracy=...)`)."""

    perplexity: float
    reference_perplexity: float
    top1_agreement: float
    mean_kl: float  # nats, KL(P_ref || P_program)
    tokens: int

    @property
    def increase(self) -> float:
        """The program's perplexity over the model's, less one (0.03: 3% more)."""
        return self.perplexity / self.reference_perplexity - 1

    def __str__(self) -> str:
        return (f"perplexity {self.perplexity:.4f} vs {self.reference_perplexity:.4f} unquantized ({self.increase:+.2%}), "
                f"top-1 {self.top1_agreement:.1%}, KL {self.mean_kl:.4f} nats, {self.tokens} tokens")


def program_accuracy(
    reference: Callable[[list[int]], torch.Tensor], candidate: Callable[[list[int]], torch.Tensor], windows: Sequence[list[int]]
) -> ProgramAccuracy:
    """Both given each window teacher-forced (`logits(ids) -> [len(ids), V]`, e.g. `Runner.logits`); every
    position but a window's last predicts the next token."""
    nll_ref, nll, agree, kl, n = 0.0, 0.0, 0, 0.0, 0
    for window in windows:
        targets = torch.tensor(window[1:])[:, None]
        log_p = reference(window)[:-1].double().log_softmax(-1)
        log_q = candidate(window)[:-1].double().log_softmax(-1)
        nll_ref -= float(log_p.gather(1, targets).sum())
        nll -= float(log_q.gather(1, targets).sum())
        agree += int((log_p.argmax(-1) == log_q.argmax(-1)).sum())
        kl += float((log_p.exp() * (log_p - log_q)).sum())
        n += len(window) - 1
    if n == 0:
        raise ConfigError("the text gives no token to score; give at least 2 tokens")
    return ProgramAccuracy(math.exp(nll / n), math.exp(nll_ref / n), agree / n, kl / n, n)


class EagerModel:
    """A PyTorch causal LM (transformers: `.logits` of its output; torchtune: the output itself) as a
    `LogitsModel` without any KV cache: every call runs the whole sequence so far, the plainest reference."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.tokens = []

    @torch.no_grad()
    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        self.tokens += [int(t) for t in tokens]
        out: Any = self.model(torch.tensor([self.tokens], dtype=torch.long))
        logits = out.logits if hasattr(out, "logits") else out
        return logits[0, -1]


@reporting
def next_token_agreement(
    reference: LogitsModel,
    candidate: LogitsModel,
    sequences: Sequence[Sequence[int]],
    prefill: int,
    *,
    progress: Progress | bool | None = None,
) -> AccuracyReport:
    """Compare `candidate` with `reference` over teacher-forced `sequences`.

    For each sequence both are reset, fed its first `prefill` tokens in one call (a prefill), then the remaining
    tokens one per call (decode steps through the KV cache); the next-token distributions are compared after every
    call, so a sequence of length L gives L - prefill + 1 positions. Raises `ConfigError` for no sequences, a
    `prefill` outside 1..len(sequence), or logits that are not `[V]` or whose V differ between the two.
    `progress` shows a step per sequence as `etblocks.export` shows its steps.
    """
    _check_inputs(sequences, prefill)
    agree, kls = 0, []
    for number, sequence in enumerate(sequences, start=1):
        progress(f"comparing next-token distributions on sequence {number} of {len(sequences)}")  # @reporting's say
        tokens = [int(t) for t in sequence]
        reference.reset()
        candidate.reset()
        feeds = [tokens[:prefill]] + [[t] for t in tokens[prefill:]]
        for feed in feeds:
            ref_logits, cand_logits = _checked_logits(reference.forward(feed), candidate.forward(feed))
            agree += int(ref_logits.argmax() == cand_logits.argmax())
            kls.append(kl_divergence(ref_logits, cand_logits))
    kl = torch.tensor(kls, dtype=torch.float64)
    return AccuracyReport(
        positions=len(kls),
        top1_agreement=agree / len(kls),
        mean_kl=float(kl.mean()),
        p99_kl=float(torch.quantile(kl, KL_PERCENTILE)),
        max_kl=float(kl.max()),
    )


def kl_divergence(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> float:
    """KL(softmax(reference) || softmax(candidate)) in nats, in float64."""
    log_p = torch.log_softmax(reference_logits.to(torch.float64), dim=-1)
    log_q = torch.log_softmax(candidate_logits.to(torch.float64), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum())


def _check_inputs(sequences: Sequence[Sequence[int]], prefill: int) -> None:
    if len(sequences) == 0:
        raise ConfigError("sequences is empty; give at least one token sequence")
    for index, sequence in enumerate(sequences):
        if not 1 <= prefill <= len(sequence):
            raise ConfigError(
                f"prefill={prefill} does not fit sequence {index} of {len(sequence)} tokens; accepted is "
                f"1 <= prefill <= the length of every sequence"
            )


def _checked_logits(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if reference.dim() != 1 or candidate.dim() != 1:
        raise ConfigError(
            f"logits of shapes {list(reference.shape)} (reference) and {list(candidate.shape)} (candidate); "
            "forward(tokens) must return the logits [V] after the last token"
        )
    if reference.shape != candidate.shape:
        raise ConfigError(
            f"vocab mismatch: the reference gives {reference.shape[0]} logits, the candidate {candidate.shape[0]}; "
            "compare models over the same vocabulary"
        )
    return reference, candidate
