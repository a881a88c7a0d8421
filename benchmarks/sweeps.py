"""What the sweep scripts share (`support_matrix.py`, `backend_matrix.py`): one case per fresh process, so a
crash or a hang is recorded as that case's failure, not the run's; and the versions and commit each case ran with.

A sweep script runs one case itself when called as `script --one KEY --one-out FILE` (writing the case's record,
a JSON object, to FILE), and every case that way through `run_isolated`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRASHED = "crashed"


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


def git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() or None
