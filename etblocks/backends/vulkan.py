"""Vulkan: Android and desktop GPUs (static programs; lowers on Linux, runs where a Vulkan driver is)."""

from __future__ import annotations

from etblocks.backends.base import STATIC_IO, Backend


class Vulkan(Backend):
    name = "vulkan"
    requires = "executorch.backends.vulkan"
    runtime_name = "VulkanBackend"
    recipe = {**STATIC_IO, "moe": "dense"}

    def partitioners(self, options) -> list:
        from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

        return [VulkanPartitioner()]

    def graph_passes(self) -> list:
        from etblocks.backends.passes import rms_norm_as_primitives

        return [rms_norm_as_primitives]


BACKEND = Vulkan()
