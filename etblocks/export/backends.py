"""ExecuTorch backends etblocks knows: how to get their partitioners, and whether they work on this machine.

Each backend imports lazily, so a missing package only matters when that backend is asked for.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

from etblocks.errors import BackendUnavailableError, ConfigError


def _xnnpack() -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


def _portable() -> list:
    return []


def _openvino() -> list:
    from executorch.backends.openvino.partitioner import OpenvinoPartitioner
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    return [OpenvinoPartitioner([CompileSpec("device", b"CPU")])]


def _coreml() -> list:
    """iOS 18 / macOS 15 programs (fp16 inputs and caches need iOS 16+); Core ML computes in fp16 by default,
    as the Neural Engine does."""
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner

    specs = CoreMLBackend.generate_compile_specs(minimum_deployment_target=ct.target.iOS18)
    return [CoreMLPartitioner(compile_specs=specs)]


def _vulkan() -> list:
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

    return [VulkanPartitioner()]


def _qnn() -> list:
    if not os.environ.get("QNN_SDK_ROOT"):
        raise BackendUnavailableError(
            "backend='qnn' needs the Qualcomm AI Engine Direct SDK: set QNN_SDK_ROOT to its install directory"
        )
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.utils.utils import generate_htp_compiler_spec, generate_qnn_executorch_compiler_spec
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset

    spec = generate_qnn_executorch_compiler_spec(QcomChipset.SM8650, generate_htp_compiler_spec(use_fp16=False))
    return [QnnPartitioner(spec)]


@dataclass(frozen=True)
class Backend:
    """One ExecuTorch backend. `runtime_name` is its delegate's name in the runtime (None: no delegate);
    `dynamic_shapes` says whether it lowers programs with a dynamic sequence length."""

    name: str
    requires: str
    install_hint: str
    runtime_name: str | None
    make_partitioners: Callable[[], list]
    dynamic_shapes: bool = False


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("xnnpack", "executorch.backends.xnnpack", "pip install executorch", "XnnpackBackend", _xnnpack, True),
        Backend("portable", "executorch.exir", "pip install executorch", None, _portable, True),
        Backend("openvino", "openvino", "pip install 'etblocks[openvino]'", "OpenvinoBackend", _openvino),
        Backend("coreml", "coremltools", "pip install coremltools", "CoreMLBackend", _coreml),
        Backend("vulkan", "executorch.backends.vulkan", "pip install executorch", "VulkanBackend", _vulkan),
        Backend("qnn", "executorch.backends.qualcomm", "install the Qualcomm SDK and set QNN_SDK_ROOT", "QnnBackend", _qnn),
    )
}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r} is unknown; accepted: {sorted(BACKENDS)}")
    return BACKENDS[name]


def is_installed(backend: Backend) -> bool:
    try:
        importlib.import_module(backend.requires)
    except ImportError:
        return False
    return True


def partitioners_for(name: str) -> list:
    """The partitioners for `name`; `BackendUnavailableError` (with the install step) if it cannot be used here."""
    backend = get_backend(name)
    if not is_installed(backend):
        raise BackendUnavailableError(f"backend={name!r} is not installed ({backend.requires} missing): {backend.install_hint}")
    try:
        return backend.make_partitioners()
    except ImportError as exc:
        raise BackendUnavailableError(f"backend={name!r} cannot be loaded: {exc}. {backend.install_hint}") from exc


def runtime_backends() -> set[str]:
    """Delegates compiled into the ExecuTorch Python runtime on this machine."""
    from executorch.runtime import Runtime

    return set(Runtime.get().backend_registry.registered_backend_names)


def runs_here(backend: Backend) -> bool:
    return backend.runtime_name is None or backend.runtime_name in runtime_backends()
