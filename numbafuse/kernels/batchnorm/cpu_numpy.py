"""Batch norm's CPU passes in plain NumPy: what a first call runs while the Numba kernels of
``kernels/batchnorm/cpu.py`` compile (``cpu_first.py``, ``kernels/cpu/first_calls.py``).

The same functions as ``cpu.py``'s entry points (``stats``, ``stats_update``, ``apply``,
``backward``) and the same arguments, computed by NumPy in float64 (the sums) and in x's dtype
(the forward's per-channel values rounded to it, as ``cpu_channels.channel_values`` rounds
them, so that the affine ReLU gate of a backward re-derives the forward's decisions): results
equal ``cpu.py``'s to rounding, not bit for bit. Nothing here compiles. Not for ``sync``
(synchronized batch norm) or an empty x: ``cpu_first.py`` runs those compiled.
"""
import numpy as np

from .math import STATE_AFFINE, STATE_MASK, STATE_Y


def _nchw(a, layout):
    """A 4-d activation as an (N, C, H, W) view."""
    return a if layout == "NCHW" else a.transpose(0, 3, 1, 2)


def _channel(v):
    return v[None, :, None, None]


def stats(x, layout, eps):
    """(mean, var, invstd) float64 (C,); var biased."""
    x64 = _nchw(x, layout).astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3))
    var = np.maximum(((x64 - _channel(mean)) ** 2).mean(axis=(0, 2, 3)), 0.0)
    return mean, var, 1.0 / np.sqrt(var + eps)


def stats_update(x, layout, eps, running_mean, running_var, momentum):
    """:func:`stats`, and the running statistics updated in place (PyTorch's rule, the
    unbiased variance)."""
    mean, var, invstd = stats(x, layout, eps)
    if running_mean is not None:
        xc = _nchw(x, layout)
        count = float(xc.shape[0] * xc.shape[2] * xc.shape[3])
        m = float(momentum)
        with np.errstate(divide="ignore", invalid="ignore"):
            unbiased = var * count / (count - 1.0)
        running_mean[...] = (1.0 - m) * running_mean.astype(np.float64) + m * mean
        running_var[...] = (1.0 - m) * running_var.astype(np.float64) + m * unbiased
    return mean, var, invstd


def _affine(x, mean, invstd, gamma, beta, layout):
    """(x - mean) * gamma * invstd + beta in x's dtype, from the per-channel values rounded to
    it as ``cpu_channels.channel_values`` rounds them (mean split in two)."""
    dtype = x.dtype
    mean_hi = mean.astype(dtype)
    mean_lo = (mean - mean_hi.astype(np.float64)).astype(dtype)
    scale = (invstd * gamma.astype(np.float64)).astype(dtype)
    shift = beta.astype(dtype)
    xc = _nchw(x, layout)
    return ((xc - _channel(mean_hi)) - _channel(mean_lo)) * _channel(scale) + _channel(shift)


def apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
    """(y, mask or None): y = [relu](gamma*xhat + beta [+ z]); mask: packed y > 0."""
    v = _affine(x, mean, invstd, gamma, beta, layout)
    if z is not None:
        v = v + _nchw(z, layout)
    if relu:
        v = np.where(v <= 0, np.zeros((), x.dtype), v)              # NaN kept (scalar.relu)
    y = np.ascontiguousarray(v.transpose(0, 2, 3, 1) if layout == "NHWC" else v)
    mask = np.packbits(y.reshape(-1) > 0, bitorder="little") if want_mask else None
    return y, mask


def backward(gy, x, mean, invstd, gamma, state_kind, state, layout, training, need,
             sync=None, sums=None):
    """``(gx, ggamma, gbeta, gz)`` as ``cpu.backward`` (no ``sync``)."""
    if sync is not None:
        raise ValueError("batch norm's NumPy backward: no synchronized batch norm")
    need_gx, need_ggamma, need_gbeta, need_gz = need
    dtype = x.dtype
    gyc, xc = _nchw(gy, layout), _nchw(x, layout)
    if state_kind == STATE_Y:
        open_ = _nchw(state, layout) > 0
    elif state_kind == STATE_MASK:
        bits = np.unpackbits(state, count=x.size, bitorder="little").reshape(x.shape)
        open_ = _nchw(bits, layout) != 0
    elif state_kind == STATE_AFFINE:
        open_ = _affine(x, mean, invstd, gamma, state, layout) > 0
    else:
        open_ = None
    g = gyc if open_ is None else np.where(open_, gyc, np.zeros((), dtype))   # x's dtype
    g64 = g.astype(np.float64)
    centred = xc.astype(np.float64) - _channel(mean)
    if sums is not None:                                  # pass 1 made by the conv
        sg, sgx = sums.sum(axis=0)
    else:
        sg, sgx = g64.sum(axis=(0, 2, 3)), (g64 * centred).sum(axis=(0, 2, 3))
    gamma64 = gamma.astype(np.float64)
    count = float(xc.shape[0] * xc.shape[2] * xc.shape[3]) or 1.0
    gx = None
    if need_gx:
        dx = _channel(gamma64 * invstd) * g64
        if training:
            dx = dx - _channel(gamma64 * invstd / count) * (
                _channel(sg) + centred * _channel(invstd * invstd * sgx))
        gx = np.ascontiguousarray(_from_nchw(dx.astype(dtype), layout))
    gz = np.ascontiguousarray(_from_nchw(g, layout)) if need_gz else None
    return (gx, (sgx * invstd).astype(dtype) if need_ggamma else None,
            sg.astype(dtype) if need_gbeta else None, gz)


def _from_nchw(a, layout):
    return a if layout == "NCHW" else a.transpose(0, 2, 3, 1)
