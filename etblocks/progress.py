"""How etblocks reports its progress: records on the `logging` logger "etblocks", shown as `[  12.3s] message`.

Long calls (`etblocks.export`, `check_readiness`, `next_token_agreement`) take `progress=` and report each step
through `steps(progress)`: logged at INFO, and handed to `progress` when it is a callable. Shown where:

- the `etblocks` command shows etblocks' records on stderr;
- from Python, a call shows its steps on stderr when stderr is a terminal and `logging` is not set up to show
  etblocks' INFO records (`progress=None`, the default), always with `progress=True`, not with `progress=False`.
  Set `logging` up (e.g. `logging.basicConfig(level=logging.INFO)`) to send them elsewhere instead.

On a terminal, inside `etblocks.quiet()` (where the command runs unless -v), the running step's line counts its
seconds and ends with how long the step took; without it, dependencies' own lines would break into that line.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import sys
import threading
import time
import weakref
from typing import Callable, Iterator, TextIO, TypeVar

from etblocks import noise

LOGGER = logging.getLogger("etblocks")
Progress = Callable[[str], None]
STEP = "etblocks_step"  # the attribute `steps` sets on its records: a step that lasts until the next message
TICK_SECONDS = 1.0
LIVE_MARGIN = 12  # room a live line keeps for its seconds: a longer one would wrap, and "\r" not reach its start

_DISPLAYS: weakref.WeakSet[ProgressLines] = weakref.WeakSet()
F = TypeVar("F", bound=Callable)


class ProgressLines(logging.Handler):
    """Records as `[  12.3s] message` lines on `stream`, the seconds counted from when the handler was made (a
    warning or an error says so first). `live` (for a terminal): the line of a step stays open while it runs,
    counting its seconds, and ends with its duration (unless it is too long to rewrite in the terminal's width)."""

    def __init__(self, stream: TextIO, live: bool = False) -> None:
        super().__init__(logging.INFO)
        self.stream = stream
        self.live = live
        self.start = time.time()
        self._step: tuple[str, float] | None = None  # the open line and when its step began
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        _DISPLAYS.add(self)

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        return f"[{record.created - self.start:6.1f}s] {level}{record.getMessage()}"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            self._end_step()
            if self.live and getattr(record, STEP, False) and _fits_a_line(text):
                self._write(text)
                self._step = (text, time.perf_counter())
                self._start_ticker()
            else:
                self._write(text + "\n")
        except Exception:
            self.handleError(record)

    def end_step(self) -> None:
        """End the open step's line (its call returned)."""
        with self.lock:
            self._end_step()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.end_step()
        super().close()

    def _end_step(self) -> None:
        if self._step is None:
            return
        text, began = self._step
        self._step = None
        seconds = time.perf_counter() - began
        self._write(f"\r{text}  {seconds:.1f} s\x1b[K\n" if seconds >= TICK_SECONDS else "\n")

    def _start_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="etblocks-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            with self.lock:
                if self._step is not None:
                    text, began = self._step
                    seconds = time.perf_counter() - began
                    if seconds >= TICK_SECONDS:
                        self._write(f"\r{text}  {seconds:.0f} s\x1b[K")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _fits_a_line(text: str) -> bool:
    return len(text) + LIVE_MARGIN < shutil.get_terminal_size().columns


@contextlib.contextmanager
def shown(live: bool | None = None) -> Iterator[ProgressLines]:
    """etblocks' records shown on stderr for the time of the block, instead of going on to other handlers (a
    handler `logging.warning` installs meanwhile would repeat them). `live`: count a step's seconds on its line
    (default: on a terminal, inside `etblocks.quiet()`; without it, dependencies' lines would break into it)."""
    handler = ProgressLines(sys.stderr, _stderr_is_terminal() and noise.active() if live is None else live)
    level, propagate = LOGGER.level, LOGGER.propagate
    LOGGER.addHandler(handler)
    if level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
    try:
        yield handler
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
        LOGGER.propagate = propagate
        handler.close()


@contextlib.contextmanager
def steps(progress: Progress | bool | None = None) -> Iterator[Progress]:
    """`say(message)` for the steps of one long call: logged at INFO on "etblocks" as a step (a live display
    counts its seconds until the next message or the end of the block) and passed to `progress` if it is a
    callable. Shown on stderr for the call with `progress=True`, or `None` when stderr is a terminal and `logging`
    is not set up to show them."""
    show = progress is True or (progress is None and _stderr_is_terminal() and not _logging_shows_info())
    callback = progress if callable(progress) else None

    def say(message: str) -> None:
        LOGGER.info(message, extra={STEP: True})
        if callback is not None:
            callback(message)

    with shown() if show else contextlib.nullcontext():
        try:
            yield say
        finally:
            for display in list(_DISPLAYS):
                display.end_step()


def _stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def _logging_shows_info() -> bool:
    """Whether `logging` is set up to show etblocks' INFO records (a level and a handler for them: the handler
    `logging.info()` installs by itself, as ExecuTorch's import does, keeps the root's WARNING level)."""
    return LOGGER.isEnabledFor(logging.INFO) and LOGGER.hasHandlers()


def reporting(function: F) -> F:
    """Run `function` inside `steps(progress)`, its keyword argument `progress` given as the steps' `say`."""

    @functools.wraps(function)
    def call(*args, progress: Progress | bool | None = None, **kwargs):
        with steps(progress) as say:
            return function(*args, progress=say, **kwargs)

    return call  # type: ignore[return-value]
