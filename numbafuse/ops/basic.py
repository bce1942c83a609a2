r"""The unfused ops a network needs around the fused layers: relu, linear, max_pool2d,
global_avg_pool2d, flatten, squeeze and cross_entropy.

One :class:`~numbafuse.autograd.Function` per op, its forward and backward side by side, and
the public snake_case function at the bottom. ``forward`` validates (``numbafuse.validate``) before
anything is allocated, normalises to C-contiguous arrays of one dtype, and hands them to the
kernel module of the backend: ``kernels/basic/cpu.py`` for NumPy arrays,
``kernels/basic/cuda.py`` for device arrays (both expose the same functions).

Notation: N batch, C channels, H/W height/width, P/Q pooled height/width, kh/kw window,
sh/sw stride, F_in/F_out linear features, L classes. Gradients: ``dy`` upstream, ``dx``...
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import numpy as np

from .. import backend, kernels, reference, validate
from ..autograd import Function
from ..validate import PoolGeometry, pool_geometry
from . import precision
from .spec import OpSpec

_kernels = functools.partial(kernels.module, "basic")  # _kernels(backend): the module


def _validated(op, half=False, **arrays):
    """(backend, dtype) of one call's floating arrays: TypeError on a mix or a non-float
    (``half``: half precision allowed, bfloat16 on the CPU only)."""
    which = backend.backend_of(op, **arrays)
    if half:
        return which, validate.check_half_dtypes(op, which, **arrays)
    return which, validate.check_float_dtypes(op, **arrays)


# --------------------------------------------------------------------------- relu

class ReLU(Function):
    r"""Rectified linear unit.

    .. math::
        y = \max(x, 0), \qquad dx = dy \cdot [y > 0]

    The mask is read from the output ``y`` (saved), never from ``x``: the next layer usually
    keeps ``y`` anyway, so the residual is free. A NaN input stays NaN.
    """
    name = "relu"

    # fwd :: x -> (y, residuals=(y,))
    def forward(self, x):
        which, dtype = _validated(self.name, half=True, x=x)
        y = _kernels(which).relu_forward(precision.compute(kernels.contiguous(x)))
        y = precision.store(y, dtype)                 # half: y saved in half
        self.save_for_backward(y=y)
        return y

    # bwd :: (residuals=(y,), dy) -> (dx,)
    def backward(self, dy):
        if not self.needs_input_grad[0]:
            return (None,)
        y = self.saved.y
        dx = _kernels(backend.backend_of_array(y)).relu_backward(
            precision.compute(kernels.contiguous(dy)), precision.compute(y))
        return (precision.store(dx, y.dtype),)


# --------------------------------------------------------------------------- linear

class Linear(Function):
    r"""Fully connected layer, PyTorch's convention: ``w`` is (F_out, F_in).

    .. math::
        y = x w^T + b, \qquad dx = dy\, w, \qquad dw = dy^T x, \qquad db = \sum_n dy_{n,:}

    CPU: BLAS (``@``); device: a shared-memory tiled matmul (``config.TILE``) and a
    deterministic column sum for ``db``.
    """
    name = "linear"

    # fwd :: (x, w, b) -> (y, residuals=(x, w))
    def forward(self, x, w, b=None):
        op = self.name
        which, _ = _validated(op, x=x, w=w, b=b)
        validate.check_ndim(op, "x", x, 2, "N, in_features")
        validate.check_ndim(op, "w", w, 2, "out_features, in_features")
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"{op}: w has {w.shape[1]} input features, x has {x.shape[1]}")
        validate.check_vector(op, "b", b, w.shape[0])
        x, w = kernels.contiguous(x), kernels.contiguous(w)
        b = None if b is None else kernels.contiguous(b)
        self.save_for_backward(x=x, w=w)
        return _kernels(which).linear_forward(x, w, b)             # (N, F_out)

    # bwd :: (residuals=(x, w), dy) -> (dx, dw, db)
    def backward(self, dy):
        x, w = self.saved.x, self.saved.w
        return _kernels(backend.backend_of_array(x)).linear_backward(
            kernels.contiguous(dy), x, w, *self.needs_input_grad)


# --------------------------------------------------------------------------- pooling

class MaxPool2d(Function):
    r"""Max pooling over ``k`` windows (stride defaults to ``k``), padding that never wins
    (CPU), floor size; below, :math:`x` is read with its padding's offsets.

    .. math::
        t_{n,c,p,q} = \operatorname{argmax}_{r<k_h,\,s<k_w} x_{n,c,p s_h + r,\,q s_w + s}
        \ (\text{first, row-major: } t = r k_w + s), \qquad
        y_{n,c,p,q} = x_{n,c,p s_h + r_t,\,q s_w + s_t}

        dx_{n,c,h,w} = \sum_{(p,q):\ (p s_h + r_t,\, q s_w + s_t) = (h,w)} dy_{n,c,p,q}

    The gradient goes to the FIRST maximum (row-major) of each window, like PyTorch;
    overlapping windows (stride < k) accumulate. Forward writes ``y`` and the window argmax
    ``t`` in one pass, and only ``t`` is saved, shaped like ``y`` in the smallest unsigned
    dtype holding ``kh*kw - 1``: one byte per output up to 16x16 windows (uint16/uint32
    beyond), 1/16 of a float32 ``x``'s bytes for k == stride == 2. Backward never reads ``x``.

    NaN: a NaN beats every number and the first NaN of a window is its argmax, so the window
    pools to NaN (PyTorch propagates NaN too) and its gradient goes to that NaN.
    """
    name = "max_pool2d"

    @dataclasses.dataclass(frozen=True)
    class Params:
        k: object
        stride: object
        layout: str
        padding: object = 0

    # fwd :: x -> (y, residuals=(argmax,))
    def forward(self, x):
        which, self.dtype = _validated(self.name, x=x)
        self.geometry = pool_geometry(self.name, x, *dataclasses.astuple(self.params))
        if which == "cuda" and (self.geometry.ph or self.geometry.pw):
            raise ValueError(f"{self.name}: padding is not supported on CUDA yet (CPU only), "
                             f"got {self.params.padding!r}")
        y, argmax = _kernels(which).max_pool2d_forward(kernels.contiguous(x), self.geometry)
        self.save_for_backward(argmax=argmax)       # shapes: self.geometry (plain attributes)
        return y

    # bwd :: (residuals=(argmax,), dy) -> (dx,)
    def backward(self, dy):
        if not self.needs_input_grad[0]:
            return (None,)
        argmax = self.saved.argmax
        return (_kernels(backend.backend_of_array(argmax)).max_pool2d_backward(
            kernels.contiguous(dy), argmax, self.geometry, self.dtype),)


class GlobalAvgPool2d(Function):
    r"""Mean over the spatial dimensions: (N, C, H, W) or (N, H, W, C) -> (N, C).

    .. math::
        y_{n,c} = \frac{1}{HW} \sum_{h,w} x_{n,c,h,w}, \qquad
        dx_{n,c,h,w} = \frac{dy_{n,c}}{HW}

    Nothing is saved but the input's shape.
    """
    name = "global_avg_pool2d"

    @dataclasses.dataclass(frozen=True)
    class Params:
        layout: str

    # fwd :: x -> (y, residuals=())
    def forward(self, x):
        op = self.name
        which, self.dtype = _validated(op, x=x)
        layout = validate.check_layout(op, self.params.layout)
        N, C, H, W = validate.activation_dims(op, x, layout)
        if H < 1 or W < 1:
            raise ValueError(f"{op}: x has an empty spatial dimension, shape {tuple(x.shape)}")
        self.geometry = PoolGeometry(N, C, H, W, 1, 1, H, W, H, W, layout)
        return _kernels(which).global_avg_pool2d_forward(kernels.contiguous(x), self.geometry)

    # bwd :: (residuals=(), dy) -> (dx,)
    def backward(self, dy):
        if not self.needs_input_grad[0]:
            return (None,)
        dy = kernels.contiguous(dy)                                  # (N, C)
        return (_kernels(backend.backend_of_array(dy)).global_avg_pool2d_backward(
            dy, self.geometry, self.dtype),)


# --------------------------------------------------------------------------- shape ops

class Flatten(Function):
    r"""(N, d1, d2, ...) -> (N, d1*d2*...): a view of the contiguous input.

    .. math:: y = \operatorname{reshape}(x), \qquad dx = \operatorname{reshape}^{-1}(dy)
    """
    name = "flatten"

    # fwd :: x -> (y, residuals=())
    def forward(self, x):
        _validated(self.name, x=x)
        if len(x.shape) < 1:
            raise ValueError(f"{self.name}: x must have a batch dimension, got a 0-d array")
        self.x_shape = tuple(x.shape)
        rest = int(np.prod(self.x_shape[1:], dtype=np.int64))
        return kernels.contiguous(x).reshape((self.x_shape[0], rest))     # (N, prod(rest))

    # bwd :: (residuals=(), dy) -> (dx,)
    def backward(self, dy):
        if not self.needs_input_grad[0]:
            return (None,)
        return (kernels.contiguous(dy).reshape(self.x_shape),)


class Squeeze(Function):
    r"""Drop the size-1 dimension ``axis``.

    .. math:: y = \operatorname{reshape}(x), \qquad dx = \operatorname{reshape}^{-1}(dy)
    """
    name = "squeeze"

    @dataclasses.dataclass(frozen=True)
    class Params:
        axis: object

    # fwd :: x -> (y, residuals=())
    def forward(self, x):
        op = self.name
        _validated(op, x=x)
        axis = self.params.axis
        if not isinstance(axis, numbers.Integral) or isinstance(axis, bool):
            raise TypeError(f"{op}: axis must be an int, got {axis!r}")
        ndim = len(x.shape)
        if not -ndim <= axis < ndim:
            raise ValueError(f"{op}: axis {axis} is out of range for x of shape "
                             f"{tuple(x.shape)}")
        axis = int(axis) % ndim
        if x.shape[axis] != 1:
            raise ValueError(f"{op}: axis {axis} of x has size {x.shape[axis]}, not 1 "
                             f"(shape {tuple(x.shape)})")
        self.x_shape = tuple(x.shape)
        y_shape = self.x_shape[:axis] + self.x_shape[axis + 1:]
        return kernels.contiguous(x).reshape(y_shape)

    # bwd :: (residuals=(), dy) -> (dx,)
    def backward(self, dy):
        if not self.needs_input_grad[0]:
            return (None,)
        return (kernels.contiguous(dy).reshape(self.x_shape),)


# --------------------------------------------------------------------------- loss

class CrossEntropy(Function):
    r"""Softmax cross-entropy of ``logits`` (N, L) against integer ``labels`` (N,), mean over
    the batch: a 0-d array.

    .. math::
        \mathrm{lse}_n = m_n + \log \sum_j e^{z_{n,j} - m_n},\ m_n = \max_j z_{n,j}, \qquad
        y = \frac{1}{N} \sum_n (\mathrm{lse}_n - z_{n,\mathrm{label}_n})

        dz_{n,j} = \frac{dy}{N} \left(e^{z_{n,j} - \mathrm{lse}_n} - [j = \mathrm{label}_n]\right)

    Saved: ``logits``, ``labels`` and the row log-sum-exps ``lse`` (N,) in float64. ``labels``
    (int32/int64, host or device, like ``logits``) are not differentiable.
    """
    name = "cross_entropy"

    # fwd :: (logits, labels) -> (y, residuals=(logits, labels, lse))
    def forward(self, logits, labels):
        op = self.name
        if labels is None:
            raise TypeError(f"{op}: labels must be an integer array, got None")
        host_labels = isinstance(labels, np.ndarray)
        # host labels with device logits: checked on the host, then uploaded (below)
        which = backend.backend_of(op, logits=logits, **({} if host_labels else
                                                         {"labels": labels}))
        validate.check_float_dtypes(op, logits=logits)
        validate.check_ndim(op, "logits", logits, 2, "N, classes")
        label_dtype = np.dtype(labels.dtype)
        if not np.issubdtype(label_dtype, np.integer):
            raise TypeError(f"{op}: labels must be integers, got {label_dtype}")
        N, L = logits.shape
        if tuple(labels.shape) != (N,):
            raise ValueError(f"{op}: labels must have shape ({N},) (one per row of logits), "
                             f"got {tuple(labels.shape)}")
        if N < 1 or L < 1:
            raise ValueError(f"{op}: logits must have at least one row and one class, "
                             f"got shape {tuple(logits.shape)}")
        impl = _kernels(which)
        if host_labels:
            if labels.min() < 0 or labels.max() >= L:
                raise ValueError(f"{op}: labels must lie in [0, {L}) for {L} classes")
            labels = np.ascontiguousarray(labels, dtype=np.int64)
            if which == backend.CUDA:        # no check launched, nothing read back
                labels = backend.upload(labels)
        else:
            labels = kernels.contiguous(labels)
            if impl.count_bad_labels(labels, L):
                raise ValueError(f"{op}: labels must lie in [0, {L}) for {L} classes")
        logits = kernels.contiguous(logits)
        loss, lse = impl.cross_entropy_forward(logits, labels)
        self.save_for_backward(logits=logits, labels=labels, lse=lse)
        return loss

    # bwd :: (residuals=(logits, labels, lse), dy) -> (dlogits, None)
    def backward(self, dy):
        if not self.needs_input_grad[0]:
            return (None, None)
        s = self.saved
        return (_kernels(backend.backend_of_array(s.logits)).cross_entropy_backward(
            dy, s.logits, s.labels, s.lse), None)


# --------------------------------------------------------------------------- public functions

def relu(x):
    """Elementwise ``max(x, 0)`` (NaN stays NaN).

    Parameters
    ----------
    x : array or Tensor
        NumPy or CUDA array (any shape), float32, float64 or half precision (float16;
        bfloat16 on the CPU): y in x's dtype.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.relu(np.array([-1.0, 0.0, 2.0]))
    array([0., 0., 2.])
    """
    return ReLU().apply(x)


def linear(x, w, b=None):
    """Fully connected layer ``y = x @ w.T + b``.

    Parameters
    ----------
    x : array or Tensor, (N, in_features)
    w : array or Tensor, (out_features, in_features)
    b : array or Tensor, (out_features,), optional

    Returns
    -------
    (N, out_features), same dtype and device as ``x``.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.linear(np.ones((2, 3)), np.ones((4, 3)), np.arange(4.0))
    array([[3., 4., 5., 6.],
           [3., 4., 5., 6.]])
    """
    return Linear().apply(x, w, b)


def max_pool2d(x, k, stride=None, *, padding=0, layout="NCHW"):
    """Max pooling over ``k`` x ``k`` windows (``k`` an int or an ``(h, w)`` pair).

    ``stride`` defaults to ``k``; ``padding`` (an int or a pair, at most half the window; the
    CPU only) adds rows and columns that never win, as PyTorch's; the output size is rounded
    down. The gradient
    goes to the first maximum of each window (row-major), like PyTorch; a NaN counts as the
    maximum. Backward keeps only a window argmax, one byte per output for windows up to 16x16.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.max_pool2d(np.arange(16.0).reshape(1, 1, 4, 4), 2)
    array([[[[ 5.,  7.],
             [13., 15.]]]])
    """
    return MaxPool2d(k=k, stride=stride, layout=layout, padding=padding).apply(x)


def global_avg_pool2d(x, *, layout="NCHW"):
    """Mean over height and width: a 4-d activation in ``layout`` -> (N, C).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.global_avg_pool2d(np.arange(8.0).reshape(1, 2, 2, 2))
    array([[1.5, 5.5]])
    """
    return GlobalAvgPool2d(layout=layout).apply(x)


def flatten(x):
    """(N, ...) -> (N, prod(...)), a view of the (contiguous) input.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.flatten(np.zeros((2, 3, 4, 5))).shape
    (2, 60)
    """
    return Flatten().apply(x)


def squeeze(x, axis):
    """Remove dimension ``axis``, which must have size 1 (else ``ValueError``).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.squeeze(np.zeros((2, 1, 3)), 1).shape
    (2, 3)
    """
    return Squeeze(axis=axis).apply(x)


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy over the batch, a 0-d array (numerically stable).

    Parameters
    ----------
    logits : array or Tensor, (N, classes), float32 or float64
    labels : int array, (N,), each in ``[0, classes)``; not differentiable. On the host or
        on ``logits``' device. Host labels are checked on the host (with device logits they
        are then copied to the device asynchronously: no kernel, no read back); device labels
        are checked by a kernel whose answer, one integer, is read back: a wait for every
        kernel queued before it. A training loop whose batches come from the host should
        pass the host's labels.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> float(nf.cross_entropy(np.zeros((2, 4)), np.array([0, 3])))  # log(4)
    1.3862943611198906
    """
    return CrossEntropy().apply(logits, labels)


SPECS = (
    OpSpec("relu", relu, ReLU, reference=reference.relu, half=True),
    OpSpec("linear", linear, Linear, reference=reference.linear),
    OpSpec("max_pool2d", max_pool2d, MaxPool2d, reference=reference.max_pool2d),
    OpSpec("global_avg_pool2d", global_avg_pool2d, GlobalAvgPool2d,
           reference=reference.global_avg_pool2d),
    OpSpec("flatten", flatten, Flatten),
    OpSpec("squeeze", squeeze, Squeeze),
    OpSpec("cross_entropy", cross_entropy, CrossEntropy, reference=reference.cross_entropy),
)
