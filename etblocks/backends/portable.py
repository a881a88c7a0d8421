"""Portable: ExecuTorch's own CPU kernels, no delegate; runs anything, also a host check of an NPU program."""

from __future__ import annotations

from etblocks.backends.base import Backend


class Portable(Backend):
    name = "portable"
    dynamic_shapes = True
    recipe = {"sdpa": "dynamic"}
    external_weights = True  # constants under their names in a shared .ptd


BACKEND = Portable()
