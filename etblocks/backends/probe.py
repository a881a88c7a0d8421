"""What each ExecuTorch backend can do on this machine, found by trying (`etblocks backends`).

For each registered backend (`etblocks.backends`): is its package installed, does a tiny `nn.Linear`
lower through `to_edge_transform_and_lower` with its partitioners, and does the lowered program run in the
ExecuTorch Python runtime here and match eager PyTorch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
from torch import nn

from etblocks.backends import Backend, backends, get_backend

PROBE_IN, PROBE_OUT, PROBE_BATCH = 16, 8, 2


@dataclass(frozen=True)
class Check:
    """`ok` is True/False when tried, None when not tried (an earlier step failed); `note` says why, briefly."""

    ok: bool | None
    note: str = ""

    @property
    def mark(self) -> str:
        return {True: "yes", False: "no", None: "-"}[self.ok]


@dataclass(frozen=True)
class BackendReport:
    name: str
    installed: Check
    lowers: Check
    runs: Check

    @property
    def notes(self) -> str:
        return "; ".join(c.note for c in (self.installed, self.lowers, self.runs) if c.note)


def short_reason(exc: BaseException, limit: int = 90) -> str:
    """`Type: first line of the message`, cut to `limit` characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def quiet_fds(enabled: bool = True):
    """Send everything written to file descriptors 1 and 2 (Python, C++ logs, progress bars) to a scratch file."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _tiny_module() -> tuple[nn.Module, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    module = nn.Linear(PROBE_IN, PROBE_OUT).eval()
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.5)
        module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.5)
    return module, torch.randn(PROBE_BATCH, PROBE_IN, generator=generator)


def runtime_backends() -> set[str]:
    """Delegates compiled into the ExecuTorch Python runtime on this machine."""
    from executorch.runtime import Runtime

    return set(Runtime.get().backend_registry.registered_backend_names)


def _delegate_count(graph_module: torch.fx.GraphModule) -> int:
    return sum(
        1
        for node in graph_module.graph.nodes
        if node.op == "call_function" and "executorch_call_delegate" in getattr(node.target, "__name__", str(node.target))
    )


def probe_backend(backend: Backend | str, quiet: bool = True) -> BackendReport:
    """Try `backend` on a tiny `nn.Linear`: import, lower, run. Never raises for a backend's own failure."""
    backend = get_backend(backend) if isinstance(backend, str) else backend
    not_tried = Check(None)
    if not backend.is_installed():
        return BackendReport(backend.name, Check(False, f"{backend.requires} missing: {backend.install_hint}"), not_tried, not_tried)
    installed = Check(True)
    reason = backend.unavailable_reason()
    if reason is not None:
        return BackendReport(backend.name, installed, Check(False, reason), not_tried)

    module, example = _tiny_module()
    with quiet_fds(quiet):
        try:
            buffer, delegates = _lower(backend, module, example)
        except Exception as exc:  # a probe reports any failure; it does not raise
            return BackendReport(backend.name, installed, Check(False, short_reason(exc)), not_tried)
    if backend.runtime_name is not None and delegates == 0:
        return BackendReport(backend.name, installed, Check(False, "the partitioner delegated nothing"), not_tried)
    lowers = Check(True, "portable kernels, no delegate" if backend.runtime_name is None else "")
    return BackendReport(backend.name, installed, lowers, _run(backend, buffer, module, example, quiet))


def _lower(backend: Backend, module: nn.Module, example: torch.Tensor) -> tuple[bytes, int]:
    from executorch.exir import to_edge_transform_and_lower

    partitioners = backend.usable_partitioners()
    exported = torch.export.export(module, (example,), strict=False)
    edge = to_edge_transform_and_lower(exported, partitioner=partitioners)
    delegates = _delegate_count(edge.exported_program().graph_module)
    return edge.to_executorch().buffer, delegates


def _run(backend: Backend, buffer: bytes, module: nn.Module, example: torch.Tensor, quiet: bool) -> Check:
    with quiet_fds(quiet):
        try:
            available = runtime_backends()
        except Exception as exc:
            return Check(False, f"no ExecuTorch runtime: {short_reason(exc)}")
    if backend.runtime_name is not None and backend.runtime_name not in available:
        return Check(False, f"{backend.runtime_name} is not in this machine's runtime (runs on device)")
    with quiet_fds(quiet):
        try:
            from executorch.runtime import Runtime

            program = Runtime.get().load_program(buffer)
            actual = program.load_method("forward").execute([example])[0]
        except Exception as exc:
            return Check(False, short_reason(exc))
    with torch.no_grad():
        expected = module(example)
    if tuple(actual.shape) != tuple(expected.shape):
        return Check(False, f"output shape {tuple(actual.shape)} != eager {tuple(expected.shape)}")
    error = (actual.float() - expected).abs().max().item()
    tolerance = 1e-2 * max(1.0, expected.abs().max().item())  # loose enough for backends computing in bf16/fp16
    if not error <= tolerance:
        return Check(False, f"output differs from eager: max abs err {error:.2g} > {tolerance:.2g}")
    note = f"max abs err vs eager {error:.1g}"
    precision = backend.precision_note(exact=error <= 1e-4 * max(1.0, expected.abs().max().item()))
    if precision:
        note += f" ({precision})"
    return Check(True, note)


def probe_backends(names: list[str] | None = None, quiet: bool = True, on_start=None) -> list[BackendReport]:
    """Reports for `names` (default: every registered backend), in that order."""
    reports = []
    for backend in [get_backend(name) for name in names] if names else backends():
        if on_start is not None:
            on_start(backend.name)
        reports.append(probe_backend(backend, quiet=quiet))
    return reports


def format_table(reports: list[BackendReport]) -> str:
    rows = [("backend", "installed", "lowers here", "runs here", "notes")]
    rows += [(r.name, r.installed.mark, r.lowers.mark, r.runs.mark, r.notes) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + ("  " + row[4] if row[4] else "")
        for row in rows
    ).rstrip()
