"""Export driver, program contracts, feeders and the runner."""

from etblocks.export.accuracy import AccuracyReport, EagerModel, next_token_agreement
from etblocks.export.contract import StaticContract
from etblocks.export.delegation import DelegationSummary
from etblocks.export.driver import ExportPlan, ExportResult, check_readiness, export
from etblocks.export.runner import Runner
from etblocks.export.sampling import sample

__all__ = [
    "export",
    "check_readiness",
    "ExportPlan",
    "ExportResult",
    "Runner",
    "sample",
    "StaticContract",
    "DelegationSummary",
    "AccuracyReport",
    "EagerModel",
    "next_token_agreement",
]
