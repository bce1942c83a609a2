"""Optimizers: stochastic gradient descent with momentum and weight decay (PyTorch semantics).

For each parameter ``p`` with gradient ``g`` (``lr``, momentum ``m``, weight decay ``wd``)::

    g  <- g + wd * p                   (weight decay is added to the gradient)
    b  <- copy of g      on the first step with momentum, then  b <- m * b + g   (m >= 0)
    p  <- p - lr * b                   (p - lr * g without momentum)

exactly as ``torch.optim.SGD`` (dampening 0, no Nesterov). Host parameters are updated in
place with NumPy; device parameters with the device ``a*x + b*y`` kernel
(``numbafuse.kernels.elementwise.cuda.axpby``), which returns a new device array that replaces
``p.data`` (the ``Tensor`` object stays the same, so modules keep seeing it).
"""
from __future__ import annotations

import numpy as np

from . import backend, kernels, validate
from .autograd import Tensor


class SGD:
    """Stochastic gradient descent, PyTorch semantics.

    Parameters
    ----------
    params : iterable of Tensor
        The trainable tensors, e.g. ``model.parameters()``.
    lr : float
        Learning rate (> 0).
    momentum : float
        Momentum factor, >= 0 like PyTorch (which checks no upper bound either: at 1 or more
        the buffer sums gradients without decay); 0 disables the momentum buffer.
    weight_decay : float
        L2 penalty (>= 0), added to the gradient as ``weight_decay * p``.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> p = nf.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    >>> opt = nf.optim.SGD([p], lr=0.1, momentum=0.9)
    >>> (p * p).sum().backward()
    >>> opt.step()
    >>> p.data
    array([0.8, 1.6])
    """

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0):
        self.params = list(params)
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise TypeError(f"SGD: params[{i}] must be a Tensor, got {type(p).__name__}")
        self.lr = validate.check_scalar("SGD", "lr", lr, lo=0.0, lo_open=True)
        self.momentum = validate.check_scalar("SGD", "momentum", momentum, lo=0.0)
        self.weight_decay = validate.check_scalar("SGD", "weight_decay", weight_decay, lo=0.0)
        self.momentum_buffers = [None] * len(self.params)   # b per parameter, made on first use

    def zero_grad(self):
        """Drop every parameter's gradient (the tape accumulates into ``.grad``)."""
        for p in self.params:
            p.grad = None

    def step(self):
        """One update of every parameter that has a gradient."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if isinstance(p.data, np.ndarray):
                self._step_host(i, p)
            else:
                self._step_device(i, p)

    def _step_host(self, i, p):
        dtype = p.data.dtype.type
        g = p.grad
        if self.weight_decay:
            g = g + dtype(self.weight_decay) * p.data           # new array: .grad is untouched
        if self.momentum:
            b = self.momentum_buffers[i]
            if b is None:
                b = self.momentum_buffers[i] = np.array(g, dtype=p.data.dtype)
            else:
                b *= dtype(self.momentum)
                b += g
            g = b
        p.data -= dtype(self.lr) * g                            # in place

    def _step_device(self, i, p):
        ew = kernels.module("elementwise", backend.CUDA)
        w, g = kernels.contiguous(p.data), kernels.contiguous(p.grad)
        if self.weight_decay:
            g = ew.axpby(1.0, g, self.weight_decay, w)          # g + wd * p
        if self.momentum:
            b = self.momentum_buffers[i]
            # the first buffer is a copy of g (g may be p.grad itself), as on the host
            b = backend.copy(g) if b is None else ew.axpby(self.momentum, b, 1.0, g)  # m*b + g
            self.momentum_buffers[i] = b
            g = b
        p.data = ew.axpby(1.0, w, -self.lr, g)                  # p - lr * g
