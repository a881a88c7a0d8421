"""Positional KV cache updated in place: slot i holds position i."""

from __future__ import annotations

import torch

from etblocks.ops import load_llama_custom_ops
from etblocks.state.kv import KVCache


class StaticKVCache(KVCache):
    """Full-length cache written at `input_pos[0]`, with `llama::update_cache` or a portable `index_copy_`.

    The custom op keeps the write in place inside XNNPACK programs; `index_copy_` needs no custom kernels.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        use_custom_op: bool = False,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__(max_batch_size, max_seq_len, n_kv_heads, head_dim, dtype, v_head_dim)
        self.use_custom_op = use_custom_op
        if use_custom_op:
            load_llama_custom_ops()

    def _allocate(self, length: int) -> None:
        super()._allocate(length)
        self.register_buffer("positions", torch.arange(length), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.write(input_pos, [(self.k_cache, k), (self.v_cache, v)])
        return self.k_cache, self.v_cache, self.positions

    def write(self, input_pos: torch.Tensor, stores: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write each `(buffer, rows)` pair's rows `[B, T, ...]` at positions `input_pos` of its buffer."""
        if not self.use_custom_op:
            for buffer, rows in stores:
                buffer.index_copy_(1, input_pos, rows)
            return
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + stores[0][1].shape[1] <= self.max_seq_len)  # the kernel skips an overflowing write silently
        for buffer, rows in stores:
            torch.ops.llama.update_cache(rows, buffer, start)
