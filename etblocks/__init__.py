"""etblocks: one model definition, every ExecuTorch backend."""

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
    "EtblocksError",
    "UnsupportedModelError",
    "ConfigError",
    "AdapterMismatchError",
    "BackendUnavailableError",
    "ContextOverflowError",
]
