"""Converters keyed by upstream class. Lookup walks the MRO, so a subclass inherits its parent's converter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from etblocks.swap.recipes import Recipe


@dataclass(frozen=True)
class SwapContext:
    """What a converter needs beyond the module: the recipe and the cache geometry."""

    recipe: Recipe
    max_seq_len: int
    max_batch_size: int = 1


Converter = Callable[[nn.Module, SwapContext], nn.Module]


class Registry:
    """Maps upstream module classes to converters."""

    def __init__(self) -> None:
        self._converters: dict[type, Converter] = {}
        self._different_output: set[type] = set()

    def register(self, *upstream: type, same_output: bool = True) -> Callable[[Converter], Converter]:
        """Decorator: `@registry.register(LlamaAttention)` makes the function the converter for that class.

        `same_output=False` marks a replacement that returns another representation of its original's result
        (a real rotary table for a complex one), so `swap` checks it through its consumers instead of directly.
        """

        def decorate(converter: Converter) -> Converter:
            for cls in upstream:
                self._converters[cls] = converter
                if not same_output:
                    self._different_output.add(cls)
            return converter

        return decorate

    def lookup(self, module: nn.Module) -> Converter | None:
        for cls in type(module).__mro__:
            if cls in self._converters:
                return self._converters[cls]
        return None

    def same_output(self, module: nn.Module) -> bool:
        return not any(cls in self._different_output for cls in type(module).__mro__)

    def supported(self) -> list[str]:
        return sorted(cls.__name__ for cls in self._converters)


ATTENTION = Registry()
# Other upstream modules a family needs replaced for export (e.g. a rotary table computed with complex ops).
MODULES = Registry()


def register(*upstream: type) -> Callable[[Converter], Converter]:
    """Register an attention converter: `@etblocks.register(MyAttention)` over `fn(module, ctx) -> nn.Module`."""
    return ATTENTION.register(*upstream)
