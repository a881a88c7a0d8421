"""A swapped transformers causal LM seen through the dynamic program contract."""

from __future__ import annotations

import torch
from torch import nn

from etblocks.swap.hf.model import token_ids


class HFDecoderProgram(nn.Module):
    """`forward(tokens [1, T], input_pos [1]) -> logits [1, V]` of the last token, caches updated in place."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        positions = input_pos + torch.arange(tokens.shape[1], dtype=input_pos.dtype)
        out = self.model(input_ids=tokens, position_ids=positions.unsqueeze(0), use_cache=False, logits_to_keep=1)
        return out.logits[:, -1, :]


def hf_token_metadata(model: nn.Module) -> dict:
    """Vocabulary size and special tokens from the model's config and generation config."""
    config = model.config
    generation = getattr(model, "generation_config", None)
    eos = token_ids(getattr(generation, "eos_token_id", None)) or token_ids(getattr(config, "eos_token_id", None))
    bos = getattr(generation, "bos_token_id", None)
    if bos is None:
        bos = getattr(config, "bos_token_id", None)
    return {
        "vocab_size": config.vocab_size,
        "bos_id": bos,
        "eos_ids": eos,
        "n_layers": config.num_hidden_layers,
    }
