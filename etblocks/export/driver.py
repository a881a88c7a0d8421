"""`export()`: from a swapped model (or one built from blocks) to a .pte for one backend."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch
from torch import nn

from etblocks.adapters import adapter_names
from etblocks.adapters.files import adapter_tensors, save_adapter_file
from etblocks.errors import ConfigError
from etblocks.export.adapters import (
    ADAPTERS_METHOD,
    SET_ADAPTER_METHOD,
    adapter_file,
    adapter_slots,
    keep_slots_on_cpu,
    lora_layers,
    set_adapter_program,
)
from etblocks.export.backends import get_backend, partitioners_for
from etblocks.export.delegation import DelegationSummary, summarize
from etblocks.export.passes import apply_backend_passes
from etblocks.export.hybrid import attention_on_cpu
from etblocks.export.programs import dynamic_program, static_program

if TYPE_CHECKING:
    from etblocks.export.qnn import QnnReadiness
from etblocks.export.quantize import quantize_static
from etblocks.export.weights import WEIGHT_SCHEMES, WeightQuantization, quantized_weights, weight_quantization
from etblocks.kv_cache.base import reset_caches
from etblocks.swap.recipes import QUANTIZE_QNN, check_int8_io_cache_lowers

Progress = Callable[[str], None]


@dataclass
class ExportResult:
    """`delegations` holds one summary per method; `delegation` adds them up. `adapters` maps each adapter
    loaded into the model to its `.ptd` file (switched at run time by `Runner.set_adapter`)."""

    path: Path
    backend: str
    methods: list[str]
    metadata: dict
    delegations: dict[str, DelegationSummary]
    seconds: dict[str, float] = field(default_factory=dict)
    quantize: str | None = None
    adapters: dict[str, Path] = field(default_factory=dict)

    @property
    def delegation(self) -> DelegationSummary:
        return DelegationSummary.combine(self.delegations.values())

    @property
    def size_mb(self) -> float:
        return self.path.stat().st_size / 1e6


def export(
    model: nn.Module,
    backend: str = "xnnpack",
    out: str | Path = "model.pte",
    *,
    max_seq_len: int | None = None,
    bos_id: int | None = None,
    eos_ids: list[int] | None = None,
    vocab_size: int | None = None,
    quantize: str | None = "auto",
    group_size: int = 32,
    quantize_embedding: str | None = None,
    calibration: Iterable[Sequence[int]] | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Export, lower and save.

    A model swapped for dynamic shapes (or built from blocks) becomes `forward(tokens[1, T], input_pos[1]) ->
    logits[1, V]` with T dynamic up to `max_seq_len` (default: the swap's), KV caches as mutable buffers, and the
    metadata methods ExecuTorch's LLM runner reads. A model swapped with static shapes becomes `prefill` and
    `decode` over one copy of the weights, with the contract of `etblocks.export.contract` recorded in the
    program. Any backend takes either program, so an NPU swap can be checked on the host.

    LoRA adapters loaded into the model (`etblocks.load_adapter`): the program gets LoRA slots (buffers set by
    a `set_adapter` method in a dynamic program, inputs of every call in a static one; see
    `etblocks.export.adapters`), and each adapter goes to its own file next to `out` (`<stem>.<adapter
    name>.ptd`); the program starts as the base model. A quantized static program is calibrated with every
    adapter and with none.

    `quantize`: for static programs a QnnQuantizer precision ("16a8w", "16a4w", "8a8w"); "auto" takes the
    recipe's when exporting to the recipe's own backend (16a8w for qnn), else None. `calibration` holds token id
    lists run through the program to calibrate (default: `quantize.default_calibration_prompts`, seeded random ids).
    For backend="xnnpack" (dynamic or static programs) a torchao weight scheme: "8da4w" (int8 dynamic
    activations, int4 weights with a scale per `group_size` inputs) or "8da8w" (int8 weights, a scale per output
    channel); `quantize_embedding="int8"` stores the embedding as int8 rows (see `etblocks.export.weights`). The
    model itself keeps its float weights. `ExportResult.quantize` says what was applied.
    Errors (`ConfigError`, `BackendUnavailableError`) come before any work.
    """
    say = progress or (lambda message: None)
    partitioners = partitioners_for(backend)  # typed errors before any work
    weights = _weight_quantization(backend, quantize, group_size, quantize_embedding)
    info = getattr(model, "etblocks_swap", None)
    if info is not None and info.recipe.partition == "hybrid":
        partitioners = [attention_on_cpu(p) for p in partitioners]
    has_adapters = bool(lora_layers(model))
    slotted = has_adapters and not (info is not None and info.recipe.static)  # slots as buffers
    if slotted:
        partitioners = [keep_slots_on_cpu(p) for p in partitioners]
    start = time.perf_counter()
    static_quantize = None if quantize in WEIGHT_SCHEMES else quantize  # QnnQuantizer's, for static programs
    program, exported, quantize = _export_methods(
        model, backend, max_seq_len, bos_id, eos_ids, vocab_size, static_quantize, calibration, say, weights
    )
    quantize = quantize or (str(weights) if weights else None)
    for ep in exported.values():
        apply_backend_passes(ep, backend)
    seconds = {"export": time.perf_counter() - start}

    start = time.perf_counter()
    say(f"lowering to {backend}")
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(
        exported,
        partitioner=partitioners,
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=program.metadata,
    )
    delegations = {name: summarize(edge.exported_program(name).graph_module) for name in exported}
    seconds["lower"] = time.perf_counter() - start

    start = time.perf_counter()
    say("serializing")
    executorch_program = edge.to_executorch(_backend_config(share_mutable_buffers=slotted))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(executorch_program.buffer)
    adapters = {}
    if has_adapters:
        for name in adapter_names(model):
            adapters[name] = save_adapter_file(adapter_tensors(model, name), adapter_file(path, name))
    seconds["serialize"] = time.perf_counter() - start
    methods = [*exported, *program.metadata]
    result = ExportResult(path, backend, methods, program.metadata, delegations, seconds, quantize, adapters)
    say(f"wrote {path} ({result.size_mb:.1f} MB); {result.delegation}")
    for name, file in adapters.items():
        say(f"wrote adapter {name!r} to {file} ({file.stat().st_size / 1e6:.2f} MB)")
    return result


def check_qnn(
    model: nn.Module,
    *,
    max_seq_len: int | None = None,
    quantize: str | None = "auto",
    calibration: Iterable[Sequence[int]] | None = None,
    progress: Progress | None = None,
) -> dict[str, QnnReadiness]:
    """QNN readiness without the Qualcomm SDK: the program `export(model, backend="qnn")` would lower (static,
    quantized as it would be) checked op by op against ExecuTorch's registered QNN op builders, plus static
    shapes and dtypes. One report per method; `format_readiness` prints them."""
    from etblocks.export.qnn import qnn_readiness

    say = progress or (lambda message: None)
    _, exported, _ = _export_methods(model, "qnn", max_seq_len, None, None, None, quantize, calibration, say)
    say("checking every op against the QNN op builders")
    return qnn_readiness(exported)


def _export_methods(model, backend, max_seq_len, bos_id, eos_ids, vocab_size, quantize, calibration, say, weights=None):
    """The program and its methods exported (and, for static programs, quantized) for `backend`. `weights`:
    torchao weight quantization applied for the time of the export (`etblocks.export.weights`)."""
    info = getattr(model, "etblocks_swap", None)
    static = info is not None and info.recipe.static
    if not static and not get_backend(backend).dynamic_shapes:
        raise ConfigError(
            f"backend={backend!r} takes fixed shapes only; swap with etblocks.swap(model, backend={backend!r}) "
            "or shapes='static' to get the static prefill/decode program"
        )
    if not static:
        if quantize not in (None, "auto"):
            raise ConfigError(f"quantize={quantize!r} applies to static programs; swap with shapes='static' (or backend='qnn')")
        program = dynamic_program(model, max_seq_len, bos_id=bos_id, eos_ids=eos_ids, vocab_size=vocab_size)
        say(f"exporting with torch.export (T dynamic in 1..{program.max_call_len}, context {program.max_seq_len})")
        with _weights_quantized(model, program.module, program.example_inputs(), weights, say):
            if not lora_layers(program.module):
                forward = _torch_export(program.module, program.example_inputs(), program.dynamic_shapes())
                return program, {"forward": forward}, None
            with adapter_slots(program.module) as table:
                say(f"with LoRA slots in {len(table.slots)} layers and a {SET_ADAPTER_METHOD} method")
                forward = _torch_export(program.module, program.example_inputs(), program.dynamic_shapes())
                exported = {"forward": forward, SET_ADAPTER_METHOD: set_adapter_program(program.module, table, _torch_export)}
        program.metadata[ADAPTERS_METHOD] = table.as_constant()
        return program, exported, None
    if info.recipe.kv_quantize is not None and info.recipe.cache == "io":
        check_int8_io_cache_lowers(backend)
    quantize = _static_quantize(info.recipe, backend, quantize)
    if weights is not None and info.recipe.linear == "conv2d":
        raise ConfigError(
            f"{weights} weight quantization takes linear projections; this swap's recipe has linear='conv2d' (1x1 "
            f"convolutions for QNN): swap with etblocks.swap(model, backend={backend!r}, shapes='static') instead"
        )
    calibration = None if calibration is None else [list(prompt) for prompt in calibration]
    program = static_program(model, max_seq_len, bos_id=bos_id, eos_ids=eos_ids, quantized=quantize is not None)
    say(f"exporting prefill (T={program.contract.chunk}) and decode (T=1) with static shapes")
    with _weights_quantized(model, program.module, program.example_inputs("decode"), weights, say):
        exported = {name: _torch_export(program.module, program.example_inputs(name)) for name in program.contract.methods}
    if quantize is not None:
        adapters = [program.contract.adapter_table.inputs(adapter_tensors(model, name)) for name in adapter_names(model)]
        with_adapters = f", with {len(adapters)} adapters and without" if adapters else ""
        say(f"quantizing with QnnQuantizer ({quantize}) on {len(calibration) if calibration else 'default'} calibration prompts{with_adapters}")
        exported = quantize_static(exported, program.contract, quantize, calibration, adapters)
    return program, exported, quantize


def _weight_quantization(backend: str, quantize, group_size, quantize_embedding) -> WeightQuantization | None:
    """`quantize` checked against both families (QnnQuantizer precisions, torchao weight schemes) and the
    torchao weight quantization asked for, before any work."""
    accepted = (None, "auto", *QUANTIZE_QNN, *WEIGHT_SCHEMES)
    if quantize not in accepted:
        raise ConfigError(
            f"quantize={quantize!r} is not accepted; choose one of {list(accepted)}: QnnQuantizer precisions "
            f"{list(QUANTIZE_QNN)} for static programs, torchao weight schemes {list(WEIGHT_SCHEMES)} for backend='xnnpack'"
        )
    weights = weight_quantization(backend, quantize, group_size, quantize_embedding)
    if weights is not None and quantize in QUANTIZE_QNN:
        raise ConfigError(
            f"quantize_embedding={quantize_embedding!r} is torchao weight quantization; it does not combine with the "
            f"QnnQuantizer precision quantize={quantize!r}"
        )
    return weights


@contextmanager
def _weights_quantized(model, program_module, example_inputs, weights: WeightQuantization | None, say):
    with quantized_weights(model, program_module, example_inputs, weights) as names:
        if names:
            say(f"quantized the weights of {len(names)} modules ({weights}) for the export; the model keeps its own")
        yield


def _static_quantize(recipe, backend: str, quantize) -> str | None:
    if quantize == "auto":
        return recipe.quantize if backend == recipe.backend else None
    if quantize is not None and quantize not in QUANTIZE_QNN:
        raise ConfigError(f"quantize={quantize!r} is not accepted; choose one of {[None, *QUANTIZE_QNN]}")
    if quantize is not None and recipe.cache != "io":
        raise ConfigError(f"quantize={quantize!r} needs the static program with cache='io'; this swap has cache={recipe.cache!r}")
    return quantize


def _torch_export(module: nn.Module, example_inputs: tuple, dynamic_shapes=None) -> torch.export.ExportedProgram:
    from etblocks.attention.sdpa import load_llama_custom_ops

    load_llama_custom_ops()
    reset_caches(module)  # buffers' values at export time become the program's initial state
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        module.train(was_training)


def _backend_config(share_mutable_buffers: bool = False):
    """`share_mutable_buffers`: methods that name the same buffer use one copy of it (LoRA slots)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    return ExecutorchBackendConfig(
        extract_delegate_segments=True,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=share_mutable_buffers),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        emit_mutable_buffer_names=share_mutable_buffers,
    )
