"""The delegation summary counts what runs where, control-flow branches included."""

from __future__ import annotations

import torch

from etblocks.export.delegation import summarize


class Branching(torch.nn.Module):
    """A `torch.cond` whose branches run ops of their own (what ExecuTorch's torchtune attention exports)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: torch.sin(x) * 2, lambda x: torch.cos(x) - 1, (x,))


def test_ops_inside_cond_branches_are_counted():
    from executorch.exir import EdgeCompileConfig, to_edge

    exported = torch.export.export(Branching(), (torch.randn(4),), strict=False)
    edge = to_edge(exported, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    summary = summarize(edge.exported_program().graph_module)
    assert not summary.partitions
    for op in ("aten.sin", "aten.mul.Tensor", "aten.cos", "aten.sub.Tensor", "aten.sum.dim_IntList"):
        assert summary.cpu_ops[op] == 1, summary
