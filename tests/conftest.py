"""Process-wide test setup."""

import os

# OpenVINO's CPU plugin computes in bf16 on CPUs with AVX512-BF16/AMX, and ExecuTorch's OpenVINO runtime
# imports compiled models without a config, so a program compiled for fp32 still runs in bf16 there. Capping
# oneDNN's instruction set (read once, when the plugin loads) keeps OpenVINO in fp32, which the token-for-token
# parity tests need.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")

# The two xdist workers take whole files (`--dist loadfile`) in collection order. The files that export the most
# go first (longest first), so neither worker is left alone with a long file at the end: that tail cost ~5 min of
# a 57-min run in alphabetical order. From `--durations=0` on CI's machine kind; files not listed follow in order.
HEAVIEST_FIRST = (
    "tests/swap/test_hf_families.py",
    "tests/export/test_qnn_recipe.py",
    "tests/moe/test_moe_programs.py",
    "tests/test_benchmarks.py",  # ~11 min of smoke runs (680 s summed over its tests on this machine kind)
    "tests/swap/test_torchtune_families.py",
    "tests/export/test_static_programs.py",
    "tests/export/test_hybrid_programs.py",
    "tests/adapters/test_adapter_programs.py",
    "tests/export/test_speculation.py",
    "tests/export/test_delegation_golden.py",
    "tests/adapters/test_sha_adapters.py",
    "tests/export/test_weight_quant.py",
    "tests/test_cli.py",
)


def pytest_collection_modifyitems(items):
    rank = {path: place for place, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
