"""Drives a static program: owns the caches, builds masks, pads, routes a short tail through `decode`.

The driver only needs a way to execute a method, so the same code runs an ExecuTorch program (`Runner`),
the exported graphs on the host (quantization calibration) and tests.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from etblocks.attention.masks import additive_mask, allowed_keys
from etblocks.errors import ConfigError, ContextOverflowError
from etblocks.export.contract import CacheGroup, StaticContract

Execute = Callable[[str, list[torch.Tensor]], Sequence[torch.Tensor]]


def check_room(pos: int, n_tokens: int, max_context_len: int) -> None:
    if pos + n_tokens > max_context_len:
        raise ContextOverflowError(f"{n_tokens} tokens at position {pos} exceed the context of {max_context_len} tokens")


def slot_positions(group: CacheGroup, pos: int) -> torch.Tensor:
    """`[L]`: the absolute position each cache row of `group` holds once positions `[0, pos)` are written
    (-1: empty). Full caches hold position p in row p; windows hold it in row p % L, the latest one winning."""
    rows = torch.arange(group.length)
    if group.window is None:
        return torch.where(rows < pos, rows, -1)
    latest = (pos - 1) - torch.remainder(pos - 1 - rows, group.length)
    return torch.where(latest >= 0, latest, -1)


def group_mask(group: CacheGroup, pos: int, n_tokens: int, dtype: torch.dtype, mask_value: float) -> torch.Tensor:
    """Additive `[T, L + T]` mask for queries at `pos .. pos + T - 1` over the cache rows and the T new rows."""
    q_pos = torch.arange(pos, pos + n_tokens)
    allowed = allowed_keys(q_pos, torch.cat((slot_positions(group, pos), q_pos)), group.window)
    return additive_mask(allowed, dtype, mask_value)


class StaticDriver:
    """Feeds tokens through `prefill` (T = chunk) and `decode` (T = 1) at absolute positions.

    Full chunks go through `prefill`; a remainder of at most `decode_tail` tokens goes through `decode` one by
    one, a longer one through `prefill` padded at the end (padding rows are never written to the caches, and
    no real token attends to them). In-place programs are never padded (a padding row would be written into
    their caches), so their remainder always goes through `decode`.
    """

    def __init__(self, contract: StaticContract, execute: Execute, decode_tail: int | None = None) -> None:
        self.contract = contract
        self.execute = execute
        self.decode_tail = max(1, contract.chunk // 8) if decode_tail is None else decode_tail
        if not 1 <= self.decode_tail < contract.chunk:
            raise ConfigError(f"decode_tail={decode_tail} is not accepted; give 1 .. {contract.chunk - 1} (below the chunk)")
        self.max_context_len = contract.max_context_len
        self.caches = self._empty_caches()
        self.pos = 0
        self.adapter_inputs = contract.adapter_table.inputs(None)  # the base model until an adapter is set

    def _empty_caches(self) -> list[torch.Tensor]:
        return [torch.zeros(tensor.shape, dtype=tensor.dtype) for _, tensor in self.contract.cache_tensors()]

    def reset(self) -> None:
        """Start a new sequence. Cache rows need no clearing: masks never let a query read an unwritten row."""
        self.pos = 0

    def restore(self, caches: Sequence[torch.Tensor], pos: int) -> None:
        """Continue from saved state (e.g. a cached system prompt): caches `[k0, v0, k1, v1, ...]` (or each layer's
        int8 layout) as `caches` returns them, and the number of positions they hold."""
        if self.contract.cache != "io":
            raise ConfigError("this program keeps its caches inside (cache='inplace'); there are none to restore")
        if len(caches) != len(self.caches):
            per_layer = len(self.caches) // len(self.contract.layers)
            raise ConfigError(f"caches: got {len(caches)} tensors, the program has {len(self.caches)} ({per_layer} per layer)")
        names = [f"{tensor.name}.{layer}" for layer, tensor in self.contract.cache_tensors()]
        for i, (given, expected, name) in enumerate(zip(caches, self.caches, names)):
            if tuple(given.shape) != tuple(expected.shape) or given.dtype != expected.dtype:
                raise ConfigError(
                    f"caches[{i}] ({name}) is {tuple(given.shape)} {given.dtype}; the program takes "
                    f"{tuple(expected.shape)} {expected.dtype}"
                )
        if not 0 <= pos <= self.max_context_len:
            raise ConfigError(f"pos={pos} is not accepted; give 0 .. {self.max_context_len}")
        self.caches = [c.clone() for c in caches]
        self.pos = pos

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed `tokens` at the current position; return the logits `[V]` after the last one."""
        check_room(self.pos, len(tokens), self.max_context_len)
        chunk, logits, start = self.contract.chunk, None, 0
        while start < len(tokens):
            remaining = len(tokens) - start
            if remaining >= chunk:
                n, method = chunk, "prefill"
            elif remaining <= self.decode_tail or self.contract.cache == "inplace":
                n, method = 1, "decode"
            else:
                n, method = remaining, "prefill"
            logits = self._step(tokens[start : start + n], method)
            start += n
        return logits

    def _step(self, tokens: Sequence[int], method: str) -> torch.Tensor:
        width, n = self.contract.methods[method], len(tokens)
        padded = torch.zeros(1, width, dtype=torch.long)
        padded[0, :n] = torch.tensor(tokens, dtype=torch.long)
        if self.contract.cache == "inplace":
            logits = self.execute(method, [padded, torch.tensor([self.pos], dtype=torch.long), *self.adapter_inputs])[0]
            self.pos += n
            return logits.reshape(-1)
        positions = torch.arange(self.pos, self.pos + width).unsqueeze(0)
        dtype, fill = self.contract.torch_dtype, self.contract.mask_value
        masks = [group_mask(group, self.pos, width, dtype, fill) for group in self.contract.groups]
        outputs = self.execute(method, [padded, positions, *masks, *self.caches, *self.adapter_inputs])
        for (layer, _), cache, rows in zip(self.contract.cache_tensors(), self.caches, outputs[1:]):
            self._write(self.contract.group(self.contract.layers[layer].group), cache, rows[:, :n])
        self.pos += n
        return outputs[0][0, n - 1]

    def _write(self, group: CacheGroup, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """Store the new rows `[1, n, Hkv, D]` of positions `pos .. pos + n - 1` in their cache rows."""
        n = rows.shape[1]
        if group.window is None:
            cache[:, self.pos : self.pos + n] = rows
            return
        keep = min(n, group.length)  # earlier rows of a long chunk would be overwritten within it anyway
        cache[:, torch.arange(self.pos + n - keep, self.pos + n) % group.length] = rows[:, n - keep :]
