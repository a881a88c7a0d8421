"""`swap()`: replace a model's attention (and MoE blocks) with etblocks blocks, in place, after checking every
replacement."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from etblocks.attention.masks import additive_mask, allowed_keys, block_sliding_window
from etblocks.errors import ConfigError, UnsupportedModelError
from etblocks.kv_cache.base import find_caches, reset_caches
from etblocks.kv_cache.io import IOKVCache
from etblocks.swap.hf import model as hf
from etblocks.swap.hf.convert import build_attention
from etblocks.swap.hf.families import register_families
from etblocks.swap.hf.fallback import infer_layout
from etblocks.swap.hf.moe import MOE_FAMILIES
from etblocks.swap.recipes import Recipe, resolve_recipe
from etblocks.swap.registry import ATTENTION, MODULES, SwapContext

DEFAULT_MAX_SEQ_LEN = 2048
PROBE_LEN = 16

register_families()


@dataclass(frozen=True)
class SwapInfo:
    """Recorded on a swapped model as `model.etblocks_swap`."""

    recipe: Recipe
    max_seq_len: int
    converted: tuple[str, ...]


def swap(
    model: nn.Module,
    backend: str = "xnnpack",
    *,
    max_seq_len: int | None = None,
    verify: bool = True,
    **recipe_overrides,
) -> nn.Module:
    """Replace every attention module of a transformers causal LM with an etblocks block, in place, and every
    module with a registered replacement (MoE blocks, DeepSeek-V2's complex rotary table).

    The backend's recipe (see `etblocks.swap.recipes`) picks attention, SDPA, cache, shapes and the MoE
    strategy; keyword arguments override single choices (`sdpa="dynamic"`, `shapes="static", chunk=32`,
    `moe="dense"`). NPU backends (qnn, coreml, openvino, vulkan) get the static contract: fixed-shape `prefill`
    and `decode` with caller-owned caches. Every module is converted and, unless `verify=False`, compared with
    its original on a probe input before anything is changed: on any failure the model is left untouched and
    `UnsupportedModelError` (or `ConfigError` for options) says which module and why.
    """
    recipe = resolve_recipe(backend, **recipe_overrides)
    if getattr(model, "etblocks_swap", None) is not None:
        raise ConfigError(f"this model is already swapped (backend={model.etblocks_swap.recipe.backend!r}); swap a fresh copy")
    if not hf.is_hf_causal_lm(model):
        raise UnsupportedModelError(
            f"swap() takes a transformers causal LM (PreTrainedModel); got {type(model).__name__}. "
            "Models built from etblocks blocks need no swap: pass them to etblocks.export directly."
        )
    max_seq_len = _check_max_seq_len(model, max_seq_len)
    if recipe.static and recipe.chunk > max_seq_len:
        raise ConfigError(f"chunk={recipe.chunk} is larger than the context max_seq_len={max_seq_len}; give chunk <= {max_seq_len}")
    ctx = SwapContext(recipe=recipe, max_seq_len=max_seq_len)

    targets = hf.attention_modules(model)
    if not targets:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no `self_attn` modules to swap; supported attention classes: {ATTENTION.supported()}"
        )
    replacements = [(name, _convert(name, module, ctx)) for name, module in targets]
    others = [(name, module, converter) for name, module in model.named_modules() if (converter := MODULES.lookup(module))]
    replacements += [(name, _call_converter(converter, name, module, ctx)) for name, module, converter in others]
    _check_experts(model, [name for name, _ in replacements])
    if verify:
        checked = targets + [(name, module) for name, module, _ in others if MODULES.same_output(module)]
        by_name = dict(replacements)
        _verify(model, [(name, original, by_name[name]) for name, original in checked], max_seq_len)
    _commit(model, replacements, recipe)
    model.etblocks_swap = SwapInfo(recipe, max_seq_len, tuple(name for name, _ in targets))
    return model


def set_max_seq_len(model: nn.Module, max_seq_len: int) -> None:
    """Resize the KV caches of a swapped model, or of one built from blocks, for a new context length (their
    contents are dropped). `ConfigError` past the model's positions."""
    max_seq_len = _check_max_seq_len(model, max_seq_len)
    info = getattr(model, "etblocks_swap", None)
    if info is not None:
        if max_seq_len > info.max_seq_len:
            # A sliding window no shorter than the swap's context became a full cache; a longer context would
            # need the window back. Growing is a new swap.
            raise ConfigError(
                f"max_seq_len={max_seq_len} is longer than the {info.max_seq_len} this model was swapped for; "
                f"accepted: 2..{info.max_seq_len}, or swap a fresh copy with max_seq_len={max_seq_len}"
            )
        if info.recipe.static and info.recipe.chunk > max_seq_len:
            raise ConfigError(
                f"max_seq_len={max_seq_len} is shorter than this static swap's chunk={info.recipe.chunk}; "
                f"accepted: {info.recipe.chunk}..{info.max_seq_len}"
            )
        model.etblocks_swap = SwapInfo(info.recipe, max_seq_len, info.converted)
    for cache in find_caches(model):
        cache.resize(max_seq_len)


def _check_max_seq_len(model: nn.Module, max_seq_len: int | None) -> int:
    limit = hf.max_positions(model) if hf.is_hf_causal_lm(model) else None
    if max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, limit or DEFAULT_MAX_SEQ_LEN)
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ConfigError(f"max_seq_len={max_seq_len!r} is not accepted; give an integer >= 2")
    if limit is not None and max_seq_len > limit:
        raise ConfigError(
            f"max_seq_len={max_seq_len} is beyond the model's positions (config.max_position_embeddings={limit}); "
            f"accepted: 2..{limit}"
        )
    return max_seq_len


def _convert(name: str, module: nn.Module, ctx: SwapContext) -> nn.Module:
    converter = ATTENTION.lookup(module)
    if converter is None:
        layout = infer_layout(module)
        if layout is None:
            raise UnsupportedModelError(
                f"{name} is a {type(module).__name__}, which has no etblocks converter and does not follow the "
                f"common HF attention layout (q/k/v/o Linear projections, head_dim, scaling); "
                f"supported attention classes: {ATTENTION.supported()}. Register one with @etblocks.register."
            )
        return build_attention(module, layout, ctx)
    return _call_converter(converter, name, module, ctx)


def _call_converter(converter, name: str, module: nn.Module, ctx: SwapContext) -> nn.Module:
    try:
        return converter(module, ctx)
    except (AttributeError, ValueError, TypeError) as exc:
        raise UnsupportedModelError(f"converting {name} ({type(module).__name__}) failed: {exc}") from exc


def _check_experts(model: nn.Module, replaced: list[str]) -> None:
    """MoE experts left upstream must export through transformers' own kernel, or the export fails much later."""
    left = hf.unexportable_experts(model, replaced)
    if left:
        name, module, implementation = left[0]
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) is a transformers MoE experts module with no etblocks converter, and "
            f"experts_implementation={implementation!r} does not export. MoE blocks etblocks converts: "
            f"{sorted(block for block, _ in MOE_FAMILIES.values())}; register a converter for its block with "
            f"etblocks.swap.registry.MODULES.register, or call model.set_experts_implementation("
            f"{hf.EXPORTABLE_EXPERTS[0]!r}) to export transformers' own kernel (a per-token gather of the top-k "
            "experts, with the upstream router)."
        )


def _verify(model: nn.Module, pairs: list[tuple[str, nn.Module, nn.Module]], max_seq_len: int) -> None:
    """Each replacement must reproduce its original's output on the inputs the original saw in a probe run."""
    windows = [w for _, _, new in pairs if (w := block_sliding_window(new))]
    probe_len = min(max([PROBE_LEN] + [w + 4 for w in windows]), max_seq_len)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, probe_len), generator=generator)
    was_training = model.training
    model.eval()
    try:
        calls = hf.capture_calls(model, [original for _, original, _ in pairs], tokens)
    finally:
        model.train(was_training)
    with torch.no_grad():
        for name, original, new in pairs:
            if id(original) not in calls:
                raise UnsupportedModelError(f"{name} ({type(original).__name__}) was not called in a forward pass")
            args, kwargs, expected = calls[id(original)]
            try:
                _bind_empty_io_cache(new, kwargs.get("position_ids"))
                actual = new(*args, **kwargs)
                actual = actual[0] if isinstance(actual, tuple) else actual
            except Exception as exc:  # any failure of the replacement on real inputs means "cannot swap"
                raise UnsupportedModelError(
                    f"{name} ({type(original).__name__}): the etblocks block failed on the probe input: {exc}"
                ) from exc
            finally:
                reset_caches(new)
                if isinstance(getattr(new, "kv_cache", None), IOKVCache):
                    new.kv_cache.unbind()
            error = (actual - expected).abs().max().item()
            tolerance = 1e-4 * max(1.0, expected.abs().max().item())
            if not error <= tolerance:
                raise UnsupportedModelError(
                    f"{name} ({type(original).__name__}) does not match its etblocks replacement on a probe of "
                    f"{probe_len} tokens: max abs error {error:.3g} > tolerance {tolerance:.3g}. "
                    "Register a converter for this class (etblocks.register) or pass verify=False at your own risk."
                )


def _bind_empty_io_cache(block: nn.Module, position_ids: torch.Tensor | None) -> None:
    """A block with a caller-owned cache is probed as a static program's first chunk: empty caches, causal mask."""
    cache = getattr(block, "kv_cache", None)
    if not isinstance(cache, IOKVCache) or position_ids is None:
        return
    positions = position_ids[0]
    dtype = next(block.parameters()).dtype
    k_empty = torch.zeros(1, 0, cache.n_kv_heads, cache.head_dim, dtype=dtype)
    v_empty = torch.zeros(1, 0, cache.n_kv_heads, cache.v_head_dim, dtype=dtype)
    mask = additive_mask(allowed_keys(positions, positions, block_sliding_window(block)))
    cache.bind(k_empty, v_empty, mask)


def _commit(model: nn.Module, replacements, recipe: Recipe) -> None:
    for name, new in replacements:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    hf.skip_hf_masks(model)
    model.eval()
    if recipe.dtype != next(model.parameters()).dtype:
        model.to(recipe.dtype)
