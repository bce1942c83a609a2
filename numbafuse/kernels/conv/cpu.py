r"""CPU convolution kernels: per-chunk gather + single-threaded GEMMs + epilogue, one task each.

Work is cut into *chunks* (blocks of output rows of one image, or several small images) sized
to stay in one core's L2. Each chunk is one task of numbafuse's thread pool (``cpu_launch.py``):
the thread that takes it gathers the chunk's input, runs its GEMMs on numbafuse's private
single-threaded BLAS (``cpu_blas.py``) and applies the epilogue (bias, ReLU) while the result is
still in its cache. No thread pool hands a chunk to another one.

Which kernels run (``algorithm``; docs/conv_bias_relu.md has the measurements):

    pointwise  1x1, stride 1, unpadded      GEMMs straight on x, y, dx   (cpu_direct.py)
    im2col     fewer than MIN_GEMM_CHANNELS input or output channels, the NCHW forward and
               dW with fewer than NCHW_IM2COL_CHANNELS (not by Winograd), and the forward
               and dW of strided convolutions the implicit path leaves (cpu_im2col.py)
    implicit   strided float32 forward (K % 8 == 0) and dW (C % 8 == 0) where the CPU has
               AVX-512: register tiles summing over the taps of a zero-padded slab of each
               chunk's input, no im2col (cpu_implicit.py, cpu_gemm_taps.py); the NHWC 1x1
               forward and dX and the NHWC dX by phase run on the same tiles
    winograd   3x3, stride 1, no dilation: F(2x2, 3x3) forward, dX and dW, NCHW through
               NHWC's transforms on HWC slabs of each chunk's rows     (cpu_winograd.py)
    winograd_s2  3x3 stride 2, float32, transformed taps of at most 2 MiB: forward (K % 8
               == 0), dX and dW (C % 8 == 0) by Winograd over the input's phases, 25
               products instead of 36              (cpu_winograd_s2.py, cpu_winograd_s2dx.py)
    phase      everything else: shifted GEMMs over phase planes (forward, dW), dX by input
               phase over one padded copy of the gradient              (cpu_direct.py)

Backward, from ``gy`` and (fused op) the output ``y``, whose sign is the ReLU mask:
g = gy * (y > 0), formed while the kernels read gy. dW and db: chunks go into ``DW_GROUPS``
fixed groups (a function of the shape only), one task each with its own partial (db in
float64), summed in group order afterwards: results do not depend on the thread count. dX:
every dx element is written by exactly one task.

Conv-BatchNorm: :func:`forward_stats` and :func:`forward_bn_sums` run the Winograd forward
with batch norm's per-channel sums in each chunk's epilogue (``cpu_epilogue.py``).

Outputs (y, dx, the Conv-BatchNorm's) and the dW partials come from
``cpu_buffers.output_cache``: a released buffer is reused instead of fresh pages that fault
on first touch (in a process alternating conv shapes, glibc returned the freed memory to the
kernel and every call faulted its output in again: ~525 faults and ~1.2 ms a call at the 1x1
shape's 16 MiB output).

Both layouts run the same task kernels: the layout is a flag tested once per chunk, and only
the small gather/scatter helpers have per-layout loop nests.
"""
import numpy as np

from .. import cpu_blas as _blas
from .. import cpu_gemm_taps as _gemm_taps
from ..cpu_buffers import output_cache as _out
from ..cpu_launch import blocks, concurrently, launch, launch_all
from . import math as conv_math

CHUNK_BYTES = 768 << 10   # target bytes of a chunk's gathered input + output (L2: 1 MiB)
MIN_CHUNKS = 4            # whole-image im2col chunks of a batch, at least (see _chunking)
DW_GROUPS = 16            # fixed groups of chunks, each with its own dW and db partial
WINOGRAD = True           # 3x3 stride-1 convolutions by Winograd F(2x2, 3x3)
WINOGRAD_TILES = 160      # 2x2 output tiles per Winograd chunk (the GEMMs' n)
# ... but a forward with fewer 2x2 output tiles in the whole batch by im2col (one GEMM, k =
# 9 C): the transformed taps (16 C K values, formed every call) and GEMMs of few rows cost
# more than the products saved. Measured fwd (ms, 2 threads, NCHW, batch 16, 3x3 C = K):
# 2x2 maps, 512 channels (16 tiles) Winograd 33.0, im2col 7.9; 4x4, 256 (64 tiles) 8.3 and
# 4.3; 8x8, 128 (256 tiles) 2.6 and 3.5. dX and dW stay Winograd (im2col's took 1.6-2x).
WINOGRAD_MIN_TILES = 128
MIN_GEMM_CHANNELS = 16    # fewer input or output channels: im2col (GEMMs with k = C*R*S)
NCHW_IM2COL_CHANNELS = 32  # NCHW forward and dW with fewer: im2col too (Winograd's and the
                           # phase planes' GEMMs have k = C or K; measured in docs)
STRIDED_NHWC_IM2COL = True     # strided NHWC forward and dW by im2col (else phase planes)
STRIDED_NCHW_SLAB = True       # strided NCHW forward and dW by im2col over NHWC slabs
# strided float32 forward (K a multiple of 8) as an implicit GEMM over a zero-padded slab of
# each chunk's input (cpu_implicit.py) instead of im2col + OpenBLAS; and the NHWC float32 1x1
# forward and dX by the same tiles (one tap) instead of the BLAS and cpu_gemm. Both on where
# the tiles have 16-float vectors (AVX-512: cpu_gemm_taps.WIDE): with 8 they measured no
# faster than the paths they would replace (docs/conv_bias_relu.md)
IMPLICIT = _gemm_taps.WIDE
POINTWISE_TAPS = _gemm_taps.WIDE
PHASE_DX_TAPS = _gemm_taps.WIDE    # ... and the NHWC dX by input phase (all of a phase's taps)
IMPLICIT_DW = _gemm_taps.WIDE      # ... and the strided dW (C a multiple of 8) over the slabs
# 3x3 stride-2 float32 forward (K a multiple of 8), dX and dW (C a multiple of 8) by Winograd
# over input phases, 25 products instead of 36 (cpu_winograd_s2.py, cpu_winograd_s2dx.py), on
# either tile width: they beat the implicit GEMM and phase dX (AVX-512) and im2col (AVX2 code);
# only with transformed taps (25 C K floats, read by every chunk) of at most
# WINOGRAD_S2_TAPS_BYTES: at 256 -> 512 channels fwd+bwd took 1.2-1.3x the other paths' time
WINOGRAD_S2 = True
WINOGRAD_S2_DX = True
WINOGRAD_S2_DW = True
WINOGRAD_S2_TILES = 64    # 2x2 output tiles (dX: 4x4 blocks of dx) per chunk: the GEMMs' m
WINOGRAD_S2_TAPS_BYTES = 2 << 20
# A backward touching fewer elements (x, gy twice) runs dX and dW at once, each on one thread
# (cpu_launch.concurrently), instead of one after the other, each split over the threads: at
# the digits shapes (8x8, 24 channels) a split pass gains what waking a helper costs
CONCURRENT_MAX_ELEMENTS = 1 << 20
# ... and where both are Winograd passes, their tasks in one job that both threads share
# (cpu_launch.launch_all) rather than one pass per thread; False: one pass per thread
SHARED_BACKWARD = True
# Conv-BatchNorm(-ReLU): the batch statistics (forward) and the batch-norm backward's first
# pass (recompute) made by the Winograd forward's chunks (cpu_epilogue.py); False: separate
# batch-norm passes over the conv's output
BN_EPILOGUE = True

geo_tuple = conv_math.geo_tuple

from . import cpu_epilogue as _epi  # noqa: E402
from ..batchnorm import cpu as _bn_cpu  # noqa: E402
from . import cpu_implicit as _implicit  # noqa: E402
from . import cpu_winograd as _wino  # noqa: E402
from . import cpu_winograd_s2 as _wino_s2  # noqa: E402
from . import cpu_winograd_s2dx as _wino_s2dx  # noqa: E402
from .cpu_direct import (_phase_dw_tasks, _phase_dx_tasks, _phase_tasks,  # noqa: E402
                         _pointwise_dw_tasks, _pointwise_tasks)
from .cpu_im2col import (_balanced, _dw_tasks, _dx_tasks, _forward_tasks,  # noqa: E402
                         _nchunks, _phase_weights, _phases, sum_groups, tile_chunks)


def _chunking(pixels_per_image, rows, row_pixels, row_bytes, images):
    """(images per chunk, rows per chunk): whole images if one image's matrix is small, else
    blocks of rows of one image; ``row_bytes``: the im2col bytes of one output pixel. Whole
    images are grouped into at least ``MIN_CHUNKS`` chunks (of the ``images``) where there are
    that many: a batch whose im2col fits one chunk (the stem's C = 1) still splits over the
    threads (a fixed count, so the chunks do not depend on the thread count)."""
    target = max(1, CHUNK_BYTES // max(row_bytes, 1))          # pixels of one chunk
    if pixels_per_image <= target:
        ipc = max(1, target // max(pixels_per_image, 1))
        return max(1, min(ipc, images // MIN_CHUNKS)), rows
    return 1, _balanced(rows, target // max(row_pixels, 1))


# --------------------------------------------------------------------------- which kernels

def _is_pointwise(geom):
    """1x1, stride 1, unpadded: the cols matrix is x itself."""
    return (geom.R == geom.S == geom.sh == geom.sw == geom.dh == geom.dw == 1
            and geom.ph == geom.pw == 0 and geom.ph_end == geom.pw_end == 0)


def algorithm(geom, pass_="forward", dtype=np.float32):
    """Which kernels run a convolution's ``pass_`` ("forward", "dx" or "dw") on inputs of
    ``dtype``: "pointwise", "im2col", "implicit", "winograd", "winograd_s2" or "phase"."""
    if _is_pointwise(geom):
        return "pointwise"
    if min(geom.C, geom.K) < MIN_GEMM_CHANNELS:
        return "im2col"
    nhwc = geom.layout == "NHWC"
    winograd = (WINOGRAD and geom.R == geom.S == 3 and geom.sh == geom.sw == 1
                and geom.dh == geom.dw == 1)
    if winograd:
        # NHWC's transforms, for NCHW too (on HWC slabs): they won at every width and channel
        # count measured from 16 up, NCHW's im2col and phase planes included, except the
        # forward of few tiles (WINOGRAD_MIN_TILES)
        tiles = geom.N * ((geom.P + 1) // 2) * ((geom.Q + 1) // 2)
        if pass_ == "forward" and tiles < WINOGRAD_MIN_TILES:
            return "im2col"
        return "winograd"
    if ({"forward": WINOGRAD_S2, "dx": WINOGRAD_S2_DX, "dw": WINOGRAD_S2_DW}[pass_]
            and _wino_s2.fits(geom, dtype, pass_)
            and _wino_s2.POSITIONS * geom.C * geom.K * 4 <= WINOGRAD_S2_TAPS_BYTES):
        return "winograd_s2"
    if not nhwc and pass_ != "dx" and min(geom.C, geom.K) < NCHW_IM2COL_CHANNELS:
        return "im2col"
    if geom.sh == geom.sw == 1:
        return "phase"
    if (IMPLICIT if pass_ == "forward" else IMPLICIT_DW if pass_ == "dw" else False) \
            and _implicit.fits(geom, dtype, pass_):
        return "implicit"
    if pass_ != "dx" and _slab(geom):
        return "im2col"
    # strided NHWC forward and dW: one GEMM with k = R*S*C beat R*S GEMMs with k = C
    # (measured, docs/conv_bias_relu.md); its NHWC gather copies whole channel vectors
    return "im2col" if nhwc and pass_ != "dx" and STRIDED_NHWC_IM2COL else "phase"


def _slab(geom):
    """Whether forward and dW run as im2col over NHWC slabs (``cpu_im2col._forward_tasks``,
    ``_dw_tasks``): a strided NCHW convolution with NCHW_IM2COL_CHANNELS or more channels
    each side. Each chunk's input rows are transposed to (rows, W, C) in cache and gathered as
    whole channel vectors: that beat the phase planes' R*S GEMMs with k = C, where the NCHW
    gather of single strided values did not (docs/conv_bias_relu.md)."""
    return (STRIDED_NCHW_SLAB and geom.layout == "NCHW" and (geom.sh > 1 or geom.sw > 1)
            and min(geom.C, geom.K) >= NCHW_IM2COL_CHANNELS and not _is_pointwise(geom))


def _weight_matrix(w, nhwc):
    """NCHW: (K, C*R*S) = w as it is; NHWC: (K, R*S*C), columns in the cols order."""
    K, C, R, S = w.shape
    if not nhwc:
        return w.reshape(K, C * R * S)
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1)).reshape(K, R * S * C)


def _taps(w, k_rows):
    """The taps w_rs as (R*S, K, C) (``k_rows``) or (R*S, C, K), contiguous."""
    K, C, R, S = w.shape
    order = (2, 3, 0, 1) if k_rows else (2, 3, 1, 0)
    return np.ascontiguousarray(w.transpose(order)).reshape(R * S, *((K, C) if k_rows else
                                                                      (C, K)))


# --------------------------------------------------------------------------- Winograd

def _winograd_run(src, gate, use_gate, w, flip, top, left, bias, relu, nhwc, blas, out, work,
                  epi=_epi.EPI_NONE, dy=None, gz=None, ev=None, affine=False):
    """out = relu?(Winograd 3x3 correlation of src (gated) zero-padded by top/left + bias);
    taps w (K, C, 3, 3), flipped and transposed for dX (``flip``). With a batch-norm epilogue
    (``epi``, HWC passes only; :mod:`cpu_epilogue`) returns each chunk's (parts, counts)."""
    (kernel, ntasks, args), parts, counts = _winograd_launch(
        src, gate, use_gate, w, flip, top, left, bias, relu, nhwc, blas, out, epi, dy, gz, ev,
        affine)
    launch(kernel, ntasks, *args, work=work, grain=1)
    return parts, counts


def _winograd_launch(src, gate, use_gate, w, flip, top, left, bias, relu, nhwc, blas, out,
                     epi=_epi.EPI_NONE, dy=None, gz=None, ev=None, affine=False):
    """_winograd_run's launch, not run: ((kernel, ntasks, args), parts, counts)."""
    Ci, Co = (w.shape[0], w.shape[1]) if flip else (w.shape[1], w.shape[0])
    N, Ho, Wo = out.shape[0], *(out.shape[1:3] if nhwc else out.shape[2:4])
    U = np.empty((16, Ci, Co), src.dtype)                           # the GEMMs' orientation
    _wino.winograd_taps(w, flip, U)
    ipc, tyb, nchunks, most = tile_chunks(N, Ho, Wo, True, WINOGRAD_TILES)
    chunks = (top, left, ipc, tyb, _wino.estride(Ci * most, src.itemsize),
              _wino.estride(Co * most, src.itemsize), int(not nhwc))
    if epi == _epi.EPI_NONE:
        args = (src, gate, use_gate, U, chunks, bias, relu, blas, out)
        return (_wino.forward_tasks, nchunks, args), None, None
    parts, counts = np.empty((nchunks, 3, Co)), np.empty(nchunks)
    dy, gz = (out, out) if dy is None else (dy, gz)
    ev = np.zeros((4, _epi.tiles(Co) * Co), src.dtype) if ev is None else ev
    args = (src, U, chunks, blas, out, (epi, int(affine)), ev.astype(src.dtype, copy=False),
            (dy, gz), parts, counts)
    return (_wino.forward_epilogue_tasks, nchunks, args), parts, counts


def _bn_epilogue_ok(geom, nhwc_only):
    """Whether the forward is the Winograd pass over HWC rows, which has the epilogue."""
    nhwc = geom.layout == "NHWC"
    return (BN_EPILOGUE and algorithm(geom, "forward") == "winograd"
            and (nhwc or not nhwc_only) and geom.N > 0)


def _forward_epilogue(x, w, geom, epi, dy=None, gz=None, ev=None, affine=False):
    h = _out.empty(geom.y_shape, x.dtype)
    parts, counts = _winograd_run(x, x, False, w, False, geom.ph, geom.pw,
                                  np.zeros(geom.K, x.dtype), False, geom.layout == "NHWC",
                                  _blas.blas_for(x.dtype), h, x.size + h.size, epi, dy, gz,
                                  ev, affine)
    return h, parts, counts


def forward_stats(x, w, geom, eps):
    """``(h, mean, var, invstd)`` of a bias-free conv: its output h and h's batch statistics
    (float64 (K,), var biased) from the conv's chunks (:mod:`cpu_epilogue`, EPI_STATS), or
    None where the forward is not the Winograd pass over HWC rows (the caller then makes the
    statistics pass)."""
    if not _bn_epilogue_ok(geom, False):
        return None
    h, parts, counts = _forward_epilogue(x, w, geom, _epi.EPI_STATS)
    mean, var, invstd = np.empty((3, geom.K))
    _epi.merge_stats(parts, counts, float(eps), mean, var, invstd)
    return h, mean, var, invstd


def forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta):
    """``(h, g, sums)``: a bias-free conv's output h (recomputed) with pass 1 of the batch-norm
    backward of ``[relu](batchnorm(h))`` made by its chunks (EPI_BN_SUMS): ``g = dy`` gated
    where ``gamma*xhat + beta > 0`` (``beta`` None: no ReLU, g = dy) and sums (chunks, 2, K)
    float64 of g and g*(h - mean), for ``kernels/batchnorm/cpu.backward(g, ..., STATE_NONE,
    sums=sums)``. NHWC only (``dy`` shaped as h); None where the forward is not the Winograd
    pass."""
    if not _bn_epilogue_ok(geom, True):
        return None
    m = _epi.tiles(geom.K)
    values = np.empty((4, m * geom.K), x.dtype)                   # batch norm's, tiled
    _bn_cpu._channel_values(mean, invstd, gamma, gamma if beta is None else beta, m, values)
    g = _out.empty(geom.y_shape, x.dtype)
    h, parts, _ = _forward_epilogue(x, w, geom, _epi.EPI_BN_SUMS, dy, g, values,
                                    beta is not None)
    return h, g, np.ascontiguousarray(parts[:, :2])


def _winograd_dw(x, gy, y, use_mask, geom, need_dw, blas, work):
    """(dw or None, db_parts) of a 3x3 stride-1 conv by Winograd."""
    (kernel, ntasks, args), finish = _winograd_dw_launch(x, gy, y, use_mask, geom, need_dw, blas)
    launch(kernel, ntasks, *args, work=work, grain=1)
    return finish()


def _winograd_dw_launch(x, gy, y, use_mask, geom, need_dw, blas):
    """_winograd_dw's launch, not run: ((kernel, ntasks, args), finish), where ``finish()``
    returns (dw or None, db_parts) once the tasks have run."""
    N, C, K, P, Q = geom.N, geom.C, geom.K, geom.P, geom.Q
    ipc, tyb, nchunks, most = tile_chunks(N, P, Q, True, WINOGRAD_TILES)
    groups = min(nchunks, DW_GROUPS)
    D_parts = _out.empty((groups if need_dw else 1, 16, K, C), x.dtype)   # D[e] (K, C)
    db_parts = np.empty((groups, K))                                   # float64
    chunks = (geom.ph, geom.pw, ipc, tyb, _wino.estride(C * most, x.itemsize),
              _wino.estride(K * most, x.itemsize), int(geom.layout != "NHWC"), nchunks, groups)
    args = (x, gy, y, use_mask, chunks, need_dw, blas, D_parts, db_parts)

    def finish():
        if not need_dw:
            return None, db_parts
        dw = np.empty((K, C, 3, 3), x.dtype)
        _wino.winograd_dw(sum_groups(D_parts, np.float64), dw)   # group order
        return dw, db_parts
    return (_wino.dw_tasks, groups, args), finish


# --------------------------------------------------------------------------- phase planes

def _phase_plan(geom):
    """Forward and dW over phase planes: (tap_plane, tap_off, planes, ext, Wq, slack)."""
    R, S, sh, sw, dh, dw = geom.R, geom.S, geom.sh, geom.sw, geom.dh, geom.dw
    orr = [r * dh // sh for r in range(R)]                         # row offset of tap r
    os_ = [s * dw // sw for s in range(S)]
    Wq = geom.Q + max(os_)
    phases = sorted({((r * dh) % sh, (s * dw) % sw) for r in range(R) for s in range(S)})
    index = {ab: i for i, ab in enumerate(phases)}
    tap_plane = np.array([index[((r * dh) % sh, (s * dw) % sw)] for r in range(R)
                          for s in range(S)], np.int64)
    tap_off = np.array([orr[r] * Wq + os_[s] for r in range(R) for s in range(S)], np.int64)
    return tap_plane, tap_off, np.array(phases, np.int64), max(orr), Wq, max(os_)


def _phase_rows(channels_per_row, width, itemsize):
    """Output rows per chunk: ``channels_per_row`` rows of ``width`` values ~CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // max(1, channels_per_row * width * itemsize))


def _phase_dx_plan(geom):
    """dX by input phase: (ph_taps, ph_start, ent_tap, ent_off, gmin, gext, gleft, Wg, slack)."""
    R, S, sh, sw, dh, dw, ph, pw = (geom.R, geom.S, geom.sh, geom.sw, geom.dh, geom.dw,
                                    geom.ph, geom.pw)
    rows = [[(r, (a + ph - r * dh) // sh) for r in range(R) if (a + ph - r * dh) % sh == 0]
            for a in range(sh)]                                    # (tap, output row offset)
    cols = [[(s, (b + pw - s * dw) // sw) for s in range(S) if (b + pw - s * dw) % sw == 0]
            for b in range(sw)]
    roffs = [o for taps in rows for _, o in taps] or [0]
    coffs = [o for taps in cols for _, o in taps] or [0]
    gmin, gext, gleft = min(roffs), max(roffs) - min(roffs), max(0, -min(coffs))
    Wg = -(-geom.W // sw) + max(coffs) + gleft
    ph_taps, ph_start, ent_tap, ent_off = [], [], [], []
    for a in range(sh):
        for b in range(sw):
            ph_start.append(len(ent_tap))
            ph_taps.append(len(rows[a]) * len(cols[b]))
            for r, ro in rows[a]:
                for s, co in cols[b]:
                    ent_tap.append(r * S + s)
                    ent_off.append((ro - gmin) * Wg + co + gleft)
    as_int = lambda v: np.array(v, np.int64)                       # noqa: E731
    return (as_int(ph_taps), as_int(ph_start), as_int(ent_tap), as_int(ent_off), gmin, gext,
            gleft, Wg, max(coffs) + gleft)


def _phase_dw(x, gy, y, use_mask, geom, need_dw, blas, work):
    """(dw or None, db_parts) by shifted GEMMs over phase planes."""
    N, C, K, R, S, P = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P
    nhwc = geom.layout == "NHWC"
    tap_plane, tap_off, planes, ext, Wq, slack = _phase_plan(geom)
    rpc = _balanced(P, _phase_rows(len(planes) * C + K, Wq, x.itemsize))
    nchunks = N * blocks(P, rpc)
    groups = min(nchunks, DW_GROUPS)
    dw_parts = _out.empty((groups if need_dw else 1, R * S, K, C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    launch(_phase_dw_tasks, groups, x, gy, y, use_mask, tap_plane, tap_off, planes, geom.sh,
           geom.sw, geom.ph, geom.pw, ext, Wq, slack, rpc, nchunks, groups, need_dw, nhwc, blas,
           dw_parts, db_parts, work=work, grain=1)
    if not need_dw:
        return None, db_parts
    dwm = sum_groups(dw_parts)                                         # group order
    return np.ascontiguousarray(dwm.reshape(R, S, K, C).transpose(2, 3, 0, 1)), db_parts


# --------------------------------------------------------------------------- pointwise

def _pointwise_view(a, nhwc):
    """A 1x1 conv's operand as the pointwise tasks take it: (N, C, HW) | (1, N*HW, C)."""
    return a.reshape(1, -1, a.shape[3]) if nhwc else a.reshape(a.shape[0], a.shape[1], -1)


def _pointwise_chunks(geom, channels, itemsize):
    """(pixels per chunk, chunks) of a pointwise pass."""
    HW = geom.P * geom.Q
    mpc = _balanced(geom.N * HW if geom.layout == "NHWC" else HW,
                    CHUNK_BYTES // max(1, channels * itemsize))
    nchunks = blocks(geom.N * HW, mpc) if geom.layout == "NHWC" else geom.N * blocks(HW, mpc)
    return mpc, nchunks


def _taps_mode(on, geom, cols, dtype):
    """The pointwise and phase-dX tasks' ``taps``: 0 (the BLAS), 1 or 2 (cpu_gemm_taps,
    16-float vectors) for an NHWC float32 product with ``cols`` (a multiple of 8) columns,
    where the flag ``on`` (POINTWISE_TAPS, PHASE_DX_TAPS) is set."""
    if not (on and geom.layout == "NHWC" and np.dtype(dtype) == np.float32 and cols % 8 == 0):
        return 0
    return 2 if _gemm_taps.WIDE else 1


def _pointwise_dw(x, gy, y, use_mask, geom, need_dw, blas, work):
    """(dw or None, db_parts) of a pointwise conv."""
    K, C = geom.K, geom.C
    nhwc = geom.layout == "NHWC"
    mpc, nchunks = _pointwise_chunks(geom, C + K, x.itemsize)
    groups = min(nchunks, DW_GROUPS)
    dw_parts = np.empty((groups if need_dw else 1, K, C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    launch(_pointwise_dw_tasks, groups, _pointwise_view(x, nhwc), _pointwise_view(gy, nhwc),
           _pointwise_view(y, nhwc), use_mask, mpc, nchunks, groups, need_dw, nhwc, blas,
           dw_parts, db_parts, work=work, grain=1)
    if not need_dw:
        return None, db_parts
    return sum_groups(dw_parts).reshape(K, C, 1, 1), db_parts         # group order


# --------------------------------------------------------------------------- im2col

def _im2col_dw(x, gy, y, use_mask, geom, need_dw, blas, work):
    """(dw or None, db_parts) by im2col chunks."""
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    nhwc = geom.layout == "NHWC"
    ipc, rpc = _chunking(P * Q, P, Q, R * S * C * x.itemsize, N)
    nchunks = _nchunks(N, P, ipc, rpc)
    groups = min(nchunks, DW_GROUPS)
    dw_parts = _out.empty((groups if need_dw else 1, K * R * S * C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    gy_k = gy.reshape(N, P * Q, K) if nhwc else gy.reshape(N, K, P * Q)
    y_k = y.reshape(N, P * Q, K) if nhwc else y.reshape(N, K, P * Q)
    slab = _slab(geom)
    launch(_dw_tasks, groups, x, gy_k, y_k, use_mask, geo_tuple(geom), ipc, rpc, nchunks,
           groups, False, slab, need_dw, blas, dw_parts.reshape(-1, K, R * S * C), db_parts,
           work=work, grain=1)
    if not need_dw:
        return None, db_parts
    dwm = sum_groups(dw_parts)                                         # group order
    if nhwc or slab:                                                   # (K, R, S, C)
        return np.ascontiguousarray(dwm.reshape(K, R, S, C).transpose(0, 3, 1, 2)), db_parts
    return dwm.reshape(K, C, R, S), db_parts


def _im2col_dx(gy, y, use_mask, w, geom, blas, dx, work):
    """dx (written in place) by phases over im2col chunks of the gated gradient."""
    N, C, H, W, K, R, S = geom.N, geom.C, geom.H, geom.W, geom.K, geom.R, geom.S
    nhwc = geom.layout == "NHWC"
    tr, orr, nr = _phases(H, R, geom.sh, geom.ph, geom.dh)
    ts, os_, ns = _phases(W, S, geom.sw, geom.pw, geom.dw)
    wphase, woff = _phase_weights(w, tr, nr, ts, ns, nhwc)
    rows_max = -(-H // geom.sh)
    wb_max = -(-W // geom.sw)
    ipc, rpc = _chunking(rows_max * wb_max, rows_max, wb_max,
                         int(nr.max()) * int(ns.max()) * K * gy.itemsize, N)
    per_phase = _nchunks(N, rows_max, ipc, rpc)
    launch(_dx_tasks, geom.sh * geom.sw * per_phase, gy.reshape(geom.y_shape),
           y.reshape(geom.y_shape), use_mask, geo_tuple(geom), ipc, rpc, per_phase, rows_max,
           tr, orr, nr, ts, os_, ns, wphase, woff, blas, dx, work=work, grain=1)


# --------------------------------------------------------------------------- drivers

def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w) + b?)`` for contiguous host arrays of one dtype."""
    N, C, K, P, Q = geom.N, geom.C, geom.K, geom.P, geom.Q
    nhwc = geom.layout == "NHWC"
    y = _out.empty(geom.y_shape, x.dtype)
    has_bias = b is not None
    b = b if has_bias else np.zeros(K, x.dtype)
    blas = _blas.blas_for(x.dtype)
    # elements touched, plus the multiply-adds counted 8 to an element: a conv with few
    # channels (the stem's 1 -> 24) touches few elements but is worth splitting
    work = x.size + y.size + N * P * Q * K * C * geom.R * geom.S // 8
    relu = bool(relu)
    kind = algorithm(geom, "forward", x.dtype)
    if kind == "winograd":
        _winograd_run(x, x, False, w, False, geom.ph, geom.pw, b, relu, nhwc, blas, y, work)
    elif kind == "winograd_s2":
        _wino_s2.forward(x, w, b, geom, relu, y, WINOGRAD_S2_TILES, _gemm_taps.WIDE, work)
    elif kind == "pointwise":
        wm = w.reshape(K, C)
        mpc, nchunks = _pointwise_chunks(geom, C + K, x.itemsize)
        xv = _pointwise_view(x, nhwc)
        launch(_pointwise_tasks, nchunks, xv, xv, False,
               np.ascontiguousarray(wm.T) if nhwc else wm, mpc, b, has_bias, relu, nhwc, blas,
               _taps_mode(POINTWISE_TAPS, geom, K, x.dtype), _pointwise_view(y, nhwc),
               work=work, grain=1)
    elif kind == "phase":
        tap_plane, tap_off, planes, ext, Wq, slack = _phase_plan(geom)
        rpc = _balanced(P, _phase_rows(len(planes) * C + K, Wq, x.itemsize))
        launch(_phase_tasks, N * blocks(P, rpc), x, _taps(w, not nhwc), tap_plane, tap_off,
               planes, geom.sh, geom.sw, geom.ph, geom.pw, ext, Wq, slack, rpc, b, relu, nhwc,
               blas, y, work=work, grain=1)
    elif kind == "implicit":
        ipc, rpc, nchunks, Hmax, Ws, aoff = _implicit_plan(geom, x.itemsize)
        launch(_implicit._implicit_tasks, nchunks, x, _taps(w, False), aoff, b, has_bias, relu,
               geo_tuple(geom), ipc, rpc, Hmax, Ws, _gemm_taps.WIDE,
               y.reshape(N, P * Q, K) if nhwc else y.reshape(N, K, P * Q), work=work, grain=1)
    else:
        ipc, rpc = _chunking(P * Q, P, Q, geom.R * geom.S * C * x.itemsize, N)
        y_k = y.reshape(N, P * Q, K) if nhwc else y.reshape(N, K, P * Q)  # (N, PQ, K) | (N, K, PQ)
        slab = _slab(geom)
        launch(_forward_tasks, _nchunks(N, P, ipc, rpc), x, _weight_matrix(w, nhwc or slab), b,
               has_bias, relu, geo_tuple(geom), ipc, rpc, False, slab, blas, y_k, work=work,
               grain=1)
    return y


def _implicit_plan(geom, itemsize):
    """(images per chunk, rows per chunk, chunks, slab rows of the tallest chunk, slab width,
    tap offsets) of the implicit forward and dW (cpu_implicit.py). A chunk's slab holds ~sh*sw
    input pixels an output pixel (plus the halo) and its output K values: those bytes, not
    im2col's R*S*C an output pixel, fill CHUNK_BYTES."""
    N, C, K, P, Q = geom.N, geom.C, geom.K, geom.P, geom.Q
    ipc, rpc = _chunking(P * Q, P, Q, (geom.sh * geom.sw * C + K) * itemsize, N)
    Hmax, Ws = _implicit.slab_shape(geom, P if ipc > 1 else rpc)
    return ipc, rpc, _nchunks(N, P, ipc, rpc), Hmax, Ws, _implicit.tap_offsets(geom, Ws)


def _implicit_dw(x, gy, y, use_mask, geom, need_dw, blas, work):
    """(dw or None, db_parts) of a strided conv over the forward's padded slabs
    (cpu_implicit._implicit_dw_tasks), in DW_GROUPS fixed groups of its chunks."""
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    nhwc = geom.layout == "NHWC"
    ipc, rpc, nchunks, Hmax, Ws, aoff = _implicit_plan(geom, x.itemsize)
    groups = min(nchunks, DW_GROUPS)
    dw_parts = _out.empty((groups if need_dw else 1, R * S, K, C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    gy_k = gy.reshape(N, P * Q, K) if nhwc else gy.reshape(N, K, P * Q)
    y_k = y.reshape(N, P * Q, K) if nhwc else y.reshape(N, K, P * Q)
    launch(_implicit._implicit_dw_tasks, groups, x, gy_k, y_k, use_mask, geo_tuple(geom), ipc,
           rpc, nchunks, groups, need_dw, Hmax, Ws, aoff, _gemm_taps.WIDE, dw_parts, db_parts,
           work=work, grain=1)
    if not need_dw:
        return None, db_parts
    dwm = sum_groups(dw_parts)                                         # group order
    return np.ascontiguousarray(dwm.reshape(R, S, K, C).transpose(2, 3, 0, 1)), db_parts


def _winograd_s2_dw(x, gy, y, use_mask, geom, need_dw, blas, work):
    return _wino_s2.dw(x, gy, y, use_mask, geom, need_dw, WINOGRAD_S2_TILES, DW_GROUPS,
                       _gemm_taps.WIDE, work)


_DW = {"winograd": _winograd_dw, "winograd_s2": _winograd_s2_dw, "phase": _phase_dw,
       "pointwise": _pointwise_dw, "im2col": _im2col_dw, "implicit": _implicit_dw}


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``y = relu?(conv(x, w) + b)``; ``y`` given: g = gy * (y > 0).

    Only the gradients flagged in ``need`` are computed (the others are ``None``).
    """
    need_dx, need_dw, need_db = (bool(v) for v in need)
    use_mask = y is not None
    y = y if use_mask else gy
    blas = _blas.blas_for(gy.dtype)
    work = x.size + 2 * gy.size

    def bias_grad(db_parts):
        return np.add.reduce(db_parts, axis=0).astype(gy.dtype) if need_db else None  # group order

    def weights():
        if not (need_dw or need_db):
            return None, None
        dw, db_parts = _DW[algorithm(geom, "dw", x.dtype)](x, gy, y, use_mask, geom, need_dw,
                                                           blas, work)
        return dw, bias_grad(db_parts)

    def inputs():
        return _conv_dx(gy, y, use_mask, w, geom, blas, work) if need_dx else None

    small = need_dx and (need_dw or need_db) and work < CONCURRENT_MAX_ELEMENTS
    if (small and SHARED_BACKWARD
            and algorithm(geom, "dx", gy.dtype) == algorithm(geom, "dw", x.dtype) == "winograd"):
        # one job of dW's groups and dX's chunks, shared by the threads
        dx = _out.empty(geom.x_shape, gy.dtype)
        dw_task, finish = _winograd_dw_launch(x, gy, y, use_mask, geom, need_dw, blas)
        dx_task = _winograd_launch(*_winograd_dx_args(gy, y, use_mask, w, geom, blas, dx))[0]
        launch_all([dw_task, dx_task], work=work)
        dw, db_parts = finish()
        db = bias_grad(db_parts)
    elif small:
        dx, (dw, db) = concurrently(inputs, weights, work=work)
    else:
        (dw, db), dx = weights(), inputs()
    return dx, dw, db


def _winograd_dx_args(gy, y, use_mask, w, geom, blas, dx):
    """dX by Winograd: dx = 3x3 correlation of g padded by 2 - ph, taps w[:, :, 2-r, 2-s]^T
    (C, K); _winograd_run's / _winograd_launch's arguments up to ``out`` (dx)."""
    return (gy, y, use_mask, w, True, 2 - geom.ph, 2 - geom.pw, np.zeros(geom.C, gy.dtype),
            False, geom.layout == "NHWC", blas, dx)


def _conv_dx(gy, y, use_mask, w, geom, blas, work):
    """dx of a convolution from gy (gated by y > 0 when ``use_mask``)."""
    N, C, H, W, K = geom.N, geom.C, geom.H, geom.W, geom.K
    nhwc = geom.layout == "NHWC"
    dx = _out.empty(geom.x_shape, gy.dtype)
    kind = algorithm(geom, "dx", gy.dtype)
    if kind == "winograd":
        _winograd_run(*_winograd_dx_args(gy, y, use_mask, w, geom, blas, dx), work)
    elif kind == "winograd_s2":
        _wino_s2dx.dx(gy, y, use_mask, w, geom, dx, WINOGRAD_S2_TILES, _gemm_taps.WIDE, work)
    elif kind == "pointwise":
        wm = w.reshape(K, C)                                           # dx = g @ w | w^T @ g
        mpc, nchunks = _pointwise_chunks(geom, C + K, gy.itemsize)
        launch(_pointwise_tasks, nchunks, _pointwise_view(gy, nhwc), _pointwise_view(y, nhwc),
               use_mask, wm if nhwc else np.ascontiguousarray(wm.T), mpc,
               np.zeros(C, gy.dtype), False, False, nhwc, blas,
               _taps_mode(POINTWISE_TAPS, geom, C, gy.dtype), _pointwise_view(dx, nhwc),
               work=work, grain=1)
    elif kind == "phase":
        ph_taps, ph_start, ent_tap, ent_off, gmin, gext, gleft, Wg, slack = _phase_dx_plan(geom)
        rpc = _balanced(-(-H // geom.sh), _phase_rows(K + C, Wg, gy.itemsize))
        wtap = _taps(w, nhwc)
        taps = _taps_mode(PHASE_DX_TAPS, geom, C, gy.dtype)
        wph = np.ascontiguousarray(wtap[ent_tap]) if taps else np.empty((0, 1, 1), gy.dtype)
        launch(_phase_dx_tasks, N * blocks(-(-H // geom.sh), rpc), gy, y, use_mask, wtap,
               ph_taps, ph_start, ent_tap, ent_off, gmin, gext, gleft, Wg, slack, rpc, geom.sh,
               geom.sw, nhwc, blas, wph, taps, dx, work=work, grain=1)
    else:
        _im2col_dx(gy, y, use_mask, w, geom, blas, dx, work)
    return dx


# --------------------------------------------------------------------------- unfused bias_add

def bias_add(x, b, layout):
    """``x + b[c]`` for a contiguous 4-d ``x`` in ``layout`` and ``b`` (C,)."""
    shape = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)   # b broadcast over N, H, W
    return x + b.reshape(shape)


def channel_sum(gy, layout):
    """Per-channel sum of a 4-d ``gy`` over N, H, W (float64 accumulation), shape (C,)."""
    axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
    return gy.sum(axis=axes, dtype=np.float64).astype(gy.dtype)
