"""`export(..., check_accuracy=FILE)`: the written program scored against the unquantized model on the user's text.

The reference is the swapped model itself in PyTorch, float (quantization lasts only while the program is exported),
run as the program's `verify` method would be (`VerifyProgram`: every position's logits); the program is scored by
`Runner.logits`. Both see the same windows of the text, each a new sequence. Beyond `max_perplexity_increase` the
program is refused: its files are removed and `ConfigError` says by how much it missed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from etblocks.errors import ConfigError
from etblocks.export.accuracy import ProgramAccuracy, program_accuracy
from etblocks.export.wrappers import VerifyProgram
from etblocks.state.base import reset_states

MAX_WINDOW = 512  # tokens per scored window, at most (and at most the program's context)


def accuracy_text_ids(
    path: str | Path | None, limit: float | None, tokenizer: Any, model: nn.Module
) -> list[int] | None:
    """The token ids of `check_accuracy`'s text, with the options checked before any work (None: no check)."""
    from etblocks.options import OPTIONS, check

    if path is None:
        if limit is not None:
            raise ConfigError(f"max_perplexity_increase={limit!r} needs check_accuracy= (the text to score the program on)")
        return None
    if limit is not None:
        check(OPTIONS["max_perplexity_increase"], limit)
    info = getattr(model, "etblocks_swap", None)
    if info is None or info.recipe.static:
        raise ConfigError("check_accuracy= takes dynamic programs (a model swapped for dynamic shapes); this one is "
                          + ("static" if info is not None else "not swapped"))
    if tokenizer is None:
        raise ConfigError("check_accuracy= needs a tokenizer to encode its text; give tokenizer= (or export from a "
                          "checkpoint that has one)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"check_accuracy={str(path)!r} cannot be read as UTF-8 text: {exc}") from None
    ids = list(tokenizer(text).input_ids)
    if len(ids) < 2:
        raise ConfigError(f"check_accuracy={str(path)!r} holds {len(ids)} token(s); give a text of at least 2 tokens")
    return ids


def checked_accuracy(model: nn.Module, result: Any, ids: list[int], limit: float | None) -> ProgramAccuracy:
    """`result`'s program against `model` on `ids`; `ConfigError` (the files removed) beyond `limit`."""
    from etblocks.export.runner import Runner

    runner = Runner(result.path, data_path=result.data_path)
    width = min(runner.max_context_len, MAX_WINDOW)
    windows = [ids[start : start + width] for start in range(0, len(ids) - 1, width) if len(ids) - start >= 2]
    eager = VerifyProgram(model, model.etblocks_swap.kind).eval()

    @torch.no_grad()
    def reference(window: list[int]) -> torch.Tensor:
        reset_states(model)
        return eager(torch.tensor([window]), torch.tensor([0]))[0]

    try:
        report = program_accuracy(reference, runner.logits, windows)
    finally:
        reset_states(model)
    if limit is not None and report.increase > limit:
        remove_outputs(result)
        raise ConfigError(f"max_perplexity_increase={limit:g}: the program's perplexity is {report.increase:+.2%} over the "
                          f"unquantized model's ({report}); no file is kept: choose a wider scheme or allow more")
    return report


def remove_outputs(result: Any) -> None:
    """Every file `export` wrote for `result`: the program, its weights, tokenizer and adapters."""
    for file in [result.path, result.data_path, *result.adapters.values()]:
        if file is not None:
            Path(file).unlink(missing_ok=True)
    if result.tokenizer is not None:
        shutil.rmtree(result.tokenizer, ignore_errors=True)
