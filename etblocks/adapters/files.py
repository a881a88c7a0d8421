"""Adapter files for deployment: one adapter's tensors in ExecuTorch's own data format (`.ptd`, FlatTensor).

Keys are `<target>.lora_A` (`[r, in]`) and `<target>.lora_B` (`[out, r]`, the adapter's scaling folded in), with
`target` the upstream module name (`model.layers.0.self_attn.q_proj`), so one file serves every program exported
from that base whatever its recipe. A file holds its tensors and a few hundred bytes of index; C++ reads it with
ExecuTorch's `FlatTensorDataMap`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from etblocks.adapters.lora import LoRALinear, LoRATensors
from etblocks.errors import AdapterMismatchError
from etblocks.program_files import check_data_file, write_whole

_KEY = re.compile(r"^(?P<target>.+)\.(?P<part>lora_A|lora_B)$")
ADAPTER_FILE = "an etblocks adapter file (.ptd with lora_A/lora_B tensors)"


def adapter_tensors(model: nn.Module, name: str) -> dict[str, LoRATensors]:
    """Adapter `name` of `model` per upstream target, scaling folded into `lora_B` (scale 1). Layers computing
    parts of one target (single-head attention's heads) are put back together by their rows."""
    parts: dict[str, list[tuple[tuple[int, int] | None, torch.Tensor, torch.Tensor]]] = {}
    for module_name, layer in model.named_modules():
        if isinstance(layer, LoRALinear) and name in layer.adapters:
            weights = layer.adapters[name]
            parts.setdefault(layer.target or module_name, []).append((layer.rows, weights.lora_A, weights.lora_B * weights.scale))
    tensors = {}
    for target, pieces in parts.items():
        pieces.sort(key=lambda piece: (piece[0] or (0, 0))[0])
        lora_B = torch.cat([b for _, _, b in pieces]) if len(pieces) > 1 else pieces[0][2]
        tensors[target] = LoRATensors(pieces[0][1], lora_B, 1.0)
    return tensors


def save_adapter_file(tensors: dict[str, LoRATensors], path: str | Path) -> Path:
    """Write `tensors` (from `adapter_tensors`) to `path` as a `.ptd` file; returns the path."""
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.exir.tensor_layout import TensorLayout
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    buffers, entries = [], {}
    for target, (lora_A, lora_B, scale) in sorted(tensors.items()):
        for part, tensor in (("lora_A", lora_A), ("lora_B", lora_B * scale)):
            tensor = tensor.detach().contiguous()
            entries[f"{target}.{part}"] = DataEntry(len(buffers), 16, TensorLayout.from_tensor(tensor))
            buffers.append(tensor.view(torch.uint8).numpy().tobytes())
    return write_whole(path, bytes(FlatTensorSerializer().serialize(DataPayload(buffers=buffers, named_data=entries))))


def read_adapter_file(path: str | Path) -> dict[str, LoRATensors]:
    """The tensors of a `.ptd` adapter file per target: `ProgramFileError` for a file that is no FlatTensor file
    (checked before it is parsed), `AdapterMismatchError` for one that holds no LoRA tensors."""
    from executorch.exir._serialize._cord import Cord
    from executorch.exir.tensor import get_scalar_type
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    path = check_data_file(path, ADAPTER_FILE)
    try:
        payload = FlatTensorSerializer().deserialize(Cord(path.read_bytes()))
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, entry in payload.named_data.items():
            match = _KEY.match(key)
            layout = entry.tensor_layout
            if match is None or len(layout.sizes) != 2:
                raise ValueError(f"unexpected tensor {key!r} {list(layout.sizes)}")
            data = bytearray(payload.buffers[entry.buffer_index])
            tensor = torch.frombuffer(data, dtype=get_scalar_type(layout.scalar_type)).reshape(layout.sizes)
            parts.setdefault(match["target"], {})[match["part"]] = tensor
    except Exception as exc:  # a FlatTensor file of other tensors, or corrupt inside: the first error it hits
        raise AdapterMismatchError(f"{path} is not {ADAPTER_FILE}: {exc}") from None
    tensors = {}
    for target, pair in parts.items():
        if set(pair) != {"lora_A", "lora_B"} or pair["lora_A"].shape[0] != pair["lora_B"].shape[1]:
            raise AdapterMismatchError(f"{path}: {target} needs lora_A [r, in] and lora_B [out, r]; has { {k: list(v.shape) for k, v in pair.items()} }")
        tensors[target] = LoRATensors(pair["lora_A"], pair["lora_B"], 1.0)
    if not tensors:
        raise AdapterMismatchError(f"{path} holds no adapter tensors")
    return tensors
