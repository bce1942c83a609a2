"""The call sites of a fused model (:func:`numbafuse.torch.fuse`): one function per fused
pattern, called by the rewritten graph with the activations and the modules themselves.

    fused_conv_bn_relu(x, conv, bn, relu, site)     relu(bn(conv(x))), or bn(conv(x))
    fused_conv_bn_add_relu(x, z, conv, bn, site)    relu(bn(conv(x)) + z)
    fused_bn_add_relu(x, z, bn, site)               relu(bn(x) + z)
    fused_conv_relu(x, conv, site)                  relu(conv(x))
    pooled_max(x, pool, site)                       pool(x), a MaxPool2d on numbafuse's kernel

Each reads its modules at the call (parameters, buffers, ``training``, ``momentum``, ``eps``,
``track_running_stats``), counts ``num_batches_tracked`` and updates the running statistics
as ``BatchNorm2d.forward`` does, and runs numbafuse's fused op. Where numbafuse's kernels
cannot stand for the modules or the tensors (:func:`conv_refusal`, :func:`bn_refusal`: also
what ``fuse`` refuses at trace time; and the tensors' dtype, device, layout, a broadcast
residual, autocast) it calls the modules themselves, and logs a warning once per site.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from .conv_batchnorm import conv_batchnorm_add_relu, conv_batchnorm_relu
from . import pool as _pool
from .bridge import DEVICE_TYPES, TENSOR_DTYPES
from .layers import batchnorm_add_relu, conv_bias_relu

logger = logging.getLogger("numbafuse.torch")


# --------------------------------------------------------------------------- what fits

def _hooked(module):
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def conv_refusal(conv, with_bn=False):
    """Why numbafuse's fused conv cannot stand for ``conv`` (None if it can)."""
    if type(conv) is not nn.Conv2d:
        return f"{type(conv).__name__} is not torch.nn.Conv2d (a subclass may compute more)"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (numbafuse pads with zeros)"
    if with_bn and conv.bias is not None:
        return ("the conv has a bias (numbafuse's Conv-BatchNorm takes a bias-free conv; the "
                "bias moves the running mean)")
    if _hooked(conv):
        return "the conv has hooks (a fused call would skip them)"
    return None


def pool_refusal(pool):
    """Why numbafuse's max pool cannot stand for ``pool`` (None if it can)."""
    if type(pool) is not nn.MaxPool2d:
        return f"{type(pool).__name__} is not torch.nn.MaxPool2d (a subclass may compute more)"
    if pool.dilation not in (1, (1, 1)):
        return f"dilation={pool.dilation!r} (numbafuse's max pool has none)"
    if pool.ceil_mode:
        return "ceil_mode=True (numbafuse's max pool rounds the output size down)"
    if pool.return_indices:
        return "return_indices=True (numbafuse keeps a window argmax, not PyTorch's indices)"
    if _hooked(pool):
        return "the max pool has hooks (a call of numbafuse's would skip them)"
    return None


def bn_refusal(bn):
    """Why numbafuse's fused batch norm cannot stand for ``bn`` (None if it can)."""
    if type(bn) is not nn.BatchNorm2d:
        return f"{type(bn).__name__} is not torch.nn.BatchNorm2d (a subclass may compute more)"
    if _hooked(bn):
        return "the batch norm has hooks (a fused call would skip them)"
    return None


def _tensor_refusal(x, w, z=None, z_shape=None):
    """Why the input ``x``, a parameter ``w`` (its dtype and device stand for the modules') and
    the residual ``z`` of output shape ``z_shape`` cannot go to numbafuse's kernels now (None
    if they can). The op itself checks the other parameters and buffers (an error naming
    them, as torch's layers raise on mixed dtypes)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return "the input is not a 4-d tensor"
    if x.dtype not in TENSOR_DTYPES:
        return f"{x.dtype} tensors (numbafuse runs float32, float64 and half precision)"
    if x.device.type not in DEVICE_TYPES:
        return f"tensors on {x.device}"
    if not _dense(x):
        return "a non-contiguous tensor (neither NCHW nor channels_last)"
    if w is not None and (w.dtype != x.dtype or w.device != x.device):
        return f"a {x.dtype} input on {x.device}, parameters {w.dtype} on {w.device}"
    if z_shape is not None:
        if not isinstance(z, torch.Tensor) or tuple(z.shape) != z_shape:
            return "the residual's shape is not the output's (a broadcast add)"
        if z.dtype != x.dtype or z.device != x.device:
            return f"a {x.dtype} input on {x.device}, a {z.dtype} residual on {z.device}"
        if not _dense(z):
            return "a non-contiguous residual (neither NCHW nor channels_last)"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is on"
    return None


def _dense(t):
    """Contiguous, NCHW or channels_last (what numbafuse's NCHW and NHWC kernels read)."""
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _conv_out_shape(conv, x):
    """The shape of ``conv(x)``, torch's arithmetic."""
    N, _, H, W = x.shape
    if isinstance(conv.padding, str):
        pad = (0, 0) if conv.padding == "valid" else None
    else:
        pad = conv.padding
    if pad is None:                                        # "same" (stride 1)
        return (N, conv.out_channels, H, W)
    size = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, p, d, k, s in
            zip((H, W), pad, conv.dilation, conv.kernel_size, conv.stride)]
    return (N, conv.out_channels, *size)


_warned = set()


def _unfused(site, reason):
    if (site, reason) not in _warned:
        _warned.add((site, reason))
        logger.warning("numbafuse.torch.fuse: %s runs unfused: %s", site, reason)


def bn_state(bn, x):
    """(weight, bias, running_mean, running_var, training, momentum, eps) as
    ``BatchNorm2d.forward`` reads them at this call (``num_batches_tracked`` counted; the
    cumulative average's factor for ``momentum=None``; ``affine=False``: 1 and 0)."""
    momentum = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:                     # cumulative moving average
            momentum = 1.0 / float(bn.num_batches_tracked)
    training = bn.training or (bn.running_mean is None and bn.running_var is None)
    use_running = not bn.training or bn.track_running_stats
    running_mean = bn.running_mean if use_running else None
    running_var = bn.running_var if use_running else None
    weight, bias = bn.weight, bn.bias
    if weight is None:                              # affine=False
        weight = torch.ones(bn.num_features, dtype=x.dtype, device=x.device)
    if bias is None:
        bias = torch.zeros(bn.num_features, dtype=x.dtype, device=x.device)
    return weight, bias, running_mean, running_var, training, momentum, bn.eps


def conv_args(conv):
    """The keywords of numbafuse.torch's conv functions for the ``torch.nn.Conv2d`` ``conv``."""
    return dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation,
                groups=conv.groups)


# --------------------------------------------------------------------------- site functions

def fused_conv_bn_relu(x, conv, bn, relu, site, recompute=True):
    """``relu(bn(conv(x)))`` (``relu=False``: ``bn(conv(x))``) by numbafuse's Conv-BatchNorm(-ReLU)
    with recompute (``recompute=False``: h kept instead), reading ``conv`` and ``bn`` now; the
    modules themselves where it cannot."""
    reason = (conv_refusal(conv, with_bn=True) or bn_refusal(bn)
              or _tensor_refusal(x, conv.weight))
    if reason is not None:
        _unfused(site, reason)
        y = bn(conv(x))
        return torch.relu(y) if relu else y
    weight, bias, running_mean, running_var, training, momentum, eps = bn_state(bn, x)
    return conv_batchnorm_relu(x, conv.weight, weight, bias, running_mean, running_var,
                               training, momentum, eps, relu=relu, recompute=recompute,
                               **conv_args(conv))


def fused_conv_bn_add_relu(x, z, conv, bn, site, recompute=True):
    """``relu(bn(conv(x)) + z)`` by numbafuse's Conv-BatchNorm-Add-ReLU with recompute
    (``recompute=False``: h kept instead)."""
    reason = (conv_refusal(conv, with_bn=True) or bn_refusal(bn) or _tensor_refusal(
        x, conv.weight, z, _conv_out_shape(conv, x) if isinstance(x, torch.Tensor)
        and x.dim() == 4 else ()))
    if reason is not None:
        _unfused(site, reason)
        return torch.relu(bn(conv(x)) + z)
    weight, bias, running_mean, running_var, training, momentum, eps = bn_state(bn, x)
    return conv_batchnorm_add_relu(x, conv.weight, z, weight, bias, running_mean, running_var,
                                   training, momentum, eps, recompute=recompute,
                                   **conv_args(conv))


def fused_bn_add_relu(x, z, bn, site):
    """``relu(bn(x) + z)`` by numbafuse's BatchNorm-Add-ReLU."""
    reason = bn_refusal(bn) or _tensor_refusal(
        x, bn.weight, z, tuple(x.shape) if isinstance(x, torch.Tensor) else ())
    if reason is not None:
        _unfused(site, reason)
        return torch.relu(bn(x) + z)
    weight, bias, running_mean, running_var, training, momentum, eps = bn_state(bn, x)
    return batchnorm_add_relu(x, z, weight, bias, running_mean, running_var, training,
                              momentum, eps)


def fused_conv_relu(x, conv, site):
    """``relu(conv(x))`` by numbafuse's Conv-Bias-ReLU (with the conv's bias, if any)."""
    reason = conv_refusal(conv) or _tensor_refusal(x, conv.weight)
    if reason is not None:
        _unfused(site, reason)
        return torch.relu(conv(x))
    return conv_bias_relu(x, conv.weight, conv.bias, **conv_args(conv))


def pooled_max(x, pool, site):
    """``pool(x)`` (a ``torch.nn.MaxPool2d``) by numbafuse's max pool where it can run
    (``numbafuse.torch.pool``: CPU float tensors; elsewhere, e.g. on CUDA, PyTorch's own,
    without a warning: that is by design); ``pool`` itself where the module changed since."""
    reason = pool_refusal(pool)
    if reason is not None:
        _unfused(site, reason)
        return pool(x)
    return _pool.max_pool2d(x, pool.kernel_size, pool.stride, pool.padding)


# the site functions: recorded as calls (not traced into) when a fused model is traced again
SITE_FUNCTIONS = (fused_conv_bn_relu, fused_conv_bn_add_relu, fused_bn_add_relu, fused_conv_relu,
                  pooled_max)
