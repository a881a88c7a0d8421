"""Method contracts: what an exported program's methods take and return, and the metadata describing them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from etblocks.backends import backends
from etblocks.errors import ConfigError
from etblocks.export.adapters import SlotInputs, adapter_table, lora_layers, shared_inputs
from etblocks.export.contract import CONTRACT_METHOD, MaskGroup, StateInput, StaticContract
from etblocks.export.wrappers import DecoderProgram, StateInputsProgram, VerifyProgram
from etblocks.moe import GatherExperts
from etblocks.state.base import State, find_states
from etblocks.state.ring import RingKVCache
from etblocks.state.spec import RING, ROWS
from etblocks.swap.api import model_kind, set_max_seq_len
from etblocks.swap.recipes import Recipe

# What masked entries of a quantized program's masks hold: -inf has no quantized form (Qualcomm's examples use
# the same value); float programs use -inf.
QUANTIZED_MASK_VALUE = -255.0


@dataclass(frozen=True)
class DynamicProgram:
    """`forward(tokens int64 [1, T], input_pos int64 [1]) -> logits [1, V]` with 1 <= T <= max_call_len, over a
    context of max_seq_len positions (ExecuTorch's `get_max_seq_len` / `get_max_context_len`; runners feed longer
    prompts in calls of at most max_call_len tokens).

    `metadata` becomes the constant methods ExecuTorch's LLM runner reads.
    """

    module: nn.Module
    max_seq_len: int
    metadata: dict
    max_call_len: int

    def example_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long)

    def dynamic_shapes(self):
        return ({1: torch.export.Dim("seq_len", min=1, max=self.max_call_len)}, None)


def dynamic_program(
    model: nn.Module,
    max_seq_len: int | None = None,
    bos_id: int | None = None,
    eos_ids: list[int] | None = None,
    vocab_size: int | None = None,
) -> DynamicProgram:
    """Wrap a swapped upstream model (transformers, torchtune), or take a model built from etblocks blocks as it
    is. `max_seq_len` (default: the longest state's rows) resizes the state.

    A call takes up to the whole context, except in a model with `GatherExperts`: each call gathers
    `[T * k, I, D]` expert weights and the memory plan is sized for the longest call, so calls are capped at
    the swap's `chunk` (32 unless `swap(..., chunk=N)` says otherwise).
    """
    kind = model_kind(model)
    if kind is not None:
        _swap_info(model)
    states = find_states(model)
    if not states:
        raise ConfigError(f"{type(model).__name__} holds no etblocks state (a KV cache or another State); build it from etblocks blocks")
    if max_seq_len is not None:
        set_max_seq_len(model, max_seq_len)
    if kind is not None:
        max_seq_len = model.etblocks_swap.max_seq_len  # not from the caches: ring caches hold only a window
        tokens = kind.token_metadata(model)
        module = DecoderProgram(model, kind)
    else:
        max_seq_len = max_seq_len or max((spec.rows for s in states for spec in s.specs() if spec.positional), default=None)
        if max_seq_len is None:
            raise ConfigError("max_seq_len=None: give max_seq_len= for a model without K/V caches (nothing else says its context)")
        tokens = {"vocab_size": vocab_size, "bos_id": None, "eos_ids": [], "n_layers": len(states)}
        module = model
    _override_tokens(tokens, bos_id, eos_ids)
    if tokens["vocab_size"] is None:
        raise ConfigError("vocab_size=None: give vocab_size= for a model built from etblocks blocks")
    call_len = max_seq_len
    if any(isinstance(m, GatherExperts) for m in model.modules()):
        call_len = min(model.etblocks_swap.recipe.chunk if kind is not None else Recipe.chunk, max_seq_len)
    return DynamicProgram(module, max_seq_len, _llm_runner_metadata(max_seq_len, tokens, call_len=call_len), call_len)


def check_verifiable(model: nn.Module, max_draft: int) -> None:
    """`ConfigError` unless `verify_program(model, max_draft)` can be exported and rolled back: a model swapped for
    dynamic shapes whose state is K/V rows, one per position (a runner drops rejected tokens by moving its position
    back; the rows they wrote are never read), or K/V rings (which get `max_draft` spare slots). Convolution and
    recurrent state would have taken the rejected tokens in."""
    info = getattr(model, "etblocks_swap", None)
    if info is None:
        raise ConfigError(f"max_draft={max_draft} needs a model swapped by etblocks.swap (its logits of every token)")
    if info.recipe.static:
        raise ConfigError(
            f"max_draft={max_draft} is for dynamic programs; a static program with cache='io' checks proposed tokens "
            "with its prefill (up to chunk - 1 of them) and needs no verify method"
        )
    for name, module in model.named_modules():
        if isinstance(module, State):
            kinds = sorted({spec.update for spec in module.specs()} - {ROWS, RING})
            if kinds:
                raise ConfigError(
                    f"max_draft={max_draft}: {name} ({type(module).__name__}) keeps {'/'.join(kinds)} state, which a "
                    "rejected proposal would leave changed in a dynamic program; export the static program "
                    "(etblocks.swap(..., shapes='static', cache='io')), whose runner keeps only the accepted tokens' state"
                )


def verify_program(model: nn.Module, max_draft: int) -> DynamicProgram:
    """The `verify` method of a dynamic program: `VerifyProgram` for 1 .. `max_draft` + 1 tokens per call. Gives
    every ring cache `max_draft` spare slots (`RingKVCache.reserve`): call it before exporting `forward`, whose
    buffers the method shares."""
    check_verifiable(model, max_draft)
    for module in model.modules():
        if isinstance(module, RingKVCache):
            module.reserve(max_draft)
    info = model.etblocks_swap
    call_len = min(max_draft + 1, info.max_seq_len)
    return DynamicProgram(VerifyProgram(model, info.kind), info.max_seq_len, {}, call_len)


@dataclass(frozen=True)
class StaticProgram:
    """Methods `prefill` (T = chunk) and `decode` (T = 1) of one module with fixed shapes; see
    `etblocks.export.contract` for their inputs and outputs."""

    module: nn.Module
    contract: StaticContract
    metadata: dict

    def example_inputs(self, method: str) -> tuple[torch.Tensor, ...]:
        contract = self.contract
        width = contract.methods[method]
        tokens = torch.zeros(1, width, dtype=torch.long)
        slots = contract.adapter_table.inputs(None)
        if contract.cache == "inplace":
            return tokens, torch.zeros(1, dtype=torch.long), *slots
        dtype = contract.torch_dtype
        masks = [torch.zeros(width, group.length + width, dtype=dtype) for group in contract.masks]
        state = [entry.spec.zeros() for entry in contract.states]
        return (tokens, torch.arange(width).unsqueeze(0), *masks, *state, *slots)


def static_program(
    model: nn.Module,
    max_seq_len: int | None = None,
    bos_id: int | None = None,
    eos_ids: list[int] | None = None,
    quantized: bool = False,
) -> StaticProgram:
    """The static program of a model swapped with `shapes="static"`; `max_seq_len` (default: the swap's) is
    the context its caches hold."""
    info = _swap_info(model)
    if not info.recipe.static:
        static = sorted(b.name for b in backends() if not b.dynamic_shapes)
        raise ConfigError(
            f"this model was swapped for dynamic shapes (backend={info.recipe.backend!r}); the static program needs "
            f"etblocks.swap(model, backend=..., shapes='static') or a backend with static programs ({', '.join(static)})"
        )
    if max_seq_len is not None:
        set_max_seq_len(model, max_seq_len)
    max_seq_len, chunk = model.etblocks_swap.max_seq_len, info.recipe.chunk
    tokens = info.kind.token_metadata(model)
    dtype = str(info.recipe.dtype).removeprefix("torch.")
    common = dict(chunk=chunk, max_context_len=max_seq_len, vocab_size=tokens["vocab_size"], dtype=dtype)
    if not info.recipe.caller_owned:
        contract = StaticContract(cache="inplace", mask_value=float("-inf"), **common)
        module = DecoderProgram(model, info.kind)
    else:
        states = [(name, m) for name, m in model.named_modules() if isinstance(m, State) and m.caller_owned]
        masks, entries, mask_of_state = state_inputs(states)
        mask_value = QUANTIZED_MASK_VALUE if quantized else float("-inf")
        contract = StaticContract(cache="io", mask_value=mask_value, masks=masks, states=entries, **common)
        names = [g.name for g in masks]
        module = StateInputsProgram(
            model, info.kind, [m for _, m in states], [None if g is None else names.index(g) for g in mask_of_state]
        )
    if lora_layers(model):
        module = SlotInputs(module, len(contract.inputs()), adapter_table(model, info.recipe.dtype))
        alone = StaticProgram(module, replace(contract, adapters=module.table.slots), {})
        groups = shared_inputs(model, lambda: module(*alone.example_inputs("decode")))
        module.table = adapter_table(model, info.recipe.dtype, groups)
        contract = replace(contract, adapters=module.table.slots)
    _override_tokens(tokens, bos_id, eos_ids)
    metadata = _llm_runner_metadata(max_seq_len, tokens, dynamic=False)
    metadata[CONTRACT_METHOD] = contract.as_constant()
    return StaticProgram(module, contract, metadata)


def state_inputs(
    states: list[tuple[str, State]]
) -> tuple[tuple[MaskGroup, ...], tuple[StateInput, ...], list[str | None]]:
    """The mask groups, the contract entry of every declared tensor, and the mask group each state is read under,
    all from the states' declarations: a positional state is read under the mask of its rows (full attention over
    the context, or a sliding window that its ring holds)."""
    groups: dict[str, MaskGroup] = {}
    entries, mask_of_state = [], []
    for index, (owner, state) in enumerate(states):
        specs = state.specs()
        positional = next((spec for spec in specs if spec.positional), None)
        group = None
        if positional is not None:
            window = positional.rows if positional.update == RING else None
            group = "full" if window is None else f"window{window}"
            groups.setdefault(group, MaskGroup(group, positional.rows, window))
        entries += [StateInput.declared(index, owner, spec, group if spec.positional else None) for spec in specs]
        mask_of_state.append(group)
    return tuple(groups.values()), tuple(entries), mask_of_state


def _override_tokens(tokens: dict, bos_id: int | None, eos_ids: list[int] | None) -> None:
    if bos_id is not None:
        tokens["bos_id"] = bos_id
    if eos_ids is not None:
        tokens["eos_ids"] = list(eos_ids)


def _swap_info(model: nn.Module):
    info = getattr(model, "etblocks_swap", None)
    if info is None:
        raise ConfigError(f"{type(model).__name__} has not been swapped; call etblocks.swap(model, backend=...) before export")
    return info


def _llm_runner_metadata(max_seq_len: int, tokens: dict, dynamic: bool = True, call_len: int | None = None) -> dict:
    metadata = {
        "get_max_seq_len": call_len or max_seq_len,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": tokens["vocab_size"],
        "get_n_layers": tokens["n_layers"],
        "use_kv_cache": True,
        "enable_dynamic_shape": dynamic,
        "use_sdpa_with_kv_cache": False,
    }
    if tokens["eos_ids"]:
        metadata["get_eos_ids"] = tokens["eos_ids"]
    if tokens["bos_id"] is not None:
        metadata["get_bos_id"] = tokens["bos_id"]
    return metadata
