"""A tiny built-in Llama with random weights, for demonstrations and tests (`etblocks export --model demo`)."""

from __future__ import annotations

DEMO_DESCRIPTION = (
    "demo: a tiny Llama (2 layers, hidden 64, 4 heads / 2 KV heads, vocab 256) with RANDOM weights, "
    "for demonstration only; its output is not meaningful text"
)


def demo_config():
    """The demo model's `LlamaConfig`. `initializer_range=0.3` makes greedy outputs vary from step to step."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def demo_model(seed: int = 0):
    """A `LlamaForCausalLM` built from `demo_config()` with random weights drawn from `torch.manual_seed(seed)`.

    The same seed gives the same weights, so a test can rebuild the model an export came from.
    """
    import torch
    from transformers import LlamaForCausalLM

    config = demo_config()
    devices = []  # fork the RNG so building the demo does not disturb the caller's random stream
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()
