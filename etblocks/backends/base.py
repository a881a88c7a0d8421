"""`Backend`: everything etblocks knows about one ExecuTorch backend, in one object.

A backend module subclasses `Backend` and sets what differs: the swap recipe's choices (data), how to build its
partitioners, the graph rewrites it wants before lowering, the quantization it runs, the limits it is known to
have (each with its reason), how to tell whether it can be used here, and its own options. Nothing outside a
backend's module compares backend names: swap, export, the probe and the CLI ask the backend.

Importing a backend module imports no heavy package (torch, executorch): each method imports what it needs when
called, so `etblocks --help` and a missing optional package cost nothing until that backend is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Protocol

from etblocks.errors import BackendUnavailableError, ConfigError
from etblocks.options import Option, check

# Limits a backend may declare (`Backend.limits`: limit -> why it does not lower).
INT8_IO_CACHE = "int8_io_cache"  # a static program whose caller-owned caches are int8
INT64_TENSORS = "int64_tensors"  # a program holding int64 tensors (an MoE router's top-k index)

# The recipe of NPU-style backends: static shapes, caller-owned state, attention with the caller's mask.
STATIC_IO = {"shapes": "static", "cache": "io", "sdpa": "static"}


class Readiness(Protocol):
    """A backend's readiness report of a program (`Backend.readiness`): printable, and whether it would lower."""

    @property
    def ready(self) -> bool: ...


class Backend:
    """One ExecuTorch backend.

    name: what users pass as `backend=`.
    requires / install_hint: the module whose import says the backend is installed, and how to install it.
    runtime_name: its delegate's name in the ExecuTorch runtime (None: portable kernels, no delegate).
    dynamic_shapes: whether it lowers programs with a dynamic sequence length.
    recipe: the swap recipe's choices for it (`etblocks.swap.recipes.Recipe` fields), as data.
    weight_schemes / embedding_schemes: the torchao weight quantization its kernels run.
    activation_schemes / default_activations: the calibrated (pt2e) quantization its `quantizer` does, and the
        scheme `export` applies by default when exporting a model swapped for it.
    limits: what it is known not to lower (keys such as `INT8_IO_CACHE`), each with the reason.
    external_weights: whether its programs read their constants from a data file (.ptd) that several programs
        share (`etblocks.export.external`), as adapter programs need.
    options: its own options (their defaults apply when not given).
    """

    name: str = ""
    requires: str = "executorch.exir"
    install_hint: str = "pip install executorch"
    runtime_name: str | None = None
    dynamic_shapes: bool = False
    recipe: Mapping[str, Any] = {}
    weight_schemes: tuple[str, ...] = ()
    embedding_schemes: tuple[str, ...] = ()
    activation_schemes: tuple[str, ...] = ()
    default_activations: str | None = None
    limits: Mapping[str, str] = {}
    external_weights: bool = False
    options: tuple[Option, ...] = ()
    quantization_hint: str = ""  # said when a quantization scheme is refused

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"

    # --- availability

    def is_installed(self) -> bool:
        try:
            importlib.import_module(self.requires)
        except ImportError:
            return False
        return True

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot lower here, said after its name (None: it can): a missing package, SDK, ..."""
        if not self.is_installed():
            return f"is not installed ({self.requires} missing): {self.install_hint}"
        return None

    def precision_note(self, exact: bool) -> str:
        """A note for `etblocks backends` when its probe's output differed from eager beyond fp32 rounding."""
        return "" if exact else "reduced precision: bf16/fp16 compute"

    # --- lowering

    def check_options(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """Its options with defaults filled in, each checked; `ConfigError` for one it does not declare."""
        declared = {option.name: option for option in self.options}
        unknown = sorted(set(given or {}) - set(declared))
        if unknown:
            raise ConfigError(
                f"backend_options {unknown} are not options of backend={self.name!r}; it takes: {sorted(declared) or 'none'}"
            )
        values = {name: option.default for name, option in declared.items()}
        for name, value in (given or {}).items():
            values[name] = check(declared[name], value)
        return values

    def partitioners(self, options: Mapping[str, Any]) -> list:
        """The partitioners `to_edge_transform_and_lower` gets (`options` checked by `check_options`)."""
        return []

    def graph_passes(self) -> list[Callable]:
        """Rewrites of an exported program before lowering: `fn(ExportedProgram) -> number rewritten`."""
        return []

    def apply_passes(self, exported) -> None:
        """Rewrite an exported program in place, as `etblocks.export` does before lowering: `fold_weight_views`
        (every backend: weights the graph would re-lay out per call are stored laid out), then `graph_passes`."""
        from etblocks.backends.passes import fold_weight_views

        fold_weight_views(exported)
        for rewrite in self.graph_passes():
            rewrite(exported)

    def quantizer(self, scheme: str):
        """The pt2e quantizer for one of `activation_schemes`."""
        raise ConfigError(f"backend={self.name!r} has no calibrated quantization")

    def readiness(self, programs: Mapping[str, Any]) -> Readiness:
        """What lowering these exported methods would meet, checked without lowering (for backends whose lowering
        cannot run here)."""
        raise ConfigError(f"backend={self.name!r} offers no readiness check; lower the program instead")

    @property
    def has_readiness(self) -> bool:
        return type(self).readiness is not Backend.readiness

    # --- checks other layers ask for

    def refuse_limit(self, limit: str, what: str, alternatives: list[str]) -> None:
        """`ConfigError` if this backend declares `limit`: `what` does not lower here, why, and where it does."""
        if limit in self.limits:
            raise ConfigError(
                f"{what} does not lower to backend={self.name!r}: {self.limits[limit]}. Lower it to one of "
                f"{alternatives} instead"
            )

    def usable_partitioners(self, options: Mapping[str, Any] | None = None) -> list:
        """`partitioners` after the checks: `BackendUnavailableError` with the install step if it cannot be used."""
        options = self.check_options(options)
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"backend={self.name!r} {reason}")
        try:
            return self.partitioners(options)
        except ImportError as exc:
            raise BackendUnavailableError(f"backend={self.name!r} cannot be loaded: {exc}. {self.install_hint}") from exc
