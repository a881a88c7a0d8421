"""Sliding-window KV cache: memory proportional to the window, not the context."""

from __future__ import annotations

import torch

from etblocks.ops import load_llama_custom_ops
from etblocks.state.kv import KVCache
from etblocks.state.spec import RING


class RingKVCache(KVCache):
    """Keeps the last `window` positions; position p lives in slot `p % window`.

    `update` returns the ring's filled slots followed by the new rows, so a chunk of any length T attends to every
    key its window needs (up to window - 1 cached plus the chunk itself); then the chunk's last `window` rows go to
    their slots, in place. Use with a position-masked SDPA (`DynamicSDPA`, `MaskedCustomSDPA`).

    Until the ring wraps, only the first `min(start, window)` slots can hold an earlier position of the sequence;
    with `read_filled`, only those are read, so a decode step after a short prompt attends over the prompt, not
    the whole window. That length comes from data, and XNNPACK delegates no op on such a shape: use it with an
    SDPA that runs outside the delegate anyway (`MaskedCustomSDPA`).
    Slot positions are stored plus one, so the all-zero state is "empty": ExecuTorch starts mutable buffers at
    zero, whatever their value at export. Only slots holding a position before the chunk are offered to
    attention, so rows left from an earlier sequence are never read after the runner restarts at position 0.
    The write is `llama::update_cache_with_indices` with `use_custom_op` (in place, in XNNPACK programs), else
    `index_copy_`, which ExecuTorch runs as a copy of the whole ring.
    """

    update_kind = RING

    def __init__(
        self,
        max_batch_size: int,
        window: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        use_custom_op: bool = False,
        read_filled: bool = False,
    ) -> None:
        super().__init__(max_batch_size, window, n_kv_heads, head_dim, dtype)
        self.use_custom_op = use_custom_op
        self.read_filled = read_filled
        self.spare = 0
        if use_custom_op:
            load_llama_custom_ops()

    @property
    def window(self) -> int:
        """Slots in the ring: the attention window, plus `spare` ones."""
        return self.length

    def reserve(self, spare: int) -> None:
        """Hold `spare` slots beyond the attention window (contents are dropped). A call may then write up to `spare`
        rows that the sequence does not keep (proposals rejected in speculative decoding) without overwriting a
        row the window still needs: those rows only ever land in slots of positions older than the window, and
        their own positions, past the sequence's, are never read. Attention's mask keeps the window."""
        self._allocate(self.length - self.spare + spare)
        self.spare = spare

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
        (k_all, v_all), k_pos = self.read_then_write(input_pos, [(self.k_cache, k), (self.v_cache, v)])
        return k_all, v_all, k_pos

    def read_then_write(
        self, input_pos: torch.Tensor, stores: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """For each `(buffer, rows [B, T, ...])` pair, what attention reads: the buffer's slots to read followed by
        the call's rows; then `write_ring`. Also returns the position of every row read (-1: empty, or stale from
        an older sequence). Read are all slots, or with `read_filled` the `min(start, window)` that can hold an
        earlier position (at least one, so that export never meets an empty slice)."""
        start = input_pos[:1]
        cached = self.slot_positions
        if self.read_filled:
            # workaround(executorch 1.5.1): a length from .item() that may be 0 fails in dim_order_from_stride.
            filled = torch.clamp(start, min=1, max=self.window).item()
            torch._check(filled >= 1)
            torch._check(filled <= self.window)
            cached = cached.narrow(0, 0, filled)
            stores_read = [(buffer.narrow(1, 0, filled), rows) for buffer, rows in stores]
        else:
            stores_read = stores
        read = [torch.cat(pair, dim=1) for pair in stores_read]
        self.write_ring(input_pos, stores)
        return read, torch.cat((torch.where(cached < start, cached, -1), input_pos))

    def write_ring(self, input_pos: torch.Tensor, stores: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each `(buffer, rows [B, T, ...])` pair's buffer takes the chunk's last `min(T, window)` rows (the ones
        the ring keeps) in slots `position % window`; then the slot positions follow."""
        # min(T, window) as data, not a branch or sym_min on T (export proves no bound on either): T stays dynamic.
        kept = torch.clamp(input_pos[-1:] - input_pos[:1] + 1, max=self.window).item()
        torch._check(kept >= 1)
        torch._check(kept <= self.window)
        positions = last_rows(input_pos, 0, kept)
        slots = torch.remainder(positions, self.window)  # positions >= 0: ExecuTorch's remainder follows C's sign
        for buffer, rows in stores:
            rows = last_rows(rows, 1, kept)
            if self.use_custom_op:
                indices = slots.unsqueeze(0).expand(rows.shape[0], -1)
                torch.ops.llama.update_cache_with_indices(rows, buffer, 0, indices)
            else:
                buffer.index_copy_(1, slots, rows)
        self.slot_positions_plus_one.index_copy_(0, slots, positions + 1)


def last_rows(tensor: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """The last `count` entries of `tensor` along `dim`, for a `count` export knows only by its checks."""
    torch._check(count <= tensor.shape[dim])
    return tensor.narrow(dim, tensor.shape[dim] - count, count)
