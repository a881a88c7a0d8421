"""A swapped upstream model seen through the program contracts; its kind says how to call it."""

from __future__ import annotations

import torch
from torch import nn

from etblocks.state.base import State
from etblocks.swap.kinds import ModelKind


class DecoderProgram(nn.Module):
    """`forward(tokens [1, T], input_pos [1]) -> logits [1, V]` of the last token, state updated in place."""

    def __init__(self, model: nn.Module, kind: ModelKind) -> None:
        super().__init__()
        self.model = model
        self.kind = kind

    last_only = True  # the logits of the last token only

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        positions = input_pos + torch.arange(tokens.shape[1], dtype=input_pos.dtype)
        logits = self.kind.logits(self.model, tokens, positions.unsqueeze(0), last_only=self.last_only)
        return logits[:, -1, :] if self.last_only else logits


class VerifyProgram(DecoderProgram):
    """`forward(tokens [1, T], input_pos [1]) -> logits [1, T, V]` of every token, over the same state as
    `DecoderProgram`: checks proposed tokens in one call (speculative decoding)."""

    last_only = False


class DraftProgram(nn.Module):
    """A draft model's program (`DecoderProgram`, `VerifyProgram`) with its weights and state under `draft.`: in
    the target's file, methods that name the same buffer share it, so the draft's must not take the target's
    names."""

    def __init__(self, program: nn.Module) -> None:
        super().__init__()
        self.draft = program

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.draft(tokens, input_pos)


class StateInputsProgram(nn.Module):
    """The static contract with caller-owned state (see `etblocks.export.contract`):
    `forward(tokens [1, T], positions [1, T], *masks [T, L + T], *state) -> (logits [1, T, V], *updates)`, where
    `state` holds the tensors every caller-owned `State` declares, in order, and `updates` one update of each.

    `mask_of_state[i]` is the index (among the masks) of the mask state i is read under (None: it has none). Each
    state gets its tensors bound before the upstream forward and hands its updates back after it.
    """

    def __init__(self, model: nn.Module, kind: ModelKind, states: list[State], mask_of_state: list[int | None]) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self._states = states  # a plain list: they are registered once, under `model`
        self._sizes = [len(state.specs()) for state in states]
        self.mask_of_state = mask_of_state
        self.n_masks = max((m for m in mask_of_state if m is not None), default=-1) + 1

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *masks_and_state: torch.Tensor):
        masks, tensors = masks_and_state[: self.n_masks], list(masks_and_state[self.n_masks :])
        for state, size, mask in zip(self._states, self._sizes, self.mask_of_state):
            state.bind(tensors[:size], None if mask is None else masks[mask])
            del tensors[:size]
        logits = self.kind.logits(self.model, tokens, positions, last_only=False)
        return (logits, *(update for state in self._states for update in state.take()))
