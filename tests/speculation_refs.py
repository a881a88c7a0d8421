"""Greedy speculative generation against HF generate, shared by the dynamic and static program tests."""

from __future__ import annotations

import torch
from hf_models import VOCAB, hf_greedy, prompt_ids

import etblocks

NEW_TOKENS = 64
MAX_DRAFT = 4


def repeating_prompt() -> list[int]:
    """Two copies of a random span and the start of a third: prompt lookup finds something to propose."""
    span = prompt_ids(9, seed=5)[0].tolist()
    return span + span + span[:4]


PROMPTS = {"repeating": repeating_prompt(), "random": prompt_ids(13)[0].tolist()}


class Oracle:
    """Proposes the tokens the model will generate (`expected`, after `prompt`), with the one at draft position
    `wrong_at` changed (cycling through every position, one call in five all right), so each draft is kept up to
    a known position; or, with `all_wrong`, proposes only wrong tokens."""

    def __init__(self, prompt: list[int], expected: list[int], all_wrong: bool = False) -> None:
        self.prompt_len, self.expected, self.all_wrong = len(prompt), expected, all_wrong
        self.calls, self.wrong_positions = 0, set()

    def __call__(self, history: list[int], limit: int) -> list[int]:
        done = len(history) - self.prompt_len
        draft = list(self.expected[done : done + limit])
        if self.all_wrong:
            return [(t + 1) % VOCAB for t in draft]
        self.calls += 1
        wrong_at = self.calls % (MAX_DRAFT + 1)
        if wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % VOCAB
            self.wrong_positions.add(wrong_at)
        return draft


def check_greedy_with_speculation(runner: etblocks.Runner, original: torch.nn.Module | None, name: str,
                                  new_tokens: int = NEW_TOKENS) -> None:
    """Prompt lookup, the oracle and all-wrong proposals: each run equals HF generate, and so does the program
    without speculation; with `original=None` (a program whose numbers are not HF's, e.g. int8 caches) each equals
    the program's own greedy output without speculation."""
    for kind, prompt in PROMPTS.items():
        plain = runner.generate(prompt, new_tokens)
        expected = plain if original is None else hf_greedy(original, torch.tensor([prompt]), new_tokens)
        assert len(set(expected)) > 4, "degenerate reference: the test would not tell models apart"
        where = f"{name}, {kind} prompt"
        assert plain == expected, where
        assert runner.generate(prompt, new_tokens, speculate="prompt_lookup", max_draft=MAX_DRAFT) == expected, where
        if kind == "repeating":
            assert runner.last_speculation.verify_calls > 0, where
        oracle = Oracle(prompt, expected)
        assert runner.generate(prompt, new_tokens, speculate=oracle, max_draft=MAX_DRAFT) == expected, where
        stats = runner.last_speculation
        assert oracle.wrong_positions == set(range(MAX_DRAFT)), where
        assert 0 < stats.accepted < stats.drafted and stats.tokens_per_call > 1.5, (where, stats)
        wrong = Oracle(prompt, expected, all_wrong=True)
        assert runner.generate(prompt, new_tokens, speculate=wrong, max_draft=MAX_DRAFT) == expected, where
        stats = runner.last_speculation
        assert stats.accepted == 0 and stats.drafted > 0, where
        assert stats.verify_calls < new_tokens // 4, (where, stats)  # backed off: not a check every step
