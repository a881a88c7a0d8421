"""Graph rewrites of an exported program before lowering; each backend picks its own (`Backend.graph_passes`).
Core ML, OpenVINO and QNN take rms_norm as it decomposes (QNN has its own RmsNorm op): they use none of those.
Every backend gets `fold_weight_views` (`Backend.apply_passes`)."""

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
    every norm splits the graph; written out here, `mean_over_last_dim_as_linear` then makes the mean delegable
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


def _constant(exported: torch.export.ExportedProgram, name: str, data: torch.Tensor, like: torch.fx.Node) -> torch.fx.Node:
    """A new lifted constant tensor placeholder named `name` holding `data`, its fake value made in the fake mode of
    `like`'s. (ExecuTorch's `create_constant_placeholder` takes the mode from the graph's first node, which fails
    when that node is a torchao-quantized weight.)

    workaround(executorch 1.5.1): the placeholder is made here, not with `create_constant_placeholder`.
    """
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    graph = exported.graph_module.graph
    specs = exported.graph_signature.input_specs
    first_user_input = next(i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(placeholders[first_user_input]):
        node = graph.placeholder(name)
    node.meta["val"] = like.meta["val"].fake_mode.from_tensor(data, static_shapes=True)  # else sizes come out symbolic
    exported.constants[node.name] = data
    specs.insert(first_user_input, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), node.name))
    return node


# Ops that only lay out their one tensor input again: over a weight they give the same tensor on every call.
_LAYOUT_OPS = {
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int, torch.ops.aten.t.default, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
}


def fold_weight_views(exported: torch.export.ExportedProgram) -> int:
    """Replace the views, slices and transposes a block takes of a weight at call time (MLA's absorbed W_UK and
    W_UV^T, read from `kv_b_proj.weight`) by contiguous constants holding their results, and drop the weight.

    Kept as views in the block so they follow weight loads and dtype moves, they would be sliced and transposed
    (copied) on every call of the program. A weight is folded only when it is read through such ops alone and
    the results hold no more elements than it, so the program grows by nothing. Only parameters and constants
    are folded (buffers may be written, LoRA slots by another method), and only layout ops: a dequantize of an
    int weight stays as it is. Returns the number of weights folded.
    """
    from executorch.backends.transforms.utils import delete_constant_placeholder
    from torch.fx.node import map_arg

    graph = exported.graph_module.graph
    signature = exported.graph_signature
    weights = {**signature.inputs_to_parameters, **signature.inputs_to_lifted_tensor_constants}
    tensors = {**exported.state_dict, **exported.constants}
    folded = 0
    for root in [n for n in graph.nodes if n.op == "placeholder" and n.name in weights]:
        values, chain, frontier = {root: tensors[weights[root.name]].detach()}, [], [root]
        while frontier:
            for user in frontier.pop().users:
                if user.target in _LAYOUT_OPS and all(arg in values for arg in user.all_input_nodes):
                    values[user] = user.target(*map_arg(user.args, values.get), **map_arg(user.kwargs, values.get))
                    chain.append(user)
                    frontier.append(user)
        ends = [node for node in chain if any(user not in values for user in node.users)]
        read_directly = any(user not in values for user in root.users)
        if not chain or read_directly or sum(values[n].numel() for n in ends) > values[root].numel():
            continue
        for end in ends:
            data = values[end].clone(memory_format=torch.contiguous_format)
            constant = _constant(exported, f"_etblocks_folded_{end.name}", data, like=end)
            end.replace_all_uses_with(constant, delete_user_cb=lambda user: user not in values)
        for node in reversed(chain):
            graph.erase_node(node)
        delete_constant_placeholder(exported, root)
        folded += 1
    exported.graph_module.recompile()
    return folded


def _scalar_constant(exported: torch.export.ExportedProgram, arg) -> float | None:
    """`arg` as a Python number if it is one or a one-element lifted constant, else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
        name = exported.graph_signature.inputs_to_lifted_tensor_constants.get(arg.name)
        value = exported.constants.get(name) if name is not None else None
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            return float(value)
    return None


def mean_over_last_dim_as_linear(exported: torch.export.ExportedProgram) -> int:
    """Rewrite `mean(x [..., D], dim=-1, keepdim=True)` (every RMSNorm, and per-head q/k norms) as
    `linear(x, ones(1, D) / D)`, and a following `+ eps` as that linear's bias.

    XNNPACK delegates mean.dim only as 4-D global average pooling, which needs `x` viewed as an image and back: three
    operators, and a fourth for the eps, where one linear does it. At one token every delegated operator costs its
    own reshape, setup and run on every call, and a Llama has two norms per layer. Returns the number rewritten.
    """
    graph = exported.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.mean.dim or node.kwargs.get("dtype"):
            continue
        x, dims = node.args[0], node.args[1]
        keepdim = len(node.args) > 2 and node.args[2]
        value = x.meta["val"]
        if not keepdim or len(dims) != 1 or dims[0] % value.dim() != value.dim() - 1 or not value.is_floating_point():
            continue
        size = value.shape[-1]
        if not isinstance(size, int):
            continue
        users = list(node.users)
        eps = None
        if len(users) == 1 and users[0].target == torch.ops.aten.add.Tensor and users[0].args[0] is node:
            eps = _scalar_constant(exported, users[0].args[1]) if len(users[0].args) == 2 and not users[0].kwargs else None
        # workaround(executorch 1.5.1): one constant per norm; a constant that several delegates read fails to lower.
        weight = torch.full((1, size), 1.0 / size, dtype=value.dtype)
        args = (x, _constant(exported, f"_etblocks_mean_weight_{node.name}", weight, like=x))
        if eps is not None:
            args += (_constant(exported, f"_etblocks_mean_bias_{node.name}", torch.tensor([eps], dtype=value.dtype), like=x),)
        with graph.inserting_before(node):
            linear = graph.call_function(torch.ops.aten.linear.default, args)
            _set_val(linear, torch.ops.aten.linear.default, *args)
        _replace(graph, users[0] if eps is not None else node, linear)
        if eps is not None:
            graph.erase_node(node)
        rewritten += 1
    exported.graph_module.recompile()
    return rewritten


def inverse_square_root_as_rsqrt(exported: torch.export.ExportedProgram) -> int:
    """Rewrite `pow(x, -0.5)` as `rsqrt(x)`. Gemma 3n's and Gemma 4's norms write their inverse square root so
    (`x * torch.pow(mean(x^2) + eps, -0.5)`), which XNNPACK does not take: left as it is, every norm runs one
    operator on the CPU between two delegates (72 of them and 117 delegates for a 10-layer Gemma 4 stack). Returns
    the number rewritten."""
    graph = exported.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.pow.Tensor_Scalar or node.args[1] != -0.5:
            continue
        with graph.inserting_before(node):
            rsqrt = graph.call_function(torch.ops.aten.rsqrt.default, (node.args[0],))
            _set_val(rsqrt, torch.ops.aten.rsqrt.default, node.args[0])
        _replace(graph, node, rsqrt)
        rewritten += 1
    exported.graph_module.recompile()
    return rewritten


def dedupe_views(exported: torch.export.ExportedProgram) -> int:
    """Merge views that repeat one another: the same tensor viewed to the same sizes. Each layer views the rope
    tables, computed once per step, again for its queries and its keys; merged, they are viewed once per step, where
    an XNNPACK delegate runs each view as a copy operator of its own. The exported graph is functional (buffer
    writes are lifted out, custom in-place ops functionalized), so two such views hold the same values wherever
    they are. Returns the number merged.

    (Merging the dynamic quantization that q, k, v (and gate, up) each apply to the same activation saves more
    operators, but ExecuTorch 1.5.1's XNNPACK partitioner then splits every MLP into two delegates.)

    workaround(executorch 1.5.1): the dynamic quantizations above are left unmerged, for that partitioner.
    """
    graph = exported.graph_module.graph
    views = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in views or node.kwargs:
            continue
        key = (node.target, node.args[0], tuple(node.args[1]))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    exported.graph_module.recompile()
    return merged

