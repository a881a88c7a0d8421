"""`export()`: from a swapped model (or one built from blocks) to a .pte for one backend."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from etblocks.adapters import adapter_names
from etblocks.adapters.files import adapter_tensors, save_adapter_file
from etblocks.backends import Backend, Readiness, backends, get_backend
from etblocks.errors import ConfigError
from etblocks.export.adapters import (
    ADAPTER_PROGRAMS,
    ADAPTER_SLOTS,
    ADAPTERS_METHOD,
    SET_ADAPTER_METHOD,
    adapter_baked,
    adapter_file,
    adapter_program_file,
    adapter_slots,
    check_unmerged,
    keep_slots_on_cpu,
    lora_layers,
    set_adapter_program,
)
from etblocks.export.accuracy import ProgramAccuracy
from etblocks.export.accuracy_check import accuracy_text_ids, checked_accuracy
from etblocks.export.delegation import DelegationSummary, summarize
from etblocks.export.external import WEIGHTS_TAG, constant_tag, tagging_pass, weights_file, write_weights
from etblocks.export.hybrid import attention_on_cpu
from etblocks.export.programs import (
    DynamicProgram,
    StaticProgram,
    check_verifiable,
    dynamic_program,
    static_program,
    verify_program,
)
from etblocks.export.quantize import quantize_static
from etblocks.export.speculate import DRAFT_PREFIX, MAX_VERIFY_METHOD, VERIFY_METHOD
from etblocks.export.text import checkpoint_tokenizer, load_tokenizer, save_tokenizer
from etblocks.export.weights import (
    KEPT,
    QUANTIZATION_METHOD,
    WeightQuantization,
    quantization_constant,
    quantized_weights,
    weight_quantization,
)
from etblocks.export.wrappers import DraftProgram
from etblocks.ops import load_llama_custom_ops
from etblocks.options import DEFAULT_GROUP_SIZE, OPTIONS, check
from etblocks.program_files import write_whole
from etblocks.progress import Progress, reporting
from etblocks.state.base import reset_states
from etblocks.swap.recipes import Recipe, check_lowers

AUTO = "auto"


@dataclass
class ExportResult:
    """`delegations` holds one summary per method; `delegation` adds them up. `quantize` says what quantization was
    applied (None: none). `adapters` maps each adapter loaded into the model to its file, switched at run time by
    `Runner.set_adapter`: its tensors (`.ptd`) or, with `adapter_mode="programs"`, its program (`.pte`), which reads
    the base weights from `data_path` as the base program does (None: the weights are inside the program), its
    methods summarized in `adapter_delegations[name]`. `tokenizer`: the directory the tokenizer was saved to beside
    the program (None: none was given), and `tokenizer_source` where it came from. `quantized`: what each quantized
    module holds, by name (`"int4 groups, kept"`: a weight that was on int4 groups already, as a GGUF file's, and
    keeps its values)."""

    path: Path
    backend: str
    methods: list[str]
    metadata: dict
    delegations: dict[str, DelegationSummary]
    seconds: dict[str, float] = field(default_factory=dict)
    quantize: str | None = None
    adapters: dict[str, Path] = field(default_factory=dict)
    tokenizer: Path | None = None
    tokenizer_source: str | None = None
    data_path: Path | None = None
    adapter_delegations: dict[str, dict[str, DelegationSummary]] = field(default_factory=dict)
    quantized: dict[str, str] = field(default_factory=dict)
    accuracy: ProgramAccuracy | None = None  # with check_accuracy: the program against the unquantized model

    @property
    def delegation(self) -> DelegationSummary:
        return DelegationSummary.combine(self.delegations.values())

    @property
    def size_mb(self) -> float:
        return self.path.stat().st_size / 1e6


@dataclass(frozen=True)
class ExportPlan:
    """Everything an export does, checked before any work: the backend and its options, the context, the token
    metadata overrides, and the two kinds of quantization (torchao `weights`; calibrated `activations`, resolved
    against the swap's recipe)."""

    backend: Backend
    backend_options: dict[str, Any]
    max_seq_len: int | None = None
    bos_id: int | None = None
    eos_ids: list[int] | None = None
    vocab_size: int | None = None
    weights: WeightQuantization | None = None
    activations: str | None = None
    calibration: list[list[int]] | None = None
    max_draft: int | None = None  # dynamic programs: a `verify` method for this many proposed tokens
    draft: nn.Module | None = field(default=None, repr=False)  # a draft model whose methods go in the same file
    adapter_mode: str = ADAPTER_SLOTS  # how LoRA adapters ship (`etblocks.export.adapters`)
    say: Progress = field(default=lambda message: None, repr=False)
    quantized: dict[str, str] = field(default_factory=dict, repr=False)  # filled by the export: what each module holds

    @property
    def applied(self) -> str | None:
        return self.activations or (str(self.weights) if self.weights else None)


@reporting
def export(
    model: nn.Module,
    backend: str = "xnnpack",
    out: str | Path = "model.pte",
    *,
    max_seq_len: int | None = None,
    bos_id: int | None = None,
    eos_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    quantize_weights: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    quantize_embedding: str | None = None,
    quantize_activations: str | None = AUTO,
    calibration: Iterable[Sequence[int]] | None = None,
    backend_options: Mapping[str, Any] | None = None,
    progress: Progress | bool | None = None,
    tokenizer: Any = None,
    max_draft: int | None = None,
    draft: nn.Module | None = None,
    adapter_mode: str = ADAPTER_SLOTS,
    external_weights: bool | None = None,
    check_accuracy: str | Path | None = None,
    max_perplexity_increase: float | None = None,
) -> ExportResult:
    """Export, lower and save.

    A model swapped for dynamic shapes (or built from blocks) becomes `forward(tokens[1, T], input_pos[1]) ->
    logits[1, V]` with T dynamic up to `max_seq_len` (default: the swap's), state as mutable buffers, and the
    metadata methods ExecuTorch's LLM runner reads. A model swapped with static shapes becomes `prefill` and
    `decode` over one copy of the weights, with the contract of `etblocks.export.contract` recorded in the
    program. Any backend takes either program, so an NPU swap can be checked on the host.

    LoRA adapters loaded into the model (`etblocks.load_adapter`), as `adapter_mode` says (see
    `etblocks.export.adapters`): "slots" (default) gives the program LoRA slots (buffers set by a `set_adapter`
    method in a dynamic program, inputs of every call in a static one) and writes each adapter's tensors next to
    `out` (`<stem>.<adapter name>.ptd`); the program starts as the base model, and a quantized static program is
    calibrated with every adapter and with none. "programs" (dynamic programs, backends with
    `external_weights`) writes the base model's program to `out` with its weights in `<stem>.ptd`, and each
    adapter as a program of its own (`<stem>.<adapter name>.pte`) holding the adapter's tensors and reading every
    other weight from `<stem>.ptd`: the adapter decodes at the base's speed, a switch loads its program.

    Two kinds of quantization, each for the backends that run it (see `etblocks.export.weights`):
    - `quantize_weights`: torchao weight schemes for a backend with such kernels (xnnpack): "8da4w" (int8 dynamic
      activations, int4 weights with a scale per `group_size` inputs) or "8da8w" (int8 weights, a scale per
      output channel); `quantize_embedding="int8"` stores the embedding as int8 rows. Dynamic or static programs.
    - `quantize_activations`: calibrated (pt2e) quantization of a static program by the quantizer of the backend
      the model was swapped for (qnn: "16a8w", "16a4w", "8a8w"); "auto" takes that backend's default when
      exporting to it (16a8w for qnn), else none. `calibration` holds token id lists run through the program to
      calibrate (default: `quantize.default_calibration_prompts`, seeded random ids).
    The model itself keeps its float weights. `ExportResult.quantize` says what was applied. `backend_options`:
    the backend's own options (e.g. qnn's `chipset`). Errors (`ConfigError`, `BackendUnavailableError`) come
    before any work.

    `tokenizer` (a checkpoint or tokenizer directory, a tokenizer.json, or a transformers tokenizer; default: the
    directory a transformers model was loaded from, when it holds one) is saved beside the program as
    `<stem>.tokenizer/`, where `Runner` finds it to take and return text.

    `max_draft` (dynamic programs): also export `verify(tokens[1, T], input_pos[1]) -> logits[1, T, V]` for T up
    to `max_draft + 1`, over the same state, with which `Runner.generate(..., speculate=...)` checks up to
    `max_draft` proposed tokens per call. Static programs with caller-owned state check them with `prefill`.
    `draft` (with `max_draft`): a smaller model with the same vocabulary, swapped for dynamic shapes too, whose
    `forward` and `verify` go in the same file as `draft_forward` and `draft_verify` (its weights and state apart
    from the target's, quantized the same way), for `Runner.generate(..., speculate="draft")`.

    `external_weights`: the program's weights in `<stem>.ptd` beside it (`ExportResult.data_path`), where
    `Runner` finds them, for a backend whose programs read them from one. There a tied embedding and output layer
    (one tensor, looked up on CPU and multiplied by the delegate) are stored once, where a `.pte` alone holds
    them twice. None (default): apart when the model's embedding and output layer are tied and the program is a
    dynamic one without LoRA slots; False: inside the `.pte`.

    `check_accuracy` (dynamic programs): a text file the written program is scored on against the unquantized
    model (`ExportResult.accuracy`: perplexity of both, top-1 agreement, KL; `etblocks.export.accuracy_check`);
    with `max_perplexity_increase` (a fraction: 0.03 allows 3%), a program beyond it is a `ConfigError` and no
    file is kept.

    `progress`: each step (exporting, calibrating, lowering, serializing) is logged on the "etblocks" logger and,
    with the default None, shown on stderr with the elapsed time when it is a terminal and `logging` is not
    configured (a terminal's line counts the running step's seconds inside `etblocks.quiet()`); True shows them on
    stderr anywhere, False not; a callable is also given each step's message (see `etblocks.progress`).
    """
    partitioners = get_backend(backend).usable_partitioners(backend_options)  # typed errors before any work
    if tokenizer is None:
        tokenizer = checkpoint_tokenizer(model)
    text_tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
    plan = make_plan(
        model, backend, max_seq_len=max_seq_len, bos_id=bos_id, eos_ids=eos_ids, vocab_size=vocab_size,
        quantize_weights=quantize_weights, group_size=group_size, quantize_embedding=quantize_embedding,
        quantize_activations=quantize_activations, calibration=calibration, backend_options=backend_options,
        progress=progress, max_draft=max_draft, draft=draft, adapter_mode=adapter_mode,
    )
    accuracy_ids = accuracy_text_ids(check_accuracy, max_perplexity_increase, text_tokenizer, model)
    info = getattr(model, "etblocks_swap", None)
    if info is not None and info.recipe.partition == "hybrid":
        partitioners = [attention_on_cpu(p) for p in partitioners]
    has_adapters = bool(lora_layers(model))
    if has_adapters and plan.adapter_mode == ADAPTER_PROGRAMS:
        if accuracy_ids is not None:
            raise ConfigError("check_accuracy= scores one program; adapter_mode='programs' writes one per adapter: "
                              "check the base with adapter_mode='slots', or each program with `etblocks eval`")
        return _export_adapter_programs(model, plan, partitioners, out, text_tokenizer)
    slotted = has_adapters and not (info is not None and info.recipe.static)  # slots as buffers
    if slotted:
        partitioners = [keep_slots_on_cpu(p) for p in partitioners]
    apart = _weights_apart(model, plan, external_weights, static=info is not None and info.recipe.static, slotted=slotted)
    lowered = _lower(model, plan, partitioners, share_mutable_buffers=slotted, weights_tag=WEIGHTS_TAG if apart else None)
    start = time.perf_counter()
    path = write_whole(out, lowered.executorch_program.buffer)
    data_path = write_weights(lowered.executorch_program, weights_file(path)) if apart else None
    adapters = {}
    if has_adapters:
        for name in adapter_names(model):
            adapters[name] = save_adapter_file(adapter_tensors(model, name), adapter_file(path, name))
    lowered.seconds["serialize"] += time.perf_counter() - start
    result = _result(lowered, path, plan, text_tokenizer, adapters)
    if data_path is not None:
        result.data_path = data_path
        plan.say(f"wrote the weights to {data_path} ({data_path.stat().st_size / 1e6:.1f} MB)")
    if accuracy_ids is not None:
        plan.say(f"scoring the program on {len(accuracy_ids)} tokens of {check_accuracy} against the unquantized model")
        result.accuracy = checked_accuracy(model, result, accuracy_ids, max_perplexity_increase)
        plan.say(f"accuracy: {result.accuracy}")
    return result


def _weights_apart(model: nn.Module, plan: ExportPlan, asked: bool | None, static: bool, slotted: bool) -> bool:
    """Whether the export writes the weights to `<stem>.ptd` (`export`'s `external_weights`), checked."""
    if asked is None:
        return plan.backend.external_weights and not static and not slotted and _tied(model)
    if not isinstance(asked, bool):
        raise ConfigError(f"external_weights={asked!r} is not accepted; give True, False or None (apart when tied)")
    if asked and not plan.backend.external_weights:
        able = sorted(b.name for b in backends() if b.external_weights)
        raise ConfigError(f"external_weights=True: backend={plan.backend.name!r} keeps weights in its own compiled form; "
                          f"backends whose programs read a .ptd: {able}")
    if asked and static:
        raise ConfigError("external_weights=True takes dynamic programs; a static program (prefill and decode) keeps its "
                          "weights inside the .pte: export with external_weights=False")
    if asked and slotted:
        raise ConfigError("external_weights=True does not combine with LoRA slots (adapter_mode='slots'); use "
                          "adapter_mode='programs', which writes the base weights apart")
    return asked


def _tied(model: nn.Module) -> bool:
    """Whether the model's input embedding and output layer are one tensor."""
    if not (hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings")):
        return False
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    return embedding is not None and output is not None and getattr(embedding, "weight", None) is getattr(output, "weight", 1)


@dataclass
class _Lowered:
    """One program exported, lowered and serialized (not yet written)."""

    methods: list[str]
    metadata: dict
    delegations: dict[str, DelegationSummary]
    executorch_program: Any
    seconds: dict[str, float]


def _lower(model: nn.Module, plan: ExportPlan, partitioners: list, share_mutable_buffers: bool = False,
           weights_tag: str | None = None, inside: Sequence[torch.Tensor] = ()) -> _Lowered:
    """`model`'s program exported, lowered and serialized as `plan` says. `weights_tag`: its constants go to that
    data file, but the tensors `inside` (`etblocks.export.external`)."""
    start = time.perf_counter()
    program, exported = _export_methods(model, plan)
    for ep in exported.values():
        plan.backend.apply_passes(ep)
    seconds = {"export": time.perf_counter() - start}

    start = time.perf_counter()
    plan.say(f"lowering to {plan.backend.name}")
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(
        exported,
        partitioner=partitioners,
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=program.metadata,
        transform_passes=None if weights_tag is None else tagging_pass(weights_tag, inside),
    )
    delegations = {name: summarize(edge.exported_program(name).graph_module) for name in exported}
    seconds["lower"] = time.perf_counter() - start

    start = time.perf_counter()
    plan.say("serializing")
    config = _backend_config(share_mutable_buffers or VERIFY_METHOD in exported, weights_tag is not None)
    executorch_program = edge.to_executorch(config)
    seconds["serialize"] = time.perf_counter() - start  # the caller adds writing the file
    return _Lowered([*exported, *program.metadata], program.metadata, delegations, executorch_program, seconds)


def _export_adapter_programs(model: nn.Module, plan: ExportPlan, partitioners: list, out: str | Path,
                             text_tokenizer: Any) -> ExportResult:
    """`adapter_mode="programs"`: the base model's program at `out` with its weights in `weights_file(out)`, and
    one program per adapter (`adapter_program_file`) holding that adapter's tensors as constants and reading
    every other constant from the same weights file."""
    check_unmerged(model)
    plan.say("the base program, its weights in a file of their own")
    with adapter_baked(model, None):
        base = _lower(model, plan, partitioners, weights_tag=WEIGHTS_TAG)
    start = time.perf_counter()
    path = write_whole(out, base.executorch_program.buffer)
    data_path = write_weights(base.executorch_program, weights_file(path))
    base.executorch_program = None  # its serialized weights, let go before the next program's
    base.seconds["serialize"] += time.perf_counter() - start
    adapters, delegations = {}, {}
    for name in adapter_names(model):
        plan.say(f"the program of adapter {name!r}, reading the base's weights from {data_path.name}")
        with adapter_baked(model, name) as constants:
            lowered = _lower(model, plan, partitioners, weights_tag=WEIGHTS_TAG, inside=constants)
        adapters[name] = write_whole(adapter_program_file(path, name), lowered.executorch_program.buffer)
        delegations[name] = lowered.delegations
        for step, seconds in lowered.seconds.items():
            base.seconds[step] += seconds
    result = _result(base, path, plan, text_tokenizer, adapters)
    result.data_path, result.adapter_delegations = data_path, delegations
    plan.say(f"wrote the base weights to {data_path} ({data_path.stat().st_size / 1e6:.1f} MB)")
    return result


def _result(lowered: _Lowered, path: Path, plan: ExportPlan, text_tokenizer: Any, adapters: dict[str, Path]) -> ExportResult:
    result = ExportResult(path, plan.backend.name, lowered.methods, lowered.metadata, lowered.delegations,
                          lowered.seconds, plan.applied, adapters, quantized=dict(plan.quantized))
    if text_tokenizer is not None:
        result.tokenizer = save_tokenizer(text_tokenizer, path)
        result.tokenizer_source = getattr(text_tokenizer, "name_or_path", "") or type(text_tokenizer).__name__
    plan.say(f"wrote {path} ({result.size_mb:.1f} MB); {result.delegation}")
    for name, file in adapters.items():
        plan.say(f"wrote adapter {name!r} to {file} ({file.stat().st_size / 1e6:.2f} MB)")
    return result


@reporting
def check_readiness(
    model: nn.Module,
    backend: str,
    *,
    max_seq_len: int | None = None,
    quantize_activations: str | None = AUTO,
    calibration: Iterable[Sequence[int]] | None = None,
    progress: Progress | bool | None = None,
) -> Readiness:
    """The backend's readiness report of the program `export(model, backend=...)` would lower (exported and
    quantized as it would be), for backends whose lowering cannot run here (qnn without the Qualcomm SDK: every op
    checked against ExecuTorch's registered QNN op builders, plus static shapes and dtypes). `str(report)` prints
    it; `report.ready` says whether nothing was found in the way. It takes minutes on a real model: `progress` shows
    its steps as `export`'s does."""
    plan = make_plan(
        model, backend, max_seq_len=max_seq_len, quantize_activations=quantize_activations, calibration=calibration,
        progress=progress,
    )
    if not plan.backend.has_readiness:
        offered = sorted(b.name for b in backends() if b.has_readiness)
        raise ConfigError(f"backend={backend!r} offers no readiness check (backends that do: {offered}); export to it instead")
    _, exported = _export_methods(model, plan)
    plan.say(f"checking the program for {backend}")
    return plan.backend.readiness(exported)


def make_plan(
    model: nn.Module,
    backend: str,
    *,
    max_seq_len: int | None = None,
    bos_id: int | None = None,
    eos_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    quantize_weights: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    quantize_embedding: str | None = None,
    quantize_activations: str | None = AUTO,
    calibration: Iterable[Sequence[int]] | None = None,
    backend_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    max_draft: int | None = None,
    draft: nn.Module | None = None,
    adapter_mode: str = ADAPTER_SLOTS,
) -> ExportPlan:
    """The export's plan with every option checked (`ConfigError` naming it), before any work."""
    spec = get_backend(backend)
    adapter_mode = check(OPTIONS["adapter_mode"], adapter_mode)
    options = spec.check_options(backend_options)
    weights = weight_quantization(spec, quantize_weights, group_size, quantize_embedding)
    info = getattr(model, "etblocks_swap", None)
    recipe = info.recipe if info is not None else None
    if not (recipe is not None and recipe.static) and not spec.dynamic_shapes:
        raise ConfigError(
            f"backend={backend!r} takes fixed shapes only; swap with etblocks.swap(model, backend={backend!r}) "
            "or shapes='static' to get the static prefill/decode program"
        )
    activations = _activations(recipe, spec, quantize_activations)
    if weights is not None and activations is not None:
        raise ConfigError(
            f"quantize_weights / quantize_embedding ({weights}) and quantize_activations={activations!r} do not "
            "combine: calibrated quantization quantizes the weights itself"
        )
    if weights is not None and recipe is not None and recipe.linear == "conv2d":
        raise ConfigError(
            f"{weights} weight quantization takes linear projections; this swap's recipe has linear='conv2d' (1x1 "
            f"convolutions for an NPU): swap with etblocks.swap(model, backend={backend!r}, shapes='static') instead"
        )
    if recipe is not None:
        check_lowers(recipe, backend)
    if adapter_mode == ADAPTER_PROGRAMS and lora_layers(model):
        _check_adapter_programs(spec, recipe)
    if max_draft is not None:
        max_draft = check(OPTIONS["max_draft"], max_draft)
        check_verifiable(model, max_draft)
    if draft is not None:
        _check_draft(model, draft, max_draft, max_seq_len)
    return ExportPlan(
        backend=spec,
        backend_options=options,
        max_seq_len=max_seq_len,
        bos_id=None if bos_id is None else check(OPTIONS["bos_id"], bos_id),
        eos_ids=None if eos_ids is None else check(OPTIONS["eos_ids"], list(eos_ids)),
        vocab_size=vocab_size,
        weights=weights,
        activations=activations,
        calibration=None if calibration is None else [list(prompt) for prompt in calibration],
        say=progress or (lambda message: None),
        max_draft=max_draft,
        draft=draft,
        adapter_mode=adapter_mode,
    )


def _check_adapter_programs(backend: Backend, recipe: Recipe | None) -> None:
    """`ConfigError` unless adapter programs can share the base's weights file: a dynamic program, lowered for a
    backend whose programs read their constants from one (`Backend.external_weights`)."""
    if recipe is not None and recipe.static:
        raise ConfigError(
            f"adapter_mode={ADAPTER_PROGRAMS!r} takes dynamic programs; this model was swapped for static shapes, whose "
            f"programs take the adapters as inputs of every call: export with adapter_mode={ADAPTER_SLOTS!r}"
        )
    if not backend.external_weights:
        sharing = sorted(b.name for b in backends() if b.external_weights)
        raise ConfigError(
            f"adapter_mode={ADAPTER_PROGRAMS!r} needs programs that read their weights from a shared .ptd file; "
            f"backend={backend.name!r} keeps them in its own compiled form (backends that share: {sharing}); export "
            f"with adapter_mode={ADAPTER_SLOTS!r}"
        )


def _check_draft(model: nn.Module, draft: nn.Module, max_draft: int | None, max_seq_len: int | None) -> None:
    """`ConfigError` unless `draft` can go in `model`'s file as a draft model: both checked with `max_draft`, the
    same vocabulary, at least the target's context, no LoRA adapters in the draft."""
    if max_draft is None:
        raise ConfigError("draft= needs max_draft=N: the draft proposes up to N tokens, which the target's verify checks")
    if draft is model:
        raise ConfigError("draft= is the model being exported; give a smaller model with the same tokenizer")
    try:
        check_verifiable(draft, max_draft)
    except ConfigError as e:
        raise ConfigError(f"draft=: {e}") from None
    info, draft_info = model.etblocks_swap, draft.etblocks_swap
    vocab, draft_vocab = (i.kind.token_metadata(m)["vocab_size"] for i, m in ((info, model), (draft_info, draft)))
    if draft_vocab != vocab:
        raise ConfigError(f"draft= has a vocabulary of {draft_vocab} tokens, the model {vocab}; a draft must share the tokenizer")
    context = max_seq_len or info.max_seq_len
    if draft_info.max_seq_len < context:
        raise ConfigError(
            f"draft= was swapped for max_seq_len={draft_info.max_seq_len}, the program holds {context} positions; swap "
            "the draft with at least the target's max_seq_len"
        )
    if lora_layers(draft):
        raise ConfigError("draft= holds LoRA adapters; a draft model goes in the file without them")


def _activations(recipe: Recipe | None, backend: Backend, requested: str | None) -> str | None:
    """The calibrated quantization to apply: "auto" is the swap's default when exporting to the swap's backend."""
    if requested == AUTO:
        return recipe.quantize_activations if recipe is not None and backend.name == recipe.backend else None
    requested = check(OPTIONS["quantize_activations"], requested)
    if requested is None:
        return None
    if recipe is None or not recipe.static:
        raise ConfigError(
            f"quantize_activations={requested!r} applies to static programs; swap with shapes='static' (or for a backend "
            "with static programs)"
        )
    swapped_for = get_backend(recipe.backend)
    if requested not in swapped_for.activation_schemes:
        offering = sorted(b.name for b in backends() if requested in b.activation_schemes)
        raise ConfigError(
            f"quantize_activations={requested!r} is not accepted for a model swapped for backend={recipe.backend!r} "
            f"(it quantizes with: {list(swapped_for.activation_schemes) or 'none'}); backends whose quantizer has it: "
            f"{offering or 'none'}"
        )
    if not recipe.caller_owned:
        raise ConfigError(
            f"quantize_activations={requested!r} needs the static program with cache='io'; this swap has cache={recipe.cache!r}"
        )
    return requested


def _export_methods(model: nn.Module, plan: ExportPlan) -> tuple[DynamicProgram | StaticProgram, dict]:
    """The program and its methods exported (and, for static programs, quantized) as `plan` says; torchao weight
    quantization is applied for the time of the export only (`etblocks.export.weights`)."""
    info = getattr(model, "etblocks_swap", None)
    tokens = dict(bos_id=plan.bos_id, eos_ids=plan.eos_ids)
    if not (info is not None and info.recipe.static):
        program, exported = _export_dynamic(model, plan, plan.max_seq_len, tokens)
        if plan.draft is not None:
            plan.say(f"the draft model, its methods named {DRAFT_PREFIX}*")
            draft, draft_methods = _export_dynamic(plan.draft, plan, None, tokens, DraftProgram)
            exported.update({DRAFT_PREFIX + name: method for name, method in draft_methods.items()})
            program.metadata.update({DRAFT_PREFIX + name: value for name, value in draft.metadata.items()})
        return program, exported
    program = static_program(model, plan.max_seq_len, quantized=plan.activations is not None, **tokens)
    plan.say(f"exporting prefill (T={program.contract.chunk}) and decode (T=1) with static shapes")
    with _weights_quantized(model, program.module, program.example_inputs("decode"), plan, program.metadata):
        exported = {name: _torch_export(program.module, program.example_inputs(name)) for name in program.contract.methods}
    if plan.activations is not None:
        adapters = [program.contract.adapter_table.inputs(adapter_tensors(model, name)) for name in adapter_names(model)]
        with_adapters = f", with {len(adapters)} adapters and without" if adapters else ""
        prompts = f"{len(plan.calibration)}" if plan.calibration else "default"
        plan.say(f"quantizing ({plan.activations}) on {prompts} calibration prompts{with_adapters}")
        quantizer = get_backend(info.recipe.backend).quantizer(plan.activations)
        exported = quantize_static(exported, program.contract, quantizer, plan.calibration, adapters)
    return program, exported


def _export_dynamic(model: nn.Module, plan: ExportPlan, max_seq_len: int | None, tokens: dict,
                    wrap: Callable[[nn.Module], nn.Module] | None = None) -> tuple[DynamicProgram, dict]:
    """`forward`, and `set_adapter` / `verify` when the model has adapters / `plan.max_draft` is set, exported;
    `wrap` wraps each method's module (`DraftProgram`)."""
    program = dynamic_program(model, max_seq_len, vocab_size=plan.vocab_size, **tokens)
    plan.say(f"exporting with torch.export (T dynamic in 1..{program.max_call_len}, context {program.max_seq_len})")
    slotted = plan.adapter_mode == ADAPTER_SLOTS and bool(lora_layers(program.module))
    verify = verify_program(model, plan.max_draft) if plan.max_draft is not None else None
    wrap = wrap or (lambda module: module)
    with _weights_quantized(model, program.module, program.example_inputs(), plan, program.metadata), \
            (adapter_slots(program.module, lambda: program.module(*program.example_inputs())) if slotted
             else nullcontext()) as table:
        exported = {"forward": _torch_export(wrap(program.module), program.example_inputs(), program.dynamic_shapes())}
        if slotted:
            plan.say(f"with LoRA slots in {len(table.slots)} layers and a {SET_ADAPTER_METHOD} method")
            exported[SET_ADAPTER_METHOD] = set_adapter_program(program.module, table, _torch_export)
            program.metadata[ADAPTERS_METHOD] = table.as_constant()
        if verify is not None:
            plan.say(f"with a {VERIFY_METHOD} method for up to {plan.max_draft} proposed tokens per call")
            exported[VERIFY_METHOD] = _torch_export(wrap(verify.module), verify.example_inputs(), verify.dynamic_shapes())
            program.metadata[MAX_VERIFY_METHOD] = verify.max_call_len
    return program, exported


@contextmanager
def _weights_quantized(model: nn.Module, program_module: nn.Module, example_inputs: tuple, plan: ExportPlan,
                       metadata: dict):
    """The weights quantized as `plan` says while the block runs; what each module holds goes to `plan.quantized`
    and, as a constant method, to the program's `metadata` (`QUANTIZATION_METHOD`)."""
    with quantized_weights(model, program_module, example_inputs, plan.weights) as record:
        if record:
            metadata.setdefault(QUANTIZATION_METHOD, quantization_constant(str(plan.weights), record))
            kept = sum(how == KEPT for how in record.values())
            plan.say(f"quantized the weights of {len(record)} modules ({plan.weights}) for the export; the model keeps its own"
                     + (f"; {kept} kept the int4 groups they had" if plan.weights.recipe else ""))
        plan.quantized.update(record)
        yield


def _torch_export(module: nn.Module, example_inputs: tuple, dynamic_shapes=None) -> torch.export.ExportedProgram:
    load_llama_custom_ops()
    reset_states(module)  # buffers' values at export time become the program's initial state
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        module.train(was_training)


def _backend_config(share_mutable_buffers: bool = False, external: bool = False):
    """`share_mutable_buffers`: methods that name the same buffer use one copy of it (LoRA slots). `external`: the
    constants left on CPU go to the data file their tag names, as the delegates' do (`etblocks.export.external`)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    return ExecutorchBackendConfig(
        extract_delegate_segments=True,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=share_mutable_buffers),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        emit_mutable_buffer_names=share_mutable_buffers,
        external_constants=constant_tag if external else False,
    )
