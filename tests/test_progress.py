"""etblocks' progress: records on the "etblocks" logger, shown as `[  1.2s] message` lines, counting the running
step's seconds on a terminal; shown from Python only on a terminal (or when asked)."""

from __future__ import annotations

import importlib
import inspect
import io
import logging
import re
import time

import pytest

from etblocks import progress
from etblocks.progress import LOGGER, STEP, ProgressLines, reporting, shown, steps


def logger_state() -> tuple:
    return list(LOGGER.handlers), LOGGER.level, LOGGER.propagate


def test_steps_log_each_message_and_hand_it_to_a_callable(caplog, capsys):
    messages = []
    with caplog.at_level(logging.INFO, logger="etblocks"), steps(messages.append) as say:
        say("lowering")
    assert messages == ["lowering"]
    assert [(r.name, r.getMessage(), getattr(r, STEP)) for r in caplog.records] == [("etblocks", "lowering", True)]
    assert capsys.readouterr().err == ""


def test_steps_are_shown_off_a_terminal_only_when_asked(capsys):
    before = logger_state()
    with steps() as say:  # stderr is pytest's capture, not a terminal
        say("not shown")
    assert capsys.readouterr().err == ""
    with steps(True) as say:
        say("shown")
        LOGGER.warning("careful")
    assert capsys.readouterr().err == "[   0.0s] shown\n[   0.0s] warning: careful\n"
    assert logger_state() == before


def test_a_live_line_counts_the_step_and_ends_with_its_duration(monkeypatch, capsys):
    monkeypatch.setattr(progress, "TICK_SECONDS", 0.05)
    monkeypatch.setenv("COLUMNS", "100")
    with shown(live=True), steps(False) as say:
        say("lowering")
        time.sleep(0.3)
        say("x" * 100)  # wider than the terminal: a plain line
        say("serializing")
    text = capsys.readouterr().err
    assert re.fullmatch(
        r"\[ +0\.0s\] lowering(\r\[ +0\.0s\] lowering  0 s\x1b\[K)+\r\[ +0\.0s\] lowering  0\.\d s\x1b\[K\n"
        r"\[ +0\.\ds\] x{100}\n\[ +0\.\ds\] serializing\n",
        text,
    ), repr(text)


def test_without_live_every_record_is_one_line():
    stream = io.StringIO()
    handler = ProgressLines(stream)
    handler.handle(logging.LogRecord("etblocks", logging.INFO, __file__, 1, "a step", None, None))
    handler.close()
    assert re.fullmatch(r"\[ +\d+\.\ds\] a step\n", stream.getvalue())


def test_reporting_gives_the_function_the_steps_say():
    @reporting
    def work(n: int, *, progress=None) -> int:
        progress(f"step {n}")
        return n

    messages = []
    assert work(3, progress=messages.append) == 3 and messages == ["step 3"]
    assert work(4) == 4  # no progress given: still a callable inside
    assert "progress" in inspect.signature(work).parameters


@pytest.mark.parametrize("name", ["export", "check_readiness"])
def test_long_calls_document_progress(name):
    function = getattr(importlib.import_module("etblocks.export.driver"), name)
    assert "`progress`" in function.__doc__
    assert "progress" in inspect.signature(function).parameters
