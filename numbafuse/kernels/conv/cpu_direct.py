r"""CPU convolution tasks without im2col: pointwise GEMMs, and shifted GEMMs over phase planes
for any stride (3x3 stride-1 filters go to ``cpu_winograd.py``, tiny channel counts to
``cpu_im2col.py``). See ``cpu.py`` for which runs when.

**Pointwise** (1x1, stride 1, unpadded): x itself is the GEMM operand, so a chunk is one GEMM
straight into y (then bias and ReLU in place while it is in cache), dX one GEMM of the gated
gradient straight into dx, dW one GEMM per chunk; nothing is copied but g.

**Phase planes** (forward, dW). Output pixel (p, q) reads, through tap (r, s), the padded
input at row ``p*sh + r*dh``, column ``q*sw + s*dw``. Split the padded input into the phase
planes ``plane[a, b][i, j] = pad[i*sh + a, j*sw + b]``: the tap reads plane
``(r*dh % sh, s*dw % sw)`` at ``(p + r*dh // sh, q + s*dw // sw)``. With a chunk's planes
flattened over rows of width ``Wq = Q + max_s (s*dw // sw)``, tap (r, s) of all the chunk's
outputs is one *shifted view* of its plane, at offset ``(r*dh // sh)*Wq + s*dw // sw``, so the
chunk's output, computed on the width Wq (the junk columns q >= Q are dropped), is a sum of
R*S GEMMs over views of planes that hold the input once (im2col copies it R*S times):

    NCHW  out (Co, m') += w_rs (Co, Ci) @ plane[:, off : off + m']       (ld of the plane)
    NHWC  out (m', Co) += plane[off : off + m', :] (m', Ci) @ w_rs^T (Ci, Co)
    dW    NCHW  dw_rs (K, C) += g' (K, m') @ plane[:, off : off + m']^T
          NHWC  dw_rs (K, C) += g'^T (K, m') @ plane[off : off + m', :]

with m' = rows * Wq and g' the gated gradient on the width Wq (zeros in the junk columns).
Stride 1 is one plane. Only the planes some tap reads are built (a 1x1 stride-2 conv: one).

**dX by phases** (any stride). Input rows ``h = a + sh*i`` of phase a are reached by the taps r
with ``(a + ph - r*dh) % sh == 0``, from output row ``i + (a + ph - r*dh) // sh`` (likewise
columns): so each input phase (a, b) is a sum of GEMMs over shifted views of *one* zero-padded
copy of the chunk's gradient g = gy * (y > 0), a copy shared by all phases:

    NCHW  dxph (C, m') += w_rs^T (C, K) @ gpad[:, off : off + m']
    NHWC  dxph (m', C) += gpad[off : off + m', :] @ w_rs (K, C)

scattered with stride (sh, sw) into dx; every dx element is written by exactly one task (a task
owns the phase rows [i0, i1) of one image, i.e. the dx rows [sh*i0, sh*i1)). Stride 1 is one
phase with every tap (a correlation with the flipped taps).
"""
import numpy as np
from numba import njit, types

from ..cpu import blas as _blas
from ..cpu import gemm_taps as _gemm_taps
from ..cpu.launch import task_kernel
from ..cpu.steps import Step, array as _arr, ready as _ready_steps
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)

from .cpu_chunks import gated_chw, gated_hwc  # noqa: E402

# A flag passed to a compiled step as a variable (a constant is typed as a literal: a
# signature of its own, compiled again)
OFF = np.bool_(False)


@njit(inline="always")
def _span(left, b, sw, Ws, Wq):
    # plane columns j < Wq whose source column j*sw + b - left lies in [0, Ws): [jlo, jhi)
    jlo = min(max(0, -((b - left) // sw)), Wq)                   # ceil((left - b) / sw)
    jhi = max(jlo, min(Wq, -((b - left - Ws) // sw)))            # ceil((Ws + left - b) / sw)
    return jlo, jhi


@njit(nogil=True, cache=True)
def _plane_chw(src, gate, use_gate, rows, phase, pad, Wq, dst):
    # src, gate: (N, C, Hs, Ws); rows = (n, u0, nrows), phase = (sh, a, sw, b), pad = (top,
    # left); dst: (C, ld) <- dst[c, i*Wq + j] = padded[(u0 + i)*sh + a, j*sw + b] for i <
    # nrows, j < Wq, padded = src[n] (times gate > 0) shifted by top rows and left columns,
    # zero outside; the columns past nrows*Wq (read by the last views) are zeroed
    n, u0, nrows = rows
    sh, a, sw, b = phase
    top, left = pad
    C, Hs, Ws = src.shape[1], src.shape[2], src.shape[3]
    jlo, jhi = _span(left, b, sw, Ws, Wq)
    w0 = jlo * sw + b - left                                     # source column of jlo
    cnt = jhi - jlo
    for c in range(C):
        row = dst[c]                                              # (ld,)
        for i in range(nrows):
            d = row[i * Wq:(i + 1) * Wq]                          # (Wq,)
            h = (u0 + i) * sh + a - top
            if h < 0 or h >= Hs or cnt == 0:
                for j in range(Wq):
                    d[j] = 0
                continue
            for j in range(jlo):
                d[j] = 0
            for j in range(jhi, Wq):
                d[j] = 0
            dv = d[jlo:jhi]
            sv = src[n, c, h, w0:w0 + (cnt - 1) * sw + 1:sw]      # (cnt,)
            if use_gate:
                gv = gate[n, c, h, w0:w0 + (cnt - 1) * sw + 1:sw]
                for j in range(cnt):
                    dv[j] = _relu_grad(sv[j], gv[j])
            else:
                for j in range(cnt):
                    dv[j] = sv[j]
        for i in range(nrows * Wq, row.shape[0]):
            row[i] = 0


@njit(nogil=True, cache=True)
def _plane_hwc(src, gate, use_gate, rows, phase, pad, Wq, dst):
    # src, gate: (N, Hs, Ws, C); dst: (ld, C) <- dst[i*Wq + j] = padded[(u0 + i)*sh + a,
    # j*sw + b] as in _plane_chw; rows past nrows*Wq zeroed
    n, u0, nrows = rows
    sh, a, sw, b = phase
    top, left = pad
    Hs, Ws, C = src.shape[1], src.shape[2], src.shape[3]
    jlo, jhi = _span(left, b, sw, Ws, Wq)
    w0 = jlo * sw + b - left
    cnt = jhi - jlo
    flat = dst.reshape(dst.shape[0] * C)
    for i in range(nrows):
        d = flat[i * Wq * C:(i + 1) * Wq * C]                     # (Wq*C,)
        h = (u0 + i) * sh + a - top
        if h < 0 or h >= Hs or cnt == 0:
            for v in range(Wq * C):
                d[v] = 0
            continue
        for v in range(jlo * C):
            d[v] = 0
        for v in range(jhi * C, Wq * C):
            d[v] = 0
        if sw == 1:                                               # one contiguous run
            dv = d[jlo * C:jhi * C]
            sv = src[n, h].reshape(Ws * C)[w0 * C:(w0 + cnt) * C]
            if use_gate:
                gv = gate[n, h].reshape(Ws * C)[w0 * C:(w0 + cnt) * C]
                for v in range(cnt * C):
                    dv[v] = _relu_grad(sv[v], gv[v])
            else:
                for v in range(cnt * C):
                    dv[v] = sv[v]
            continue
        for j in range(cnt):
            dv = d[(jlo + j) * C:(jlo + j + 1) * C]               # (C,)
            sv = src[n, h, w0 + j * sw]
            if use_gate:
                gv = gate[n, h, w0 + j * sw]
                for c in range(C):
                    dv[c] = _relu_grad(sv[c], gv[c])
            else:
                for c in range(C):
                    dv[c] = sv[c]
    for v in range(nrows * Wq * C, flat.shape[0]):
        flat[v] = 0


# --------------------------------------------------------------------------- phase planes

# The plane copies as steps (cpu/steps.py): the phase kernels call them through slots, so
# their code is compiled once per dtype, not again inside each of the three kernels.
_I = types.int64


def _plane_signatures(f):
    # src, gate, use_gate, rows (n, u0, nrows), phase (sh, a, sw, b), pad (top, left), Wq, dst
    return [(_arr(f, 4), _arr(f, 4), types.boolean, types.UniTuple(_I, 3),
             types.UniTuple(_I, 4), types.UniTuple(_I, 2), _I, _arr(f, 2))]


PLANE_CHW = Step(_plane_chw.py_func, _plane_signatures)
PLANE_HWC = Step(_plane_hwc.py_func, _plane_signatures)
_plane_chw_step, _plane_hwc_step = PLANE_CHW.call, PLANE_HWC.call


def ready(dtype):
    """The plane copies compiled for ``dtype`` and their slots filled: host code calls this
    before it launches phase_tasks, phase_dw_tasks or phase_dx_tasks (and
    ``gemm_taps.ready()`` before a kernel whose plan has taps)."""
    _ready_steps(dtype, (PLANE_CHW, PLANE_HWC))


@task_kernel
def phase_tasks(t0, t1, x, wtap, taps, dims, bias, relu, nhwc, blas, y):
    tap_plane, tap_off, planes = taps
    sh, sw, ph, pw, ext, Wq, slack, rpc = dims
    # x: (N, C, H, W) | (N, H, W, C); wtap: (R*S, K, C) | (R*S, C, K) (w_rs, w_rs^T);
    # tap_plane, tap_off (R*S,): the plane (index into planes (np, 2) of phases (a, b)) and
    # offset read by each tap; y: (N, K, P, Q) | (N, P, Q, K) = relu?(conv + bias), bias (K,)
    # zeros for none. Chunk t = output rows [o0, o1) of one image; a plane holds rows
    # o0 .. o1 + ext of width Wq (+ slack)
    if nhwc:
        N, P, Q, K = y.shape
        C = x.shape[3]
    else:
        N, K, P, Q = y.shape
        C = x.shape[1]
    npl = planes.shape[0]
    nblk = (P + rpc - 1) // rpc
    pbuf = np.empty((npl, C * ((rpc + ext) * Wq + slack)), x.dtype)
    obuf = np.empty(K * rpc * Wq, x.dtype)
    for t in range(t0, t1):
        n = t // nblk
        o0 = (t - n * nblk) * rpc
        o1 = min(P, o0 + rpc)
        m = (o1 - o0) * Wq                                        # outputs on the width Wq
        ld = (o1 - o0 + ext) * Wq + slack
        if nhwc:
            for pi in range(npl):
                _plane_hwc_step((x, x, OFF, (n, o0, o1 - o0 + ext),
                                 (sh, planes[pi, 0], sw, planes[pi, 1]), (ph, pw), Wq,
                                 pbuf[pi, :ld * C].reshape((ld, C))))
            ob = obuf[:m * K].reshape((m, K))                     # (m', K)
            for tap in range(wtap.shape[0]):
                pb = pbuf[tap_plane[tap], :ld * C].reshape((ld, C))
                _blas.gemm(blas, False, False, (m, K, C), 1.0, pb[tap_off[tap]:], C, wtap[tap],
                           K, 0.0 if tap == 0 else 1.0, ob, K)
            for p in range(o0, o1):
                for q in range(Q):
                    sr, dr = ob[(p - o0) * Wq + q], y[n, p, q]    # (K,) each
                    for k in range(K):
                        v = sr[k] + bias[k]
                        dr[k] = _relu(v) if relu else v
        else:
            for pi in range(npl):
                _plane_chw_step((x, x, OFF, (n, o0, o1 - o0 + ext),
                                 (sh, planes[pi, 0], sw, planes[pi, 1]), (ph, pw), Wq,
                                 pbuf[pi, :C * ld].reshape((C, ld))))
            ob = obuf[:K * m].reshape((K, m))                     # (K, m')
            for tap in range(wtap.shape[0]):
                pb = pbuf[tap_plane[tap], :C * ld].reshape((C, ld))
                _blas.gemm(blas, False, False, (K, m, C), 1.0, wtap[tap], C, pb[:, tap_off[tap]:],
                           ld, 0.0 if tap == 0 else 1.0, ob, m)
            for k in range(K):
                bk = bias[k]
                for p in range(o0, o1):
                    sr, dr = ob[k, (p - o0) * Wq:(p - o0) * Wq + Q], y[n, k, p]   # (Q,)
                    for q in range(Q):
                        v = sr[q] + bk
                        dr[q] = _relu(v) if relu else v


@task_kernel
def phase_dw_tasks(t0, t1, x, gy, y, use_mask, taps, dims, need_dw, nhwc, blas, parts):
    tap_plane, tap_off, planes = taps
    sh, sw, ph, pw, ext, Wq, slack, rpc, nchunks, groups = dims
    dw_parts, db_parts = parts
    # x: (N, C, H, W) | (N, H, W, C); gy, y: (N, K, P, Q) | (N, P, Q, K); dw_parts: (groups,
    # R*S, K, C) <- each group's dW per tap; db_parts: (groups, K) float64 <- its sum of g.
    # Chunks and planes as in phase_tasks; groups of chunks fixed by the shape
    if nhwc:
        N, P, Q, K = gy.shape
        C = x.shape[3]
    else:
        N, K, P, Q = gy.shape
        C = x.shape[1]
    npl = planes.shape[0]
    nblk = (P + rpc - 1) // rpc
    pbuf = np.empty((npl, C * ((rpc + ext) * Wq + slack) if need_dw else 0), x.dtype)
    gbuf = np.empty(K * rpc * Wq, x.dtype)
    for grp in range(t0, t1):
        dbp = db_parts[grp]                                       # (K,)
        dbp[:] = 0.0
        first = True
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n = t // nblk
            p0 = (t - n * nblk) * rpc
            p1 = min(P, p0 + rpc)
            m = (p1 - p0) * Wq
            ld = (p1 - p0 + ext) * Wq + slack
            beta = 0.0 if first else 1.0
            first = False
            if nhwc:
                g = gbuf[:m * K].reshape((m, K))                  # (m', K), junk rows 0
                gy2, y2 = gy[n].reshape((P * Q, K)), y[n].reshape((P * Q, K))
                for p in range(p0, p1):
                    gated_hwc(gy2, y2, use_mask, p * Q, (p + 1) * Q, g, (p - p0) * Wq, dbp)
                    for q in range(Q, Wq):
                        g[(p - p0) * Wq + q, :] = 0
                if not need_dw:
                    continue
                for pi in range(npl):
                    _plane_hwc_step((x, x, OFF, (n, p0, p1 - p0 + ext),
                                     (sh, planes[pi, 0], sw, planes[pi, 1]), (ph, pw), Wq,
                                     pbuf[pi, :ld * C].reshape((ld, C))))
                for tap in range(tap_plane.shape[0]):
                    pb = pbuf[tap_plane[tap], :ld * C].reshape((ld, C))
                    # dW_rs (K, C) += g'^T (K, m') @ plane[off:off+m'] (m', C)
                    _blas.gemm(blas, True, False, (K, C, m), 1.0, g, K, pb[tap_off[tap]:], C,
                               beta, dw_parts[grp, tap], C)
            else:
                g = gbuf[:K * m].reshape((K, m))                  # (K, m'), junk columns 0
                gyf, yf = gy.reshape((N, K, P * Q)), y.reshape((N, K, P * Q))
                if Wq == Q:                                       # no junk: one block
                    gated_chw(gyf, yf, use_mask, n, p0, p1, P * Q, Q, g, 0, dbp)
                else:
                    for p in range(p0, p1):
                        gated_chw(gyf, yf, use_mask, n, p, p + 1, P * Q, Q, g, (p - p0) * Wq, dbp)
                        for q in range(Q, Wq):
                            g[:, (p - p0) * Wq + q] = 0
                if not need_dw:
                    continue
                for pi in range(npl):
                    _plane_chw_step((x, x, OFF, (n, p0, p1 - p0 + ext),
                                     (sh, planes[pi, 0], sw, planes[pi, 1]), (ph, pw), Wq,
                                     pbuf[pi, :C * ld].reshape((C, ld))))
                for tap in range(tap_plane.shape[0]):
                    pb = pbuf[tap_plane[tap], :C * ld].reshape((C, ld))
                    # dW_rs (K, C) += g' (K, m') @ plane[:, off:off+m']^T (m', C)
                    _blas.gemm(blas, False, True, (K, C, m), 1.0, g, m, pb[:, tap_off[tap]:], ld,
                               beta, dw_parts[grp, tap], C)


@task_kernel
def phase_dx_tasks(t0, t1, gy, y, use_mask, wtap, table, dims, nhwc, blas, wph, dx):
    ph_taps, ph_start, ent_tap, ent_off = table
    gmin, gext, gleft, Wg, slack, rpc, sh, sw, taps = dims
    # gy, y: (N, K, P, Q) | (N, P, Q, K); wtap: (R*S, C, K) | (R*S, K, C) (w_rs^T, w_rs);
    # input phase f = a*sw + b reads the taps ent_tap[ph_start[f] : + ph_taps[f]] at the
    # offsets ent_off[...] of the chunk's padded g, which holds g rows i0 + gmin ... of width
    # Wg (g column v at v + gleft); dx: (N, C, H, W) | (N, H, W, C). Task t = phase rows
    # [i0, i1) of one image (dx rows [sh*i0, sh*i1)), every phase. taps (NHWC, float32, C % 8
    # == 0): 1 or 2 (16-float vectors): each phase's taps summed in the registers of
    # cpu.gemm_taps's tiles (a row address per g pixel, an offset per tap) from wph = wtap in
    # entry order, (entries, K, C); 0: a BLAS GEMM per tap
    if nhwc:
        N, H, W, C = dx.shape
        K = gy.shape[3]
    else:
        N, C, H, W = dx.shape
        K = gy.shape[1]
    rows = (H + sh - 1) // sh                                     # phase rows, most
    nblk = (rows + rpc - 1) // rpc
    gpad = np.empty(K * ((rpc + gext) * Wg + slack), dx.dtype)
    dbuf = np.empty(C * rpc * Wg, dx.dtype)
    prow = np.empty(rpc * Wg if taps else 0, np.int64)
    aoff = np.empty(ent_off.size if taps else 0, np.int64)
    one, zero = np.int64(1), np.int64(0)     # (variables: a constant is typed as a literal)
    for t in range(t0, t1):
        n = t // nblk
        i0 = (t - n * nblk) * rpc
        i1 = min(rows, i0 + rpc)
        ld = (i1 - i0 + gext) * Wg + slack
        if nhwc:
            gb = gpad[:ld * K].reshape((ld, K))
            _plane_hwc_step((gy, y, use_mask, (n, i0 + gmin, i1 - i0 + gext),
                             (one, zero, one, zero), (zero, gleft), Wg, gb))
        else:
            gb = gpad[:K * ld].reshape((K, ld))
            _plane_chw_step((gy, y, use_mask, (n, i0 + gmin, i1 - i0 + gext),
                             (one, zero, one, zero), (zero, gleft), Wg, gb))
        for f in range(sh * sw):
            a, b = f // sw, f % sw
            r1 = min(i1, (H - a + sh - 1) // sh)                  # this phase's rows
            Wb = (W - b + sw - 1) // sw
            if r1 <= i0 or Wb <= 0:
                continue
            m = (r1 - i0) * Wg
            nt = ph_taps[f]
            if nhwc:
                d = dbuf[:m * C].reshape((m, C))                  # (m', C)
                if taps:                                          # every tap at once
                    _gemm_taps.dense_rows(prow, np.int64(gb.ctypes.data), m, K)
                    for e in range(nt):
                        aoff[e] = ent_off[ph_start[f] + e] * K
                    _gemm_taps.taps_step(((np.int64(m), np.int64(C), np.int64(K)), np.int64(nt),
                                         np.int64(prow.ctypes.data), np.int64(aoff.ctypes.data),
                                         np.int64(wph.ctypes.data) + 4 * ph_start[f] * K * C,
                                         np.int64(C), np.int64(d.ctypes.data), np.int64(C),
                                         np.int64(0), np.int64(0), np.int64(taps - 1)))
                else:                                             # a BLAS GEMM a tap
                    if nt == 0:
                        d[:] = 0
                    for e in range(ph_start[f], ph_start[f] + nt):
                        _blas.gemm(blas, False, False, (m, C, K), 1.0, gb[ent_off[e]:], K,
                                   wtap[ent_tap[e]], C, 0.0 if e == ph_start[f] else 1.0, d, C)
                for i in range(i0, r1):
                    for j in range(Wb):
                        src, dst = d[(i - i0) * Wg + j], dx[n, a + i * sh, b + j * sw]   # (C,)
                        for c in range(C):
                            dst[c] = src[c]
            else:
                d = dbuf[:C * m].reshape((C, m))                  # (C, m')
                if nt == 0:
                    d[:] = 0
                for e in range(ph_start[f], ph_start[f] + nt):
                    _blas.gemm(blas, False, False, (C, m, K), 1.0, wtap[ent_tap[e]], K,
                               gb[:, ent_off[e]:], ld, 0.0 if e == ph_start[f] else 1.0, d, m)
                for c in range(C):
                    for i in range(i0, r1):
                        src = d[c, (i - i0) * Wg:(i - i0) * Wg + Wb]   # (Wb,)
                        if sw == 1:
                            dst = dx[n, c, a + i * sh]            # (W,)
                            for j in range(Wb):
                                dst[j] = src[j]
                        else:
                            dst = dx[n, c, a + i * sh, b:b + (Wb - 1) * sw + 1:sw]   # (Wb,)
                            for j in range(Wb):
                                dst[j] = src[j]
