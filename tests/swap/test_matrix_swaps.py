"""Every architecture of transformers' causal-LM auto mapping (`hf_matrix.py`): `swap` takes it with the probe
(and its eager logits then match upstream) or refuses it with a typed error, model untouched; never a raw
exception. Exports: `test_matrix_exports.py` (a fixed subset) and `benchmarks/support_matrix.py` (all of them)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_matrix import MATRIX, tiny_matrix_model
from hf_models import assert_untouched, snapshot_of

import etblocks
from etblocks.errors import EtblocksError

PROMPT = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_swap_takes_or_refuses_cleanly(model_type):
    original = tiny_matrix_model(model_type)
    model = copy.deepcopy(original)
    snapshot = snapshot_of(model)
    try:
        etblocks.swap(model, backend="xnnpack", max_seq_len=64)
    except EtblocksError:
        assert_untouched(model, snapshot)
        return
    positions = torch.arange(PROMPT.shape[1])[None]
    with torch.no_grad():
        expected = original(input_ids=PROMPT, position_ids=positions, use_cache=False).logits[:, -1]
        actual = model(input_ids=PROMPT, position_ids=positions, use_cache=False).logits[:, -1]
    assert (actual - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_matrix_covers_every_causal_lm_architecture_once():
    from hf_matrix import NOT_BUILDABLE
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert not set(MATRIX) & set(NOT_BUILDABLE)
    assert set(MATRIX) | set(NOT_BUILDABLE) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["gather", "dense"])
def test_generic_experts_of_every_matrix_family_match_upstream(strategy):
    """Every generic experts module of the matrix that etblocks converts computes what upstream does, called as its
    router calls it, in both strategies: also in families `swap` refuses for another module (their attention or a
    state layer), so the experts are never why a family is refused."""
    from etblocks.swap.hf.moe import convert_generic_experts, generic_experts_layout, is_generic_experts
    from etblocks.swap.recipes import resolve_recipe
    from etblocks.swap.registry import SwapContext

    ctx = SwapContext(recipe=resolve_recipe("xnnpack", moe=strategy), max_seq_len=64)
    checked = []
    for model_type in sorted(MATRIX):
        experts = next((m for m in tiny_matrix_model(model_type).modules() if is_generic_experts(m)), None)
        if experts is None or generic_experts_layout(experts) is None:
            continue
        torch.manual_seed(0)
        x = torch.randn(5, experts.config.hidden_size)
        n_experts = experts.gate_up_proj.shape[0]
        weights, index = torch.randn(5, n_experts).softmax(-1).topk(min(2, n_experts))
        with torch.no_grad():
            expected = experts(x, index, weights)
            actual = convert_generic_experts(experts, ctx)(x, index, weights)
        error = (actual - expected).abs().max().item()
        assert error <= 1e-5 * max(1.0, expected.abs().max().item()), f"{model_type}: max abs error {error:.3g}"
        checked.append(model_type)
    assert len(checked) >= 55, checked  # 59 families in transformers 5.24
