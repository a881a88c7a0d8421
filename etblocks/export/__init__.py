"""Export driver, backends, program contracts and the runner."""

from etblocks.export.backends import BACKENDS, get_backend, partitioners_for
from etblocks.export.delegation import DelegationSummary
from etblocks.export.driver import ExportResult, export
from etblocks.export.runner import Runner, sample

__all__ = ["export", "ExportResult", "Runner", "sample", "BACKENDS", "get_backend", "partitioners_for", "DelegationSummary"]
