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
