"""Delegation guard: what each recipe's program delegates, checked against golden summaries.

A change that moves work out of a delegate (an op the partitioner stops taking, a reshape that turns dynamic,
a new CPU kernel between two partitions) changes the summary and fails here. After a deliberate change,
regenerate with `ETBLOCKS_UPDATE_GOLDEN=1 python -m pytest tests/export/test_delegation_golden.py` and review
the diff of `golden_delegation.json` like code.

Core ML and Vulkan programs cannot run here; for them the summary is the evidence: every compute op of
llama and gemma3_text (sliding + full layers, q/k norms, scaled embeddings) is inside the delegate.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from hf_models import original_and_copy, swapped_family

import etblocks

GOLDEN = Path(__file__).with_name("golden_delegation.json")
UPDATE = os.environ.get("ETBLOCKS_UPDATE_GOLDEN") == "1"

# recipe name -> (swap backend, swap options, export backend)
RECIPES = {
    "xnnpack-static": ("xnnpack", dict(shapes="static"), "xnnpack"),
    "xnnpack-hybrid": ("xnnpack", dict(partition="hybrid", sdpa="dynamic", cache_update="index_copy"), "xnnpack"),
    "openvino": ("openvino", {}, "openvino"),
    "coreml": ("coreml", {}, "coreml"),
    "vulkan": ("vulkan", {}, "vulkan"),
}


def summary_of(result: etblocks.ExportResult) -> dict:
    return {
        method: {"partitions": [list(p) for p in summary.partitions], "cpu_ops": dict(sorted(summary.cpu_ops.items()))}
        for method, summary in result.delegations.items()
    }


def export_recipe(recipe: str, family: str, out_dir: Path) -> etblocks.ExportResult:
    swap_backend, options, export_backend = RECIPES[recipe]
    _, model = swapped_family(family, swap_backend, max_seq_len=64, chunk=8, **options)
    return etblocks.export(model, backend=export_backend, out=out_dir / f"{recipe}-{family}.pte")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`exported(recipe, family)`, each program exported once: the golden and the all-compute checks share llama's."""
    out_dir = tmp_path_factory.mktemp("programs")
    return functools.cache(lambda recipe, family: export_recipe(recipe, family, out_dir))


@pytest.fixture(scope="module")
def golden():
    found = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    yield found
    if UPDATE:
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_llama_delegation_matches_golden(recipe, golden, exported):
    actual = summary_of(exported(recipe, "llama"))
    if UPDATE:
        golden[recipe] = actual
    assert recipe in golden, f"no golden summary for {recipe}; run with ETBLOCKS_UPDATE_GOLDEN=1 and review it"
    assert actual == golden[recipe]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("recipe", ["coreml", "vulkan"])
def test_npu_recipes_delegate_all_compute(recipe, family, exported):
    result = exported(recipe, family)
    for method, summary in result.delegations.items():
        assert len(summary.partitions) == 1, f"{recipe} {family} {method}: {summary}"
        assert summary.n_cpu_ops == 0, f"{recipe} {family} {method}: {summary}"


@pytest.mark.slow
def test_hybrid_keeps_attention_core_on_cpu_and_projections_delegated(golden, exported):
    """A hybrid export (the 2-layer llama of the golden test, exported once per module) shows the split: cache writes
    and softmax on CPU, no matmul of a projection or the MLP on CPU (those are `mm`/`linear`, attention's are `bmm`);
    and it is the committed golden, so the golden shows it too."""
    summary = summary_of(exported("xnnpack-hybrid", "llama"))
    for method in ("prefill", "decode"):
        cpu = summary[method]["cpu_ops"]
        assert cpu.get("aten.index_put", 0) == 4  # k and v cache writes of 2 layers
        assert cpu.get("aten._softmax", 0) == 2
        assert not any(op in cpu for op in ("aten.mm", "aten.addmm", "aten.linear"))
        assert summary[method]["partitions"]  # test_static_programs checks that every projection is in them
    if not UPDATE:
        assert summary == golden["xnnpack-hybrid"]


@pytest.mark.slow
def test_coreml_fp16_program_is_fully_delegated(tmp_path):
    """dtype=torch.float16: fp16 weights, masks and caches (the Neural Engine's precision), all in Core ML."""
    _, model = original_and_copy("llama")
    etblocks.swap(model, backend="coreml", max_seq_len=64, chunk=8, dtype=torch.float16)
    result = etblocks.export(model, backend="coreml", out=tmp_path / "fp16.pte")
    assert json.loads(bytes(result.metadata["etblocks_contract"]).decode())["dtype"] == "float16"
    for summary in result.delegations.values():
        assert len(summary.partitions) == 1 and summary.n_cpu_ops == 0, summary
