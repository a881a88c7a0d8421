"""Hybrid partition: delegate the fixed-shape projections and MLP, keep every in-place state update and attention's
dynamic-length attention on CPU (ExecuTorch forum, "Support of Dynamic and Static Shape in One Module").

An NPU holds no state between calls and takes fixed shapes only; state updates and the attention over the filled
part of a cache are neither. Everything else of a static program is, so it goes to the delegate.
`keep_on_cpu` is the partitioner filter underneath, also used to keep LoRA slot reads off the delegate.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.export import ExportedProgram

from etblocks.attention.sdpa import SDPA
from etblocks.errors import ConfigError
from etblocks.state.base import State


def _subclass_names(cls: type) -> set[str]:
    names, todo = set(), [cls]
    while todo:
        current = todo.pop()
        names.add(f"{current.__module__}.{current.__qualname__}")
        todo.extend(current.__subclasses__())
    return names


def attention_core_types() -> set[str]:
    """Qualified names of every SDPA and `State` class (subclasses included) as module stacks record them."""
    return _subclass_names(SDPA) | _subclass_names(State)


def in_attention_core(node: torch.fx.Node, core: set[str]) -> bool:
    """Whether `node` was traced inside one of the `core` module types (by the node's module stack)."""
    for _, module_type in node.meta.get("nn_module_stack", {}).values():
        name = module_type if isinstance(module_type, str) else f"{module_type.__module__}.{module_type.__qualname__}"
        if name in core:
            return True
    return False


def attention_on_cpu(partitioner):
    """Wrap a configuration-based partitioner (XNNPACK's) so it leaves attention-core nodes on CPU."""
    core = attention_core_types()
    return keep_on_cpu(partitioner, lambda ep, node: in_attention_core(node, core), "partition='hybrid'")


def keep_on_cpu(partitioner, rule: Callable[[ExportedProgram, torch.fx.Node], bool], why: str):
    """Wrap a configuration-based partitioner so no partition holds a node for which `rule(ep, node)` holds;
    the remaining matches are regrouped (convex partitions, as the partitioner itself would make them)."""
    from executorch.exir.backend.canonical_partitioners.config_partitioner import ConfigerationBasedPartitioner
    from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
        generate_grouped_partitions_from_list_of_nodes,
    )
    from executorch.exir.backend.partitioner import Partitioner, PartitionResult

    if not isinstance(partitioner, ConfigerationBasedPartitioner):
        raise ConfigError(f"{why} works with configuration-based partitioners (XNNPACK); got {type(partitioner).__name__}")

    class KeepOnCpu(Partitioner):
        def ops_to_not_decompose(self, ep):
            return partitioner.ops_to_not_decompose(ep)

        def partition(self, ep) -> PartitionResult:
            groups = [
                group
                for group in partitioner.get_matched_nodes_from_configs(ep)
                if not any(rule(ep, node) for node in group)
            ]
            tags = {}
            for found in generate_grouped_partitions_from_list_of_nodes(ep.graph_module, groups):
                tag = f"tag{found.id}"
                for node in found.nodes:
                    node.meta["delegation_tag"] = tag
                tags[tag] = partitioner.delegation_spec
            return PartitionResult(tagged_exported_program=ep, partition_tags=tags)

    return KeepOnCpu()
