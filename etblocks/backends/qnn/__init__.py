"""Qualcomm QNN (Hexagon HTP NPUs): static programs with single-head attention and 1x1-conv projections,
quantized by `QnnQuantizer` (16a8w by default). Lowering needs the Qualcomm AI Engine Direct SDK; quantization and
the readiness check (`readiness.py`) run without it."""

from __future__ import annotations

import os
from typing import Any

from etblocks.backends.base import INT64_TENSORS, STATIC_IO, Backend
from etblocks.backends.qnn.quantizer import PRECISIONS
from etblocks.options import Option, Rejected, text

DEFAULT_CHIPSET = "SM8650"


def chipset(value: Any) -> str:
    """A `QcomChipset` name of ExecuTorch's Qualcomm backend."""
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset

    names = [c.name for c in QcomChipset if c.name != "UNKNOWN_SM"]
    if text(value) not in names:
        raise Rejected(f"choose one of ExecuTorch's QcomChipset names {names}")
    return value


class Qnn(Backend):
    name = "qnn"
    requires = "executorch.backends.qualcomm"
    install_hint = "install the Qualcomm AI Engine Direct SDK and set QNN_SDK_ROOT"
    runtime_name = "QnnBackend"
    recipe = {**STATIC_IO, "attention": "sha", "linear": "conv2d", "moe": "dense"}
    activation_schemes = PRECISIONS
    default_activations = "16a8w"
    limits = {INT64_TENSORS: "the Hexagon NPU (HTP) holds no int64 tensors"}
    options = (Option("chipset", ("export",), chipset, "the Snapdragon SoC to compile for (a QcomChipset name)", DEFAULT_CHIPSET, metavar="SOC"),)

    def unavailable_reason(self) -> str | None:
        reason = super().unavailable_reason()
        if reason is None and not os.environ.get("QNN_SDK_ROOT"):
            return "needs QNN_SDK_ROOT: the install directory of the Qualcomm AI Engine Direct SDK"
        return reason

    def partitioners(self, options) -> list:
        from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
        from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
        from executorch.backends.qualcomm.utils.utils import (
            generate_htp_compiler_spec,
            generate_qnn_executorch_compiler_spec,
        )

        spec = generate_qnn_executorch_compiler_spec(
            getattr(QcomChipset, options["chipset"]), generate_htp_compiler_spec(use_fp16=False)
        )
        return [QnnPartitioner(spec)]

    def quantizer(self, scheme: str):
        from etblocks.backends.qnn.quantizer import qnn_quantizer

        return qnn_quantizer(scheme)

    def readiness(self, programs):
        from etblocks.backends.qnn.readiness import qnn_readiness

        return qnn_readiness(programs)


BACKEND = Qnn()
