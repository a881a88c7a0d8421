"""Graph rewrites applied to an exported program before lowering, per backend."""

from __future__ import annotations

import torch


def _set_val(node: torch.fx.Node, fn, *args) -> None:
    fake = args[0].meta["val"]
    with fake.fake_mode:
        node.meta["val"] = fn(fake, *[a for a in args[1:]])


def mean_over_last_dim_as_pooling(exported: torch.export.ExportedProgram) -> int:
    """Rewrite `mean(x [B, T, D], dim=-1, keepdim=True)` (every RMSNorm) as a mean over the last two dims of
    `x [B, T, D, 1]`.

    XNNPACK delegates mean.dim only as 4-D global average pooling; the 3-D form stays on CPU and splits the
    graph into a partition per norm, each a separate delegate call per token. Returns the number rewritten.
    """
    graph = exported.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.mean.dim or node.kwargs.get("dtype"):
            continue
        x, dims = node.args[0], node.args[1]
        keepdim = len(node.args) > 2 and node.args[2]
        rank = x.meta["val"].dim()
        if rank != 3 or not keepdim or [d % rank for d in dims] != [2]:
            continue
        if sum(not isinstance(size, int) for size in x.meta["val"].shape) > 1:
            continue  # a view may infer one size only
        with graph.inserting_before(node):
            expanded = graph.call_function(torch.ops.aten.unsqueeze.default, (x, 3))
            _set_val(expanded, torch.ops.aten.unsqueeze.default, x, 3)
            pooled = graph.call_function(torch.ops.aten.mean.dim, (expanded, [2, 3], True))
            _set_val(pooled, torch.ops.aten.mean.dim, expanded, [2, 3], True)
            # A view with -1 for the dynamic size, not squeeze: XNNPACK delegates exactly that form.
            sizes = [size if isinstance(size, int) else -1 for size in x.meta["val"].shape[:2]]
            squeezed = graph.call_function(torch.ops.aten.view.default, (pooled, [*sizes, 1]))
            _set_val(squeezed, lambda p: p.view(*p.shape[:2], 1), pooled)
        squeezed.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(squeezed)
        graph.erase_node(node)
        rewritten += 1
    exported.graph_module.recompile()
    return rewritten


BACKEND_PASSES = {"xnnpack": [mean_over_last_dim_as_pooling]}
