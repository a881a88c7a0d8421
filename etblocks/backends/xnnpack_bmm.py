"""XNNPACK's batched matmul reading a transposed right operand in place.

LoRA slots reach a program's matmuls at run time in PEFT's layout (`A [r, in]`, `B [out, r]`), so the right operand
of `x @ A^T` is a transpose: `bmm(x, permute(slot))`. ExecuTorch 1.5.1 serializes that as a transpose operator and
a bmm, and XNNPACK packs a run-time right operand on every call: from `[K, N]` with a scalar kernel on x86, from
`[N, K]` (`XNN_FLAG_TRANSPOSE_B`) with the vectorized one it packs linear weights with. While `transposed_operands()`
is active, a float bmm whose right operand is a transpose of its last two dims that only bmms read is serialized as
one bmm with that flag, reading the transpose's input as it lies; the transpose is not serialized. Same products,
same packed weights, so the same results.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

BMM, PERMUTE = "aten.bmm.default", "aten.permute_copy.default"


def _target(node: object) -> str:
    return getattr(getattr(node, "target", None), "__name__", "")


def _float(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32


def read_transposed(permute: torch.fx.Node) -> bool:
    """Whether `permute` swaps the last two dims of a 3-d float tensor that bmms alone read, each as its right
    operand."""
    if _target(permute) != PERMUTE or not _float(permute) or permute.meta["val"].dim() != 3:
        return False
    readers = list(permute.users)
    return (
        [dim % 3 for dim in permute.args[1]] == [0, 2, 1]
        and bool(readers)
        and all(_target(r) == BMM and r.args[1] is permute and r.args[0] is not permute and _float(r) for r in readers)
    )


def _visitors(stock_bmm: type, stock_permute: type) -> tuple[type, type]:
    from executorch.backends.xnnpack.operators.quant_params import QuantParams
    from executorch.backends.xnnpack.serialization.xnnpack_graph_schema import XNNBatchMatrixMultiply, XNode
    from executorch.backends.xnnpack.utils.xnnpack_constants import XNN_FLAG_TRANSPOSE_B

    def read_in_place(permute: torch.fx.Node, program: torch.export.ExportedProgram) -> bool:
        """`read_transposed`, by bmms with no quantized input or output (their visitor's stock path handles those)."""
        return read_transposed(permute) and all(
            QuantParams.from_outputs(bmm) is None
            and all(QuantParams.from_inputs(value, program) is None for value in (bmm.args[0], permute.args[0]))
            for bmm in permute.users
        )

    class TransposedOperandBMM(stock_bmm):
        def define_node(self, node, xnn_graph, vals_to_ids, debug_handle) -> None:
            left, right = node.args[0], node.args[1]
            if not read_in_place(right, self.exported_program):
                return super().define_node(node, xnn_graph, vals_to_ids, debug_handle)
            source = right.args[0]
            for value in (node, left, source):
                self.define_tensor(value, xnn_graph, vals_to_ids)
            bmm = XNNBatchMatrixMultiply(
                input1_id=vals_to_ids[left], input2_id=vals_to_ids[source], output_id=vals_to_ids[node],
                flags=XNN_FLAG_TRANSPOSE_B,
            )
            xnn_graph.xnodes.append(XNode(xnode_union=bmm, debug_handle=debug_handle))

    class ReadInPlacePermute(stock_permute):
        def define_node(self, node, xnn_graph, vals_to_ids, debug_handle) -> None:
            if not read_in_place(node, self.exported_program):  # else its readers take its input transposed
                super().define_node(node, xnn_graph, vals_to_ids, debug_handle)

    return TransposedOperandBMM, ReadInPlacePermute


@contextmanager
def transposed_operands() -> Iterator[None]:
    """XNNPACK lowering inside the block serializes bmms of transposed operands as described above; ExecuTorch's
    own visitors are back after it.

    workaround(executorch 1.5.1): its bmm visitor always passes flags=0, and `register_node_visitor` returns None,
    so the stock visitor classes are reachable only through its registry.
    """
    from executorch.backends.xnnpack.operators.node_visitor import _node_visitor_dict as registry

    stock = {BMM: registry[BMM], PERMUTE: registry[PERMUTE]}
    registry[BMM], registry[PERMUTE] = _visitors(stock[BMM], stock[PERMUTE])
    try:
        yield
    finally:
        registry.update(stock)
