"""Method contracts: what an exported program's methods take and return, and the metadata describing them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from etblocks.errors import ConfigError
from etblocks.kv_cache.base import find_caches
from etblocks.swap import set_max_seq_len
from etblocks.swap.hf.model import is_hf_causal_lm
from etblocks.swap.hf.program import HFDecoderProgram, hf_token_metadata


@dataclass(frozen=True)
class DynamicProgram:
    """`forward(tokens int64 [1, T], input_pos int64 [1]) -> logits [1, V]` with 1 <= T <= max_seq_len.

    `metadata` becomes the constant methods ExecuTorch's LLM runner reads.
    """

    module: nn.Module
    max_seq_len: int
    metadata: dict

    def example_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long)

    def dynamic_shapes(self):
        return ({1: torch.export.Dim("seq_len", min=1, max=self.max_seq_len)}, None)


def dynamic_program(
    model: nn.Module,
    max_seq_len: int | None = None,
    bos_id: int | None = None,
    eos_ids: list[int] | None = None,
    vocab_size: int | None = None,
) -> DynamicProgram:
    """Wrap a swapped HF model, or take a model built from etblocks blocks as it is. `max_seq_len` (default:
    the caches' length) resizes the caches."""
    hf_model = is_hf_causal_lm(model)
    if hf_model and getattr(model, "etblocks_swap", None) is None:
        raise ConfigError(f"{type(model).__name__} has not been swapped; call etblocks.swap(model, backend=...) before export")
    caches = find_caches(model)
    if not caches:
        raise ConfigError(f"{type(model).__name__} holds no etblocks KV cache; build it from etblocks blocks")
    if max_seq_len is not None:
        set_max_seq_len(model, max_seq_len)
    if hf_model:
        max_seq_len = model.etblocks_swap.max_seq_len  # not from the caches: ring caches hold only a window
        tokens = hf_token_metadata(model)
        module = HFDecoderProgram(model)
    else:
        max_seq_len = max_seq_len or max(cache.max_seq_len for cache in caches)
        tokens = {"vocab_size": vocab_size, "bos_id": None, "eos_ids": [], "n_layers": len(caches)}
        module = model
    if bos_id is not None:
        tokens["bos_id"] = bos_id
    if eos_ids is not None:
        tokens["eos_ids"] = list(eos_ids)
    if tokens["vocab_size"] is None:
        raise ConfigError("vocab_size=None: give vocab_size= for a model that is not a transformers model")
    return DynamicProgram(module, max_seq_len, _llm_runner_metadata(max_seq_len, tokens))


def _llm_runner_metadata(max_seq_len: int, tokens: dict) -> dict:
    metadata = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": tokens["vocab_size"],
        "get_n_layers": tokens["n_layers"],
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
        "use_sdpa_with_kv_cache": False,
    }
    if tokens["eos_ids"]:
        metadata["get_eos_ids"] = tokens["eos_ids"]
    if tokens["bos_id"] is not None:
        metadata["get_bos_id"] = tokens["bos_id"]
    return metadata
