"""The one way etblocks imports torchtune: torchtune 0.6.1 imports NF4 from `torchao.dtypes.nf4tensor`, which
torchao 0.18 moved to `torchao.quantization.quantize_.workflows.nf4.nf4_tensor`. Aliasing the old module name to
the new module before the import is all torchtune needs (builders, generation, LoRA). Everything in etblocks and
its tests that imports torchtune goes through `import_torchtune()`, so the shim lives in this one place.

workaround(torchtune 0.6.1): the NF4 module alias (`_alias_nf4`).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from etblocks.errors import ConfigError

OLD_NF4 = "torchao.dtypes.nf4tensor"
NEW_NF4 = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def import_torchtune() -> ModuleType:
    """The `torchtune` module, imported with the NF4 alias in place (idempotent). `ConfigError` when torchtune
    or torchao is not installed."""
    try:
        _alias_nf4()
        return importlib.import_module("torchtune")
    except ModuleNotFoundError as exc:
        if exc.name not in ("torchtune", "torchao"):
            raise
        raise ConfigError(f"torchtune adapters and models need the package {exc.name!r}, which is not installed; pip install torchtune==0.6.1 torchao") from None


def is_torchtune_decoder(model: object) -> bool:
    """Whether `model` is a torchtune `TransformerDecoder`; never imports torchtune (a caller holding one has)."""
    module = sys.modules.get("torchtune.modules.transformer")
    return module is not None and isinstance(model, module.TransformerDecoder)


def _alias_nf4() -> None:
    """Point `torchao.dtypes.nf4tensor` at its new home unless this torchao still has it."""
    if OLD_NF4 in sys.modules:
        return
    try:
        importlib.import_module(OLD_NF4)
    except ModuleNotFoundError as exc:
        if exc.name != OLD_NF4:
            raise
        # workaround(torchtune 0.6.1): it imports NF4 from torchao's old module path (moved in torchao 0.18).
        sys.modules[OLD_NF4] = importlib.import_module(NEW_NF4)
