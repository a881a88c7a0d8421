"""Model kinds: what `swap` and `export` must know about a family of upstream model classes (transformers causal
LMs, torchtune decoders) beyond its modules. One swap, one registry and one pair of program wrappers serve every
kind; a kind answers the questions whose answer depends on how the upstream model is called.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable, ContextManager

import torch
from torch import nn

from etblocks.adapters.lora import LoRATensors


class ModelKind(ABC):
    """One family of upstream model classes. `name` is what error messages call it, `positions_name` where
    the model declares its longest context."""

    name: str
    positions_name: str

    @abstractmethod
    def matches(self, model: nn.Module) -> bool:
        """Whether `model` is of this kind (without importing a package the caller has not imported)."""

    def prepare(self) -> None:
        """Register this kind's converters, once, before its first model is swapped (never over a user's own)."""

    @abstractmethod
    def mixer_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """`(name, module)` of every token mixer (attention) `swap` replaces."""

    def module_layout(self, module: nn.Module) -> Callable[..., nn.Module] | None:
        """A converter for a module with no registered one that this kind recognises by its layout (transformers'
        generic MoE experts), or None."""
        return None

    @abstractmethod
    def max_positions(self, model: nn.Module) -> int | None:
        """The longest context the model declares, if it declares one."""

    @abstractmethod
    def vocab_size(self, model: nn.Module) -> int:
        """The number of token ids the model embeds."""

    @abstractmethod
    def logits(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool) -> torch.Tensor:
        """`tokens [1, T]` at absolute `positions [1, T]` -> logits `[1, T, V]` (`[1, 1, V]` with `last_only`),
        without the upstream cache: swapped blocks keep their own, originals see the whole probe at once."""

    @abstractmethod
    def token_metadata(self, model: nn.Module) -> dict:
        """`vocab_size`, `bos_id`, `eos_ids` and `n_layers` for the program's metadata methods."""

    def check(self, model: nn.Module, replaced: list[str]) -> None:
        """Raise `UnsupportedModelError` for what the swap would leave behind that cannot export."""

    def adapter_layers(self, model: nn.Module) -> dict[str, LoRATensors]:
        """LoRA layers the upstream model carries in its own modules, by module name; `swap` unwraps them to
        their base and loads them back as an etblocks adapter."""
        return {}

    def base_only(self, model: nn.Module) -> ContextManager:
        """A context in which the upstream model runs without its own adapters (what the swapped blocks compute
        before the adapter is loaded back)."""
        return contextlib.nullcontext()

    def finish(self, model: nn.Module) -> None:
        """Model-level changes after the swapped modules are in place."""
