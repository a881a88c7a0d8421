"""KV-shared layers (Gemma 3n, Gemma 4) in static programs, against untouched transformers.

The families (`KV_SHARED_FAMILIES`: four layers, sliding then full, twice; layers 2-3 reuse the keys and values
of layers 0-1) are also `FAMILIES` entries: their eager parity and dynamic XNNPACK tokens are in
`tests/swap/test_hf_families.py`. Here: the static contract holds one cache per source layer, the static program
run eagerly matches transformers' logits, and the exported static programs generate transformers' greedy tokens
for prompts a multiple of the chunk (16) and not (13), both longer than the window (6).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import KV_SHARED_FAMILIES, WINDOW, assert_untouched, family_pair, hf_greedy, prompt_ids, snapshot_of
from static_refs import CHUNK, CONTEXT, eager_feeder, greedy, swap_static

import etblocks
from etblocks.errors import UnsupportedModelError
from etblocks.export.programs import static_program
from etblocks.swap.hf.adapter import HFKVSharedAttention

NEW_TOKENS = 32
PROMPT_LENGTHS = (16, 13)
# Exported static programs: each backend once per family kind, the MoE variant (dense experts) on OpenVINO.
EXPORTED = [
    ("gemma3n_text", "portable"), ("gemma3n_text", "openvino"),
    ("gemma4_text", "xnnpack"), ("gemma4_text", "openvino"), ("gemma4_text_moe", "openvino"),
]


@pytest.mark.parametrize("name", sorted(KV_SHARED_FAMILIES))
def test_static_contract_holds_one_cache_per_source_layer(name):
    """Four layers, two of which store keys and values: two K/V pairs in the contract, a window's and a full one."""
    original, swapped = swap_static(name, "openvino")
    modes = original.config.kv_sharing_modes
    sources = [i for i, mode in enumerate(modes) if mode == "store"]
    assert len(sources) == 2 and len(modes) == 4
    contract = static_program(swapped).contract
    assert [s.owner for s in contract.states] == [f"model.layers.{i}.self_attn.kv_cache" for i in sources for _ in "kv"]
    rows = [shape[1] for shape in contract.state_shapes()]
    assert rows == [WINDOW, WINDOW, CONTEXT, CONTEXT]
    readers = [layer.self_attn for layer in swapped.model.layers[2:]]
    assert all(isinstance(r, HFKVSharedAttention) for r in readers)
    assert [r.reads for r in readers] == [swapped.model.layers[i].self_attn.kv_share for i in sources]


@pytest.mark.parametrize("name", sorted(KV_SHARED_FAMILIES))
def test_static_eager_matches_hf(name):
    original, swapped = swap_static(name, "openvino")
    feeder = eager_feeder(swapped)
    for length in PROMPT_LENGTHS:
        prompt = prompt_ids(length)
        with torch.no_grad():
            expected = original(prompt).logits[0, -1]
            feeder.reset()
            actual = feeder.forward(prompt[0].tolist())
        error = (actual - expected).abs().max().item()
        assert error <= 1e-4 * max(1.0, expected.abs().max().item()), f"{name} prompt {length}: {error:.3g}"
    prompt = prompt_ids(13)
    with torch.no_grad():
        feeder.reset()
        assert greedy(feeder.forward, prompt[0].tolist(), NEW_TOKENS) == hf_greedy(original, prompt, NEW_TOKENS)


@pytest.fixture(scope="module", params=EXPORTED, ids=str)
def exported(request, tmp_path_factory):
    name, backend = request.param
    original, swapped = swap_static(name, backend)
    result = etblocks.export(swapped, backend=backend, out=tmp_path_factory.mktemp("kv_shared") / f"{name}_{backend}.pte")
    return name, backend, original, result


@pytest.mark.slow
def test_static_program_generates_the_tokens_of_transformers(exported):
    name, backend, original, result = exported
    runner = etblocks.Runner(result.path)
    for length in PROMPT_LENGTHS:
        prompt = prompt_ids(length)
        expected = hf_greedy(original, prompt, NEW_TOKENS)
        assert len(set(expected)) > 4, "degenerate reference: the test would not tell models apart"
        runner.reset()
        assert runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == expected, f"{name} {backend} prompt {length}"


def test_qnn_recipe_refuses_kv_sharing_untouched():
    """The qnn recipe splits attention per head, which KV-shared layers do not take yet: refused, model as it was."""
    _, model = family_pair("gemma3n_text")
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn.*attention='mha'"):
        etblocks.swap(model, backend="qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    assert_untouched(model, snapshot)
