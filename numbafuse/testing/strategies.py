"""Hypothesis strategies for numbafuse property tests, reusable in your own test suites.

Shapes and values are drawn freely; dtypes and layouts from short lists, since every new
dtype/layout is a new Numba compilation.

Examples
--------
>>> from hypothesis import given
>>> from numbafuse.testing import strategies as nfs
>>> @given(nfs.conv_problems())
... def test_my_conv(problem):
...     x, w, b, kw = problem.x, problem.w, problem.b, problem.kwargs
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

DTYPES = (np.float32, np.float64)
LAYOUTS = ("NCHW", "NHWC")


def dtypes():
    return st.sampled_from(DTYPES)


def layouts():
    return st.sampled_from(LAYOUTS)


def _out_size(size, k, stride, dilation, pad_begin, pad_end):
    return (size + pad_begin + pad_end - dilation * (k - 1) - 1) // stride + 1


def _same(size, k, stride, dilation):
    out = -(-size // stride)
    total = max((out - 1) * stride + dilation * (k - 1) + 1 - size, 0)
    return total // 2, total - total // 2


@dataclass
class ConvProblem:
    """One drawn convolution: arrays and the keyword arguments of the call."""
    x: np.ndarray
    w: np.ndarray
    b: np.ndarray | None
    kwargs: dict = field(default_factory=dict)

    @property
    def layout(self):
        return self.kwargs.get("layout", "NCHW")


@st.composite
def conv_geometries(draw, max_batch=2, max_channels=4, max_size=8, max_kernel=3,
                    max_stride=2, max_dilation=2, paddings=("int", "pair", "same", "valid")):
    """A dict of valid conv geometry: N, C, H, W, K, R, S, stride, padding, dilation."""
    N = draw(st.integers(1, max_batch))
    C = draw(st.integers(1, max_channels))
    K = draw(st.integers(1, max_channels))
    R = draw(st.integers(1, max_kernel))
    S = draw(st.integers(1, max_kernel))
    stride = (draw(st.integers(1, max_stride)), draw(st.integers(1, max_stride)))
    dilation = (draw(st.integers(1, max_dilation)), draw(st.integers(1, max_dilation)))
    kind = draw(st.sampled_from(paddings))
    if kind == "int":
        p = draw(st.integers(0, max_kernel - 1))
        padding, pads = p, ((p, p), (p, p))
    elif kind == "pair":
        ph, pw = draw(st.integers(0, max_kernel - 1)), draw(st.integers(0, max_kernel - 1))
        padding, pads = (ph, pw), ((ph, ph), (pw, pw))
    else:
        padding, pads = kind, None
    H = draw(st.integers(1, max_size))
    W = draw(st.integers(1, max_size))
    if pads is None:
        pads = ((0, 0), (0, 0)) if kind == "valid" else (
            _same(H, R, stride[0], dilation[0]), _same(W, S, stride[1], dilation[1]))
    assume(_out_size(H, R, stride[0], dilation[0], *pads[0]) >= 1)
    assume(_out_size(W, S, stride[1], dilation[1], *pads[1]) >= 1)
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=stride, padding=padding,
                dilation=dilation)


def arrays(shape, dtype, seed_strategy=None, scale=1.0):
    """A strategy of standard-normal arrays of a fixed shape (seeded draws: fast shrinking)."""
    return st.integers(0, 2**32 - 1).map(
        lambda seed: (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype))


@st.composite
def conv_problems(draw, dtype=None, layout=None, bias=None, **geometry_kwargs):
    """A :class:`ConvProblem` with random x, w, b in a drawn geometry, dtype and layout."""
    g = draw(conv_geometries(**geometry_kwargs))
    dtype = draw(dtypes()) if dtype is None else dtype
    layout = draw(layouts()) if layout is None else layout
    with_bias = draw(st.booleans()) if bias is None else bias
    x_shape = (g["N"], g["C"], g["H"], g["W"]) if layout == "NCHW" else (
        g["N"], g["H"], g["W"], g["C"])
    x = draw(arrays(x_shape, dtype))
    w = draw(arrays((g["K"], g["C"], g["R"], g["S"]), dtype, scale=1.0 / np.sqrt(g["C"] * g["R"] * g["S"])))
    b = draw(arrays((g["K"],), dtype)) if with_bias else None
    return ConvProblem(x, w, b, dict(stride=g["stride"], padding=g["padding"],
                                     dilation=g["dilation"], layout=layout))


@dataclass
class BatchNormProblem:
    """One drawn batch-norm-add batch: x, the residual z, affine params and running stats."""
    x: np.ndarray
    z: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    running_mean: np.ndarray
    running_var: np.ndarray
    layout: str


@st.composite
def batchnorm_problems(draw, dtype=None, layout=None, max_batch=3, max_channels=4, max_size=5,
                       mean_scale=None):
    """A :class:`BatchNormProblem` with at least two values per channel.

    ``mean_scale`` (e.g. 1e4) offsets each channel's mean to test accumulation accuracy.
    """
    dtype = draw(dtypes()) if dtype is None else dtype
    layout = draw(layouts()) if layout is None else layout
    N = draw(st.integers(1, max_batch))
    C = draw(st.integers(1, max_channels))
    H = draw(st.integers(1, max_size))
    W = draw(st.integers(1, max_size))
    assume(N * H * W >= 2)
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if mean_scale:
        offsets = rng.uniform(-mean_scale, mean_scale, C)
        x = x + (offsets.reshape(1, C, 1, 1) if layout == "NCHW" else offsets)
    return BatchNormProblem(
        x=x.astype(dtype),
        z=rng.standard_normal(shape).astype(dtype),
        gamma=rng.uniform(0.5, 1.5, C).astype(dtype),
        beta=rng.standard_normal(C).astype(dtype),
        running_mean=rng.standard_normal(C).astype(dtype),
        running_var=rng.uniform(0.5, 2.0, C).astype(dtype),
        layout=layout,
    )
