"""Feeders: they feed tokens to a program's methods at absolute positions and keep what the program does not.

A static feeder owns the caller-owned state, builds masks, pads, and routes a short tail through `decode`, all
from the program's contract; it only needs a way to execute a method, so the same code runs an ExecuTorch program
(`Runner`), the exported graphs on the host (quantization calibration) and tests.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from etblocks.attention.masks import additive_mask, allowed_keys
from etblocks.errors import ConfigError, ContextOverflowError
from etblocks.export.contract import MaskGroup, StaticContract
from etblocks.state.spec import REPLACE, RING, ROWS, apply_update, held_positions

Execute = Callable[[str, list[torch.Tensor]], Sequence[torch.Tensor]]


def check_room(pos: int, n_tokens: int, max_context_len: int) -> None:
    if pos + n_tokens > max_context_len:
        raise ContextOverflowError(f"{n_tokens} tokens at position {pos} exceed the context of {max_context_len} tokens")


def group_mask(group: MaskGroup, pos: int, n_tokens: int, dtype: torch.dtype, mask_value: float) -> torch.Tensor:
    """Additive `[T, L + T]` mask for queries at `pos .. pos + T - 1` over the group's rows and the T new rows."""
    q_pos = torch.arange(pos, pos + n_tokens)
    held = held_positions(ROWS if group.window is None else RING, group.length, pos)
    return additive_mask(allowed_keys(q_pos, torch.cat((held, q_pos)), group.window), dtype, mask_value)


class DynamicFeeder:
    """Feeds `forward(tokens [1, T], input_pos [1])` chunks of at most `max_seq_len` tokens; `run(method, inputs)`
    executes the method. A program exported with `max_draft` also checks proposed tokens (`verify`, `keep`)."""

    def __init__(
        self, method: Any, max_seq_len: int, max_context_len: int, run: Callable[[Any, list], list],
        verify_method: Any = None, verify_len: int = 0,
    ) -> None:
        self.method = method
        self.max_seq_len = max_seq_len
        self.max_context_len = max_context_len
        self.run = run
        self.verify_method = verify_method  # `verify(tokens [1, T], input_pos [1]) -> logits [1, T, V]`, T <= verify_len
        self.verify_len = verify_len
        self.pos = 0
        self._verified = 0

    def reset(self) -> None:
        """State needs no clearing: attention masks stale rows by position, other state reads zeros at position 0."""
        self.pos = 0

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        check_room(self.pos, len(tokens), self.max_context_len)
        logits = None
        for start in range(0, len(tokens), self.max_seq_len):
            chunk = torch.tensor([list(tokens[start : start + self.max_seq_len])], dtype=torch.long)
            logits = self.run(self.method, [chunk, torch.tensor([self.pos], dtype=torch.long)])[0]
            self.pos += chunk.shape[1]
        return logits.reshape(-1, logits.shape[-1])[-1]

    @property
    def max_verify(self) -> int:
        """The most tokens `verify` checks in one call (0: the program has no `verify` method)."""
        return self.verify_len if self.verify_method is not None else 0

    def verify(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed `tokens` in one call of the `verify` method; return the logits after each `[T, V]`. `keep(n)` then
        says how many of them the sequence keeps."""
        if not 1 <= len(tokens) <= self.max_verify:
            raise ConfigError(f"verify takes 1 .. {self.max_verify} tokens per call; got {len(tokens)}")
        check_room(self.pos, len(tokens), self.max_context_len)
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        logits = self.run(self.verify_method, [ids, torch.tensor([self.pos], dtype=torch.long)])[0]
        self.pos += len(tokens)
        self._verified = len(tokens)
        return logits.reshape(len(tokens), -1)

    def keep(self, n: int) -> None:
        """Keep the first `n` tokens of the last `verify` call. The program's state is K/V rows and rings with
        spare slots (`verify` is exported only then): the rows of the others stay where they are, never read, since
        attention reads positions below the query's, and later calls overwrite them."""
        self.pos -= self._verified - n
        self._verified = 0


class StaticFeeder:
    """Feeds tokens through `prefill` (T = chunk) and `decode` (T = 1) at absolute positions, and owns the state the
    program's caller keeps (`state`, one tensor per contract entry).

    Full chunks go through `prefill`; a remainder of at most `decode_tail` tokens goes through `decode` one by
    one, a longer one through `prefill` padded at the end when the contract allows padding (padding rows are never
    kept, no real token attends to them, and they carry position -1 when a state skips padding), else through
    `decode` too: in-place state would store the padding, and state replaced whole that does not skip padding
    would fold it in.
    """

    def __init__(self, contract: StaticContract, execute: Execute, decode_tail: int | None = None) -> None:
        self.contract = contract
        self.execute = execute
        self.decode_tail = max(1, contract.chunk // 8) if decode_tail is None else decode_tail
        if not 1 <= self.decode_tail < contract.chunk:
            raise ConfigError(f"decode_tail={decode_tail} is not accepted; give 1 .. {contract.chunk - 1} (below the chunk)")
        self.max_context_len = contract.max_context_len
        self.state = [entry.spec.zeros() for entry in contract.states]
        self.marks_padding = any(entry.skips_padding for entry in contract.states)
        self.replaces_state = any(entry.spec.update == REPLACE for entry in contract.states)
        self._pending: tuple[list[int], Sequence[torch.Tensor]] | None = None
        self.pos = 0
        self.adapter_inputs = contract.adapter_table.inputs(None)  # the base model until an adapter is set

    def reset(self) -> None:
        """Start a new sequence. State needs no clearing: masks never let a query read an unwritten row, and state
        that is not positional is read as zeros by a call at position 0."""
        self.pos = 0

    def restore(self, state: Sequence[torch.Tensor], pos: int) -> None:
        """Continue from saved state (e.g. a cached system prompt): one tensor per contract entry, as `state` holds
        them, and the number of positions fed into it."""
        if self.contract.cache != "io":
            raise ConfigError("this program keeps its state inside (cache='inplace'); there is none to restore")
        if len(state) != len(self.state):
            names = ", ".join(f"{entry.name}.{entry.state}" for entry in self.contract.states[:4])
            raise ConfigError(f"caches: got {len(state)} tensors, the program has {len(self.state)} ({names}, ...)")
        for i, (given, entry) in enumerate(zip(state, self.contract.states)):
            if tuple(given.shape) != entry.shape or given.dtype != entry.spec.dtype:
                raise ConfigError(
                    f"caches[{i}] ({entry.name}.{entry.state}) is {tuple(given.shape)} {given.dtype}; the program takes "
                    f"{entry.shape} {entry.spec.dtype}"
                )
        if not 0 <= pos <= self.max_context_len:
            raise ConfigError(f"pos={pos} is not accepted; give 0 .. {self.max_context_len}")
        self.state = [tensor.clone() for tensor in state]
        self.pos = pos

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed `tokens` at the current position; return the logits `[V]` after the last one."""
        check_room(self.pos, len(tokens), self.max_context_len)
        chunk, logits, start = self.contract.chunk, None, 0
        while start < len(tokens):
            remaining = len(tokens) - start
            if remaining >= chunk:
                n, method = chunk, "prefill"
            elif remaining <= self.decode_tail or not self.contract.paddable:
                n, method = 1, "decode"
            else:
                n, method = remaining, "prefill"
            logits = self._step(tokens[start : start + n], method)
            start += n
        return logits

    def _step(self, tokens: Sequence[int], method: str) -> torch.Tensor:
        n = len(tokens)
        if self.contract.cache == "inplace":
            logits = self.execute(method, [self._padded(tokens, method), torch.tensor([self.pos], dtype=torch.long),
                                           *self.adapter_inputs])[0]
            self.pos += n
            return logits.reshape(-1)
        outputs = self._call(tokens, method)
        self._apply(outputs, n)
        return outputs[0][0, n - 1]

    def _padded(self, tokens: Sequence[int], method: str) -> torch.Tensor:
        padded = torch.zeros(1, self.contract.methods[method], dtype=torch.long)
        padded[0, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return padded

    def _call(self, tokens: Sequence[int], method: str) -> Sequence[torch.Tensor]:
        """One call of a caller-owned-state program at the current position; the state is not updated yet."""
        width, n = self.contract.methods[method], len(tokens)
        positions = torch.arange(self.pos, self.pos + width).unsqueeze(0)
        if self.marks_padding:
            positions[0, n:] = -1  # what state that `skips_padding` skips (no real token reads these rows)
        dtype, fill = self.contract.torch_dtype, self.contract.mask_value
        masks = [group_mask(group, self.pos, width, dtype, fill) for group in self.contract.masks]
        return self.execute(method, [self._padded(tokens, method), positions, *masks, *self.state, *self.adapter_inputs])

    def _apply(self, outputs: Sequence[torch.Tensor], n: int) -> None:
        """Update the state from a call's outputs for its first `n` tokens, and move on by `n`."""
        self.state = [
            apply_update(entry.spec, tensor, update, self.pos, n)
            for entry, tensor, update in zip(self.contract.states, self.state, outputs[1:])
        ]
        self.pos += n

    @property
    def max_verify(self) -> int:
        """The most tokens `verify` checks in one call: a chunk, when the program's caller owns its state and a
        call may be padded (0: it cannot check proposals)."""
        return self.contract.chunk if self.contract.cache == "io" and self.contract.paddable else 0

    def verify(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run `tokens` through one `prefill` call; return the logits after each `[T, V]`. The state is updated
        only by `keep(n)`, for the tokens the sequence keeps."""
        if not 1 <= len(tokens) <= self.max_verify:
            raise ConfigError(f"verify takes 1 .. {self.max_verify} tokens per call; got {len(tokens)}")
        check_room(self.pos, len(tokens), self.max_context_len)
        self._pending = (list(tokens), self._call(tokens, "prefill"))
        return self._pending[1][0][0, : len(tokens)]

    def keep(self, n: int) -> None:
        """Keep the first `n` tokens of the last `verify` call: rows, rings and windows take only their rows (a ring
        slot a rejected token would have overwritten keeps its row); state replaced whole after every token (a
        recurrence) cannot drop the rejected ones, so those `n` tokens run again from the state before the call."""
        tokens, outputs = self._pending
        self._pending = None
        if n == len(tokens) or not self.replaces_state:
            self._apply(outputs, n)
        elif n:
            self.forward(tokens[:n])
