"""Converters keyed by upstream class. Lookup walks the MRO, so a subclass inherits its parent's converter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from etblocks.state.mixer import Mixer
from etblocks.state.shared import KVShare
from etblocks.swap.recipes import Recipe


@dataclass(frozen=True)
class SwapContext:
    """What a converter needs beyond the module: the recipe and the state geometry. A mixer builds its `State`
    in place or caller-owned as `caller_owned` says."""

    recipe: Recipe
    max_seq_len: int
    max_batch_size: int = 1
    # One `KVShare` per source of shared keys and values, by the key its converters agree on (a layer index): the
    # source and the layers that read it get the same object, however often each is built. A copy made with
    # `dataclasses.replace` keeps the same dict.
    kv_shares: dict = field(default_factory=dict, compare=False)

    @property
    def caller_owned(self) -> bool:
        return self.recipe.caller_owned

    def kv_share(self, key) -> KVShare:
        """The `KVShare` of source `key`, made on first use."""
        return self.kv_shares.setdefault(key, KVShare())


Converter = Callable[[nn.Module, SwapContext], nn.Module]


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry:
    """Maps upstream module classes to converters. A class is given as itself or, for etblocks' own families, by
    its qualified name: a name needs nothing imported, so `import etblocks` loads no upstream modeling code and a
    family costs nothing until a model of it is swapped."""

    def __init__(self) -> None:
        self._converters: dict[type | str, Converter] = {}
        self._different_output: set[type | str] = set()
        self._when: dict[type | str, Callable[[nn.Module], bool]] = {}

    def register(
        self,
        *upstream: type | str,
        same_output: bool = True,
        replace: bool = True,
        when: Callable[[nn.Module], bool] | None = None,
    ) -> Callable[[Converter], Converter]:
        """Decorator: `@registry.register(LlamaAttention)` makes the function the converter for that class.

        `same_output=False` marks a replacement that returns another representation of its original's result
        (a real rotary table for a complex one), so `swap` checks it through its consumers instead of directly.
        `replace=False` keeps a converter already registered for the class (etblocks' own families never
        override one a user registered). `when(module)` limits the converter to the instances it accepts; lookup
        passes over the others as if the class had none (a MoE block whose experts etblocks cannot read stays
        upstream).
        """

        def decorate(converter: Converter) -> Converter:
            for key in upstream:
                if not replace and key in self._converters:
                    continue
                self._converters[key] = converter
                self._different_output.discard(key)
                self._when.pop(key, None)
                if not same_output:
                    self._different_output.add(key)
                if when is not None:
                    self._when[key] = when
            return converter

        return decorate

    def _keys(self, module: nn.Module):
        for cls in type(module).__mro__:
            yield cls
            yield qualified_name(cls)

    def _key(self, module: nn.Module) -> type | str | None:
        """The registration that applies to `module`: the first along its MRO whose `when` accepts it."""
        return next((k for k in self._keys(module) if k in self._converters and (k not in self._when or self._when[k](module))), None)

    def lookup(self, module: nn.Module) -> Converter | None:
        key = self._key(module)
        return None if key is None else self._converters[key]

    def same_output(self, module: nn.Module) -> bool:
        return self._key(module) not in self._different_output

    def supported(self) -> list[str]:
        return sorted(key.rsplit(".", 1)[-1] if isinstance(key, str) else key.__name__ for key in self._converters)


MIXERS = Registry()
# Other upstream modules a family needs replaced for export (e.g. a rotary table computed with complex ops).
MODULES = Registry()


MixerConverter = Callable[[nn.Module, SwapContext], Mixer]


def register(*upstream: type) -> Callable[[MixerConverter], MixerConverter]:
    """Register a mixer converter: `@etblocks.register(MyAttention)` over `fn(module, ctx) -> mixer`, where the
    mixer (`etblocks.state.mixer`) holds the module's weights, builds its state in the form `ctx.caller_owned` asks
    for, and is called the upstream way (`etblocks.swap.HFCall`, `etblocks.swap.TuneCall`)."""
    return MIXERS.register(*upstream)
