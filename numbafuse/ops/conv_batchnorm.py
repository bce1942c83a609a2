r"""Conv -> BatchNorm (-> ReLU) trained with recompute, and batch-norm folding for inference.

Notation: N batch, C input channels, H/W input size, K output channels (= batch-norm
channels), R/S filter size, P/Q output size, M = N*P*Q values per batch-norm channel.
``h = conv2d(x, w)`` (no bias) is the batch-norm input; ``xhat = (h - mean) * invstd``.

Training (``training=True``)::

    forward   h = conv(x, w);  mean, var = batch stats of h;  invstd = 1/sqrt(var + eps)
              y = [relu](gamma * xhat + beta);  running stats updated in place
    saved     x, w, gamma, mean, invstd   (+ beta when relu: the mask is the sign of
              gamma*xhat + beta)          -- NOT h, NOT y: O(K) besides the inputs
    backward  h = conv(x, w) again; y = [relu](gamma*xhat + beta) again (its sign is the mask);
              (gh, ggamma, gbeta) = batch-norm backward;  (gx, gw) = conv backward of gh

``beta`` (K values) is kept only with the ReLU: the mask is the sign of gamma*xhat + beta, so it
cannot be rebuilt without it. The Function (not the public function, whose signature is fixed)
also takes ``recompute=False``: keep h and a packed 1-bit ReLU mask instead of recomputing the
conv - faster, but then the op keeps about what the unfused chain keeps.

Inference (``training=False``): batch norm is folded into the conv,
``w' = w * s[k]``, ``b' = beta - running_mean * s``, ``s = gamma / sqrt(running_var + eps)``
(:func:`fold_batchnorm`), and one conv with bias (and ReLU) runs. Its backward recomputes the
unfolded chain with the running statistics as constants.

The work is done by the array-level helpers of the conv and batch-norm families
(``numbafuse.ops.conv`` / ``numbafuse.ops.batchnorm``), which dispatch to the Numba CPU
kernels for NumPy arrays and to the numba.cuda kernels for device arrays, so this module has
no kernels of its own and results stay on the device.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays
from ..autograd import Function
from . import batchnorm as _bn
from . import conv as _conv

OP = "conv_batchnorm_relu"


# --------------------------------------------------------------------------- validation

def _validate(op, x, w, gamma, beta, running_mean, running_var, training, momentum, eps,
              stride, padding, dilation, layout):
    """Everything checked before anything is computed or written; returns (backend, geom)."""
    backend = _arrays.backend_of(op, x=x, w=w, gamma=gamma, beta=beta,
                                 running_mean=running_mean, running_var=running_var)
    _arrays.check_float_dtypes(op, x=x, w=w, gamma=gamma, beta=beta,
                               running_mean=running_mean, running_var=running_var)
    geom = _arrays.conv_geometry(op, tuple(x.shape), tuple(w.shape), stride, padding,
                                 dilation, layout)
    _arrays.check_vector(op, "gamma", gamma, geom.K)
    _arrays.check_vector(op, "beta", beta, geom.K)
    _bn.check_running_stats(op, geom.K, geom.N * geom.P * geom.Q, running_mean, running_var,
                            training, momentum, eps)
    return backend, geom


# --------------------------------------------------------------------------- the Function

class ConvBatchNormReLU(Function):
    r"""Fused conv (no bias) -> batch norm [-> ReLU], recomputing the conv in backward.

    Forward (training), per output channel k over the M = N*P*Q values of h = conv(x, w):

    .. math::

        \mu_k = \frac{1}{M}\sum h, \quad \sigma_k^2 = \frac{1}{M}\sum (h - \mu_k)^2, \quad
        \hat h = (h - \mu_k)\,\mathrm{invstd}_k, \quad
        y = \mathrm{relu}(\gamma_k \hat h + \beta_k)

    Backward, with :math:`g = \partial L/\partial y \cdot [y > 0]` (the mask recomputed from
    the recomputed :math:`\gamma\hat h + \beta`):

    .. math::

        \partial\beta_k = \sum g, \quad \partial\gamma_k = \sum g\,\hat h, \quad
        \partial h = \frac{\gamma_k\,\mathrm{invstd}_k}{M}
                     (M g - \partial\beta_k - \hat h\,\partial\gamma_k), \\
        \partial w = \mathrm{correlate}(x, \partial h), \quad
        \partial x = \mathrm{conv\_transpose}(\partial h, w)

    In inference the statistics are the running ones (constants), folded into the conv, and
    :math:`\partial h = \gamma_k\,\mathrm{invstd}_k\, g`.
    """

    name = OP

    def __init__(self, *, running_mean=None, running_var=None, training=True, momentum=0.1,
                 eps=1e-5, stride=1, padding=0, dilation=1, relu=True, layout="NCHW",
                 recompute=True):
        super().__init__(running_mean=running_mean, running_var=running_var,
                         training=training, momentum=momentum, eps=eps, stride=stride,
                         padding=padding, dilation=dilation,
                         relu=_arrays.check_flag(OP, "relu", relu), layout=layout,
                         recompute=_arrays.check_flag(OP, "recompute", recompute))

    # fwd :: (x, w, gamma, beta) -> (y, residuals=(x, w, gamma, [beta], mean, invstd))
    #        recompute=False, training: residuals=(x, w, gamma, h, relu_state, mean, invstd)
    #        (relu_state: the packed 1-bit mask of y > 0, or None without ReLU)
    def forward(self, x, w, gamma, beta):
        backend, geom = _validate(self.name, x, w, gamma, beta, self.running_mean,
                                  self.running_var, self.training, self.momentum, self.eps,
                                  self.stride, self.padding, self.dilation, self.layout)
        x, w, gamma, beta = (_arrays.contiguous(a) for a in (x, w, gamma, beta))
        self.geom = geom
        if self.training:
            h = _conv.conv_forward(x, w, None, geom, False)               # (N,K,P,Q) | NHWC
            mean, var, invstd = _bn.bn_stats(h, eps=self.eps, layout=geom.layout)  # (K,)
            keep_h = not self.recompute
            y = _bn.bn_apply(h, mean, invstd, gamma, beta, relu=self.relu, layout=geom.layout,
                             with_mask=keep_h and self.relu)
            if self.running_mean is not None:
                _bn.update_running(self.running_mean, self.running_var, mean, var,
                                   geom.N * geom.P * geom.Q, self.momentum)
            if keep_h:   # trade memory for speed: keep h and a 1-bit ReLU mask, no recompute
                y, mask = y if self.relu else (y, None)
                self.save_for_backward(x=x, w=w, gamma=gamma, h=h, relu_state=mask, mean=mean,
                                       invstd=invstd)
                return y
            del h                                                         # never kept
        else:
            mean, invstd = _bn.bn_inference_stats(_arrays.contiguous(self.running_mean),
                                                  _arrays.contiguous(self.running_var),
                                                  eps=self.eps)           # (K,) float64
            w_folded, b_folded = _fold(backend, w, None, gamma, beta, mean, invstd)
            y = _conv.conv_forward(x, w_folded, b_folded, geom, self.relu)
        if self.relu:
            self.save_for_backward(x=x, w=w, gamma=gamma, beta=beta, mean=mean, invstd=invstd)
        else:
            self.save_for_backward(x=x, w=w, gamma=gamma, mean=mean, invstd=invstd)
        return y

    # bwd :: (residuals, gy) -> (gx, gw, ggamma, gbeta)
    def backward(self, gy):
        s, geom = self.saved, self.geom
        need_x, need_w, need_gamma, need_beta = self.needs_input_grad
        gy = _arrays.contiguous(gy)
        if hasattr(s, "h"):                                               # recompute=False
            h, relu_state = s.h, s.relu_state
        else:
            h = _conv.conv_forward(s.x, s.w, None, geom, False)           # recompute
            relu_state = (_bn.bn_apply(h, s.mean, s.invstd, s.gamma, s.beta, relu=True,
                                       layout=geom.layout)
                          if self.relu else None)                         # its sign: the mask
        gh, ggamma, gbeta, _ = _bn.bn_backward(
            gy, h, s.mean, s.invstd, s.gamma, relu_state, layout=geom.layout,
            need=(need_x or need_w, need_gamma, need_beta, False), training=self.training)
        del h, relu_state
        gx = gw = None
        if need_x or need_w:
            gx, gw, _ = _conv.conv_backward(gh, s.x, s.w, geom, None, (need_x, need_w, False))
        return gx, gw, ggamma, gbeta


# --------------------------------------------------------------------------- folding

def _fold(backend, w, b, gamma, beta, mean, invstd):
    """(w', b') with s = gamma*invstd: w' = w*s[k], b' = (b - mean)*s + beta (b may be None).

    Batch norm's own apply kernel does both per-channel affine maps, on either backend:
    w viewed as an NCHW activation (1, K, C*R*S, 1) has channel k = filter k.
    """
    K = w.shape[0]
    CRS = int(np.prod(w.shape[1:]))
    zero_mean = _arrays.zeros(backend, (K,), np.float64)                   # (K,)
    zero_shift = _arrays.zeros(backend, (K,), w.dtype)                     # (K,)
    w_folded = _bn.bn_apply(w.reshape(1, K, CRS, 1), zero_mean, invstd, gamma, zero_shift,
                            relu=False, layout="NCHW").reshape(w.shape)    # gamma*invstd*w
    bias = _arrays.zeros(backend, (1, K, 1, 1), w.dtype) if b is None else b.reshape(1, K, 1, 1)
    b_folded = _bn.bn_apply(bias, mean, invstd, gamma, beta, relu=False,
                            layout="NCHW").reshape(K)                      # (b-mean)*s + beta
    return w_folded, b_folded


def fold_batchnorm(w, b, gamma, beta, running_mean, running_var, eps=1e-5):
    """Fold inference batch norm into the preceding conv's weights and bias.

    Returns ``(w_folded, b_folded)`` with ``s = gamma / sqrt(running_var + eps)``,
    ``w_folded[k] = w[k] * s[k]`` and ``b_folded = (b - running_mean) * s + beta``, so that
    ``conv2d(x, w_folded) + b_folded == batchnorm(conv2d(x, w) + b, training=False)``.

    Parameters
    ----------
    w : array (K, C, R, S)
    b : array (K,) or None
        The conv's bias (None: a conv without bias).
    gamma, beta, running_mean, running_var : arrays (K,)
    eps : float

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> w = np.ones((2, 1, 1, 1)); g = np.array([1.0, 2.0]); z = np.zeros(2)
    >>> wf, bf = nf.fold_batchnorm(w, None, g, z, z, np.ones(2), eps=0.0)
    >>> wf.ravel(), bf
    (array([1., 2.]), array([0., 0.]))
    """
    op = "fold_batchnorm"
    w, b, gamma, beta, running_mean, running_var = (
        _arrays.data(a) for a in (w, b, gamma, beta, running_mean, running_var))
    backend = _arrays.backend_of(op, w=w, b=b, gamma=gamma, beta=beta,
                                 running_mean=running_mean, running_var=running_var)
    _arrays.check_float_dtypes(op, w=w, b=b, gamma=gamma, beta=beta,
                               running_mean=running_mean, running_var=running_var)
    _arrays.check_ndim(op, "w", w, 4, "K, C, R, S")
    K = w.shape[0]
    for name, v in (("b", b), ("gamma", gamma), ("beta", beta), ("running_mean", running_mean),
                    ("running_var", running_var)):
        _arrays.check_vector(op, name, v, K)
    _arrays.check_scalar(op, "eps", eps, lo=0.0)
    w, b, gamma, beta = (None if a is None else _arrays.contiguous(a) for a in (w, b, gamma, beta))
    mean, invstd = _bn.bn_inference_stats(_arrays.contiguous(running_mean),
                                          _arrays.contiguous(running_var), eps=eps)
    return _fold(backend, w, b, gamma, beta, mean, invstd)


# --------------------------------------------------------------------------- public functions

def conv_batchnorm_relu(x, w, gamma, beta, *, running_mean=None, running_var=None,
                        training=True, momentum=0.1, eps=1e-5, stride=1, padding=0,
                        dilation=1, relu=True, layout="NCHW"):
    """``relu(batchnorm(conv2d(x, w)))`` fused; trained with recompute, folded in inference.

    Parameters
    ----------
    x : array or Tensor (N, C, H, W) (or NHWC)
    w : array or Tensor (K, C, R, S)
    gamma, beta : arrays or Tensors (K,)
    running_mean, running_var : arrays or Tensors (K,), or None
        Updated in place in training (PyTorch's convention, unbiased variance); required in
        inference, where batch norm is folded into the conv.
    training : bool
    momentum, eps : float
    stride, padding, dilation : int, pair, or ``"same"``/``"valid"`` (padding)
    relu : bool
        ``False`` leaves the ReLU out (a conv -> batch norm pair).
    layout : {"NCHW", "NHWC"}

    Returns
    -------
    y : array or Tensor (N, K, P, Q) (or NHWC). With Tensors the op saves for backward only
        x, w, gamma, (beta), and the per-channel mean and invstd; backward recomputes the conv.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 3, 5, 5)); w = rng.standard_normal((4, 3, 3, 3))
    >>> y = nf.conv_batchnorm_relu(x, w, np.ones(4), np.zeros(4), padding=1)
    >>> y.shape, bool((y >= 0).all())
    ((2, 4, 5, 5), True)
    """
    return ConvBatchNormReLU(running_mean=_arrays.data(running_mean),
                             running_var=_arrays.data(running_var), training=training,
                             momentum=momentum, eps=eps, stride=stride, padding=padding,
                             dilation=dilation, relu=relu, layout=layout).apply(x, w, gamma, beta)


def conv_batchnorm_relu_backward(gy, x, w, gamma, beta, *, running_mean=None, running_var=None,
                                 training=True, eps=1e-5, stride=1, padding=0, dilation=1,
                                 relu=True, layout="NCHW", need=(True, True, True, True)):
    """``(gx, gw, ggamma, gbeta)`` of :func:`conv_batchnorm_relu`, NumPy style (no tape).

    Recomputes the conv and the batch statistics from ``x`` (training) or uses the running
    statistics (inference), exactly as the tape's backward does. Nothing is written to the
    running statistics. ``need`` flags which of the four gradients to compute (the others
    are ``None``).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 3, 5, 5)); w = rng.standard_normal((4, 3, 3, 3))
    >>> gy = np.ones((2, 4, 3, 3))
    >>> gx, gw, ggamma, gbeta = nf.conv_batchnorm_relu_backward(gy, x, w, np.ones(4),
    ...                                                         np.zeros(4))
    >>> gx.shape, gw.shape, ggamma.shape
    ((2, 3, 5, 5), (4, 3, 3, 3), (4,))
    """
    op = "conv_batchnorm_relu_backward"
    gy, x, w, gamma, beta, running_mean, running_var = (
        _arrays.data(a) for a in (gy, x, w, gamma, beta, running_mean, running_var))
    _, geom = _validate(op, x, w, gamma, beta, running_mean, running_var, training, 0.0, eps,
                        stride, padding, dilation, layout)
    _arrays.backend_of(op, gy=gy, x=x)
    _arrays.check_float_dtypes(op, gy=gy, x=x)
    if tuple(gy.shape) != geom.y_shape:
        raise ValueError(f"{op}: gy has shape {tuple(gy.shape)}, expected {geom.y_shape}")
    if not isinstance(need, (tuple, list)) or len(need) != 4:
        raise ValueError(f"{op}: need must be four booleans (gx, gw, ggamma, gbeta), "
                         f"got {need!r}")
    x, w, gamma, beta, gy = (_arrays.contiguous(a) for a in (x, w, gamma, beta, gy))
    h = _conv.conv_forward(x, w, None, geom, False)                       # the one conv
    if training:
        mean, _, invstd = _bn.bn_stats(h, eps=eps, layout=geom.layout)    # (K,) float64
    else:
        mean, invstd = _bn.bn_inference_stats(_arrays.contiguous(running_mean),
                                              _arrays.contiguous(running_var), eps=eps)
    relu_state = (_bn.bn_apply(h, mean, invstd, gamma, beta, relu=True, layout=geom.layout)
                  if relu else None)                                      # y: its sign, the mask
    # the tape's backward, fed these residuals (the recompute=False form: h is at hand)
    fn = ConvBatchNormReLU(training=training, eps=eps, stride=stride, padding=padding,
                           dilation=dilation, relu=relu, layout=layout, recompute=False)
    fn.geom, fn.needs_input_grad = geom, tuple(bool(n) for n in need)
    fn.save_for_backward(x=x, w=w, gamma=gamma, h=h, relu_state=relu_state, mean=mean,
                         invstd=invstd)
    return fn.backward(gy)
