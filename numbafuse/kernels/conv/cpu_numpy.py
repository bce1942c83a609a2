"""The CPU conv passes in plain NumPy: what a first call runs while Numba compiles.

``cpu/first_calls.py`` runs these while the compiled kernels of a pass compile in the
background (nothing here compiles anything). Same contract as ``cpu.py``/``cpu_grouped.py``'s
``conv_forward`` and ``conv_backward`` (``kernels.interfaces.ConvKernels``), any groups, both
layouts, in x's dtype: one GEMM per filter tap (and group) through NumPy's BLAS, on NHWC views
(``matmul`` of a strided tap view copies it; no im2col matrix of all taps is built). Slower than
the compiled kernels (no fused gather, one thread's packing) but exact to the same rounding
order of a float GEMM; ``tests/test_first_calls.py`` checks it against the float64 reference.

Notation: N batch, C/K input/output channels, H/W input, P/Q output, R/S filter; G groups of
Cg = C/G inputs and Kg = K/G outputs. Padding: x sits at (ph, pw) in a zero array tall and wide
enough for every tap's last read (the bottom/right padding is what lies past x).
"""
import numpy as np


def _nhwc(a, layout):
    """``a`` as an (N, H, W, C) view."""
    return a if layout == "NHWC" else a.transpose(0, 2, 3, 1)


def _in_layout(a_nhwc, layout):
    """A contiguous array in ``layout`` from an (N, H, W, C) one."""
    return np.ascontiguousarray(a_nhwc if layout == "NHWC" else a_nhwc.transpose(0, 3, 1, 2))


def _padded_zeros(geom, dtype):
    """An (N, Hp, Wp, C) zero array: x's rows and columns plus padding, enough for the last
    tap's last read."""
    Hp = max(geom.ph + geom.H, (geom.P - 1) * geom.sh + (geom.R - 1) * geom.dh + 1)
    Wp = max(geom.pw + geom.W, (geom.Q - 1) * geom.sw + (geom.S - 1) * geom.dw + 1)
    return np.zeros((geom.N, Hp, Wp, geom.C), dtype)


def _inside(a, geom):
    """The (N, H, W, C) view of padded ``a`` where x lies."""
    return a[:, geom.ph:geom.ph + geom.H, geom.pw:geom.pw + geom.W]


def _padded(x, geom):
    """x as NHWC in a zero array with its padding (:func:`_padded_zeros`)."""
    xp = _padded_zeros(geom, x.dtype)
    _inside(xp, geom)[...] = _nhwc(x, geom.layout)
    return xp


def _tap(a, geom, r, s):
    """The (N, P, Q, C) view of padded NHWC ``a`` that tap (r, s) reads for each output."""
    h0, w0 = r * geom.dh, s * geom.dw
    return a[:, h0:h0 + (geom.P - 1) * geom.sh + 1:geom.sh,
             w0:w0 + (geom.Q - 1) * geom.sw + 1:geom.sw]


def _grouped(a, groups):
    """(M, G*c) -> (G, M, c): a tap's rows, one matrix per group."""
    return a.reshape(a.shape[0], groups, -1).transpose(1, 0, 2)


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w, groups) + b?)``."""
    N, G, M = geom.N, geom.groups, geom.N * geom.P * geom.Q
    xp = _padded(x, geom)                                                  # (N, Hp, Wp, C)
    wg = w.reshape(G, geom.K // G, geom.C // G, geom.R, geom.S)            # (G, Kg, Cg, R, S)
    y = np.zeros((G, M, geom.K // G), x.dtype)                             # (G, M, Kg)
    for r in range(geom.R):
        for s in range(geom.S):
            tap = _grouped(_tap(xp, geom, r, s).reshape(M, geom.C), G)    # (G, M, Cg)
            y += tap @ wg[:, :, :, r, s].transpose(0, 2, 1)                # (G, Cg, Kg)
    y = y.transpose(1, 0, 2).reshape(N, geom.P, geom.Q, geom.K)           # (N, P, Q, K)
    if b is not None:
        y += b
    if relu:
        np.maximum(y, 0, out=y)
    return _in_layout(y, geom.layout)


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``relu?(conv(x, w, groups) + b)``; ``y`` given: g = gy * (y > 0);
    only ``need``'s are computed (the others None). db sums in float64."""
    need_dx, need_dw, need_db = (bool(v) for v in need)
    N, G, M = geom.N, geom.groups, geom.N * geom.P * geom.Q
    g = _nhwc(gy, geom.layout)                                             # (N, P, Q, K)
    if y is not None:
        g = np.where(_nhwc(y, geom.layout) > 0, g, np.zeros((), gy.dtype))
    g = _grouped(np.ascontiguousarray(g).reshape(M, geom.K), G)           # (G, M, Kg)
    db = (g.sum(axis=1, dtype=np.float64).reshape(geom.K).astype(gy.dtype)
          if need_db else None)
    dw = dx = None
    wg = w.reshape(G, geom.K // G, geom.C // G, geom.R, geom.S)            # (G, Kg, Cg, R, S)
    if need_dw:
        xp = _padded(x, geom)
        dw = np.empty_like(wg)
        for r in range(geom.R):
            for s in range(geom.S):
                tap = _grouped(_tap(xp, geom, r, s).reshape(M, geom.C), G)  # (G, M, Cg)
                dw[:, :, :, r, s] = g.transpose(0, 2, 1) @ tap              # (G, Kg, Cg)
        dw = dw.reshape(geom.w_shape)
    if need_dx:
        dxp = _padded_zeros(geom, gy.dtype)
        for r in range(geom.R):
            for s in range(geom.S):
                part = g @ wg[:, :, :, r, s]                                # (G, M, Cg)
                _tap(dxp, geom, r, s)[...] += part.transpose(1, 0, 2).reshape(
                    N, geom.P, geom.Q, geom.C)
        dx = _in_layout(_inside(dxp, geom), geom.layout)
    return dx, dw, db
