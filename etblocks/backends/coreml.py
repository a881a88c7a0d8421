"""Core ML: Apple's CPU, GPU and Neural Engine (static programs; lowers on Linux, runs on Apple devices)."""

from __future__ import annotations

from etblocks.backends.base import INT8_IO_CACHE, STATIC_IO, Backend


class CoreMl(Backend):
    name = "coreml"
    requires = "coremltools"
    install_hint = "pip install coremltools"
    runtime_name = "CoreMLBackend"
    recipe = {**STATIC_IO, "moe": "dense"}
    # workaround(coremltools 9.0): int8 caller-owned caches refused; its converter fails on int8 cache tensors.
    limits = {INT8_IO_CACHE: "coremltools 9.0 fails on the int8 cache tensors (KeyError: torch.int8)"}
    quantization_hint = "Core ML programs are fp32 or fp16 (dtype=torch.float16)"

    def partitioners(self, options) -> list:
        """iOS 18 / macOS 15 programs (fp16 inputs and caches need iOS 16+); Core ML computes in fp16 by default, as
        the Neural Engine does."""
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner

        specs = CoreMLBackend.generate_compile_specs(minimum_deployment_target=ct.target.iOS18)
        return [CoreMLPartitioner(compile_specs=specs)]


BACKEND = CoreMl()
