"""Inference batch norm after a conv: folded into the conv's weights and bias, or (where the
backend's conv can) applied as the conv's per-channel scale and shift in its epilogue.

    fold_batchnorm(w, b, gamma, beta, running_mean, running_var, eps)   the public fold
    fold(which, w, b, gamma, beta, mean, invstd)                        (w', b'), any backend
    inference_forward(which, x, w, gamma, beta, mean, invstd, geometry, relu, eps)
                                                the Conv-BN(-ReLU) op's inference y
"""
from __future__ import annotations

import numpy as np

from .. import autograd, backend, kernels, validate
from ..kernels.conv import weights as _weights
from . import batchnorm as _bn
from . import conv as _conv


def _values(w, gamma, beta, mean, invstd):
    """The batch norm as per-channel (scale, shift) for ``forward_scaled``: a callable of
    (s, beta - mean*s), (K,) each in w's dtype, from float64 (host arrays: the CPU kernels
    ask for them; a compiled step, ``kernels/batchnorm/cpu_running.scale_shift``, so that a
    prepared call records it)."""
    def values():
        return kernels.batchnorm_kernels(backend.CPU).scale_shift(gamma, beta, mean, invstd,
                                                                  w.dtype)
    return values


def inference_forward(which, x, w, gamma, beta, mean, invstd, geometry, relu, eps):
    """y of inference: the batch norm as the conv's per-channel scale and shift
    (``forward_scaled``, its epilogue: w not rewritten) where the backend can, else folded
    into w and the bias (cached where the caller vouches for w and the batch norm's tensors,
    numbafuse.torch in inference: kernels/conv/weights.py, and so what the conv derives)."""
    y = kernels.conv_kernels(which, geometry.groups).forward_scaled(
        x, w, _values(w, gamma, beta, mean, invstd), geometry, relu)
    if y is not None:
        return y
    w_folded, b_folded = _weights.derived(w, ("folded", float(eps)), lambda: fold(
        which, w, None, gamma, beta, mean, invstd))
    with _weights.vouch_like(w_folded, w):
        return _conv.conv_forward(x, w_folded, b_folded, geometry, relu)


def inference_add_forward(which, x, w, gamma, beta, mean, invstd, geometry, z):
    """y = relu(batchnorm(conv(x, w)) + z) of inference in one pass: the batch norm as the
    conv's scale and shift and z added in its epilogue (``forward_scaled``'s z), where the
    backend's conv for ``geometry`` has that epilogue (the CPU's im2col, tapwise and NCHW
    pointwise plans); else None (the caller runs the conv, then the batch norm's apply with
    z)."""
    return kernels.conv_kernels(which, geometry.groups).forward_scaled(
        x, w, _values(w, gamma, beta, mean, invstd), geometry, True, z=z)


def fold(which, w, b, gamma, beta, mean, invstd):
    """(w', b') with s = gamma*invstd: w' = w*s[k], b' = (b - mean)*s + beta (b may be None).

    Batch norm's own apply kernel does both per-channel affine maps, on either backend:
    w viewed as an NCHW activation (1, K, C*R*S, 1) has channel k = filter k.
    """
    K = w.shape[0]
    CRS = int(np.prod(w.shape[1:]))
    zero_mean = kernels.zeros(which, (K,), np.float64)                   # (K,)
    zero_shift = kernels.zeros(which, (K,), w.dtype)                     # (K,)
    w_folded = _bn.bn_apply(w.reshape(1, K, CRS, 1), zero_mean, invstd, gamma, zero_shift,
                            relu=False, layout="NCHW").reshape(w.shape)    # gamma*invstd*w
    bias = kernels.zeros(which, (1, K, 1, 1), w.dtype) if b is None else b.reshape(1, K, 1, 1)
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
        autograd.unwrap(a) for a in (w, b, gamma, beta, running_mean, running_var))
    validate.check_given(op, w=w, gamma=gamma, beta=beta, running_mean=running_mean,
                         running_var=running_var)
    which = backend.backend_of(op, w=w, b=b, gamma=gamma, beta=beta,
                                 running_mean=running_mean, running_var=running_var)
    validate.check_float_dtypes(op, w=w, b=b, gamma=gamma, beta=beta,
                               running_mean=running_mean, running_var=running_var)
    validate.check_ndim(op, "w", w, 4, "K, C, R, S")
    K = w.shape[0]
    for name, v in (("b", b), ("gamma", gamma), ("beta", beta), ("running_mean", running_mean),
                    ("running_var", running_var)):
        validate.check_vector(op, name, v, K)
    validate.check_scalar(op, "eps", eps, lo=0.0)
    w, b, gamma, beta = (None if a is None else kernels.contiguous(a) for a in (w, b, gamma, beta))
    mean, invstd = _bn.bn_inference_stats(kernels.contiguous(running_mean),
                                          kernels.contiguous(running_var), eps=eps)
    return fold(which, w, b, gamma, beta, mean, invstd)
