"""`etblocks.quiet()`: the known dependency lines are dropped wherever they are written (C++ on file descriptor 2,
Python warnings, log records, prints), everything else passes, also the last words of a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from etblocks.noise import STDERR_LINES, STDOUT_LINES, LineFilter

CPUINFO = "[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\n"
TEMP_ALLOCATOR = "[kernel_runtime_context.h:91] No temp allocator provided\n"


def feed_in_pieces(lines: LineFilter, text: str, size: int) -> str:
    out = "".join(lines.feed(text[i : i + size]) for i in range(0, len(text), size))
    return out + lines.flush()


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_line_filter_drops_known_lines_however_they_are_split(size):
    kept = "[cpuinfo_utils.cpp:12] an error the runtime reports\n"
    text = CPUINFO + kept + TEMP_ALLOCATOR + "unknown\r\n[  1.2s] step\n"
    assert feed_in_pieces(LineFilter(STDERR_LINES), text, size) == kept + "unknown\r\n[  1.2s] step\n"


def test_line_filter_passes_a_partial_line_at_once_unless_it_could_be_known():
    lines = LineFilter(STDERR_LINES)
    assert lines.feed("[  3.1s] lowering") == "[  3.1s] lowering"  # a live progress line, no newline yet
    assert lines.feed("\r[  3.1s] lowering  2 s") == "\r[  3.1s] lowering  2 s"
    assert lines.feed("\n[kernel_runtime") == "\n"  # held: it may become a known line
    assert lines.feed("_context.h:91] something new") == ""  # its known start: held to the end of the line
    assert lines.feed(" continued\n") == "[kernel_runtime_context.h:91] something new continued\n"
    assert lines.feed("[cpuinfo") == ""
    assert lines.flush() == "[cpuinfo"  # given up on when the stream is flushed or ends


def test_stdout_filter_drops_only_the_ops_with_nothing_to_quantize():
    kept = "No quant config is implemented for op, aten.mm.default\n"
    text = "No quant config is implemented for op, aten.to.device\n" + kept
    assert feed_in_pieces(LineFilter(STDOUT_LINES), text, 7) == kept


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_quiet_keeps_known_lines_out_and_lets_the_rest_through():
    proc = run_python(
        f"""
        import logging, os, sys, warnings
        import etblocks

        def noise(label):
            os.write(2, {CPUINFO!r}.encode())  # as C++ writes: past Python
            for part in (b"[kernel_runtime_context.h:", b"91", b"] No temp allocator provided", b"\\n"):
                os.write(2, part)
            os.write(2, f"C++ {{label}}\\n".encode())
            for part in ("[", "cpuinfo_utils.cpp", ":", "87", "] ", "Failed to open midr file /sys/x", "\\n"):
                sys.stderr.write(part)  # as ExecuTorch's bindings pass the runtime's log lines on during a call
                sys.stderr.flush()
            warnings.warn("Mutation on a buffer in the model is detected. ExecuTorch assumes", UserWarning)
            warnings.warn(f"warning {{label}}", UserWarning)
            logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.cpython-310-x86.so: no")
            logging.warning("The backend_opinfo module couldn't be imported, so the abstract implementation is used")
            logging.warning(f"record {{label}}")
            print("No quant config is implemented for op, aten.alias.default")
            print(f"print {{label}}")

        with etblocks.quiet():
            with etblocks.quiet():  # nested: the outer one
                noise("inside")
        noise("after")
        """
    )
    assert proc.returncode == 0, proc.stderr
    for label in ("inside", "after"):
        assert f"C++ {label}\n" in proc.stderr and f"UserWarning: warning {label}" in proc.stderr
        assert f"WARNING:root:record {label}" in proc.stderr and f"print {label}\n" in proc.stdout
    known_lines = ("[cpuinfo_utils.cpp:71]", "[cpuinfo_utils.cpp:87]", "[kernel_runtime_context.h:91]",
                   "Mutation on a buffer", "Failed to load", "backend_opinfo")
    for known in known_lines:
        assert proc.stderr.count(known) == 1, known  # only after the block
    assert proc.stdout.count("No quant config") == 1


def test_quiet_passes_the_last_words_of_a_crash():
    proc = run_python(
        """
        import os
        import etblocks

        with etblocks.quiet():
            os.write(2, b"[cpuinfo_utils.cpp:71] Reading file /sys/x\\n")
            os.write(2, b"terminate called after throwing an instance of 'X'\\n  what(): the reason")
            os.abort()
        """
    )
    assert proc.returncode == -signal.SIGABRT
    assert proc.stderr == "terminate called after throwing an instance of 'X'\n  what(): the reason"


def test_python_writes_to_stderr_keep_their_order_with_stdout_and_see_the_terminal():
    """Only file descriptor 2 goes through the filter: sys.stderr writes straight to the terminal, so a prompt on
    stdout after a status line on stderr comes after it, and a progress display knows it is on a terminal."""
    leader, follower = os.openpty()
    code = (
        "import sys, etblocks\nwith etblocks.quiet():\n"
        "    for n in range(50):\n        print(f'status {n}', file=sys.stderr)\n        print(f'prompt {n}')\n"
        "    print(sys.stderr.isatty())\n"
    )
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=follower, stderr=follower)
        os.close(follower)
        output = b""
        while chunk := _read(leader):
            output += chunk
        proc.wait(timeout=60)
    finally:
        os.close(leader)
    lines = output.decode().splitlines()
    assert lines == [line for n in range(50) for line in (f"status {n}", f"prompt {n}")] + ["True"]


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:  # the terminal's other end closed (Linux)
        return b""
