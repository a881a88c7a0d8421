"""`swap()`: replace a model's attention (and MoE blocks) with etblocks blocks, in place, after checking every
replacement."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from torch import nn

from etblocks.adapters.load import attach_adapter
from etblocks.backends import INT64_TENSORS, backends, get_backend
from etblocks.errors import ConfigError, UnsupportedModelError
from etblocks.state.base import find_states
from etblocks.swap.hf.convert import attention_from_layout
from etblocks.swap.hf.fallback import infer_layouts
from etblocks.swap.hf.hybrid import is_state_layer, state_layout
from etblocks.swap.hf.model import TransformersKind
from etblocks.swap.hf.moe import int64_index_users
from etblocks.swap.kinds import ModelKind
from etblocks.swap.probe import Probe, probe_length
from etblocks.swap.recipes import Recipe, resolve_recipe
from etblocks.swap.registry import MIXERS, MODULES, SwapContext
from etblocks.swap.torchtune.model import TorchtuneKind

DEFAULT_MAX_SEQ_LEN = 2048

# The adapter a torchtune LoRA model carries in its own modules is loaded back under this name.
EMBEDDED_ADAPTER = "default"

KINDS: tuple[ModelKind, ...] = (TransformersKind(), TorchtuneKind())


@dataclass(frozen=True)
class SwapInfo:
    """Recorded on a swapped model as `model.etblocks_swap`."""

    recipe: Recipe
    max_seq_len: int
    converted: tuple[str, ...]
    kind: ModelKind


def swap(
    model: nn.Module,
    backend: str = "xnnpack",
    *,
    max_seq_len: int | None = None,
    verify: bool = True,
    **recipe_overrides,
) -> nn.Module:
    """Replace every token mixer (attention) of a transformers causal LM or a torchtune `TransformerDecoder` with an
    etblocks block, in place, and every module with a registered replacement (MoE blocks, DeepSeek-V2's complex
    rotary table).

    The backend's recipe (see `etblocks.swap.recipes`) picks attention, SDPA, cache, shapes and the MoE
    strategy; keyword arguments override single choices (`sdpa="dynamic"`, `shapes="static", chunk=32`,
    `moe="dense"`). NPU backends (qnn, coreml, openvino, vulkan) get the static contract: fixed-shape `prefill`
    and `decode` with caller-owned caches. Every module is converted and, unless `verify=False`, compared with
    its original on a probe input before anything is changed: on any failure the model is left untouched and
    `UnsupportedModelError` (or `ConfigError` for options) says which module and why.

    A torchtune LoRA model's `LoRALinear` layers become their base `nn.Linear`, and their LoRA weights an
    etblocks adapter named `"default"` (active; see `etblocks.set_adapter`), which `export` keeps in its own file.
    """
    recipe = resolve_recipe(backend, **recipe_overrides)
    if getattr(model, "etblocks_swap", None) is not None:
        raise ConfigError(f"this model is already swapped (backend={model.etblocks_swap.recipe.backend!r}); swap a fresh copy")
    kind = model_kind(model)
    if kind is None:
        raise UnsupportedModelError(
            f"swap() takes a {' or a '.join(k.name for k in KINDS)}; got {type(model).__name__}. "
            "Models built from etblocks blocks need no swap: pass them to etblocks.export directly."
        )
    kind.prepare()
    max_seq_len = _check_max_seq_len(model, max_seq_len)
    if recipe.static and recipe.chunk > max_seq_len:
        raise ConfigError(f"chunk={recipe.chunk} is larger than the context max_seq_len={max_seq_len}; give chunk <= {max_seq_len}")
    ctx = SwapContext(recipe=recipe, max_seq_len=max_seq_len)

    targets = kind.mixer_modules(model)
    if not targets:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no attention modules to swap; supported attention classes: {MIXERS.supported()}"
        )
    adapter = kind.adapter_layers(model)
    options = [(name, module, _conversions_or_refusal(name, module)) for name, module in targets]
    others = []  # outer modules first: what a converted module holds is its converter's
    for name, module in model.named_modules():
        if not _inside(name, targets + [(outer, m) for outer, m, _ in others]):
            if converter := MODULES.lookup(module) or kind.module_layout(module):
                others.append((name, module, converter))
    options += [(name, module, [_named(converter, name)]) for name, module, converter in others]
    kind.check(model, [name for name, _, _ in options])
    # The probe checks the conversion, exactly, at the model's own precision; what int8 or fp16 state costs is
    # measured apart (tests, benchmarks). Blocks built for another recipe are built again for the real one.
    own_dtype = next(model.parameters()).dtype
    probe_ctx = dataclasses.replace(ctx, recipe=dataclasses.replace(recipe, kv_quantize=None, dtype=own_dtype))
    probed = {name for name, module, makers in options if len(makers) > 1 or (verify and MODULES.same_output(module))}
    mixers = [module for _, module in targets] if verify else None
    chosen = _choose(model, kind, [o for o in options if o[0] in probed], probe_ctx, max_seq_len, mixers) if probed else {}
    replacements = []
    for name, module, makers in options:
        if name in chosen and chosen[name] is None:
            continue  # never called by a text forward (a vision tower, cross-attention): left as it is
        index, block = chosen.get(name, (0, None))
        replacements.append((name, block if block is not None and probe_ctx == ctx else makers[index](module, ctx)))
    targets = [(name, module) for name, module in targets if chosen.get(name, True) is not None]
    if not targets:
        raise UnsupportedModelError(f"none of the token mixers of this {type(model).__name__} runs in a text forward pass")
    _refuse_int64_index(model, replacements, recipe)
    _commit(model, replacements, recipe)
    kind.finish(model)
    if adapter:
        attach_adapter(model, adapter, EMBEDDED_ADAPTER, source=f"the LoRA layers of this {type(model).__name__}")
    model.etblocks_swap = SwapInfo(recipe, max_seq_len, tuple(name for name, _ in targets), kind)
    return model


def model_kind(model: nn.Module) -> ModelKind | None:
    """The kind of upstream model `model` is, or None (a model built from etblocks blocks, or one unknown)."""
    return next((kind for kind in KINDS if kind.matches(model)), None)


def set_max_seq_len(model: nn.Module, max_seq_len: int) -> None:
    """Resize the state of a swapped model, or of one built from blocks, for a new context length (its contents
    are dropped). `ConfigError` past the model's positions."""
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
        model.etblocks_swap = dataclasses.replace(info, max_seq_len=max_seq_len)
    for state in find_states(model):
        state.resize(max_seq_len)


def _check_max_seq_len(model: nn.Module, max_seq_len: int | None) -> int:
    kind = model_kind(model)
    limit = kind.max_positions(model) if kind is not None else None
    if max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, limit or DEFAULT_MAX_SEQ_LEN)
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ConfigError(f"max_seq_len={max_seq_len!r} is not accepted; give an integer >= 2")
    if limit is not None and max_seq_len > limit:
        raise ConfigError(
            f"max_seq_len={max_seq_len} is beyond the model's positions ({kind.positions_name}={limit}); "
            f"accepted: 2..{limit}"
        )
    return max_seq_len


Maker = Callable[[nn.Module, SwapContext], nn.Module]


def _conversions_or_refusal(name: str, module: nn.Module) -> list[Maker]:
    """`_conversions`, or one maker raising its refusal: a module the model never calls needs no conversion."""
    try:
        return _conversions(name, module)
    except UnsupportedModelError as exc:
        refusal = exc

        def refuse(module: nn.Module, ctx: SwapContext) -> nn.Module:
            raise refusal

        refuse.if_called = True
        return [refuse]


def _conversions(name: str, module: nn.Module) -> list[Maker]:
    """The ways to convert a token mixer, in order of preference: its registered converter, the converter of a
    state layer laid out as one etblocks converts, or every variant of the common attention layout it may be."""
    converter = MIXERS.lookup(module)
    if converter is None and is_state_layer(module):
        converter = state_layout(module)
        if converter is None:
            raise UnsupportedModelError(
                f"{name} is a {type(module).__name__}, a layer keeping recurrent or convolution state, with no etblocks "
                f"converter and not laid out as one etblocks converts (LFM2's short convolution, Qwen3.5's gated "
                f"DeltaNet, Mamba2's mixer); supported: {MIXERS.supported()}. Register one with @etblocks.register."
            )
    if converter is not None:
        return [_named(converter, name)]
    layouts = infer_layouts(module)
    if not layouts:
        raise UnsupportedModelError(
            f"{name} is a {type(module).__name__}, which has no etblocks converter and does not follow the "
            f"common HF attention layout (q/k/v/o Linear projections, head_dim, scaling); "
            f"supported attention classes: {MIXERS.supported()}. Register one with @etblocks.register."
        )
    return [_named(functools.partial(_from_layout, layout=layout), name) for layout in layouts]


def _from_layout(module: nn.Module, ctx: SwapContext, layout) -> nn.Module:
    return attention_from_layout(module, layout, ctx)


def _named(converter: Maker, name: str) -> Maker:
    """`converter`, with the failures a converter raises on a module it cannot take turned into a refusal naming it."""

    def convert(module: nn.Module, ctx: SwapContext) -> nn.Module:
        try:
            return converter(module, ctx)
        except (AttributeError, ValueError, TypeError) as exc:
            raise UnsupportedModelError(f"converting {name} ({type(module).__name__}) failed: {exc}") from exc

    return convert


def _choose(
    model: nn.Module, kind: ModelKind, options, ctx: SwapContext, max_seq_len: int, mixers: list[nn.Module] | None
) -> dict[str, tuple[int, nn.Module] | None]:
    """Probe the options and keep, per module, the first conversion that reproduces the original (prefill and
    decode): `name -> (index, block)`, or None for a module the model never called (left upstream). Later
    conversions are built only when the earlier ones fail, so a module's candidates never hold their state at
    once. `UnsupportedModelError` naming the module when none matches, or, given the `mixers`, when the model does
    not place tokens by the positions it is called with."""
    first = [(name, module, makers, _try_make(makers[0], module, ctx)) for name, module, makers in options]
    for name, module, makers, (block, failure) in first:
        if block is None and len(makers) == 1 and not getattr(makers[0], "if_called", False):
            raise UnsupportedModelError(failure)  # a converter that cannot take the module: before running anything
    length = probe_length([block for *_, (block, _) in first if block is not None], max_seq_len)
    with kind.base_only(model):
        probe = Probe(model, kind, [module for _, module, _, _ in first], length)
        first_called = next((m for m in mixers or [] if id(m) in probe.calls), None)
        if first_called is not None and (reason := probe.position_mismatch(first_called)):
            raise UnsupportedModelError(reason)
    chosen, publishers = {}, {}  # publishers: id of a KVShare -> (upstream module, the block publishing into it)
    for name, module, makers, (block, failure) in first:
        if id(module) not in probe.calls:
            chosen[name] = None
            continue
        mismatches, failures = [], [failure] if failure else []
        for index, make in enumerate(makers):
            if index > 0:
                block, failure = _try_make(make, module, ctx)
                failures += [failure] if failure else []
            reason = None if block is None else probe.mismatch(name, module, block, _sources(block, publishers, name))
            if block is not None and reason is None:
                chosen[name] = (index, block)
                if getattr(block, "kv_share", None) is not None:
                    publishers[id(block.kv_share)] = (module, block)
                break
            mismatches += [reason] if reason is not None else []
        else:
            if not mismatches:
                raise UnsupportedModelError(failures[0])
            tried = f" (the first of {len(makers)} layouts tried)" if len(makers) > 1 else ""
            raise UnsupportedModelError(
                f"{mismatches[0]}{tried}. Register a converter for this class (etblocks.register) or pass "
                "verify=False at your own risk."
            )
    return chosen


def _sources(block: nn.Module, publishers: dict, name: str) -> list[tuple[nn.Module, nn.Module]]:
    """The `(upstream module, block)` whose keys and values `block` reads (a `KVSharedAttention`), for the probe."""
    reads = getattr(block, "reads", None)
    if reads is None:
        return []
    if id(reads) not in publishers:
        raise UnsupportedModelError(f"{name} reads the keys and values of a layer that was not converted before it")
    return [publishers[id(reads)]]


def _try_make(make: Maker, module: nn.Module, ctx: SwapContext) -> tuple[nn.Module | None, str | None]:
    """A conversion, or why it failed (a layout the block cannot take, or a refusal `_choose` raises if the model
    calls the module)."""
    try:
        return make(module, ctx), None
    except UnsupportedModelError as exc:
        return None, str(exc)


def _inside(name: str, targets: list[tuple[str, nn.Module]]) -> bool:
    """Whether module `name` lies inside an attention module (its converter owns it)."""
    return any(name.startswith(outer + ".") for outer, _ in targets)


def _refuse_int64_index(model: nn.Module, replacements: list[tuple[str, nn.Module]], recipe: Recipe) -> None:
    """`UnsupportedModelError` if the programs would hold an MoE top-k index (int64) and the backend holds none."""
    backend = get_backend(recipe.backend)
    users = int64_index_users(replacements) if INT64_TENSORS in backend.limits else []
    if users:
        name, why, remedy = users[0]
        takers = sorted(b.name for b in backends() if INT64_TENSORS not in b.limits)
        raise UnsupportedModelError(
            f"{name} ({type(model.get_submodule(name)).__name__}): {why}, an int64 tensor, and backend="
            f"{recipe.backend!r} cannot take it: {backend.limits[INT64_TENSORS]}. {remedy[0].upper()}{remedy[1:]}, "
            f"or swap for one of {takers}"
        )


def _commit(model: nn.Module, replacements, recipe: Recipe) -> None:
    for name, new in replacements:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    model.eval()
    if recipe.dtype != next(model.parameters()).dtype:
        model.to(recipe.dtype)
