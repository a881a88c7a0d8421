"""Recipes: per backend, which blocks a swap builds. Data only; adding a backend is adding an entry."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from etblocks.errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    """What `swap(model, backend=...)` builds.

    sdpa: "custom" uses `llama::custom_sdpa` where a layer allows it (no softcap, no window), "dynamic" is
        plain torch everywhere.
    cache_update: "custom" writes with `llama::update_cache`, "index_copy" with portable `index_copy_`.
    shapes: "dynamic" exports `forward(tokens[1, T], input_pos[1])` with T dynamic.
    """

    backend: str
    sdpa: Literal["custom", "dynamic"]
    cache_update: Literal["custom", "index_copy"]
    shapes: Literal["dynamic"] = "dynamic"
    dtype: torch.dtype = torch.float32


RECIPES: dict[str, Recipe] = {
    "xnnpack": Recipe(backend="xnnpack", sdpa="custom", cache_update="custom"),
    "portable": Recipe(backend="portable", sdpa="dynamic", cache_update="index_copy"),
}

_CHOICES = {"sdpa": ("custom", "dynamic"), "cache_update": ("custom", "index_copy"), "shapes": ("dynamic",)}


def resolve_recipe(backend: str, **overrides) -> Recipe:
    """The recipe for `backend` with single choices overridden; unknown names raise `ConfigError`."""
    if backend not in RECIPES:
        raise ConfigError(f"backend={backend!r} has no swap recipe; accepted: {sorted(RECIPES)}")
    recipe = RECIPES[backend]
    for key, value in overrides.items():
        if key == "dtype":
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ConfigError(f"dtype={value!r} is not accepted; give a floating torch.dtype such as torch.float32")
            continue
        if key not in _CHOICES:
            raise ConfigError(f"unknown recipe option {key}={value!r}; accepted options: {sorted(_CHOICES) + ['dtype']}")
        if value not in _CHOICES[key]:
            raise ConfigError(f"{key}={value!r} is not accepted; choose one of {list(_CHOICES[key])}")
    return dataclasses.replace(recipe, **overrides)
