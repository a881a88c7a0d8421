"""next_token_agreement: its measures against independent computations, its feeding pattern and its errors, on
small fake runners (plain objects), no export."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from etblocks.errors import ConfigError
from etblocks.export import AccuracyReport, EagerModel, next_token_agreement

VOCAB = 11
SEQUENCES = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
PREFILL = 3


def random_table(seed: int, rows: int = 7) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


class TableRunner:
    """Logits from a fixed table, row (sum of the tokens so far) % rows, so they depend on the whole history;
    `perturb(position, logits)` changes them at the position of the last token fed. Records its calls."""

    def __init__(self, table: torch.Tensor, perturb: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        self.table = table
        self.perturb = perturb or (lambda position, logits: logits)
        self.history: list[int] = []
        self.calls: list[int] = []
        self.resets = 0

    def reset(self) -> None:
        self.history = []
        self.resets += 1

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        self.calls.append(len(tokens))
        self.history += list(tokens)
        logits = self.table[sum(self.history) % len(self.table)].clone()
        return self.perturb(len(self.history) - 1, logits)


def compared_logits(reference: TableRunner, candidate: TableRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (reference, candidate) logits after every prefix the comparison feeds, computed independently."""
    pairs = []
    for sequence in SEQUENCES:
        for end in range(PREFILL, len(sequence) + 1):
            for runner in (reference, candidate):
                runner.reset()
            pairs.append((reference.forward(sequence[:end]), candidate.forward(sequence[:end])))
    return pairs


def test_kl_matches_torch_distributions():
    reference, candidate = TableRunner(random_table(0)), TableRunner(random_table(0) + random_table(1) * 0.2)
    report = next_token_agreement(reference, candidate, SEQUENCES, PREFILL)
    expected = torch.stack([
        kl_divergence(Categorical(logits=p.double()), Categorical(logits=q.double()))
        for p, q in compared_logits(reference, candidate)
    ])
    assert report.positions == len(expected) == sum(len(s) - PREFILL + 1 for s in SEQUENCES)
    assert report.mean_kl == pytest.approx(float(expected.mean()), rel=1e-9)
    assert report.max_kl == pytest.approx(float(expected.max()), rel=1e-9)
    assert report.p99_kl == pytest.approx(float(torch.quantile(expected, 0.99)), rel=1e-9)
    assert report.mean_kl > 0


def test_identical_runners_agree_fully():
    report = next_token_agreement(TableRunner(random_table(2)), TableRunner(random_table(2)), SEQUENCES, PREFILL)
    assert report == AccuracyReport(positions=report.positions, top1_agreement=1.0, mean_kl=0.0, p99_kl=0.0,
                                    max_kl=0.0)


def demote_top_token_every_third_position(position: int, logits: torch.Tensor) -> torch.Tensor:
    if position % 3 == 0:
        logits[logits.argmax()] = logits.min() - 1
    return logits


def test_known_top1_disagreement():
    table = random_table(3)
    report = next_token_agreement(TableRunner(table), TableRunner(table, demote_top_token_every_third_position),
                                  SEQUENCES, PREFILL)
    positions = [p for s in SEQUENCES for p in range(PREFILL - 1, len(s))]
    flipped = sum(p % 3 == 0 for p in positions)
    assert report.positions == len(positions)
    assert report.top1_agreement == pytest.approx(1 - flipped / len(positions))
    assert report.max_kl > 0


def test_prefill_in_one_call_then_one_token_per_call_after_a_reset():
    reference, candidate = TableRunner(random_table(4)), TableRunner(random_table(4))
    next_token_agreement(reference, candidate, SEQUENCES, PREFILL)
    expected_calls = [n for s in SEQUENCES for n in [PREFILL] + [1] * (len(s) - PREFILL)]
    for runner in (reference, candidate):
        assert runner.calls == expected_calls
        assert runner.resets == len(SEQUENCES)


@pytest.mark.parametrize(
    "sequences, prefill, message",
    [
        ([], 1, "sequences is empty"),
        (SEQUENCES, 0, "prefill=0"),
        ([[1, 2, 3], [1, 2]], 3, "sequence 1 of 2 tokens"),
    ],
)
def test_bad_input_is_refused(sequences, prefill, message):
    with pytest.raises(ConfigError, match=message):
        next_token_agreement(TableRunner(random_table(5)), TableRunner(random_table(5)), sequences, prefill)


def test_vocab_mismatch_is_refused():
    wider = torch.cat([random_table(6), torch.zeros(7, 1)], dim=1)
    with pytest.raises(ConfigError, match="vocab mismatch: the reference gives 11 logits, the candidate 12"):
        next_token_agreement(TableRunner(random_table(6)), TableRunner(wider), SEQUENCES, PREFILL)


def test_logits_must_be_one_row():
    batched = TableRunner(random_table(7), lambda position, logits: logits[None])
    with pytest.raises(ConfigError, match=r"logits of shapes \[11\] \(reference\) and \[1, 11\]"):
        next_token_agreement(TableRunner(random_table(7)), batched, SEQUENCES, PREFILL)


class CumulativeLM(torch.nn.Module):
    """A causal LM whose logits [B, T, V] depend on every earlier token; returned as they are (torchtune's way)
    or as the `.logits` of an output object (transformers' way)."""

    def __init__(self, output_object: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.output_object = output_object

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | SimpleNamespace:
        logits = self.head(self.embed(tokens).cumsum(dim=1))
        return SimpleNamespace(logits=logits) if self.output_object else logits

    def last_logits(self, tokens: list[int]) -> torch.Tensor:
        out = self(torch.tensor([tokens]))
        return (out.logits if self.output_object else out)[0, -1]


@pytest.mark.parametrize("output_object", [False, True])
def test_eager_model_runs_the_whole_sequence_so_far(output_object):
    torch.manual_seed(0)
    module = CumulativeLM(output_object)
    eager = EagerModel(module)
    eager.forward([1, 2, 3])
    assert torch.allclose(eager.forward([4]), module.last_logits([1, 2, 3, 4]))
    eager.reset()
    assert torch.allclose(eager.forward([4]), module.last_logits([4]))
    report = next_token_agreement(eager, EagerModel(module), SEQUENCES, PREFILL)
    assert (report.top1_agreement, report.max_kl) == (1.0, 0.0)
