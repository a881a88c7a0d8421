"""Thread settings for processes that run programs on the host.

It imports nothing (no torch): the setting has to be made before torch loads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

BLAS_THREADS_ENV = "MKL_NUM_THREADS"


def prefer_single_threaded_blas(environ: MutableMapping[str, str] = os.environ,
                                modules: Mapping[str, object] = sys.modules) -> bool:
    """Ask torch's MKL for one thread when neither torch is loaded yet (MKL reads the variable when it loads) nor
    the variable set; returns whether it set it.

    ExecuTorch's CPU attention kernel (`llama::custom_sdpa`, in every XNNPACK program) multiplies through BLAS
    from inside ExecuTorch's own thread pool, and in a Python process that BLAS is torch's MKL: its threads on top
    of the pool's oversubscribe the cores. A device build has no MKL. For processes that run programs (`etblocks
    run`, `chat`, the benchmarks' timing processes), not ones that export or run models in torch, whose matrix
    products MKL's threads speed up.
    """
    if "torch" in modules or BLAS_THREADS_ENV in environ:
        return False
    environ[BLAS_THREADS_ENV] = "1"
    return True
