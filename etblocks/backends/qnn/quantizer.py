"""The `QnnQuantizer` for pt2e quantization of static programs, built without the Qualcomm SDK
(`etblocks.export.quantize` runs it)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Iterator

from etblocks.errors import ConfigError

if TYPE_CHECKING:
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer

PRECISIONS = ("16a8w", "16a4w", "8a8w")


@contextlib.contextmanager
def _no_sdk_download() -> Iterator[None]:
    """Keep ExecuTorch from downloading the Qualcomm SDK when none is configured.

    `QnnQuantizer()` looks for the SDK's op-constraint tables and, with `QNN_SDK_ROOT` unset, downloads the
    SDK to get them. An empty `QNN_SDK_ROOT` tells ExecuTorch the caller manages the SDK, so it falls back
    to no constraint validation instead (etblocks never fetches the SDK; the QNN backend asks for it). The
    variable is restored afterwards; ExecuTorch remembers the SDK as set up for this process, which is
    what etblocks wants anyway.
    """
    if os.environ.get("QNN_SDK_ROOT") is not None:
        yield
        return
    os.environ["QNN_SDK_ROOT"] = ""
    try:
        yield
    finally:
        os.environ.pop("QNN_SDK_ROOT", None)


def qnn_quantizer(precision: str = "16a8w") -> QnnQuantizer:
    """A `QnnQuantizer` for HTP: per-channel linear/conv weights and min/max activation ranges, as
    ExecuTorch's Qualcomm LLM recipes use. `precision` is activation bits + weight bits: 16a8w is the usual
    LLM choice, 16a4w halves its weight memory, 8a8w also halves activation traffic (and needs activation
    ranges narrow enough for 256 levels)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not a QNN precision; accepted: {list(PRECISIONS)}")
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from torchao.quantization.pt2e import MinMaxObserver

    with _no_sdk_download():
        quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(
        getattr(QuantDtype, f"use_{precision}"),
        is_conv_per_channel=True,
        is_linear_per_channel=True,
        act_observer=MinMaxObserver,
    )
    return quantizer
