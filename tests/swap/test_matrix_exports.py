"""A fixed subset of the support matrix, one family per structural-fallback path and per generic converter, exported
and compared with `generate`; and the generated page against the committed results. The whole matrix with exports
is `benchmarks/support_matrix.py`, whose results make docs/transformers.md."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_matrix import tiny_matrix_model

import etblocks

ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 8


# model type -> what its export covers
EXPORTED = {
    "glm": "rope tables in halves, rotated as interleaved pairs (partial rotary)",
    "cohere": "interleaved rope tables",
    "flint": "NoPE full layers beside rotary sliding ones, attention sinks",
    "gpt_neox": "fused qkv rows per head",
    "gpt2": "Conv1D projections, positions handed over from the model's call",
    "gpt_bigcode": "fused multi-query qkv in blocks",
    "bert": "BERT's inner self-attention without an output projection",
    "cohere2_moe": "generic experts (gather) behind the family's router",
    "aria_text": "generic experts stored transposed",
    "nanochat": "rope rotated the other way, weightless q/k norms",
    "afmoe": "a sigmoid output gate from its own projection, its MoE block with a biased sigmoid router",
    "bitnet": "a norm of the heads' output before the output projection",
    "kolibri1": "a window stored on every layer but used where `is_sliding`; NoPE full layers",
    "lfm3": "one sigmoid output gate per head from `g_proj`",
    "laguna": "a softplus output gate",
}


# Families whose layers are all of one kind: one layer shows what their export covers, in about half the time.
ONE_KIND = {"aria_text", "bert", "bitnet", "cohere", "glm", "gpt2", "gpt_bigcode", "gpt_neox", "nanochat"}


def _exported_tokens(model_type: str, backend: str, tmp_path) -> tuple[list[int], list[int]]:
    original = tiny_matrix_model(model_type, **({"num_hidden_layers": 1} if model_type in ONE_KIND else {}))
    swapped = etblocks.swap(copy.deepcopy(original), backend=backend, max_seq_len=64)
    result = etblocks.export(swapped, backend=backend, out=tmp_path / f"{model_type}.pte")
    with torch.no_grad():
        expected = original.generate(PROMPT, do_sample=False, max_new_tokens=NEW_TOKENS)[0, PROMPT.shape[1] :].tolist()
    actual = etblocks.Runner(result.path).generate(PROMPT[0].tolist(), max_new_tokens=NEW_TOKENS)
    assert len(set(expected)) > 2, "degenerate reference: the test would not tell models apart"
    return expected, actual


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(EXPORTED))
def test_fallback_and_generic_paths_export_token_exact(model_type, tmp_path):
    expected, actual = _exported_tokens(model_type, "xnnpack", tmp_path)
    assert actual == expected, EXPORTED[model_type]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["cohere2_moe", "gpt_neox"])
def test_static_programs_of_generic_paths_are_token_exact(model_type, tmp_path):
    """OpenVINO's static program: dense generic experts from the router's top-k; fused per-head qkv."""
    expected, actual = _exported_tokens(model_type, "openvino", tmp_path)
    assert actual == expected


# model type -> (what the qnn recipe's per-head split must keep, a check of the split attention, config overrides)
SINGLE_HEAD = {
    "bitnet": ("the output norm on the concatenated heads", lambda attn: attn.o_norm is not None, {}),
    "lfm3": ("one sigmoid gate per head", lambda attn: attn.gate_heads[0].weight.shape[0] == 1, {}),
    # Laguna's routed experts sit behind its own router, whose int64 top-k index qnn refuses (tests/test_errors.py):
    # the attention is checked with dense MLPs on both layers.
    "laguna": ("a softplus gate", lambda attn: attn.gate_activation == "softplus", dict(mlp_layer_types=["dense", "dense"])),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(SINGLE_HEAD))
def test_single_head_split_keeps_what_the_upstream_attention_does(model_type):
    """The qnn recipe splits attention per head; the probe (`swap`'s check against the upstream module on prefill
    and decode calls) accepts the split only if it computes what upstream does."""
    what, check, overrides = SINGLE_HEAD[model_type]
    model = etblocks.swap(tiny_matrix_model(model_type, **overrides), backend="qnn", max_seq_len=64, chunk=8)
    split = [m for m in model.modules() if type(m).__name__ == "HFSingleHeadAttention"]
    assert split and all(check(attn) for attn in split), what


def test_support_page_is_what_the_results_give():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "support_matrix.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, "docs/transformers.md is stale: run python benchmarks/support_matrix.py --render"
