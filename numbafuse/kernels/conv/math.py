"""Index math of a convolution, shared by the CPU and the CUDA conv kernels.

Plain Python (no decorators): ``kernels/conv/cpu.py`` wraps these with ``cpu_scalar`` and
``kernels/conv/cuda.py`` with ``cuda_scalar``, so both backends agree on every index by
construction. A helper here cannot call another (the plain function is not compilable from a
kernel), so the composite offsets below spell the one-line formulas out again, each marked
with the helper it repeats.

A convolution's geometry travels to the kernels as one tuple of ints, ``geo`` (see
``GEO_FIELDS``); ``nhwc`` is 1 for the NHWC layout, 0 for NCHW. Notation: N batch, C input
channels, H/W input size, K filters, R/S filter size, P/Q output size, sh/sw stride, ph/pw
top/left padding, dh/dw dilation.
"""

GEO_FIELDS = ("N", "C", "H", "W", "K", "R", "S", "P", "Q", "sh", "sw", "ph", "pw", "dh", "dw",
              "nhwc")
GEO_LEN = len(GEO_FIELDS)


def geo_tuple(geom):
    """The ``GEO_FIELDS`` tuple of a ``validate.ConvGeometry`` (host side)."""
    return tuple(int(geom.layout == "NHWC") if f == "nhwc" else int(getattr(geom, f))
                 for f in GEO_FIELDS)


def act_offset(n, c, h, w, C, H, W, nhwc):
    """Flat offset of element (n, c, h, w) of a contiguous activation of C channels, H x W."""
    if nhwc:
        return ((n * H + h) * W + w) * C + c
    return ((n * C + c) * H + h) * W + w


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


def cols_offset(m, crs, geo):
    """Flat offset in x of im2col element ``cols[m, crs]``, or -1 where it is zero padding.

    ``m = (n*P + p)*Q + q`` indexes output pixels, ``crs = (c*R + r)*S + s`` filter taps in
    the order of w's (C, R, S) dimensions.
    """
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    q = m % Q
    p = (m // Q) % P
    n = m // (P * Q)
    s = crs % S
    r = (crs // S) % R
    c = crs // (R * S)
    h = p * sh - ph + r * dh                              # input_coord(p, r, sh, ph, dh)
    w = q * sw - pw + s * dw                              # input_coord(q, s, sw, pw, dw)
    if h < 0 or h >= H or w < 0 or w >= W:
        return -1
    if nhwc:                                              # act_offset(n, c, h, w, ...)
        return ((n * H + h) * W + w) * C + c
    return ((n * C + c) * H + h) * W + w


def transposed_cols_offset(mx, rsk, geo):
    """Flat offset in y (or gy) of element ``[mx, rsk]`` of the transposed problem, or -1.

    dx (N*H*W, C) = G (N*H*W, R*S*K) @ W' (R*S*K, C): ``mx = (n*H + h)*W + w`` indexes input
    pixels, ``rsk = (r*S + s)*K + k`` a tap and a filter; G holds the gradient at the output
    pixel whose tap (r, s) reads (h, w), or zero if no output pixel does.
    """
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    w = mx % W
    h = (mx // W) % H
    n = mx // (H * W)
    k = rsk % K
    s = (rsk // K) % S
    r = rsk // (K * S)
    hp = h + ph - r * dh                                  # output_coord(h, r, sh, ph, dh, P)
    wq = w + pw - s * dw                                  # output_coord(w, s, sw, pw, dw, Q)
    if hp < 0 or wq < 0 or hp % sh != 0 or wq % sw != 0:
        return -1
    p = hp // sh
    q = wq // sw
    if p >= P or q >= Q:
        return -1
    if nhwc:                                              # act_offset(n, k, p, q, K, P, Q, ...)
        return ((n * P + p) * Q + q) * K + k
    return ((n * K + k) * P + p) * Q + q


def out_offset(m, k, K, PQ, nhwc):
    """Flat offset in y of output pixel ``m = n*PQ + pq``, channel ``k``."""
    if nhwc:
        return m * K + k
    return ((m // PQ) * K + k) * PQ + m % PQ
