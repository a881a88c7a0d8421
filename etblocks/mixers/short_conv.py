"""LFM2's gated short convolution."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from etblocks.state.window import WindowState


def causal_depthwise_conv(window: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`window [B, K - 1 + T, C]` (the K - 1 kept inputs, then the call's T) -> `[B, T, C]`: `conv`'s K taps per
    channel over each input and the K - 1 before it. No padding: the window already holds the history."""
    out = F.conv1d(window.transpose(1, 2), conv.weight, conv.bias, groups=conv.groups)
    return out.transpose(1, 2)


class ShortConv(nn.Module):
    """LFM2's gated short convolution: `in_proj(x)` gives `b, c, h [B, T, D]`; `y = out_proj(c * conv(b * h))`,
    where `conv` is a depthwise causal convolution over the last `K = conv.kernel_size` inputs.

    `forward(x [B, T, D], input_pos [T], position_embeddings=None) -> [B, T, D]` (the mixer contract of
    `etblocks.state.mixer`; rotary tables are ignored). State: `conv_state`, a `WindowState` of the last K - 1
    gated inputs `b * h` `[B, K - 1, D]`, in place or caller-owned.

    Modules keep LFM2's names (`in_proj`, `conv`, `out_proj`), so state dicts and adapter targets are the
    upstream ones. Override `convolve` to change how the window is convolved.
    """

    def __init__(
        self,
        in_proj: nn.Module,
        conv: nn.Conv1d,
        out_proj: nn.Module,
        *,
        caller_owned: bool = False,
        max_batch_size: int = 1,
    ) -> None:
        super().__init__()
        dim, kernel_size = conv.in_channels, conv.kernel_size[0]
        if conv.groups != dim or conv.out_channels != dim:
            raise ValueError(
                f"conv must be depthwise (groups = channels = {dim}); got groups={conv.groups}, out_channels={conv.out_channels}"
            )
        if kernel_size < 2:
            raise ValueError(f"conv.kernel_size={kernel_size} keeps no history; a short convolution has 2 or more taps")
        self.dim = dim
        self.in_proj, self.conv, self.out_proj = in_proj, conv, out_proj
        owned = dict(caller_owned=caller_owned, max_batch_size=max_batch_size)
        self.conv_state = WindowState(kernel_size - 1, dim, conv.weight.dtype, name="conv_state", **owned)

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        return causal_depthwise_conv(window, self.conv)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        bch = self.in_proj(x)
        d = self.dim
        # workaround(executorch 1.5.1): slices, not chunk(): a split on the last dim can freeze a dynamic sequence
        # length in to_edge.
        b, c, h = bch[..., :d], bch[..., d : 2 * d], bch[..., 2 * d :]
        window = self.conv_state.update(input_pos, b * h)
        return self.out_proj(c * self.convolve(window))
