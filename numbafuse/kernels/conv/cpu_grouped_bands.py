r"""NHWC grouped convolutions by chunks of output rows, every group in each chunk (float32).

``cpu_grouped_taps`` runs a grouped pass as tasks of (images, a block of groups), each group
copying its channels of each image into a slab of its own. In NHWC a group's channels are 32
to 64 bytes of every pixel, a pixel's whole row 1 KiB or more apart: that copy read a line of
every pixel for every pair of groups, and took half of ResNeXt's stride-2 NHWC forward (machine
A, (32, 256, 56, 56), groups 32: ~24 of ~41 ms on one thread). Here a task is a chunk of output
rows (or of whole images) with every group in it: the chunk's padded input rows, every channel,
are copied once into a slab of at most :data:`BAND_BYTES` (``cpu_implicit``'s fill: whole
pixels in order), and each merged group's taps read its channels there, at the taps' offsets
plus ``g * cg``:

    forward   y_g = relu?(conv(x_g, w_g) + b_g?): ``gemm_taps`` per group over the chunk's
              slab, into its kg columns of the chunk's output rows (:func:`band_tasks`).
    dX        the same on g (gated once by the caller) with the flipped, transposed taps, on
              the stride-1 conv whose output is dX (:func:`dx_geometry`).
    dW        ``gemm_gather`` per group and tap over the chunk's pixels: dW_g tap (r, s) (kg,
              cg) += g_g^T (kg, pixels) @ the pixels' tap rows of the slab; each of
              :data:`DW_PARTS` fixed runs of chunks (in order) sums into its own part, and the
              parts are added in order (``cpu_chunks.sum_groups``): the same on any thread
              count (:func:`band_dw_tasks`).

Each y and dx value is the same float32 sum as ``cpu_grouped_taps``' (tap order, then channel
order), so the same bits; a dW value is summed in another order (chunk after chunk in a part,
then the parts), not the per-group kernel's (image after image).
"""
import dataclasses

import numpy as np

from ..cpu import gemm_taps as _taps
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import launch, num_threads, task_kernel
from ..cpu.steps import ready as _ready_steps
from ..cpu.transpose import transpose
from . import cpu_implicit as _implicit, math as conv_math
from .cpu_chunks import chunk, count_chunks, sum_groups
from .cpu_implicit import slab_shape

BAND_BYTES = 512 << 10     # a chunk's slab of every channel: at most this (machine A, L2 1 MiB:
#                            the stride-2 forward 15.2 ms at 256 KiB, 14.2 at 512, 14.0 at 1 MiB)
TASKS_A_THREAD = 4         # chunks a pass aims at, a thread (bands down to one output row)
DW_PARTS = 16              # the dW's runs of chunks, each summed into its own part


def _dims(*values):
    return tuple(np.int64(v) for v in values)


@task_kernel
def band_tasks(t0, t1, x, wt, aoff, bias, geo, sizes, flags, y):
    # y = relu?(conv(x, w, groups) + bias?), NHWC: x (N, H, W, C), wt (Gm, R*S, cg, kg), aoff
    # (Gm, R*S) the taps' element offsets in the slab, each group's + g * cg, y (N, P, Q, K).
    # Chunk t (cpu_chunks.chunk: images [n0, n1) or one image's output rows [p0, p1)): its
    # padded input rows, every channel, copied once into the slab, then each merged group's
    # taps over its cg channels of the slab, into its kg columns of the chunk's output rows
    has_bias, relu, wide = flags
    ipc, rpc, Hmax, Ws, Gm, cg, kg = sizes
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    PQ = P * Q
    slab = np.empty((ipc, Hmax, Ws, C), np.float32)
    rows = np.empty(ipc * PQ if ipc > 1 else rpc * Q, np.int64)    # the pixels' corners
    for t in range(t0, t1):
        n0, n1, p0, p1 = chunk(t, N, P, ipc, rpc)
        m = (n1 - n0) * (p1 - p0) * Q
        _implicit._fill_step((x, n0, n1, p0, p1, geo, Hmax, Ws, slab, rows))
        pc = np.int64(y.ctypes.data) + 4 * (n0 * PQ + p0 * Q) * K
        for g in range(Gm):
            _taps.taps_step(((np.int64(m), np.int64(kg), np.int64(cg)), np.int64(R * S),
                            np.int64(rows.ctypes.data), np.int64(aoff[g].ctypes.data),
                            np.int64(wt[g].ctypes.data), np.int64(kg), pc + 4 * g * kg,
                            np.int64(K),
                            np.int64(bias.ctypes.data) + 4 * g * kg if has_bias else np.int64(0),
                            np.int64(1 if relu else 0), np.int64(1 if wide else 0)))


@task_kernel
def band_dw_tasks(t0, t1, x, g, aoff, geo, sizes, wide, parts):
    # parts[t] (Gm, R*S, kg, cg) <- the dW of chunks [t * cpt, (t + 1) * cpt) in order: each
    # chunk's slab (every channel) and g^T of its pixels (K, m) once, then per merged group
    # and tap c += g_g^T (kg, m) @ the pixels' tap rows of the group's channels (the first
    # chunk's products overwrite c). x (N, H, W, C), g (N, P, Q, K) ungated.
    ipc, rpc, Hmax, Ws, Gm, cg, kg, nchunks, cpt = sizes
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    PQ = P * Q
    RS = R * S
    mmax = ipc * PQ if ipc > 1 else rpc * Q
    slab = np.empty((ipc, Hmax, Ws, C), np.float32)
    rows = np.empty(mmax, np.int64)
    gT = np.empty((K, mmax), np.float32)
    g2 = g.reshape((N * PQ, K))
    for t in range(t0, t1):
        c0 = t * cpt
        for c in range(c0, min(nchunks, c0 + cpt)):
            n0, n1, p0, p1 = chunk(c, N, P, ipc, rpc)
            m = (n1 - n0) * (p1 - p0) * Q
            _implicit._fill_step((x, n0, n1, p0, p1, geo, Hmax, Ws, slab, rows))
            r0 = n0 * PQ + p0 * Q
            transpose(g2[r0:r0 + m], gT[:, :m])
            for grp in range(Gm):
                for tap in range(RS):
                    _taps.gather_step((np.int64(kg), np.int64(cg), np.int64(m),
                                       np.int64(gT[grp * kg].ctypes.data), np.int64(mmax),
                                       np.int64(rows.ctypes.data), aoff[grp, tap],
                                       np.int64(parts[t, grp, tap].ctypes.data), np.int64(cg),
                                       np.int64(0 if c == c0 else 1),
                                       np.int64(1 if wide else 0)))


def bands(geom, threads):
    """(images a chunk, output rows a chunk, chunks, slab rows, slab width) of the passes
    here: a chunk's slab (every input channel) at most :data:`BAND_BYTES`, whole images where
    one fits, and at least TASKS_A_THREAD chunks a thread where the rows allow."""
    N, P = geom.N, geom.P
    Hs, Ws = slab_shape(geom, P)
    row_bytes = 4 * Ws * geom.C
    ipc = int(max(1, min(N, BAND_BYTES // (Hs * row_bytes),
                         -(-N // (TASKS_A_THREAD * threads)))))
    rpc = P
    if ipc == 1:
        fit = (BAND_BYTES // row_bytes - (geom.R - 1) * geom.dh - 1) // geom.sh + 1
        nb = max(-(-P // max(1, fit)), min(P, -(-TASKS_A_THREAD * threads // N)))
        rpc = -(-P // nb)
    Hmax = slab_shape(geom, P if ipc > 1 else rpc)[0]
    return ipc, rpc, count_chunks(N, P, ipc, rpc), Hmax, Ws


def _offsets(geom, Ws, G, cg):
    # (G, R*S) int64: each merged group's tap offsets in a slab of every channel
    return _implicit.tap_offsets(geom, Ws)[None, :] + cg * np.arange(G, dtype=np.int64)[:, None]


def conv(x, wt, b, geom, relu, sizes):
    """The NHWC output of the grouped conv ``geom`` (``sizes``: merged groups, their input
    channels, their filters) by :func:`band_tasks`; ``wt`` the merged groups' taps (Gm, R*S,
    cg, kg): the forward's, or a dX's flipped ones on :func:`dx_geometry`'s conv."""
    G, cg, kg = sizes
    ipc, rpc, nchunks, Hmax, Ws = bands(geom, num_threads())
    y = _out.empty(geom.y_shape, np.float32)
    _taps.ready(gather=False)
    _ready_steps(None, (_implicit.FILL,))
    launch(band_tasks, nchunks, x, wt, _offsets(geom, Ws, G, cg),
           b if b is not None else np.empty(0, np.float32), conv_math.geo_tuple(geom),
           _dims(ipc, rpc, Hmax, Ws, G, cg, kg), (b is not None, bool(relu), _taps.WIDE), y,
           work=x.size + y.size, grain=1)
    return y


def banded_dw(cg):
    """Whether an NHWC grouped dW runs here (:func:`dw_parts`): where a merged group has 8
    channels, half a cache line of each pixel. Machine A, 2 threads, ms per-group slabs /
    bands: (32, 128, 56, 56) groups 32 (8 channels merged) 28.1-29.2 / 22.6-24.1, stride 2
    (32, 256, 56, 56) 24.5-26.5 / 17.5-21.2; but (32, 512, 14, 14) groups 32 (16 channels, a
    line) 6.9-7.1 / 8.2-10.1: there each tap's gather reads the slab's lines 2 KiB apart from
    L2 nine times, where a group's own slab is read in order."""
    return cg == 8


def dw_parts(x, g, geom, sizes):
    """(Gm, R*S, kg, cg): the merged groups' dW taps of the NHWC grouped conv ``geom`` (``g``
    its output's gradient, gated), by :func:`band_dw_tasks` (DW_PARTS parts, added in order)."""
    G, cg, kg = sizes
    # (the chunks as for DW_PARTS threads' worth of tasks, whatever the thread count: the
    # sums' order, so the bits, must not depend on it)
    ipc, rpc, nchunks, Hmax, Ws = bands(geom, max(1, -(-DW_PARTS // TASKS_A_THREAD)))
    nparts = min(nchunks, DW_PARTS)
    cpt = -(-nchunks // nparts)
    nparts = -(-nchunks // cpt)
    parts = _out.empty((nparts, G, geom.R * geom.S, kg, cg), np.float32)
    _taps.ready(gather=True)
    _ready_steps(None, (_implicit.FILL,))
    launch(band_dw_tasks, nparts, x, g, _offsets(geom, Ws, G, cg), conv_math.geo_tuple(geom),
           _dims(ipc, rpc, Hmax, Ws, G, cg, kg, nchunks, cpt), _taps.WIDE, parts,
           work=x.size + g.size, grain=1)
    return sum_groups(parts)


def dx_geometry(geom):
    """The NHWC stride-1 conv whose output is ``geom``'s dX (its input g (N, P, Q, K), the
    padding (R-1)*dh less the forward's on each side), run by :func:`conv` with the flipped
    taps; None where ``geom`` is NCHW or strided (``cpu_grouped_taps``' slabs upsample g) or
    a side's padding exceeds the filter's reach (negative there)."""
    pads = ((geom.R - 1) * geom.dh - geom.ph, (geom.S - 1) * geom.dw - geom.pw,
            (geom.R - 1) * geom.dh - geom.ph_end, (geom.S - 1) * geom.dw - geom.pw_end)
    if geom.layout != "NHWC" or (geom.sh, geom.sw) != (1, 1) or min(pads) < 0:
        return None
    return dataclasses.replace(geom, C=geom.K, H=geom.P, W=geom.Q, K=geom.C, P=geom.H,
                               Q=geom.W, ph=pads[0], pw=pads[1], ph_end=pads[2],
                               pw_end=pads[3])
