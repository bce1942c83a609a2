r"""numba.cuda kernels of batch norm -> add -> ReLU: statistics, fused apply, two-pass backward.

Notation: N batch, C channels, M = N*H*W values per channel, ``size`` = N*C*H*W. For the
per-channel reductions an activation is viewed as ``x3`` (A, C, B): NCHW is (N, C, H*W), NHWC
is (M, C, 1); value m of channel c is ``x3[m // B, c, m % B]`` and its flat index is
``(m // B * C + c) * B + m % B``. Elementwise kernels use flat (size,) views, channel
``(j // B) % C``.

Reductions are deterministic (no float atomics): a 2-d grid (parts, min(C, 65535)), each block
grid-strides over its channels (blockIdx.y, + gridDim.y, ...) and over each channel's values,
reduces in shared memory (or with warp shuffles on a real GPU) and writes one partial per
(channel, part); a finalize kernel, one thread per channel, sums the partials in a fixed
order. The result depends on ``config.reduce_blocks``/``config.threads``
(the partition), never on scheduling.

Relu state codes for the backward (``math.py``, shared with the CPU kernels): ``STATE_NONE``, ``STATE_Y``
(open where y > 0), ``STATE_MASK`` (packed bits, bit ``j % 8`` of byte ``j // 8``).

Host-level entry points (same as ``kernels/batchnorm/cpu.py``): :func:`stats`,
:func:`inference_stats`, :func:`apply`, :func:`backward`, :func:`update_running`.
"""
import numpy as np
from numba import boolean, float64, int64, uint8

from ... import backend
from ... import kernels
from ...cuda import SIMULATOR, numba_cuda as cuda
from . import math as bm
from .math import BITS, STATE_MASK, STATE_NONE, STATE_Y, mask_nbytes  # noqa: F401
from .. import scalar
from ..scalar import cuda_scalar
from .. import cuda_config as config

BLOCK = config.BLOCK
WARP = 32
FULL_MASK = 0xFFFFFFFF
# Warp shuffles on a real GPU only; the simulator takes the shared-memory tree.
USE_SHUFFLE = not SIMULATOR

_relu = cuda_scalar(scalar.relu)
_finalize_mean = cuda_scalar(bm.finalize_mean)
_finalize_var = cuda_scalar(bm.finalize_var)
_invstd_of = cuda_scalar(bm.invstd_of)
_unbiased_var = cuda_scalar(bm.unbiased_var)
_running_update = cuda_scalar(bm.running_update)
_normalize_affine = cuda_scalar(bm.normalize_affine)
_mask_bit = cuda_scalar(bm.mask_bit)
_gate = cuda_scalar(bm.gate)
_coef_g = cuda_scalar(bm.coef_g)
_coef_x = cuda_scalar(bm.coef_x)
_coef_0 = cuda_scalar(bm.coef_0)
_input_grad = cuda_scalar(bm.input_grad)


# --------------------------------------------------------------------------- device helpers

@cuda.jit(device=True, inline=True)
def _block_sum2(a, b, buf_a, buf_b):
    """Sums of ``a`` and ``b`` over the block (valid in thread 0); buf_*: shared (BLOCK,).

    Every thread of the block must call it (it synchronises); it may be called again with the
    same buffers (it ends with a barrier).
    """
    t = cuda.threadIdx.x
    if USE_SHUFFLE and cuda.blockDim.x % WARP == 0:
        off = WARP // 2
        while off > 0:  # within each warp, fixed order
            a += cuda.shfl_down_sync(FULL_MASK, a, off)
            b += cuda.shfl_down_sync(FULL_MASK, b, off)
            off //= 2
        lane = t % WARP
        warp = t // WARP
        if lane == 0:
            buf_a[warp] = a
            buf_b[warp] = b
        cuda.syncthreads()  # every warp's sum is in buf_*
        nwarps = cuda.blockDim.x // WARP
        if warp == 0:
            a = buf_a[lane] if lane < nwarps else 0.0
            b = buf_b[lane] if lane < nwarps else 0.0
            off = WARP // 2
            while off > 0:
                a += cuda.shfl_down_sync(FULL_MASK, a, off)
                b += cuda.shfl_down_sync(FULL_MASK, b, off)
                off //= 2
        cuda.syncthreads()  # warp 0 has read buf_* before a next call overwrites it
        return a, b
    # portable path: shared-memory tree (blockDim.x is a power of two <= BLOCK)
    buf_a[t] = a
    buf_b[t] = b
    cuda.syncthreads()  # every thread's values are in buf_*
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            buf_a[t] += buf_a[t + step]
            buf_b[t] += buf_b[t + step]
        cuda.syncthreads()  # this level of the tree is complete before the next reads it
        step //= 2
    a, b = buf_a[0], buf_b[0]
    cuda.syncthreads()  # everyone has read buf_*[0] before a next call overwrites it
    return a, b


@cuda.jit(device=True, inline=True)
def _gated(gy, state_kind, ystate, mask, j, g_in):
    # g = gy * (relu open at flat index j); g_in = gy at j
    if state_kind == STATE_Y:
        return _gate(g_in, ystate[j] > 0)
    if state_kind == STATE_MASK:
        return _gate(g_in, _mask_bit(mask[j >> 3], j) != 0)
    return g_in + 0.0


# --------------------------------------------------------------------------- statistics

@cuda.jit(cache=True)
def _stats_partials(x3, partials):
    # x3: (A, C, B); partials: (C, parts, 2) float64 <- shifted sums s1, s2 of this block's
    # share of each of its channels (shift: the channel's first value)
    buf_a = cuda.shared.array(BLOCK, float64)
    buf_b = cuda.shared.array(BLOCK, float64)
    A, C, B = x3.shape
    part = cuda.blockIdx.x
    # channels: bounds depend on the block only, so all its threads reach every barrier
    for c in range(cuda.blockIdx.y, C, cuda.gridDim.y):
        shift = float64(x3[0, c, 0])
        s1 = 0.0
        s2 = 0.0
        for m in range(part * cuda.blockDim.x + cuda.threadIdx.x, A * B,
                       cuda.gridDim.x * cuda.blockDim.x):
            d = float64(x3[m // B, c, m % B]) - shift
            s1 += d
            s2 += d * d
        s1, s2 = _block_sum2(s1, s2, buf_a, buf_b)
        if cuda.threadIdx.x == 0:
            partials[c, part, 0] = s1
            partials[c, part, 1] = s2


@cuda.jit(cache=True)
def _stats_finalize(x3, partials, eps, mean, var, invstd):
    # partials: (C, parts, 2); mean, var, invstd: (C,) float64; one thread per channel
    A, C, B = x3.shape
    count = float64(A * B)
    for c in range(cuda.grid(1), C, cuda.gridsize(1)):
        s1 = 0.0
        s2 = 0.0
        for p in range(partials.shape[1]):  # fixed order: deterministic
            s1 += partials[c, p, 0]
            s2 += partials[c, p, 1]
        mean[c] = _finalize_mean(s1, float64(x3[0, c, 0]), count)
        var[c] = _finalize_var(s1, s2, count)
        invstd[c] = _invstd_of(var[c], eps)


@cuda.jit(cache=True)
def _inference_stats(running_mean, running_var, eps, mean, invstd):
    # running_*: (C,); mean, invstd: (C,) float64
    for c in range(cuda.grid(1), mean.shape[0], cuda.gridsize(1)):
        mean[c] = running_mean[c]
        invstd[c] = _invstd_of(float64(running_var[c]), eps)


@cuda.jit(cache=True)
def _update_running(running_mean, running_var, mean, var, count, momentum):
    # running_*: (C,) updated in place; mean, var: (C,) float64 (var biased)
    for c in range(cuda.grid(1), mean.shape[0], cuda.gridsize(1)):
        running_mean[c] = _running_update(float64(running_mean[c]), mean[c], momentum)
        running_var[c] = _running_update(float64(running_var[c]),
                                         _unbiased_var(var[c], count), momentum)


# --------------------------------------------------------------------------- fused forward

@cuda.jit(cache=True)
def _apply(x, z, has_z, mean, invstd, gamma, beta, relu, C, B, y, mask, want_mask):
    # x, z, y: (size,) flat; mean, invstd: (C,) float64; gamma, beta: (C,);
    # mask: (ceil(size/8),) uint8. Thread q owns elements 8q .. 8q+7 (one mask byte).
    size = x.shape[0]
    for q in range(cuda.grid(1), (size + BITS - 1) // BITS, cuda.gridsize(1)):
        byte = 0
        for t in range(BITS):
            j = q * BITS + t
            if j < size:
                c = (j // B) % C
                v = _normalize_affine(float64(x[j]), mean[c], gamma[c] * invstd[c],
                                      float64(beta[c]))
                if has_z:
                    v += z[j]
                if relu:
                    v = _relu(v)
                y[j] = v
                if y[j] > 0:
                    byte |= 1 << t
        if want_mask:
            mask[q] = byte


# --------------------------------------------------------------------------- fused backward

@cuda.jit(cache=True)
def _bwd_partials(gy3, x3, mean, state_kind, ystate3, mask, partials):
    # gy3, x3, ystate3: (A, C, B); mean: (C,) float64; mask: packed uint8;
    # partials: (C, parts, 2) float64 <- sums of g and g*(x - mean) of this block's share of
    # each of its channels
    buf_a = cuda.shared.array(BLOCK, float64)
    buf_b = cuda.shared.array(BLOCK, float64)
    A, C, B = x3.shape
    part = cuda.blockIdx.x
    # channels: bounds depend on the block only, so all its threads reach every barrier
    for c in range(cuda.blockIdx.y, C, cuda.gridDim.y):
        m_c = mean[c]
        sg = 0.0
        sgx = 0.0
        for m in range(part * cuda.blockDim.x + cuda.threadIdx.x, A * B,
                       cuda.gridDim.x * cuda.blockDim.x):
            a = m // B
            b = m % B
            j = (a * C + c) * B + b  # flat index, for the mask bit
            g = 0.0
            if state_kind == STATE_Y:
                g = _gate(float64(gy3[a, c, b]), ystate3[a, c, b] > 0)
            elif state_kind == STATE_MASK:
                g = _gate(float64(gy3[a, c, b]), _mask_bit(mask[j >> 3], j) != 0)
            else:
                g = float64(gy3[a, c, b])
            sg += g
            sgx += g * (float64(x3[a, c, b]) - m_c)
        sg, sgx = _block_sum2(sg, sgx, buf_a, buf_b)
        if cuda.threadIdx.x == 0:
            partials[c, part, 0] = sg
            partials[c, part, 1] = sgx


@cuda.jit(cache=True)
def _bwd_finalize(partials, nparts, gamma, invstd, count, training, ggamma, gbeta, cg, cx,
                  c0):
    # partials: (C, >= nparts, 2); ggamma, gbeta: (C,) dtype of x; cg, cx, c0: (C,) float64
    # with dx = cg*g + cx*(x - mean) + c0
    for c in range(cuda.grid(1), invstd.shape[0], cuda.gridsize(1)):
        sg = 0.0
        sgx = 0.0
        for p in range(nparts):  # fixed order: deterministic
            sg += partials[c, p, 0]
            sgx += partials[c, p, 1]
        dgamma = sgx * invstd[c]
        gbeta[c] = sg
        ggamma[c] = dgamma
        gam = float64(gamma[c])
        cg[c] = _coef_g(gam, invstd[c])
        cx[c] = _coef_x(gam, invstd[c], dgamma, count, training)
        c0[c] = _coef_0(gam, invstd[c], sg, count, training)


@cuda.jit(cache=True)
def _bwd_apply(gy, x, mean, cg, cx, c0, state_kind, ystate, mask, C, B, gx, want_gx, gz,
               want_gz):
    # gy, x, ystate, gx, gz: (size,) flat; per-channel float64 coefficients (C,)
    for j in range(cuda.grid(1), gy.shape[0], cuda.gridsize(1)):
        c = (j // B) % C
        g = _gated(gy, state_kind, ystate, mask, j, float64(gy[j]))
        if want_gz:
            gz[j] = g
        if want_gx:
            gx[j] = _input_grad(g, float64(x[j]), mean[c], cg[c], cx[c], c0[c])


# --------------------------------------------------------------------------- host entry points

def _dims(shape, layout):
    """(A, C, B) of the reduction view: NCHW (N, C, H*W), NHWC (N*H*W, C, 1)."""
    if layout == "NCHW":
        N, C, H, W = shape
        return N, C, H * W
    N, H, W, C = shape
    return N * H * W, C, 1


def _parts(M):
    return max(1, min(config.reduce_blocks, -(-M // config.block_threads())))


def stats(x, layout, eps):
    """(mean, var, invstd) float64 (C,) device arrays of a C-contiguous device ``x``."""
    A, C, B = _dims(x.shape, layout)
    x3 = x.reshape(A, C, B)                                       # (A, C, B)
    parts = _parts(A * B)
    partials = cuda.device_array((C, parts, 2), np.float64)
    _stats_partials[(parts, min(C, config.max_grid_y)), config.block_threads()](x3, partials)
    mean, var, invstd = (cuda.device_array(C, np.float64) for _ in range(3))
    blocks, threads = config.grid_1d(C)
    _stats_finalize[blocks, threads](x3, partials, float(eps), mean, var, invstd)
    return mean, var, invstd


def inference_stats(running_mean, running_var, eps):
    C = running_mean.shape[0]
    mean, invstd = cuda.device_array(C, np.float64), cuda.device_array(C, np.float64)
    blocks, threads = config.grid_1d(C)
    _inference_stats[blocks, threads](kernels.contiguous(running_mean),
                                      kernels.contiguous(running_var), float(eps),
                                      mean, invstd)
    return mean, invstd


def update_running(running_mean, running_var, mean, var, count, momentum):
    """In place on the device (contiguous running statistics)."""
    blocks, threads = config.grid_1d(mean.shape[0])
    _update_running[blocks, threads](backend.as_device_array(running_mean),
                                     backend.as_device_array(running_var), mean, var,
                                     float(count), float(momentum))


def apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
    """(y, mask or None) on the device; see the CPU module."""
    A, C, B = _dims(x.shape, layout)
    y = cuda.device_array(x.shape, x.dtype)
    nbytes = mask_nbytes(x.size)
    mask = cuda.device_array(nbytes if want_mask else 1, np.uint8)
    flat = x.reshape(x.size)                                      # (size,)
    zf = flat if z is None else z.reshape(z.size)                 # x stands in for "no z"
    blocks, threads = config.grid_1d(nbytes)
    _apply[blocks, threads](flat, zf, z is not None, mean, invstd, gamma, beta, bool(relu), C,
                            B, y.reshape(y.size), mask, bool(want_mask))
    return y, (mask if want_mask else None)


def backward(gy, x, mean, invstd, gamma, state_kind, state, layout, training, need):
    """(gx, ggamma, gbeta, gz) on the device, each None unless asked for in ``need``."""
    need_gx, need_ggamma, need_gbeta, need_gz = need
    A, C, B = _dims(x.shape, layout)
    dtype = x.dtype
    x3, gy3 = x.reshape(A, C, B), gy.reshape(A, C, B)             # (A, C, B)
    ystate3 = state.reshape(A, C, B) if state_kind == STATE_Y else x3
    mask = state if state_kind == STATE_MASK else cuda.device_array(1, np.uint8)
    if need_ggamma or need_gbeta or (need_gx and training):
        parts = _parts(A * B)
        partials = cuda.device_array((C, parts, 2), np.float64)
        _bwd_partials[(parts, min(C, config.max_grid_y)), config.block_threads()](
            gy3, x3, mean, state_kind, ystate3, mask, partials)
    else:  # inference, dx/dz only: no reduction (the coefficients need none)
        parts = 0
        partials = cuda.device_array((C, 1, 2), np.float64)
    ggamma, gbeta = cuda.device_array(C, dtype), cuda.device_array(C, dtype)
    cg, cx, c0 = (cuda.device_array(C, np.float64) for _ in range(3))
    blocks, threads = config.grid_1d(C)
    _bwd_finalize[blocks, threads](partials, parts, gamma, invstd, float(A * B),
                                   bool(training), ggamma, gbeta, cg, cx, c0)
    gx = gz = None
    if need_gx or need_gz:
        gx = cuda.device_array(x.shape if need_gx else 1, dtype)
        gz = cuda.device_array(x.shape if need_gz else 1, dtype)
        blocks, threads = config.grid_1d(x.size)
        _bwd_apply[blocks, threads](gy.reshape(gy.size), x.reshape(x.size), mean, cg, cx, c0,
                                    state_kind, ystate3.reshape(x.size), mask, C, B,
                                    gx.reshape(gx.size), bool(need_gx), gz.reshape(gz.size),
                                    bool(need_gz))
        gx = gx if need_gx else None
        gz = gz if need_gz else None
    return (gx, ggamma if need_ggamma else None, gbeta if need_gbeta else None, gz)


# Every kernel above with its signature as a function of the numba float type f; compiled to
# PTX for a real target by tests/test_ptx.py.
PTX_SIGNATURES = [
    (_stats_partials, lambda f: (f[:, :, ::1], float64[:, :, ::1])),
    (_stats_finalize, lambda f: (f[:, :, ::1], float64[:, :, ::1], float64, float64[::1],
                                 float64[::1], float64[::1])),
    (_inference_stats, lambda f: (f[::1], f[::1], float64, float64[::1], float64[::1])),
    (_update_running, lambda f: (f[::1], f[::1], float64[::1], float64[::1], float64,
                                 float64)),
    (_apply, lambda f: (f[::1], f[::1], boolean, float64[::1], float64[::1], f[::1], f[::1],
                        boolean, int64, int64, f[::1], uint8[::1], boolean)),
    (_bwd_partials, lambda f: (f[:, :, ::1], f[:, :, ::1], float64[::1], int64,
                               f[:, :, ::1], uint8[::1], float64[:, :, ::1])),
    (_bwd_finalize, lambda f: (float64[:, :, ::1], int64, f[::1], float64[::1], float64,
                               boolean, f[::1], f[::1], float64[::1], float64[::1],
                               float64[::1])),
    (_bwd_apply, lambda f: (f[::1], f[::1], float64[::1], float64[::1], float64[::1],
                            float64[::1], int64, f[::1], uint8[::1], int64, int64, f[::1],
                            boolean, f[::1], boolean)),
]
