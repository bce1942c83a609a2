r"""Convolution family: the fused Conv2D -> BiasAdd -> ReLU, and the unfused conv2d and bias_add.

Public functions (arrays in: an array out; a Tensor in: a Tensor out, on the tape)::

    conv_bias_relu(x, w, b=None, *, stride=1, padding=0, dilation=1, layout="NCHW")
    conv_bias_relu_backward(dy, x, w, y, *, stride=1, padding=0, dilation=1,
                            layout="NCHW", need=(True, True, True)) -> (dx, dw, db)
    conv2d(x, w, *, stride=1, padding=0, dilation=1, layout="NCHW")
    bias_add(x, b, *, layout="NCHW")

Array-level helpers for other op families (Conv-BatchNorm recompute, batch-norm folding). They
take arrays that are already validated, C-contiguous and of one dtype, and a
``_arrays.ConvGeometry``; NumPy arrays run the Numba CPU kernels (``kernels/cpu/conv.py``),
device arrays the numba.cuda kernels (``kernels/cuda/conv.py``), and results stay on the
arrays' device::

    conv_forward(x, w, b, geom, relu) -> y
        y = relu(conv(x, w) + b); b may be None (no bias); relu a bool.
    conv_backward(gy, x, w, geom, y=None, need=(True, True, True)) -> (dx, dw, db)
        Gradients of that conv. If y (the forward output) is given, its sign is the ReLU mask:
        g = gy * (y > 0); otherwise g = gy. db = sum of g over N, P, Q. Only the gradients
        flagged in need = (dx, dw, db) are computed; the others are None.

Notation: N batch, C input channels, H/W input size, K filters, R/S filter size, P/Q output
size. Activations are NCHW or NHWC (``layout``); weights are always (K, C, R, S). Gradients:
``gy`` upstream, ``gx``, ``gw``, ``gb``.
"""
from __future__ import annotations

import functools

from .. import _arrays
from ..autograd import Function

_kernels = functools.partial(_arrays.kernels, "conv")   # _kernels(backend): the module


# --------------------------------------------------------------------------- array helpers

def conv_forward(x, w, b, geom, relu):
    """``relu?(conv(x, w) + b?)`` for validated, contiguous arrays (see the module docstring)."""
    return _kernels(_arrays.backend_of_array(x)).conv_forward(x, w, b, geom, bool(relu))


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of a conv [+ bias] [+ ReLU whose output is ``y``] (module docstring)."""
    return _kernels(_arrays.backend_of_array(gy)).conv_backward(gy, x, w, geom, y, tuple(need))


def _validate_conv(op, x, w, b, stride, padding, dilation, layout):
    """(geom, x, w, b): everything checked before anything is allocated, then made contiguous."""
    _arrays.backend_of(op, x=x, w=w, b=b)
    _arrays.check_float_dtypes(op, x=x, w=w, b=b)
    geom = _arrays.conv_geometry(op, tuple(x.shape), tuple(w.shape), stride, padding, dilation,
                                 layout)
    _arrays.check_vector(op, "b", b, geom.K)
    b = None if b is None else _arrays.contiguous(b)
    return geom, _arrays.contiguous(x), _arrays.contiguous(w), b


# --------------------------------------------------------------------------- conv2d (unfused)

class Conv2d(Function):
    r"""2-d cross-correlation, no bias, no activation (the unfused baseline).

    .. math::
        y_{nkpq} = \sum_{c,r,s} x_{n,c,p s_h + r d_h - p_h, q s_w + s d_w - p_w}\, w_{kcrs}

        gx = \mathrm{conv\_transpose}(gy, w), \qquad gw = \mathrm{correlate}(x, gy)
    """
    name = "conv2d"

    def __init__(self, stride=1, padding=0, dilation=1, layout="NCHW"):
        super().__init__(stride=stride, padding=padding, dilation=dilation, layout=layout)

    # fwd :: (x, w) -> (y, residuals=(x, w))
    def forward(self, x, w):
        geom, x, w, _ = _validate_conv(self.name, x, w, None, self.stride, self.padding,
                                       self.dilation, self.layout)
        self.geom = geom
        self.save_for_backward(x=x, w=w)
        return conv_forward(x, w, None, geom, False)

    # bwd :: (residuals=(x, w), gy) -> (gx, gw)
    def backward(self, gy):
        need_x, need_w = self.needs_input_grad
        gx, gw, _ = conv_backward(_arrays.contiguous(gy), self.saved.x, self.saved.w, self.geom,
                                  None, (need_x, need_w, False))
        return gx, gw


# --------------------------------------------------------------------------- bias_add (unfused)

class BiasAdd(Function):
    r"""Add a per-channel bias (the unfused baseline).

    .. math::
        y_{nchw} = x_{nchw} + b_c, \qquad gx = gy, \qquad gb_c = \sum_{n,h,w} gy_{nchw}
    """
    name = "bias_add"

    def __init__(self, layout="NCHW"):
        super().__init__(layout=layout)

    # fwd :: (x, b) -> (y, residuals=())
    def forward(self, x, b):
        _arrays.backend_of(self.name, x=x, b=b)
        _arrays.check_float_dtypes(self.name, x=x, b=b)
        layout = _arrays.check_layout(self.name, self.layout)
        _arrays.check_ndim(self.name, "x", x, 4, layout)
        _arrays.check_vector(self.name, "b", b, x.shape[_arrays.channel_axis(layout)])
        self.checked_layout = layout
        x, b = _arrays.contiguous(x), _arrays.contiguous(b)
        return _kernels(_arrays.backend_of_array(x)).bias_add(x, b, layout)

    # bwd :: gy -> (gx = gy, gb = sum of gy over N, H, W)
    def backward(self, gy):
        gx = gy if self.needs_input_grad[0] else None
        gb = None
        if self.needs_input_grad[1]:
            gb = _kernels(_arrays.backend_of_array(gy)).channel_sum(_arrays.contiguous(gy),
                                                                    self.checked_layout)
        return gx, gb


# --------------------------------------------------------------------------- conv_bias_relu

class ConvBiasReLU(Function):
    r"""Fused Conv2D -> BiasAdd -> ReLU: one pass forward, one pass backward.

    Forward (bias and ReLU applied in the GEMM epilogue, before the single store of y):

    .. math::
        y = \max(\mathrm{conv}(x, w) + b,\ 0)

    Backward, from :math:`gy`, with the ReLU mask read from the *output* y (the
    pre-activation is never stored: :math:`y > 0 \iff \mathrm{conv}(x,w) + b > 0`):

    .. math::
        g = gy \cdot [y > 0], \qquad gb_k = \sum_{n,p,q} g_{nkpq}, \qquad
        gw = \mathrm{correlate}(x, g), \qquad gx = \mathrm{conv\_transpose}(g, w)

    The mask is applied while g is formed from gy, and gb is summed in that same pass.
    Residuals: x, w and y only.
    """
    name = "conv_bias_relu"
    relu = True

    def __init__(self, stride=1, padding=0, dilation=1, layout="NCHW"):
        super().__init__(stride=stride, padding=padding, dilation=dilation, layout=layout)

    # fwd :: (x, w, b) -> (y, residuals=(x, w, y))
    def forward(self, x, w, b=None):
        geom, x, w, b = _validate_conv(self.name, x, w, b, self.stride, self.padding,
                                       self.dilation, self.layout)
        self.geom = geom
        y = conv_forward(x, w, b, geom, self.relu)
        self.save_for_backward(x=x, w=w, y=y if self.relu else None)   # y: the ReLU mask
        return y

    # bwd :: (residuals=(x, w, y), gy) -> (gx, gw, gb)
    def backward(self, gy):
        s = self.saved
        return conv_backward(_arrays.contiguous(gy), s.x, s.w, self.geom, s.y,
                             self.needs_input_grad)                   # (need x, w, b)


class ConvBias(ConvBiasReLU):
    r"""Conv2D -> BiasAdd in one pass, no activation (the remapper's rewrite of
    conv2d -> bias_add): :math:`y = \mathrm{conv}(x, w) + b`, :math:`g = gy`. Residuals: x, w.
    """
    name = "conv_bias"
    relu = False


# --------------------------------------------------------------------------- public functions

def conv2d(x, w, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """2-d convolution (cross-correlation, like PyTorch), without bias or activation.

    Parameters
    ----------
    x : array or Tensor, (N, C, H, W) for NCHW, (N, H, W, C) for NHWC
    w : array or Tensor, (K, C, R, S)
    stride, dilation : int or (int, int)
    padding : int, (int, int), "valid" or "same" (TensorFlow's rule, maybe asymmetric)
    layout : "NCHW" or "NHWC"

    Returns
    -------
    y : (N, K, P, Q) or (N, P, Q, K), on x's device; a Tensor if an input is one.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.conv2d(np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))).shape
    (1, 1, 2, 2)
    """
    return Conv2d(stride=stride, padding=padding, dilation=dilation, layout=layout).apply(x, w)


def conv_bias(x, w, b, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """``conv2d(x, w) + b`` in one pass, without ReLU (what the remapper makes of
    conv2d -> bias_add). Same arguments as :func:`conv_bias_relu`.

    Examples
    --------
    >>> import numpy as np
    >>> from numbafuse.ops.conv import conv_bias
    >>> conv_bias(np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)), np.array([-10.0])).ravel()
    array([-6.])
    """
    return ConvBias(stride=stride, padding=padding, dilation=dilation, layout=layout).apply(
        x, w, b)


def bias_add(x, b, *, layout="NCHW"):
    """Add the per-channel bias ``b`` (C,) to the 4-d activation ``x``.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.bias_add(np.zeros((1, 2, 1, 1)), np.array([1.0, 2.0])).ravel()
    array([1., 2.])
    """
    return BiasAdd(layout=layout).apply(x, b)


def conv_bias_relu(x, w, b=None, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Fused ``relu(conv2d(x, w) + b)``: one kernel pass, one store of y.

    Parameters
    ----------
    x : array or Tensor, (N, C, H, W) for NCHW, (N, H, W, C) for NHWC
    w : array or Tensor, (K, C, R, S)
    b : array or Tensor (K,), or None for no bias
    stride, dilation : int or (int, int)
    padding : int, (int, int), "valid" or "same" (TensorFlow's rule, maybe asymmetric)
    layout : "NCHW" or "NHWC"

    Returns
    -------
    y : (N, K, P, Q) or (N, P, Q, K), on x's device; a Tensor (on the tape, keeping x, w and
    y for backward) if an input is one.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x = np.arange(9.0).reshape(1, 1, 3, 3)
    >>> nf.conv_bias_relu(x, np.ones((1, 1, 2, 2)), np.array([-10.0])).ravel()
    array([ 0.,  2., 10., 14.])
    """
    return ConvBiasReLU(stride=stride, padding=padding, dilation=dilation,
                        layout=layout).apply(x, w, b)


def conv_bias_relu_backward(dy, x, w, y, *, stride=1, padding=0, dilation=1, layout="NCHW",
                            need=(True, True, True)):
    """Gradients of :func:`conv_bias_relu`, NumPy style (no tape).

    Parameters
    ----------
    dy : array, the gradient of the output, shape of ``y``
    x, w : the forward's inputs
    y : array, the forward's output: its sign is the ReLU mask (g = dy * (y > 0))
    stride, padding, dilation, layout : as in the forward
    need : (bool, bool, bool)
        Which of (dx, dw, db) to compute; the others are returned as None. db does not depend
        on whether the forward had a bias: it is the gradient a bias would get.

    Returns
    -------
    (dx, dw, db) : x's shape, (K, C, R, S) and (K,), on the inputs' device (or None).

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
    dy, x, w, y = (_arrays.data(a) for a in (dy, x, w, y))
    _arrays.backend_of(op, dy=dy, x=x, w=w, y=y)
    _arrays.check_float_dtypes(op, dy=dy, x=x, w=w, y=y)
    geom = _arrays.conv_geometry(op, tuple(x.shape), tuple(w.shape), stride, padding, dilation,
                                 layout)
    if tuple(y.shape) != geom.y_shape:
        raise ValueError(f"{op}: y has shape {tuple(y.shape)}, the conv's output has "
                         f"{geom.y_shape}")
    _arrays.check_same_shape(op, "dy", dy, "y", y)
    if len(tuple(need)) != 3:
        raise ValueError(f"{op}: need must be three booleans (dx, dw, db), got {need!r}")
    c = _arrays.contiguous
    return conv_backward(c(dy), c(x), c(w), geom, c(y), tuple(bool(v) for v in need))
