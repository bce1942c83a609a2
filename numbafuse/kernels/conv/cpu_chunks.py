r"""How the CPU conv passes cut their work and gather their gradients: chunks (blocks of
output rows of one image, or several whole images; for Winograd, of 2x2 tiles), the gated
gradient g = gy * (y > 0) of a chunk with its bias-gradient sums, and the partials of fixed
groups of chunks summed in group order (results do not depend on the thread count).

    chunk(t, N, rows, ipc, rpc) -> (n0, n1, r0, r1)   images and rows of chunk t (compiled)
    nchunks, balanced, tile_chunks, block_chunks     the chunking, on the host
    gated_chw, gated_hwc                             g of a chunk's pixels, db += its sums
    gated_channel_sums(gy, y, layout)                db of a whole gy, on the pool
    sum_groups(parts), sum64(a)                      group-order and float64 sums
    phases, phase_weights                            dX by input phase: taps and weights
"""
import functools

import numpy as np
from numba import njit

from ..cpu import recorded as _rec
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import blocks, launch, task_kernel
from ..scalar import cpu_scalar, relu_grad as _relu_grad_math

_relu_grad = cpu_scalar(_relu_grad_math)


# --------------------------------------------------------------------------- chunking

@njit(inline="always")
def chunk(t, N, rows, ipc, rpc):
    """Chunk t: images [n0, n1), rows [r0, r1) of each."""
    if ipc > 1:
        n0 = t * ipc
        return n0, min(N, n0 + ipc), 0, rows
    nblk = (rows + rpc - 1) // rpc
    n0 = t // nblk
    r0 = (t - n0 * nblk) * rpc
    return n0, n0 + 1, r0, min(rows, r0 + rpc)


@njit(inline="always")
def block_len(n, blocks):
    """Channels per block when ``n`` channels go in ``blocks`` blocks: a multiple of 16, so
    the last block may be partial and trailing ones empty (the whole-batch im2col tasks)."""
    return ((n + blocks - 1) // blocks + 15) // 16 * 16


def count_chunks(N, rows, ipc, rpc):
    """How many chunks ``chunk`` numbers: of ``ipc`` images, or of ``rpc`` rows of one."""
    return blocks(N, ipc) if ipc > 1 else N * blocks(rows, rpc)


def balanced(rows, most):
    """Rows per block: at most ``most``, the blocks of ``rows`` as even as can be (blocks of
    7, 7 and 2 rows become 6, 6 and 4: a tiny last block runs its GEMMs slowly)."""
    most = max(1, min(int(most), rows))
    return -(-rows // -(-rows // most))


def tile_chunks(N, Ho, Wo, nhwc, tiles):
    """(images per chunk, tile rows per chunk, chunks, most tiles of a chunk) of a Winograd
    pass over an Ho x Wo output in 2x2 tiles: ~``tiles`` tiles (NCHW rows of tiles carry
    one junk tile each), whole images when an image has fewer."""
    TY, TX = (Ho + 1) // 2, (Wo + 1) // 2
    return block_chunks(N, TY, TX if nhwc else TX + 1, tiles)


def block_chunks(N, TY, per_row, tiles):
    """tile_chunks of TY rows of ``per_row`` tiles (blocks) an image."""
    if TY * per_row <= tiles:
        ipc, tyb = balanced(N, tiles // (TY * per_row)), TY
    else:
        ipc, tyb = 1, balanced(TY, tiles // per_row)
    most = (ipc * TY if ipc > 1 else tyb) * per_row
    return ipc, tyb, count_chunks(N, TY, ipc, tyb), most


SUM_BLOCK = 1 << 14        # values per task of _sum_groups_tasks (read on the host: a
                           # global read inside a kernel is frozen into its cached code)


@task_kernel
def _sum_groups_tasks(t0, t1, parts, block, out):
    # parts: (G, n) -> out (n,) = parts[0] + parts[1] + ... in group order, per value (the
    # same order on any thread count); task t: values [t*block, (t+1)*block)
    G, n = parts.shape
    for t in range(t0, t1):
        i0, i1 = t * block, min(n, (t + 1) * block)
        dst = out[i0:i1]
        src = parts[0, i0:i1]
        for i in range(i1 - i0):
            dst[i] = src[i]
        for g in range(1, G):
            src = parts[g, i0:i1]
            for i in range(i1 - i0):
                dst[i] += src[i]


def sum_groups(parts, dtype=None):
    """``parts`` (G, ...) summed over its first axis in group order, on the pool: an array of
    shape ``parts.shape[1:]`` in ``dtype`` (default: parts' dtype). A large sum reuses a
    buffer of the output cache: a fresh one's page faults took 3.9 of the 5.3 ms of summing
    two (16, 512, 512) float32 Winograd partials into float64 (the 3x3 512 convs' dW at 7x7)."""
    flat = parts.reshape(parts.shape[0], -1)                      # (G, n)
    out = _out.empty(flat.shape[1], dtype or parts.dtype)
    launch(_sum_groups_tasks, blocks(flat.shape[1], SUM_BLOCK), flat, SUM_BLOCK, out,
           work=flat.size, grain=1)
    return out.reshape(parts.shape[1:])


@njit(cache=True, fastmath={"reassoc"})
def sum64(a):
    # float64 sum of a 1-d array, vectorised (reassociated in a fixed, compiled order: the same
    # result on every call, whatever the thread count)
    s = 0.0
    for i in range(a.shape[0]):
        s += a[i]
    return s


@njit(inline="always")
def gated_chw(gy, y, use_mask, n, p0, p1, PQ, Q, g, col0, db):
    # gy, y: (N, K, PQ); g: (K, ld) <- gy * (y > 0) of pixels [p0*Q, p1*Q) at col0; db: (K,)
    # float64 += the sums (sum64 per row, a fixed order)
    K = g.shape[0]
    a, b = p0 * Q, p1 * Q
    L = b - a
    for k in range(K):
        gyr = gy[n, k, a:b]                                       # (L,)
        yr = y[n, k, a:b]
        dst = g[k, col0:col0 + L]
        for i in range(L):
            dst[i] = _relu_grad(gyr[i], yr[i]) if use_mask else gyr[i]
        db[k] += sum64(dst)


@njit(inline="always")
def gated_hwc(gy2, y2, use_mask, m0, m1, g, row0, db):
    # gy2, y2: (N*PQ, K); g: (rows, K) <- gy * (y > 0) of rows [m0, m1) at row0; db: (K,)
    # float64 += the column sums, row by row (a fixed order)
    # (rows by index, no view of each: a view's reference count is an atomic on one cache
    # line every thread of the launch shares; kernels/batchnorm/cpu.py, _ROWS_BY_INDEX)
    K = g.shape[1]
    for m in range(m0, m1):
        d = row0 + m - m0
        for k in range(K):
            v = _relu_grad(gy2[m, k], y2[m, k]) if use_mask else gy2[m, k]
            g[d, k] = v
            db[k] += v


def gated_channel_sums(gy, y, layout):
    """(K,) in gy's dtype: the per-channel sums of g = gy * (y > 0) (gy itself where y is
    None) of a 4-d NCHW or NHWC float gy: float64 per image (``_gated_sums_tasks``, an image a
    task), the images' sums added in image order (``sum_groups``): the same on any thread
    count. The bias gradient of a pass whose kernels make none (the grouped implicit GEMMs):
    NumPy's ``np.where`` and float64 ``sum`` over (N, H, W) took 9.9 ms on one thread at (32,
    512, 14, 14), more than that pass's dW (machine A)."""
    N = gy.shape[0]
    nhwc = layout == "NHWC"
    K = gy.shape[3] if nhwc else gy.shape[1]
    shape = (N, gy.size // (N * K), K) if nhwc else (N, K, gy.size // (N * K))
    g3 = np.ascontiguousarray(gy).reshape(shape)
    y3 = g3 if y is None else np.ascontiguousarray(y).reshape(shape)
    parts = _out.empty((N, K), np.float64)
    launch(_gated_sums_tasks, N, g3, y3, y is not None, nhwc, parts, work=2 * gy.size,
           grain=1)
    return sum_groups(parts).astype(gy.dtype)


@task_kernel
def _gated_sums_tasks(t0, t1, gy, y, use_mask, nhwc, parts):
    # gy, y: (N, K, L) NCHW or (N, L, K) NHWC; parts[n] (K,) float64 <- image n's sums of
    # gy * (y > 0) (or gy): NCHW a row of g by sum64, NHWC pixel after pixel
    K = gy.shape[2] if nhwc else gy.shape[1]
    L = gy.shape[1] if nhwc else gy.shape[2]
    row = np.empty(0 if nhwc else L, gy.dtype)
    for n in range(t0, t1):
        p = parts[n]
        p[:] = 0.0
        if nhwc:
            for i in range(L):                    # (by index: gated_hwc's note)
                for k in range(K):
                    p[k] += _relu_grad(gy[n, i, k], y[n, i, k]) if use_mask else gy[n, i, k]
        else:
            for k in range(K):
                gr, yr = gy[n, k], y[n, k]
                for i in range(L):
                    row[i] = _relu_grad(gr[i], yr[i]) if use_mask else gr[i]
                p[k] = sum64(row)


# --------------------------------------------------------------------------- dX phases

@functools.lru_cache(maxsize=256)
def phases(size_in, taps, stride, pad, dilation):
    """Per input phase a < stride: its taps t with (a + pad - t*dilation) % stride == 0 and
    their output offsets (a + pad - t*dilation) // stride, as (stride, taps) arrays + counts.
    Cached (a function of the geometry alone, asked again by every backward of a layer); the
    arrays are shared: callers only read them."""
    tap = np.zeros((stride, taps), np.int64)
    off = np.zeros((stride, taps), np.int64)
    cnt = np.zeros(stride, np.int64)
    for a in range(stride):
        for t in range(taps):
            v = a + pad - t * dilation
            if v % stride == 0:
                tap[a, cnt[a]], off[a, cnt[a]] = t, v // stride
                cnt[a] += 1
    return tap, off, cnt


@functools.lru_cache(maxsize=256)
def most_taps(size_in, taps, stride, pad, dilation):
    """The most taps of one phase (:func:`phases`' counts' max: asked by every backward,
    a NumPy reduction's ~3 us host time each made once)."""
    return int(phases(size_in, taps, stride, pad, dilation)[2].max())


def phase_weights(w, rows, cols, nhwc):
    """w' of each phase, flat, and the offsets: NCHW (C, K*T) rows c, columns (k, r, s);
    NHWC (T*K, C), rows (r, s, k). ``rows``, ``cols``: the :func:`phases` arguments of the
    two axes. One gather of w by an index made once per shape and phases (a small map's
    backward spent ~8 us of host time here, slicing w phase by phase)."""
    index, offs = _phase_index(tuple(w.shape), tuple(rows), tuple(cols), bool(nhwc))
    out = np.empty(index.shape, w.dtype)                   # (a gather: a prepared call's step)
    return _rec.step(np.take, w.reshape(-1), index, None, out), offs


@functools.lru_cache(maxsize=256)
def _phase_index(w_shape, rows, cols, nhwc):
    """(index into the flat w, offsets) of :func:`phase_weights`."""
    (tr, _, nr), (ts, _, ns) = phases(*rows), phases(*cols)
    at = np.arange(int(np.prod(w_shape)), dtype=np.int64).reshape(w_shape)
    mats = []
    for a in range(tr.shape[0]):
        for b in range(ts.shape[0]):
            sub = at[:, :, tr[a, :nr[a]]][:, :, :, ts[b, :ns[b]]]     # (K, C, nr, ns)
            if nhwc:
                mats.append(sub.transpose(2, 3, 0, 1).reshape(-1))    # (nr, ns, K, C)
            else:
                mats.append(sub.transpose(1, 0, 2, 3).reshape(-1))    # (C, K, nr, ns)
    offs = np.cumsum([0] + [m.size for m in mats[:-1]]).astype(np.int64)
    return (np.concatenate(mats) if mats else np.zeros(0, np.int64)), offs


# --------------------------------------------------------------------------- one tap

@task_kernel
def tap_tasks(t0, t1, w, r, s, out):
    # filters [t0, t1) of w (K, Cg, R, S): out[k, c] = w[k, c, r, s] (a conv cropped to one
    # tap: cpu_first._crop; a strided read that one thread made at ~10 GB/s)
    for k in range(t0, t1):
        wk, ok = w[k], out[k]
        for c in range(wk.shape[0]):
            ok[c] = wk[c, r, s]


@task_kernel
def spread_tap_tasks(t0, t1, d, r, s, full):
    # filters [t0, t1): full[k] (Cg, R, S) zero but full[k, c, r, s] = d[k, c]: dW of a conv
    # cropped to one tap, each value written once
    for k in range(t0, t1):
        dk, fk = d[k], full[k]
        flat = fk.reshape(fk.size)
        for i in range(flat.shape[0]):           # (a memset, in this filter's cache lines)
            flat[i] = 0
        for c in range(fk.shape[0]):
            fk[c, r, s] = dk[c]


def one_tap(w, r, s):
    """w[:, :, r, s] as a C-contiguous (K, Cg, 1, 1) array, made by the threads."""
    out = np.empty(w.shape[:2] + (1, 1), w.dtype)
    launch(tap_tasks, w.shape[0], w, int(r), int(s), out.reshape(w.shape[:2]), work=w.size)
    return out


def spread_tap(d, shape, r, s):
    """The (K, Cg, R, S) ``shape``d array, zero but for tap (r, s): ``d`` (K, Cg, 1, 1) (an
    output-cache buffer, made by the threads)."""
    full = _out.empty(shape, d.dtype)
    launch(spread_tap_tasks, shape[0], np.ascontiguousarray(d).reshape(shape[:2]), int(r),
           int(s), full, work=full.size)
    return full
