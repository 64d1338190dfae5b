"""Mllama's vision patch embedding: the CS linear ``[H, p*p*C]`` as HF's convolution weight ``[H, C, p, p]``.

The CS vision model patchifies the image itself and applies a linear layer whose input runs over
(patch row, patch column, channel); HF applies a ``Conv2d`` whose weight is ``[out, channel, row, column]``.
So the HF weight is the CS weight viewed as ``[H, p, p, C]`` with its last axis moved to the front of the
three patch axes. Reading any box of the result reads only the CS rows (output channels) it covers.
"""
from __future__ import annotations

import numpy as np

from ...errors import MappingError
from ...tensor.base import Box, VirtualTensor


class PatchLinearAsConv(VirtualTensor):
    """``src`` [H, rows*cols*channels] seen as the conv weight [H, channels, rows, cols]."""

    def __init__(self, src: VirtualTensor, rows: int, cols: int, channels: int):
        rows, cols, channels = int(rows), int(cols), int(channels)
        if src.ndim != 2 or src.shape[1] != rows * cols * channels:
            raise MappingError(None, f"patch_linear_to_conv: {src.describe()} is not a linear weight "
                                     f"[H, {rows}*{cols}*{channels}]")
        super().__init__((src.shape[0], channels, rows, cols), src.dtype)
        self.src, self.rows, self.cols, self.channels = src, rows, cols, channels

    def read(self, box: Box) -> np.ndarray:
        (h0, h1), (c0, c1), (r0, r1), (k0, k1) = box
        rows = self.src.read(((h0, h1), (0, self.src.shape[1])))
        patch = rows.reshape(h1 - h0, self.rows, self.cols, self.channels).transpose(0, 3, 1, 2)
        return np.ascontiguousarray(patch[:, c0:c1, r0:r1, k0:k1])

    def sources(self):
        return [self.src]

    def describe(self) -> str:
        return (f"conv view [H, {self.channels}, {self.rows}, {self.cols}] of the linear patch embedding "
                f"{self.src.describe()}")


def patch_linear_to_conv(x, patch_size, channels) -> VirtualTensor:
    """HF conv weight from the CS linear patch embedding; ``patch_size`` is ``[rows, cols]`` or one int."""
    if not isinstance(x, VirtualTensor):
        raise MappingError(None, f"patch_linear_to_conv: input is not a tensor ({x!r})")
    rows, cols = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
    return PatchLinearAsConv(x, rows, cols, channels)


class ConvAsPatchLinear(VirtualTensor):
    """The conv weight ``src`` [H, channels, rows, cols] seen as the CS linear patch embedding [H, rows*cols*channels]
    (the inverse of ``PatchLinearAsConv``)."""

    def __init__(self, src: VirtualTensor):
        if src.ndim != 4:
            raise MappingError(None, f"conv_to_patch_linear: {src.describe()} is not a conv weight [H, C, p, p]")
        h, c, r, k = src.shape
        super().__init__((h, r * k * c), src.dtype)
        self.src = src

    def read(self, box: Box) -> np.ndarray:
        (h0, h1), (a, b) = box
        conv = self.src.read(((h0, h1),) + tuple((0, n) for n in self.src.shape[1:]))
        flat = conv.transpose(0, 2, 3, 1).reshape(h1 - h0, -1)
        return np.ascontiguousarray(flat[:, a:b])

    def sources(self):
        return [self.src]

    def describe(self) -> str:
        return f"linear patch embedding view of the conv weight {self.src.describe()}"


def conv_to_patch_linear(y, patch_size, channels) -> list:
    """[CS linear patch embedding] from the HF conv weight (the inverse of ``patch_linear_to_conv``)."""
    t = ConvAsPatchLinear(y)
    rows, cols = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
    if y.shape[1:] != (int(channels), rows, cols):
        raise MappingError(None, f"conv_to_patch_linear: {y.describe()} is not [H, {channels}, {rows}, {cols}]")
    return [t]


FUNCTIONS = {"patch_linear_to_conv": patch_linear_to_conv}
INVERSES = {"patch_linear_to_conv": conv_to_patch_linear}
