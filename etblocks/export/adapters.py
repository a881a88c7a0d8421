"""Adapters switched at run time: every `LoRALinear` computes its LoRA path from a "slot", `slot_a = A^T
[in, r]` and `slot_b = scale * B^T [r, out]`, zero-padded to the largest rank loaded there (all zeros is the
base model). Layers that read one input (q/k/v, gate/up, a single-head block's heads) share one `slot_a` with
their targets' A side by side, so a program computes `x @ A^T` once for them (`SharedInput`): the LoRA path of
a layer costs two small matmuls with operands that arrive at run time, and most of that is per call.

- Dynamic programs keep the slots as mutable buffers that a second method, `set_adapter(*slots)` (in
  `AdapterTable.input_names` order), copies new values into. Both methods share them (`share_mutable_buffers`),
  so a switch is one call moving the adapter's own bytes; the base is loaded and packed once. The slot table
  travels in the `etblocks_adapters` constant method.
- Static programs take the slots as their last inputs (`SlotInputs`): NPUs hold no state between calls, so the
  runner passes the active adapter's slots with every `prefill` and `decode`. The table is in the contract.

A delegate must not read slot buffers: it would serialize their initial zeros as constants and ignore every
switch. `keep_slots_on_cpu` leaves the ops that read them (the views `LoRALinear` takes, aliases of the buffers
at run time) on CPU, so the LoRA matmuls, delegated with everything else, receive the slots as run-time inputs.

That is the slots' cost: XNNPACK packs an operand that arrives at run time on every call, where it packs a
constant once at load. With `adapter_mode="programs"` each adapter is instead a program of its own, exported with
that adapter active (`adapter_baked`): its tensors are constants of that program, every
other weight is read from the base program's data file (`etblocks.export.external`), so the adapter costs two small
linears and an add per adapted layer (its scale folded into `lora_B`) and a switch loads the adapter's program.
"""

from __future__ import annotations

import glob
import json
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from etblocks.adapters.lora import LoRALinear, LoRATensors, SharedInput
from etblocks.errors import AdapterMismatchError, ConfigError
from etblocks.export.hybrid import keep_on_cpu
from etblocks.options import ADAPTER_MODES
from etblocks.state.base import reset_states

ADAPTER_SLOTS, ADAPTER_PROGRAMS = ADAPTER_MODES
ADAPTERS_METHOD = "etblocks_adapters"
SET_ADAPTER_METHOD = "set_adapter"
SLOT_BUFFERS = ("slot_a", "slot_b")


@dataclass(frozen=True)
class AdapterSlot:
    """One `LoRALinear` of the program: it computes output `rows` (None: all) of upstream module `target`, from
    adapters of rank <= `rank`. `group` is the index of the first slot of the layers that share its input and so
    one `slot_a` (`SharedInput`); None, its own (programs before groups have none)."""

    target: str
    rows: tuple[int, int] | None
    in_features: int
    out_features: int
    rank: int
    group: int | None = None

    @classmethod
    def from_dict(cls, body: dict) -> AdapterSlot:
        """From its JSON form (`rows` a list there)."""
        return cls(**{**body, "rows": tuple(body["rows"]) if body["rows"] else None})


@dataclass(frozen=True)
class AdapterTable:
    """The program's slots and their dtype. `set_adapter` (and a static program after its other inputs) takes,
    slot by slot, the group's `slot_a [in, R]` at the group's first slot, then the slot's `slot_b [R, out]`: R
    is the sum of the ranks of the group's targets, each target's A in its own columns."""

    slots: tuple[AdapterSlot, ...]
    dtype: str

    def group_of(self, index: int) -> int:
        """The group of slot `index`: the index of the first slot sharing its `slot_a` (its own if none does)."""
        group = self.slots[index].group
        return index if group is None else group

    def columns(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Per group (the index of its first slot): `{target: (first column, rank)}` of its `slot_a`; the group's
        width is `group_rank` of it."""
        groups: dict[int, dict[str, tuple[int, int]]] = {}
        for index, slot in enumerate(self.slots):
            columns = groups.setdefault(self.group_of(index), {})
            if slot.target not in columns:
                columns[slot.target] = (group_rank(columns), slot.rank)
        return groups

    def input_names(self) -> list[str]:
        """`slot_a.<i>` for each group's first slot `i`, `slot_b.<i>` for every slot, in input order."""
        return [
            name for index in range(len(self.slots))
            for name in ([f"slot_a.{index}"] if self.group_of(index) == index else []) + [f"slot_b.{index}"]
        ]

    def inputs(self, tensors: dict[str, LoRATensors] | None, scale: float = 1.0) -> list[torch.Tensor]:
        """`set_adapter`'s inputs for an adapter (`{target: LoRATensors}`; None: the base model), checked first:
        `AdapterMismatchError` for a target the program lacks or a shape or rank that does not fit."""
        if tensors is not None:
            self.check(tensors)
        tensors = tensors or {}
        dtype = getattr(torch, self.dtype)
        groups = self.columns()
        inputs = []
        for index, slot in enumerate(self.slots):
            columns = groups[self.group_of(index)]
            width = group_rank(columns)
            if self.group_of(index) == index:
                slot_a = torch.zeros(slot.in_features, width, dtype=dtype)
                for target, (first, _) in columns.items():
                    if target in tensors:
                        lora_A = tensors[target].lora_A
                        slot_a[:, first : first + lora_A.shape[0]] = lora_A.T
                inputs.append(slot_a)
            slot_b = torch.zeros(width, slot.out_features, dtype=dtype)
            if slot.target in tensors:
                lora_A, lora_B, factor = tensors[slot.target]
                lora_B = lora_B if slot.rows is None else lora_B[slot.rows[0] : slot.rows[1]]
                first = columns[slot.target][0]
                slot_b[first : first + lora_A.shape[0]] = lora_B.T * (factor * scale)
            inputs.append(slot_b)
        return inputs

    def check(self, tensors: dict[str, LoRATensors]) -> None:
        """Every target of the adapter has slots here, whose shapes take its tensors at a rank they can hold."""
        by_target: dict[str, list[AdapterSlot]] = {}
        for slot in self.slots:
            by_target.setdefault(slot.target, []).append(slot)
        for target, (lora_A, lora_B, _) in tensors.items():
            slots = by_target.get(target)
            if slots is None:
                raise AdapterMismatchError(
                    f"the adapter targets {target}, which has no LoRA slot in this program (slots: "
                    f"{sorted(by_target)[:4]}{' ...' if len(by_target) > 4 else ''}); was it made for this base, and "
                    "was an adapter with this target loaded before export?"
                )
            in_features = slots[0].in_features
            out_features = max(s.rows[1] if s.rows else s.out_features for s in slots)
            rank = min(s.rank for s in slots)
            if lora_A.shape[1] != in_features or lora_B.shape[0] != out_features or lora_A.shape[0] > rank:
                raise AdapterMismatchError(
                    f"{target}: the adapter has lora_A {list(lora_A.shape)}, lora_B {list(lora_B.shape)}; this program's "
                    f"slot takes lora_A [r, {in_features}] and lora_B [{out_features}, r] with r <= {rank}"
                )

    def to_json(self) -> str:
        return json.dumps({"slots": [asdict(slot) for slot in self.slots], "dtype": self.dtype})

    @classmethod
    def from_json(cls, text: str) -> AdapterTable:
        body = json.loads(text)
        return cls(tuple(AdapterSlot.from_dict(slot) for slot in body["slots"]), body["dtype"])

    def as_constant(self) -> torch.Tensor:
        """The JSON as a uint8 tensor: one constant-buffer entry (a list would cost one program value per byte)."""
        return torch.tensor(list(self.to_json().encode()), dtype=torch.uint8)

    @classmethod
    def from_constant(cls, value: torch.Tensor) -> AdapterTable:
        return cls.from_json(value.numpy().tobytes().decode())


def group_rank(columns: dict[str, tuple[int, int]]) -> int:
    """The columns of a group's `slot_a` (`AdapterTable.columns`): its targets' ranks summed."""
    return sum(rank for _, rank in columns.values())


def adapter_file(program: str | Path, name: str) -> Path:
    """Where `export` writes adapter `name` of the program at `program`: `<dir>/<stem>.<name>.ptd`."""
    program = Path(program)
    return program.with_name(f"{program.stem}.{name}.ptd")


def adapter_program_file(program: str | Path, name: str) -> Path:
    """Where `export(..., adapter_mode="programs")` writes the program of adapter `name` of the program at
    `program`: `<dir>/<stem>.<name>.pte`."""
    program = Path(program)
    return program.with_name(f"{program.stem}.{name}.pte")


def exported_adapters(program: str | Path) -> dict[str, Path]:
    """The adapter files beside the program at `program`, by name: the files `adapter_file` and
    `adapter_program_file` name."""
    program = Path(program)
    prefix = f"{program.stem}."
    files = [file for suffix in (".ptd", ".pte") for file in program.parent.glob(f"{glob.escape(prefix)}*{suffix}")]
    return {file.name[len(prefix) : -len(file.suffix)]: file for file in sorted(files)}


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def shared_inputs(module: nn.Module, run: Callable[[], object]) -> list[int | None]:
    """Per `LoRALinear` of `module` (`lora_layers` order), the index of the first of the layers that were given
    the same input tensor as it in every call of `run()` (None: it shares with none, or not every time). The
    states `run()` wrote are reset."""
    layers = [layer for _, layer in lora_layers(module)]
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]  # kept alive, so their ids stay unique
    hooks = [
        layer.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0]))
        for layer, seen in zip(layers, inputs)
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
        reset_states(module)
    readers: dict[int, set[int]] = {}
    for index, seen in enumerate(inputs):
        for x in seen:
            readers.setdefault(id(x), set()).add(index)
    partners = [{frozenset(readers[id(x)]) for x in seen} for seen in inputs]
    groups: list[int | None] = []
    for mine in partners:
        group = next(iter(mine)) if len(mine) == 1 else frozenset()
        agreed = len(group) > 1 and all(partners[other] == mine for other in group)
        groups.append(min(group) if agreed else None)
    return groups


def check_unmerged(module: nn.Module) -> list[tuple[str, LoRALinear]]:
    """`module`'s `LoRALinear` layers; `ConfigError` if one has an adapter merged into its base."""
    layers = lora_layers(module)
    merged = [(name, layer.merged) for name, layer in layers if layer.merged is not None]
    if merged:
        raise ConfigError(
            f"{merged[0][0]} has adapter {merged[0][1]!r} merged into its base; unmerge() to export adapters switched at "
            "run time, or etblocks.adapters.merge_adapter(model, name) to export one adapter baked into the weights"
        )
    return layers


@contextmanager
def adapter_baked(module: nn.Module, name: str | None) -> Iterator[list[torch.Tensor]]:
    """Every `LoRALinear` of `module` runs adapter `name` (the base where a layer has no such adapter; None: the
    base everywhere) with its scale folded into `lora_B`, one multiplication less per layer in a program that holds
    the adapter as constants; yields those constants, what stays inside that program. The layers' adapters and
    choices are restored after."""
    layers = [layer for _, layer in lora_layers(module)]
    before = [layer.active for layer in layers]
    unfolded = [(layer, layer.adapters[name]) for layer in layers if name in layer.adapters]
    try:
        constants = []
        for layer, weights in unfolded:
            layer.adapters[name] = weights.folded()
            constants += list(layer.adapters[name].parameters())
        for layer in layers:
            layer.set_adapter(name if name in layer.adapters else None)
        yield constants
    finally:
        for layer, weights in unfolded:
            layer.adapters[name] = weights
        for layer, active in zip(layers, before):
            layer.set_adapter(active)


def adapter_table(
    module: nn.Module, dtype: torch.dtype | None = None, groups: list[int | None] | None = None
) -> AdapterTable:
    """The slots `module`'s `LoRALinear` layers need, each of its largest loaded rank, in the groups that
    `shared_inputs` found (None: every slot alone)."""
    layers = check_unmerged(module)
    groups = groups or [None] * len(layers)
    slots = tuple(
        AdapterSlot(layer.target or name, layer.rows, layer.in_features, layer.out_features, layer.max_rank, group)
        for (name, layer), group in zip(layers, groups)
    )
    dtype = dtype or (layers[0][1].base.weight.dtype if layers else torch.float32)
    return AdapterTable(slots, str(dtype).removeprefix("torch."))


@contextmanager
def adapter_slots(module: nn.Module, run: Callable[[], object] | None = None) -> Iterator[AdapterTable]:
    """Give every `LoRALinear` of `module` zeroed slot buffers of its largest rank while the block runs (export);
    layers that share their input in `run()` (a call of `module`) share one `slot_a`."""
    table = adapter_table(module, groups=None if run is None else shared_inputs(module, run))
    layers = [layer for _, layer in lora_layers(module)]
    columns = table.columns()
    owners = {group: SharedInput(layers[group]) for group in {slot.group for slot in table.slots} - {None}}
    for index, (layer, slot) in enumerate(zip(layers, table.slots)):
        group = table.group_of(index)
        layer.add_slot(group_rank(columns[group]), owns_a=group == index)
        layer.shared_input = owners.get(slot.group)
    try:
        yield table
    finally:
        for layer in layers:
            layer.remove_slot()


def slot_buffers(module: nn.Module, table: AdapterTable) -> list[torch.Tensor]:
    """The slot buffers of `module`'s `LoRALinear` layers in `table`'s input order."""
    return [
        getattr(layer, part)
        for index, (_, layer) in enumerate(lora_layers(module))
        for part in (SLOT_BUFFERS if table.group_of(index) == index else SLOT_BUFFERS[1:])
    ]


class SlotInputs(nn.Module):
    """A static program with the LoRA slots as its last inputs, in `table`'s input order: NPUs hold no state
    between calls, so the runner passes the active adapter's slots with every call."""

    def __init__(self, program: nn.Module, n_inputs: int, table: AdapterTable) -> None:
        super().__init__()
        self.program = program
        self.n_inputs = n_inputs
        self.table = table
        self._layers = [layer for _, layer in lora_layers(program)]  # registered under `program`

    def forward(self, *inputs: torch.Tensor):
        fixed, slots = inputs[: self.n_inputs], iter(inputs[self.n_inputs :])
        slot_a: dict[int, torch.Tensor] = {}
        shared: dict[int, SharedInput] = {}
        for index, (layer, slot) in enumerate(zip(self._layers, self.table.slots)):
            group = self.table.group_of(index)
            if group == index:
                slot_a[group] = next(slots)
            layer.slot_inputs = (slot_a[group], next(slots))
            if slot.group is not None and group not in shared:
                shared[group] = SharedInput()
            layer.shared_input = shared.get(slot.group)
        try:
            return self.program(*fixed)
        finally:
            for layer in self._layers:
                layer.slot_inputs = layer.shared_input = None


def set_adapter_program(module: nn.Module, table: AdapterTable, export) -> torch.export.ExportedProgram:
    """`set_adapter(*slot tensors)` exported from `module` itself, so its buffers have `forward`'s names (that is
    what makes the two methods share them). `export(module, example_inputs)` is the driver's exporter."""

    def set_slots(self, *tensors):
        for buffer, tensor in zip(slot_buffers(module, table), tensors):  # read while tracing
            buffer.copy_(tensor)
        # workaround(executorch 1.5.1): return nothing; returning an input turns the copies into aliases its
        # emitter drops.
        return None

    module.forward = types.MethodType(set_slots, module)
    try:
        return export(module, tuple(table.inputs(None)))
    finally:
        del module.forward


def reads_slot(ep: torch.export.ExportedProgram, node: torch.fx.Node) -> bool:
    """Whether `node` takes a slot buffer itself as an input."""
    buffers = ep.graph_signature.inputs_to_buffers
    return any(
        source.op == "placeholder" and buffers.get(source.name, "").rsplit(".", 1)[-1] in SLOT_BUFFERS
        for source in node.all_input_nodes
    )


def keep_slots_on_cpu(partitioner):
    why = (
        "LoRA slots in a dynamic program (kept away from the delegate, which would freeze them; for other backends "
        "swap with shapes='static', whose programs take the slots as inputs, or bake one adapter in with "
        "etblocks.adapters.merge_adapter)"
    )
    return keep_on_cpu(partitioner, reads_slot, why)
