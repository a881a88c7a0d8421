"""ExecuTorch backends, one module each, behind one registry.

etblocks' own backends are the modules listed in `BUILTIN`; another package adds one with `register_backend`
(or, for the `etblocks` command, an entry point in the group `etblocks.backends` naming a `Backend` subclass or
instance). Everything that depends on the backend asks `get_backend(name)`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from etblocks.backends.base import INT8_IO_CACHE, INT64_TENSORS, STATIC_IO, Backend, Readiness
from etblocks.errors import ConfigError
from etblocks.options import Option

BUILTIN = (
    "etblocks.backends.xnnpack",
    "etblocks.backends.portable",
    "etblocks.backends.openvino",
    "etblocks.backends.coreml",
    "etblocks.backends.vulkan",
    "etblocks.backends.qnn",
)
ENTRY_POINT_GROUP = "etblocks.backends"

_REGISTRY: dict[str, Backend] = {}
_LOADED = False


def register_backend(backend: Backend | type[Backend]) -> Backend:
    """Make `backend` (a `Backend` instance, or a subclass to instantiate) known by its name; a name registered
    again is replaced. Usable as a class decorator."""
    instance = backend() if isinstance(backend, type) else backend
    if not isinstance(instance, Backend) or not isinstance(instance.name, str) or not instance.name:
        raise ConfigError(f"register_backend takes a Backend with a non-empty name; got {backend!r}")
    _load()
    _REGISTRY[instance.name] = instance
    return backend if isinstance(backend, type) else instance


def _load() -> None:
    """etblocks' backends, then those installed packages declare, once."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for module in BUILTIN:
        backend = importlib.import_module(module).BACKEND
        _REGISTRY[backend.name] = backend
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        register_backend(entry.load())


def backends() -> list[Backend]:
    _load()
    return list(_REGISTRY.values())


def get_backend(name: str) -> Backend:
    """The backend named `name`; `ConfigError` listing the known ones otherwise."""
    _load()
    if name not in _REGISTRY:
        raise ConfigError(f"backend={name!r} is unknown; accepted: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def command_options() -> list[Option]:
    """Every backend's own options as the CLI and YAML know them: `<backend>_<option>`."""
    return [
        option.renamed(f"{backend.name}_{option.name}", f"backend {backend.name}: {option.help}")
        for backend in backends()
        for option in backend.options
    ]


__all__ = [
    "Backend",
    "Readiness",
    "INT8_IO_CACHE",
    "INT64_TENSORS",
    "STATIC_IO",
    "BUILTIN",
    "register_backend",
    "backends",
    "get_backend",
    "command_options",
]
