"""QNN (HTP) readiness without the Qualcomm SDK.

Lowering needs the SDK (`QnnPartitioner` and `QnnBackend` validate and compile through the SDK's libraries), so
`qnn_readiness` runs everything of `to_edge_transform_and_lower_to_qnn` that does not: QNN's export passes, QNN's
edge decompositions and to-edge passes, QNN's per-node support check and QNN's graph build, each stopping where
the SDK would be called.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

# Output dtypes of the ops a QNN HTP graph can hold: float32 (run in fp16, or quantized), float16, the
# fixed-point types quantized tensors use (u)int8/(u)int16, int32 (indices, after QNN's I64toI32 pass), bool.
# Not accepted: int64 (QNN has no 64-bit integer type: I64toI32 casts what it can, anything left is a real
# problem), float64 (QNN's builders silently map it to float32), bfloat16 and complex (no QNN type at all).
HTP_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.int32, torch.int16, torch.uint16, torch.int8, torch.uint8, torch.bool}
)


def _op_name(node: torch.fx.Node) -> str:
    """The name QNN's builder registry is keyed by (`aten.add.Tensor`, `getitem`, ...)."""
    return getattr(node.target, "__name__", str(node.target))


def _is_symbolic(value: Any) -> bool:
    return any(not isinstance(d, int) for t in _tensors(value) for d in t.shape)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a node's `meta["val"]` (one, or a tuple for multi-output ops)."""
    return [t for t in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(t, torch.Tensor)]


def _shapes(value: Any) -> str:
    return ", ".join(str(list(t.shape)) for t in _tensors(value))


@dataclass
class QnnReadiness:
    """What QNN would make of one method, short of the SDK's own validation.

    `ops` counts the edge ops after QNN's pre-lowering passes; `uncovered` those QNN would leave on CPU,
    with the reason in `reasons`; `dynamic` lists nodes with symbolic shapes; `bad_dtypes` nodes whose
    output dtype HTP cannot hold (see `HTP_DTYPES`); `build_error` is set when building the QNN op
    wrappers of the whole method failed (tried only when every op is covered).
    """

    method: str
    ops: Counter
    uncovered: Counter
    dynamic: list[str]
    bad_dtypes: list[str]
    reasons: dict[str, str] = field(default_factory=dict)
    build_error: str | None = None

    @property
    def ready(self) -> bool:
        return not self.uncovered and not self.dynamic and not self.bad_dtypes and self.build_error is None


def _graph_copy(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A program with its own graph (QNN's passes rewrite graphs in place) sharing the weight tensors.

    The copy keeps the original node names (deepcopy renames ones that shadow builtins, `input` ->
    `input_1`, which the graph signature would no longer match) and drops each node's `from_node`
    provenance: torch deep-copies that chain into every node a pass creates, which made the check several
    times slower on quantized graphs (long chains), and the throwaway copy never needs it.

    workaround(torch 2.13.0): names restored and `from_node` dropped after `copy.deepcopy` of a graph module.
    """
    module = copy.deepcopy(program.graph_module)
    for original, node in zip(program.graph.nodes, module.graph.nodes):
        node.name = original.name
        node.meta.pop("from_node", None)
    module.recompile()
    return torch.export.ExportedProgram(
        root=module,
        graph=module.graph,
        graph_signature=copy.deepcopy(program.graph_signature),
        state_dict=dict(program.state_dict),
        range_constraints=dict(program.range_constraints),
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=dict(program.constants),
        verifiers=program.verifiers,
    )


def _probe_partitioner() -> Any:
    """A partitioner that asks to keep exactly the ops `QnnPartitioner` keeps undecomposed, sees the same
    edge program `QnnPartitioner.partition` would, and delegates nothing (lowering needs the SDK)."""
    from executorch.backends.qualcomm.partition.utils import filter_fn, get_skip_decomp_table
    from executorch.exir.backend.partitioner import Partitioner, PartitionResult

    class QnnProbe(Partitioner):
        def __init__(self) -> None:
            super().__init__()
            self.partitioned = False

        def partition(self, exported_program):
            self.partitioned = True
            return PartitionResult(tagged_exported_program=exported_program, partition_tags={})

        def ops_to_not_decompose(self, ep):
            # After partitioning, to_edge_transform_and_lower checks that every kept op was delegated; the
            # probe delegates nothing on purpose, so it reports them as not kept any more.
            return get_skip_decomp_table(), (lambda node: False) if self.partitioned else filter_fn

    return QnnProbe()


def _coverage(edge_program: torch.export.ExportedProgram) -> tuple[Counter, Counter, dict[str, str]]:
    """`QnnOperatorSupport.is_node_supported` without its last step (the SDK's `IsNodeSupportedByBackend`).

    A `call_function` node is covered when QNN's partitioner would pass it before asking the SDK:
    - `getitem` (a skip op), `qaisw` context-binary ops and nodes QNN's FoldQDQ pass marked as bypass
      (the dequantize of a quantized weight, folded into the op that reads it) are covered;
    - ops QNN lists as unsupported or not yet implemented, or marked for CPU fallback, are not;
    - any other op needs a registered builder (node visitor) whose `define_node` builds a QNN op wrapper
      for this node, as the partitioner does; a builder that returns None or raises does not cover it.
    Quantize/dequantize ops have builders, so they are covered by the same rule.
    """
    from executorch.backends.qualcomm.builders import node_visitor_manager
    from executorch.backends.qualcomm.builders.qnn_constants import OpContextLoader
    from executorch.backends.qualcomm.partition.common_defs import (
        allow_list_operator,
        constant_operator,
        not_supported_operator,
        to_be_implemented_operator,
    )
    from executorch.backends.qualcomm.utils.constants import QCOM_BYPASS_NODE, QCOM_FALLBACK_NODE

    visitors = node_visitor_manager.get_node_visitors(edge_program)
    ops, uncovered, reasons = Counter(), Counter(), {}
    for node in edge_program.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node)
        ops[name] += 1
        if node.target in allow_list_operator or node.meta.get(QCOM_BYPASS_NODE, False):
            continue
        if getattr(node.target, "namespace", None) == OpContextLoader.namespace:
            continue
        if node.target in not_supported_operator:
            reason = "QNN lists it as unsupported"
        elif node.target in to_be_implemented_operator:
            reason = "QNN lists it as not implemented yet"
        elif node.meta.get(QCOM_FALLBACK_NODE, False):
            reason = "a QNN pass marked it for CPU fallback"
        elif name not in visitors:
            reason = "no QNN builder"
        else:
            try:
                wrapper = visitors[name].define_node(node, defaultdict(dict))
                declined = wrapper is None and node.target not in constant_operator
                reason = "QNN builder declined it" if declined else None
            except Exception as exc:  # a builder's assertion is how QNN rejects an op's arguments
                reason = f"QNN builder failed: {exc}"
        if reason is not None:
            uncovered[name] += 1
            reasons.setdefault(name, reason)
    return ops, uncovered, reasons


def _build_error(edge_program: torch.export.ExportedProgram) -> str | None:
    """Run what `QnnBackend.preprocess` does before handing the graph to the SDK: QNN's preprocess passes
    (FoldQDQ, InsertRequantize, InsertIOQDQ, LayoutTransform, ...), an op wrapper from every builder, and
    the graph I/O check. Done on the whole method, which is the delegated graph when every op is covered.
    Rewrites `edge_program`."""
    from executorch.backends.qualcomm import qnn_preprocess
    from executorch.backends.qualcomm.serialization.qc_schema import QnnExecuTorchBackendType

    logger = qnn_preprocess.logger  # logs every node it visits at INFO
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        qnn_preprocess.QnnBackend._build_op_wrappers(
            edge_program, False, [], False, QnnExecuTorchBackendType.kHtpBackend
        )
    except Exception as exc:  # whatever fails here would fail the real lowering the same way
        return f"{type(exc).__name__}: {exc}"
    finally:
        logger.setLevel(level)
    return None


class QnnReport(dict):
    """`{method: QnnReadiness}`; printed, the table of `format_readiness`."""

    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.values())

    def __str__(self) -> str:
        return format_readiness(self)


def qnn_readiness(programs: dict[str, torch.export.ExportedProgram]) -> QnnReport:
    """Whether each method would lower to QNN HTP in full, checked as far as possible without the SDK.

    Runs the pipeline of `to_edge_transform_and_lower_to_qnn` (HTP) on copies of the graphs:
    1. `QnnHtpPassManager.transform_for_export_pipeline` (QNN's decompositions on the ATen graph);
    2. `to_edge_transform_and_lower` with QNN's edge config, QNN's undecomposed-op table and filter, and
       the transform passes of `get_to_edge_transform_passes` (FoldQDQ, I64toI32, LayoutTransform, ...);
    3. per node, `QnnPartitioner`'s support check minus the SDK's backend validation (see `_coverage`);
    4. when every op is covered, `QnnBackend`'s graph build short of compiling (see `_build_error`).
    Not checked: whether HTP accepts each op's exact shapes, dtypes and parameters (the SDK validates
    that), graph compilation, and memory or performance limits.
    """
    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.serialization.qc_schema import QnnExecuTorchBackendType
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.exir import to_edge_transform_and_lower

    aten, transform_passes = {}, {}
    for name, program in programs.items():
        manager = get_qnn_pass_manager_cls(QnnExecuTorchBackendType.kHtpBackend)()
        program = _graph_copy(program)
        aten[name] = manager.transform_for_export_pipeline(program)
        transform_passes[name] = manager.get_to_edge_transform_passes(program)
    edge = to_edge_transform_and_lower(
        aten,
        transform_passes=transform_passes,
        partitioner={name: [_probe_partitioner()] for name in aten},
        compile_config=qnn_edge_config(),
    )
    report = QnnReport()
    for name in programs:
        edge_program = edge.exported_program(name)
        ops, uncovered, reasons = _coverage(edge_program)
        dynamic, bad_dtypes = [], []
        for node in edge_program.graph.nodes:
            value = node.meta.get("val")
            if node.op in ("placeholder", "call_function") and _is_symbolic(value):
                dynamic.append(f"{node.name} {_shapes(value)}")
            if node.op == "call_function":
                bad = [t.dtype for t in _tensors(value) if t.dtype not in HTP_DTYPES]
                if bad:
                    bad_dtypes.append(f"{node.name} ({_op_name(node)}): {', '.join(map(str, bad))}")
        build_error = None if uncovered else _build_error(edge_program)
        report[name] = QnnReadiness(name, ops, uncovered, dynamic, bad_dtypes, reasons, build_error)
    return report


def format_readiness(report: dict[str, QnnReadiness]) -> str:
    """A plain-text table: the verdict per method, op counts side by side, then every problem found."""
    methods = list(report)
    lines = ["QNN HTP readiness (QNN passes, builders and graph build; the SDK's op validation and compile not run)"]
    lines += _table(
        ["method", "ops", "uncovered", "dynamic", "bad dtypes", "verdict"],
        [
            [m, sum(r.ops.values()), sum(r.uncovered.values()), len(r.dynamic), len(r.bad_dtypes), _verdict(r)]
            for m, r in report.items()
        ],
    )
    totals = Counter()
    for r in report.values():
        totals.update(r.ops)
    lines += ["", "op counts:"]
    lines += _table(
        ["op", *methods, "QNN"],
        [[op, *(report[m].ops[op] for m in methods), _covered_mark(report, op)] for op, _ in totals.most_common()],
    )
    for method, r in report.items():
        for op, count in r.uncovered.items():
            lines.append(f"{method}: uncovered {op} x{count} ({r.reasons.get(op, 'unknown')})")
        if r.dynamic:
            shown = "; ".join(r.dynamic[:3]) + (f"; ... ({len(r.dynamic)} nodes)" if len(r.dynamic) > 3 else "")
            lines.append(f"{method}: symbolic shapes (QNN needs static ones): {shown}")
        for entry in r.bad_dtypes:
            lines.append(f"{method}: dtype HTP cannot hold: {entry}")
        if r.build_error:
            lines.append(f"{method}: building the QNN graph failed: {r.build_error}")
    return "\n".join(lines)


def _verdict(readiness: QnnReadiness) -> str:
    return "ready" if readiness.ready else "NOT READY"


def _covered_mark(report: dict[str, QnnReadiness], op: str) -> str:
    return "no" if any(r.uncovered[op] for r in report.values()) else "yes"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]
