"""The static contract (prefill + decode, caller-owned caches) against untouched transformers.

Tiny llama, qwen3 and gemma3_text (a sliding layer with window 6 and a full layer), and the hybrids qwen3_5_text,
qwen3_5_moe_text (gated DeltaNet: a convolution window and a recurrent state), lfm2 (short convolutions) and
granitemoehybrid (Mamba2: a convolution window and an SSM state; MoE experts beside a shared MLP): the
exported static program, driven by `etblocks.Runner`, must generate HF `generate`'s greedy tokens for prompts
whose length is a multiple of the chunk (16), is not (13: padded prefill tail), is shorter than one chunk (5),
and leaves a one-token tail that goes through `decode` (17). All but the 5-token prompt are longer than the
window and the convolutions.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import SCORE_ATOL, hf_greedy, hf_log_probs, original_and_copy, prompt_ids
from speculation_refs import check_greedy_with_speculation
from static_refs import CHUNK, CONTEXT, eager_feeder, greedy, swap_static

import etblocks
from etblocks.export.contract import StaticContract
from etblocks.export.programs import static_program
from etblocks.export.feeders import group_mask
from etblocks.state import IOKVCache
from etblocks.swap.hf.adapter import HFSingleHeadAttention

NEW_TOKENS = 32
PROMPT_LENGTHS = (16, 13, 5, 17)
STATIC_FAMILIES = ("llama", "qwen3", "gemma3_text", "qwen3_5_text", "qwen3_5_moe_text", "lfm2", "granitemoehybrid")
# Exported: llama on each backend, and each kind of layer once, on a backend that lowers it its own way: windows on
# portable kernels, gated DeltaNet in XNNPACK's fused kernel (Qwen3.5) and in chunks with dense experts on OpenVINO
# (Qwen3.5-MoE), short convolutions on portable kernels, Mamba2's scan with MoE on OpenVINO. Qwen3 adds only the
# per-head q/k norms that gemma3_text's programs hold too. Every family on every backend:
# `benchmarks/backend_matrix.py` (docs/backend_matrix.md).
EXPORTED = [("llama", "portable"), ("llama", "xnnpack"), ("llama", "openvino"), ("gemma3_text", "portable"),
            ("qwen3_5_text", "xnnpack"), ("qwen3_5_moe_text", "openvino"), ("lfm2", "portable"),
            ("granitemoehybrid", "openvino")]
LOGIT_ATOL = 1e-4


@pytest.mark.parametrize("backend", ["openvino", "qnn"])
@pytest.mark.parametrize("name", STATIC_FAMILIES)
def test_static_eager_matches_hf(name, backend):
    """MHA (openvino recipe) and SHA with 1x1-conv projections (qnn recipe), unquantized, against HF."""
    original, swapped = swap_static(name, backend)
    if backend == "qnn":
        assert all(isinstance(m, HFSingleHeadAttention) for n, m in swapped.named_modules() if n.endswith("self_attn"))
    feeder = eager_feeder(swapped)
    for length in PROMPT_LENGTHS:
        prompt = prompt_ids(length)
        with torch.no_grad():
            expected = original(prompt).logits[0, -1]
            feeder.reset()
            actual = feeder.forward(prompt[0].tolist())
        assert (actual - expected).abs().max().item() <= LOGIT_ATOL, f"{name} {backend} prompt {length}"
    prompt = prompt_ids(13)
    with torch.no_grad():
        feeder.reset()
        assert greedy(feeder.forward, prompt[0].tolist(), NEW_TOKENS) == hf_greedy(original, prompt, NEW_TOKENS)


@pytest.fixture(scope="module", params=EXPORTED, ids=str)
def exported(request, tmp_path_factory):
    name, backend = request.param
    original, swapped = swap_static(name, backend)
    result = etblocks.export(swapped, backend=backend, out=tmp_path_factory.mktemp("static") / f"{name}_{backend}.pte")
    return name, backend, original, result


@pytest.mark.slow
def test_runner_greedy_matches_hf_generate(exported):
    name, backend, original, result = exported
    assert result.methods[:2] == ["prefill", "decode"]
    if backend != "portable":  # fewer than a fifth of the program's operators on CPU
        on_cpu = result.delegation.n_cpu_ops
        assert on_cpu < 0.2 * (on_cpu + sum(result.delegation.ops_per_delegate.values()))
    runner = etblocks.Runner(result.path)
    assert runner.contract.chunk == CHUNK and runner.max_context_len == CONTEXT
    for length in PROMPT_LENGTHS:
        prompt = prompt_ids(length)
        expected = hf_greedy(original, prompt, NEW_TOKENS)
        assert len(set(expected)) > 4, "degenerate reference: the test would not tell models apart"
        runner.reset()
        assert runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == expected, f"{name} {backend} prompt {length}"


@pytest.mark.slow
def test_runner_speculation_matches_hf_generate(exported):
    """Proposals checked by one padded `prefill` (prompt lookup; the right tokens with one wrong at each draft
    position; only wrong ones) leave greedy generation HF's: K/V rows, ring slots and convolution windows take only
    the kept tokens' rows, and recurrent states run the kept tokens again after a rejection."""
    name, backend, original, result = exported
    check_greedy_with_speculation(etblocks.Runner(result.path), original, f"{name} {backend}")


@pytest.mark.slow
def test_runner_scores_as_transformers(exported):
    """`Runner.score` in padded `prefill` chunks (the last one partial): transformers' log-probabilities."""
    name, backend, original, result = exported
    runner = etblocks.Runner(result.path)
    ids = prompt_ids(2 * CHUNK + 5, seed=3)[0].tolist()
    torch.testing.assert_close(runner.score(ids), hf_log_probs(original, ids), rtol=0, atol=SCORE_ATOL, msg=f"{name} {backend}")


@pytest.mark.slow
def test_runner_continues_a_conversation(exported):
    """A second generate call with fresh=False continues: it equals one HF generate over the concatenation."""
    _, _, original, result = exported
    runner = etblocks.Runner(result.path)
    first = prompt_ids(11)[0].tolist()
    reply = runner.generate(first, max_new_tokens=4)
    second = prompt_ids(6, seed=2)[0].tolist()
    continued = runner.generate(second, max_new_tokens=8, fresh=False)
    assert continued == hf_greedy(original, torch.tensor([first + reply + second]), 8)


@pytest.mark.slow
def test_saved_state_resumes_to_the_same_tokens(exported):
    """Save every state mid-generation, run another sequence, restore: the continuation is HF's."""
    _, _, original, result = exported
    runner = etblocks.Runner(result.path)
    prompt = prompt_ids(13)[0].tolist()
    expected = hf_greedy(original, torch.tensor([prompt]), 12)
    first = runner.generate(prompt, max_new_tokens=6)
    saved, fed = runner.caches, runner.pos - 1  # the last generated token is not fed yet
    runner.reset()
    runner.generate(prompt_ids(9, seed=3)[0].tolist(), max_new_tokens=4)
    runner.restore(saved, fed)
    assert first + runner.generate(first[-1:], max_new_tokens=6, fresh=False) == expected


def test_contract_describes_layers_and_windows():
    _, swapped = swap_static("gemma3_text", "openvino")
    contract = static_program(swapped).contract
    assert StaticContract.from_json(contract.to_json()) == contract
    assert [(g.name, g.length, g.window) for g in contract.masks] == [("window6", 6, 6), ("full", CONTEXT, None)]
    assert [(s.state, s.mask, s.update) for s in contract.states] == [
        (0, "window6", "ring"), (0, "window6", "ring"), (1, "full", "rows"), (1, "full", "rows")
    ]
    assert [s.owner for s in contract.states[::2]] == [f"model.layers.{i}.self_attn.kv_cache" for i in (0, 1)]
    assert contract.state_shapes() == [(1, 6, 2, 16)] * 2 + [(1, CONTEXT, 2, 16)] * 2
    assert contract.paddable
    assert contract.inputs() == ["tokens", "positions", "mask.window6", "mask.full", "k_cache.0", "v_cache.0", "k_cache.1", "v_cache.1"]
    assert contract.outputs() == ["logits", "k_new.0", "v_new.0", "k_new.1", "v_new.1"]
    assert all(isinstance(m, IOKVCache) for m in (layer.self_attn.kv_cache for layer in swapped.model.layers))


def test_window_mask_reads_only_the_last_positions():
    """Independent of the feeder's ring arithmetic: after 9 positions a window-6 cache row r holds the latest
    position p < 9 with p % 4 == r, and a query at 9 may read positions 6, 7, 8 and itself."""
    contract = static_program(swap_static("gemma3_text", "openvino")[1]).contract
    window = contract.mask("window6")
    mask = group_mask(window, pos=9, n_tokens=2, dtype=torch.float32, mask_value=float("-inf"))
    held = {r: max(p for p in range(9) if p % 6 == r) for r in range(6)}  # rows hold positions 6, 7, 8, 3, 4, 5
    for q in (0, 1):
        readable = {held[r] for r in range(6) if mask[q, r] == 0} | {9 + t for t in (0, 1) if mask[q, 6 + t] == 0}
        assert readable == {p for p in range(0, 9 + q + 1) if 9 + q - p < 6}


@pytest.mark.slow
def test_two_methods_share_one_copy_of_the_weights(tmp_path):
    """The static program (prefill + decode) is at most 1.05x the size of the one-method dynamic program."""
    wide = dict(hidden_size=256, intermediate_size=512, head_dim=32, vocab_size=512, num_hidden_layers=1)
    _, dynamic = original_and_copy("llama", **wide)
    _, static = original_and_copy("llama", **wide)
    etblocks.swap(dynamic, backend="xnnpack", max_seq_len=CONTEXT)
    etblocks.swap(static, backend="xnnpack", max_seq_len=CONTEXT, shapes="static", chunk=CHUNK)
    one = etblocks.export(dynamic, backend="xnnpack", out=tmp_path / "one.pte")
    two = etblocks.export(static, backend="xnnpack", out=tmp_path / "two.pte")
    weights_mb = sum(p.numel() * p.element_size() for p in static.parameters()) / 1e6
    assert two.size_mb <= 1.05 * one.size_mb, f"two methods {two.size_mb:.2f} MB vs one {one.size_mb:.2f} MB"
    assert two.size_mb <= 1.1 * weights_mb


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [dict(sdpa="dynamic", cache_update="index_copy"), dict()],
    ids=["portable-kernel-attention", "custom-op-attention"],
)
def test_hybrid_partition_matches_hf_generate(options, tmp_path):
    """Static methods with the projections and MLP in XNNPACK and the in-place cache + attention on CPU."""
    original, swapped = swap_static("llama", "xnnpack", partition="hybrid", **options)
    result = etblocks.export(swapped, backend="xnnpack", out=tmp_path / "hybrid.pte")
    runner = etblocks.Runner(result.path)
    assert runner.contract.cache == "inplace"
    projections = sum(isinstance(m, torch.nn.Linear) for m in original.modules())  # q, k, v, o, MLP, lm_head
    for summary in result.delegations.values():
        assert summary.delegated_ops["aten.linear"] >= projections, summary.delegated_ops
        assert not any(op in summary.cpu_ops for op in ("aten.mm", "aten.addmm", "aten.linear"))
    for length in PROMPT_LENGTHS:
        prompt = prompt_ids(length)
        runner.reset()
        assert runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == hf_greedy(original, prompt, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name, backend", [("deepseek_v2", "portable"), ("deepseek_v3", "xnnpack")])
def test_mla_static_program_matches_hf_generate(name, backend, tmp_path):
    """MLA under the static contract: per layer the caller keeps the latent `[1, L, 1, kv_lora_rank]` and the
    roped shared key `[1, L, 1, qk_rope_head_dim]`, nothing per head."""
    original, swapped = swap_static(name, backend)
    result = etblocks.export(swapped, backend=backend, out=tmp_path / f"{name}.pte")
    runner = etblocks.Runner(result.path)
    config = original.config
    assert runner.contract.state_shapes()[:2] == [(1, CONTEXT, 1, config.kv_lora_rank), (1, CONTEXT, 1, config.qk_rope_head_dim)]
    for length in PROMPT_LENGTHS:
        prompt = prompt_ids(length)
        runner.reset()
        assert runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == hf_greedy(original, prompt, NEW_TOKENS)
