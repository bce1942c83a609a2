"""Conv-BatchNorm modules trained with recompute: a ``torch.nn.Conv2d`` (no bias) and a
``torch.nn.BatchNorm2d`` run as one numbafuse op.

    ConvBatchNormReLU2d(in_channels, out_channels, kernel_size, stride=1, padding=0,
                        dilation=1, groups=1, eps=1e-5, momentum=0.1, device=None, dtype=None,
                        recompute=True)
    ConvBatchNorm2d(...)          the same arguments, no ReLU (a ResNet downsample branch)
    ConvBatchNormAddReLU2d(...)   the same arguments, called as m(x, z): relu(bn(conv(x)) + z)
    <class>.from_modules(conv, bn, recompute=True)   the modules of an existing model, shared
                                                     (not copied)

State: the sub-modules ``conv`` (``torch.nn.Conv2d(..., bias=False)``) and ``bn``
(``torch.nn.BatchNorm2d``), so the keys are ``conv.weight``, ``bn.weight``, ``bn.bias``,
``bn.running_mean``, ``bn.running_var``, ``bn.num_batches_tracked``, a ``Conv2d``'s and a
``BatchNorm2d``'s checkpoints load under those prefixes, and recipes that look for
``isinstance(m, nn.BatchNorm2d)`` (freezing batch norm, no-decay groups) find ``bn``. Each
call reads ``bn``'s ``training``, ``momentum`` (``None``: the cumulative average) and ``eps``,
counts ``num_batches_tracked`` and updates the running statistics as ``BatchNorm2d.forward``
does (:func:`numbafuse.torch.sites.bn_state`), then runs
:func:`~numbafuse.torch.conv_batchnorm_relu` / :func:`~numbafuse.torch.conv_batchnorm_add_relu`:
backward keeps the conv's input, not its output (``recompute=False``, an attribute too: it
keeps the output as well and runs no conv forward in backward, faster; ``"auto"``: that
where the conv is dear to recompute and its output small, the deep layers). ``groups`` makes a
grouped or depthwise conv (MobileNet's Conv(dw)-BN-ReLU: ``groups=in_channels``);
channels_last inputs run the NHWC kernels and give channels_last outputs; ``dtype``
float32/float64/half and ``device`` CPU/CUDA, else an error naming the argument.

Examples
--------
>>> import torch
>>> from numbafuse.torch import ConvBatchNormReLU2d
>>> dw = ConvBatchNormReLU2d(8, 8, 3, padding=1, groups=8)        # MobileNet's depthwise
>>> x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
>>> y = dw(x)
>>> y.shape, y.is_contiguous(memory_format=torch.channels_last), int(dw.bn.num_batches_tracked)
(torch.Size([2, 8, 6, 6]), True, 1)
>>> list(dw.state_dict())[:3]
['conv.weight', 'bn.weight', 'bn.bias']
"""
from __future__ import annotations

from torch import nn

from .. import validate
from .conv_batchnorm import conv_batchnorm_add_relu, conv_batchnorm_relu
from .layers import factory_kwargs
from .sites import bn_state, conv_args


class ConvBatchNormReLU2d(nn.Module):
    """``relu(bn(conv(x)))`` fused, trained with recompute (module docstring)."""

    relu = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, eps=1e-5, momentum=0.1, device=None, dtype=None, recompute=True):
        super().__init__()
        self.recompute = validate.check_recompute(type(self).__name__, recompute)
        like = factory_kwargs(type(self).__name__, device, dtype)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation,
                              groups, bias=False, **like)
        self.bn = nn.BatchNorm2d(out_channels, eps, momentum, **like)

    @classmethod
    def from_modules(cls, conv, bn, recompute=True):
        """The fused module over the existing ``conv`` (a bias-free ``torch.nn.Conv2d``) and
        ``bn`` (a ``torch.nn.BatchNorm2d`` of its output channels), shared, not copied."""
        name = cls.__name__
        if type(conv) is not nn.Conv2d or conv.bias is not None:
            raise TypeError(f"{name}.from_modules: conv must be a torch.nn.Conv2d without bias, "
                            f"got {conv!r}")
        if type(bn) is not nn.BatchNorm2d or bn.num_features != conv.out_channels:
            raise TypeError(f"{name}.from_modules: bn must be a torch.nn.BatchNorm2d of "
                            f"{conv.out_channels} features, got {bn!r}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.conv, module.bn = conv, bn
        module.recompute = validate.check_recompute(f"{name}.from_modules", recompute)
        return module

    def forward(self, x):
        weight, bias, running_mean, running_var, training, momentum, eps = bn_state(self.bn, x)
        return conv_batchnorm_relu(x, self.conv.weight, weight, bias, running_mean,
                                   running_var, training, momentum, eps, relu=self.relu,
                                   recompute=self.recompute, **conv_args(self.conv))


class ConvBatchNorm2d(ConvBatchNormReLU2d):
    """``bn(conv(x))`` fused (no ReLU), trained with recompute (module docstring)."""

    relu = False


class ConvBatchNormAddReLU2d(ConvBatchNormReLU2d):
    """``relu(bn(conv(x)) + z)`` fused, called as ``m(x, z)``: a ResNet block's tail."""

    def forward(self, x, z):
        weight, bias, running_mean, running_var, training, momentum, eps = bn_state(self.bn, x)
        return conv_batchnorm_add_relu(x, self.conv.weight, z, weight, bias, running_mean,
                                       running_var, training, momentum, eps,
                                       recompute=self.recompute, **conv_args(self.conv))


__all__ = ["ConvBatchNormReLU2d", "ConvBatchNorm2d", "ConvBatchNormAddReLU2d"]
