"""CPU kernels of the unfused ops: relu, linear, max_pool2d, global_avg_pool2d, cross_entropy.

Every function here takes C-contiguous arrays of one float dtype (``ops/basic.py`` validates and
normalises) and returns new arrays. ``kernels/cuda/basic.py`` has the same functions, with the
same names and arguments, for device arrays: ``ops/basic.py`` picks one module per call.

Activations are handled as flat ``(n,)`` buffers addressed through *element strides*
``(sN, sC, sH, sW)``, so one compiled kernel serves both layouts (see ``ops.basic.PoolGeometry``);
the max pool's kernels (``cpu_pool.py``) work on rows of channels instead.

Scalar math shared with the CUDA kernels is written once, as plain Python, in
``kernels/basic_math.py`` and wrapped per target (``scalar.cpu_scalar`` here,
``scalar.cuda_scalar`` in ``kernels/cuda/basic.py``).

Notation: N batch, C channels, H/W input height/width, P/Q pooled height/width,
kh/kw window, sh/sw stride; F_in/F_out linear features; L classes.
"""
import numpy as np

from .. import scalar
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import blocks, launch, task_kernel
from . import cpu_pool as _pool, math as basic_math

_relu = scalar.cpu_scalar(scalar.relu)
_relu_grad = scalar.cpu_scalar(scalar.relu_grad)
_row_logsumexp = scalar.cpu_scalar(basic_math.row_logsumexp)
_xent_grad = scalar.cpu_scalar(basic_math.xent_grad)

ELEMENT_BLOCK = 1 << 14   # elements per task of the elementwise kernels


# --------------------------------------------------------------------------- relu

# Each task's blocks as views indexed from 0: the loops vectorise (indexed from t0 * block,
# Numba keeps a wraparound check on every access and they did not: machine A, 2 threads,
# relu_backward at (32, 14, 14, 512) 1.38 -> 0.64 ms, (32, 56, 56, 128) 16.0 -> 8.8, (16, 16,
# 16, 256) 0.44 -> 0.095; relu_forward changed alike, not timed), one view a block (a view's
# reference count is an atomic all threads share: never one an element or a row)

@task_kernel
def _relu_fwd(t0, t1, x, y):
    # x, y: (n,)
    for t in range(t0, t1):
        lo = t * ELEMENT_BLOCK
        hi = min(x.size, lo + ELEMENT_BLOCK)
        a, d = x[lo:hi], y[lo:hi]
        for i in range(hi - lo):
            d[i] = _relu(a[i])


@task_kernel
def _relu_bwd(t0, t1, gy, y, gx):
    # gy, y, gx: (n,); the mask comes from the output y
    for t in range(t0, t1):
        lo = t * ELEMENT_BLOCK
        hi = min(gy.size, lo + ELEMENT_BLOCK)
        a, b, d = gy[lo:hi], y[lo:hi], gx[lo:hi]
        for i in range(hi - lo):
            d[i] = _relu_grad(a[i], b[i])


# fwd :: x -> y
def relu_forward(x):
    y = np.empty_like(x)
    launch(_relu_fwd, blocks(x.size, ELEMENT_BLOCK), x.reshape(-1), y.reshape(-1),
           work=x.size)                                              # (n,) views
    return y


# bwd :: (y, gy) -> gx
def relu_backward(gy, y, out=None):
    """gx = gy * (y > 0) (NaN kept, the scalar ``relu_grad``); into ``out`` (C-contiguous, y's
    shape and dtype) where given: the grouped convs' backward gates g once this way, into a
    buffer of the output cache."""
    gx = np.empty_like(y) if out is None else out
    launch(_relu_bwd, blocks(gy.size, ELEMENT_BLOCK), gy.reshape(-1), y.reshape(-1),
           gx.reshape(-1), work=gy.size)                             # (n,) views
    return gx


# --------------------------------------------------------------------------- linear (BLAS)

# fwd :: (x, w, b) -> y
def linear_forward(x, w, b):
    """x (N, F_in), w (F_out, F_in), b (F_out,) or None -> y (N, F_out) = x @ w.T + b."""
    y = x @ w.T                                                      # (N, F_out)
    if b is not None:
        y += b
    return y


# bwd :: (x, w, gy) -> (gx, gw, gb)
def linear_backward(gy, x, w, need_gx, need_gw, need_gb):
    """gx = gy @ w (N, F_in), gw = gy.T @ x (F_out, F_in), gb = sum_n gy (F_out,)."""
    gx = gy @ w if need_gx else None
    gw = gy.T @ x if need_gw else None                               # gy.T: (F_out, N)
    gb = gy.sum(axis=0, dtype=np.float64).astype(gy.dtype) if need_gb else None
    return gx, gw, gb


# --------------------------------------------------------------------------- max_pool2d
# Forward writes y and, in the same pass, the window argmax: the row-major tap t = r*kw + s of
# each window's first maximum, in the smallest unsigned dtype holding kh*kw - 1 (uint8 up to
# 16x16 windows; ``PoolGeometry.argmax_dtype``). Backward reads only the argmax, never x.
# The kernels: ``cpu_pool.py``.

# fwd :: (x, geometry) -> (y, argmax): cpu_pool's kernels (padding, vectorised over channels)
def max_pool2d_forward(x, g):
    y = np.empty(g.y_shape, x.dtype)
    argmax = np.empty(g.y_shape, g.argmax_dtype)
    HW, PQ = g.H * g.W, g.P * g.Q
    if y.size:
        rows = (_rows(x, HW, g), _rows(y, PQ, g), _rows(argmax, PQ, g), _pool_geo(g))
        if g.layout == "NHWC":
            launch(_pool.max_pool_fwd_nhwc, g.N, *rows, work=x.size)
        else:
            launch(_pool.max_pool_fwd_nchw, g.N * -(-g.C // _pool.LANES), *rows, work=x.size)
    return y, argmax


# bwd :: (argmax, gy, geometry) -> gx
def max_pool2d_backward(gy, argmax, g, dtype):
    gx = _out.empty(g.x_shape, dtype)                     # zeroed by the kernels, in cache
    HW, PQ = g.H * g.W, g.P * g.Q
    if gy.size:                                           # (else gx is empty too)
        args = (_rows(gy.astype(dtype, copy=False), PQ, g), _rows(argmax, PQ, g),
                _rows(gx, HW, g), _pool_geo(g))
        if g.layout == "NHWC":
            launch(_pool.max_pool_bwd_nhwc, g.N, *args, work=gx.size)
        else:
            launch(_pool.max_pool_bwd_nchw, g.N * -(-g.C // _pool.LANES), *args,
                   work=gx.size)
    return gx


def _rows(a, n, g):
    """``a`` (x or gx: n = H*W; y, argmax or gy: n = P*Q) as cpu_pool's rows: (N, n, C) NHWC,
    (N, C, n) NCHW."""
    return a.reshape(g.N, n, g.C) if g.layout == "NHWC" else a.reshape(g.N, g.C, n)


def _pool_geo(g):
    """cpu_pool's geometry tuple: (H, W, P, Q, kh, kw, sh, sw, ph, pw)."""
    return tuple(int(v) for v in (g.H, g.W, g.P, g.Q, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw))


# --------------------------------------------------------------------------- global_avg_pool2d

@task_kernel
def _gap_fwd(t0, t1, x, y, N, C, H, W, xs_n, xs_c, xs_h, xs_w):
    # x: (N*C*H*W,) flat in its layout, y: (N*C,) = (N, C) row-major
    inv = 1.0 / (H * W)
    for nc in range(t0, t1):
        x0 = (nc // C) * xs_n + (nc % C) * xs_c
        acc = 0.0                                                    # float64 accumulator
        for h in range(H):
            for w in range(W):
                acc += x[x0 + h * xs_h + w * xs_w]
        y[nc] = acc * inv


@task_kernel
def _gap_bwd(t0, t1, gy, gx, N, C, H, W, xs_n, xs_c, xs_h, xs_w):
    # gy: (N*C,), gx: (N*C*H*W,) flat in its layout
    inv = 1.0 / (H * W)
    for nc in range(t0, t1):
        x0 = (nc // C) * xs_n + (nc % C) * xs_c
        g = gy[nc] * inv
        for h in range(H):
            for w in range(W):
                gx[x0 + h * xs_h + w * xs_w] = g


@task_kernel
def _gap_fwd_hwc(t0, t1, x, y):
    # x: (N, H*W, C) (NHWC), y: (N, C); task = image. The same float64 sums, in the same
    # order (h, w), as _gap_fwd's, with the channels innermost: whole rows read, not a stride
    N, HW, C = x.shape
    inv = 1.0 / HW
    acc = np.empty(C)                                            # float64
    for n in range(t0, t1):
        acc[:] = 0.0
        for i in range(HW):
            row = x[n, i]                                            # (C,)
            for c in range(C):
                acc[c] += row[c]
        dst = y[n]
        for c in range(C):
            dst[c] = acc[c] * inv


@task_kernel
def _gap_bwd_hwc(t0, t1, gy, gx):
    # gy: (N, C), gx: (N, H*W, C) (NHWC); task = image; gx = gy * (1 / (H*W)) as _gap_bwd
    N, HW, C = gx.shape
    inv = 1.0 / HW
    for n in range(t0, t1):
        g = gx[n, 0]                                                 # (C,): row 0, then copies
        src = gy[n]
        for c in range(C):
            g[c] = src[c] * inv
        for i in range(1, HW):
            row = gx[n, i]
            for c in range(C):
                row[c] = g[c]


# fwd :: (x, geometry) -> y (N, C)
def global_avg_pool2d_forward(x, g):
    y = np.empty((g.N, g.C), x.dtype)
    if g.layout == "NHWC":
        launch(_gap_fwd_hwc, g.N, x.reshape(g.N, g.H * g.W, g.C), y, work=x.size)
        return y
    launch(_gap_fwd, g.N * g.C, x.reshape(-1), y.reshape(-1), g.N, g.C, g.H, g.W,
           *g.x_strides, work=x.size)
    return y


# bwd :: (gy (N, C), geometry) -> gx
def global_avg_pool2d_backward(gy, g, dtype):
    gx = np.empty(g.x_shape, dtype)
    if g.layout == "NHWC":
        launch(_gap_bwd_hwc, g.N, gy.reshape(g.N, g.C), gx.reshape(g.N, g.H * g.W, g.C),
               work=gx.size)
        return gx
    launch(_gap_bwd, g.N * g.C, gy.reshape(-1), gx.reshape(-1), g.N, g.C, g.H, g.W,
           *g.x_strides, work=gx.size)
    return gx


# --------------------------------------------------------------------------- cross_entropy

@task_kernel
def _xent_fwd(t0, t1, logits, labels, nll, lse):
    # logits: (N, L), labels: (N,) int, nll, lse: (N,) float64
    N, L = logits.shape
    for n in range(t0, t1):
        lse[n] = _row_logsumexp(logits, n, L)
        nll[n] = lse[n] - logits[n, labels[n]]


@task_kernel
def _xent_bwd(t0, t1, logits, labels, lse, scale, glogits):
    # logits, glogits: (N, L), labels: (N,) int, lse: (N,) float64; scale = gy / N
    N, L = logits.shape
    for n in range(t0, t1):
        for j in range(L):
            glogits[n, j] = _xent_grad(logits[n, j], lse[n], j == labels[n], scale)


# fwd :: (logits, labels) -> (loss, residuals=(lse,))
def cross_entropy_forward(logits, labels):
    """0-d mean over rows of lse - logit[label], and the row log-sum-exps (N,) float64."""
    N = logits.shape[0]
    nll, lse = np.empty(N), np.empty(N)                              # (N,) float64
    launch(_xent_fwd, N, logits, labels, nll, lse, work=logits.size)
    return np.asarray(nll.sum() / N, dtype=logits.dtype), lse


# bwd :: (logits, labels, lse, gy) -> glogits
def cross_entropy_backward(gy, logits, labels, lse):
    glogits = np.empty_like(logits)                                  # (N, L)
    launch(_xent_bwd, logits.shape[0], logits, labels, lse, float(gy) / logits.shape[0],
           glogits, work=logits.size)
    return glogits
