"""What a lowered program delegates: ops per delegate, ops left on CPU, partitions."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class DelegationSummary:
    """`partitions` lists `(backend_id, op count)` per delegated subgraph; `delegated_ops` counts the ops inside
    them by name; `cpu_ops` counts the kernels that stay outside any delegate (symbolic-shape bookkeeping is not
    counted)."""

    partitions: list[tuple[str, int]] = field(default_factory=list)
    cpu_ops: Counter = field(default_factory=Counter)
    delegated_ops: Counter = field(default_factory=Counter)

    @property
    def ops_per_delegate(self) -> dict[str, int]:
        totals: Counter = Counter()
        for backend_id, count in self.partitions:
            totals[backend_id] += count
        return dict(totals)

    @classmethod
    def combine(cls, summaries) -> DelegationSummary:
        """One summary for several methods of a program."""
        total = cls()
        for summary in summaries:
            total.partitions.extend(summary.partitions)
            total.cpu_ops.update(summary.cpu_ops)
            total.delegated_ops.update(summary.delegated_ops)
        return total

    @property
    def n_cpu_ops(self) -> int:
        return sum(self.cpu_ops.values())

    def __str__(self) -> str:
        delegated = ", ".join(f"{k}: {v} ops" for k, v in self.ops_per_delegate.items()) or "nothing delegated"
        cpu = ", ".join(f"{op} x{n}" for op, n in self.cpu_ops.most_common())
        return f"{len(self.partitions)} partitions ({delegated}); {self.n_cpu_ops} ops on CPU" + (f": {cpu}" if cpu else "")


# Shape bookkeeping that runs no kernel worth counting: symbolic sizes, their asserts, Python scalar math.
_BOOKKEEPING = {"getitem", "sym_size", "_assert_scalar", "_local_scalar_dense", "sym_constrain_range_for_size"}


def _op_name(node: torch.fx.Node) -> str | None:
    """The kernel a node runs, or None for bookkeeping. In-place custom ops show under their own name."""
    if node.op != "call_function":
        return None
    target = node.target
    if "auto_functionalized" in str(target):
        target = node.args[0]  # the mutating op it wraps, e.g. llama.update_cache (in place after to_executorch)
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and not hasattr(target, "_op"):
        if getattr(target, "__name__", "") != "executorch_call_delegate":
            return None  # operator.add and friends on symbolic ints
    name = (str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target)))
    name = name.replace(".default", "")
    return None if any(part in _BOOKKEEPING for part in name.split(".")) else name


def summarize(graph_module: torch.fx.GraphModule) -> DelegationSummary:
    """The summary of a lowered method's graph, control-flow branches (`torch.cond` subgraphs) included."""
    summary = DelegationSummary()
    for node in graph_module.graph.nodes:
        name = _op_name(node)
        if name is None:
            continue
        if name == "executorch_call_delegate":
            lowered = getattr(graph_module, node.args[0].target)
            inner = [name for name in map(_op_name, lowered.original_module.graph.nodes) if name is not None]
            summary.partitions.append((lowered.backend_id, len(inner)))
            summary.delegated_ops.update(inner)
        else:
            summary.cpu_ops[name] += 1
    branches = [child for child in graph_module.children() if isinstance(child, torch.fx.GraphModule)]
    return DelegationSummary.combine([summary, *map(summarize, branches)])
