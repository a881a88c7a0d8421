"""`export()`: from a swapped model (or one built from blocks) to a .pte for one backend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from etblocks.errors import ConfigError
from etblocks.export.backends import partitioners_for
from etblocks.export.delegation import DelegationSummary, summarize
from etblocks.export.passes import BACKEND_PASSES
from etblocks.export.programs import DynamicProgram, dynamic_program
from etblocks.kv_cache.base import reset_caches
from etblocks.swap.recipes import RECIPES

Progress = Callable[[str], None]


@dataclass
class ExportResult:
    path: Path
    backend: str
    methods: list[str]
    metadata: dict
    delegation: DelegationSummary
    seconds: dict[str, float] = field(default_factory=dict)

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
    progress: Progress | None = None,
) -> ExportResult:
    """Export, lower and save. The program is `forward(tokens[1, T], input_pos[1]) -> logits[1, V]` with T
    dynamic up to `max_seq_len` (default: the swap's), KV caches as mutable buffers, and the metadata methods
    ExecuTorch's LLM runner reads. Backend errors (`ConfigError`, `BackendUnavailableError`) come before any work.
    """
    say = progress or (lambda message: None)
    partitioners = check_exportable(backend)
    program = dynamic_program(model, max_seq_len, bos_id=bos_id, eos_ids=eos_ids, vocab_size=vocab_size)
    seconds: dict[str, float] = {}

    start = time.perf_counter()
    say(f"exporting with torch.export (T dynamic in 1..{program.max_seq_len})")
    exported = _torch_export(program)
    for rewrite in BACKEND_PASSES.get(backend, []):
        rewrite(exported)
    seconds["export"] = time.perf_counter() - start

    start = time.perf_counter()
    say(f"lowering to {backend}")
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(
        exported,
        partitioner=partitioners,
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=program.metadata,
    )
    delegation = summarize(edge.exported_program().graph_module)
    seconds["lower"] = time.perf_counter() - start

    start = time.perf_counter()
    say("serializing")
    executorch_program = edge.to_executorch(_backend_config())
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(executorch_program.buffer)
    seconds["serialize"] = time.perf_counter() - start
    say(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); {delegation}")
    return ExportResult(path, backend, ["forward", *program.metadata], program.metadata, delegation, seconds)


def check_exportable(backend: str) -> list:
    """The partitioners for `backend`, once it is known, usable here and has a program recipe; else the
    typed error (`ConfigError`, `BackendUnavailableError`). Cheap: call it before loading a model."""
    partitioners = partitioners_for(backend)
    if backend not in RECIPES:
        raise ConfigError(
            f"backend={backend!r} has no dynamic-shape program recipe yet; accepted for export: {sorted(RECIPES)}"
        )
    return partitioners


def _torch_export(program: DynamicProgram) -> torch.export.ExportedProgram:
    from etblocks.attention.sdpa import load_llama_custom_ops

    load_llama_custom_ops()
    reset_caches(program.module)  # buffers' values at export time become the program's initial state
    was_training = program.module.training
    program.module.eval()
    try:
        with torch.no_grad():
            return torch.export.export(
                program.module, program.example_inputs(), dynamic_shapes=program.dynamic_shapes(), strict=False
            )
    finally:
        program.module.train(was_training)


def _backend_config():
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    return ExecutorchBackendConfig(
        extract_delegate_segments=True,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
    )
