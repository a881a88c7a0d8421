"""KV-shared layers (Gemma 3n, Gemma 4) in static programs, against untouched transformers.

The families (`KV_SHARED_FAMILIES`: four layers, sliding then full, twice; layers 2-3 reuse the keys and values
of layers 0-1) are also `FAMILIES` entries: their eager parity and Gemma 4's dynamic XNNPACK tokens are in
`tests/swap/test_hf_families.py`. Here: the static contract holds one cache per source layer, the static program
run eagerly matches transformers' logits (also in the qnn recipe's per-head form, whose 16a8w Gemma 4 programs have a
QNN builder for every op), and the exported static programs generate transformers' greedy tokens for prompts a
multiple of the chunk (16) and not (13), both longer than the window (6).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import FEW_HEADS, KV_SHARED_FAMILIES, WINDOW, hf_greedy, prompt_ids, tiny_model
from static_refs import CHUNK, CONTEXT, eager_feeder, greedy, swap_static

import etblocks
from etblocks.backends.qnn.readiness import format_readiness
from etblocks.export import check_readiness
from etblocks.export.programs import static_program
from etblocks.swap.hf.adapter import HFKVSharedAttention, HFSingleHeadAttention
from etblocks.swap.hf.moe import HFRouter

NEW_TOKENS = 32
PROMPT_LENGTHS = (16, 13)
# Exported static programs: every backend takes a family's reuse layers through the same static contract; Gemma 4
# goes to OpenVINO with and without its MoE block (dense experts, the router's index-free form), Gemma 3n to
# portable. Every family on every backend (Gemma 4 on XNNPACK's static program too), and Gemma 3n's dynamic XNNPACK
# program: `benchmarks/backend_matrix.py`; Gemma 4's dynamic XNNPACK program: tests/swap/test_hf_families.py.
EXPORTED = [("gemma3n_text", "portable"), ("gemma4_text", "openvino"), ("gemma4_text_moe", "openvino")]


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


@pytest.mark.parametrize("name", sorted(KV_SHARED_FAMILIES))
def test_single_head_static_eager_matches_hf(name):
    """The qnn recipe's per-head split (1x1-conv projections, caller-owned caches), unquantized: reuse layers read
    the per-head keys and values their source publishes, with its mask."""
    original, swapped = swap_static(name, "qnn")
    attention = [layer.self_attn for layer in swapped.model.layers]
    assert all(isinstance(a, HFSingleHeadAttention) for a in attention)
    assert [a.reads is not None for a in attention] == [False, False, True, True]
    assert len(static_program(swapped).contract.states) == 4
    feeder = eager_feeder(swapped)
    prompt = prompt_ids(13)
    with torch.no_grad():
        expected = original(prompt).logits[0, -1]
        feeder.reset()
        actual = feeder.forward(prompt[0].tolist())
        assert (actual - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
        feeder.reset()
        assert greedy(feeder.forward, prompt[0].tolist(), NEW_TOKENS) == hf_greedy(original, prompt, NEW_TOKENS)


@pytest.mark.slow
def test_qnn_programs_are_fully_covered():
    """16a8w prefill and decode of a sliding and a full source layer and a full layer reusing the latter (2 query
    heads over 1 KV head): every op has a QNN builder, value norms, K=V values and Gemma 4's MoE (its router's dense
    form: no int64 index) included. A sliding reuse layer differs from the full one by its mask only, which the
    sliding source has too (three layers instead of the family's four: the check costs ~0.35 s per graph node).
    Gemma 4 only: Gemma 3n's attention converts by the same layout and converter (`families.py`: `VALUE_NORM`,
    `kv_shared_attention`), and what it adds (AltUp, LAuReL, per-layer inputs) is upstream's own code, which a check
    of its own would add minutes for. Gemma 4 without experts: `benchmarks/backend_matrix.py`."""
    model_type, overrides = KV_SHARED_FAMILIES["gemma4_text_moe"]
    three_layers = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                        num_kv_shared_layers=1)
    model = tiny_model(model_type, **{**overrides, **FEW_HEADS, **three_layers})
    etblocks.swap(model, backend="qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    assert [layer.self_attn.reads is not None for layer in model.model.layers] == [False, False, True]
    assert any(isinstance(m, HFRouter) and m.dense for m in model.modules())
    report = check_readiness(model, "qnn")
    text = format_readiness(report)
    for method, readiness in report.items():
        assert readiness.ready, f"{method}:\n{text}"
        assert not readiness.uncovered and not readiness.dynamic and not readiness.bad_dtypes
