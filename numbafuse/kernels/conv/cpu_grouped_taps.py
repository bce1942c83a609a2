r"""Grouped convolutions (1 < groups < C, float32) as implicit GEMMs, every group in one launch.

ResNeXt's grouped 3x3 convs (32 groups of 4 to 32 channels) ran as ``cpu.py``'s kernels once
per group (``cpu_grouped``'s loop: a copy in and out, a plan and launches for a GEMM of 4 to
32 columns, 32 times a pass): at batch 16, 64x64 on machine F each pass took 4-17 ms against
PyTorch's 0.6-8.5. Here every pass is one launch whose tasks are (a chunk of images, a block
of groups): for each group the task copies the group's input channels of its images into a
small zero-padded slab (pixels, group channels; an NCHW image's block of channels transposed
once for the block's groups) and sums the taps in registers with ``cpu.gemm_taps``' tiles, as
``cpu_implicit.py`` does for an ungrouped conv. The reordered weights go through the weight
cache (``weights.derived``: kept only where a caller vouches for w).

    forward   y_g = relu?(conv(x_g, w_g) + b_g?): ``gemm_taps`` over the slab of x's group
              channels, one row per output pixel, one offset per tap (r, s).
    dX        the same kernel on g = gy * (y > 0)?: dx_g = conv(g upsampled by the stride,
              the taps of w_g flipped and transposed), padding (R-1)*dh - ph, stride 1. The
              slab of g is made with the stride's zeros between its pixels (no array of them).
    dW        ``gemm_gather``, per group (one task a block of groups, all images in order):
              dW_g tap (r, s) (Kg, Cg) += g_g^T (Kg, pixels) @ the pixels' tap-(r, s) rows of
              x's slab.

The tiles' columns come in vectors of 8 floats: a group's filters (forward), its input
channels (dX, dW) must be multiples of 8. Groups of 4 (ResNeXt's first stage) or 2 go in
pairs or fours (``merged``): w of the merged group is block-diagonal (zeros between its
groups), so the tiles multiply the zeros too (2x the products for groups of 4) and dW's
blocks off the diagonal are computed and dropped.

Each y and dx value is one float32 sum in tap order, then channel order, over its own
group's channels (a merged group adds the zeros of the others exactly); each dW value one sum
over the images in order, then pixels: results do not depend on the thread count.

NHWC (:data:`BANDS`): the forward, a stride-1 dX and the dW run ``cpu_grouped_bands``' kernels
instead (chunks of output rows, every group in each, a slab of every channel), on g gated once
(``_gated``) in a backward: the same y and dx bits; dW summed in another order.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..basic.cpu import relu_backward as _relu_backward
from ..cpu import gemm_taps as _taps
from ..cpu.gemm import Vec
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import launch, num_threads, task_kernel
from ..cpu.transpose import transpose
from ..scalar import cpu_scalar, relu_grad as _relu_grad_math
from . import cpu_grouped_bands as _bands, weights as _weights
from .cpu_chunks import gated_channel_sums
from .cpu_implicit import slab_shape

_relu_grad = cpu_scalar(_relu_grad_math)
# Flat indices of the copy loops are unsigned: with a signed index Numba adds the wrap-around
# of a negative one to every access, and LLVM then copies a value at a time (machine F, a
# slab's runs of 8 floats: 1.43 ns a value signed, 0.46 unsigned)
_U = np.uint64

ROWS_A_TASK = 256          # output pixels a task aims at (images of small maps go together)
TASKS_A_THREAD = 4         # tasks a pass aims at, a thread (blocks of groups down to that)
BLOCK_VALUES = 1 << 16     # the most values of an NCHW input's block of channels transposed
#                            at once, the task's images (its groups then read it from L2)
BANDS = True               # NHWC passes by cpu_grouped_bands (False: here, as NCHW; tests, A/B)


def merged(geom):
    """How many groups go in one (1, 2, 4 or 8), so that the merged group's input channels and
    filters are multiples of 8; None where no such merge divides the groups."""
    Cg, Kg = geom.C // geom.groups, geom.K // geom.groups
    for m in (1, 2, 4, 8):
        if geom.groups % m == 0 and (m * Cg) % 8 == 0 and (m * Kg) % 8 == 0:
            return m
    return None


def fits(geom, dtype):
    """Whether this module runs ``geom``'s passes for ``dtype``: float32, grouped but not
    depthwise, and the groups' channels and filters multiples of 8 when merged (:func:`merged`)."""
    return (np.dtype(dtype) == np.float32 and 1 < geom.groups < geom.C
            and merged(geom) is not None)


def _taps_of(w, geom, m):
    """w (K, C/groups, R, S) as the merged groups' taps (groups/m, R*S, m*Cg, m*Kg), float32,
    block-diagonal where m > 1."""
    G, R, S = geom.groups, geom.R, geom.S
    Cg, Kg = geom.C // G, geom.K // G
    wt = np.asarray(w, np.float32).reshape(G, Kg, Cg, R * S).transpose(0, 3, 2, 1)
    if m == 1:
        return np.ascontiguousarray(wt)
    out = np.zeros((G // m, R * S, m, Cg, m, Kg), np.float32)
    for a in range(m):                 # (host NumPy; copyto: see tests/test_cpu_steps.py)
        np.copyto(out[:, :, a, :, a, :], wt[a::m])
    return out.reshape(G // m, R * S, m * Cg, m * Kg)


def _images(N, pixels):
    """Images a task (or a dW chunk) takes: enough for ROWS_A_TASK output pixels."""
    return max(1, min(N, ROWS_A_TASK // max(1, pixels)))


@intrinsic
def _copy8(typingctx, dst, src, n8):
    """dst[:8 n8] = src[:8 n8], float32 at the int64 addresses dst and src, 8 floats a
    vector: a slab pixel's channels (a merged group's are a multiple of 8: :func:`merged`).
    Before, a loop of ``cg`` values a pixel: machine A, one thread, (32, 256, 56, 56) groups
    32 stride 2 NHWC forward 40.3-40.7 -> 35.9-36.6 ms; two threads 24.5 -> 23.1-24.0, NCHW
    15.9-18.1 -> 14.6-15.0 (the fill of an NHWC slab, a run of 32 bytes a pixel 1 KiB apart,
    still takes about half of that pass)."""
    def codegen(context, builder, signature, args):
        dst, src, n8 = args
        V = Vec(builder, 8)
        d, s = V.floats(dst), V.floats(src)
        with cgutils.for_range(builder, n8) as loop:
            off = builder.mul(loop.index, ir.Constant(ir.IntType(64), 8))
            V.store(V.load(s, off), d, off)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@njit(inline="always")
def _sources(table, pad, up, size):
    # table[u] = the source row (column) of slab row u: (u - pad) / up where that is whole
    # and inside [0, size), else -1 (a zero of the padding or of the stride)
    for u in range(table.shape[0]):
        i = u - pad
        table[u] = i // up if i >= 0 and i % up == 0 and i // up < size else -1


@njit(inline="always")
def _fill(src, gate, use_gate, nhwc, n, c0, tables, cols, tb, tc0, slab, i):
    # slab[i] (Hs, Ws, cg) <- image n's channels [c0, c0 + cg) of src at the rows and columns
    # of tables = (hsrc, wsrc) (zero at -1; cols = (pad_l, up_w): column v's is v - pad_l
    # where up_w is 1), gated by gate > 0 where use_gate. An NCHW src with up_w 1 is read
    # from tb (H*W, cb), columns [tc0, tc0 + cg): the image's block of channels transposed by
    # :func:`_transposed` (a value at a time, as the strided reads below, takes ~1.5 ns) and,
    # for a dX, gated there by conv_tasks (use_gate False here); an NHWC one from src's pixel
    # rows. (Gated value by value, each NCHW dX value's gate was read for every tap: the deep
    # ResNeXt dX at (32, 512, 14, 14) 10.4 ms against 7.0 ungated; gated once: 7.7, machine A.)
    _, Hs, Ws, cg = slab.shape
    hsrc, wsrc = tables
    pad_l, up_w = cols
    if nhwc:
        _, Hin, Win, Cin = src.shape
    else:
        _, Cin, Hin, Win = src.shape
    d = slab.reshape(slab.size)
    d0 = i * Hs * Ws * cg
    ucg = _U(cg)
    if use_gate or up_w != 1:           # (a gated or strided dX: value by value)
        sf = src.reshape(src.size)
        gf = gate.reshape(gate.size)
        for u in range(Hs):
            h = hsrc[u]
            for v in range(Ws):
                wi = wsrc[v]
                o = _U(d0 + (u * Ws + v) * cg)
                if h < 0 or wi < 0:
                    for c in range(ucg):
                        d[o + c] = 0
                elif nhwc:
                    a = _U(((n * Hin + h) * Win + wi) * Cin + c0)
                    for c in range(ucg):
                        d[o + c] = _relu_grad(sf[a + c], gf[a + c]) if use_gate else sf[a + c]
                else:
                    a = _U(((n * Cin + c0) * Hin + h) * Win + wi)
                    for c in range(ucg):
                        e = a + c * _U(Hin * Win)
                        d[o + c] = _relu_grad(sf[e], gf[e]) if use_gate else sf[e]
        return
    if nhwc:            # the values of slab pixel (u, v): a run of cg at pf[(h*W + w)*ld + col]
        pf, r0, ld, col = src.reshape(src.size), n * Hin * Win, Cin, c0
    else:
        pf, r0, ld, col = tb.reshape(tb.size), 0, tb.shape[1], tc0
    vlo = min(Ws, max(0, pad_l))
    vhi = max(vlo, min(Ws, pad_l + Win))
    for u in range(Hs):
        h = hsrc[u]
        o = _U(d0 + u * Ws * cg)
        if h < 0:
            for e in range(o, o + _U(Ws * cg)):
                d[e] = 0
            continue
        for e in range(o, o + _U(vlo * cg)):
            d[e] = 0
        for e in range(o + _U(vhi * cg), o + _U(Ws * cg)):
            d[e] = 0
        a = (r0 + h * Win + vlo - pad_l) * ld + col
        dv = np.int64(d.ctypes.data) + 4 * (np.int64(o) + vlo * cg)
        sv = np.int64(pf.ctypes.data) + 4 * a
        for v in range(vhi - vlo):
            _copy8(dv + 4 * v * cg, sv + 4 * v * ld, cg // 8)


@njit(inline="always")
def _transposed(src, n, c0, tmp, i):
    # tmp[i] (H*W, cb) <- image n's channels [c0, c0 + cb) of an NCHW src, by 8 x 8 tiles
    _, C, H, W = src.shape
    cb = tmp.shape[2]
    transpose(src[n, c0:c0 + cb].reshape((cb, H * W)), tmp[i])


@njit(inline="always")
def _corners(rows, i, base, P, Q, Hs, Ws, sh, sw, cb):
    # rows of image i's output pixels: the slab address of each one's receptive field corner
    for p in range(P):
        r0 = (i * P + p) * Q
        a0 = base + 4 * ((i * Hs + p * sh) * Ws) * cb
        for q in range(Q):
            rows[r0 + q] = a0 + 4 * q * sw * cb


@task_kernel
def conv_tasks(t0, t1, src, gate, wt, bias, dims, flags, out):
    # out_g = relu?(conv(src_g gated?, wt_g) + bias_g?) for the merged groups g; src (N, Cin,
    # Hin, Win) | (N, Hin, Win, Cin), gate src's shape (y: src where gate > 0, else 0), wt
    # (Gm, R*S, cg, kg), bias (Kout,), out (N, Kout, P, Q) | (N, P, Q, Kout). Input pixel i
    # of slab row u is src's (u - pad_t) / up_h where that is whole and inside (the stride's
    # zeros of a dX), likewise columns. Task t: the gpb groups of block t % (Gm / gpb) (one
    # slab of their channels) of images [c*ipc, c*ipc + ipc), c = t // (Gm / gpb).
    (N, Cin, Hin, Win, Kout, R, S, P, Q, sh, sw, dh, dw, pad_t, pad_l, up_h, up_w, Gm, cg, kg,
     ipc, Hs, Ws, gpb, nhwc) = dims
    has_bias, relu, use_gate, wide = flags
    RS = R * S
    PQ = P * Q
    cb = gpb * cg
    nblk = Gm // gpb
    flat = nhwc or up_w != 1                      # (_fill reads src itself)
    slab = np.empty((ipc, Hs, Ws, cg), np.float32)
    tmp = np.empty((1 if flat else ipc, 0 if flat else Hin * Win, cb), np.float32)
    ytmp = np.empty((1, 0 if flat or not use_gate else Hin * Win, cb), np.float32)
    rows = np.empty(ipc * PQ, np.int64)
    toff = np.empty(RS, np.int64)
    cbuf = np.empty((0 if nhwc else ipc * PQ) * kg, np.float32)
    hsrc = np.empty(Hs, np.int64)
    wsrc = np.empty(Ws, np.int64)
    _sources(hsrc, pad_t, up_h, Hin)
    _sources(wsrc, pad_l, up_w, Win)
    for r in range(R):
        for s in range(S):
            toff[r * S + s] = (r * dh * Ws + s * dw) * cg
    base = np.int64(slab.ctypes.data)
    for i in range(ipc):                    # (the same slab for every task: its corners once)
        _corners(rows, i, base, P, Q, Hs, Ws, sh, sw, cg)
    o3 = out.reshape((N, Kout, PQ)) if not nhwc else out.reshape((N, PQ, Kout))
    for t in range(t0, t1):
        g0 = (t % nblk) * gpb
        n0 = (t // nblk) * ipc
        n1 = min(N, n0 + ipc)
        for i in range(n1 - n0 if not flat else 0):
            _transposed(src, n0 + i, g0 * cg, tmp, i)
            if use_gate:        # an NCHW stride-1 dX's g, gated once here (gate transposed
                _transposed(gate, n0 + i, g0 * cg, ytmp, 0)         # the same way)
                ti, yi = tmp[i].reshape(tmp[i].size), ytmp[0].reshape(ytmp[0].size)
                for e in range(ti.shape[0]):
                    ti[e] = _relu_grad(ti[e], yi[e])
        m = (n1 - n0) * PQ
        for g in range(g0, g0 + gpb):
            for i in range(n1 - n0):
                _fill(src, gate, use_gate and flat, nhwc, n0 + i, g * cg, (hsrc, wsrc),
                      (pad_l, up_w), tmp[0 if flat else i], (g - g0) * cg, slab, i)
            if nhwc:
                pc, ldc = np.int64(o3[n0].ctypes.data) + 4 * g * kg, Kout
            else:
                pc, ldc = np.int64(cbuf.ctypes.data), kg
            _taps.taps_step(((np.int64(m), np.int64(kg), np.int64(cg)), np.int64(RS),
                            np.int64(rows.ctypes.data), np.int64(toff.ctypes.data),
                            np.int64(wt[g].ctypes.data), np.int64(kg), pc, np.int64(ldc),
                            np.int64(bias.ctypes.data) + 4 * g * kg if has_bias else np.int64(0),
                            np.int64(1 if relu else 0), np.int64(1 if wide else 0)))
            if not nhwc:                  # (pixels, kg) -> each image's (kg, PQ) block
                cbm = cbuf[:m * kg].reshape((m, kg))
                for i in range(n1 - n0):
                    transpose(cbm[i * PQ:(i + 1) * PQ], o3[n0 + i, g * kg:(g + 1) * kg])


@task_kernel
def dw_tasks(t0, t1, x, gy, y, dims, flags, parts):
    # parts[g] (R*S, kg, cg) <- merged group g's dW taps: for tap (r, s), sum over the images
    # (in order, ipc at a time) of g^T (kg, pixels) @ the pixels' tap rows of x's slab, g =
    # gy * (y > 0)? of the group's filters. x (N, C, H, W) | (N, H, W, C); gy, y (N, K, P, Q)
    # | (N, P, Q, K). Task t: the gpb groups of block t (one slab of their channels).
    (N, C, H, W, K, R, S, P, Q, sh, sw, dh, dw, ph, pw, Gm, cg, kg, ipc, Hs, Ws, gpb,
     nhwc) = dims
    use_gate, wide = flags
    RS = R * S
    PQ = P * Q
    cb = gpb * cg
    slab = np.empty((ipc, Hs, Ws, cg), np.float32)
    tmp = np.empty((1 if nhwc else ipc, 0 if nhwc else H * W, cb), np.float32)
    rows = np.empty(ipc * PQ, np.int64)
    toff = np.empty(RS, np.int64)
    gt = np.empty((gpb * kg, ipc * PQ), np.float32)
    gtf = gt.reshape(gt.size)
    gyf, yf = gy.reshape(gy.size), y.reshape(y.size)
    gy2, y2 = gy.reshape((N * PQ, K)), y.reshape((N * PQ, K))
    yt = np.empty((gpb * kg if nhwc and use_gate else 0, PQ), np.float32)
    hsrc = np.empty(Hs, np.int64)
    wsrc = np.empty(Ws, np.int64)
    _sources(hsrc, ph, 1, H)
    _sources(wsrc, pw, 1, W)
    for r in range(R):
        for s in range(S):
            toff[r * S + s] = (r * dh * Ws + s * dw) * cg
    base = np.int64(slab.ctypes.data)
    for i in range(ipc):                    # (the same slab for every task: its corners once)
        _corners(rows, i, base, P, Q, Hs, Ws, sh, sw, cg)
    ld = ipc * PQ
    for blk in range(t0, t1):
        g0 = blk * gpb
        k0 = g0 * kg
        for n0 in range(0, N, ipc):
            n1 = min(N, n0 + ipc)
            m = (n1 - n0) * PQ
            for i in range(n1 - n0):
                n = n0 + i
                if not nhwc:
                    _transposed(x, n, g0 * cg, tmp, i)
                if nhwc:                    # g^T's columns of image i: pixels' rows of K
                    gti = gt[:, i * PQ:(i + 1) * PQ]                  # (gpb*kg, PQ)
                    transpose(gy2[n * PQ:(n + 1) * PQ, k0:k0 + gpb * kg], gti)
                    if use_gate:                    # (y's block the same way, then the gate)
                        transpose(y2[n * PQ:(n + 1) * PQ, k0:k0 + gpb * kg], yt)
                        for k in range(gpb * kg):
                            gr, yr = gti[k], yt[k]
                            for j in range(PQ):
                                gr[j] = _relu_grad(gr[j], yr[j])
                else:
                    for k in range(gpb * kg):
                        e0 = _U((n * K + k0 + k) * PQ)
                        o = _U(k * ld + i * PQ)
                        for j in range(_U(PQ)):
                            a = gyf[e0 + j]
                            gtf[o + j] = _relu_grad(a, yf[e0 + j]) if use_gate else a
            for g in range(g0, g0 + gpb):
                for i in range(n1 - n0):
                    _fill(x, x, False, nhwc, n0 + i, g * cg, (hsrc, wsrc), (pw, 1),
                          tmp[0 if nhwc else i], (g - g0) * cg, slab, i)
                for tap in range(RS):
                    _taps.gather_step((np.int64(kg), np.int64(cg), np.int64(m),
                                       np.int64(gt[(g - g0) * kg].ctypes.data), np.int64(ld),
                                       np.int64(rows.ctypes.data), toff[tap],
                                       np.int64(parts[g, tap].ctypes.data), np.int64(cg),
                                       np.int64(0 if n0 == 0 else 1),
                                       np.int64(1 if wide else 0)))


def _blocks(G, least, most):
    """Groups a block (a divisor of G): the most, up to ``most``, that still makes ``least``
    blocks (one where G < least)."""
    for blocks in range(1, G + 1):
        if G % blocks == 0 and blocks >= least and G // blocks <= max(1, most):
            return G // blocks
    return 1


def _sizes(geom):
    """(m, merged groups, their channels, their filters) of ``geom`` (:func:`merged`)."""
    m = merged(geom)
    return m, geom.groups // m, m * geom.C // geom.groups, m * geom.K // geom.groups


def _dims(*values):
    return tuple(np.int64(v) for v in values)


def _layout(geom):
    return int(geom.layout == "NHWC")


def forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w, groups) + b?)`` (:func:`fits`)."""
    m, G, cg, kg = _sizes(geom)
    P, Q = geom.P, geom.Q
    if geom.layout == "NHWC" and BANDS:
        return _bands.conv(x, _weights.derived(w, ("grouped taps", geom.groups, m),
                                               lambda: _taps_of(w, geom, m)), b, geom, relu,
                           (G, cg, kg))
    ipc = _images(geom.N, P * Q)
    Hs, Ws = slab_shape(geom, P)
    y = _out.empty(geom.y_shape, np.float32)
    H, W = geom.H, geom.W
    chunks = -(-geom.N // ipc)
    gpb = _blocks(G, -(-TASKS_A_THREAD * num_threads() // chunks),
                  BLOCK_VALUES // (ipc * H * W * cg))
    _taps.ready()
    launch(conv_tasks, chunks * (G // gpb), x, x,
           _weights.derived(w, ("grouped taps", geom.groups, m), lambda: _taps_of(w, geom, m)),
           b if b is not None else np.empty(0, np.float32),
           _dims(geom.N, geom.C, H, W, geom.K, geom.R, geom.S, P, Q, geom.sh, geom.sw,
                 geom.dh, geom.dw, geom.ph, geom.pw, 1, 1, G, cg, kg, ipc, Hs, Ws, gpb,
                 _layout(geom)),
           (b is not None, bool(relu), False, _taps.WIDE), y,
           work=x.size + y.size, grain=1)
    return y


def _gated(gy, y):
    """g = gy * (y > 0), float32, gy's shape, in a buffer of the output cache
    (``basic.cpu.relu_backward``): an NHWC backward's passes then read g ungated (the same
    values: the same bits), not each its gate: the dX's slabs a value at a time, the dW's
    blocks of y transposed."""
    return _relu_backward(gy, y, out=_out.empty(gy.shape, np.float32))


def backward(gy, x, w, geom, y, need):
    """``(dx, dw, db)`` (``need``'s; the others None) of the grouped conv, gy gated by
    ``y > 0`` where y is given (:func:`fits`)."""
    need_dx, need_dw, need_db = (bool(v) for v in need)
    m, G, cg, kg = _sizes(geom)
    R, S, P, Q, H, W = geom.R, geom.S, geom.P, geom.Q, geom.H, geom.W
    nhwc = _layout(geom)
    if nhwc and y is not None and BANDS and (need_dx or need_dw):
        gy, y = _gated(gy, y), None          # (g once, for the passes below: the same values)
    gate = y if y is not None else gy
    use_gate = y is not None
    _taps.ready()
    dx = dw = db = None
    tgeom = _bands.dx_geometry(geom) if need_dx and BANDS else None
    if need_dx:
        # dx = conv(g upsampled by the stride, w flipped and transposed), stride 1
        wd = _weights.derived(w, ("grouped dx taps", geom.groups, m), lambda: np.ascontiguousarray(
            _taps_of(w, geom, m)[:, ::-1].transpose(0, 1, 3, 2)))
    if tgeom is not None:
        dx = _bands.conv(gy, wd, None, tgeom, False, (G, kg, cg))
    elif need_dx:
        ipc = _images(geom.N, H * W)
        chunks = -(-geom.N // ipc)
        gpb = _blocks(G, -(-TASKS_A_THREAD * num_threads() // chunks),
                      BLOCK_VALUES // (ipc * P * Q * kg))
        dx = _out.empty(geom.x_shape, np.float32)
        launch(conv_tasks, chunks * (G // gpb), gy, gate, wd, np.empty(0, np.float32),
               _dims(geom.N, geom.K, P, Q, geom.C, R, S, H, W, 1, 1, geom.dh, geom.dw,
                     (R - 1) * geom.dh - geom.ph, (S - 1) * geom.dw - geom.pw, geom.sh,
                     geom.sw, G, kg, cg, ipc, H + (R - 1) * geom.dh, W + (S - 1) * geom.dw,
                     gpb, nhwc),
               (False, False, use_gate, _taps.WIDE), dx, work=gy.size + dx.size, grain=1)
    if need_dw and nhwc and BANDS and _bands.banded_dw(cg):
        parts = _bands.dw_parts(x, gy, geom, (G, cg, kg))
    elif need_dw:
        ipc = _images(geom.N, P * Q)
        Hs, Ws = slab_shape(geom, P)
        parts = _out.empty((G, R * S, kg, cg), np.float32)
        gpb = _blocks(G, num_threads(), BLOCK_VALUES // (ipc * H * W * cg))
        _taps.ready(gather=True)
        launch(dw_tasks, G // gpb, x, gy, gate,
               _dims(geom.N, geom.C, H, W, geom.K, R, S, P, Q, geom.sh, geom.sw, geom.dh,
                     geom.dw, geom.ph, geom.pw, G, cg, kg, ipc, Hs, Ws, gpb, nhwc),
               (use_gate, _taps.WIDE), parts, work=x.size + gy.size, grain=1)
    if need_dw:
        Cg, Kg = geom.C // geom.groups, geom.K // geom.groups
        blocks = parts.reshape(G, R * S, m, Kg, m, Cg)
        diag = np.stack([blocks[:, :, a, :, a, :] for a in range(m)], axis=1)  # (G, m, RS, Kg, Cg)
        dw = np.ascontiguousarray(diag.reshape(geom.groups, R, S, Kg, Cg).transpose(0, 3, 4, 1, 2)
                                  ).reshape(geom.K, Cg, R, S)
    if need_db:
        db = gated_channel_sums(gy, y, geom.layout)
    return dx, dw, db
