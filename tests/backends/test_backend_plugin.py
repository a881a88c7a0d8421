"""A backend added in one file (`hostnpu_backend.py`), with its own recipe and limit, used by the Python API and by
the `etblocks` command (found through the `etblocks.backends` entry-point group), nothing else edited."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import etblocks
from etblocks.backends import _REGISTRY, backends, get_backend, register_backend
from etblocks.demo import demo_model
from etblocks.errors import ConfigError

HERE = Path(__file__).parent
PROMPT = [1, 7, 42, 9, 100, 3, 18]  # 7 tokens: a chunk of 4 and a padded remainder of 3
NEW_TOKENS = 10


@pytest.fixture
def hostnpu():
    from hostnpu_backend import HostNpu

    register_backend(HostNpu)
    yield get_backend("hostnpu")
    _REGISTRY.pop("hostnpu")


@torch.no_grad()
def demo_greedy() -> list[int]:
    tokens = demo_model().generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokens[0, len(PROMPT) :].tolist()


@pytest.mark.slow
def test_registered_backend_swaps_exports_and_runs(hostnpu, tmp_path):
    assert hostnpu in backends()
    model = etblocks.swap(demo_model(), backend="hostnpu", max_seq_len=32)
    recipe = model.etblocks_swap.recipe
    assert (recipe.backend, recipe.shapes, recipe.cache, recipe.chunk) == ("hostnpu", "static", "io", 4)
    result = etblocks.export(model, backend="hostnpu", out=tmp_path / "demo.pte")
    assert result.backend == "hostnpu" and result.methods[:2] == ["prefill", "decode"]
    assert etblocks.Runner(result.path).generate(PROMPT, max_new_tokens=NEW_TOKENS) == demo_greedy()
    with pytest.raises(ConfigError, match="does not lower to backend='hostnpu': this test backend declares"):
        etblocks.swap(demo_model(), backend="hostnpu", kv_quantize="int8")


@pytest.mark.slow
def test_entry_point_backend_exports_through_the_cli(tmp_path):
    dist = tmp_path / "hostnpu_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hostnpu-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[etblocks.backends]\nhostnpu = hostnpu_backend:HostNpu\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "etblocks"]
    listed = subprocess.run([*command, "export", "--help"], env=env, capture_output=True, text=True, check=True).stdout
    assert "hostnpu" in listed
    out = tmp_path / "cli.pte"
    export = subprocess.run(
        [*command, "export", "--model", "demo", "--backend", "hostnpu", "--max-seq-len", "32", "--out", str(out)],
        env=env, capture_output=True, text=True,
    )
    assert export.returncode == 0, export.stderr[-2000:]
    assert "backend     hostnpu" in export.stdout and "prefill T=4" in export.stdout
    assert etblocks.Runner(out).generate(PROMPT, max_new_tokens=NEW_TOKENS) == demo_greedy()
