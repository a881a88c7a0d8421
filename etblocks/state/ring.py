"""Sliding-window KV cache: memory proportional to the window, not the context."""

from __future__ import annotations

import torch

from etblocks.state.kv import KVCache
from etblocks.state.spec import RING


class RingKVCache(KVCache):
    """Keeps the last `window` positions; position p lives in slot `p % window`.

    `update` returns the ring's contents followed by the new rows, so a chunk of any length T attends to every
    key its window needs (up to window - 1 cached plus the chunk itself); then the ring keeps the last `window`
    positions. Use with a position-masked SDPA (`DynamicSDPA`).

    Slot positions are stored plus one, so the all-zero state is "empty": ExecuTorch starts mutable buffers at
    zero, whatever their value at export. Only slots holding a position before the chunk are offered to
    attention, so rows left from an earlier sequence are never read after the runner restarts at position 0.
    """

    update_kind = RING

    def __init__(
        self,
        max_batch_size: int,
        window: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(max_batch_size, window, n_kv_heads, head_dim, dtype)

    @property
    def window(self) -> int:
        return self.length

    @property
    def slot_positions(self) -> torch.Tensor:
        """Absolute position held by each slot, -1 for empty."""
        return self.slot_positions_plus_one - 1

    def _allocate(self, length: int) -> None:
        super()._allocate(length)
        self.register_buffer("slot_positions_plus_one", torch.zeros(length, dtype=torch.long), persistent=False)

    def reset(self) -> None:
        super().reset()
        self.slot_positions_plus_one.zero_()

    def resize(self, max_seq_len: int) -> None:
        """The ring is sized by its window; a context length does not change it."""
        self.reset()

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        k_all = torch.cat((self.k_cache, k), dim=1)
        v_all = torch.cat((self.v_cache, v), dim=1)
        k_pos = self.write_ring(input_pos, [(self.k_cache, k_all), (self.v_cache, v_all)])
        return k_all, v_all, k_pos

    def write_ring(self, input_pos: torch.Tensor, stores: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Keep the last `window` positions: each `(buffer, rows)` pair's buffer takes its slots from `rows`, the
        buffer's old contents followed by the chunk's new rows along dim 1. Returns the position of every row
        of `rows` (-1: not to be read)."""
        window = self.window
        start, last = input_pos[:1], input_pos[-1:]
        cached = self.slot_positions
        cached_pos = torch.where(cached < start, cached, -1)  # -1: empty, or stale from an older sequence
        # After the write, slot s holds the latest position p <= last with p % window == s. It is a new row
        # (at index window + p - start of the concatenation) if p >= start, else the slot keeps its old row.
        # A gather rather than slicing the last `window` rows: no branch on T, so T stays dynamic in export.
        # Operands stay non-negative: ExecuTorch's integer remainder follows C (sign of the dividend).
        slots = torch.arange(window, device=input_pos.device)
        latest = last - torch.remainder(last + window - slots, window)
        is_new = latest >= start
        source = torch.where(is_new, window + latest - start, slots)
        for buffer, rows in stores:
            buffer.copy_(rows.index_select(1, source))
        self.slot_positions_plus_one.copy_(torch.where(is_new, latest + 1, self.slot_positions_plus_one))
        return torch.cat((cached_pos, input_pos))
