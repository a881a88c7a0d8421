"""etblocks: one model definition, every ExecuTorch backend.

The names below load on first use, so `import etblocks` (and `etblocks --help`) costs no torch import.
"""

from __future__ import annotations

import importlib
import sys
import types

from etblocks.errors import (
    AdapterMismatchError,
    BackendUnavailableError,
    ConfigError,
    ContextOverflowError,
    EtblocksError,
    ProgramFileError,
    UnsupportedModelError,
)

_LAZY = {
    "swap": "etblocks.swap.api",
    "register": "etblocks.swap.registry",
    "export": "etblocks.export.driver",
    "ExportResult": "etblocks.export.driver",
    "Runner": "etblocks.export.runner",
    "Chat": "etblocks.export.chat",
    "load_adapter": "etblocks.adapters.load",
    "set_adapter": "etblocks.adapters.load",
    "register_backend": "etblocks.backends",
    "quiet": "etblocks.noise",
    "load_gguf": "etblocks.gguf",
}

__all__ = [
    *_LAZY,
    "EtblocksError",
    "UnsupportedModelError",
    "ConfigError",
    "AdapterMismatchError",
    "BackendUnavailableError",
    "ContextOverflowError",
    "ProgramFileError",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'etblocks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """`etblocks.swap` and `etblocks.export` are the functions, not the subpackages of the same names: importing a
    subpackage sets it as an attribute of its parent, which would shadow the function once loaded."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
