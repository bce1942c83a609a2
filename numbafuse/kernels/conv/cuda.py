"""numba.cuda convolution kernels: tiled implicit GEMMs with fused epilogues and masks.

Notation: N batch, C input channels, H/W input size, K filters, R/S filter size, P/Q output
size, M = N*P*Q output pixels, CRS = C*R*S. Every array is passed flat (1-d, C-contiguous);
``conv_math`` turns (row, column) of the implicit matrices into flat offsets for either layout.
The geometry travels as one tuple ``geo`` (``conv_math.GEO_FIELDS``).

Three implicit GEMMs, none of which materialises its im2col matrix:

    forward  y (M, K)        = cols (M, CRS) @ w^T (CRS, K);  epilogue relu(. + b), one store
    dx       dx (N*H*W, C)   = G (N*H*W, R*S*K) @ W' (R*S*K, C);  G reads g = gy*(y > 0)
    dw       dw (K, CRS)     = g^T (K, M) @ cols (M, CRS);  M cut into fixed splits
    db       db (K,)         = sum over M of g;             M cut into fixed splits

A block computes one TILE x TILE output tile at a time (grid-stride over tiles), staging
TILE x TILE operand tiles in shared memory; it has ``config.threads`` threads (any power of
two <= BLOCK), each owning the tile elements ``e = t, t + threads, ...``, and accumulates in a
shared tile. dw and db are deterministic: each (tile, split) writes its own float64 partial,
and ``_sum_rows`` adds the partials in split order. No float atomics anywhere.
"""
import numpy as np
from numba import float64, types

from ...cuda import numba_cuda as cuda

from . import math as conv_math
from ..scalar import cuda_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from .. import cuda_config as config
from ..cuda_reduce import block_sum
from ..elementwise.cuda import fill

TILE = config.TILE
BLOCK = config.BLOCK

_relu = cuda_scalar(_relu_math)
_relu_grad = cuda_scalar(_relu_grad_math)
_cols_offset = cuda_scalar(conv_math.cols_offset)
_transposed_cols_offset = cuda_scalar(conv_math.transposed_cols_offset)
_out_offset = cuda_scalar(conv_math.out_offset)
_act_offset = cuda_scalar(conv_math.act_offset)


@cuda.jit(device=True, inline=True)
def _tile_zero(acc, t, nt):
    # acc: (TILE, TILE), the elements this thread owns set to 0
    for e in range(t, TILE * TILE, nt):
        acc[e // TILE, e % TILE] = 0.0


@cuda.jit(device=True, inline=True)
def _tile_mac(a_tile, b_tile, acc, t, nt):
    # acc[j, i] += sum_kk a_tile[kk, i] * b_tile[kk, j]  (i fastest across threads: no bank
    # conflicts on a_tile and acc, a broadcast on b_tile)
    for e in range(t, TILE * TILE, nt):
        i = e % TILE
        j = e // TILE
        s = acc[j, i]
        for kk in range(TILE):
            s += a_tile[kk, i] * b_tile[kk, j]
        acc[j, i] = s


# --------------------------------------------------------------------------- forward

@cuda.jit(cache=True)
def _conv_fwd(x, w, b, y, geo, has_bias, relu):
    # x: (N*C*H*W,) in layout;  w: (K*CRS,) = (K, CRS);  b: (K,);  y: (N*K*P*Q,) in layout
    # y (M, K) = cols (M, CRS) @ w^T (CRS, K), then relu(. + b) before the single store
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    a_tile = cuda.shared.array((TILE, TILE), x.dtype)     # [crs, m]: cols^T tile
    b_tile = cuda.shared.array((TILE, TILE), x.dtype)     # [crs, k]: w^T tile
    acc = cuda.shared.array((TILE, TILE), x.dtype)        # [k, m]
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    M, CRS = N * P * Q, C * R * S
    m_tiles = (M + TILE - 1) // TILE
    n_tiles = m_tiles * ((K + TILE - 1) // TILE)
    for tile in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
        m0 = (tile % m_tiles) * TILE
        k0 = (tile // m_tiles) * TILE
        _tile_zero(acc, t, nt)
        for c0 in range(0, CRS, TILE):
            for e in range(t, TILE * TILE, nt):
                i = e % TILE                  # m (a_tile) / crs (b_tile): fastest, coalesced
                j = e // TILE
                # if/else stores, not "v if cond else 0.0": that would compute in float64
                off = _cols_offset(m0 + i, c0 + j, geo) if m0 + i < M and c0 + j < CRS else -1
                if off >= 0:
                    a_tile[j, i] = x[off]
                else:
                    a_tile[j, i] = 0.0
                if k0 + j < K and c0 + i < CRS:
                    b_tile[i, j] = w[(k0 + j) * CRS + c0 + i]
                else:
                    b_tile[i, j] = 0.0
            cuda.syncthreads()  # both operand tiles are loaded
            _tile_mac(a_tile, b_tile, acc, t, nt)
            cuda.syncthreads()  # every thread is done reading the tiles before they are reloaded
        for e in range(t, TILE * TILE, nt):
            i = e % TILE
            j = e // TILE
            if m0 + i < M and k0 + j < K:
                v = acc[j, i] + (b[k0 + j] if has_bias else 0.0)
                y[_out_offset(m0 + i, k0 + j, K, P * Q, nhwc)] = _relu(v) if relu else v


# --------------------------------------------------------------------------- backward

@cuda.jit(cache=True)
def _conv_dx(gy, y, w, dx, geo, use_mask):
    # gy, y: (N*K*P*Q,) in layout;  w: (K*C*R*S,);  dx: (N*C*H*W,) in layout, written once
    # dx (N*H*W, C) = G (N*H*W, R*S*K) @ W' (R*S*K, C), G's entries g = gy*(y > 0) masked on load
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    a_tile = cuda.shared.array((TILE, TILE), gy.dtype)    # [rsk, mx]: G^T tile
    b_tile = cuda.shared.array((TILE, TILE), gy.dtype)    # [rsk, c]: W' tile
    acc = cuda.shared.array((TILE, TILE), gy.dtype)       # [c, mx]
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    MX, RSK = N * H * W, R * S * K
    m_tiles = (MX + TILE - 1) // TILE
    n_tiles = m_tiles * ((C + TILE - 1) // TILE)
    for tile in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
        m0 = (tile % m_tiles) * TILE
        c0 = (tile // m_tiles) * TILE
        _tile_zero(acc, t, nt)
        for r0 in range(0, RSK, TILE):
            for e in range(t, TILE * TILE, nt):
                i = e % TILE
                j = e // TILE
                off = -1
                if m0 + i < MX and r0 + j < RSK:
                    off = _transposed_cols_offset(m0 + i, r0 + j, geo)
                # g = relu_grad(gy, y) (gy where y > 0) as typed stores: the helper returns
                # float64 for float32 arguments (its literal 0.0), a round trip per element
                if off >= 0 and (not use_mask or y[off] > 0):
                    a_tile[j, i] = gy[off]
                else:
                    a_tile[j, i] = 0.0
                # W'[(r, s, k), c] = w[k, c, r, s]
                rsk = r0 + i
                if rsk < RSK and c0 + j < C:
                    k = rsk % K
                    s = (rsk // K) % S
                    r = rsk // (K * S)
                    b_tile[i, j] = w[((k * C + c0 + j) * R + r) * S + s]
                else:
                    b_tile[i, j] = 0.0
            cuda.syncthreads()  # both operand tiles are loaded
            _tile_mac(a_tile, b_tile, acc, t, nt)
            cuda.syncthreads()  # every thread is done reading the tiles before they are reloaded
        for e in range(t, TILE * TILE, nt):
            i = e % TILE
            j = e // TILE
            mx = m0 + i
            if mx < MX and c0 + j < C:
                dx[_act_offset(mx // (H * W), c0 + j, (mx // W) % H, mx % W, C, H, W, nhwc)] = \
                    acc[j, i]


@cuda.jit(cache=True)
def _conv_dw_partials(gy, y, x, partials, geo, use_mask, split_len):
    # gy, y: (N*K*P*Q,);  x: (N*C*H*W,);  partials: (n_splits, K*CRS) float64
    # partials[s] = g^T (K, rows of split s) @ cols (rows of split s, CRS), g masked on load
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    a_tile = cuda.shared.array((TILE, TILE), x.dtype)     # [m, k]: g tile
    b_tile = cuda.shared.array((TILE, TILE), x.dtype)     # [m, crs]: cols tile
    acc = cuda.shared.array((TILE, TILE), x.dtype)        # [k, crs]
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    M, CRS, PQ = N * P * Q, C * R * S, P * Q
    n_splits = partials.shape[0]
    c_tiles = (CRS + TILE - 1) // TILE
    out_tiles = c_tiles * ((K + TILE - 1) // TILE)
    for job in range(cuda.blockIdx.x, out_tiles * n_splits, cuda.gridDim.x):
        split = job // out_tiles
        c0 = (job % c_tiles) * TILE
        k0 = ((job % out_tiles) // c_tiles) * TILE
        m_end = min(M, (split + 1) * split_len)
        _tile_zero(acc, t, nt)
        for m0 in range(split * split_len, m_end, TILE):
            for e in range(t, TILE * TILE, nt):
                i = e % TILE
                j = e // TILE
                off = _out_offset(m0 + j, k0 + i, K, PQ, nhwc) if m0 + j < m_end and k0 + i < K \
                    else -1
                if off >= 0 and (not use_mask or y[off] > 0):   # g = relu_grad(gy, y), typed
                    a_tile[j, i] = gy[off]
                else:
                    a_tile[j, i] = 0.0
                off = _cols_offset(m0 + j, c0 + i, geo) if m0 + j < m_end and c0 + i < CRS \
                    else -1
                if off >= 0:
                    b_tile[j, i] = x[off]
                else:
                    b_tile[j, i] = 0.0
            cuda.syncthreads()  # both operand tiles are loaded
            _tile_mac(b_tile, a_tile, acc, t, nt)     # acc[k, crs] += sum_m g[m, k] cols[m, crs]
            cuda.syncthreads()  # every thread is done reading the tiles before they are reloaded
        for e in range(t, TILE * TILE, nt):
            i = e % TILE
            j = e // TILE
            if c0 + i < CRS and k0 + j < K:
                partials[split, (k0 + j) * CRS + c0 + i] = acc[j, i]


@cuda.jit(cache=True)
def _channel_sum_partials(gy, y, use_mask, partials, K, PQ, nhwc, split_len):
    # gy, y: (N*K*P*Q,) in layout;  partials: (n_splits, K) float64, the sum over the output
    # pixels m of split s of g[m, k] = gy*(y > 0) (or gy), a shared-memory tree per (s, k)
    buf = cuda.shared.array(BLOCK, float64)
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    n_splits = partials.shape[0]
    M = gy.size // K
    for job in range(cuda.blockIdx.x, n_splits * K, cuda.gridDim.x):
        split = job // K
        k = job % K
        acc = 0.0
        for m in range(split * split_len + t, min(M, (split + 1) * split_len), nt):
            off = _out_offset(m, k, K, PQ, nhwc)
            acc += _relu_grad(gy[off], y[off]) if use_mask else gy[off]
        total = block_sum(buf, acc)
        if t == 0:
            partials[split, k] = total


@cuda.jit(cache=True)
def _sum_rows(partials, out):
    # partials: (n_splits, n) float64;  out: (n,) = sum over splits, in split order
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        acc = 0.0
        for s in range(partials.shape[0]):
            acc += partials[s, i]
        out[i] = acc


@cuda.jit(cache=True)
def _bias_add(x, b, out, C, HW, nhwc):
    # x, out: (N*C*H*W,) in layout;  b: (C,)
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        c = i % C if nhwc else (i // HW) % C
        out[i] = x[i] + b[c]


# --------------------------------------------------------------------------- wrappers

def _flat(a):
    return a.reshape(a.size)


def _tile_blocks(n_tiles):
    return max(1, min(config.max_blocks, n_tiles))


def _splits(rows, granule):
    """(split_len, n_splits): ``rows`` cut into at most ``config.reduce_blocks`` fixed slices.

    ``rows == 0``: one empty split of one granule (its partial is 0).
    """
    rows = max(rows, 1)
    n = max(1, min(config.reduce_blocks, -(-rows // granule)))
    split_len = -(-rows // n)
    split_len = -(-split_len // granule) * granule     # a whole number of granules
    return split_len, -(-rows // split_len)


def _reduce_splits(partials, out):
    blocks, threads = config.grid_1d(out.size)
    _sum_rows[blocks, threads](partials, _flat(out))
    return out


def conv_forward(x, w, b, geom, relu):
    """``relu?(conv(x, w) + b?)`` for contiguous device arrays; y stays on the device."""
    geo = conv_math.geo_tuple(geom)
    y = cuda.device_array(geom.y_shape, x.dtype)
    M = geom.N * geom.P * geom.Q
    n_tiles = -(-M // TILE) * -(-geom.K // TILE)
    has_bias = b is not None
    _conv_fwd[_tile_blocks(n_tiles), config.block_threads()](
        _flat(x), _flat(w), _flat(b if has_bias else w), _flat(y), geo, int(has_bias),
        int(bool(relu)))
    return y


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` on the device; ``y`` given: g = gy * (y > 0). Only ``need`` computed."""
    need_dx, need_dw, need_db = (bool(v) for v in need)
    geo = conv_math.geo_tuple(geom)
    use_mask = int(y is not None)
    gy_f = _flat(gy)
    y_f = _flat(y) if use_mask else gy_f
    N, C, K, PQ = geom.N, geom.C, geom.K, geom.P * geom.Q
    CRS, M = C * geom.R * geom.S, N * PQ
    dx = dw = db = None
    if need_dx:
        dx = cuda.device_array(geom.x_shape, gy.dtype)
        n_tiles = -(-(N * geom.H * geom.W) // TILE) * -(-C // TILE)
        _conv_dx[_tile_blocks(n_tiles), config.block_threads()](gy_f, y_f, _flat(w), _flat(dx), geo,
                                                         use_mask)
    if need_dw:
        split_len, n_splits = _splits(M, TILE)
        partials = cuda.device_array((n_splits, K * CRS), np.float64)   # (splits, K*C*R*S)
        n_jobs = n_splits * -(-K // TILE) * -(-CRS // TILE)
        _conv_dw_partials[_tile_blocks(n_jobs), config.block_threads()](
            gy_f, y_f, _flat(x), partials, geo, use_mask, split_len)
        dw = _reduce_splits(partials, cuda.device_array(geom.w_shape, gy.dtype))
    if need_db:
        split_len, n_splits = _splits(M, config.block_threads())
        partials = cuda.device_array((n_splits, K), np.float64)          # (splits, K)
        _channel_sum_partials[_tile_blocks(n_splits * K), config.block_threads()](
            gy_f, y_f, use_mask, partials, K, PQ, int(geom.layout == "NHWC"), split_len)
        db = _reduce_splits(partials, cuda.device_array(K, gy.dtype))
    return dx, dw, db


def bias_add(x, b, layout):
    """``x + b[c]`` for a contiguous 4-d device ``x`` in ``layout``."""
    out = cuda.device_array(x.shape, x.dtype)
    nhwc = int(layout == "NHWC")
    C = x.shape[3] if nhwc else x.shape[1]
    HW = x.shape[1] * x.shape[2] if nhwc else x.shape[2] * x.shape[3]
    blocks, threads = config.grid_1d(x.size)
    _bias_add[blocks, threads](_flat(x), b, _flat(out), C, HW, nhwc)
    return out


def channel_sum(gy, layout):
    """Per-channel sum of a 4-d device ``gy`` over N, H, W; deterministic; shape (C,)."""
    nhwc = int(layout == "NHWC")
    C = gy.shape[3] if nhwc else gy.shape[1]
    HW = gy.shape[1] * gy.shape[2] if nhwc else gy.shape[2] * gy.shape[3]
    out = cuda.device_array(C, gy.dtype)
    if gy.size == 0:                                    # N, H or W is 0: the sums are 0
        return fill(out, 0.0)
    split_len, n_splits = _splits(gy.size // C, config.block_threads())
    partials = cuda.device_array((n_splits, C), np.float64)              # (splits, C)
    g = _flat(gy)
    _channel_sum_partials[_tile_blocks(n_splits * C), config.block_threads()](
        g, g, 0, partials, C, HW, nhwc, split_len)
    return _reduce_splits(partials, out)


# Every kernel above with the signatures it is compiled for, as a function of the numba
# scalar type f (float32, float64); tests/test_ptx.py compiles each to PTX.
_GEO = types.UniTuple(types.int64, conv_math.GEO_LEN)
_I = types.int64
PTX_SIGNATURES = [
    (_conv_fwd, lambda f: (f[::1], f[::1], f[::1], f[::1], _GEO, _I, _I)),
    (_conv_dx, lambda f: (f[::1], f[::1], f[::1], f[::1], _GEO, _I)),
    (_conv_dw_partials, lambda f: (f[::1], f[::1], f[::1], float64[:, ::1], _GEO, _I, _I)),
    (_channel_sum_partials, lambda f: (f[::1], f[::1], _I, float64[:, ::1], _I, _I, _I, _I)),
    (_sum_rows, lambda f: (float64[:, ::1], f[::1])),
    (_bias_add, lambda f: (f[::1], f[::1], f[::1], _I, _I, _I)),
]
