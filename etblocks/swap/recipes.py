"""Recipes: per backend, which blocks a swap builds and how export treats them. Data only; adding a backend is
adding an entry."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from etblocks.errors import ConfigError

QUANTIZE_QNN = ("16a8w", "16a4w", "8a8w")

# Backends that do not lower a static program with int8 caller-owned caches in this release, and why.
INT8_IO_CACHE_FAILS = {
    "xnnpack": "ExecuTorch 1.5.1's XNNPACK partitioner proposes a partition with a dependency cycle around the cache "
    "quantization",
    "coreml": "coremltools 9.0 fails on the int8 cache tensors (KeyError: torch.int8)",
}


@dataclass(frozen=True)
class Recipe:
    """What `swap(model, backend=...)` builds and what `export` does with it.

    shapes: "dynamic" exports `forward(tokens[1, T], input_pos[1])` with T dynamic and caches as mutable buffers;
        "static" exports `prefill` (T = `chunk`) and `decode` (T = 1) with fixed shapes. A dynamic program with
        gather MoE experts takes at most `chunk` tokens per call (its gathered weights grow with T).
    cache: "inplace" keeps the caches in the program as mutable buffers; "io" makes them program inputs and the
        new rows outputs (static only: NPUs hold no state between calls).
    sdpa: "custom" uses `llama::custom_sdpa` where a layer allows it (no softcap, window or sinks), "dynamic" is plain
        torch masked from positions, "static" is plain torch with the caller's mask (the "io" cache's partner).
    cache_update: "custom" writes in-place caches with `llama::update_cache`, "index_copy" with `index_copy_`.
    attention: "mha" keeps heads in one tensor; "sha" computes each head on its own (Qualcomm HTP).
    linear: "conv2d" turns the attention projections into 1x1 convolutions (HTP's fastest matmul).
    partition: "hybrid" delegates only the fixed-shape projections and MLP and keeps attention with its in-place
        cache on CPU (static shapes, "inplace" cache).
    moe: "gather" runs only each token's top-k experts (decode cost flat in the number of experts; CPUs);
        "dense" runs every expert weighted by the router (no indexing; NPUs and fixed-shape compilers).
    quantize: what `export` to this backend quantizes with unless told otherwise (QnnQuantizer precisions).
    kv_quantize: "int8" stores the KV caches in int8 with a scale and zero point per token and KV head
        (`etblocks.kv_cache.quantized`); in-place caches read by `llama::custom_sdpa` are read by ExecuTorch's
        `llama::custom_quantized_sdpa` instead.
    dtype: the floating dtype of the swapped model and its caches.
    """

    backend: str
    sdpa: Literal["custom", "dynamic", "static"]
    cache_update: Literal["custom", "index_copy"] = "index_copy"
    shapes: Literal["dynamic", "static"] = "dynamic"
    cache: Literal["inplace", "io"] = "inplace"
    chunk: int = 32
    attention: Literal["mha", "sha"] = "mha"
    linear: Literal["linear", "conv2d"] = "linear"
    partition: Literal["all", "hybrid"] = "all"
    moe: Literal["dense", "gather"] = "gather"
    quantize: str | None = None
    kv_quantize: Literal[None, "int8"] = None
    dtype: torch.dtype = torch.float32

    @property
    def static(self) -> bool:
        return self.shapes == "static"


_NPU = dict(shapes="static", cache="io", sdpa="static")

RECIPES: dict[str, Recipe] = {
    "xnnpack": Recipe(backend="xnnpack", sdpa="custom", cache_update="custom"),
    "portable": Recipe(backend="portable", sdpa="dynamic"),
    "openvino": Recipe(backend="openvino", moe="dense", **_NPU),
    "coreml": Recipe(backend="coreml", moe="dense", **_NPU),
    "vulkan": Recipe(backend="vulkan", moe="dense", **_NPU),
    "qnn": Recipe(backend="qnn", attention="sha", linear="conv2d", moe="dense", quantize="16a8w", **_NPU),
}

_CHOICES = {
    "sdpa": ("custom", "dynamic", "static"),
    "cache_update": ("custom", "index_copy"),
    "shapes": ("dynamic", "static"),
    "cache": ("inplace", "io"),
    "attention": ("mha", "sha"),
    "linear": ("linear", "conv2d"),
    "partition": ("all", "hybrid"),
    "moe": ("dense", "gather"),
    "quantize": (None, *QUANTIZE_QNN),
    "kv_quantize": (None, "int8"),
}


def resolve_recipe(backend: str, **overrides) -> Recipe:
    """The recipe for `backend` with single choices overridden; unknown or inconsistent options raise `ConfigError`.

    `shapes="static"` on a dynamic backend also switches to caller-owned caches and the static SDPA, unless
    `cache`/`sdpa`/`partition` say otherwise.
    """
    if backend not in RECIPES:
        raise ConfigError(f"backend={backend!r} has no swap recipe; accepted: {sorted(RECIPES)}")
    for key, value in overrides.items():
        _check_option(backend, key, value)
    recipe = RECIPES[backend]
    if overrides.get("partition") == "hybrid":
        sdpa = "dynamic" if recipe.sdpa == "static" else recipe.sdpa  # an in-place cache masks by position
        overrides = {"shapes": "static", "cache": "inplace", "sdpa": sdpa, **overrides}
    if overrides.get("shapes") == "static" and not recipe.static and overrides.get("cache", "io") == "io":
        overrides = {**_NPU, **overrides}
    recipe = dataclasses.replace(recipe, **overrides)
    _check_consistent(recipe)
    return recipe


def _check_option(backend: str, key: str, value) -> None:
    if key == "dtype":
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise ConfigError(f"dtype={value!r} is not accepted; give a floating torch.dtype such as torch.float32")
        return
    if key == "chunk":
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise ConfigError(f"chunk={value!r} is not accepted; give an integer >= 2 (decode is the T=1 method)")
        return
    if key not in _CHOICES:
        raise ConfigError(f"unknown recipe option {key}={value!r}; accepted options: {sorted(_CHOICES) + ['chunk', 'dtype']}")
    if value not in _CHOICES[key]:
        raise ConfigError(f"{key}={value!r} is not accepted; choose one of {list(_CHOICES[key])}")
    if key == "quantize" and value is not None and backend != "qnn":
        hint = "; Core ML programs are fp32 or fp16 (dtype=torch.float16)" if backend == "coreml" else ""
        raise ConfigError(f"backend={backend!r} does not support quantize={value!r}: QnnQuantizer precisions are for qnn{hint}")


def check_int8_io_cache_lowers(backend: str) -> None:
    """`ConfigError` for a static program with int8 caller-owned caches on a backend that cannot lower it."""
    if backend in INT8_IO_CACHE_FAILS:
        runs = sorted({"portable", "openvino", "vulkan"})
        raise ConfigError(
            f"kv_quantize='int8' with caller-owned caches does not lower to backend={backend!r}: "
            f"{INT8_IO_CACHE_FAILS[backend]}. Lower the static program to one of {runs}, or keep float caches"
            + (" (the dynamic xnnpack program has in-place int8 caches)" if backend == "xnnpack" else "")
        )


def _check_consistent(recipe: Recipe) -> None:
    problems = []
    if recipe.cache == "io" and not recipe.static:
        problems.append("cache='io' needs shapes='static' (a dynamic program keeps its caches in place)")
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
    if recipe.quantize is not None and recipe.cache != "io":
        problems.append(f"quantize={recipe.quantize!r} applies to the static program with cache='io'")
    if recipe.kv_quantize is not None:
        if recipe.attention == "sha":
            problems.append(
                f"kv_quantize={recipe.kv_quantize!r} needs attention='mha' (single-head attention keeps float caches; "
                "a quantized QNN program quantizes them with its activations)"
            )
        if recipe.quantize is not None:
            problems.append(f"kv_quantize={recipe.kv_quantize!r} and quantize={recipe.quantize!r}: a QnnQuantizer program quantizes its caches itself")
        if recipe.cache == "inplace" and recipe.dtype != torch.float32:
            problems.append(f"kv_quantize={recipe.kv_quantize!r} with an in-place cache needs dtype=torch.float32, not {recipe.dtype}")
    if problems:
        raise ConfigError(f"backend={recipe.backend!r}: " + "; ".join(problems))
    if recipe.kv_quantize is not None and recipe.cache == "io":
        check_int8_io_cache_lowers(recipe.backend)
