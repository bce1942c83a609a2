"""Optimizers: stochastic gradient descent with momentum and weight decay (PyTorch semantics).

For each parameter ``p`` with gradient ``g`` (``lr``, momentum ``m``, weight decay ``wd``)::

    g  <- g + wd * p                   (weight decay is added to the gradient)
    b  <- copy of g      on the first step with momentum, then  b <- m * b + g   (m >= 0)
    p  <- p - lr * b                   (p - lr * g without momentum)

exactly as ``torch.optim.SGD`` (dampening 0, no Nesterov). Host parameters are updated in
place, one compiled pass each (``kernels.elementwise.cpu.sgd_param_step``: the arithmetic of
the NumPy steps above, bit for bit; NumPy itself for a parameter or gradient that is not a
C-contiguous array of the parameter's float dtype).

Device parameters take one fused step per dtype, as PyTorch's fused/foreach SGD: the
parameters of one dtype live in one flat pool buffer (each ``p.data`` becomes a view of its
slice, made on the first step and remade when ``p.data`` is reassigned, e.g. by
``load_state_dict`` or ``Module.to``), their momentum buffers in another, and one kernel
launch (``kernels.elementwise.cuda.sgd_step``; one per 32 parameters with a gradient) updates
them all in place from the tuple of gradients. The arithmetic is that of the per-parameter
``a*x + b*y`` steps it replaces, bit for bit (``tests/cuda/test_sgd_cuda.py``).
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
        self._groups = {}         # dtype -> _FlatGroup of the device parameters of that dtype

    def zero_grad(self):
        """Drop every parameter's gradient (the tape accumulates into ``.grad``)."""
        for p in self.params:
            p.grad = None

    def step(self):
        """One update of every parameter that has a gradient."""
        on_device = {}                                  # dtype -> indices of device params
        scalars = {}                                    # dtype -> the host step's scalars
        for i, p in enumerate(self.params):
            if isinstance(p.data, np.ndarray):
                if p.grad is not None:
                    self._step_host(i, p, scalars)
            else:
                on_device.setdefault(np.dtype(p.data.dtype), []).append(i)
        for dtype, indices in on_device.items():
            if any(self.params[i].grad is not None for i in indices):
                self._step_device(dtype, indices)

    def _step_host(self, i, p, scalars):
        data, g, b = p.data, p.grad, self.momentum_buffers[i]
        first = b is None
        if self.momentum and first:
            b = self.momentum_buffers[i] = np.empty_like(data)
        if not (_compiled_step(data, g) and (not self.momentum or _compiled_step(data, b))):
            self._step_host_numpy(i, p, first)
            return
        ew = kernels.module("elementwise", backend.CPU)
        s = scalars.get(data.dtype)
        if s is None:
            s = scalars[data.dtype] = ew.sgd_scalars(self.lr, self.momentum, self.weight_decay,
                                                     data.dtype)
        ew.sgd_param_step(data, g, data if b is None else b, s, self.weight_decay != 0,
                    self.momentum != 0, first)

    def _step_host_numpy(self, i, p, first):
        # the same step in NumPy calls, for arrays the compiled step does not take
        dtype = p.data.dtype.type
        g = p.grad
        if self.weight_decay:
            g = g + dtype(self.weight_decay) * p.data           # new array: .grad is untouched
        if self.momentum:
            b = self.momentum_buffers[i]
            if first:
                b = self.momentum_buffers[i] = np.array(g, dtype=p.data.dtype)
            else:
                b *= dtype(self.momentum)
                b += g
            g = b
        p.data -= dtype(self.lr) * g                            # in place

    def _step_device(self, dtype, indices):
        """The fused step of the device parameters ``indices`` of one dtype."""
        group = self._groups.get(dtype)
        if group is None or not group.holds(self.params, indices):
            group = _FlatGroup(self.params, indices, dtype, self.momentum_buffers)
            self._groups[dtype] = group
        group.repack(self.params)
        ew = kernels.module("elementwise", backend.CUDA)
        with_grad = [i for i in indices if self.params[i].grad is not None]
        for start in range(0, len(with_grad), ew.SGD_BUCKETS[-1]):
            part = with_grad[start:start + ew.SGD_BUCKETS[-1]]
            grads = [kernels.contiguous(self.params[i].grad) for i in part]
            table = group.table(part, bool(self.momentum))
            ew.sgd_step(group.values, group.buffers if self.momentum else group.values,
                        grads, table, self.lr, self.momentum, self.weight_decay)
        if self.momentum:
            for i in with_grad:
                group.started.add(i)
                self.momentum_buffers[i] = group.buffer_view(i)


def _compiled_step(data, other):
    """Whether the compiled host step takes ``other`` (a gradient or momentum buffer) with
    the parameter ``data``: C-contiguous arrays of one float dtype and one shape."""
    return (isinstance(other, np.ndarray) and data.flags.c_contiguous
            and other.flags.c_contiguous and other.dtype == data.dtype
            and other.shape == data.shape and data.dtype in _STEP_DTYPES)


_STEP_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _FlatGroup:
    """The device parameters of one dtype in one flat pool buffer (``values``, each
    ``p.data`` a view of its slice) and their momentum buffers in another (``buffers``),
    with the fused step's chunk tables (device arrays, one per set of parameters stepped)."""

    def __init__(self, params, indices, dtype, momentum_buffers):
        self.indices = tuple(indices)
        self.shapes = {i: tuple(params[i].data.shape) for i in indices}
        self.sizes, self.offsets, total = {}, {}, 0
        for i in indices:
            self.sizes[i] = int(np.prod(self.shapes[i], dtype=np.int64))
            self.offsets[i] = total
            total += self.sizes[i]
        self.values = backend.empty(backend.CUDA, max(total, 1), dtype)    # (total,)
        self.buffers = backend.empty(backend.CUDA, max(total, 1), dtype)   # (total,)
        self.views = {i: None for i in indices}
        self._buffer_views = {}
        self.started = set()          # parameters whose momentum buffer holds a value
        self._tables = {}
        for i in indices:             # momentum carried over from a previous layout
            b = momentum_buffers[i]
            if b is not None and tuple(b.shape) == self.shapes[i] and \
                    backend.is_device_array(b):
                self.buffer_view(i).copy_to_device(kernels.contiguous(b))
                self.started.add(i)

    def holds(self, params, indices):
        return self.indices == tuple(indices) and all(
            tuple(params[i].data.shape) == self.shapes[i] for i in indices)

    def _slice(self, flat, i):
        return flat[self.offsets[i]:self.offsets[i] + self.sizes[i]].reshape(self.shapes[i])

    def buffer_view(self, i):
        """Parameter i's momentum buffer: a view of its slice of ``buffers`` (made once)."""
        view = self._buffer_views.get(i)
        if view is None:
            view = self._buffer_views[i] = self._slice(self.buffers, i)
        return view

    def repack(self, params):
        """Make every ``p.data`` the view of its slice (copying in what was assigned)."""
        for i in self.indices:
            p = params[i]
            if p.data is not self.views[i]:
                backend.require_eager("the optimizer packing a replaced parameter")
                view = self._slice(self.values, i)
                view.copy_to_device(kernels.contiguous(p.data))
                p.data = self.views[i] = view

    def table(self, part, momentum):
        """The device chunk table of the parameters ``part`` (in tuple order)."""
        firsts = {i: momentum and i not in self.started for i in part}
        key = (tuple(part), tuple(firsts[i] for i in part))
        if key not in self._tables:
            ew = kernels.module("elementwise", backend.CUDA)
            host = ew.sgd_chunks(self.sizes, self.offsets, firsts, part)
            self._tables[key] = backend.to_device(host)
        return self._tables[key]
