"""XNNPACK: ExecuTorch's CPU delegate, the fast path for phones' and laptops' CPUs."""

from __future__ import annotations

from etblocks.backends.base import INT8_IO_CACHE, Backend
from etblocks.options import EMBEDDING_SCHEMES, WEIGHT_SCHEMES


class Xnnpack(Backend):
    name = "xnnpack"
    requires = "executorch.backends.xnnpack"
    runtime_name = "XnnpackBackend"
    dynamic_shapes = True
    external_weights = True  # constants under their content keys in a shared .ptd
    recipe = {"sdpa": "custom", "cache_update": "custom", "delta_rule": "fused"}
    weight_schemes = WEIGHT_SCHEMES  # its dynamically quantized GEMMs
    embedding_schemes = EMBEDDING_SCHEMES  # looked up by quantized_decomposed::embedding_byte on CPU
    # workaround(executorch 1.5.1): int8 caller-owned caches refused; its partitioner builds a cyclic partition.
    limits = {
        INT8_IO_CACHE: "ExecuTorch 1.5.1's XNNPACK partitioner proposes a partition with a dependency cycle around the "
        "cache quantization (the dynamic xnnpack program has in-place int8 caches)",
    }

    def partitioners(self, options) -> list:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]

    def graph_passes(self) -> list:
        from etblocks.backends.passes import (
            dedupe_views,
            inverse_square_root_as_rsqrt,
            mean_over_last_dim_as_linear,
            rms_norm_as_primitives,
        )

        return [rms_norm_as_primitives, inverse_square_root_as_rsqrt, mean_over_last_dim_as_linear, dedupe_views]


BACKEND = Xnnpack()
