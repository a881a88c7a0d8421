"""MoE models exported with each strategy, under the dynamic and the static contract, against untouched
transformers `generate` (32 greedy tokens). The gather strategy on XNNPACK's dynamic program is in
tests/swap/test_hf_families.py (deepseek_v3, gpt_oss) and benchmarks/support_matrix.py (every family); here: gather
with a chunk below the prompt and dense on the dynamic program, both on static ones."""

from __future__ import annotations

import pytest
from hf_models import family_variant, hf_greedy, prompt_ids, swapped_family

import etblocks
from etblocks.export.programs import dynamic_program
from etblocks.moe import DenseExperts, GatherExperts, MoE
from etblocks.backends import backends
from etblocks.swap.recipes import recipe_for

NEW_TOKENS = 32
CONTEXT = 64
PROMPT_LENGTHS = (16, 13, 5, 17)  # a multiple of the chunk, a padded tail, less than a chunk, a one-token tail


def swapped_pair(name: str, backend: str, **options):
    return swapped_family(name, backend, max_seq_len=CONTEXT, **options)


def strategies(model) -> set[str]:
    return {m.experts.strategy for m in model.modules() if isinstance(m, MoE)}


@pytest.mark.parametrize("backend", sorted(b.name for b in backends()))
def test_recipe_picks_the_strategy_and_options_override_it(backend):
    _, swapped = swapped_pair("qwen3_moe", backend, chunk=8) if recipe_for(backend).static else swapped_pair("qwen3_moe", backend)
    assert strategies(swapped) == {"dense" if backend in ("qnn", "coreml", "vulkan", "openvino") else "gather"}
    other = "gather" if recipe_for(backend).moe == "dense" else "dense"
    _, overridden = swapped_pair("mixtral", "xnnpack", moe=other)
    assert strategies(overridden) == {other}


# Dense experts replace the family's experts only (its router and shared experts stay): plain SwiGLU experts
# (mixtral), with a gated shared expert (qwen2_moe), under MLA with a grouped sigmoid router (deepseek_v3), and
# GPT-OSS's clamped experts with biases. olmoe, qwen3_moe and deepseek_v2 add nothing to these.
DENSE_FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")


@pytest.mark.slow
@pytest.mark.parametrize("name", DENSE_FAMILIES)
def test_dense_strategy_dynamic_program_matches_hf_generate(name, tmp_path):
    original, swapped = swapped_pair(name, "xnnpack", moe="dense")
    assert all(isinstance(m.experts, DenseExperts) for m in swapped.modules() if isinstance(m, MoE))
    result = etblocks.export(swapped, backend="xnnpack", out=tmp_path / f"{name}.pte")
    assert "aten.index.Tensor" not in result.delegation.cpu_ops  # dense never indexes weights
    prompt = prompt_ids(12)
    expected = hf_greedy(original, prompt, NEW_TOKENS)
    assert len(set(expected)) > 4, "degenerate reference: the test would not tell models apart"
    assert etblocks.Runner(result.path).generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == expected


@pytest.mark.slow
def test_gather_dynamic_program_caps_tokens_per_call(tmp_path):
    """Gathered weights scale with the tokens of a call, so a gather program takes at most `chunk` per call; the
    runner feeds a longer prompt in several calls and still generates HF's tokens. Dense programs take the context."""
    original, swapped = swapped_pair("qwen3_moe", "xnnpack", chunk=8)
    result = etblocks.export(swapped, backend="xnnpack", out=tmp_path / "gather.pte")
    assert (result.metadata["get_max_seq_len"], result.metadata["get_max_context_len"]) == (8, CONTEXT)
    prompt = prompt_ids(21)
    expected = hf_greedy(original, prompt, NEW_TOKENS)
    assert etblocks.Runner(result.path).generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == expected
    _, dense = swapped_pair("qwen3_moe", "xnnpack", chunk=8, moe="dense")
    assert dynamic_program(dense).metadata["get_max_seq_len"] == CONTEXT  # the metadata export writes, as above


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, backend, options, experts",
    [
        ("mixtral", "openvino", {}, DenseExperts),
        ("qwen2_moe", "xnnpack", dict(shapes="static"), GatherExperts),
        ("gpt_oss", "portable", dict(shapes="static", moe="dense"), DenseExperts),
        ("olmoe", "portable", dict(shapes="static"), GatherExperts),
    ],
)
def test_static_program_matches_hf_generate(name, backend, options, experts, tmp_path):
    original, swapped = swapped_pair(name, backend, chunk=8, **options)
    assert all(isinstance(m.experts, experts) for m in swapped.modules() if isinstance(m, MoE))
    result = etblocks.export(swapped, backend=backend, out=tmp_path / f"{name}.pte")
    runner = etblocks.Runner(result.path)
    assert runner.contract.chunk == 8
    for length in PROMPT_LENGTHS:
        prompt = prompt_ids(length)
        runner.reset()
        expected = hf_greedy(original, prompt, NEW_TOKENS)
        assert runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == expected, f"{name} prompt {length}"


# One layer holding what each family adds: GPT-OSS's sinks on a sliding layer beside its experts, DeepSeek-V3's MLA
# beside its routed experts (its leading dense MLP layer is every other family's).
ONE_MOE_LAYER = {"gpt_oss": dict(num_hidden_layers=1, layer_types=["sliding_attention"]),
                 "deepseek_v3": dict(num_hidden_layers=1, first_k_dense_replace=0)}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["coreml", "vulkan"])
@pytest.mark.parametrize("name", sorted(ONE_MOE_LAYER))
def test_npu_recipes_lower_the_dense_moe_whole(name, backend, tmp_path):
    """Core ML and Vulkan (lowered here, run only on device) take each method as one partition: routers, dense
    experts, sinks and MLA included. Vulkan leaves only the creation of the -inf scalars on CPU."""
    _, swapped = swapped_family(name, backend, family_variant(name, **ONE_MOE_LAYER[name]), max_seq_len=CONTEXT, chunk=8)
    assert any(getattr(m, "sinks", None) is not None for m in swapped.modules()) == (name == "gpt_oss")
    assert strategies(swapped) == {"dense"}
    result = etblocks.export(swapped, backend=backend, out=tmp_path / f"{name}.pte")
    for method, summary in result.delegations.items():
        assert len(summary.partitions) == 1, f"{method}: {summary}"
        assert set(summary.cpu_ops) <= {"aten.scalar_tensor"}, f"{method}: {summary}"
