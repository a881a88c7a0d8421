"""What the sweep scripts share (`support_matrix.py`, `backend_matrix.py`): one case per fresh process, so a
crash or a hang is recorded as that case's failure, not the run's; and the versions and commit each case ran with.

A sweep script runs one case itself when called as `script --one KEY --one-out FILE` (writing the case's record,
a JSON object, to FILE), and every case that way through `run_isolated`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRASHED = "crashed"


def add_sweep_args(parser: argparse.ArgumentParser, results: Path, page: Path) -> None:
    """`--out`, `--render`, `--check`, and the hidden `--one KEY --one-out FILE` each case runs by."""
    parser.add_argument("--out", type=Path, default=results)
    parser.add_argument("--render", action="store_true", help=f"rewrite {page.relative_to(ROOT)} from the results file")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {page.relative_to(ROOT)} is not what the results give")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)


def one_case_or_page(args: argparse.Namespace, run_case: Callable[[str, Path], dict],
                     render: Callable[[dict], str], page: Path) -> int | None:
    """The exit code of `--one` (`run_case(key, workdir)` in this process, its record into `--one-out`), `--render`
    or `--check` (the page against what the results file gives); None when the call is a sweep."""
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            record = run_case(args.one, Path(tmp))
        args.one_out.write_text(json.dumps(record))
        return 0
    if args.render or args.check:
        text = render(json.loads(args.out.read_text()))
        if args.check:
            return 0 if page.exists() and page.read_text() == text else 1
        page.write_text(text)
        return 0
    return None


def table_cell(text: str, limit: int = 300) -> str:
    """`text` on one line for a Markdown table, `|` escaped, cut to `limit` characters."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text[: limit - 3] + "..." if len(text) > limit else text


def run_isolated(script: Path, key: str, timeout_s: float) -> dict:
    """`script --one key` in a fresh process: its record, with the seconds it took; a crash, or no record within
    `timeout_s`, becomes a record of status `CRASHED` with the reason."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        start = time.perf_counter()
        cmd = [sys.executable, str(script), "--one", key, "--one-out", str(out)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
        except subprocess.TimeoutExpired:
            return {"status": CRASHED, "reason": f"no result within {timeout_s:.0f} s"}
        if not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"status": CRASHED, "reason": f"exit {done.returncode}: {' | '.join(tail)}"[:2000]}
        record = json.loads(out.read_text())
        record["seconds"] = round(time.perf_counter() - start, 1)
        return record


def versions() -> dict:
    return {name: version(name) for name in ("transformers", "torch", "executorch")}


def git_commit() -> dict:
    """The commit of the etblocks checkout a run comes from, and whether its tracked files have changes (a run of
    uncommitted code must not pass for the commit's). Results files and docs do not count: runs write them."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *args], check=False, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results", ":!docs")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def commit_label(record: dict) -> str:
    """A record's commit as the pages show it: 10 hex digits, and "+ local changes" when the tree had some."""
    return f"{str(record.get('git_commit'))[:10]}{' + local changes' if record.get('git_dirty') else ''}"
