"""numba.cuda kernels of the unfused ops: relu, linear, max_pool2d, global_avg_pool2d,
cross_entropy.

The host-side functions at the bottom have the same names and arguments as those of
``kernels/cpu/basic.py``; they take C-contiguous device arrays of one float dtype and return
device arrays (no host round trip, except the one-integer label check of cross_entropy).

Activations are flat ``(n,)`` buffers addressed through element strides ``(sN, sC, sH, sW)``,
so one compiled kernel serves both layouts. Every reduction is deterministic: each output is
summed by one thread in a fixed order, or by one block's shared-memory tree; there are no
float atomics. Launch sizes come from ``config`` at launch time; shared-array shapes from the
compile-time constants ``BLOCK`` and ``TILE``.

Notation: N batch, C channels, H/W input height/width, P/Q pooled height/width,
kh/kw window, sh/sw stride; F_in/F_out linear features; L classes.
"""
import math
import threading

import numpy as np
from numba import float64, int32, int64, types, uint8, uint32

from ...cuda import capture_in_progress, empty, flat, numba_cuda as cuda, to_device

from ..cuda import config
from ..cuda.launch import launch
from .. import scalar
from ..cuda.reduce import block_sum, placeholder
from . import math as basic_math

BLOCK = config.BLOCK
TILE = config.TILE


@cuda.jit(device=True, inline=True)
def _div(a, b):
    """a // b for 0 <= a, b < 2**32 as an inline unsigned 32-bit division (Python-semantics
    int64 ``//`` is a subroutine call per element; ``config.grid_1d`` refuses 2**32 items)."""
    return int64(uint32(a) // uint32(b))


@cuda.jit(device=True, inline=True)
def _mod(a, b):
    """a % b for 0 <= a, b < 2**32 (see ``_div``)."""
    return int64(uint32(a) % uint32(b))

_relu = scalar.cuda_scalar(scalar.relu)
_relu_grad = scalar.cuda_scalar(scalar.relu_grad)
_first_max_tap = scalar.cuda_scalar(basic_math.first_max_tap)
_row_logsumexp = scalar.cuda_scalar(basic_math.row_logsumexp)
_xent_grad = scalar.cuda_scalar(basic_math.xent_grad)


# --------------------------------------------------------------------------- relu

@cuda.jit(cache=True)
def _relu_fwd(x, y):
    # x, y: (n,)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        y[i] = _relu(x[i])


@cuda.jit(cache=True)
def _relu_bwd(gy, y, gx):
    # gy, y, gx: (n,); the mask comes from the output y
    for i in range(cuda.grid(1), gy.size, cuda.gridsize(1)):
        gx[i] = _relu_grad(gy[i], y[i])


# --------------------------------------------------------------------------- linear

@cuda.jit(device=True, inline=True)
def _matmul_tile(a, b, bias, out, trans_a, trans_b, has_bias, tile, a_tile, b_tile):
    # tile ``tile`` (row-major over TILE x TILE tiles) of out (M, Nc) = op(a) @ op(b)
    # (+ bias[None, :]); op(a): (M, Kd), op(b): (Kd, Nc); a: (Kd, M) if trans_a else (M, Kd);
    # b: (Nc, Kd) if trans_b else (Kd, Nc); bias: (Nc,). Run by a whole (TILE, TILE) block
    # (it synchronises); a_tile, b_tile: its shared (TILE, TILE) float64 buffers. The
    # accumulator is float64, the k order fixed
    ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
    M, Nc = out.shape
    Kd = a.shape[0] if trans_a else a.shape[1]
    tiles_n = (Nc + TILE - 1) // TILE
    i = _div(tile, tiles_n) * TILE + ty                              # row of out
    j = _mod(tile, tiles_n) * TILE + tx                              # column of out
    acc = 0.0
    for k0 in range(0, Kd, TILE):
        ka, kb = k0 + tx, k0 + ty
        if i < M and ka < Kd:
            a_tile[ty, tx] = a[ka, i] if trans_a else a[i, ka]
        else:
            a_tile[ty, tx] = 0.0
        if j < Nc and kb < Kd:
            b_tile[ty, tx] = b[j, kb] if trans_b else b[kb, j]
        else:
            b_tile[ty, tx] = 0.0
        cuda.syncthreads()  # both tiles are loaded before anyone multiplies
        for kk in range(TILE):
            acc += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()  # everyone is done reading before the next load overwrites
    if i < M and j < Nc:
        if has_bias:
            acc += bias[j]
        out[i, j] = acc


def _tiles(shape):
    """TILE x TILE tiles of a 2-d output of ``shape``."""
    return -(-shape[0] // TILE) * -(-shape[1] // TILE)


@cuda.jit(cache=True)
def _matmul_tiled(a, b, bias, out, trans_a, trans_b, has_bias):
    # out (M, Nc) = op(a) @ op(b) (+ bias[None, :]) (_matmul_tile): a (TILE, TILE) block
    # computes one tile per iteration of a grid-stride loop over tiles; loop bounds depend on
    # the block only, so all its threads reach every syncthreads
    a_tile = cuda.shared.array((TILE, TILE), float64)
    b_tile = cuda.shared.array((TILE, TILE), float64)
    M, Nc = out.shape
    n_tiles = ((M + TILE - 1) // TILE) * ((Nc + TILE - 1) // TILE)
    for tile in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
        _matmul_tile(a, b, bias, out, trans_a, trans_b, has_bias, tile, a_tile, b_tile)


@cuda.jit(cache=True)
def _linear_bwd(gy, x, w, gx, gw, gb, parts):
    # the linear layer's three gradients in one launch: gx (N, F_in) = gy @ w, gw (F_out,
    # F_in) = gy.T @ x, gb (F_out,) = sum_n gy, as work items of one grid-stride loop:
    # parts = (gx's tiles, gw's tiles, gb's chunks of TILE*TILE columns), a part 0 when its
    # gradient is not wanted (its array then a placeholder). Each item is the whole block's
    # (block-uniform bounds: every syncthreads is met); each output is summed as the separate
    # kernels summed it (_matmul_tile's order; gb one thread a column, rows in order, float64)
    a_tile = cuda.shared.array((TILE, TILE), float64)
    b_tile = cuda.shared.array((TILE, TILE), float64)
    n_gx, n_gw, n_gb = parts
    for item in range(cuda.blockIdx.x, n_gx + n_gw + n_gb, cuda.gridDim.x):
        if item < n_gx:
            _matmul_tile(gy, w, gb, gx, False, False, False, item, a_tile, b_tile)
        elif item < n_gx + n_gw:
            _matmul_tile(gy, x, gb, gw, True, False, False, item - n_gx, a_tile, b_tile)
        else:
            j = (item - n_gx - n_gw) * (TILE * TILE) + cuda.threadIdx.y * TILE \
                + cuda.threadIdx.x
            if j < gb.shape[0]:
                acc = float64(0.0)           # (explicit: the simulator's 0.0 + float32 is
                for i in range(gy.shape[0]):  # float32 under NumPy 2's promotion rules)
                    acc += float64(gy[i, j])
                gb[j] = acc


def _matmul(a, b, bias, trans_a, trans_b, shape):
    """``op(a) @ op(b) (+ bias)`` into a new (M, Nc) device array."""
    out = empty(shape, a.dtype)
    if out.size == 0:
        return out
    blocks = max(1, min(config.max_blocks, _tiles(shape)))
    has_bias = bias is not None
    bias = bias if has_bias else flat(out)  # never read: a placeholder of the type
    launch(_matmul_tiled, blocks, (TILE, TILE), a, b, bias, out, int(trans_a), int(trans_b),
                                        int(has_bias))
    return out


# fwd :: (x, w, b) -> y
def linear_forward(x, w, b):
    """x (N, F_in), w (F_out, F_in), b (F_out,) or None -> y (N, F_out) = x @ w.T + b."""
    return _matmul(x, w, b, False, True, (x.shape[0], w.shape[0]))


# bwd :: (x, w, gy) -> (gx, gw, gb)
def linear_backward(gy, x, w, need_gx, need_gw, need_gb):
    """gx = gy @ w (N, F_in), gw = gy.T @ x (F_out, F_in), gb = sum_n gy (F_out,): the wanted
    ones in one launch (``_linear_bwd``)."""
    dtype = gy.dtype
    gx = empty((x.shape[0], w.shape[1]), dtype) if need_gx else None
    gw = empty((w.shape[0], w.shape[1]), dtype) if need_gw else None
    gb = empty(w.shape[0], dtype) if need_gb else None
    parts = (_tiles(gx.shape) if need_gx else 0, _tiles(gw.shape) if need_gw else 0,
             -(-w.shape[0] // (TILE * TILE)) if need_gb else 0)
    if sum(parts):
        blocks = max(1, min(config.max_blocks, sum(parts)))
        launch(_linear_bwd, blocks, (TILE, TILE), gy, x, w,
               gx if need_gx else placeholder(dtype, 2),
               gw if need_gw else placeholder(dtype, 2),
               gb if need_gb else placeholder(dtype, 1), parts)
    return gx, gw, gb


# --------------------------------------------------------------------------- max_pool2d
# Forward writes y and the window argmax (row-major tap t = r*kw + s of the first maximum, uint8
# up to 16x16 windows) in one pass; backward reads only the argmax (see cpu/basic.py).
# Threads walk y (and gx) in memory order, so neighbouring threads touch neighbouring elements
# in both layouts: channels innermost when the channel stride is 1 (NHWC).

@cuda.jit(device=True, inline=True)
def _coords(e, C, H, W, channels_last):
    """(n, c, h, w) of element ``e`` of a C-contiguous (N, C, H, W) / (N, H, W, C) array."""
    if channels_last:
        return (_div(e, H * W * C), _mod(e, C), _mod(_div(e, W * C), H),
                _mod(_div(e, C), W))
    return _div(e, C * H * W), _mod(_div(e, H * W), C), _mod(_div(e, W), H), _mod(e, W)


@cuda.jit(cache=True)
def _max_pool_fwd(x, y, argmax, pool, xs, channels_last):
    # x: (N*C*H*W,), y, argmax: (N*C*P*Q,) flat in their layout; pool = (C, P, Q, kh, kw,
    # sh, sw) (``_pool``); xs = (xs_n, xs_c, xs_h, xs_w): element strides of x.
    # One thread per output o, which is y's (and argmax's) flat index.
    C, P, Q, kh, kw, sh, sw = pool
    xs_n, xs_c, xs_h, xs_w = xs
    for o in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        n, c, p, q = _coords(o, C, P, Q, channels_last)
        start = n * xs_n + c * xs_c + p * sh * xs_h + q * sw * xs_w
        t = _first_max_tap(x, start, kh, kw, xs_h, xs_w)
        y[o] = x[start + _div(t, kw) * xs_h + _mod(t, kw) * xs_w]
        argmax[o] = t


@cuda.jit(cache=True)
def _max_pool_bwd(gy, argmax, gx, pool, H, W, ys, channels_last):
    # gy, argmax: (N*C*P*Q,), gx: (N*C*H*W,) flat; pool = (C, P, Q, kh, kw, sh, sw)
    # (``_pool``); ys = (ys_n, ys_c, ys_h, ys_w): element strides of gy/argmax. A gather,
    # one thread per gx element e: it visits the windows covering it and adds gy of those
    # whose argmax tap is e's own. No atomics; overlapping windows add in a fixed order.
    C, P, Q, kh, kw, sh, sw = pool
    ys_n, ys_c, ys_h, ys_w = ys
    for e in range(cuda.grid(1), gx.size, cuda.gridsize(1)):
        n, c, h, w = _coords(e, C, H, W, channels_last)
        p_lo = 0 if h < kh else _div(h - kh + sh, sh)                # first window row covering h
        q_lo = 0 if w < kw else _div(w - kw + sw, sw)
        p_hi = min(P - 1, _div(h, sh))
        q_hi = min(Q - 1, _div(w, sw))
        acc = float64(0.0)     # (float64 in the simulator too: see _gap_fwd)
        for p in range(p_lo, p_hi + 1):
            for q in range(q_lo, q_hi + 1):
                o = n * ys_n + c * ys_c + p * ys_h + q * ys_w
                if argmax[o] == (h - p * sh) * kw + (w - q * sw):   # e is this window's max
                    acc += float64(gy[o])
        gx[e] = acc


def _pool(g):
    """The max-pool kernels' ``pool`` tuple of a ``PoolGeometry``: (C, P, Q, kh, kw, sh, sw)."""
    return (g.C, g.P, g.Q, g.kh, g.kw, g.sh, g.sw)


# fwd :: (x, geometry) -> (y, argmax)
def max_pool2d_forward(x, g):
    y = empty(g.y_shape, x.dtype)
    argmax = empty(g.y_shape, g.argmax_dtype)
    if y.size:
        blocks, threads = config.grid_1d(y.size)
        launch(_max_pool_fwd, blocks, threads, flat(x), flat(y), flat(argmax), _pool(g),
               g.x_strides, int(g.layout == "NHWC"))
    return y, argmax


# bwd :: (argmax, gy, geometry) -> gx
def max_pool2d_backward(gy, argmax, g, dtype):
    gx = empty(g.x_shape, dtype)
    if gx.size:
        blocks, threads = config.grid_1d(gx.size)
        launch(_max_pool_bwd, blocks, threads, flat(gy), flat(argmax), flat(gx), _pool(g),
               g.H, g.W, g.y_strides, int(g.layout == "NHWC"))
    return gx


# --------------------------------------------------------------------------- global_avg_pool2d

@cuda.jit(cache=True)
def _gap_fwd(x, y, C, H, W, xs_n, xs_c, xs_h, xs_w):
    # x: (N*C*H*W,) flat in its layout, y: (N*C,) = (N, C); one thread per output sums its
    # H*W values in a fixed order (float64)
    inv = 1.0 / (H * W)
    for nc in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        x0 = _div(nc, C) * xs_n + _mod(nc, C) * xs_c
        acc = float64(0.0)     # (numba types 0.0 + float32 as float64; the simulator, under
        for h in range(H):     # NumPy 2's promotion, as float32: made explicit for both)
            for w in range(W):
                acc += float64(x[x0 + h * xs_h + w * xs_w])
        y[nc] = acc * inv


@cuda.jit(cache=True)
def _gap_bwd(gy, gx, C, H, W, xs_n, xs_c, xs_h, xs_w):
    # gy: (N*C,), gx: (N*C*H*W,) flat in its layout; one thread per gx element
    inv = 1.0 / (H * W)
    for e in range(cuda.grid(1), gx.size, cuda.gridsize(1)):
        w = _mod(e, W)
        h = _mod(_div(e, W), H)
        c = _mod(_div(e, H * W), C)
        n = _div(e, C * H * W)
        gx[n * xs_n + c * xs_c + h * xs_h + w * xs_w] = gy[n * C + c] * inv


# fwd :: (x, geometry) -> y (N, C)
def global_avg_pool2d_forward(x, g):
    y = empty((g.N, g.C), x.dtype)
    blocks, threads = config.grid_1d(y.size)
    launch(_gap_fwd, blocks, threads, flat(x), flat(y), g.C, g.H, g.W,
                              *g.x_strides)
    return y


# bwd :: (gy (N, C), geometry) -> gx
def global_avg_pool2d_backward(gy, g, dtype):
    gx = empty(g.x_shape, dtype)
    blocks, threads = config.grid_1d(gx.size)
    launch(_gap_bwd, blocks, threads, flat(gy), flat(gx), g.C, g.H, g.W,
                              *g.x_strides)
    return gx


# --------------------------------------------------------------------------- cross_entropy

@cuda.jit(device=True, inline=True)
def _row_nll(logits, labels, n, L, lse):
    # row n's loss lse[n] - logits[n, label], lse[n] stored on the way; NaN for a label
    # outside [0, L) (refused on the host, except inside a graph)
    lse[n] = _row_logsumexp(logits, n, L)
    label = labels[n]
    if label < 0 or label >= L:
        return math.nan
    return lse[n] - logits[n, label]


@cuda.jit(cache=True)
def _xent_rows(logits, labels, nll, lse):
    # logits: (N, L), labels: (N,) int, nll, lse: (N,) float64; one thread per row
    N, L = logits.shape
    for n in range(cuda.grid(1), N, cuda.gridsize(1)):
        nll[n] = _row_nll(logits, labels, n, L, lse)


@cuda.jit(cache=True)
def _xent_one_block(logits, labels, scale, lse, out):
    # _xent_rows and _mean_one_block in one block (a small batch): thread t takes rows t,
    # t + blockDim.x, ... and sums their losses in that order, the order in which
    # _mean_one_block sums them, so out[0] is the same bits (tests/test_basic_ops.py)
    buf = cuda.shared.array(BLOCK, float64)
    N, L = logits.shape
    acc = 0.0
    for n in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        acc += _row_nll(logits, labels, n, L, lse)
    total = block_sum(buf, acc)
    if cuda.threadIdx.x == 0:
        out[0] = total * scale


@cuda.jit(cache=True)
def _mean_one_block(values, scale, out):
    # values: (n,) float64, out: (1,); out[0] = scale * sum(values). One block: each thread
    # sums a strided share in order, then a shared-memory tree (blockDim.x a power of two)
    buf = cuda.shared.array(BLOCK, float64)
    t = cuda.threadIdx.x
    acc = 0.0
    for i in range(t, values.size, cuda.blockDim.x):
        acc += values[i]
    total = block_sum(buf, acc)
    if t == 0:
        out[0] = total * scale


@cuda.jit(cache=True)
def _xent_bwd(logits, labels, lse, gy, scale, glogits):
    # logits, glogits: (N, L), labels: (N,) int, lse: (N,) float64, gy: (1,) device scalar;
    # glogits = gy * scale * (softmax - onehot), scale = 1/N; one thread per element
    N, L = logits.shape
    for e in range(cuda.grid(1), N * L, cuda.gridsize(1)):
        n, j = _div(e, L), _mod(e, L)
        glogits[n, j] = _xent_grad(logits[n, j], lse[n], j == labels[n], gy[0] * scale)


@cuda.jit(cache=True)
def _flag_bad_labels(labels, L, flag):
    # labels: (N,) int, flag: (1,) int32 zeroed; any label outside [0, L) sets flag[0] = 1
    # (every writer writes the same value, so the race is benign)
    for n in range(cuda.grid(1), labels.size, cuda.gridsize(1)):
        if labels[n] < 0 or labels[n] >= L:
            flag[0] = 1


_FLAGS = threading.local()     # .flag: this thread's (1,) int32 device flag, zero between calls


def count_bad_labels(labels, L):
    """1 if a label falls outside [0, L), else 0: the one integer read back to the host, since
    refusing bad labels with a ValueError needs a host-side answer. Inside a CUDA graph capture
    (no host reads there) 0 without looking: ``_xent_rows`` then gives such a row a NaN loss.

    The flag is made once per thread and left zero (set back after a bad batch), so a call is
    one launch and one 4-byte read: no pool request and no host-to-device copy (a synchronous
    one) per training step."""
    if capture_in_progress() is not None:
        return 0
    flag = getattr(_FLAGS, "flag", None)
    if flag is None:
        flag = _FLAGS.flag = to_device(np.zeros(1, np.int32))
    blocks, threads = config.grid_1d(labels.size)
    launch(_flag_bad_labels, blocks, threads, labels, L, flag)
    bad = int(flag.copy_to_host()[0])
    if bad:
        flag.copy_to_device(np.zeros(1, np.int32))
    return bad


# fwd :: (logits, labels) -> (loss, residuals=(lse,))
def cross_entropy_forward(logits, labels):
    """0-d mean over rows of lse - logit[label], and the row log-sum-exps (N,) float64."""
    N = logits.shape[0]
    lse, loss = empty(N, np.float64), empty(1, logits.dtype)
    if logits.size <= config.xent_one_block_elements:       # one launch, no (N,) losses
        launch(_xent_one_block, 1, config.block_threads(), logits, labels, 1.0 / N, lse,
               loss)
        return loss.reshape(()), lse
    nll = empty(N, np.float64)
    blocks, threads = config.grid_1d(N)
    launch(_xent_rows, blocks, threads, logits, labels, nll, lse)
    launch(_mean_one_block, 1, config.block_threads(), nll, 1.0 / N, loss)
    return loss.reshape(()), lse


# bwd :: (logits, labels, lse, gy) -> glogits
def cross_entropy_backward(gy, logits, labels, lse):
    glogits = empty(logits.shape, logits.dtype)         # (N, L)
    blocks, threads = config.grid_1d(glogits.size)
    launch(_xent_bwd, blocks, threads, logits, labels, lse, gy.reshape(1), 1.0 / logits.shape[0],
                               glogits)
    return glogits


# fwd :: x -> y
def relu_forward(x):
    y = empty(x.shape, x.dtype)
    if y.size:
        blocks, threads = config.grid_1d(y.size)
        launch(_relu_fwd, blocks, threads, flat(x), flat(y))   # (n,) views
    return y


# bwd :: (y, gy) -> gx
def relu_backward(gy, y):
    gx = empty(y.shape, y.dtype)
    if gx.size:
        blocks, threads = config.grid_1d(gx.size)
        launch(_relu_bwd, blocks, threads, flat(gy), flat(y),
               flat(gx))
    return gx


# Every kernel above with the signatures it is compiled for, as a function of the numba float
# type f; tests/test_ptx.py compiles each to PTX. Integer scalars (sizes, strides, flags) are
# int64, as Python ints are; labels are int64 here (int32 labels compile on first use), and
# max-pool argmaxes uint8 (the uint16/uint32 of windows over 16x16 compile on first use).
_i = int64
_POOL = types.UniTuple(int64, 7)       # max pool's (C, P, Q, kh, kw, sh, sw)
_STRIDES = types.UniTuple(int64, 4)    # element strides (s_n, s_c, s_h, s_w)
PTX_SIGNATURES = [
    (_relu_fwd, lambda f: (f[::1], f[::1])),
    (_relu_bwd, lambda f: (f[::1], f[::1], f[::1])),
    (_matmul_tiled, lambda f: (f[:, ::1], f[:, ::1], f[::1], f[:, ::1], _i, _i, _i)),
    (_linear_bwd, lambda f: (f[:, ::1], f[:, ::1], f[:, ::1], f[:, ::1], f[:, ::1], f[::1],
                             types.UniTuple(int64, 3))),
    (_max_pool_fwd, lambda f: (f[::1], f[::1], uint8[::1], _POOL, _STRIDES, _i)),
    (_max_pool_bwd, lambda f: (f[::1], uint8[::1], f[::1], _POOL, _i, _i, _STRIDES, _i)),
    (_gap_fwd, lambda f: (f[::1], f[::1]) + (_i,) * 7),
    (_gap_bwd, lambda f: (f[::1], f[::1]) + (_i,) * 7),
    (_xent_rows, lambda f: (f[:, ::1], int64[::1], float64[::1], float64[::1])),
    (_mean_one_block, lambda f: (float64[::1], float64, f[::1])),
    (_xent_one_block, lambda f: (f[:, ::1], int64[::1], float64, float64[::1], f[::1])),
    (_xent_bwd, lambda f: (f[:, ::1], int64[::1], float64[::1], f[::1], float64, f[:, ::1])),
    (_flag_bad_labels, lambda f: (int64[::1], _i, int32[::1])),
]
