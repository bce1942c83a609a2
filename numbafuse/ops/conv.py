r"""Convolution family: the fused Conv2D -> BiasAdd -> ReLU, and the unfused conv2d and bias_add.

Public functions (arrays in: an array out; a Tensor in: a Tensor out, on the tape)::

    conv_bias_relu(x, w, b=None, *, stride=1, padding=0, dilation=1, layout="NCHW", groups=1)
    conv_bias_relu_backward(dy, x, w, y, *, stride=1, padding=0, dilation=1,
                            layout="NCHW", need=(True, True, True), groups=1) -> (dx, dw, db)
    conv2d(x, w, *, stride=1, padding=0, dilation=1, layout="NCHW", groups=1)
    bias_add(x, b, *, layout="NCHW")

Array-level helpers for other op families (Conv-BatchNorm recompute, batch-norm folding). They
take arrays that are already validated, C-contiguous and of one dtype, and a
``validate.ConvGeometry``; NumPy arrays run the Numba CPU kernels (``kernels/conv/cpu.py``),
device arrays the numba.cuda kernels (``kernels/conv/cuda.py``), and results stay on the
arrays' device::

    conv_forward(x, w, b, geometry, relu) -> y
        y = relu(conv(x, w) + b); b may be None (no bias); relu a bool.
    conv_backward(dy, x, w, geometry, y=None, need=(True, True, True)) -> (dx, dw, db)
        Gradients of that conv. If y (the forward output) is given, its sign is the ReLU mask:
        g = dy * (y > 0); otherwise g = dy. db = sum of g over N, P, Q. Only the gradients
        flagged in need = (dx, dw, db) are computed; the others are None.

Grouped convolutions (``groups > 1``, the geometry's ``groups``) run ``kernels/conv/
cpu_grouped.py`` (depthwise stencils for ``groups == C``, else grouped implicit GEMMs or
``cpu.py``'s kernels per group)
and ``cuda_grouped.py`` (depthwise stencils, ``cuda_depthwise.py``, for ``groups == C``, else
``cuda.py``'s GEMMs per group); ``groups == 1`` calls ``cpu.py`` /
``cuda.py`` as it always did.

Half precision (float16; bfloat16 on the CPU with ``ml_dtypes``): x, w, b, y, dy and the
gradients all in that dtype (PyTorch's conv takes one dtype), computed by the float32 kernels
on inputs converted at this module's array helpers (``ops/precision.py``): float32
accumulation, one rounding of each result to half.

Notation: N batch, C input channels, H/W input size, K filters, R/S filter size, P/Q output
size. Activations are NCHW or NHWC (``layout``); weights are always (K, C/groups, R, S).
Gradients: ``dy`` upstream, ``dx``, ``dw``, ``db``.
"""
from __future__ import annotations

import dataclasses
import functools

from .. import autograd, backend, kernels, reference, validate
from ..autograd import Function
from . import precision
from .spec import OpSpec

_kernels = functools.partial(kernels.module, "conv")   # _kernels(backend): the module


def _conv_kernels(which, geometry):
    """The kernel module running ``geometry`` on backend ``which`` (``kernels.interfaces.
    ConvKernels``): ``cpu``/``cuda``, or ``cpu_grouped``/``cuda_grouped`` for ``groups > 1``."""
    return kernels.conv_kernels(which, geometry.groups)


# --------------------------------------------------------------------------- array helpers

def conv_forward(x, w, b, geometry, relu):
    """``relu?(conv(x, w) + b?)`` for validated, contiguous arrays (see the module docstring).
    An empty batch (N = 0) gives an empty y; no kernel runs. Half precision: the float32
    kernels on converted inputs, y converted back (``precision``)."""
    which = backend.backend_of_array(x)
    if geometry.N == 0:
        return backend.empty(which, geometry.y_shape, x.dtype)
    dtype = x.dtype
    x, w, b = (precision.compute(a) for a in (x, w, b))      # float32 for half: no-op else
    y = _conv_kernels(which, geometry).conv_forward(x, w, b, geometry, bool(relu))
    return precision.store(y, dtype)


def adds_into_dx(geometry, dy, addend, need_dx=True):
    """Whether :func:`conv_backward` can return dx plus ``addend`` (the tape's gradient of x
    so far) from the dx kernel's own epilogue, with no sum kernel after it: where the
    backend's kernels say so (``DX_ADDEND``: the CUDA GEMMs), dx is needed, neither the batch
    nor dy is empty, and ``addend`` is an array of x's shape and dy's dtype on dy's backend
    (not half precision: the tape's half sums round in float32 first)."""
    if addend is None or not need_dx or geometry.N == 0 or dy.size == 0:
        return False
    which = backend.backend_of_array(dy)
    if not _conv_kernels(which, geometry).DX_ADDEND:
        return False
    return (backend.backend_of_array(addend) == which and not validate.is_half(dy.dtype)
            and addend.dtype == dy.dtype and tuple(addend.shape) == tuple(geometry.x_shape))


def conv_backward(dy, x, w, geometry, y=None, need=(True, True, True), dx_addend=None):
    """``(dx, dw, db)`` of a conv [+ bias] [+ ReLU whose output is ``y``] (module docstring).
    An empty batch (N = 0): dx empty, dw and db zero (sums over no pixels); no kernel runs.
    Half precision: float32 kernels, the gradients converted back to dy's dtype.
    ``dx_addend``: dx comes back plus it, only where :func:`adds_into_dx` said so."""
    which = backend.backend_of_array(dy)
    if dx_addend is not None:                   # (the caller asked adds_into_dx first)
        grads = _conv_kernels(which, geometry).conv_backward(
            dy, x, w, geometry, y, tuple(need), dx_addend=kernels.contiguous(dx_addend))
        return tuple(grads)
    dtype = dy.dtype
    if geometry.N == 0:
        need_x, need_w, need_b = need
        f = validate.compute_dtype(dtype)
        return (backend.empty(which, geometry.x_shape, dtype) if need_x else None,
                precision.store(kernels.zeros(which, geometry.w_shape, f), dtype)
                if need_w else None,
                precision.store(kernels.zeros(which, (geometry.K,), f), dtype)
                if need_b else None)
    dy, x, w, y = (precision.compute(a) for a in (dy, x, w, y))   # y: its sign is exact
    grads = _conv_kernels(which, geometry).conv_backward(dy, x, w, geometry, y, tuple(need))
    return tuple(precision.store(g, dtype) for g in grads)


def _validate_conv(op, x, w, b, stride, padding, dilation, layout, groups):
    """(geometry, x, w, b): everything checked before anything is allocated, then made
    contiguous."""
    validate.check_given(op, x=x, w=w)
    which = backend.backend_of(op, x=x, w=w, b=b)
    validate.check_half_dtypes(op, which, x=x, w=w, b=b)
    geometry = validate.conv_geometry(op, tuple(x.shape), tuple(w.shape), stride, padding, dilation,
                                 layout, groups)
    validate.check_vector(op, "b", b, geometry.K)
    b = None if b is None else kernels.contiguous(b)
    return geometry, kernels.contiguous(x), kernels.contiguous(w), b


@dataclasses.dataclass(frozen=True)
class ConvParams:
    """The non-array arguments of a convolution (see :func:`conv2d`)."""
    stride: object
    padding: object
    dilation: object
    layout: str
    groups: object

    def astuple(self):
        return (self.stride, self.padding, self.dilation, self.layout, self.groups)


# --------------------------------------------------------------------------- conv2d (unfused)

class Conv2d(Function):
    r"""2-d cross-correlation, no bias, no activation (the unfused baseline).

    .. math::
        y_{nkpq} = \sum_{c,r,s} x_{n,c,p s_h + r d_h - p_h, q s_w + s d_w - p_w}\, w_{kcrs}

        dx = \mathrm{conv\_transpose}(dy, w), \qquad dw = \mathrm{correlate}(x, dy)
    """
    name = "conv2d"
    Params = ConvParams

    # fwd :: (x, w) -> (y, residuals=(x, w))
    def forward(self, x, w):
        geometry, x, w, _ = _validate_conv(self.name, x, w, None, *self.params.astuple())
        self.geometry = geometry
        self.save_for_backward(x=x, w=w)
        return conv_forward(x, w, None, geometry, False)

    # bwd :: (residuals=(x, w), dy) -> (dx, dw)
    def backward(self, dy):
        return self.backward_adding(dy, (None, None))[0]

    # bwd, with the tape's gradient of x so far added into dx where the kernels can
    def backward_adding(self, dy, addends):
        need_x, need_w = self.needs_input_grad
        dy = kernels.contiguous(dy)
        addend = addends[0] if adds_into_dx(self.geometry, dy, addends[0], need_x) else None
        dx, dw, _ = conv_backward(dy, self.saved.x, self.saved.w, self.geometry, None,
                                  (need_x, need_w, False), dx_addend=addend)
        return (dx, dw), (() if addend is None else (0,))


# --------------------------------------------------------------------------- bias_add (unfused)

class BiasAdd(Function):
    r"""Add a per-channel bias (the unfused baseline).

    .. math::
        y_{nchw} = x_{nchw} + b_c, \qquad dx = dy, \qquad db_c = \sum_{n,h,w} dy_{nchw}
    """
    name = "bias_add"

    @dataclasses.dataclass(frozen=True)
    class Params:
        layout: str

    # fwd :: (x, b) -> (y, residuals=())
    def forward(self, x, b):
        validate.check_given(self.name, x=x, b=b)
        which = backend.backend_of(self.name, x=x, b=b)
        dtype = validate.check_half_dtypes(self.name, which, x=x, b=b)
        layout = validate.check_layout(self.name, self.params.layout)
        validate.check_ndim(self.name, "x", x, 4, layout)
        validate.check_vector(self.name, "b", b, x.shape[validate.channel_axis(layout)])
        self.checked_layout = layout
        x, b = (precision.compute(kernels.contiguous(a)) for a in (x, b))   # half: float32
        return precision.store(_kernels(which).bias_add(x, b, layout), dtype)

    # bwd :: dy -> (dx = dy, db = sum of dy over N, H, W)
    def backward(self, dy):
        dx = dy if self.needs_input_grad[0] else None
        db = None
        if self.needs_input_grad[1]:
            db = _kernels(backend.backend_of_array(dy)).channel_sum(
                precision.compute(kernels.contiguous(dy)), self.checked_layout)
            db = precision.store(db, dy.dtype)
        return dx, db


# --------------------------------------------------------------------------- conv_bias_relu

class ConvBiasReLU(Function):
    r"""Fused Conv2D -> BiasAdd -> ReLU: one pass forward, one pass backward.

    Forward (bias and ReLU applied in the GEMM epilogue, before the single store of y):

    .. math::
        y = \max(\mathrm{conv}(x, w) + b,\ 0)

    Backward, from :math:`dy`, with the ReLU mask read from the *output* y (the
    pre-activation is never stored: :math:`y > 0 \iff \mathrm{conv}(x,w) + b > 0`):

    .. math::
        g = dy \cdot [y > 0], \qquad db_k = \sum_{n,p,q} g_{nkpq}, \qquad
        dw = \mathrm{correlate}(x, g), \qquad dx = \mathrm{conv\_transpose}(g, w)

    The mask is applied while g is formed from dy, and db is summed in that same pass.
    Residuals: x, w and y only.
    """
    name = "conv_bias_relu"
    Params = ConvParams
    relu = True

    # fwd :: (x, w, b) -> (y, residuals=(x, w, y))
    def forward(self, x, w, b=None):
        geometry, x, w, b = _validate_conv(self.name, x, w, b, *self.params.astuple())
        self.geometry = geometry
        y = conv_forward(x, w, b, geometry, self.relu)
        self.save_for_backward(x=x, w=w, y=y if self.relu else None)   # y: the ReLU mask
        return y

    # bwd :: (residuals=(x, w, y), dy) -> (dx, dw, db)
    def backward(self, dy):
        return self.backward_adding(dy, (None, None, None))[0]

    # bwd, with the tape's gradient of x so far added into dx where the kernels can
    def backward_adding(self, dy, addends):
        s = self.saved
        dy = kernels.contiguous(dy)
        need = self.needs_input_grad                                   # (need x, w, b)
        addend = addends[0] if adds_into_dx(self.geometry, dy, addends[0], need[0]) else None
        grads = conv_backward(dy, s.x, s.w, self.geometry, s.y, need, dx_addend=addend)
        return grads, (() if addend is None else (0,))


class ConvBias(ConvBiasReLU):
    r"""Conv2D -> BiasAdd in one pass, no activation (the remapper's rewrite of
    conv2d -> bias_add): :math:`y = \mathrm{conv}(x, w) + b`, :math:`g = dy`. Residuals: x, w.
    """
    name = "conv_bias"
    relu = False


# --------------------------------------------------------------------------- public functions

def conv2d(x, w, *, stride=1, padding=0, dilation=1, layout="NCHW", groups=1):
    """2-d convolution (cross-correlation, like PyTorch), without bias or activation.

    Parameters
    ----------
    x : array or Tensor, (N, C, H, W) for NCHW, (N, H, W, C) for NHWC
    w : array or Tensor, (K, C/groups, R, S)
    stride, dilation : int or (int, int)
    padding : int, (int, int), (int, int, int, int), "valid" or "same"
        A 4-tuple is ``(left, right, top, bottom)``, ``torch.nn.functional.pad``'s order:
        the result is that of ``x`` zero-padded so, then convolved unpadded. "same":
        TensorFlow's rule, output ``ceil(size / stride)``, the odd padding element at the
        bottom/right (at stride 1, PyTorch's "same", even kernels included).
    layout : "NCHW" or "NHWC"
    groups : int
        Channels split into ``groups`` groups (dividing C and K): filters
        ``g*K/groups ... (g+1)*K/groups - 1`` see input channels ``g*C/groups ...`` only, and w
        is ``(K, C/groups, R, S)`` (PyTorch's). ``groups == C``: depthwise.

    Returns
    -------
    y : (N, K, P, Q) or (N, P, Q, K), on x's device; a Tensor if an input is one.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.conv2d(np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))).shape
    (1, 1, 2, 2)
    >>> nf.conv2d(np.ones((1, 4, 3, 3)), np.ones((4, 1, 2, 2)), groups=4).ravel()[:2]  # depthwise
    array([4., 4.])
    """
    return Conv2d(stride=stride, padding=padding, dilation=dilation, layout=layout,
                  groups=groups).apply(x, w)


def conv_bias(x, w, b, *, stride=1, padding=0, dilation=1, layout="NCHW", groups=1):
    """``conv2d(x, w) + b`` in one pass, without ReLU (what the remapper makes of
    conv2d -> bias_add). Same arguments as :func:`conv_bias_relu`.

    Examples
    --------
    >>> import numpy as np
    >>> from numbafuse.ops.conv import conv_bias
    >>> conv_bias(np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)), np.array([-10.0])).ravel()
    array([-6.])
    """
    return ConvBias(stride=stride, padding=padding, dilation=dilation, layout=layout,
                    groups=groups).apply(x, w, b)


def bias_add(x, b, *, layout="NCHW"):
    """Add the per-channel bias ``b`` (C,) to the 4-d activation ``x``.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.bias_add(np.zeros((1, 2, 1, 1)), np.array([1.0, 2.0])).ravel()
    array([1., 2.])
    """
    return BiasAdd(layout=layout).apply(x, b)


def conv_bias_relu(x, w, b=None, *, stride=1, padding=0, dilation=1, layout="NCHW",
                   groups=1):
    """Fused ``relu(conv2d(x, w) + b)``: one kernel pass, one store of y.

    Parameters
    ----------
    x : array or Tensor, (N, C, H, W) for NCHW, (N, H, W, C) for NHWC
    w : array or Tensor, (K, C/groups, R, S)
    b : array or Tensor (K,), or None for no bias
    stride, dilation : int or (int, int)
    padding : int, (int, int), (int, int, int, int), "valid" or "same"
        A 4-tuple is ``(left, right, top, bottom)``, ``torch.nn.functional.pad``'s order:
        the result is that of ``x`` zero-padded so, then convolved unpadded. "same":
        TensorFlow's rule, output ``ceil(size / stride)``, the odd padding element at the
        bottom/right (at stride 1, PyTorch's "same", even kernels included).
    layout : "NCHW" or "NHWC"
    groups : int
        Channels split into ``groups`` groups (dividing C and K): filters
        ``g*K/groups ... (g+1)*K/groups - 1`` see input channels ``g*C/groups ...`` only, and w
        is ``(K, C/groups, R, S)`` (PyTorch's). ``groups == C``: depthwise.

    Returns
    -------
    y : (N, K, P, Q) or (N, P, Q, K), on x's device; a Tensor (on the tape, keeping x, w and
    y for backward) if an input is one. An empty batch (N = 0) gives an empty y (and zero
    dw, db), as PyTorch.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x = np.arange(9.0).reshape(1, 1, 3, 3)
    >>> nf.conv_bias_relu(x, np.ones((1, 1, 2, 2)), np.array([-10.0])).ravel()
    array([ 0.,  2., 10., 14.])
    """
    return ConvBiasReLU(stride=stride, padding=padding, dilation=dilation,
                        layout=layout, groups=groups).apply(x, w, b)


def conv_bias_relu_backward(dy, x, w, y, *, stride=1, padding=0, dilation=1, layout="NCHW",
                            need=(True, True, True), groups=1):
    """Gradients of :func:`conv_bias_relu`, NumPy style (no tape).

    Parameters
    ----------
    dy : array, the gradient of the output, shape of ``y``
    x, w : the forward's inputs
    y : array, the forward's output: its sign is the ReLU mask (g = dy * (y > 0))
    stride, padding, dilation, layout, groups : as in the forward
    need : (bool, bool, bool)
        Which of (dx, dw, db) to compute; the others are returned as None. db does not depend
        on whether the forward had a bias: it is the gradient a bias would get.

    Returns
    -------
    (dx, dw, db) : x's shape, (K, C/groups, R, S) and (K,), on the inputs' device (or None).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x, w = np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))
    >>> y = nf.conv_bias_relu(x, w)
    >>> dx, dw, db = nf.conv_bias_relu_backward(np.ones_like(y), x, w, y)
    >>> db
    array([4.])
    """
    op = "conv_bias_relu_backward"
    dy, x, w, y = (autograd.unwrap(a) for a in (dy, x, w, y))
    validate.check_given(op, dy=dy, x=x, w=w, y=y)
    which = backend.backend_of(op, dy=dy, x=x, w=w, y=y)
    validate.check_half_dtypes(op, which, dy=dy, x=x, w=w, y=y)
    geometry = validate.conv_geometry(op, tuple(x.shape), tuple(w.shape), stride, padding, dilation,
                                 layout, groups)
    if tuple(y.shape) != geometry.y_shape:
        raise ValueError(f"{op}: y has shape {tuple(y.shape)}, the conv's output has "
                         f"{geometry.y_shape}")
    validate.check_same_shape(op, "dy", dy, "y", y)
    if not isinstance(need, (tuple, list)) or len(need) != 3:
        raise ValueError(f"{op}: need must be three booleans (dx, dw, db), got {need!r}")
    c = kernels.contiguous
    return conv_backward(c(dy), c(x), c(w), geometry, c(y), tuple(bool(v) for v in need))


SPECS = (
    OpSpec("conv2d", conv2d, Conv2d, reference=reference.conv2d, half=True),
    OpSpec("bias_add", bias_add, BiasAdd, reference=reference.bias_add, half=True),
    OpSpec("conv_bias_relu", conv_bias_relu, ConvBiasReLU, reference=reference.conv_bias_relu,
           backward=conv_bias_relu_backward, fuses=("conv2d", "bias_add", "relu"), half=True),
    OpSpec("conv_bias", conv_bias, ConvBias, fuses=("conv2d", "bias_add"), half=True),
)
