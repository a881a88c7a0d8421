"""Each typed error: raised early, naming the value and what is accepted, leaving the model untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import assert_untouched, family_pair, original_and_copy, prompt_ids, snapshot_of, tiny_model

import etblocks
from etblocks.errors import BackendUnavailableError, ConfigError, ContextOverflowError, UnsupportedModelError
from etblocks.backends import get_backend
from etblocks.swap.hf.fallback import infer_layouts


def test_unknown_architecture_names_class_and_supported():
    model = tiny_model("mpt", d_model=64, n_layers=2, n_heads=4)  # `Wqkv` with ALiBi: fits no layout
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"MptAttention.*supported attention classes: \[.*LlamaAttention"):
        etblocks.swap(model, backend="xnnpack")
    assert_untouched(model, snapshot)


def test_probe_mismatch_names_module_and_error_size():
    """A module the structural fallback takes for the common layout but that computes something else: every layout
    variant fails the probe, and the refusal names the module, the error and how many layouts were tried."""
    from transformers.models.glm.modeling_glm import GlmAttention

    class ScaledGlmAttention(GlmAttention):
        def forward(self, *args, **kwargs):
            output, weights = super().forward(*args, **kwargs)
            return 2 * output, weights

    model = tiny_model("glm")
    for layer in model.model.layers:
        layer.self_attn.__class__ = ScaledGlmAttention
    assert len(infer_layouts(model.model.layers[0].self_attn)) > 1
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn \(ScaledGlmAttention\).*max abs error [0-9.e+-]+ > tolerance .*the first of [0-9]+ layouts tried"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    assert_untouched(model, snapshot)


def test_registered_converter_mismatch_is_caught_too():
    """A wrong converter registered by a user is caught by the same probe."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    from etblocks.swap.hf.convert import HFAttentionLayout, attention_from_layout
    from etblocks.swap.registry import MIXERS

    class SkewedAttention(LlamaAttention):
        pass

    @etblocks.register(SkewedAttention)
    def wrong(module, ctx):
        block = attention_from_layout(module, HFAttentionLayout(), ctx)
        block.use_rope = False  # drops the rotation: outputs differ
        return block

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.__class__ = SkewedAttention
    try:
        with pytest.raises(UnsupportedModelError, match="SkewedAttention"):
            etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    finally:
        MIXERS._converters.pop(SkewedAttention)


@pytest.mark.parametrize("backend", ["xnnpack", "openvino"])
def test_converter_whose_decode_misreads_cached_rows_is_refused(backend):
    """A converter that is right on a prefill from empty caches but reads cached rows one position off afterwards
    (dynamic caches for xnnpack, caller-owned ones for openvino's static programs): the probe's decode steps catch it, naming the module."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    from etblocks.swap.hf.convert import HFAttentionLayout, attention_from_layout
    from etblocks.swap.registry import MIXERS

    class MisreadAttention(LlamaAttention):
        pass

    def misread(attend):
        def wrong(q, k, v, q_pos, k_pos, mask=None):
            if int(q_pos[0]) > 0:  # a call after the prefill: each key's value is read from the row after it
                keys = mask.shape[-1] if k_pos is None else k_pos.shape[-1]
                v = torch.roll(v, shifts=-1, dims=list(v.shape).index(keys))
            return attend(q, k, v, q_pos, k_pos, mask)

        return wrong

    @etblocks.register(MisreadAttention)
    def convert(module, ctx):
        block = attention_from_layout(module, HFAttentionLayout(), ctx)
        block.attend = misread(block.attend)
        return block

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.__class__ = MisreadAttention
    snapshot = snapshot_of(model)
    try:
        with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn \(MisreadAttention\).* the call at positions 1[0-9]\.\.[0-9]+ after the prefill"):
            etblocks.swap(model, backend=backend, max_seq_len=32)
    finally:
        MIXERS._converters.pop(MisreadAttention)
    assert_untouched(model, snapshot)


def test_max_seq_len_beyond_positions():
    original, model = original_and_copy("llama", max_position_embeddings=64)
    with pytest.raises(ConfigError, match=r"max_seq_len=100 .*max_position_embeddings=64.*2\.\.64"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=100)
    etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    with pytest.raises(ConfigError, match=r"max_seq_len=65"):
        etblocks.export(model, backend="xnnpack", out="unused.pte", max_seq_len=65)
    with pytest.raises(ConfigError, match=r"max_seq_len=48 is longer than the 32 this model was swapped for"):
        etblocks.export(model, backend="xnnpack", out="unused.pte", max_seq_len=48)


def test_unknown_backend():
    _, model = original_and_copy("llama")
    with pytest.raises(ConfigError, match=r"backend='tpu'.*accepted: \['coreml', 'openvino', 'portable', 'qnn', 'vulkan', 'xnnpack'\]"):
        etblocks.swap(model, backend="tpu")
    with pytest.raises(ConfigError, match=r"backend='tpu' is unknown; accepted: \['coreml', 'openvino', 'portable', 'qnn', 'vulkan', 'xnnpack'\]"):
        etblocks.export(model, backend="tpu", out="unused.pte")


def test_unknown_recipe_option():
    _, model = original_and_copy("llama")
    with pytest.raises(ConfigError, match=r"sdpa='flash' \(str\) is not accepted; choose one of \['custom', 'dynamic', 'static'\]"):
        etblocks.swap(model, backend="xnnpack", sdpa="flash")
    with pytest.raises(ConfigError, match=r"unknown recipe option flash=True; accepted options: \['attention', 'cache'"):
        etblocks.swap(model, backend="xnnpack", flash=True)


def test_qnn_without_sdk_is_unavailable(monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    _, model = original_and_copy("llama")
    etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    with pytest.raises(BackendUnavailableError, match="QNN_SDK_ROOT"):
        etblocks.export(model, backend="qnn", out="unused.pte")


def test_backend_not_installed(monkeypatch):
    monkeypatch.setattr(get_backend("openvino"), "requires", "openvino_not_here")
    _, model = original_and_copy("llama")
    with pytest.raises(BackendUnavailableError, match=r"backend='openvino' is not installed .*pip install 'etblocks\[openvino\]'"):
        etblocks.export(model, backend="openvino", out="unused.pte")


def test_export_before_swap():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="has not been swapped"):
        etblocks.export(model, backend="xnnpack", out="unused.pte")


def test_swap_twice():
    _, model = original_and_copy("llama")
    etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    with pytest.raises(ConfigError, match="already swapped"):
        etblocks.swap(model, backend="portable")


@pytest.fixture(scope="module")
def small_program(tmp_path_factory):
    _, model = original_and_copy("llama")
    etblocks.swap(model, backend="xnnpack", max_seq_len=16)
    return etblocks.export(model, backend="xnnpack", out=tmp_path_factory.mktemp("ctx") / "m.pte").path


@pytest.mark.slow
def test_prompt_longer_than_context(small_program):
    runner = etblocks.Runner(small_program)
    with pytest.raises(ContextOverflowError, match=r"prompt of 17 tokens at position 0 .* context is 16"):
        runner.generate(list(range(3, 20)), max_new_tokens=1)


@pytest.mark.slow
def test_generation_past_context_is_refused_before_running(small_program):
    runner = etblocks.Runner(small_program)
    prompt = prompt_ids(10)[0].tolist()
    with pytest.raises(ContextOverflowError, match=r"needs 17 positions.*context is 16 \(at most 7 new tokens fit"):
        runner.generate(prompt, max_new_tokens=8)
    assert runner.pos == 0
    assert len(runner.generate(prompt, max_new_tokens=7)) == 7  # exactly fills the context
    with pytest.raises(ContextOverflowError, match=r"at most 0 new tokens fit"):
        runner.generate([5], max_new_tokens=1, fresh=False)
    assert len(runner.generate(prompt, max_new_tokens=2)) == 2  # a new sequence


def test_chunk_larger_than_context():
    _, model = original_and_copy("llama")
    snapshot = snapshot_of(model)
    with pytest.raises(ConfigError, match=r"chunk=32 is larger than the context max_seq_len=16; give chunk <= 16"):
        etblocks.swap(model, backend="openvino", max_seq_len=16, chunk=32)
    assert_untouched(model, snapshot)
    with pytest.raises(ConfigError, match=r"chunk=1 \(int\) is not accepted; give an integer >= 2"):
        etblocks.swap(model, backend="openvino", max_seq_len=16, chunk=1)


@pytest.mark.parametrize(
    "backend, options, message",
    [
        ("coreml", dict(quantize_activations="16a8w"), r"backend='coreml' does not support quantize_activations='16a8w'; it takes: none; Core ML programs are fp32 or fp16"),
        ("xnnpack", dict(attention="sha"), r"attention='sha' is a static block"),
        ("qnn", dict(cache="inplace"), r"attention='sha' is a static block"),
        ("openvino", dict(linear="conv2d"), r"linear='conv2d' applies to the per-head projections of attention='sha'"),
        ("qnn", dict(quantize_activations="4a4w"), r"quantize_activations='4a4w'; it takes: \['16a8w', '16a4w', '8a8w'\]"),
        ("xnnpack", dict(moe="sparse"), r"moe='sparse' \(str\) is not accepted; choose one of \['dense', 'gather'\]"),
    ],
)
def test_recipe_option_the_backend_does_not_support(backend, options, message):
    _, model = original_and_copy("llama")
    snapshot = snapshot_of(model)
    with pytest.raises(ConfigError, match=message):
        etblocks.swap(model, backend=backend, max_seq_len=32, **options)
    assert_untouched(model, snapshot)


def test_export_options_that_do_not_fit_the_program():
    _, dynamic = original_and_copy("llama")
    etblocks.swap(dynamic, backend="xnnpack", max_seq_len=32)
    with pytest.raises(ConfigError, match=r"backend='coreml' takes fixed shapes only"):
        etblocks.export(dynamic, backend="coreml", out="unused.pte")
    with pytest.raises(ConfigError, match=r"quantize_activations='16a8w' applies to static programs"):
        etblocks.export(dynamic, backend="xnnpack", out="unused.pte", quantize_activations="16a8w")
    _, static = original_and_copy("llama")
    etblocks.swap(static, backend="openvino", max_seq_len=32, chunk=8)
    with pytest.raises(ConfigError, match=r"quantize_weights='int4' \(str\) is not accepted"):
        etblocks.export(static, backend="portable", out="unused.pte", quantize_weights="int4")
    with pytest.raises(ConfigError, match=r"quantize_activations='16a8w' is not accepted for a model swapped for backend='openvino'.*: \['qnn'\]"):
        etblocks.export(static, backend="portable", out="unused.pte", quantize_activations="16a8w")
    with pytest.raises(ConfigError, match=r"backend_options \['chipset'\] are not options of backend='portable'"):
        etblocks.export(static, backend="portable", out="unused.pte", backend_options={"chipset": "SM8750"})


@pytest.fixture(scope="module")
def small_static_program(tmp_path_factory):
    _, model = original_and_copy("llama")
    etblocks.swap(model, backend="portable", shapes="static", max_seq_len=16, chunk=4)
    return etblocks.export(model, backend="portable", out=tmp_path_factory.mktemp("static") / "m.pte").path


@pytest.mark.slow
def test_static_runner_refuses_caches_of_wrong_shape_or_dtype(small_static_program):
    runner = etblocks.Runner(small_static_program)
    prompt = prompt_ids(6)[0].tolist()
    runner.forward(prompt)
    caches, pos = runner.caches, runner.pos
    assert [tuple(c.shape) for c in caches] == [(1, 16, 2, 16)] * 4
    wrong_shape = [*caches[:3], torch.zeros(1, 8, 2, 16)]
    with pytest.raises(ConfigError, match=r"caches\[3\] \(v_cache.1\) is \(1, 8, 2, 16\) torch.float32; the program takes \(1, 16, 2, 16\) torch.float32"):
        runner.restore(wrong_shape, pos)
    with pytest.raises(ConfigError, match=r"caches\[0\] \(k_cache.0\) is \(1, 16, 2, 16\) torch.float16"):
        runner.restore([caches[0].half(), *caches[1:]], pos)
    with pytest.raises(ConfigError, match=r"caches: got 3 tensors, the program has 4"):
        runner.restore(caches[:3], pos)
    # restoring what it saved continues exactly like the runner that never stopped
    fresh = etblocks.Runner(small_static_program)
    fresh.restore(caches, pos)
    assert fresh.generate([7], max_new_tokens=3, fresh=False) == runner.generate([7], max_new_tokens=3, fresh=False)


@pytest.mark.slow
def test_static_prompt_over_context(small_static_program):
    runner = etblocks.Runner(small_static_program)
    with pytest.raises(ContextOverflowError, match=r"prompt of 17 tokens at position 0 .* context is 16"):
        runner.generate(list(range(3, 20)), max_new_tokens=1)
    assert runner.pos == 0


def test_export_context_shorter_than_the_chunk_changes_nothing():
    _, model = original_and_copy("llama")
    etblocks.swap(model, backend="openvino", max_seq_len=32, chunk=16)
    with pytest.raises(ConfigError, match=r"max_seq_len=8 is shorter than this static swap's chunk=16; accepted: 16\.\.32"):
        etblocks.export(model, backend="portable", out="unused.pte", max_seq_len=8)
    assert model.etblocks_swap.max_seq_len == 32


def test_hybrid_partition_needs_a_configurable_partitioner():
    _, model = original_and_copy("llama")
    etblocks.swap(model, backend="openvino", max_seq_len=32, chunk=8, partition="hybrid")
    with pytest.raises(ConfigError, match=r"partition='hybrid' works with configuration-based partitioners \(XNNPACK\); got OpenvinoPartitioner"):
        etblocks.export(model, backend="openvino", out="unused.pte")


def test_mla_configs_it_cannot_serve():
    _, model = family_pair("deepseek_v3")
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"DeepseekV3Attention.*MLA has no single-head form"):
        etblocks.swap(model, backend="qnn", max_seq_len=32, chunk=8)
    assert_untouched(model, snapshot)


def test_moe_configs_it_cannot_serve():
    """A router asking for more experts than exist, and OLMoE's q/k/v clamping: refused, nothing swapped."""
    _, model = family_pair("qwen3_moe")
    model.model.layers[1].mlp.gate.top_k = 9
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp \(Qwen3MoeSparseMoeBlock\).*top_k=9 must be in 1\.\.8"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    assert_untouched(model, snapshot)

    _, model = family_pair("olmoe")
    model.config.clip_qkv = 8.0
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"OlmoeAttention.*clip_qkv=8\.0 .* is not supported; accepted: None"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    assert_untouched(model, snapshot)


def test_moe_top_k_index_on_a_backend_without_int64_is_refused():
    """QNN's HTP holds no int64 tensors: experts picked by a top-k index (the gather strategy, or generic experts
    behind their family's router, left upstream) are refused at swap, naming the module, why and the way out, rather
    than found by the readiness check after it. The same models swap for a backend that holds int64."""
    from hf_matrix import tiny_matrix_model

    _, model = family_pair("qwen3_moe")
    snapshot = snapshot_of(model)
    with pytest.raises(
        UnsupportedModelError,
        match=r"model\.layers\.0\.mlp \(Qwen3MoeSparseMoeBlock\): its experts take the gather strategy.*int64.*"
        r"backend='qnn' cannot take it: the Hexagon NPU \(HTP\) holds no int64 tensors\. Swap with moe='dense'",
    ):
        etblocks.swap(model, backend="qnn", max_seq_len=32, chunk=8, moe="gather")
    assert_untouched(model, snapshot)

    model = tiny_matrix_model("cohere2_moe")
    snapshot = snapshot_of(model)
    with pytest.raises(
        UnsupportedModelError,
        match=r"model\.layers\.\d+\.mlp\.experts \(Cohere2MoeExperts\): its family's router, which etblocks does "
        r"not convert, hands it a top-k index.*Register a converter for the family's MoE block returning an "
        r"etblocks\.moe\.MoE.*or for its router returning an etblocks\.swap\.hf\.moe\.HFRouter.*"
        r"or swap for one of \[.*'openvino'.*\]",
    ):
        etblocks.swap(model, backend="qnn", max_seq_len=32, chunk=8)
    assert_untouched(model, snapshot)
    etblocks.swap(model, backend="openvino", max_seq_len=32, chunk=8)
    assert "experts" in {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m).__name__ == "HFExperts"}


def test_moe_blocks_with_their_routers_in_etblocks_form_swap_for_qnn():
    """ERNIE 4.5 and LFM2-MoE keep routers of their own (a correction bias; sigmoid scores) in front of transformers'
    generic experts: their blocks convert whole, so the qnn recipe's dense strategy holds no top-k index and the
    swap (whose probe checks each block against upstream's) succeeds where it refused them before the routers had
    etblocks' form."""
    from hf_matrix import tiny_matrix_model

    from etblocks.moe import DenseExperts, GroupedTopKRouter, MoE
    from etblocks.swap.hf.moe import HFExperts

    for model_type in ("ernie4_5_moe", "lfm2_moe"):
        model = tiny_matrix_model(model_type)
        etblocks.swap(model, backend="qnn", max_seq_len=32, chunk=8)
        blocks = [m for m in model.modules() if isinstance(m, MoE)]
        assert blocks, model_type
        assert all(isinstance(b.router, GroupedTopKRouter) and isinstance(b.experts, DenseExperts) for b in blocks)
        assert not any(isinstance(m, HFExperts) for m in model.modules()), model_type


def test_moe_probe_catches_a_block_that_computes_something_else():
    """A subclass inherits its parent's converter; if it computes differently, the probe names it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    class ScaledMoe(Qwen3MoeSparseMoeBlock):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    _, model = family_pair("qwen3_moe")
    for layer in model.model.layers:
        layer.mlp.__class__ = ScaledMoe
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp \(ScaledMoe\) does not match"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    assert_untouched(model, snapshot)


@pytest.mark.slow
def test_moe_experts_etblocks_does_not_convert_are_refused_until_they_export(tmp_path):
    """HunYuan-MoE's generic experts with a norm after each expert (`has_post_expert_norm`, which etblocks' experts
    do not have): its default experts kernel does not export, so swap refuses it by name and says how out; with
    transformers' `batched_mm` kernel the swapped model exports and generates HF's tokens."""
    from hf_models import hf_greedy
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = tiny_model("hunyuan_v1_moe", num_experts=8, moe_topk=2, num_experts_per_tok=2, moe_intermediate_size=32)
    for layer in model.model.layers:
        layer.mlp.experts.has_post_expert_norm = True
        layer.mlp.experts.post_expert_norm = LlamaRMSNorm(model.config.hidden_size)
    snapshot = snapshot_of(model)
    with pytest.raises(
        UnsupportedModelError,
        match=r"model\.layers\.0\.mlp\.experts \(HunYuanMoEV1Experts\) is a transformers MoE experts module etblocks "
        r"does not convert \(has_gate=True, has_post_expert_norm=True\), and experts_implementation='grouped_mm' does not "
        r"export.*set_experts_implementation\('batched_mm'\)",
    ):
        etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    assert_untouched(model, snapshot)

    model.set_experts_implementation("batched_mm")
    original = copy.deepcopy(model)
    etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    result = etblocks.export(model, backend="xnnpack", out=tmp_path / "hunyuan_moe.pte")
    prompt = prompt_ids(12)
    assert etblocks.Runner(result.path).generate(prompt[0].tolist(), max_new_tokens=16) == hf_greedy(original, prompt, 16)


def test_model_whose_embeddings_ignore_position_ids_is_refused():
    """BART's causal-LM decoder embeds positions counted from the call (its learned positions ignore `position_ids`):
    every block passes the probe, but its programs would embed each decode step at position 0, so swap refuses the
    model before changing it."""
    from hf_matrix import tiny_matrix_model

    model = tiny_matrix_model("bart")
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"BartForCausalLM does not place a token by the position_ids"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    assert_untouched(model, snapshot)


def test_mixer_called_several_times_per_forward_is_refused():
    """HRM runs its layers in loops within one forward pass: a cache of one row per position cannot hold every pass
    (its exported program gave other tokens than `generate`), so swap refuses it, naming the module."""
    from hf_matrix import tiny_matrix_model

    model = tiny_matrix_model("hrm_text")
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=r"self_attn \(HrmTextAttention\) runs [0-9]+ times in one forward pass"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=32)
    assert_untouched(model, snapshot)
