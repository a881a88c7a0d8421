"""Token mixers that are not attention: they keep a fixed-size state (a convolution window, a recurrent matrix)
instead of K/V rows. Same contract as attention (`etblocks.state.mixer`)."""

from etblocks.mixers.delta_rule import ChunkedDeltaRule, DeltaRule, FusedDeltaRule, gated_delta_rule_steps
from etblocks.mixers.gated_deltanet import GatedDeltaNet, GatedRMSNorm
from etblocks.mixers.mamba2 import GroupedGatedRMSNorm, Mamba2, ssd_scan, ssd_step
from etblocks.mixers.short_conv import ShortConv, causal_depthwise_conv

__all__ = [
    "ShortConv",
    "causal_depthwise_conv",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "DeltaRule",
    "ChunkedDeltaRule",
    "FusedDeltaRule",
    "gated_delta_rule_steps",
    "Mamba2",
    "GroupedGatedRMSNorm",
    "ssd_scan",
    "ssd_step",
]
