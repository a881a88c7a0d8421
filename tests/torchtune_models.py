"""Tiny torchtune decoders from torchtune's own component builders, with random weights, and torchtune's own
greedy generation as the reference."""

from __future__ import annotations

import contextlib
import copy

import torch
from hf_models import VOCAB

from etblocks.torchtune_compat import import_torchtune

import_torchtune()
from torchtune.generation import generate  # noqa: E402  (after the torchao shim)
from torchtune.models.gemma._component_builders import gemma  # noqa: E402
from torchtune.models.gemma2._component_builders import gemma2  # noqa: E402
from torchtune.models.llama3_2._component_builders import lora_llama3_2, llama3_2  # noqa: E402
from torchtune.models.mistral._component_builders import mistral  # noqa: E402
from torchtune.models.phi3._component_builders import phi3  # noqa: E402
from torchtune.models.qwen2._component_builders import qwen2  # noqa: E402
from torchtune.modules.peft import disable_adapter  # noqa: E402

MAX_SEQ_LEN = 128
WINDOW = 8  # gemma2's sliding window in the tests where it binds
DIMS = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=MAX_SEQ_LEN)
HEAD = dict(head_dim=16, intermediate_dim=128)

# family -> builder call with tiny dimensions. Rope: interleaved (llama3_2 scaled, mistral, gemma, gemma2) or
# rotate-half (qwen2_5, phi3); qwen2_5 has q/k/v biases; gemma2 has softcaps, query_pre_attn_scalar and a
# window on every other layer (never binding unless a test passes `sliding_window_size`).
FAMILIES = {
    "llama3_2": lambda **o: llama3_2(**{**DIMS, "intermediate_dim": 128, **o}),
    "qwen2_5": lambda **o: qwen2(**DIMS, intermediate_dim=128, tie_word_embeddings=True, **o),
    "mistral": lambda **o: mistral(**DIMS, intermediate_dim=128, **o),
    "gemma": lambda **o: gemma(**DIMS, **HEAD, **o),
    "gemma2": lambda **o: gemma2(**DIMS, **HEAD, query_pre_attn_scalar=24, **{"sliding_window_size": 4096, **o}),
    "phi3": lambda **o: phi3(**DIMS, intermediate_dim=128, **o),
}
LORA_ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]


def tiny_tune_model(family: str, seed: int = 6, **overrides) -> torch.nn.Module:
    """The family's decoder with random weights (`randomized`) under `seed`, in eval mode; seed 6 gives every
    family at least 9 distinct tokens in 32 greedy ones."""
    torch.manual_seed(seed)
    return randomized(FAMILIES[family](**overrides))


def tiny_lora_model(seed: int = 6, **overrides) -> torch.nn.Module:
    """lora_llama3_2 (rank 4, alpha 8) on every attention projection and the MLP, with random base and LoRA
    weights (torchtune starts lora_b at zero, which would make the adapter a no-op)."""
    torch.manual_seed(seed)
    return randomized(lora_llama3_2(LORA_ATTN, apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8, **DIMS, intermediate_dim=128, **overrides))


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Parameters drawn from N(0, 0.3), embeddings from N(0, 0.05), LoRA weights from N(0, 0.1), in eval mode:
    with torchtune's own init, or large tied embeddings, a tiny model's greedy output repeats one token and a
    test could not tell a wrong model from a right one."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.05 if name.startswith("tok_embeddings") else 0.1 if "lora" in name else 0.3)
    return model.eval()


def original_and_copy(family: str, **overrides):
    original = tiny_tune_model(family, **overrides)
    return original, copy.deepcopy(original)


def tune_greedy(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, cached: bool = True, base_only: bool = False) -> list[int]:
    """torchtune's `generate` with top_k=1 (greedy) on a copy of `model`: KV-cached unless `cached=False` (then
    every step runs the whole sequence); `base_only` disables its LoRA adapters."""
    model = copy.deepcopy(model)
    if cached:
        model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=prompt.shape[1] + max_new_tokens)
    with torch.no_grad(), (disable_adapter(model) if base_only else contextlib.nullcontext()):
        tokens, _ = generate(model, prompt, max_generated_tokens=max_new_tokens, top_k=1)
    return tokens[0, prompt.shape[1] :].tolist()


def tune_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits `[1, T, V]` of every position, called the torchtune way (the swapped model needs `input_pos`)."""
    with torch.no_grad():
        return model(tokens, input_pos=torch.arange(tokens.shape[1]).unsqueeze(0))
