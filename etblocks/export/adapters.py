"""Adapters switched at run time: every `LoRALinear` computes its LoRA path from a "slot", `slot_a = A^T
[in, r]` and `slot_b = scale * B^T [r, out]`, zero-padded to the largest rank loaded there (all zeros is the
base model).

- Dynamic programs keep the slots as mutable buffers that a second method, `set_adapter(a_0, b_0, a_1, ...)`,
  copies new values into. Both methods share them (`share_mutable_buffers`), so a switch is one call moving the
  adapter's own bytes; the base is loaded and packed once. The slot table travels in the `etblocks_adapters`
  constant method.
- Static programs take the slots as their last inputs (`SlotInputs`): NPUs hold no state between calls, so the
  runner passes the active adapter's slots with every `prefill` and `decode`. The table is in the contract.

A delegate must not read slot buffers: it would serialize their initial zeros as constants and ignore every
switch. `keep_slots_on_cpu` leaves the ops that read them (the `[None]` views `LoRALinear` takes) on CPU, so the
LoRA matmuls, delegated with everything else, receive the slots as run-time inputs.
"""

from __future__ import annotations

import glob
import json
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from etblocks.adapters.lora import LoRALinear, LoRATensors
from etblocks.errors import AdapterMismatchError, ConfigError
from etblocks.export.hybrid import keep_on_cpu

ADAPTERS_METHOD = "etblocks_adapters"
SET_ADAPTER_METHOD = "set_adapter"
SLOT_BUFFERS = ("slot_a", "slot_b")


@dataclass(frozen=True)
class AdapterSlot:
    """One `LoRALinear` of the program: it computes output `rows` (None: all) of upstream module `target`."""

    target: str
    rows: tuple[int, int] | None
    in_features: int
    out_features: int
    rank: int

    @classmethod
    def from_dict(cls, body: dict) -> AdapterSlot:
        """From its JSON form (`rows` a list there)."""
        return cls(**{**body, "rows": tuple(body["rows"]) if body["rows"] else None})

    def inputs(self, tensors: LoRATensors | None, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(slot_a [in, rank], slot_b [rank, out])` for this layer's part of `tensors` (None: zeros)."""
        slot_a = torch.zeros(self.in_features, self.rank, dtype=dtype)
        slot_b = torch.zeros(self.rank, self.out_features, dtype=dtype)
        if tensors is not None:
            lora_A, lora_B, factor = tensors
            lora_B = lora_B if self.rows is None else lora_B[self.rows[0] : self.rows[1]]
            rank = lora_A.shape[0]
            slot_a[:, :rank] = lora_A.T
            slot_b[:rank] = lora_B.T * (factor * scale)
        return slot_a, slot_b


@dataclass(frozen=True)
class AdapterTable:
    """The program's slots in `set_adapter`'s input order, and their dtype."""

    slots: tuple[AdapterSlot, ...]
    dtype: str

    def inputs(self, tensors: dict[str, LoRATensors] | None, scale: float = 1.0) -> list[torch.Tensor]:
        """`set_adapter`'s inputs for an adapter (`{target: LoRATensors}`; None: the base model), checked first:
        `AdapterMismatchError` for a target the program lacks or a shape or rank that does not fit."""
        if tensors is not None:
            self.check(tensors)
        dtype = getattr(torch, self.dtype)
        return [t for slot in self.slots for t in slot.inputs(None if tensors is None else tensors.get(slot.target), scale, dtype)]

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


def adapter_file(program: str | Path, name: str) -> Path:
    """Where `export` writes adapter `name` of the program at `program`: `<dir>/<stem>.<name>.ptd`."""
    program = Path(program)
    return program.with_name(f"{program.stem}.{name}.ptd")


def exported_adapters(program: str | Path) -> dict[str, Path]:
    """The adapter files beside the program at `program`, by name (the files `adapter_file` names)."""
    program = Path(program)
    prefix = f"{program.stem}."
    files = program.parent.glob(f"{glob.escape(prefix)}*.ptd")
    return {file.name[len(prefix) : -len(".ptd")]: file for file in sorted(files)}


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def adapter_table(module: nn.Module, dtype: torch.dtype | None = None) -> AdapterTable:
    """The slots `module`'s `LoRALinear` layers need, each of its largest loaded rank."""
    layers = lora_layers(module)
    merged = [(name, layer.merged) for name, layer in layers if layer.merged is not None]
    if merged:
        raise ConfigError(
            f"{merged[0][0]} has adapter {merged[0][1]!r} merged into its base; unmerge() to export adapters switched at "
            "run time, or etblocks.adapters.merge_adapter(model, name) to export one adapter baked into the weights"
        )
    slots = tuple(
        AdapterSlot(layer.target or name, layer.rows, layer.in_features, layer.out_features, layer.max_rank) for name, layer in layers
    )
    dtype = dtype or (layers[0][1].base.weight.dtype if layers else torch.float32)
    return AdapterTable(slots, str(dtype).removeprefix("torch."))


@contextmanager
def adapter_slots(module: nn.Module) -> Iterator[AdapterTable]:
    """Give every `LoRALinear` of `module` a zeroed slot buffer of its largest rank while the block runs (export)."""
    table = adapter_table(module)
    layers = [layer for _, layer in lora_layers(module)]
    for layer, slot in zip(layers, table.slots):
        layer.add_slot(slot.rank)
    try:
        yield table
    finally:
        for layer in layers:
            layer.remove_slot()


class SlotInputs(nn.Module):
    """A static program with the LoRA slots as its last inputs, `(slot_a, slot_b)` per `LoRALinear` in table
    order: NPUs hold no state between calls, so the runner passes the active adapter's slots with every call."""

    def __init__(self, program: nn.Module, n_inputs: int) -> None:
        super().__init__()
        self.program = program
        self.n_inputs = n_inputs
        self._layers = [layer for _, layer in lora_layers(program)]  # registered under `program`

    def forward(self, *inputs: torch.Tensor):
        fixed, slots = inputs[: self.n_inputs], inputs[self.n_inputs :]
        for i, layer in enumerate(self._layers):
            layer.slot_inputs = (slots[2 * i], slots[2 * i + 1])
        try:
            return self.program(*fixed)
        finally:
            for layer in self._layers:
                layer.slot_inputs = None


def set_adapter_program(module: nn.Module, table: AdapterTable, export) -> torch.export.ExportedProgram:
    """`set_adapter(*slot tensors)` exported from `module` itself, so its buffers have `forward`'s names (that is
    what makes the two methods share them). `export(module, example_inputs)` is the driver's exporter."""
    layers = [layer for _, layer in lora_layers(module)]

    def set_slots(self, *tensors):
        buffers = [getattr(layer, part) for layer in layers for part in SLOT_BUFFERS]  # read while tracing
        for buffer, tensor in zip(buffers, tensors):
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
