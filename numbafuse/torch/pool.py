"""numbafuse's max pool for PyTorch tensors: what a fused model runs for ``nn.MaxPool2d``.

    max_pool2d(x, kernel_size, stride=None, padding=0) -> y     # F.max_pool2d's values

On a CPU float32/float64 tensor, contiguous or channels_last (the output keeps the format),
numbafuse's CPU kernel (``kernels/basic/cpu_pool.py``: the padding never wins, the first
maximum of a window gets its gradient, gradients summed per pixel in PyTorch's order: values
and gradients bit for bit PyTorch's, NaN aside: PyTorch sends a window's gradient to its last
NaN, numbafuse to its first). Backward keeps a one-byte window argmax per output (PyTorch:
an int64 index). Elsewhere (another device or dtype, windows over 256 taps, while torch
captures a graph: ``torch.compile`` compiles its own) it is ``F.max_pool2d`` itself.

Why: PyTorch's CPU max pool of an NCHW tensor is a scalar loop per output; at ResNet's stem
pool (3x3/2, padding 1, (16, 64, 32, 32), 2 threads, machine E) it took 3.0 ms (its
channels_last kernel 0.17 ms), 4% of a ResNet-18 training step at 64x64 and 15% of an eval
forward; numbafuse's 0.29 ms forward, 0.30 backward (docs/pytorch.md).
"""
from __future__ import annotations

import torch

from .. import validate
from ..kernels.basic import cpu as _cpu
from .bridge import capturing, layout_of

F = torch.nn.functional
_DTYPES = (torch.float32, torch.float64)


class MaxPool2dFunction(torch.autograd.Function):
    """``F.max_pool2d(x, kernel_size, stride, padding)`` on numbafuse's CPU kernels."""

    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding):
        layout = layout_of(x)
        nhwc = layout == "NHWC"
        xa = (x.permute(0, 2, 3, 1) if nhwc else x).detach().contiguous().numpy()
        g = validate.pool_geometry("max_pool2d", xa, kernel_size, stride, layout, padding)
        y, argmax = _cpu.max_pool2d_forward(xa, g)
        ctx.geometry, ctx.nhwc = g, nhwc
        ctx.save_for_backward(torch.from_numpy(argmax))
        y = torch.from_numpy(y)
        return y.permute(0, 3, 1, 2) if nhwc else y

    @staticmethod
    def backward(ctx, gy):
        (argmax,) = ctx.saved_tensors
        gy = (gy.permute(0, 2, 3, 1) if ctx.nhwc else gy).contiguous().numpy()
        gx = torch.from_numpy(_cpu.max_pool2d_backward(gy, argmax.numpy(), ctx.geometry,
                                                       gy.dtype))
        return (gx.permute(0, 3, 1, 2) if ctx.nhwc else gx), None, None, None


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def refusal(x, kernel_size):
    """Why numbafuse's kernel does not run this call (None if it does)."""
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        return "not a CPU tensor"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}"
    if x.dim() != 4:
        return f"a {x.dim()}-d input"
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return "an input neither contiguous nor channels_last"
    kh, kw = _pair(kernel_size)
    if kh * kw > 256:
        return f"a {kh}x{kw} window (over 256 taps)"
    return None


def max_pool2d(x, kernel_size, stride=None, padding=0):
    """``F.max_pool2d(x, kernel_size, stride, padding)`` (dilation 1, floor, no indices),
    on numbafuse's CPU kernel where it can (the module docstring)."""
    stride = kernel_size if stride is None or stride == [] or stride == () else stride
    if capturing() or refusal(x, kernel_size) is not None:
        return F.max_pool2d(x, kernel_size, stride, padding)
    return MaxPool2dFunction.apply(x, _pair(kernel_size), _pair(stride), _pair(padding))
