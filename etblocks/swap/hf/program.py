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


class HFStaticProgram(nn.Module):
    """The static contract with caller-owned caches (see `etblocks.export.contract`):
    `forward(tokens [1, T], positions [1, T], *masks [T, L + T], *caches [1, L, Hkv, D])
    -> (logits [1, T, V], k_new_0, v_new_0, ...)`.

    `mask_of_layer[i]` is the index (among the masks) of the mask layer i reads. Each layer's IO cache gets its
    inputs bound before the transformers forward and hands its new rows back after it.
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module], mask_of_layer: list[int]) -> None:
        super().__init__()
        self.model = model
        self._blocks = blocks  # a plain list: they are registered once, under `model`
        self.mask_of_layer = mask_of_layer
        self.n_masks = max(mask_of_layer) + 1

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *masks_and_caches: torch.Tensor):
        masks, caches = masks_and_caches[: self.n_masks], masks_and_caches[self.n_masks :]
        for i, block in enumerate(self._blocks):
            block.kv_cache.bind(caches[2 * i], caches[2 * i + 1], masks[self.mask_of_layer[i]])
        logits = self.model(input_ids=tokens, position_ids=positions, use_cache=False).logits
        return (logits, *(rows for block in self._blocks for rows in block.kv_cache.take()))
