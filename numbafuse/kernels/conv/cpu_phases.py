"""Phase planes of one input plane, for the NCHW depthwise kernels (``cpu_depthwise``): a
plane zero-padded and split by its stride phases, so that each tap of a strided convolution
is a fixed offset into one phase (``split_phases``), and the inverse (``merge_phases``, dX).
At stride 2 along w both column phases of a row are written at once, in vector shuffles
(``cpu.pairs``): 3x3 stride 2 at (32, 64, 56, 56), 1 thread, machine A, forward 6.6-7.7 ->
6.2-6.4 ms, dX 7.8-8.7 -> 7.0-7.2 (three alternating runs each). The split writes only the
values from the plane (its callers zero the buffer once: the padding never changes within a
launch) and takes a row's pairs by address, its last 8 pairs one more overlapping block:
the split had still been 4 of the 6.3 ms forward (per row: five slices, four zeroed edges
and a scalar remainder of 4 pairs); forward 6.3-6.4 -> 5.0-5.5 ms, 7x7 stride 2 at (32, 96,
28, 28) 4.5-5.4 -> 3.3-3.7, dW 8.4 -> 7.4-7.8 (``benchmarks/depthwise_passes.py``, two
alternating runs).
"""
import numpy as np
from numba import njit, types

from ..cpu.pairs import copy_at, merge_pairs_at, split_pairs_at
from ..cpu.steps import Step, array as _arr


@njit(cache=True)
def _phase_columns(b, sw, left, W, Wph):
    # (j0, j1): the columns j of a phase row whose source column j*sw + b - left is in [0, W)
    j0 = max(0, (left - b + sw - 1) // sw)
    j1 = min(Wph, (W - 1 + left - b) // sw + 1) if W - 1 + left - b >= 0 else 0
    return j0, max(j0, j1)


@njit(cache=True)
def _stride2_columns(left, W, Wph):
    # stride 2 along w: (be, bo, j0e, j0o, m, ne, no): source column 2k (even) is column
    # j0e + k of phase be, 2k + 1 (odd) column j0o + k of phase bo, for k < ne (no) (the
    # _phase_columns ranges); m = min(ne, no), the whole pairs
    be = left % 2
    j0e, j1e = _phase_columns(be, 2, left, W, Wph)
    j0o, j1o = _phase_columns(1 - be, 2, left, W, Wph)
    return be, 1 - be, j0e, j0o, min(j1e - j0e, j1o - j0o), j1e - j0e, j1o - j0o


@njit(cache=True)
def split_phases(src, top, left, sh, sw, Wph, out):
    # src: (H, W) plane;  out: (sh*sw, Hph*Wph) <- its zero-padded copy split by phase:
    # out[a*sw + b, i*Wph + j] = src[i*sh + a - top, j*sw + b - left], 0 outside src. Only
    # the values from src are written: out's padding must be zero already (zero out once
    # before the first plane; every plane of one geometry writes the same positions). Rows
    # by address where src's are contiguous, and where every row is pairs only one loop of
    # addresses alone: the per-row remainder loops, even unentered, had made the split ~4x
    # as slow (docs/conv_bias_relu.md, "Phase planes by address")
    H, W = src.shape
    plane = out.shape[1]
    Hph = plane // Wph
    isz = src.itemsize
    flat = src.strides[1] == isz and src.strides[0] == W * isz
    ps, pout = np.intp(src.ctypes.data), np.intp(out.ctypes.data)
    if sw == 2:                   # both column phases of a row at once, in vector shuffles
        be, bo, j0e, j0o, m, ne, no = _stride2_columns(left, W, Wph)
        whole = m >= 8 and flat
        if whole and ne == m and no == m:           # every row pairs only: addresses alone
            for a in range(sh):
                pe = pout + ((a * 2 + be) * plane + j0e) * isz
                po = pout + ((a * 2 + bo) * plane + j0o) * isz
                for i in range(Hph):
                    h = i * sh + a - top
                    if 0 <= h < H:
                        split_pairs_at(ps + h * W * isz, pe + i * Wph * isz, po + i * Wph * isz,
                                       m, src)
            return
        for a in range(sh):
            ke, ko = a * 2 + be, a * 2 + bo
            for i in range(Hph):
                h = i * sh + a - top
                if h < 0 or h >= H:
                    continue
                e0, o0 = i * Wph + j0e, i * Wph + j0o
                k0 = 0
                if whole:
                    split_pairs_at(ps + h * W * isz, pout + (ke * plane + e0) * isz,
                                   pout + (ko * plane + o0) * isz, m, src)
                    k0 = m
                for k in range(k0, ne):
                    out[ke, e0 + k] = src[h, 2 * k]
                for k in range(k0, no):
                    out[ko, o0 + k] = src[h, 2 * k + 1]
        return
    for a in range(sh):
        for b in range(sw):
            _split_phase(src, top, left, sh, sw, Wph, out, a, b)


@njit(cache=True)
def pad_plane(src, top, left, Wph, out):
    # split_phases at stride 1: out (1, Hph*Wph) <- src zero-padded (the values from src
    # only, as split_phases). A step of its own: it compiles in a fraction of split_phases'
    # time, whose stride-2 paths a stride-1 conv never runs
    _split_phase(src, top, left, 1, 1, Wph, out, 0, 0)


@njit(cache=True)
def _split_phase(src, top, left, sh, sw, Wph, out, a, b):
    # phase (a, b) of split_phases, element by element or (sw == 1, contiguous rows) a row
    # by address
    H, W = src.shape
    plane = out.shape[1]
    Hph = plane // Wph
    isz = src.itemsize
    flat = src.strides[1] == isz and src.strides[0] == W * isz
    ps, pout = np.intp(src.ctypes.data), np.intp(out.ctypes.data)
    o = a * sw + b
    j0, j1 = _phase_columns(b, sw, left, W, Wph)
    c0 = j0 * sw + b - left                             # the source column of phase column j0
    for i in range(Hph):
        h = i * sh + a - top
        if h < 0 or h >= H or j1 == j0:
            continue
        d0 = i * Wph + j0
        if sw == 1 and flat:
            copy_at(pout + (o * plane + d0) * isz, ps + (h * W + c0) * isz, j1 - j0, src)
        else:
            for j in range(j1 - j0):
                out[o, d0 + j] = src[h, c0 + j * sw]


@njit(cache=True)
def merge_phases(buf, top, left, sh, sw, Wph, dst):
    # the inverse of split_phases: dst (H, W)[i*sh + a - top, j*sw + b - left] =
    # buf[a*sw + b, i*Wph + j]; 0 where no phase element lands (past the buffer). Rows by
    # address where dst's are contiguous, as split_phases
    H, W = dst.shape
    plane = buf.shape[1]
    Hph = plane // Wph
    isz = dst.itemsize
    flat = dst.strides[1] == isz and dst.strides[0] == W * isz
    pd, pbuf = np.intp(dst.ctypes.data), np.intp(buf.ctypes.data)
    dst[:] = 0
    if sw == 2:
        be, bo, j0e, j0o, m, ne, no = _stride2_columns(left, W, Wph)
        whole = m >= 8 and flat
        if whole and ne == m and no == m:           # every row pairs only: addresses alone
            for a in range(sh):
                pe = pbuf + ((a * 2 + be) * plane + j0e) * isz
                po = pbuf + ((a * 2 + bo) * plane + j0o) * isz
                for i in range(Hph):
                    h = i * sh + a - top
                    if 0 <= h < H:
                        merge_pairs_at(pe + i * Wph * isz, po + i * Wph * isz, pd + h * W * isz,
                                       m, dst)
            return
        for a in range(sh):
            ke, ko = a * 2 + be, a * 2 + bo
            for i in range(Hph):
                h = i * sh + a - top
                if h < 0 or h >= H:
                    continue
                e0, o0 = i * Wph + j0e, i * Wph + j0o
                k0 = 0
                if whole:
                    merge_pairs_at(pbuf + (ke * plane + e0) * isz, pbuf + (ko * plane + o0) * isz,
                                   pd + h * W * isz, m, dst)
                    k0 = m
                for k in range(k0, ne):
                    dst[h, 2 * k] = buf[ke, e0 + k]
                for k in range(k0, no):
                    dst[h, 2 * k + 1] = buf[ko, o0 + k]
        return
    for a in range(sh):
        for b in range(sw):
            _merge_phase(buf, top, left, sh, sw, Wph, dst, a, b)


@njit(cache=True)
def crop_plane(buf, top, left, Wph, dst):
    # merge_phases at stride 1 (pad_plane's inverse): dst (H, W) <- the window of buf's one
    # phase plane, 0 past it
    dst[:] = 0
    _merge_phase(buf, top, left, 1, 1, Wph, dst, 0, 0)


@njit(cache=True)
def _merge_phase(buf, top, left, sh, sw, Wph, dst, a, b):
    # phase (a, b) of merge_phases (as _split_phase)
    H, W = dst.shape
    plane = buf.shape[1]
    Hph = plane // Wph
    isz = dst.itemsize
    flat = dst.strides[1] == isz and dst.strides[0] == W * isz
    pd, pbuf = np.intp(dst.ctypes.data), np.intp(buf.ctypes.data)
    o = a * sw + b
    j0, j1 = _phase_columns(b, sw, left, W, Wph)
    c0 = j0 * sw + b - left                             # the column of phase column j0
    for i in range(Hph):
        h = i * sh + a - top
        if h < 0 or h >= H or j1 == j0:
            continue
        s0 = i * Wph + j0
        if sw == 1 and flat:
            copy_at(pd + (h * W + c0) * isz, pbuf + (o * plane + s0) * isz, j1 - j0, dst)
        else:
            for j in range(j1 - j0):
                dst[h, c0 + j * sw] = buf[o, s0 + j]


# The task kernels call the split and the merge through steps (kernels/cpu/steps.py), not by
# linking their code in: each compiles once, not again inside every kernel that calls it (the
# NCHW depthwise forward's first call compiled split_phases, 0.77 s of CPU with its helpers,
# into forward_tiled; the dX merge_phases, 0.57 s, into _dx_nchw), and a kernel calls
# pad_plane (crop_plane) at stride 1 and split_phases (merge_phases) else (:func:`split`,
# :func:`merge`), so that a stride-1 conv never compiles the strided code. The host readies
# what its kernel will call (:func:`ready`) before the launch.
_I = types.int64
SPLIT = Step(split_phases.py_func, lambda f: [(_arr(f, 2), _I, _I, _I, _I, _I, _arr(f, 2))])
PAD = Step(pad_plane.py_func, lambda f: [(_arr(f, 2), _I, _I, _I, _arr(f, 2))])
MERGE = Step(merge_phases.py_func, lambda f: [(_arr(f, 2), _I, _I, _I, _I, _I, _arr(f, 2))])
CROP = Step(crop_plane.py_func, lambda f: [(_arr(f, 2), _I, _I, _I, _arr(f, 2))])
_split_step, _pad_step = SPLIT.call, PAD.call
_merge_step, _crop_step = MERGE.call, CROP.call


@njit(inline="always")
def split(src, top, left, sh, sw, Wph, out):
    # split_phases through its step, pad_plane's at stride 1
    if sh == 1 and sw == 1:
        _pad_step((src, top, left, Wph, out))
    else:
        _split_step((src, top, left, sh, sw, Wph, out))


@njit(inline="always")
def merge(buf, top, left, sh, sw, Wph, dst):
    # merge_phases through its step, crop_plane's at stride 1
    if sh == 1 and sw == 1:
        _crop_step((buf, top, left, Wph, dst))
    else:
        _merge_step((buf, top, left, sh, sw, Wph, dst))


def ready(dtype, geom, merging=False):
    """Fill the slot that :func:`split` (``merging``: :func:`merge`) calls for ``geom``'s
    strides, at ``dtype``."""
    stride1 = geom.sh == 1 and geom.sw == 1
    if merging:
        (CROP if stride1 else MERGE).ready(dtype)
    else:
        (PAD if stride1 else SPLIT).ready(dtype)
