"""Export driver, backends, program contracts and the runner."""

from etblocks.export.accuracy import AccuracyReport, EagerModel, next_token_agreement
from etblocks.export.backends import BACKENDS, get_backend, partitioners_for
from etblocks.export.delegation import DelegationSummary
from etblocks.export.contract import StaticContract
from etblocks.export.driver import ExportResult, check_qnn, export
from etblocks.export.qnn import format_readiness
from etblocks.export.runner import Runner, sample

__all__ = [
    "export",
    "check_qnn",
    "format_readiness",
    "ExportResult",
    "Runner",
    "sample",
    "StaticContract",
    "BACKENDS",
    "get_backend",
    "partitioners_for",
    "DelegationSummary",
    "AccuracyReport",
    "EagerModel",
    "next_token_agreement",
]
