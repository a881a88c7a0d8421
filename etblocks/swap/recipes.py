"""Recipes: which blocks a swap builds for a backend and how export treats them. Each backend declares its choices
as data (`Backend.recipe`); this module turns them, with the caller's overrides, into one checked `Recipe`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from etblocks.backends import INT8_IO_CACHE, STATIC_IO, backends, get_backend
from etblocks.errors import ConfigError
from etblocks.options import OPTIONS, RECIPE_KEYS, check


@dataclass(frozen=True)
class Recipe:
    """What `swap(model, backend=...)` builds and what `export` does with it. The choices of each field are declared
    once, in `etblocks.options`.

    shapes: "dynamic" exports `forward(tokens[1, T], input_pos[1])` with T dynamic and state as mutable buffers;
        "static" exports `prefill` (T = `chunk`) and `decode` (T = 1) with fixed shapes. A dynamic program with
        gather MoE experts takes at most `chunk` tokens per call (its gathered weights grow with T).
    cache: "inplace" keeps every mixer's state in the program as mutable buffers; "io" makes it program inputs and
        its updates outputs (static only: NPUs hold no state between calls).
    sdpa: "custom" uses `llama::custom_sdpa` where a layer allows it (no softcap or sinks; sliding windows with a
        mask from positions), "dynamic" is plain torch masked from positions, "static" is plain torch with the
        caller's mask (the "io" cache's partner).
    cache_update: "custom" writes in-place caches with `llama::update_cache` (rings: `update_cache_with_indices`),
        "index_copy" with `index_copy_`.
    attention: "mha" keeps heads in one tensor; "sha" computes each head on its own (Qualcomm HTP).
    linear: "conv2d" turns the attention projections into 1x1 convolutions (HTP's fastest matmul).
    partition: "hybrid" delegates only the fixed-shape projections and MLP and keeps attention with its in-place
        state on CPU (static shapes, "inplace" cache).
    moe: "gather" runs only each token's top-k experts (decode cost flat in the number of experts; CPUs);
        "dense" runs every expert weighted by the router (no indexing; NPUs and fixed-shape compilers).
    delta_rule: the form of gated DeltaNet's recurrence (`etblocks.mixers.delta_rule`): "fused" is ExecuTorch's
        `llama::gated_delta_rule` CPU kernel, "chunked" the matmul form any backend takes.
    quantize_activations: the calibrated quantization `export` applies unless told otherwise (the backend's
        `default_activations`, e.g. QNN's 16a8w).
    kv_quantize: "int8" stores the KV caches in int8 with a scale and zero point per token and KV head
        (`etblocks.state.quantized`); in-place caches read by `llama::custom_sdpa` are read by ExecuTorch's
        `llama::custom_quantized_sdpa` instead.
    dtype: the floating dtype of the swapped model and its state.
    """

    backend: str
    sdpa: str = "dynamic"
    cache_update: str = "index_copy"
    shapes: str = "dynamic"
    cache: str = "inplace"
    chunk: int = 32
    attention: str = "mha"
    linear: str = "linear"
    partition: str = "all"
    moe: str = "gather"
    delta_rule: str = "chunked"
    quantize_activations: str | None = None
    kv_quantize: str | None = None
    dtype: torch.dtype = torch.float32

    @property
    def static(self) -> bool:
        return self.shapes == "static"

    @property
    def caller_owned(self) -> bool:
        """Whether the programs take each mixer's state as inputs (and return its updates)."""
        return self.cache == "io"


def recipe_for(backend: str) -> Recipe:
    """The backend's own recipe, unchanged."""
    spec = get_backend(backend)
    return Recipe(backend=spec.name, quantize_activations=spec.default_activations, **spec.recipe)


def resolve_recipe(backend: str, **overrides) -> Recipe:
    """The recipe for `backend` with single choices overridden; unknown or inconsistent options raise `ConfigError`.

    `shapes="static"` on a dynamic backend also switches to caller-owned state and the static SDPA, unless
    `cache`/`sdpa`/`partition` say otherwise.
    """
    recipe = recipe_for(backend)
    overrides = {key: _checked(backend, key, value) for key, value in overrides.items()}
    if overrides.get("partition") == "hybrid":
        sdpa = "dynamic" if recipe.sdpa == "static" else recipe.sdpa  # an in-place cache masks by position
        overrides = {"shapes": "static", "cache": "inplace", "sdpa": sdpa, **overrides}
    if overrides.get("shapes") == "static" and not recipe.static and overrides.get("cache", "io") == "io":
        overrides = {**STATIC_IO, **overrides}
    recipe = dataclasses.replace(recipe, **overrides)
    _check_consistent(recipe)
    return recipe


def _checked(backend: str, key: str, value):
    if key == "quantize_activations":
        spec = get_backend(backend)
        value = check(OPTIONS[key], value)
        if value is not None and value not in spec.activation_schemes:
            accepted = list(spec.activation_schemes) or "none"
            hint = f"; {spec.quantization_hint}" if spec.quantization_hint else ""
            raise ConfigError(f"backend={backend!r} does not support quantize_activations={value!r}; it takes: {accepted}{hint}")
        return value
    if key not in RECIPE_KEYS:
        raise ConfigError(f"unknown recipe option {key}={value!r}; accepted options: {sorted([*RECIPE_KEYS, 'quantize_activations'])}")
    return check(OPTIONS[key], value)


def check_lowers(recipe: Recipe, backend: str) -> None:
    """`ConfigError` for what `recipe`'s programs hold that `backend` is known not to lower."""
    if recipe.kv_quantize is not None and recipe.caller_owned:
        alternatives = sorted(b.name for b in backends() if INT8_IO_CACHE not in b.limits)
        get_backend(backend).refuse_limit(INT8_IO_CACHE, f"kv_quantize={recipe.kv_quantize!r} with caller-owned caches", alternatives)


def _check_consistent(recipe: Recipe) -> None:
    problems = []
    if recipe.cache == "io" and not recipe.static:
        problems.append("cache='io' needs shapes='static' (a dynamic program keeps its state in place)")
    if recipe.cache == "io" and recipe.sdpa != "static":
        problems.append(f"cache='io' attends with the caller's mask: it needs sdpa='static', not {recipe.sdpa!r}")
    if recipe.cache == "inplace" and recipe.sdpa == "static":
        problems.append("sdpa='static' needs cache='io' (an in-place cache builds its mask from positions)")
    if recipe.attention == "sha" and recipe.cache != "io":
        problems.append("attention='sha' is a static block: it needs shapes='static' and cache='io'")
    if recipe.linear == "conv2d" and recipe.attention != "sha":
        problems.append("linear='conv2d' applies to the per-head projections of attention='sha'")
    if recipe.partition == "hybrid" and (recipe.cache != "inplace" or not recipe.static):
        problems.append("partition='hybrid' keeps an in-place cache on CPU: it needs shapes='static', cache='inplace'")
    if recipe.quantize_activations is not None and recipe.cache != "io":
        problems.append(f"quantize_activations={recipe.quantize_activations!r} applies to the static program with cache='io'")
    if recipe.kv_quantize is not None:
        if recipe.attention == "sha":
            problems.append(
                f"kv_quantize={recipe.kv_quantize!r} needs attention='mha' (single-head attention keeps float caches; "
                "a quantized NPU program quantizes them with its activations)"
            )
        if recipe.quantize_activations is not None:
            problems.append(
                f"kv_quantize={recipe.kv_quantize!r} and quantize_activations={recipe.quantize_activations!r}: a "
                "program with calibrated activations quantizes its caches itself"
            )
        if recipe.cache == "inplace" and recipe.dtype != torch.float32:
            problems.append(f"kv_quantize={recipe.kv_quantize!r} with an in-place cache needs dtype=torch.float32, not {recipe.dtype}")
    if problems:
        raise ConfigError(f"backend={recipe.backend!r}: " + "; ".join(problems))
    check_lowers(recipe, recipe.backend)
