"""torchtune decoders from torchtune's component builders: swapped eager logits against the untouched torchtune
model, and greedy tokens of exported programs against torchtune's own `generate`; refusals leave the model as it
was."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import assert_untouched, prompt_ids, snapshot_of, tiny_model
from static_refs import eager_feeder, greedy
from torchtune_models import FAMILIES, WINDOW, original_and_copy, tune_greedy, tune_logits

import etblocks
from etblocks.errors import ConfigError, UnsupportedModelError
from etblocks.export import check_readiness
from etblocks.export.programs import dynamic_program
from etblocks.backends.qnn.readiness import format_readiness
from etblocks.state import IOKVCache, RingKVCache, StaticKVCache
from etblocks.swap.registry import MIXERS
from etblocks.swap.torchtune.attention import TuneAttention, TuneSingleHeadAttention
from torchtune.modules import MultiHeadAttention, TransformerDecoder

LOGIT_ATOL = 1e-4  # fp32
NEW_TOKENS = 32
INTERLEAVED = {"llama3_2": True, "qwen2_5": False, "mistral": True, "gemma": True, "gemma2": True, "phi3": False}


def _swapped(family: str, backend: str = "xnnpack", **options):
    overrides = options.pop("model", {})
    original, model = original_and_copy(family, **overrides)
    return original, etblocks.swap(model, backend=backend, **{"max_seq_len": 64, **options})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_swapped_logits_match_torchtune(family):
    original, swapped = _swapped(family)
    blocks = [layer.attn for layer in swapped.layers]
    assert all(isinstance(block, TuneAttention) for block in blocks)
    assert all(block.rope.interleaved == INTERLEAVED[family] for block in blocks)
    tokens = prompt_ids(20)
    error = (tune_logits(swapped, tokens) - tune_logits(original, tokens)).abs().max().item()
    assert error <= LOGIT_ATOL, f"{family}: max abs logit error {error:.3g}"


def test_exported_graph_has_no_control_flow():
    """ExecuTorch's own torchtune replacement exports its cache through `torch.cond`, inside which XNNPACK lowers
    nothing; the swapped blocks export as one straight graph."""
    _, swapped = _swapped("llama3_2")
    program = dynamic_program(swapped)
    with torch.no_grad():
        exported = torch.export.export(program.module, program.example_inputs(), dynamic_shapes=program.dynamic_shapes(), strict=False)
    targets = {node.target for node in exported.graph.nodes if node.op == "call_function"}
    assert not [t for t in targets if isinstance(t, torch._ops.HigherOrderOperator)], sorted(map(str, targets))
    assert torch.ops.llama.custom_sdpa.default in targets


def test_gemma2_sliding_window_logits_match_torchtune():
    """A window shorter than the prompt binds on gemma2's even layers: a ring cache there, a full one on the odd."""
    original, swapped = _swapped("gemma2", model={"sliding_window_size": WINDOW})
    assert [type(layer.attn.kv_cache) for layer in swapped.layers] == [RingKVCache, StaticKVCache]
    tokens = prompt_ids(3 * WINDOW)
    error = (tune_logits(swapped, tokens) - tune_logits(original, tokens)).abs().max().item()
    assert error <= LOGIT_ATOL, f"max abs logit error {error:.3g}"


STATIC_CASES = {"llama3_2": {}, "qwen2_5": {}, "gemma2": {"sliding_window_size": WINDOW}}


@pytest.mark.parametrize("family", sorted(STATIC_CASES))
def test_qnn_recipe_eager_matches_torchtune(family):
    """The NPU program (single-head attention on 1x1 convolutions, caches as inputs and outputs), run eagerly
    the way the Runner drives it (chunked prefill, then decode): last-token logits for prompts shorter and
    longer than a chunk, and greedy tokens, against torchtune (uncached where gemma2's window binds, see
    `test_gemma2_binding_window_greedy_matches_torchtune`)."""
    original, swapped = _swapped(family, "qnn", chunk=8, model=STATIC_CASES[family])
    assert all(isinstance(layer.attn, TuneSingleHeadAttention) for layer in swapped.layers)
    assert all(isinstance(layer.attn.kv_cache, IOKVCache) for layer in swapped.layers)
    feeder = eager_feeder(swapped)
    for length in (5, 8, 13, 20):
        prompt = prompt_ids(length)
        with torch.no_grad():
            feeder.reset()
            actual = feeder.forward(prompt[0].tolist())
        error = (actual - tune_logits(original, prompt)[0, -1]).abs().max().item()
        assert error <= LOGIT_ATOL, f"prompt of {length}: max abs logit error {error:.3g}"
    prompt = prompt_ids(12)
    with torch.no_grad():
        feeder.reset()
        tokens = greedy(feeder.forward, prompt[0].tolist(), NEW_TOKENS)
    assert tokens == tune_greedy(original, prompt, NEW_TOKENS, cached=not STATIC_CASES[family])


def _exported_tokens(swapped, tmp_path, name: str, prompt: torch.Tensor) -> list[int]:
    result = etblocks.export(swapped, backend="xnnpack", out=tmp_path / f"{name}.pte", quantize_activations=None)
    assert result.delegation.ops_per_delegate.get("XnnpackBackend", 0) > 0
    # torchtune's RMSNorm (F.rms_norm) is delegated whole once rewritten (etblocks.backends.passes)
    assert not {"aten.rms_norm.default", "aten.add.Scalar", "aten.mean.dim"} & set(result.delegation.cpu_ops)
    return etblocks.Runner(result.path).generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_xnnpack_greedy_matches_torchtune_generate(family, tmp_path):
    original, swapped = _swapped(family)
    prompt = prompt_ids(12)
    expected = tune_greedy(original, prompt, NEW_TOKENS)
    assert len(set(expected)) > 4, "degenerate reference: the test would not tell models apart"
    assert _exported_tokens(swapped, tmp_path, family, prompt) == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3_2", "qwen2_5"])
def test_qnn_recipe_greedy_matches_torchtune_generate(family, tmp_path):
    """The NPU program (single-head attention on 1x1 convolutions, caches as inputs and outputs, prefill and
    decode) in fp32, run here through XNNPACK: interleaved rope (llama3_2) and rotate-half with biases (qwen2_5)."""
    original, swapped = _swapped(family, "qnn")
    assert all(isinstance(layer.attn, TuneSingleHeadAttention) for layer in swapped.layers)
    prompt = prompt_ids(12)
    assert _exported_tokens(swapped, tmp_path, family, prompt) == tune_greedy(original, prompt, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "qnn"])
def test_gemma2_binding_window_greedy_matches_torchtune(backend, tmp_path):
    """torchtune 0.6.1's KV-cached gemma2 places the window at the start of its cache instead of before each
    query, so with a window that binds its cached `generate` is not the model; its uncached `generate` is."""
    original, swapped = _swapped("gemma2", backend, model={"sliding_window_size": WINDOW})
    prompt = prompt_ids(12)
    expected = tune_greedy(original, prompt, NEW_TOKENS, cached=False)
    assert len(set(expected)) > 4
    assert _exported_tokens(swapped, tmp_path, f"gemma2-{backend}", prompt) == expected


@pytest.mark.slow
def test_openvino_program_greedy_matches_torchtune_generate(tmp_path):
    """The openvino recipe's static program (MHA, caches as inputs) lowered to OpenVINO and run here."""
    original, swapped = _swapped("llama3_2", "openvino", chunk=8)
    result = etblocks.export(swapped, backend="openvino", out=tmp_path / "openvino.pte")
    assert result.delegation.ops_per_delegate.get("OpenvinoBackend", 0) > 0
    prompt = prompt_ids(12)
    tokens = etblocks.Runner(result.path).generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS)
    assert tokens == tune_greedy(original, prompt, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["coreml", "vulkan"])
def test_npu_recipes_delegate_all_compute(backend, tmp_path):
    """Core ML and Vulkan programs cannot run here; one partition per method with nothing on CPU is the evidence.
    gemma2: torchtune's attention with interleaved rope, softcaps and a binding window mask (the SiLU MLP of the
    other families is in tests/export/test_delegation_golden.py's llama)."""
    _, swapped = _swapped("gemma2", backend, chunk=8, model={"sliding_window_size": WINDOW})
    result = etblocks.export(swapped, backend=backend, out=tmp_path / f"{backend}-gemma2.pte")
    for method, summary in result.delegations.items():
        assert len(summary.partitions) == 1 and summary.n_cpu_ops == 0, f"{method}: {summary}"


@pytest.mark.slow
def test_quantized_qnn_program_is_fully_covered():
    """What QNN would lower (16a8w, the recipe's default), checked op by op without the SDK."""
    few_heads = dict(num_layers=1, num_heads=2, num_kv_heads=1)  # a cheaper check, as hf_models.FEW_HEADS says
    _, swapped = _swapped("llama3_2", "qnn", chunk=8, model=few_heads)
    report = check_readiness(swapped, "qnn")
    assert set(report) == {"prefill", "decode"}
    for method, readiness in report.items():
        assert readiness.ready, f"{method}:\n{format_readiness(report)}"
        assert readiness.ops["aten.convolution.default"] > 0


def test_one_registry_for_every_kind():
    """torchtune converters live in the registry HF converters use: a converter registered for a subclass of
    torchtune's MultiHeadAttention wins over the built-in one, as it would for a transformers class."""
    original, model = original_and_copy("llama3_2")
    etblocks.swap(copy.deepcopy(model), max_seq_len=64)  # registers the torchtune converters
    etblocks.swap(tiny_model("llama"), max_seq_len=64)  # and the transformers families, on first use
    builtin = MIXERS.lookup(original.layers[0].attn)
    assert builtin is not None
    assert "LlamaAttention" in MIXERS.supported() and "MultiHeadAttention" in MIXERS.supported()

    class Recorded(MultiHeadAttention):
        pass

    seen = []

    @etblocks.register(Recorded)
    def convert(module, ctx):
        seen.append(module)
        return builtin(module, ctx)

    for layer in model.layers:
        layer.attn.__class__ = Recorded
    etblocks.swap(model, max_seq_len=64)
    assert len(seen) == len(model.layers)
    tokens = prompt_ids(10)
    assert (tune_logits(model, tokens) - tune_logits(original, tokens)).abs().max() <= LOGIT_ATOL


def test_swapped_model_refuses_what_its_blocks_cannot_do():
    _, swapped = _swapped("llama3_2")
    tokens = prompt_ids(6)
    with pytest.raises(ValueError, match="input_pos"):
        swapped(tokens)
    with pytest.raises(ValueError, match="mask must be None"):
        swapped(tokens, mask=torch.ones(1, 6, 6, dtype=torch.bool), input_pos=torch.arange(6)[None])
    with pytest.raises(ConfigError, match="owns its KV cache"):
        swapped.setup_caches(batch_size=1, dtype=torch.float32)


def _refused(model, error, match: str, **options) -> None:
    snapshot = snapshot_of(model)
    with pytest.raises(error, match=match):
        etblocks.swap(model, **{"max_seq_len": 64, **options})
    assert_untouched(model, snapshot)


def test_torchtune_caches_set_up_are_refused():
    _, model = original_and_copy("llama3_2")
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=64)
    _refused(model, UnsupportedModelError, r"layers\.0\.attn .*setup_caches was called")


def test_unknown_rope_is_refused():
    _, model = original_and_copy("llama3_2")

    class OtherRope(torch.nn.Module):
        def forward(self, x, input_pos=None):
            return x

    rope = OtherRope()
    for layer in model.layers:
        layer.attn.pos_embeddings = rope
    _refused(model, UnsupportedModelError, r"OtherRope; accepted rotary modules: \[.*Llama3ScaledRoPE.*RotaryPositionalEmbeddings")


def test_overridden_decoder_forward_is_refused():
    _, model = original_and_copy("qwen2_5")

    class Scaled(TransformerDecoder):
        def forward(self, tokens, **kwargs):
            return 2 * super().forward(tokens, **kwargs)

    model.__class__ = Scaled
    _refused(model, UnsupportedModelError, r"Scaled overrides TransformerDecoder\.forward")


def test_context_beyond_the_models_positions_is_refused():
    _, model = original_and_copy("mistral")
    _refused(model, ConfigError, r"max_seq_len=256 .*model\.max_seq_len=128.*2\.\.128", max_seq_len=256)


def test_swap_error_names_both_kinds():
    with pytest.raises(UnsupportedModelError, match="transformers causal LM .* or a torchtune TransformerDecoder; got Linear"):
        etblocks.swap(torch.nn.Linear(2, 2))
