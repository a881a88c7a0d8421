"""`KVShare`: the keys and values one attention block attended over, for later blocks that share them."""

from __future__ import annotations

import torch


class KVShare:
    """What a source attention block attended over in its latest call: `(k_all, v_all, k_pos, mask)`, exactly as
    its own SDPA read them (its cache, or a caller-owned cache followed by the call's rows, with their positions or
    mask). Later blocks of the same kind read it in the same forward pass (KV sharing: Gemma 3n, Gemma 4), so the
    program keeps one cache per source however many layers read it. A plain object, not a module: the readers hold
    no state of their own."""

    def __init__(self) -> None:
        self._latest: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None

    def publish(self, k_all: torch.Tensor, v_all: torch.Tensor, k_pos: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        self._latest = (k_all, v_all, k_pos, mask)

    def read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if self._latest is None:
            raise ValueError(
                "no attention block has published keys and values to this KVShare yet: a KV-shared block runs after "
                "its source, in the same forward pass"
            )
        return self._latest
