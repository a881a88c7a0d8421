"""Graph rewrites before lowering: the rewritten program computes what the original did, and the rewrite
moves the work into the delegate."""

from __future__ import annotations

import pytest
import torch

from etblocks.export.delegation import summarize
from etblocks.backends import get_backend
from etblocks.backends.passes import rms_norm_as_primitives


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
        get_backend("xnnpack").apply_passes(exported)  # what etblocks.export runs before lowering to XNNPACK
    lowered = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    summary = summarize(lowered.exported_program().graph_module)
    if rewrite:
        assert len(summary.partitions) == 1 and summary.n_cpu_ops == 0, summary
    else:
        assert summary.cpu_ops["aten.add.Scalar"] == 2 and summary.cpu_ops["aten.mean.dim"] == 2, summary


def test_backends_without_rewrites_keep_the_norm_whole():
    """Core ML, OpenVINO and QNN take rms_norm as it decomposes: their programs are left as exported."""
    exported = _exported(Norms().eval(), torch.randn(1, 7, 16))
    get_backend("openvino").apply_passes(exported)
    assert sum(n.target == torch.ops.aten.rms_norm.default for n in exported.graph.nodes) == 2


class HFNorms(torch.nn.Module):
    """transformers' RMSNorm (the upstream module, written out as pow, mean, + eps, rsqrt) over `[B, T, D]`, and
    again per head over `[B, T, H, D]` as Qwen3's q/k norms apply it."""

    def __init__(self, heads: int = 3, head_dim: int = 8) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.heads, self.head_dim = heads, head_dim
        self.norm = LlamaRMSNorm(heads * head_dim, eps=1e-5)
        self.head_norm = LlamaRMSNorm(head_dim, eps=1e-6)
        torch.nn.init.normal_(self.norm.weight)
        torch.nn.init.normal_(self.head_norm.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.head_norm(x.view(x.shape[0], -1, self.heads, self.head_dim))


def test_mean_rewrite_keeps_the_values_and_folds_the_eps():
    from etblocks.backends.passes import mean_over_last_dim_as_linear

    module, x = HFNorms().eval(), torch.randn(1, 7, 24)
    exported = _exported(module, x)
    assert mean_over_last_dim_as_linear(exported) == 2
    targets = [n.target for n in exported.graph.nodes]
    assert torch.ops.aten.mean.dim not in targets
    linears = [n for n in exported.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 2 and all(len(n.args) == 3 for n in linears)  # the eps went into the bias
    assert targets.count(torch.ops.aten.add.Tensor) == 0, "the + eps adds were folded into the linears"
    for length in (1, 7, 40):
        x = torch.randn(1, length, 24)
        torch.testing.assert_close(exported.module()(x), module(x), atol=1e-5, rtol=1e-5)


def test_mean_rewrite_keeps_a_mean_whose_sum_is_used_elsewhere():
    """The eps is folded only into a mean whose one user is the add: here the mean is also returned."""
    from etblocks.backends.passes import mean_over_last_dim_as_linear

    class TwoUsers(torch.nn.Module):
        def forward(self, x):
            m = x.pow(2).mean(-1, keepdim=True)
            return torch.rsqrt(m + 1e-5), m

    module, x = TwoUsers(), torch.randn(1, 5, 16)
    exported = _exported(module, x)
    assert mean_over_last_dim_as_linear(exported) == 1
    assert [n.target for n in exported.graph.nodes].count(torch.ops.aten.add.Tensor) == 1
    for got, want in zip(exported.module()(x), module(x)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_dedupe_views_merges_repeated_views_only():
    from etblocks.backends.passes import dedupe_views

    class Views(torch.nn.Module):
        def forward(self, x, table):
            a = x * table.reshape(1, -1, 1, 4)  # the same table viewed twice the same way: one view is enough
            b = x + table.reshape(1, -1, 1, 4)
            return a, b, table.reshape(-1, 4)  # another shape: kept

    module, x, table = Views(), torch.randn(1, 6, 2, 4), torch.randn(1, 6, 4)
    seq = torch.export.Dim("seq", min=1, max=64)
    exported = torch.export.export(module, (x, table), dynamic_shapes=({1: seq}, {1: seq}), strict=False)
    view_ops = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
    views = lambda: sum(n.target in view_ops for n in exported.graph.nodes)
    assert views() == 3
    assert dedupe_views(exported) == 1 and views() == 2
    for got, want in zip(exported.module()(x, table), module(x, table)):
        torch.testing.assert_close(got, want)


class WeightViews(torch.nn.Module):
    """Reads `split` only through views, slices and a transpose (as MLA reads kv_b_proj.weight), `shared` through
    a transpose and directly, and the buffer `table` through a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.split = torch.nn.Parameter(torch.randn(2 * 6, 4))  # two heads of 3 + 3 rows
        self.shared = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("table", torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, T, 4]
        heads = self.split.view(2, 6, 4)
        y = torch.bmm(torch.bmm(x, heads[:, 3:].transpose(1, 2)), heads[:, :3])
        return torch.nn.functional.linear(y, self.shared) + y @ self.shared.t() + y @ self.table.t()


def test_fold_weight_views_stores_a_weight_read_through_views_laid_out():
    """`split` becomes two contiguous constants (its 48 elements as 24 + 24) and leaves the program; `shared`
    (also read directly: folding would store it twice) and the buffer (a program may write buffers) stay. The
    program lowers (the constants' shapes static) and computes what the module does at any length."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from etblocks.backends.passes import fold_weight_views

    module = WeightViews().eval()
    exported = _exported(module, torch.randn(2, 5, 4))
    assert fold_weight_views(exported) == 1
    assert set(exported.state_dict) == {"shared", "table"}
    heads = module.split.detach().view(2, 6, 4)
    constants = {tuple(c.shape): c for c in exported.constants.values()}
    for expected in (heads[:, 3:].transpose(1, 2), heads[:, :3]):
        folded = constants[tuple(expected.shape)]
        assert folded.is_contiguous()
        torch.testing.assert_close(folded, expected, rtol=0, atol=0)
    relayout = (torch.ops.aten.view.default, torch.ops.aten.slice.Tensor, torch.ops.aten.transpose.int)
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    assert sorted(str(u.target) for n in placeholders for u in n.users if u.target in relayout) == []
    assert sorted(str(u.target) for n in placeholders for u in n.users if u.target == torch.ops.aten.t.default) == [
        "aten.t.default", "aten.t.default"]  # shared's and the buffer's, kept
    buffer = to_edge_transform_and_lower(exported).to_executorch().buffer
    method = Runtime.get().load_program(buffer).load_method("forward")
    for length in (1, 5, 9):
        x = torch.randn(2, length, 4)
        with torch.no_grad():
            torch.testing.assert_close(method.execute([x])[0], module(x), rtol=1e-5, atol=1e-5)


def test_mean_rewrite_on_a_graph_whose_first_input_is_a_torchao_weight():
    """The new constants' fake values come from the activation's fake mode: a graph whose first placeholder is a
    torchao-quantized weight (a tensor subclass without one) rewrites, lowers whole and keeps the values."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization import quantize_
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from etblocks.export.weights import WeightQuantization

    class ProjectThenNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(32, 24, bias=False)
            self.norm = LlamaRMSNorm(24, eps=1e-5)
            torch.nn.init.normal_(self.norm.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.proj(x))

    module = ProjectThenNorm().eval()
    quantize_(module, WeightQuantization("8da4w", 32).linear_config(), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
    exported = _exported(module, torch.randn(1, 5, 32))
    first = next(n for n in exported.graph.nodes if n.op == "placeholder")
    assert not hasattr(first.meta["val"], "fake_mode"), "the test needs a subclass weight as the first placeholder"
    get_backend("xnnpack").apply_passes(exported)
    assert torch.ops.aten.mean.dim not in [n.target for n in exported.graph.nodes]
    x = torch.randn(1, 9, 32)
    torch.testing.assert_close(exported.module()(x), module(x), atol=1e-5, rtol=1e-5)
    lowered = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    summary = summarize(lowered.exported_program().graph_module)
    assert len(summary.partitions) == 1 and summary.n_cpu_ops == 0, summary


def test_inverse_square_root_rewrite_keeps_gemma_norms_in_the_delegate():
    """Gemma 4's norm (`x * torch.pow(mean(x^2) + eps, -0.5)`, with and without a scale) against the upstream
    module: the values stay within a rounding of it, and after the xnnpack passes XNNPACK takes the whole graph
    (left as `pow`, the inverse square root stays on the CPU and splits the delegate)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from etblocks.backends.passes import inverse_square_root_as_rsqrt

    torch.manual_seed(0)
    norms = torch.nn.Sequential(Gemma4RMSNorm(16), Gemma4RMSNorm(16, with_scale=False)).eval()
    torch.nn.init.normal_(norms[0].weight)
    exported = _exported(norms, torch.randn(1, 7, 16))
    assert inverse_square_root_as_rsqrt(exported) == 2
    assert not any(n.target == torch.ops.aten.pow.Tensor_Scalar and n.args[1] == -0.5 for n in exported.graph.nodes)
    for length in (1, 7, 40):
        x = torch.randn(1, length, 16)
        torch.testing.assert_close(exported.module()(x), norms(x), atol=1e-6, rtol=1e-6)

    exported = _exported(norms, torch.randn(1, 7, 16))
    get_backend("xnnpack").apply_passes(exported)
    lowered = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    summary = summarize(lowered.exported_program().graph_module)
    assert len(summary.partitions) == 1 and summary.n_cpu_ops == 0, summary
