"""Index math of a convolution, shared by the CPU and the CUDA conv kernels.

Plain Python (no decorators): ``kernels/cpu/conv.py`` wraps these with ``cpu_scalar``. The
CUDA implicit GEMMs (``kernels/conv/cuda.py``) never compute an index per element: they read
host-built tap tables whose entries solve the same equations (``input_coord`` per tap, and
``output_coord`` solved once per dx phase).

A convolution's geometry travels to the kernels as one tuple of ints, ``geo`` (see
``GEO_FIELDS``); ``nhwc`` is 1 for the NHWC layout, 0 for NCHW. Notation: N batch, C input
channels, H/W input size, K filters, R/S filter size, P/Q output size, sh/sw stride, ph/pw
top/left padding, dh/dw dilation.
"""
import dataclasses
import functools

GEO_FIELDS = ("N", "C", "H", "W", "K", "R", "S", "P", "Q", "sh", "sw", "ph", "pw", "dh", "dw",
              "nhwc")
GEO_LEN = len(GEO_FIELDS)


def geo_tuple(geom):
    """The ``GEO_FIELDS`` tuple of a ``validate.ConvGeometry`` (host side; made once per
    geometry, a frozen dataclass: 16 attribute reads were a few microseconds of each call)."""
    return _geo_tuple(geom)


@functools.lru_cache(maxsize=1024)
def _geo_tuple(geom):
    return tuple(int(geom.layout == "NHWC") if f == "nhwc" else int(getattr(geom, f))
                 for f in GEO_FIELDS)


def k_view(a, geom):
    """An output-shaped host array as (N, PQ, K) (NHWC) or (N, K, PQ) (NCHW), the view the
    CPU forwards' tasks write y (and read a residual z) through."""
    N, PQ, K = geom.N, geom.P * geom.Q, geom.K
    return a.reshape(N, PQ, K) if geom.layout == "NHWC" else a.reshape(N, K, PQ)


def int_tuple(*values):
    """Scalars as one tuple of Python ints (host side): a task kernel's sizes in one argument
    of one type (a UniTuple of int64), however the host computed them."""
    return tuple(map(int, values))


def group_geometry(geom):
    """The ungrouped geometry of one group of a grouped ``validate.ConvGeometry`` (host side):
    C/groups channels, K/groups filters, groups=1."""
    return dataclasses.replace(geom, C=geom.C // geom.groups, K=geom.K // geom.groups, groups=1)


def is_depthwise(geom):
    """Whether a grouped ``validate.ConvGeometry`` is depthwise: one input channel per group
    (``groups == C``, K = C * multiplier), which runs the direct stencils
    (``cpu_depthwise.py``, ``cuda_depthwise.py``) instead of a GEMM per group."""
    return geom.groups > 1 and geom.groups == geom.C


def channel_block(a, layout, lo, hi):
    """Channels [lo, hi) of a 4-d activation ``a`` in ``layout``, as a view (host or device)."""
    return a[:, lo:hi] if layout == "NCHW" else a[:, :, :, lo:hi]


def input_coord(o, t, stride, pad, dilation):
    """Input row (or column) read by output position ``o`` through filter tap ``t``."""
    return o * stride - pad + t * dilation


def output_coord(i, t, stride, pad, dilation, size):
    """Output position ``o`` whose tap ``t`` reads input position ``i``, or -1 if there is none.

    Inverse of :func:`input_coord`: ``i = o*stride - pad + t*dilation`` with ``0 <= o < size``.
    """
    num = i + pad - t * dilation
    if num < 0 or num % stride != 0:
        return -1
    o = num // stride
    if o >= size:
        return -1
    return o


def valid_range(t, stride, pad, dilation, size_in, size_out):
    """``(lo, hi)``: the output positions ``lo <= o < hi`` whose tap ``t`` lands inside the input.

    Outside that range the tap reads the zero padding. ``hi`` may be ``<= lo`` (no valid o).
    """
    off = t * dilation - pad                    # input position of output 0's tap t
    lo = 0 if off >= 0 else (-off + stride - 1) // stride
    hi = (size_in - 1 - off) // stride + 1 if size_in - 1 - off >= 0 else 0
    if hi > size_out:
        hi = size_out
    return lo, hi


def tap_spans(out, size, taps, stride, dilation, pad):
    """Per tap along one axis, the outputs ``[lo, hi)`` that read it inside the input (not
    the padding; ``hi <= lo``: none), by :func:`valid_range`."""
    return [valid_range(t, stride, pad, dilation, size, out) for t in range(taps)]


def _valid_pairs(out, size, k, stride, dilation, pad):
    """How many (output, tap) pairs along one axis read inside the input (not the padding)."""
    return sum(max(0, hi - lo) for lo, hi in tap_spans(out, size, k, stride, dilation, pad))


def tapwise_density(geom):
    """The share of im2col's products that tapwise computes (those not with the padding)."""
    total = geom.P * geom.Q * geom.R * geom.S
    if total == 0:
        return 1.0
    return (_valid_pairs(geom.P, geom.H, geom.R, geom.sh, geom.dh, geom.ph)
            * _valid_pairs(geom.Q, geom.W, geom.S, geom.sw, geom.dw, geom.pw) / total)
