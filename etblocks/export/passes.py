"""Graph rewrites applied to an exported program before lowering, per backend."""

from __future__ import annotations

import torch


def _set_val(node: torch.fx.Node, fn, *args) -> None:
    """`node`'s fake value: `fn` over the fake values of the node arguments (the first one is a node) and the rest."""
    fakes = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    with fakes[0].fake_mode:
        node.meta["val"] = fn(*fakes)


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, new: torch.fx.Node) -> None:
    """`new` takes `node`'s place (and its metadata but the value)."""
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def rms_norm_as_primitives(exported: torch.export.ExportedProgram) -> int:
    """Rewrite `aten.rms_norm(x, [D], weight, eps)` (`F.rms_norm`: torchtune's and `torch.nn`'s RMSNorm) as
    `x * rsqrt(mean(x^2, -1) + eps) * weight`, the form transformers' norms export as.

    Left whole, to_edge decomposes it with a scalar add (`add.Scalar`) that neither XNNPACK nor Vulkan takes, so
    every norm splits the graph; written out here, `mean_over_last_dim_as_pooling` then makes the mean poolable
    too. Returns the number rewritten.
    """
    graph = exported.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.rms_norm.default:
            continue
        x, normalized_shape = node.args[0], node.args[1]
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        eps = node.args[3] if len(node.args) > 3 else node.kwargs.get("eps")
        if len(normalized_shape) != 1 or eps is None:
            continue  # a norm over several dims, or the dtype's own eps: leave it to the default decomposition
        aten = torch.ops.aten
        with graph.inserting_before(node):
            steps = [(aten.pow.Tensor_Scalar, (x, 2)), (aten.mean.dim, (None, [-1], True)), (aten.add.Tensor, (None, eps)),
                     (aten.rsqrt.default, (None,)), (aten.mul.Tensor, (x, None))]
            if weight is not None:
                steps.append((aten.mul.Tensor, (None, weight)))
            previous = None
            for target, args in steps:
                args = tuple(previous if a is None else a for a in args)
                previous = graph.call_function(target, args)
                _set_val(previous, target, *args)
        _replace(graph, node, previous)
        rewritten += 1
    exported.graph_module.recompile()
    return rewritten


def mean_over_last_dim_as_pooling(exported: torch.export.ExportedProgram) -> int:
    """Rewrite `mean(x [B, ..., D], dim=-1, keepdim=True)` (every RMSNorm, and per-head q/k norms on
    `[B, T, H, D]`) as a mean over the last two dims of `x` viewed as `[B, N, D, 1]`.

    XNNPACK delegates mean.dim only as 4-D global average pooling; the other forms stay on CPU and split the
    graph into a partition per norm, each a separate delegate call per token. Returns the number rewritten.
    """
    graph = exported.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.mean.dim or node.kwargs.get("dtype"):
            continue
        x, dims = node.args[0], node.args[1]
        keepdim = len(node.args) > 2 and node.args[2]
        shape = x.meta["val"].shape
        if len(shape) not in (3, 4) or not keepdim or [d % len(shape) for d in dims] != [len(shape) - 1]:
            continue
        if sum(not isinstance(size, int) for size in shape) > 1 or not isinstance(shape[0], int):
            continue  # a view may infer one size only
        # Views with -1 for the one dynamic size, not (un)squeeze: XNNPACK delegates exactly that form.
        rows = [shape[0], -1, shape[-1], 1]
        out_sizes = [size if isinstance(size, int) else -1 for size in shape[:-1]] + [1]
        with graph.inserting_before(node):
            as_image = graph.call_function(torch.ops.aten.view.default, (x, rows))
            _set_val(as_image, torch.ops.aten.view.default, x, rows)
            pooled = graph.call_function(torch.ops.aten.mean.dim, (as_image, [2, 3], True))
            _set_val(pooled, torch.ops.aten.mean.dim, as_image, [2, 3], True)
            restored = graph.call_function(torch.ops.aten.view.default, (pooled, out_sizes))
            _set_val(restored, lambda p: p.view(*shape[:-1], 1), pooled)
        _replace(graph, node, restored)
        rewritten += 1
    exported.graph_module.recompile()
    return rewritten


# Core ML, OpenVINO and QNN take rms_norm as it decomposes (QNN has its own RmsNorm op): no rewrite for them.
BACKEND_PASSES = {"xnnpack": [rms_norm_as_primitives, mean_over_last_dim_as_pooling], "vulkan": [rms_norm_as_primitives]}


def apply_backend_passes(exported: torch.export.ExportedProgram, backend: str) -> None:
    """Rewrite `exported` in place with `backend`'s passes (none for a backend without any), before lowering."""
    for rewrite in BACKEND_PASSES.get(backend, []):
        rewrite(exported)
