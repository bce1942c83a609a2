r"""CPU convolution drivers: per-chunk gather + single-threaded GEMMs + epilogue, one task each.

Work is cut into *chunks* (blocks of output rows of one image, or several small images) sized
to stay in one core's L2. Each chunk is one task of numbafuse's thread pool (``cpu/launch.py``):
the thread that takes it gathers the chunk's input, runs its GEMMs on numbafuse's private
single-threaded BLAS (``cpu/blas.py``) and applies the epilogue (bias, ReLU) while the result is
still in its cache. No thread pool hands a chunk to another one.

Which kernels run a pass, and how it is chunked, is a value: ``cpu_plan.plan(geom, pass_,
dtype) -> Plan`` (the algorithms and the measured rules are listed there). The drivers here
follow a plan: :func:`conv_forward` and :func:`conv_backward` make one by the current rules
unless they are given one.

Backward, from ``gy`` and (fused op) the output ``y``, whose sign is the ReLU mask:
g = gy * (y > 0), formed while the kernels read gy. dW and db: chunks go into ``dw_groups``
fixed groups (a function of the shape only), one task each with its own partial (db in
float64), summed in group order afterwards: results do not depend on the thread count. dX:
every dx element is written by exactly one task. A small backward runs dX and dW at once
(``Rules.concurrent_max_elements``), as one shared job where both are Winograd passes
(``Rules.shared_max_elements``).

Conv-BatchNorm: :func:`forward_stats` and :func:`forward_bn_sums` run the Winograd forward
with batch norm's per-channel sums in each chunk's epilogue (``cpu_epilogue.py``).

Outputs (y, dx, the Conv-BatchNorm's) and the dW partials come from
``cpu.buffers.output_cache``: a released buffer is reused instead of fresh pages that fault
on first touch (in a process alternating conv shapes, glibc returns the freed memory to the
kernel and every call would fault its output in again: ~525 faults and ~1.2 ms a call at a
1x1 shape's 16 MiB output).

Both layouts run the same task kernels: the layout is a flag tested once per chunk, and only
the small gather/scatter helpers have per-layout loop nests.
"""
from typing import NamedTuple

import numpy as np

from ..cpu import blas as _blas, gemm_taps as _gemm_taps, recorded as _rec
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import blocks, concurrently, launch, launch_all
from . import cpu_plan
from . import math as conv_math
from . import weights as _weights
from .cpu_plan import algorithm, plan as _plan

geo_tuple = conv_math.geo_tuple
_ints = conv_math.int_tuple
_k_view = conv_math.k_view

from . import cpu_epilogue as _epi  # noqa: E402
from ..batchnorm import cpu as _bn_cpu  # noqa: E402
from . import cpu_implicit as _implicit  # noqa: E402
from . import cpu_winograd as _wino  # noqa: E402
from . import cpu_winograd_s2 as _wino_s2  # noqa: E402
from . import cpu_winograd_s2dx as _wino_s2dx  # noqa: E402
from . import cpu_direct as _direct  # noqa: E402
from . import cpu_pointwise as _pointwise  # noqa: E402
from . import cpu_im2col as _im2col  # noqa: E402
from . import cpu_im2col_fwd as _im2col_fwd  # noqa: E402
from . import cpu_im2col_dw as _im2col_dwk  # noqa: E402
from . import cpu_tapwise as _tapwise  # noqa: E402
from .cpu_chunks import (balanced, count_chunks, most_taps as _most_taps,  # noqa: E402
                         phase_weights as _phase_weights, phases as _phases, sum_groups,
                         tile_chunks)

__all__ = ["algorithm", "conv_forward", "conv_backward", "forward_stats", "forward_bn_sums",
           "forward_scaled", "DX_ADDEND"]
DX_ADDEND = False   # conv_backward takes no dx_addend: the tape adds (interfaces.ConvKernels)


def _chunking(plan, pixels_per_image, rows, row_pixels, row_bytes, images):
    """(images per chunk, rows per chunk): whole images if one image's matrix is small, else
    blocks of rows of one image; ``row_bytes``: the im2col bytes of one output pixel. Whole
    images are grouped into at least ``plan.min_chunks`` chunks (of the ``images``) where
    there are that many: a batch whose im2col fits one chunk (the stem's C = 1) still splits
    over the threads (a fixed count, so the chunks do not depend on the thread count)."""
    target = max(1, plan.chunk_bytes // max(row_bytes, 1))     # pixels of one chunk
    if pixels_per_image <= target:
        ipc = max(1, target // max(pixels_per_image, 1))
        return max(1, min(ipc, images // plan.min_chunks)), rows
    return 1, balanced(rows, target // max(row_pixels, 1))


def _weight_matrix(w, nhwc):
    """NCHW: (K, C*R*S) = w as it is; NHWC: (K, R*S*C), columns in the cols order."""
    K, C, R, S = w.shape
    if not nhwc:
        return w.reshape(K, C * R * S)
    return _weights.derived(w, "matrix", lambda: np.ascontiguousarray(
        w.transpose(0, 2, 3, 1)).reshape(K, R * S * C))


def _taps(w, k_rows, cache=True):
    """The taps w_rs as (R*S, K, C) (``k_rows``) or (R*S, C, K), contiguous (``cache``: kept
    as ``weights.derived`` says; dX's, used once a version, are not)."""
    K, C, R, S = w.shape
    order = (2, 3, 0, 1) if k_rows else (2, 3, 1, 0)

    def make():
        return np.ascontiguousarray(w.transpose(order)).reshape(R * S, *((K, C) if k_rows
                                                                         else (C, K)))
    return _weights.derived(w, ("taps", bool(k_rows)), make) if cache else make()


def _winograd_taps(w, flip, shape):
    U = _out.empty(shape, w.dtype)                                 # the GEMMs' orientation
    _wino.winograd_taps(w, flip, U)
    return U


# --------------------------------------------------------------------------- Winograd

class _Correlation(NamedTuple):
    """One Winograd pass: out = relu?(3x3 correlation of src (gated by gate > 0 where
    ``use_gate``) zero-padded by top/left, taps w (K, C, 3, 3), * scale + bias), ``bias``
    (2K,) the bias then the scale (:func:`_bias_scale`); ``flip``: the taps flipped and
    transposed (dX)."""
    src: np.ndarray
    gate: np.ndarray
    use_gate: bool
    w: np.ndarray
    flip: bool
    top: int
    left: int
    bias: np.ndarray
    relu: bool
    nhwc: bool
    out: np.ndarray


def _winograd_run(c, plan, work):
    """Run the Winograd pass ``c`` (a :class:`_Correlation`) in ``plan``'s chunks."""
    kernel, ntasks, args = _winograd_launch(c, plan)[0]
    launch(kernel, ntasks, *args, work=work, grain=1)


def _winograd_launch(c, plan, epi=_epi.EPI_NONE, ev=None, dg=None, affine=False):
    """The Winograd pass ``c``'s launch, not run: ((kernel, ntasks, args), parts, counts).
    With a batch-norm epilogue (``epi``, :mod:`cpu_epilogue`: values ``ev``, (dy, g) ``dg``)
    the kernel fills each chunk's (parts, counts)."""
    w, out = c.w, c.out
    _wino.ready(c.src.dtype, nhwc=c.nhwc)
    Ci, Co = (w.shape[0], w.shape[1]) if c.flip else (w.shape[1], w.shape[0])
    N, Ho, Wo = out.shape[0], *(out.shape[1:3] if c.nhwc else out.shape[2:4])
    U = (_winograd_taps(w, c.flip, (16, Ci, Co)) if c.flip else     # (dX: once a version)
         _weights.derived(w, "winograd", lambda: _winograd_taps(w, False, (16, Ci, Co))))
    ipc, tyb, nchunks, most = tile_chunks(N, Ho, Wo, True, plan.tiles)
    chunks = (c.top, c.left, ipc, tyb, _wino.estride(Ci * most, c.src.itemsize),
              _wino.estride(Co * most, c.src.itemsize), int(not c.nhwc))
    blas = _blas.blas_for(c.src.dtype)
    if epi == _epi.EPI_NONE:
        args = (c.src, c.gate, c.use_gate, U, chunks, c.bias, c.relu, blas, out)
        return (_wino.forward_tasks, nchunks, args), None, None
    _epi.BLOCK.ready(c.src.dtype)
    parts, counts = np.empty((nchunks, 3, Co)), np.empty(nchunks)
    dg = (out, out) if dg is None else dg
    ev = np.zeros((4, _epi.tiles(Co) * Co), c.src.dtype) if ev is None else ev
    args = (c.src, U, chunks, blas, out, (epi, int(affine)), ev.astype(c.src.dtype, copy=False),
            dg, parts, counts)
    return (_wino.forward_epilogue_tasks, nchunks, args), parts, counts


def _bn_epilogue(geom, dtype, nhwc_only):
    """The forward's plan where it is the Winograd pass over HWC rows, which has the batch-norm
    epilogue; else None."""
    plan = _plan(geom, "forward", dtype)
    nhwc = geom.layout == "NHWC"
    ok = plan.algorithm == "winograd" and (nhwc or not nhwc_only) and geom.N > 0
    return plan if ok else None


def _forward_epilogue(x, w, geom, plan, epi, **values):
    h = _out.empty(geom.y_shape, x.dtype)
    c = _Correlation(x, x, False, w, False, geom.ph, geom.pw, None, False,
                     geom.layout == "NHWC", h)                  # (the epilogue's own bias)
    (kernel, ntasks, args), parts, counts = _winograd_launch(c, plan, epi, **values)
    launch(kernel, ntasks, *args, work=x.size + h.size, grain=1)
    return h, parts, counts


def forward_stats(x, w, geom, eps):
    """``(h, mean, var, invstd)`` of a bias-free conv: its output h and h's batch statistics
    (float64 (K,), var biased) from the conv's chunks (:mod:`cpu_epilogue`, EPI_STATS), or
    None where the forward is not the Winograd pass over HWC rows (the caller then makes the
    statistics pass)."""
    plan = _bn_epilogue(geom, x.dtype, False)
    if plan is None:
        return None
    h, parts, counts = _forward_epilogue(x, w, geom, plan, _epi.EPI_STATS)
    mean, var, invstd = np.empty((3, geom.K))
    _rec.step(_epi.merge_stats, parts, counts, float(eps), mean, var, invstd)
    return h, mean, var, invstd


def _scales(algorithm, geom, z=False):
    """Whether ``algorithm``'s forward of ``geom`` has the scale (and, ``z``, residual)
    epilogue (:func:`forward_scaled`): im2col, tapwise, the NCHW pointwise GEMMs; Winograd's
    output transform without a residual."""
    return (algorithm in ("im2col", "tapwise") or (algorithm == "pointwise"
            and geom.layout == "NCHW") or (algorithm == "winograd" and not z))


def _bias_scale(b, scale):
    """The Winograd output transform's (2K,): b, then ``scale`` (ones where None)."""
    return _rec.joined(b, 1 if scale is None else scale)


def forward_scaled(x, w, values, geom, relu, z=None):
    """``relu?(scale[k] * conv(x, w) + shift[k] [+ z])``, ``(scale, shift) = values()`` (K,)
    each (inference batch norm after a bias-free conv, not folded into w: the forwards of
    :func:`_scales` scale their sums in the epilogue; ``z``, y's shape: a residual added
    there too, Conv-BN-Add-ReLU in one pass), or None (the caller folds, ``values`` not
    called). A fold rewrote w every call (two batch-norm launches unless the weight cache
    kept it): ResNet-50's eval, batch 16, 64x64, its 1x1 sites 38.2 -> 32.5 ms."""
    plan = cpu_plan.scaled(geom, x.dtype)
    if not _scales(plan.algorithm, geom, z is not None) or geom.N == 0:
        return None
    scale, shift = values()
    return conv_forward(x, w, shift, geom, relu, plan=plan, scale=scale, z=z)


def forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta):
    """``(h, g, sums)``: a bias-free conv's output h (recomputed) with pass 1 of the batch-norm
    backward of ``[relu](batchnorm(h))`` made by its chunks (EPI_BN_SUMS): ``g = dy`` gated
    where ``gamma*xhat + beta > 0`` (``beta`` None: no ReLU, g = dy) and sums (chunks, 2, K)
    float64 of g and g*(h - mean), for ``kernels/batchnorm/cpu.backward(g, ..., STATE_NONE,
    sums=sums)``. NHWC only (``dy`` shaped as h); None where the forward is not the Winograd
    pass."""
    plan = _bn_epilogue(geom, x.dtype, True)
    if plan is None:
        return None
    m, shift = _epi.tiles(geom.K), gamma if beta is None else beta
    values = np.empty((4, m * geom.K), x.dtype)                   # batch norm's, tiled
    _rec.step(_bn_cpu.channel_values, mean, invstd, gamma, shift, m, values)
    g = _out.empty(geom.y_shape, x.dtype)
    h, parts, _ = _forward_epilogue(x, w, geom, plan, _epi.EPI_BN_SUMS, ev=values, dg=(dy, g),
                                    affine=beta is not None)
    return h, g, np.ascontiguousarray(parts[:, :2])


def _winograd_dw_launch(x, gy, y, use_mask, geom, need_dw, plan):
    """The Winograd dW's launch, not run: ((kernel, ntasks, args), finish), where
    ``finish()`` returns (dw or None, db_parts) once the tasks have run."""
    N, C, K, P, Q = geom.N, geom.C, geom.K, geom.P, geom.Q
    _wino.ready(x.dtype, dw=True, nhwc=geom.layout == "NHWC")
    ipc, tyb, nchunks, most = tile_chunks(N, P, Q, True, plan.tiles)
    groups = min(nchunks, plan.dw_groups)
    D_parts = _out.empty((groups if need_dw else 1, 16, K, C), x.dtype)   # D[e] (K, C)
    db_parts = np.empty((groups, K))                                   # float64
    chunks = (geom.ph, geom.pw, ipc, tyb, _wino.estride(C * most, x.itemsize),
              _wino.estride(K * most, x.itemsize), int(geom.layout != "NHWC"), nchunks, groups)
    args = (x, gy, y, use_mask, chunks, need_dw, _blas.blas_for(x.dtype), D_parts, db_parts)

    def finish():
        if not need_dw:
            return None, db_parts
        dw = _out.empty((K, C, 3, 3), x.dtype)
        _wino.winograd_dw(sum_groups(D_parts, np.float64), dw)   # group order
        return dw, db_parts
    return (_wino.dw_tasks, groups, args), finish


def _winograd_dw(x, gy, y, use_mask, geom, need_dw, plan, work):
    """(dw or None, db_parts) of a 3x3 stride-1 conv by Winograd."""
    (kernel, ntasks, args), finish = _winograd_dw_launch(x, gy, y, use_mask, geom, need_dw, plan)
    launch(kernel, ntasks, *args, work=work, grain=1)
    return finish()


def _winograd_dx(gy, y, use_mask, w, geom, dx):
    """dX by Winograd: dx = 3x3 correlation of g padded by 2 - ph, taps w[:, :, 2-r, 2-s]^T
    (C, K)."""
    return _Correlation(gy, y, use_mask, w, True, 2 - geom.ph, 2 - geom.pw,
                        _bias_scale(np.zeros(geom.C, gy.dtype), None), False,
                        geom.layout == "NHWC", dx)


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


def _phase_rows(plan, channels_per_row, width, itemsize):
    """Output rows per chunk: ``channels_per_row`` rows of ``width`` values ~chunk_bytes."""
    return max(1, plan.chunk_bytes // max(1, channels_per_row * width * itemsize))


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


def _phase_dw(x, gy, y, use_mask, geom, need_dw, plan, work):
    """(dw or None, db_parts) by shifted GEMMs over phase planes."""
    N, C, K, R, S, P = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P
    tap_plane, tap_off, planes, ext, Wq, slack = _phase_plan(geom)
    rpc = balanced(P, _phase_rows(plan, len(planes) * C + K, Wq, x.itemsize))
    nchunks = N * blocks(P, rpc)
    groups = min(nchunks, plan.dw_groups)
    dw_parts = _out.empty((groups if need_dw else 1, R * S, K, C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    _direct.ready(x.dtype)
    launch(_direct.phase_dw_tasks, groups, x, gy, y, use_mask, (tap_plane, tap_off, planes),
           _ints(geom.sh, geom.sw, geom.ph, geom.pw, ext, Wq, slack, rpc, nchunks, groups),
           need_dw, geom.layout == "NHWC", _blas.blas_for(x.dtype), (dw_parts, db_parts),
           work=work, grain=1)
    if not need_dw:
        return None, db_parts
    dwm = sum_groups(dw_parts)                                         # group order
    return np.ascontiguousarray(dwm.reshape(R, S, K, C).transpose(2, 3, 0, 1)), db_parts


# --------------------------------------------------------------------------- im2col

def _im2col_chunks(plan, geom, itemsize):
    """(images per chunk, rows per chunk, output-channel blocks) of the im2col forward:
    ``plan.k_blocks`` > 1, one chunk of the whole batch whose GEMM each of the k_blocks tasks
    runs for its block of output channels (every weight read once); else chunks of about
    chunk_bytes of cols."""
    if plan.k_blocks > 1:
        return geom.N, geom.P, plan.k_blocks
    return (*_chunking(plan, geom.P * geom.Q, geom.P, geom.Q,
                       geom.R * geom.S * geom.C * itemsize, geom.N), 1)


def _batch_cols(x, geom, slab, build):
    """The whole batch's im2col matrix, built once (``cpu_im2col.cols_tasks``, a task an
    image) for the k-blocked forward and dW, whose every task reads it: (M, R*S*C) for NHWC
    and over NCHW slabs, else (C*R*S, M), M = N*P*Q; (0, 0) when not ``build``. Each task had
    gathered it itself: k_blocks gathers of the same matrix (l4 3x3 512 -> 512 at batch 16,
    2x2: four of 1.2 MB)."""
    if not build:
        return np.empty((0, 0), x.dtype)
    M, RSC = geom.N * geom.P * geom.Q, geom.R * geom.S * geom.C
    nhwc = geom.layout == "NHWC"
    orient = 0 if nhwc else 1 if slab else 2
    cols = np.empty((M, RSC) if orient < 2 else (RSC, M), x.dtype)
    launch(_im2col.cols_tasks, geom.N, x, geo_tuple(geom), orient, cols, work=cols.size)
    return cols


def _im2col_dw(x, gy, y, use_mask, geom, need_dw, plan, work):
    """(dw or None, db_parts) by im2col chunks, or (``plan.k_blocks`` > 1) the whole batch in
    blocks of output channels."""
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    if plan.k_blocks > 1:
        dwm = _out.empty((K if need_dw else 0, R * S * C), x.dtype)
        db = np.empty((1, K))                                          # float64
        _im2col.ready(x.dtype, geom.layout == "NHWC", bool(plan.slab))
        cols = _batch_cols(x, geom, plan.slab, need_dw)
        ordered = False
        if need_dw and (geom.layout == "NHWC" or plan.slab) and R * S > 1:  # back in w's order
            _im2col.ready_reorder(x.dtype)
            ordered = cols.shape[0] < K         # the batch's cols in (c, r, s) order, once
            if ordered:
                cols = _im2col_dwk.in_w_order(cols, R * S, C)
        launch(_im2col_dwk.dw_block_tasks, plan.k_blocks, x, _k_view(gy, geom), _k_view(y, geom),
               use_mask, geo_tuple(geom), int(plan.k_blocks),
               (bool(plan.slab), bool(need_dw), ordered), _blas.blas_for(x.dtype), cols,
               (dwm, db[0]), work=work, grain=1)
        return (dwm.reshape(K, C, R, S) if need_dw else None), db      # (in w's order)
    ipc, rpc = _chunking(plan, P * Q, P, Q, R * S * C * x.itemsize, N)
    nchunks = count_chunks(N, P, ipc, rpc)
    groups = min(nchunks, plan.dw_groups)
    dw_parts = _out.empty((groups if need_dw else 1, K * R * S * C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    _im2col.ready(x.dtype, geom.layout == "NHWC", bool(plan.slab))
    gather = need_dw and _im2col_dwk.gathers_dw(geom, plan.slab, x.dtype)
    if gather:
        _im2col.ready_reorder(x.dtype)                                 # (g's transposes)
    launch(_im2col_dwk.dw_tasks, groups, x, _k_view(gy, geom), _k_view(y, geom), use_mask,
           geo_tuple(geom), _ints(ipc, rpc, nchunks, groups),
           (bool(plan.slab), bool(need_dw), gather), _blas.blas_for(x.dtype),
           (dw_parts.reshape(-1, K, R * S * C), db_parts), work=work, grain=1)
    if not need_dw:
        return None, db_parts
    dwm = sum_groups(dw_parts)                                         # group order
    if gather:                                                         # dW^T (C*R*S, K)
        dwm = np.ascontiguousarray(dwm.reshape(R * S * C, K).T)
    return _dw_from_cols_order(dwm, geom, plan), db_parts


def _dw_from_cols_order(dwm, geom, plan):
    """dw (K, C, R, S) from the (K, R*S*C) (NHWC, slabs) or (K, C*R*S) matrix of im2col."""
    K, C, R, S = geom.K, geom.C, geom.R, geom.S
    if geom.layout == "NHWC" or plan.slab:                             # (K, R, S, C)
        return np.ascontiguousarray(dwm.reshape(K, R, S, C).transpose(0, 3, 1, 2))
    return dwm.reshape(K, C, R, S)


def _im2col_dx(gy, y, use_mask, w, geom, plan, dx, work):
    """dx (written in place) by phases over im2col chunks of the gated gradient, or
    (``plan.k_blocks`` > 1) one GEMM of the whole batch in blocks of input channels."""
    N, H, W, K, R, S = geom.N, geom.H, geom.W, geom.K, geom.R, geom.S
    if plan.k_blocks > 1:
        # a range of blocks a thread (launch caps the grain), each gathering the gated g once
        # (a range a block: once a block; 1x1 2048 -> 512, 2x2, batch 16: 1.09 ms, now 0.85)
        launch(_im2col.dx_block_tasks, plan.k_blocks, gy.reshape(geom.y_shape),
               y.reshape(geom.y_shape), use_mask,
               np.ascontiguousarray(w, gy.dtype).reshape(K, geom.C * R * S), geo_tuple(geom),
               int(plan.k_blocks), _blas.blas_for(gy.dtype), dx, work=work,
               grain=int(plan.k_blocks))
        return
    rows, cols = (H, R, geom.sh, geom.ph, geom.dh), (W, S, geom.sw, geom.pw, geom.dw)
    (tr, orr, nr), (ts, os_, ns) = _phases(*rows), _phases(*cols)
    wphase, woff = _phase_weights(w, rows, cols, geom.layout == "NHWC")
    rows_max = -(-H // geom.sh)
    wb_max = -(-W // geom.sw)
    ipc, rpc = _chunking(plan, rows_max * wb_max, rows_max, wb_max,
                         _most_taps(*rows) * _most_taps(*cols) * K * gy.itemsize, N)
    per_phase = count_chunks(N, rows_max, ipc, rpc)
    launch(_im2col.dx_tasks, geom.sh * geom.sw * per_phase, gy.reshape(geom.y_shape),
           y.reshape(geom.y_shape), use_mask, geo_tuple(geom),
           _ints(ipc, rpc, per_phase, rows_max), (tr, orr, nr, ts, os_, ns), (wphase, woff),
           _blas.blas_for(gy.dtype), dx, work=work, grain=1)


# --------------------------------------------------------------------------- implicit GEMM

def _implicit_plan(plan, geom, itemsize):
    """(images per chunk, rows per chunk, chunks, slab rows of the tallest chunk, slab width)
    of the implicit forward and dW (cpu_implicit.py). A chunk's slab holds ~sh*sw input pixels
    an output pixel and its output K values: those bytes, not im2col's R*S*C an output pixel,
    fill chunk_bytes."""
    N, C, K, P, Q = geom.N, geom.C, geom.K, geom.P, geom.Q
    ipc, rpc = _chunking(plan, P * Q, P, Q, (geom.sh * geom.sw * C + K) * itemsize, N)
    Hmax, Ws = _implicit.slab_shape(geom, P if ipc > 1 else rpc)
    return ipc, rpc, count_chunks(N, P, ipc, rpc), Hmax, Ws


def _implicit_dw(x, gy, y, use_mask, geom, need_dw, plan, work):
    """(dw or None, db_parts) of a strided conv over the forward's padded slabs
    (cpu_implicit.implicit_dw_tasks), in dw_groups fixed groups of its chunks."""
    K, C, R, S = geom.K, geom.C, geom.R, geom.S
    chunks = _implicit_plan(plan, geom, x.itemsize)
    if C % 8:                           # by output rows (a stem's: cpu_implicit.gathers)
        return _implicit.dw_by_rows(x, gy, y, use_mask, geom, need_dw, chunks, plan.taps, work)
    ipc, rpc, nchunks, Hmax, Ws = chunks
    groups = min(nchunks, plan.dw_groups)
    dw_parts = _out.empty((groups if need_dw else 1, R * S, K, C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    _implicit.ready()
    launch(_implicit.implicit_dw_tasks, groups, x, _k_view(gy, geom), _k_view(y, geom),
           use_mask, geo_tuple(geom), _ints(ipc, rpc, nchunks, groups, Hmax, Ws),
           (bool(need_dw), plan.taps == 2), _implicit.tap_offsets(geom, Ws),
           (dw_parts, db_parts), work=work, grain=1)
    if not need_dw:
        return None, db_parts
    dwm = sum_groups(dw_parts)                                         # group order
    return np.ascontiguousarray(dwm.reshape(R, S, K, C).transpose(2, 3, 0, 1)), db_parts


def _winograd_s2_dw(x, gy, y, use_mask, geom, need_dw, plan, work):
    return _wino_s2.dw(x, gy, y, use_mask, geom, need_dw, plan.tiles, plan.dw_groups,
                       plan.taps == 2, work)


_DW = {"winograd": _winograd_dw, "winograd_s2": _winograd_s2_dw, "phase": _phase_dw,
       "pointwise": _pointwise.dw, "im2col": _im2col_dw, "implicit": _implicit_dw}


# --------------------------------------------------------------------------- drivers

def conv_forward(x, w, b, geom, relu, plan=None, scale=None, z=None):
    """``y = relu?(conv(x, w) + b?)`` for contiguous host arrays of one dtype, as ``plan``
    says (default: :func:`cpu_plan.plan` of the forward by the current rules); ``scale``
    (K,): ``relu?(scale * conv(x, w) + b?)``, and ``z`` (contiguous, y's shape and dtype):
    ``z`` added before the ReLU; the plans of :func:`_scales` only (:func:`forward_scaled`)."""
    N, C, K = geom.N, geom.C, geom.K
    nhwc = geom.layout == "NHWC"
    plan = _plan(geom, "forward", x.dtype) if plan is None else plan
    y = _out.empty(geom.y_shape, x.dtype)
    has_bias = b is not None
    b = b if has_bias else np.zeros(K, x.dtype)
    blas = _blas.blas_for(x.dtype)
    # elements touched, plus the multiply-adds counted 8 to an element: a conv with few
    # channels (the stem's 1 -> 24) touches few elements but is worth splitting
    work = x.size + y.size + N * geom.P * geom.Q * K * C * geom.R * geom.S // 8
    relu = bool(relu)
    kind = plan.algorithm
    if (scale is not None or z is not None) and not _scales(kind, geom, z is not None):
        raise ValueError(f"conv_forward: scale= and z= need the im2col, tapwise or NCHW "
                         f"pointwise plan (scale= alone: Winograd too), not {kind!r}")
    if kind == "winograd":
        _winograd_run(_Correlation(x, x, False, w, False, geom.ph, geom.pw,
                                   _bias_scale(b, scale), relu, nhwc, y), plan, work)
    elif kind == "winograd_s2":
        _wino_s2.forward(x, w, b, geom, relu, y, plan.tiles, plan.taps == 2, work)
    elif kind == "pointwise":
        _pointwise.forward(x, w, b, has_bias, scale, z, relu, geom, plan, blas, y, work)
    elif kind == "phase":
        tap_plane, tap_off, planes, ext, Wq, slack = _phase_plan(geom)
        rpc = balanced(geom.P, _phase_rows(plan, len(planes) * C + K, Wq, x.itemsize))
        _direct.ready(x.dtype)
        launch(_direct.phase_tasks, N * blocks(geom.P, rpc), x, _taps(w, not nhwc),
               (tap_plane, tap_off, planes),
               _ints(geom.sh, geom.sw, geom.ph, geom.pw, ext, Wq, slack, rpc), b, relu, nhwc,
               blas, y, work=work, grain=1)
    elif kind == "tapwise":
        _tapwise.forward(x, w, b, has_bias, scale, geom, relu, plan.k_blocks, y, blas, work,
                         z)
    elif kind == "implicit":
        _implicit.forward(x, w, b, has_bias, relu, geom, plan.taps == 2,
                          _implicit_plan(plan, geom, x.itemsize), _taps, y, work)
    else:
        ipc, rpc, kb = _im2col_chunks(plan, geom, x.itemsize)
        _im2col.ready(x.dtype, geom.layout == "NHWC", bool(plan.slab))
        # k blocks over NHWC-ordered cols: each block's task reorders its weights itself
        # (into wdst, kept by the weight cache where it keeps w's arrays), unless cached
        ordered = (nhwc or plan.slab) and geom.R * geom.S > 1       # (1x1: w's order is)
        kept = _weights.peek(w, "matrix") if kb > 1 and ordered else None
        wt = kb > 1 and ordered and kept is None
        wdst = np.empty((K if wt and _weights.will_keep(w) else 0, w[0].size), x.dtype)
        if wt:
            _im2col.ready_reorder(x.dtype)
        wmat = (w.reshape(K, -1) if wt else kept if kept is not None
                else _weight_matrix(w, ordered))
        tasks = _im2col_fwd.forward_tasks_hwc if nhwc else _im2col_fwd.forward_tasks_chw
        zv = np.empty((0, 0, 0), x.dtype) if z is None else _k_view(z, geom)
        launch(tasks, count_chunks(N, geom.P, ipc, rpc) * kb, x, wmat,
               (b, b if scale is None else scale, zv),
               (has_bias, relu, bool(plan.slab), wt, scale is not None, z is not None),
               geo_tuple(geom),
               _ints(ipc, rpc, kb), blas, _batch_cols(x, geom, plan.slab, kb > 1), wdst,
               _k_view(y, geom), work=work, grain=1)
        if wdst.shape[0]:
            _weights.put(w, "matrix", wdst)
    return y


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True), plans=None):
    """``(dx, dw, db)`` of ``y = relu?(conv(x, w) + b)``; ``y`` given: g = gy * (y > 0).

    Only the gradients flagged in ``need`` are computed (the others are ``None``). ``plans``:
    the (dx, dw) plans (default: :func:`cpu_plan.plan` of each by the current rules).
    """
    need_dx, need_dw, need_db = (bool(v) for v in need)
    use_mask = y is not None
    y = y if use_mask else gy
    rules = cpu_plan.current_rules()
    dx_plan, dw_plan = plans or (_plan(geom, "dx", gy.dtype, rules),
                                 _plan(geom, "dw", x.dtype, rules))
    work = x.size + 2 * gy.size

    def bias_grad(db_parts):
        return np.add.reduce(db_parts, axis=0).astype(gy.dtype) if need_db else None  # group order

    def weights():
        if not (need_dw or need_db):
            return None, None
        dw, db_parts = _DW[dw_plan.algorithm](x, gy, y, use_mask, geom, need_dw, dw_plan, work)
        return dw, bias_grad(db_parts)

    def inputs():
        return _conv_dx(gy, y, use_mask, w, geom, dx_plan, work) if need_dx else None

    both = need_dx and (need_dw or need_db)
    if (both and work < rules.shared_max_elements and rules.shared_backward
            and dx_plan.algorithm == dw_plan.algorithm == "winograd"):
        # one job of dW's groups and dX's chunks, shared by the threads
        dx = _out.empty(geom.x_shape, gy.dtype)
        dw_task, finish = _winograd_dw_launch(x, gy, y, use_mask, geom, need_dw, dw_plan)
        dx_task = _winograd_launch(_winograd_dx(gy, y, use_mask, w, geom, dx), dx_plan)[0]
        launch_all([dw_task, dx_task], work=work)
        dw, db_parts = finish()
        db = bias_grad(db_parts)
    elif both and work < rules.concurrent_max_elements:
        dx, (dw, db) = concurrently(inputs, weights, work=work)
    else:
        (dw, db), dx = weights(), inputs()
    return dx, dw, db


def _conv_dx(gy, y, use_mask, w, geom, plan, work):
    """dx of a convolution from gy (gated by y > 0 when ``use_mask``), as ``plan`` says."""
    N, C, H, K = geom.N, geom.C, geom.H, geom.K
    nhwc = geom.layout == "NHWC"
    dx = _out.empty(geom.x_shape, gy.dtype)
    blas = _blas.blas_for(gy.dtype)
    kind = plan.algorithm
    if kind == "winograd":
        _winograd_run(_winograd_dx(gy, y, use_mask, w, geom, dx), plan, work)
    elif kind == "winograd_s2":
        _wino_s2dx.dx(gy, y, use_mask, w, geom, dx, plan.tiles, plan.taps == 2, work)
    elif kind == "pointwise":
        _pointwise.dx(gy, y, use_mask, w, geom, plan, dx, work)
    elif kind == "tapwise":
        _tapwise.dx(gy, y, use_mask, w, geom, plan.k_blocks, dx, blas, work)
    elif kind == "phase":
        ph_taps, ph_start, ent_tap, ent_off, gmin, gext, gleft, Wg, slack = _phase_dx_plan(geom)
        rpc = balanced(-(-H // geom.sh), _phase_rows(plan, K + C, Wg, gy.itemsize))
        wtap = _taps(w, nhwc, cache=False)
        wph = (np.ascontiguousarray(wtap[ent_tap]) if plan.taps
               else np.empty((0, 1, 1), gy.dtype))
        _direct.ready(gy.dtype)
        if plan.taps:
            _gemm_taps.ready(gather=False)
        launch(_direct.phase_dx_tasks, N * blocks(-(-H // geom.sh), rpc), gy, y, use_mask, wtap,
               (ph_taps, ph_start, ent_tap, ent_off),
               _ints(gmin, gext, gleft, Wg, slack, rpc, geom.sh, geom.sw, plan.taps), nhwc,
               blas, wph, dx, work=work, grain=1)
    else:
        _im2col_dx(gy, y, use_mask, w, geom, plan, dx, work)
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
