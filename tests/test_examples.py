"""The examples run, and what they produce matches references written here in plain torch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"etblocks_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def custom_model():
    return _load_example("custom_model")


# ---- an independent reference: full recompute every step, weights read from the model, no etblocks code ----


def _rms_norm(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _rope(x, positions, base):
    """Rotate-half rotary embedding of `x [B, H, T, D]` at integer `positions [T]`."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1).float()
    sin = torch.cat((angles.sin(), angles.sin()), -1).float()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _reference_logits(model, tokens: list[int], n_heads, n_kv_heads, rope_base, gate: bool) -> torch.Tensor:
    """Logits `[V]` at the last of `tokens`, recomputed from scratch with F.scaled_dot_product_attention."""
    ids = torch.tensor([tokens])
    seq_len = ids.shape[1]
    positions = torch.arange(seq_len)
    x = F.embedding(ids, model.embed.weight)
    for layer in model.layers:
        attn = layer.attn
        h = _rms_norm(x, layer.attn_norm)
        q = F.linear(h, attn.q_proj.weight).view(1, seq_len, n_heads, -1).transpose(1, 2)
        k = F.linear(h, attn.k_proj.weight).view(1, seq_len, n_kv_heads, -1).transpose(1, 2)
        v = F.linear(h, attn.v_proj.weight).view(1, seq_len, n_kv_heads, -1).transpose(1, 2)
        head_dim = q.shape[-1]
        q, k = _rope(q, positions, rope_base), _rope(k, positions, rope_base)
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
        v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim**-0.5)  # [1, H, T, Dh]
        if gate:
            y = y * torch.sigmoid(attn.head_gate).view(1, -1, 1, 1)
        x = x + F.linear(y.transpose(1, 2).reshape(1, seq_len, -1), attn.o_proj.weight)
        h = _rms_norm(x, layer.mlp_norm)
        mlp = layer.mlp
        x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight), mlp.down_proj.weight)
    return F.linear(_rms_norm(x, model.norm), model.lm_head.weight)[0, -1]


def _reference_greedy(model, prompt_ids, max_new_tokens, **kw) -> list[int]:
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(torch.argmax(_reference_logits(model, tokens, **kw))))
    return tokens[len(prompt_ids) :]


def _arch(example) -> dict:
    return {"n_heads": example.N_HEADS, "n_kv_heads": example.N_KV_HEADS, "rope_base": example.ROPE_BASE}


# ---- tests ----


@pytest.mark.slow
def test_custom_model_exported_greedy_matches_plain_torch_reference(custom_model, tmp_path):
    max_new_tokens = 16
    out = custom_model.main(tmp_path, max_new_tokens=max_new_tokens)

    assert Path(out["path"]).is_file()
    assert out["result"].metadata["get_vocab_size"] == custom_model.VOCAB_SIZE
    assert isinstance(out["model"].layers[0].attn, custom_model.GatedAttention)

    # The reference reads the exported model's weights and nothing else of it (no cache, no etblocks SDPA).
    expected = _reference_greedy(out["model"], out["prompt_ids"], max_new_tokens, gate=True, **_arch(custom_model))
    assert len(set(expected)) > 3, f"degenerate random model, the comparison would be weak: {expected}"
    assert out["tokens"] == expected
    # The subclass's hook survived export: without the gate the same weights generate something else.
    ungated = _reference_greedy(out["model"], out["prompt_ids"], max_new_tokens, gate=False, **_arch(custom_model))
    assert out["tokens"] != ungated


def test_custom_attention_hook_changes_outputs(custom_model):
    from etblocks.attention import Attention

    gated = custom_model.build_model()
    plain = custom_model.build_model(attention_cls=Attention)
    # Same weights; the only difference is the gate, which plain Attention does not have.
    missing, unexpected = plain.load_state_dict(gated.state_dict(), strict=False)
    assert missing == []
    assert sorted(unexpected) == [f"layers.{i}.attn.head_gate" for i in range(custom_model.N_LAYERS)]

    # Distinct heads get distinct scales, so the gate is not a single factor the norms would undo.
    gates = torch.sigmoid(gated.layers[0].attn.head_gate.detach())
    assert gates.unique().numel() == custom_model.N_HEADS

    tokens = torch.tensor([custom_model.PROMPT_IDS])
    input_pos = torch.tensor([0])
    with torch.no_grad():
        gated_logits = gated(tokens, input_pos)[0]
        plain_logits = plain(tokens, input_pos)[0]
        arch = _arch(custom_model)
        ref_gated = _reference_logits(gated, custom_model.PROMPT_IDS, gate=True, **arch)
        ref_plain = _reference_logits(gated, custom_model.PROMPT_IDS, gate=False, **arch)

    # Each eager model matches the plain-torch reference with or without the gate...
    torch.testing.assert_close(gated_logits, ref_gated, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain_logits, ref_plain, rtol=1e-4, atol=1e-4)
    # ...and the gate moves the logits by far more than that tolerance.
    assert (gated_logits - plain_logits).abs().max() > 0.1


@pytest.mark.slow
def test_lora_example_matches_peft_generate(tmp_path):
    """Each adapter's tokens from the example's one program equal PeftModel's `generate` with that adapter."""
    from peft import PeftModel

    example = _load_example("lora_adapters")
    tokens = example.main(tmp_path)
    reference = PeftModel.from_pretrained(example.base_model(), tmp_path / "chat", adapter_name="chat")
    reference.load_adapter(tmp_path / "code", adapter_name="code")
    prompt = torch.tensor([[1, 17, 42, 99, 7]])
    for name in ("chat", "code", None):
        with torch.no_grad():
            if name is None:
                with reference.disable_adapter():
                    expected = reference.generate(prompt, do_sample=False, max_new_tokens=12)
            else:
                reference.set_adapter(name)
                expected = reference.generate(prompt, do_sample=False, max_new_tokens=12)
        assert tokens[name] == expected[0, prompt.shape[1]:].tolist(), name
    assert len({tuple(t) for t in tokens.values()}) == 3


@pytest.mark.slow
def test_torchtune_example_matches_torchtune_generate(tmp_path):
    """The example's tokens with the adapter and without equal torchtune's `generate` on its own LoRA model,
    with its adapters enabled and disabled."""
    from torchtune_models import tune_greedy

    example = _load_example("torchtune_model")
    tokens = example.main(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.default.ptd", "model.pte"]
    prompt = torch.tensor([example.PROMPT])
    assert tokens["default"] == tune_greedy(example.lora_model(), prompt, 12)
    assert tokens[None] == tune_greedy(example.lora_model(), prompt, 12, base_only=True)
    assert tokens["default"] != tokens[None]
