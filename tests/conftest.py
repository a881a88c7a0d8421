"""Process-wide test setup."""

import os

# OpenVINO's CPU plugin computes in bf16 on CPUs with AVX512-BF16/AMX, and ExecuTorch's OpenVINO runtime
# imports compiled models without a config, so a program compiled for fp32 still runs in bf16 there. Capping
# oneDNN's instruction set (read once, when the plugin loads) keeps OpenVINO in fp32, which the token-for-token
# parity tests need.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
