"""Weights outside the program: a program's constants written to a data file (`.ptd`) that several programs read.

A constant whose node carries a tag leaves the `.pte`: a delegate (XNNPACK) stores it under a key of its content in
the data file named by the tag, and `to_executorch` stores the constants left on CPU there under their names
(`ExecutorchBackendConfig.external_constants`). Programs lowered from the same weights with the same tag so need
one data file between them: adapter programs (`etblocks.export.adapters`) keep only their adapter's tensors.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch

WEIGHTS_TAG = "weights"  # the tag of the base weights' data file (written as `weights_file`)
TAG_KEY = "delegate_constant_tag"  # read from `node.meta["custom"]` by ExecuTorch's lowering and by `constant_tag`


def tag_constants(ep: torch.export.ExportedProgram, tag: str, inside: Iterable[torch.Tensor] = ()) -> None:
    """Tag every constant of `ep` (parameters, buffers no method writes, lifted constants) for the data file `tag`,
    but the tensors `inside` (the module's own tensor objects, which `ep.state_dict` holds)."""
    signature = ep.graph_signature
    names = {**signature.inputs_to_parameters, **signature.inputs_to_buffers, **signature.inputs_to_lifted_tensor_constants}
    written = set(signature.buffers_to_mutate.values())
    kept = {id(tensor) for tensor in inside}
    for node in ep.graph.nodes:
        name = names.get(node.name) if node.op == "placeholder" else None
        if name is not None and name not in written and id(ep.state_dict.get(name)) not in kept:
            node.meta.setdefault("custom", {})[TAG_KEY] = tag
            for user in node.users:  # XNNPACK reads a quantized weight's tag from the node that dequantizes it
                if "dequantize" in str(user.target):
                    user.meta.setdefault("custom", {})[TAG_KEY] = tag


def tagging_pass(tag: str, inside: Iterable[torch.Tensor] = ()):
    """`tag_constants` as a pass of `to_edge_transform_and_lower` (`transform_passes`), which runs on the edge
    programs before partitioning: there tensor subclasses (torchao's quantized weights) are plain tensors, each a
    placeholder of its own."""
    from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult
    from executorch.exir.pass_manager import ExportedProgramPassManager

    class TagConstants(ExportedProgramPassBase):
        def call(self, exported_program):
            tag_constants(exported_program, tag, inside)
            return ExportedProgramPassResult(exported_program, True)

    return ExportedProgramPassManager([TagConstants()])


def constant_tag(node: torch.fx.Node) -> str | None:
    """The data file a constant left on CPU goes to (`ExecutorchBackendConfig.external_constants`): its tag."""
    return (node.meta.get("custom") or {}).get(TAG_KEY)


def weights_file(program: str | Path) -> Path:
    """The data file holding the weights of the program at `program`, when they were written apart:
    `<dir>/<stem>.ptd`."""
    return Path(program).with_suffix(".ptd")


def write_weights(executorch_program: Any, path: Path) -> Path:
    """The data file of `WEIGHTS_TAG` of `executorch_program` (an `ExecutorchProgramManager`) written to `path`
    whole: ExecuTorch writes it into a directory beside `path`, from which it is renamed over `path` once synced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as scratch:
        executorch_program.write_tensor_data_to_file(scratch)
        written = Path(scratch) / f"{WEIGHTS_TAG}.ptd"
        with written.open("rb") as file:
            os.fsync(file.fileno())
        os.replace(written, path)
    return path
