"""Graph rewrites applied to an exported program before lowering, per backend."""

from __future__ import annotations

import torch


def _set_val(node: torch.fx.Node, fn, *args) -> None:
    fake = args[0].meta["val"]
    with fake.fake_mode:
        node.meta["val"] = fn(fake, *[a for a in args[1:]])


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
        restored.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(restored)
        graph.erase_node(node)
        rewritten += 1
    exported.graph_module.recompile()
    return rewritten


BACKEND_PASSES = {"xnnpack": [mean_over_last_dim_as_pooling]}
