"""`swap()`: replace a model's attention (and MoE blocks) with etblocks blocks, in place, after checking every
replacement."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from etblocks.adapters.load import attach_adapter
from etblocks.attention.masks import additive_mask, allowed_keys
from etblocks.errors import ConfigError, UnsupportedModelError
from etblocks.state.base import State, find_states, reset_states
from etblocks.state.spec import RING
from etblocks.swap.hf.convert import attention_from_layout
from etblocks.swap.hf.fallback import infer_layout
from etblocks.swap.hf.hybrid import is_state_layer, state_layout
from etblocks.swap.hf.model import TransformersKind
from etblocks.swap.kinds import ModelKind
from etblocks.swap.recipes import Recipe, resolve_recipe
from etblocks.swap.registry import MIXERS, MODULES, SwapContext
from etblocks.swap.torchtune.model import TorchtuneKind

DEFAULT_MAX_SEQ_LEN = 2048
PROBE_LEN = 16

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
    replacements = [(name, _convert(name, module, ctx)) for name, module in targets]
    others = [
        (name, module, converter)
        for name, module in model.named_modules()
        if (converter := MODULES.lookup(module)) and not _inside(name, targets)
    ]
    replacements += [(name, _call_converter(converter, name, module, ctx)) for name, module, converter in others]
    kind.check(model, [name for name, _ in replacements])
    if verify:
        checked = targets + [(name, module) for name, module, _ in others if MODULES.same_output(module)]
        by_name = dict(replacements)
        if recipe.kv_quantize is not None:
            # The probe checks the conversion, exactly; what int8 caches cost is measured apart (tests, benchmarks).
            float_ctx = dataclasses.replace(ctx, recipe=dataclasses.replace(recipe, kv_quantize=None))
            by_name.update((name, _convert(name, module, float_ctx)) for name, module in targets)
        with kind.base_only(model):
            _verify(model, kind, [(name, original, by_name[name]) for name, original in checked], max_seq_len)
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


def _convert(name: str, module: nn.Module, ctx: SwapContext) -> nn.Module:
    converter = MIXERS.lookup(module)
    if converter is None and is_state_layer(module):
        converter = state_layout(module)
        if converter is None:
            raise UnsupportedModelError(
                f"{name} is a {type(module).__name__}, a layer keeping recurrent or convolution state, with no etblocks "
                f"converter and not laid out as one etblocks converts (LFM2's short convolution, Qwen3.5's gated "
                f"DeltaNet); supported: {MIXERS.supported()}. Register one with @etblocks.register."
            )
    if converter is None:
        layout = infer_layout(module)
        if layout is None:
            raise UnsupportedModelError(
                f"{name} is a {type(module).__name__}, which has no etblocks converter and does not follow the "
                f"common HF attention layout (q/k/v/o Linear projections, head_dim, scaling); "
                f"supported attention classes: {MIXERS.supported()}. Register one with @etblocks.register."
            )
        return attention_from_layout(module, layout, ctx)
    return _call_converter(converter, name, module, ctx)


def _call_converter(converter, name: str, module: nn.Module, ctx: SwapContext) -> nn.Module:
    try:
        return converter(module, ctx)
    except (AttributeError, ValueError, TypeError) as exc:
        raise UnsupportedModelError(f"converting {name} ({type(module).__name__}) failed: {exc}") from exc


def _inside(name: str, targets: list[tuple[str, nn.Module]]) -> bool:
    """Whether module `name` lies inside an attention module (its converter owns it)."""
    return any(name.startswith(outer + ".") for outer, _ in targets)


def _verify(model: nn.Module, kind: ModelKind, pairs: list[tuple[str, nn.Module, nn.Module]], max_seq_len: int) -> None:
    """Each replacement must reproduce its original's output on the inputs the original saw in a probe run."""
    windows = [spec.rows for _, _, new in pairs for state in find_states(new) for spec in state.specs() if spec.update == RING]
    probe_len = min(max([PROBE_LEN] + [w + 4 for w in windows]), max_seq_len)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, kind.vocab_size(model), (1, probe_len), generator=generator)
    positions = torch.arange(probe_len)
    calls = _capture_calls(model, kind, [original for _, original, _ in pairs], tokens, positions)
    with torch.no_grad():
        for name, original, new in pairs:
            if id(original) not in calls:
                raise UnsupportedModelError(f"{name} ({type(original).__name__}) was not called in a forward pass")
            args, kwargs, expected = calls[id(original)]
            if getattr(new, "positions_from_layer", False):  # upstream hands it none; its decoder layer does
                kwargs = {**kwargs, "position_ids": positions[None]}
            states = find_states(new)
            try:
                for state in states:
                    _bind_first_call(state, positions)
                actual = new(*args, **kwargs)
                actual = actual[0] if isinstance(actual, tuple) else actual
            except Exception as exc:  # any failure of the replacement on real inputs means "cannot swap"
                raise UnsupportedModelError(
                    f"{name} ({type(original).__name__}): the etblocks block failed on the probe input: {exc}"
                ) from exc
            finally:
                reset_states(new)
                for state in states:
                    state.unbind()
            error = (actual - expected).abs().max().item()
            tolerance = 1e-4 * max(1.0, expected.abs().max().item())
            if not error <= tolerance:
                raise UnsupportedModelError(
                    f"{name} ({type(original).__name__}) does not match its etblocks replacement on a probe of "
                    f"{probe_len} tokens: max abs error {error:.3g} > tolerance {tolerance:.3g}. "
                    "Register a converter for this class (etblocks.register) or pass verify=False at your own risk."
                )


@torch.no_grad()
def _capture_calls(
    model: nn.Module, kind: ModelKind, modules: list[nn.Module], tokens: torch.Tensor, positions: torch.Tensor
) -> dict[int, tuple]:
    """Run the untouched model once over `tokens` at `positions` and record `(args, kwargs, output)` of each
    listed module, keyed by id."""
    calls: dict[int, tuple] = {}

    def record(module, args, kwargs, output):
        calls[id(module)] = (args, kwargs, output[0] if isinstance(output, tuple) else output)

    hooks = [m.register_forward_hook(record, with_kwargs=True) for m in modules]
    was_training = model.training
    model.eval()
    try:
        kind.logits(model, tokens, positions.unsqueeze(0), last_only=True)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return calls


def _bind_first_call(state: State, positions: torch.Tensor) -> None:
    """Caller-owned state is probed as a static program's first call: no rows kept yet (zeros for state that
    is not positional), the causal mask over the call's own rows."""
    if not state.caller_owned:
        return
    specs = state.specs()
    tensors = [torch.zeros(s.update_shape(0), dtype=s.dtype) if s.positional else s.zeros() for s in specs]
    ring = next((s.rows for s in specs if s.update == RING), None)
    mask = additive_mask(allowed_keys(positions, positions, ring)) if any(s.positional for s in specs) else None
    state.bind(tensors, mask)


def _commit(model: nn.Module, replacements, recipe: Recipe) -> None:
    for name, new in replacements:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    model.eval()
    if recipe.dtype != next(model.parameters()).dtype:
        model.to(recipe.dtype)
