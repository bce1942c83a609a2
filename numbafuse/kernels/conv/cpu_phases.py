"""Phase planes of one input plane, for the NCHW depthwise kernels (``cpu_depthwise``): a
plane zero-padded and split by its stride phases, so that each tap of a strided convolution
is a fixed offset into one phase (``split_phases``), and the inverse (``merge_phases``, dX).
At stride 2 along w both column phases of a row are written at once, in vector shuffles
(``cpu.pairs``): 3x3 stride 2 at (32, 64, 56, 56), 1 thread, machine A, forward 6.6-7.7 ->
6.2-6.4 ms, dX 7.8-8.7 -> 7.0-7.2 (three alternating runs each).
"""
from numba import njit

from ..cpu.pairs import merge_pairs, split_pairs


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
    # out[a*sw + b, i*Wph + j] = src[i*sh + a - top, j*sw + b - left], 0 outside src
    H, W = src.shape
    Hph = out.shape[1] // Wph
    if sw == 2:                   # both column phases of a row at once, in vector shuffles
        be, bo, j0e, j0o, m, ne, no = _stride2_columns(left, W, Wph)
        for a in range(sh):
            oe, oo = out[a * 2 + be], out[a * 2 + bo]
            for i in range(Hph):
                h = i * sh + a - top
                re, ro = oe[i * Wph:(i + 1) * Wph], oo[i * Wph:(i + 1) * Wph]
                if h < 0 or h >= H:
                    re[:] = 0
                    ro[:] = 0
                    continue
                re[:j0e] = 0
                re[j0e + ne:] = 0
                ro[:j0o] = 0
                ro[j0o + no:] = 0
                xs = src[h]
                split_pairs(xs[:2 * m], re[j0e:j0e + m], ro[j0o:j0o + m])
                for k in range(m, ne):
                    re[j0e + k] = xs[2 * k]
                for k in range(m, no):
                    ro[j0o + k] = xs[2 * k + 1]
        return
    for a in range(sh):
        for b in range(sw):
            o = out[a * sw + b]
            j0, j1 = _phase_columns(b, sw, left, W, Wph)
            for i in range(Hph):
                h = i * sh + a - top
                row = o[i * Wph:(i + 1) * Wph]
                if h < 0 or h >= H or j1 == j0:
                    row[:] = 0
                    continue
                row[:j0] = 0
                row[j1:] = 0
                dst, xs = row[j0:j1], src[h, j0 * sw + b - left:]         # views from 0
                if sw == 1:
                    for j in range(j1 - j0):
                        dst[j] = xs[j]
                else:
                    for j in range(j1 - j0):
                        dst[j] = xs[j * sw]


@njit(cache=True)
def merge_phases(buf, top, left, sh, sw, Wph, dst):
    # the inverse of split_phases: dst (H, W)[i*sh + a - top, j*sw + b - left] =
    # buf[a*sw + b, i*Wph + j]; 0 where no phase element lands (past the buffer)
    H, W = dst.shape
    Hph = buf.shape[1] // Wph
    dst[:] = 0
    if sw == 2:
        be, bo, j0e, j0o, m, ne, no = _stride2_columns(left, W, Wph)
        for a in range(sh):
            for i in range(Hph):
                h = i * sh + a - top
                if h < 0 or h >= H:
                    continue
                d = dst[h]
                re = buf[a * 2 + be, i * Wph + j0e:i * Wph + j0e + ne]
                ro = buf[a * 2 + bo, i * Wph + j0o:i * Wph + j0o + no]
                merge_pairs(re[:m], ro[:m], d[:2 * m])
                for k in range(m, ne):
                    d[2 * k] = re[k]
                for k in range(m, no):
                    d[2 * k + 1] = ro[k]
        return
    for a in range(sh):
        for i in range(Hph):
            h = i * sh + a - top
            if h < 0 or h >= H:
                continue
            for b in range(sw):
                j0, j1 = _phase_columns(b, sw, left, W, Wph)
                src, d = buf[a * sw + b, i * Wph + j0:i * Wph + j1], dst[h, j0 * sw + b - left:]
                if sw == 1:
                    for j in range(j1 - j0):
                        d[j] = src[j]
                else:
                    for j in range(j1 - j0):
                        d[j * sw] = src[j]
