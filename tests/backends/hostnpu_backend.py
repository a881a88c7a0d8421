"""A backend defined in this one file: an NPU's static contract on ExecuTorch's portable kernels, to run NPU-shaped
programs on a host. What `tests/backends/test_backend_plugin.py` registers in-process and, through the entry point
group `etblocks.backends`, in the `etblocks` command."""

from etblocks.backends import INT8_IO_CACHE, Backend


class HostNpu(Backend):
    name = "hostnpu"
    recipe = {"shapes": "static", "cache": "io", "sdpa": "static", "moe": "dense", "chunk": 4}
    limits = {INT8_IO_CACHE: "this test backend declares that it does not lower int8 caller-owned caches"}
