"""Hypothesis strategies for numbafuse property tests, reusable in your own test suites.

Shapes and values are drawn freely; dtypes and layouts from short lists, since every new
dtype/layout is a new Numba compilation. Every strategy draws *valid* problems (output sizes
>= 1, at least two values per batch-norm channel, labels in range), so a test never has to
filter.

Each problem strategy takes size limits (``max_batch``, ``max_channels``, ``max_size``...) and
``dims``, a dict of strategies that replace the draw of individual dimensions. ``dims`` is how
a test reaches a kernel's block and chunk boundaries with small inputs, e.g. image heights
just past a row block of 8::

    conv_problems(dims={"H": st.sampled_from([9, 17, 33]), "N": st.just(3)})

==============================  ==========================================================
strategy                        draws
==============================  ==========================================================
``dtypes(half=False)``          float32/float64, with ``half`` also float16 (and bfloat16
                                with ``ml_dtypes``); ``layouts()``: "NCHW"/"NHWC";
                                ``param_dtypes(dtype)``: a batch norm's parameter dtypes
``shapes(...)``                 tuples of small positive ints (any rank)
``arrays(shape, dtype)``        seeded standard-normal arrays (fast shrinking)
``conv_geometries(...)``        dict N, C, H, W, K, R, S, stride, padding (int, pair,
                                asymmetric 4-tuple, "same", "valid"), dilation
``conv_problems(...)``          :class:`ConvProblem` for ``conv_bias_relu(p.x, p.w, p.b,
                                **p.kwargs)``
``batchnorm_problems(...)``     :class:`BatchNormProblem` (x, z, gamma, beta, running stats)
``conv_batchnorm_problems()``   :class:`ConvBatchNormProblem` for ``conv_batchnorm_relu``
                                (``half``, ``param_dtype``, ``groups`` as the others)
``pool_problems(...)``          :class:`PoolProblem` for ``max_pool2d(p.x, p.k, p.stride, ...)``
``linear_problems(...)``        :class:`LinearProblem` for ``linear(p.x, p.w, p.b)``
``cross_entropy_problems()``    :class:`CrossEntropyProblem` (logits, int labels in range)
==============================  ==========================================================

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

from .. import validate

DTYPES = (np.float32, np.float64)
HALF_DTYPES = tuple(d.type for d in validate.HALF_DTYPES)   # float16 (+ bfloat16: ml_dtypes)
LAYOUTS = ("NCHW", "NHWC")
SEEDS = st.integers(0, 2**32 - 1)


def dtypes(half=False):
    """float32 or float64; with ``half`` also the half-precision dtypes (the ops whose
    ``OpSpec.half`` says so; bfloat16 runs on the CPU only: draw float16 for CUDA)."""
    return st.sampled_from(DTYPES + HALF_DTYPES if half else DTYPES)


def param_dtypes(dtype):
    """The dtypes a batch norm's parameters may have for an input of ``dtype``: its own and,
    for a half ``dtype``, float32 (PyTorch's rule, ``validate.check_param_dtypes``)."""
    dtype = np.dtype(dtype)
    return st.sampled_from((dtype.type, np.float32) if dtype.type in HALF_DTYPES
                           else (dtype.type,))


def layouts():
    return st.sampled_from(LAYOUTS)


def shapes(min_dims=1, max_dims=4, max_side=5):
    """Tuples of ``min_dims``..``max_dims`` sides in 1..``max_side``."""
    return st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def _dim(draw, dims, name, lo, hi):
    """Dimension ``name``: from ``dims[name]`` (a strategy) if given, else in [lo, hi]."""
    if dims and name in dims:
        return draw(dims[name])
    return draw(st.integers(lo, hi))


def _nchw(draw, dims, max_batch, max_channels, max_size):
    """N, C, H, W drawn in that order (each from ``dims`` if given there, else from 1 up to
    its ``max_*``)."""
    return (_dim(draw, dims, "N", 1, max_batch), _dim(draw, dims, "C", 1, max_channels),
            _dim(draw, dims, "H", 1, max_size), _dim(draw, dims, "W", 1, max_size))


def _activation_shape(layout, N, C, H, W):
    return (N, C, H, W) if layout == "NCHW" else (N, H, W, C)


def _out_size(size, k, stride, dilation, pad_begin, pad_end):
    return (size + pad_begin + pad_end - dilation * (k - 1) - 1) // stride + 1


def _same(size, k, stride, dilation):
    out = -(-size // stride)
    total = max((out - 1) * stride + dilation * (k - 1) + 1 - size, 0)
    return total // 2, total - total // 2


def arrays(shape, dtype, seed_strategy=None, scale=1.0):
    """A strategy of standard-normal arrays of a fixed shape (seeded draws: fast shrinking)."""
    seeds = SEEDS if seed_strategy is None else seed_strategy
    return seeds.map(
        lambda seed: (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype))


# --------------------------------------------------------------------------- convolution

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
                    max_stride=2, max_dilation=2,
                    paddings=("int", "pair", "quad", "same", "valid"), dims=None,
                    groups=False):
    """A dict of valid conv geometry: N, C, H, W, K, R, S, stride, padding, dilation (plus
    the output size P, Q).

    ``paddings``: the kinds drawn from: "int", "pair" (h, w), "quad" (an asymmetric 4-tuple
    (left, right, top, bottom), ``torch.nn.functional.pad``'s order), "same", "valid".

    ``dims``: optional strategies for any of N, C, K, H, W, R, S, replacing the ``max_*``
    ranges of those dimensions (e.g. ``{"C": st.integers(17, 20)}``).

    ``groups=True`` also draws ``groups`` G (C and K multiples of G; C == G: depthwise), or
    ``groups`` a strategy of G; then ``dims["Cg"]`` may give the channels per group (C = G *
    Cg; 1: depthwise). The dict always has ``groups`` (1 unless drawn).
    """
    N = _dim(draw, dims, "N", 1, max_batch)
    C = _dim(draw, dims, "C", 1, max_channels)
    K = _dim(draw, dims, "K", 1, max_channels)
    G = (draw(groups) if isinstance(groups, st.SearchStrategy) else
         draw(st.integers(1, max_channels)) if groups else 1)
    if G > 1:   # C = G * C/G input channels, K = G * (1 or 2) filters
        C = G * _dim(draw, dims, "Cg", 1, max(1, max_channels // G))
        K = G * draw(st.integers(1, 2))
    R = _dim(draw, dims, "R", 1, max_kernel)
    S = _dim(draw, dims, "S", 1, max_kernel)
    stride = (draw(st.integers(1, max_stride)), draw(st.integers(1, max_stride)))
    dilation = (draw(st.integers(1, max_dilation)), draw(st.integers(1, max_dilation)))
    kind = draw(st.sampled_from(paddings))
    if kind == "int":
        p = draw(st.integers(0, max_kernel - 1))
        padding, pads = p, ((p, p), (p, p))
    elif kind == "pair":
        ph, pw = draw(st.integers(0, max_kernel - 1)), draw(st.integers(0, max_kernel - 1))
        padding, pads = (ph, pw), ((ph, ph), (pw, pw))
    elif kind == "quad":
        left, right, top, bottom = (draw(st.integers(0, max_kernel - 1)) for _ in range(4))
        padding, pads = (left, right, top, bottom), ((top, bottom), (left, right))
    else:
        padding, pads = kind, None
    H = _dim(draw, dims, "H", 1, max_size)
    W = _dim(draw, dims, "W", 1, max_size)
    if pads is None:
        pads = ((0, 0), (0, 0)) if kind == "valid" else (
            _same(H, R, stride[0], dilation[0]), _same(W, S, stride[1], dilation[1]))
    P = _out_size(H, R, stride[0], dilation[0], *pads[0])
    Q = _out_size(W, S, stride[1], dilation[1], *pads[1])
    assume(P >= 1 and Q >= 1)
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=stride, padding=padding,
                dilation=dilation, P=P, Q=Q, groups=G)


def _groups(g):
    """The ``groups`` keyword of a drawn geometry: only where grouped (calls without it stay
    as they were)."""
    return {"groups": g["groups"]} if g["groups"] != 1 else {}


@st.composite
def conv_problems(draw, dtype=None, layout=None, bias=None, half=False, **geometry_kwargs):
    """A :class:`ConvProblem` with random x, w, b in a drawn geometry, dtype and layout.

    ``geometry_kwargs`` go to :func:`conv_geometries` (``max_*`` limits, ``paddings``, ``dims``).
    ``half``: the dtype drawn (when not given) may be half precision (:func:`dtypes`).
    """
    g = draw(conv_geometries(**geometry_kwargs))
    dtype = draw(dtypes(half)) if dtype is None else dtype
    layout = draw(layouts()) if layout is None else layout
    with_bias = draw(st.booleans()) if bias is None else bias
    x = draw(arrays(_activation_shape(layout, g["N"], g["C"], g["H"], g["W"]), dtype))
    Cg = g["C"] // g["groups"]                                     # input channels per group
    w = draw(arrays((g["K"], Cg, g["R"], g["S"]), dtype,
                    scale=1.0 / np.sqrt(Cg * g["R"] * g["S"])))
    b = draw(arrays((g["K"],), dtype)) if with_bias else None
    return ConvProblem(x, w, b, dict(stride=g["stride"], padding=g["padding"],
                                     dilation=g["dilation"], layout=layout, **_groups(g)))


# --------------------------------------------------------------------------- batch norm

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


def _batchnorm_parameters(rng, C, dtype):
    """gamma, beta, running_mean, running_var (C,) each: gamma and running_var positive."""
    return dict(gamma=rng.uniform(0.5, 1.5, C).astype(dtype),
                beta=rng.standard_normal(C).astype(dtype),
                running_mean=rng.standard_normal(C).astype(dtype),
                running_var=rng.uniform(0.5, 2.0, C).astype(dtype))


@st.composite
def batchnorm_problems(draw, dtype=None, layout=None, max_batch=3, max_channels=4, max_size=5,
                       mean_scale=None, dims=None, half=False, param_dtype=None):
    """A :class:`BatchNormProblem` with at least two values per channel.

    ``half``: the dtype drawn (when not given) may be half precision; ``param_dtype``: that
    of gamma, beta and the running statistics, drawn from :func:`param_dtypes` when None (x's
    own, or float32 for a half x).

    ``mean_scale`` (e.g. 1e4) offsets each channel's mean to test accumulation accuracy.
    ``dims``: optional strategies for any of N, C, H, W (replacing the ``max_*`` ranges).
    """
    dtype = draw(dtypes(half)) if dtype is None else dtype
    param_dtype = draw(param_dtypes(dtype)) if param_dtype is None else param_dtype
    layout = draw(layouts()) if layout is None else layout
    N, C, H, W = _nchw(draw, dims, max_batch, max_channels, max_size)
    assume(N * H * W >= 2)
    shape = _activation_shape(layout, N, C, H, W)
    rng = np.random.default_rng(draw(SEEDS))
    x = rng.standard_normal(shape)
    if mean_scale:
        offsets = rng.uniform(-mean_scale, mean_scale, C)
        x = x + (offsets.reshape(1, C, 1, 1) if layout == "NCHW" else offsets)
    return BatchNormProblem(x=x.astype(dtype), z=rng.standard_normal(shape).astype(dtype),
                            layout=layout, **_batchnorm_parameters(rng, C, param_dtype))


@dataclass
class ConvBatchNormProblem:
    """One drawn conv -> batch norm: x, w (no bias), the batch norm's K-vectors and the conv
    keywords (stride, padding, dilation, layout)."""
    x: np.ndarray
    w: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    running_mean: np.ndarray
    running_var: np.ndarray
    kwargs: dict = field(default_factory=dict)

    @property
    def layout(self):
        return self.kwargs.get("layout", "NCHW")


@st.composite
def conv_batchnorm_problems(draw, dtype=None, layout=None, half=False, param_dtype=None,
                            **geometry_kwargs):
    """A :class:`ConvBatchNormProblem` whose conv output has at least two values per channel
    (N*P*Q >= 2, so training batch norm is defined). ``geometry_kwargs`` as in
    :func:`conv_problems` (default limits: batch 2, channels 3, size 6, kernel 3; ``groups``
    too). ``half``: the dtype drawn (when not given) may be half precision; ``param_dtype``:
    that of gamma, beta and the running statistics, drawn from :func:`param_dtypes` when None
    (x's dtype, or float32 for a half x: autocast's mix)."""
    geometry_kwargs = {**dict(max_batch=2, max_channels=3, max_size=6, max_kernel=3),
                       **geometry_kwargs}
    g = draw(conv_geometries(**geometry_kwargs))
    assume(g["N"] * g["P"] * g["Q"] >= 2)
    dtype = draw(dtypes(half)) if dtype is None else dtype
    param_dtype = draw(param_dtypes(dtype)) if param_dtype is None else param_dtype
    layout = draw(layouts()) if layout is None else layout
    x = draw(arrays(_activation_shape(layout, g["N"], g["C"], g["H"], g["W"]), dtype))
    Cg = g["C"] // g["groups"]                                     # input channels per group
    w = draw(arrays((g["K"], Cg, g["R"], g["S"]), dtype,
                    scale=1.0 / np.sqrt(Cg * g["R"] * g["S"])))
    rng = np.random.default_rng(draw(SEEDS))
    return ConvBatchNormProblem(x=x, w=w, **_batchnorm_parameters(rng, g["K"], param_dtype),
                                kwargs=dict(stride=g["stride"], padding=g["padding"],
                                            dilation=g["dilation"], layout=layout,
                                            **_groups(g)))


# --------------------------------------------------------------------------- the unfused ops

@dataclass
class PoolProblem:
    """One drawn max pooling: ``max_pool2d(p.x, p.k, p.stride, layout=p.layout)``."""
    x: np.ndarray
    k: object          # an int or an (h, w) pair
    stride: object     # None (= k) or an (h, w) pair
    layout: str


@st.composite
def pool_problems(draw, dtype=None, layout=None, max_batch=2, max_channels=3, max_size=7,
                  ties=None, distinct=False, dims=None):
    """A :class:`PoolProblem`: any window that fits, stride None or up to 3 per dimension.

    ``ties``: x holds small integers (windows with several maxima) - drawn when None.
    ``distinct``: x is a permutation of 0..size-1 (no ties anywhere: what finite differences
    need). ``dims``: optional strategies for any of N, C, H, W.
    """
    dtype = draw(dtypes()) if dtype is None else dtype
    layout = draw(layouts()) if layout is None else layout
    N, C, H, W = _nchw(draw, dims, max_batch, max_channels, max_size)
    kh, kw = draw(st.integers(1, H)), draw(st.integers(1, W))
    k = kh if kh == kw and draw(st.booleans()) else (kh, kw)
    stride = draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))))
    shape = _activation_shape(layout, N, C, H, W)
    rng = np.random.default_rng(draw(SEEDS))
    if distinct:
        x = rng.permutation(int(np.prod(shape))).reshape(shape)
    elif draw(st.booleans()) if ties is None else ties:
        x = rng.integers(-2, 3, shape)
    else:
        x = rng.standard_normal(shape)
    return PoolProblem(x.astype(dtype), k, stride, layout)


@dataclass
class LinearProblem:
    """One drawn fully connected layer: ``linear(p.x, p.w, p.b)``."""
    x: np.ndarray
    w: np.ndarray
    b: np.ndarray | None


@st.composite
def linear_problems(draw, dtype=None, max_size=6, bias=None, dims=None):
    """A :class:`LinearProblem`: x (N, F_in), w (F_out, F_in), b (F_out,) or None.

    ``dims``: optional strategies for any of N, F_in, F_out.
    """
    dtype = draw(dtypes()) if dtype is None else dtype
    N, F_in, F_out = (_dim(draw, dims, name, 1, max_size) for name in ("N", "F_in", "F_out"))
    with_bias = draw(st.booleans()) if bias is None else bias
    x = draw(arrays((N, F_in), dtype))
    w = draw(arrays((F_out, F_in), dtype, scale=1 / np.sqrt(F_in)))
    b = draw(arrays((F_out,), dtype)) if with_bias else None
    return LinearProblem(x, w, b)


@dataclass
class CrossEntropyProblem:
    """One drawn loss: ``cross_entropy(p.logits, p.labels)``."""
    logits: np.ndarray
    labels: np.ndarray


@st.composite
def cross_entropy_problems(draw, dtype=None, max_batch=6, max_classes=6, scales=(1.0, 30.0),
                           dims=None):
    """A :class:`CrossEntropyProblem`: logits (N, L) times a scale drawn from ``scales``
    (large ones test the stable log-sum-exp), labels int32 or int64 in [0, L).

    ``dims``: optional strategies for N and L.
    """
    dtype = draw(dtypes()) if dtype is None else dtype
    N, L = _dim(draw, dims, "N", 1, max_batch), _dim(draw, dims, "L", 1, max_classes)
    rng = np.random.default_rng(draw(SEEDS))
    logits = (rng.standard_normal((N, L)) * draw(st.sampled_from(scales))).astype(dtype)
    labels = rng.integers(0, L, N).astype(draw(st.sampled_from([np.int32, np.int64])))
    return CrossEntropyProblem(logits, labels)
