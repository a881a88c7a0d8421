"""A swapped upstream model seen through the program contracts; its kind says how to call it."""

from __future__ import annotations

import torch
from torch import nn

from etblocks.swap.kinds import ModelKind


class DecoderProgram(nn.Module):
    """`forward(tokens [1, T], input_pos [1]) -> logits [1, V]` of the last token, caches updated in place."""

    def __init__(self, model: nn.Module, kind: ModelKind) -> None:
        super().__init__()
        self.model = model
        self.kind = kind

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        positions = input_pos + torch.arange(tokens.shape[1], dtype=input_pos.dtype)
        return self.kind.logits(self.model, tokens, positions.unsqueeze(0), last_only=True)[:, -1, :]


class StaticCacheProgram(nn.Module):
    """The static contract with caller-owned caches (see `etblocks.export.contract`):
    `forward(tokens [1, T], positions [1, T], *masks [T, L + T], *caches [1, L, Hkv, D])
    -> (logits [1, T, V], k_new_0, v_new_0, ...)`, each layer's caches and new rows being the tensors of its
    cache's `layout` (two, or six for an int8 cache).

    `mask_of_layer[i]` is the index (among the masks) of the mask layer i reads. Each layer's IO cache gets its
    inputs bound before the upstream forward and hands its new rows back after it.
    """

    def __init__(self, model: nn.Module, kind: ModelKind, blocks: list[nn.Module], mask_of_layer: list[int]) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self._blocks = blocks  # a plain list: they are registered once, under `model`
        self.mask_of_layer = mask_of_layer
        self.n_masks = max(mask_of_layer) + 1

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *masks_and_caches: torch.Tensor):
        masks, caches = masks_and_caches[: self.n_masks], list(masks_and_caches[self.n_masks :])
        for i, block in enumerate(self._blocks):
            n = len(block.kv_cache.layout(0, torch.float32))
            block.kv_cache.bind(caches[:n], masks[self.mask_of_layer[i]])
            del caches[:n]
        logits = self.kind.logits(self.model, tokens, positions, last_only=False)
        return (logits, *(rows for block in self._blocks for rows in block.kv_cache.take()))
