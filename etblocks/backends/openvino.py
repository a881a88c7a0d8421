"""OpenVINO: Intel CPUs, GPUs and NPUs, through ExecuTorch's OpenVINO delegate (static programs)."""

from __future__ import annotations

from etblocks.backends.base import STATIC_IO, Backend


class OpenVino(Backend):
    name = "openvino"
    requires = "openvino"
    install_hint = "pip install 'etblocks[openvino]'"
    runtime_name = "OpenvinoBackend"
    recipe = {**STATIC_IO, "moe": "dense"}

    def partitioners(self, options) -> list:
        from executorch.backends.openvino.partitioner import OpenvinoPartitioner
        from executorch.exir.backend.compile_spec_schema import CompileSpec

        return [OpenvinoPartitioner([CompileSpec("device", b"CPU")])]

    def precision_note(self, exact: bool) -> str:
        return "" if exact else "reduced precision: bf16/fp16 compute; ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps OpenVINO in fp32"


BACKEND = OpenVino()
