"""Graph rewrites before lowering: the rewritten program computes what the original did, and the rewrite
moves the work into the delegate."""

from __future__ import annotations

import pytest
import torch

from etblocks.export.delegation import summarize
from etblocks.export.passes import apply_backend_passes, rms_norm_as_primitives


class Norms(torch.nn.Module):
    """`torch.nn.RMSNorm` (what torchtune's RMSNorm calls: `F.rms_norm`) with and without a weight."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.with_weight = torch.nn.RMSNorm(dim, eps=1e-5)
        self.without_weight = torch.nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        torch.nn.init.normal_(self.with_weight.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.without_weight(self.with_weight(x) * 3.0)


def _exported(module: torch.nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    seq = torch.export.Dim("seq", min=1, max=64)
    return torch.export.export(module, (x,), dynamic_shapes=({1: seq},), strict=False)


def test_rms_norm_rewrite_keeps_the_values():
    module, x = Norms().eval(), torch.randn(1, 7, 16)
    exported = _exported(module, x)
    assert rms_norm_as_primitives(exported) == 2
    assert not any(n.target == torch.ops.aten.rms_norm.default for n in exported.graph.nodes)
    for length in (1, 7, 40):
        x = torch.randn(1, length, 16)
        torch.testing.assert_close(exported.module()(x), module(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rewrite", [False, True])
def test_rms_norm_rewrite_lets_xnnpack_take_the_norms(rewrite):
    """Left whole, each norm decomposes with a scalar add and a mean that XNNPACK does not take, which stay on
    CPU; rewritten, the whole graph is one partition."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    exported = _exported(Norms().eval(), torch.randn(1, 7, 16))
    if rewrite:
        apply_backend_passes(exported, "xnnpack")  # what etblocks.export runs before lowering to XNNPACK
    lowered = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    summary = summarize(lowered.exported_program().graph_module)
    if rewrite:
        assert len(summary.partitions) == 1 and summary.n_cpu_ops == 0, summary
    else:
        assert summary.cpu_ops["aten.add.Scalar"] == 2 and summary.cpu_ops["aten.mean.dim"] == 2, summary


def test_backends_without_rewrites_keep_the_norm_whole():
    """Core ML, OpenVINO and QNN take rms_norm as it decomposes: their programs are left as exported."""
    exported = _exported(Norms().eval(), torch.randn(1, 7, 16))
    apply_backend_passes(exported, "openvino")
    assert sum(n.target == torch.ops.aten.rms_norm.default for n in exported.graph.nodes) == 2
