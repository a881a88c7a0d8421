"""`Runner`: generate with an exported etblocks program through the ExecuTorch Python runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from etblocks.errors import ConfigError, ContextOverflowError


class Runner:
    """Loads a .pte with a dynamic `forward(tokens[1, T], input_pos[1])` and generates from token ids.

    The runner keeps the absolute position across `generate` calls (a chat continues where it stopped);
    `reset()` starts a new sequence.
    """

    def __init__(self, path: str | Path, data_path: str | Path | None = None) -> None:
        from executorch.runtime import Runtime

        from etblocks.attention.sdpa import load_llama_custom_ops

        load_llama_custom_ops()
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"path={str(path)!r} is not a file; give the .pte written by etblocks.export")
        kwargs = {"data_path": str(data_path)} if data_path else {}
        self.program = Runtime.get().load_program(str(path), **kwargs)
        methods = set(self.program.method_names)
        if "forward" not in methods or "get_max_seq_len" not in methods:
            raise ConfigError(f"{path} has methods {sorted(methods)}; expected 'forward' and the LLM metadata methods")
        self.max_seq_len = int(self._constant("get_max_seq_len"))
        self.max_context_len = int(self._constant("get_max_context_len", self.max_seq_len))
        self.eos_ids = [int(t) for t in self._constant("get_eos_ids", [])]
        self._forward = self.program.load_method("forward")
        self.pos = 0

    def _constant(self, name: str, default=None):
        if name not in self.program.method_names:
            return default
        value = self.program.load_method(name).execute([])
        return value if len(value) > 1 or name == "get_eos_ids" else value[0]

    def reset(self) -> None:
        """Start a new sequence. Stale cache rows are never read: attention masks by position."""
        self.pos = 0

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens at the current position (in chunks of at most `max_seq_len`); return the last logits."""
        if self.pos + len(tokens) > self.max_context_len:
            raise ContextOverflowError(
                f"{len(tokens)} tokens at position {self.pos} exceed the context of {self.max_context_len} tokens"
            )
        logits = None
        for start in range(0, len(tokens), self.max_seq_len):
            chunk = torch.tensor([tokens[start : start + self.max_seq_len]], dtype=torch.long)
            logits = self._forward.execute([chunk, torch.tensor([self.pos], dtype=torch.long)])[0]
            self.pos += chunk.shape[1]
        return logits.reshape(-1, logits.shape[-1])[-1]

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 32,
        eos: int | Iterable[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[int]:
        """New tokens after `prompt_ids`; stops after an EOS token (included). `eos=None` uses the program's."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ConfigError("prompt_ids=[] is empty; give at least one token id")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens} is not accepted; give an integer >= 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ConfigError(f"temperature={temperature}, top_p={top_p}: accepted are temperature >= 0, 0 < top_p <= 1")
        needed = self.pos + len(prompt_ids) + max_new_tokens - 1
        if needed > self.max_context_len:
            raise ContextOverflowError(
                f"prompt of {len(prompt_ids)} tokens at position {self.pos} plus max_new_tokens={max_new_tokens} "
                f"needs {needed} positions; the program's context is {self.max_context_len} "
                f"(at most {self.max_context_len - self.pos - len(prompt_ids) + 1} new tokens fit; reset() frees it)"
            )
        stop = set(self.eos_ids if eos is None else ([eos] if isinstance(eos, int) else eos))
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        logits = self.forward(prompt_ids)
        new_tokens: list[int] = []
        while True:
            token = sample(logits, temperature, top_p, generator)
            new_tokens.append(token)
            if token in stop or len(new_tokens) == max_new_tokens:
                return new_tokens
            logits = self.forward([token])


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling over `softmax(logits / temperature)`."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])
