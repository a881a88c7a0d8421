"""A Linear computed as a 1x1 convolution: QNN HTP runs Conv2d faster than MatMul/FullyConnected."""

from __future__ import annotations

import torch
from torch import nn


class Conv2dLinear(nn.Conv2d):
    """`forward(x [B, T, in]) -> [B, T, out]`, equal to `nn.Linear(in, out)` with `weight [out, in, 1, 1]`.

    The tokens run along the convolution's width: `x` goes through as `[B, in, 1, T]`. The permutes are
    cheap on fixed (static-program) shapes and let HTP pick its conv kernels.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, kernel_size=1, bias=bias, device=device, dtype=dtype)

    @property
    def in_features(self) -> int:
        return self.in_channels

    @property
    def out_features(self) -> int:
        return self.out_channels

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Conv2dLinear:
        """Share `linear`'s weight (a `[out, in, 1, 1]` view, no copy) and its bias Parameter."""
        conv = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        weight = linear.weight.detach().view(linear.out_features, linear.in_features, 1, 1)
        conv.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
        conv.bias = linear.bias
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        y = super().forward(x.reshape(bsz, seq, 1, self.in_channels).permute(0, 3, 2, 1))  # [B, out, 1, T]
        return y.permute(0, 3, 2, 1).reshape(bsz, seq, self.out_channels)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
