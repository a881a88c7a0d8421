"""etblocks: one model definition, every ExecuTorch backend."""

from etblocks.adapters import load_adapter, set_adapter
from etblocks.errors import (
    AdapterMismatchError,
    BackendUnavailableError,
    ConfigError,
    ContextOverflowError,
    EtblocksError,
    UnsupportedModelError,
)
from etblocks.export import ExportResult, Runner, export
from etblocks.swap import register, swap

__all__ = [
    "swap",
    "export",
    "Runner",
    "ExportResult",
    "register",
    "load_adapter",
    "set_adapter",
    "EtblocksError",
    "UnsupportedModelError",
    "ConfigError",
    "AdapterMismatchError",
    "BackendUnavailableError",
    "ContextOverflowError",
]
