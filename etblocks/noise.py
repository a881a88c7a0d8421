"""Dependency noise kept out of the terminal: `quiet()`.

torch, torchao, ExecuTorch, coremltools and QNN's quantizer print lines an etblocks user can do nothing about:
optional CUDA kernels missing on a CPU host, deprecations inside the libraries' own calls, the C++ runtime
describing the CPU it found. Each is declared below with where it comes from and how it reaches the terminal;
`quiet()` drops exactly those and passes everything else through, so a new or real problem still shows. The
`etblocks` command runs inside it unless `-v`; from Python it is opt-in:

    with etblocks.quiet():
        result = etblocks.export(model, backend="xnnpack", out="model.pte")

While active it changes process-wide state (warning filters, filters on a few loggers, file descriptor 2,
`sys.stdout` and `sys.stderr`), all restored when the block ends: use it around a call, from one thread.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import logging
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Iterator, Sequence, TextIO


@dataclass(frozen=True)
class Line:
    """A known line: its literal `start`, then a `rest` the regex matches in full (line terminator excluded)."""

    start: str
    rest: str

    def matches(self, line: str) -> bool:
        return line.startswith(self.start) and re.fullmatch(self.rest, line[len(self.start) :]) is not None

    def could_begin(self, partial: str) -> bool:
        """Whether a line beginning with `partial` could still be this one."""
        return self.start.startswith(partial) or partial.startswith(self.start)


# Python warnings: (category, the start of the message as a regex).
WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # ExecuTorch's llama custom ops (their meta kernels call torch._check_is_size; executorch 1.5.1, torch 2.13)
    (FutureWarning, r"_check_is_size will be removed"),
    # torch's pytree when ExecuTorch copies exported programs (torch 2.13)
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # ExecuTorch's emitter: etblocks keeps a dynamic program's state in mutable buffers on purpose (reset zeroes them)
    (UserWarning, r"Mutation on a buffer in the model is detected"),
)

# Log records: (the logger that creates them, "" for the root logger; the start of the message as a regex).
RECORDS: tuple[tuple[str, str], ...] = (
    # torchao's CUDA-only kernels (mxfp8, cutlass) on a host without CUDA, at its import
    ("torchao", r"Failed to load \S*torchao\S*\.so: "),
    # torchao registering its enums with torch's pytree, at its import (torch 2.13)
    ("torch.utils._pytree", r"<enum '\w+'> is an Enum subclass and is now natively supported"),
    # ExecuTorch's passes (QNN's quantization and lowering) using its own deprecated PassManager
    ("executorch.exir.pass_manager", r"PassManager is deprecated"),
    # ExecuTorch's to_edge on ops QNN's partitioner asks to keep whole; said with logging.warning (the root logger)
    ("", r"Op \S+ was requested for preservation by partitioner\.  This request is ignored because it aliases output"),
    # QNN's quantizer without the Qualcomm SDK, which etblocks' quantization and readiness check do not need
    ("", r"The backend_opinfo module couldn't be imported"),
    # coremltools' Core ML runtime, which exists on macOS only, and its version table of optional packages
    ("coremltools", r"Failed to load _ML\w+Proxy: No module named 'coremltools\.libcoremlpython'"),
    ("coremltools", r"\S+ version \S+ (has not been tested with coremltools|is not supported)"),
)

# Lines C++ writes to file descriptor 2, where Python's warnings and logging cannot filter them. ExecuTorch's
# Python runtime logs every level this way, as "[file:line] message".
STDERR_LINES: tuple[Line, ...] = (
    # the runtime's threadpool sizing itself from /sys on first use (hosts without the ARM files it looks for)
    Line(
        "[cpuinfo_utils.cpp:",
        r"\d+\] (Reading file /\S+|Failed to open midr file /\S+|CPU info and manual query on # of cpus dont match\.)",
    ),
    # ExecuTorch's llama custom ops run eagerly while a program is exported, without a runtime temp allocator
    Line("[kernel_runtime_context.h:", r"\d+\] No temp allocator provided"),
)

# Lines Python code prints to sys.stdout.
STDOUT_LINES: tuple[Line, ...] = (
    # QNN's quantizer on ops that have nothing to quantize (device moves and aliases)
    Line("No quant config is implemented for op, ", r"aten\.(to\.device|alias\.default)"),
)

_PIECE = re.compile(r"[^\r\n]+(?:\r\n|\r|\n)?|\r\n|\r|\n")


class LineFilter:
    """Drops whole known lines from a stream of text given in arbitrary pieces, passing everything else on as
    soon as it cannot be one: a partial line is held only while it could still become a known line."""

    def __init__(self, known: Sequence[Line]) -> None:
        self.known = known
        self.held = ""
        self.passing = False  # part of the current line was passed on: the rest follows it

    def feed(self, text: str) -> str:
        """What of `text` (and of what was held) to pass on now."""
        out = []
        for piece in _PIECE.findall(text):
            ended = piece.endswith(("\r", "\n"))
            if self.passing:
                out.append(piece)
                self.passing = not ended
                continue
            line, self.held = self.held + piece, ""
            if ended:
                if not any(known.matches(line.rstrip("\r\n")) for known in self.known):
                    out.append(line)
            elif any(known.could_begin(line) for known in self.known):
                self.held = line
            else:
                out.append(line)
                self.passing = True
        return "".join(out)

    def flush(self) -> str:
        """The partial line held back, given up on (the stream ended or was flushed)."""
        held, self.held = self.held, ""
        self.passing = self.passing or bool(held)
        return held


class _FilteredText:
    """A text stream that drops `known` lines written through it; everything else is the stream's. `flush` keeps a
    partial line held (ExecuTorch's bindings flush after each piece of a line), `end` gives it up."""

    def __init__(self, stream: TextIO, known: Sequence[Line]) -> None:
        self.stream = stream
        self.lines = LineFilter(known)

    def write(self, text: str) -> int:
        self.stream.write(self.lines.feed(text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def end(self) -> None:
        self.stream.write(self.lines.flush())
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class _DropKnown(logging.Filter):
    def __init__(self, patterns: Sequence[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(pattern) for pattern in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.match(message) for pattern in self.patterns)


_active = False


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep the known dependency noise (`WARNINGS`, `RECORDS`, `STDERR_LINES`, `STDOUT_LINES`) out of the
    terminal for the time of the block; everything else passes. The `etblocks` command runs in it unless -v:

        with etblocks.quiet():
            etblocks.export(model, backend="xnnpack", out="model.pte")

    Process-wide while active (see the module's docstring); nested uses are the outer one."""
    if _active:
        yield
        return
    with warnings.catch_warnings(), _filtered_records(), _filtered_stdout(), _filtered_stderr():
        for category, message in WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def active() -> bool:
    """Whether `quiet()` is in effect (then no dependency line breaks into a line left open on stderr)."""
    return _active


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.StringIO and pytest's capture have none
        return None


@contextlib.contextmanager
def _filtered_records() -> Iterator[None]:
    by_logger: dict[str, list[str]] = {}
    for name, pattern in RECORDS:
        by_logger.setdefault(name, []).append(pattern)
    filters = [(logging.getLogger(name), _DropKnown(patterns)) for name, patterns in by_logger.items()]
    for logger, known in filters:
        logger.addFilter(known)
    try:
        yield
    finally:
        for logger, known in filters:
            logger.removeFilter(known)


@contextlib.contextmanager
def _filtered_stdout() -> Iterator[None]:
    original = sys.stdout
    filtered = _FilteredText(original, STDOUT_LINES)
    sys.stdout = filtered
    try:
        yield
    finally:
        filtered.end()
        if sys.stdout is filtered:  # unless someone replaced it meanwhile
            sys.stdout = original


class _QuietStderr:
    """sys.stderr while `quiet()` filters file descriptor 2, without `STDERR_LINES` too: ExecuTorch's bindings
    send the runtime's C++ log lines through sys.stderr while they run a call. A stream on descriptor 2 is written
    straight to where the descriptor went (in order with sys.stdout), another (pytest's, a notebook's) as it is.
    Once `quiet()` has ended, writes go to the original stream again, for whoever kept a reference."""

    def __init__(self, original: TextIO, terminal: int) -> None:
        self.original = original
        stream = original
        if _fileno(original) == 2:
            stream = io.TextIOWrapper(
                io.FileIO(terminal, "w", closefd=False), encoding=original.encoding, errors=original.errors,
                line_buffering=True, write_through=True,
            )
        self.filtered: _FilteredText | None = _FilteredText(stream, STDERR_LINES)

    def end(self) -> None:
        if self.filtered is not None:
            self.filtered.end()
            self.filtered = None

    def write(self, text: str) -> int:
        return self._target.write(text)

    def flush(self) -> None:
        self._target.flush()

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    @property
    def _target(self) -> TextIO:
        return self.original if self.filtered is None else self.filtered


@contextlib.contextmanager
def _filtered_stderr() -> Iterator[None]:
    """File descriptor 2, where C++ writes, through a child process that drops `STDERR_LINES`. A child rather
    than a thread: it reads the pipe to its end even if this process dies, so the last words of a crash still
    reach the terminal. Python's sys.stderr bypasses it (`_QuietStderr`)."""
    global _active
    sys.stderr.flush()
    terminal = os.dup(2)
    read, write = os.pipe()
    # its own session: Ctrl-C in the terminal stops this process, not the filter still forwarding its output
    child = subprocess.Popen([sys.executable, "-m", __name__], stdin=read, stdout=terminal, start_new_session=True)
    os.close(read)
    os.dup2(write, 2)
    os.close(write)
    stream = sys.stderr = _QuietStderr(sys.stderr, terminal)
    _active = True
    try:
        yield
    finally:
        _active = False
        stream.end()
        if sys.stderr is stream:  # unless someone replaced it meanwhile
            sys.stderr = stream.original
        sys.stderr.flush()
        os.dup2(terminal, 2)  # closes this process's end of the pipe: the child reads the rest, then ends
        os.close(terminal)
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process started meanwhile may still hold the pipe
            child.wait(timeout=5)


def forward(source: int, sink: int, known: Sequence[Line]) -> None:
    """Copy file descriptor `source` to `sink` until its end, without `known` lines; bytes that are not UTF-8
    pass unchanged."""
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    lines = LineFilter(known)
    while chunk := os.read(source, 1 << 16):
        _write_all(sink, lines.feed(decoder.decode(chunk)))
    _write_all(sink, lines.feed(decoder.decode(b"", final=True)) + lines.flush())


def _write_all(fd: int, text: str) -> None:
    data = memoryview(text.encode("utf-8", "surrogateescape"))
    while data:
        data = data[os.write(fd, data) :]


if __name__ == "__main__":  # the child process of `_filtered_stderr`
    forward(0, 1, STDERR_LINES)
