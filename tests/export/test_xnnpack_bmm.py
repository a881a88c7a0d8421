"""etblocks' XNNPACK lowering of `bmm(x, s^T)` (LoRA slots in PEFT's layout): one bmm reading `s` as it lies
(`XNN_FLAG_TRANSPOSE_B`) where ExecuTorch's own lowering serializes a transpose and a bmm; the same results."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from executorch.backends.xnnpack import xnnpack_preprocess
from executorch.backends.xnnpack.operators.node_visitor import _node_visitor_dict
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.backends.xnnpack.serialization.xnnpack_graph_schema import XNNBatchMatrixMultiply, XNNStaticTranspose
from executorch.exir import to_edge_transform_and_lower
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
from torch import nn

from etblocks.backends import get_backend
from etblocks.backends.xnnpack_bmm import BMM, PERMUTE

X, SLOT = torch.randn(1, 5, 24), torch.randn(1, 6, 24)  # x [1, T, in], a slot [1, r, in]: x @ slot^T is [1, 5, 6]


class TransposedOperand(nn.Module):
    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, slot.transpose(1, 2))


class TransposeAlsoReturned(nn.Module):
    """The transpose is a program output too: it must be computed."""

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        transposed = slot.transpose(1, 2)
        return torch.bmm(x, transposed), transposed


def lower(module: nn.Module, etblocks_lowering: bool) -> tuple[list[torch.Tensor], list[object]]:
    """The program's outputs for (X, SLOT) and the XNNPACK nodes it serialized."""
    serialized = []
    serialize = xnnpack_preprocess.serialize_xnnpack_binary

    def recording(graph, *args, **kwargs):
        serialized.extend(node.xnode_union for node in graph.xnodes)
        return serialize(graph, *args, **kwargs)

    exported = torch.export.export(module, (X, SLOT))
    with pytest.MonkeyPatch.context() as patch, get_backend("xnnpack").lowering() if etblocks_lowering else nullcontext():
        patch.setattr(xnnpack_preprocess, "serialize_xnnpack_binary", recording)
        program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch()
    buffer = program.buffer  # kept alive while the program runs
    outputs = _load_for_executorch_from_buffer(buffer).forward([X, SLOT])
    return list(outputs), serialized


def test_a_transposed_operand_is_read_in_place():
    fused, fused_nodes = lower(TransposedOperand(), etblocks_lowering=True)
    stock, stock_nodes = lower(TransposedOperand(), etblocks_lowering=False)
    assert [type(n) for n in stock_nodes] == [XNNStaticTranspose, XNNBatchMatrixMultiply]
    assert stock_nodes[1].flags == 0
    (bmm,) = fused_nodes
    assert isinstance(bmm, XNNBatchMatrixMultiply) and bmm.flags == 1  # XNN_FLAG_TRANSPOSE_B
    assert torch.equal(fused[0], stock[0])
    torch.testing.assert_close(fused[0], X @ SLOT.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_a_transpose_read_elsewhere_is_kept():
    (product, transposed), nodes = lower(TransposeAlsoReturned(), etblocks_lowering=True)
    assert any(isinstance(n, XNNStaticTranspose) for n in nodes)
    assert all(n.flags == 0 for n in nodes if isinstance(n, XNNBatchMatrixMultiply))
    assert torch.equal(transposed, SLOT.transpose(1, 2))
    torch.testing.assert_close(product, X @ SLOT.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_executorch_visitors_are_back_after_lowering():
    stock = {target: _node_visitor_dict[target] for target in (BMM, PERMUTE)}
    with pytest.raises(RuntimeError, match="inside"):
        with get_backend("xnnpack").lowering():
            assert _node_visitor_dict[BMM] is not stock[BMM] and issubclass(_node_visitor_dict[BMM], stock[BMM])
            raise RuntimeError("inside")
    assert {target: _node_visitor_dict[target] for target in (BMM, PERMUTE)} == stock
