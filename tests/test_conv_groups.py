"""Grouped and depthwise convolutions (``groups``) on the CPU, against the float64 reference.

``groups`` 1 < g < C runs, in float32 where the groups (merged in 2s, 4s or 8s) have multiples of
8 channels and filters, ``cpu_grouped_taps.py``'s implicit GEMMs (one launch a pass), else
``kernels/conv/cpu.py``'s kernels per group (``cpu_grouped.py``); ``groups == C`` the depthwise
stencils of ``cpu_depthwise.py``. Their constants are shrunk here (``CHUNK_ELEMENTS``: one or
two output rows per NHWC chunk, a partial last chunk; ``DW_GROUPS`` 3: groups of uneven sizes;
``ROWS_A_TASK``: one image a task, or a few with a partial last) so that small shapes cross
every task boundary. Every case runs
forward and backward on 1 and 3 threads (bitwise equal) and compares both with
``numbafuse.reference`` (block-diagonal weights, so independent of the kernels).
"""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref, validate
from numbafuse.kernels.cpu import launch as _launch
from numbafuse.kernels.conv import (cpu_depthwise, cpu_depthwise_nchw, cpu_grouped,
                                    cpu_grouped_bands, cpu_grouped_taps)

from .harness import close

# (x shape NCHW, K, R x S, groups, geometry): groups 2, 3 and C (depthwise, multiplier 1 and 2),
# stride 1 and 2, 3x3 and 7x7, asymmetric 4-tuple padding, dilation
CASES = {
    "groups 2": ((2, 4, 7, 6), 6, (3, 3), 2, dict(padding=1)),
    "groups 3 stride 2": ((2, 6, 9, 8), 9, (3, 2), 3, dict(stride=2, padding=(1, 0, 2, 1))),
    # the implicit GEMMs (cpu_grouped_taps): groups of 8 (no merge), of 4 (merged in pairs,
    # as ResNeXt's first stage), of 2 x 4 filters (merged in fours); stride 2 with 4-tuple
    # padding, dilation, a strided 1x1
    "groups 4 of 8": ((3, 32, 7, 6), 32, (3, 3), 4, dict(padding=1)),
    "groups 8 of 4 stride 2": ((5, 32, 9, 8), 32, (3, 3), 8,
                               dict(stride=2, padding=(1, 0, 2, 1))),
    "groups 8 of 2x4 dilated": ((3, 16, 8, 9), 32, (3, 3), 8,
                                dict(stride=(1, 2), padding=2, dilation=2)),
    "groups 2 1x1 stride 2": ((3, 16, 7, 6), 32, (1, 1), 2, dict(stride=2)),
    # groups of 16 and 24 channels: a slab pixel copied as 2 and 3 vectors of 8 (_copy8)
    "groups 2 of 16 stride 2": ((2, 32, 8, 7), 32, (3, 3), 2, dict(stride=2, padding=1)),
    "groups 2 of 24": ((2, 48, 5, 6), 48, (3, 3), 2, dict(padding=1)),
    "groups 4 of 8 wide padding": ((2, 32, 5, 6), 32, (3, 3), 4, dict(padding=(3, 1, 0, 2))),
    "groups 2 of 16 dilated": ((2, 32, 7, 8), 32, (3, 3), 2, dict(padding=(2, 1, 1, 2),
                                                                  dilation=2)),
    "depthwise 3x3": ((2, 5, 7, 9), 5, (3, 3), 5, dict(padding=1)),
    # float32 NCHW on small maps: the NHWC tiles on transposed copies (cpu_depthwise_nchw.by_nhwc)
    "depthwise small map": ((3, 16, 5, 6), 16, (3, 3), 16, dict(padding=1)),
    "depthwise small map stride 2": ((2, 8, 9, 7), 8, (3, 3), 8,
                                     dict(stride=2, padding=(1, 0, 2, 1))),
    "depthwise stride 2 asym": ((3, 4, 9, 10), 4, (3, 3), 4,
                                dict(stride=2, padding=(0, 2, 1, 0))),
    "depthwise 7x7": ((2, 3, 11, 10), 3, (7, 7), 3, dict(padding=3)),
    "depthwise x2 dilated": ((2, 3, 8, 9), 6, (3, 3), 3, dict(stride=(2, 1), padding=2,
                                                             dilation=(2, 1))),
}
# which cases run in which layout and dtype: each pair compiles kernels, so not all of them
PLAN = [("groups 2", "NCHW", np.float64), ("groups 3 stride 2", "NHWC", np.float32),
        ("groups 4 of 8", "NCHW", np.float32), ("groups 4 of 8", "NHWC", np.float32),
        ("groups 8 of 4 stride 2", "NCHW", np.float32),
        ("groups 8 of 4 stride 2", "NHWC", np.float32),
        ("groups 8 of 2x4 dilated", "NCHW", np.float32),
        ("groups 8 of 2x4 dilated", "NHWC", np.float32),
        ("groups 2 1x1 stride 2", "NHWC", np.float32),
        ("groups 2 1x1 stride 2", "NCHW", np.float32),
        ("groups 2 of 16 stride 2", "NHWC", np.float32),
        ("groups 2 of 16 stride 2", "NCHW", np.float32),
        ("groups 2 of 24", "NHWC", np.float32),
        ("depthwise 3x3", "NCHW", np.float32), ("depthwise 3x3", "NHWC", np.float64),
        ("depthwise small map", "NCHW", np.float32),
        ("depthwise small map stride 2", "NCHW", np.float32),
        ("depthwise stride 2 asym", "NCHW", np.float64),
        ("depthwise stride 2 asym", "NHWC", np.float32),
        ("depthwise 7x7", "NHWC", np.float32), ("depthwise 7x7", "NCHW", np.float64),
        ("depthwise x2 dilated", "NHWC", np.float64),
        ("depthwise x2 dilated", "NCHW", np.float32)]


def _problem(name, layout, dtype, seed=0):
    x_shape, K, (R, S), groups, kw = CASES[name]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(dtype)
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w = rng.standard_normal((K, x_shape[1] // groups, R, S)).astype(dtype)
    b = rng.standard_normal(K).astype(dtype)
    return x, w, b, dict(kw, layout=layout, groups=groups)


def _run(x, w, b, gy, kw, threads):
    _launch.set_num_threads(threads)
    y = nf.conv_bias_relu(x, w, b, **kw)
    return (y, *nf.conv_bias_relu_backward(gy, x, w, y, **kw))


@pytest.mark.parametrize("name, layout, dtype", PLAN,
                         ids=[f"{n}-{lay}-{np.dtype(d).name}" for n, lay, d in PLAN])
@pytest.mark.parametrize("chunk", [1, 40])
def test_groups_match_reference_on_any_thread_count(name, layout, dtype, chunk, monkeypatch):
    monkeypatch.setattr(cpu_depthwise, "CHUNK_ELEMENTS", chunk)   # 1 or a few rows a chunk
    monkeypatch.setattr(cpu_depthwise, "DW_GROUPS", 3)
    monkeypatch.setattr(cpu_grouped_taps, "ROWS_A_TASK", 1 if chunk == 1 else 2 * 42 + 1)
    monkeypatch.setattr(cpu_grouped_bands, "BAND_BYTES", 1 if chunk == 1 else 1 << 20)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)      # always on the pool
    x, w, b, kw = _problem(name, layout, dtype)
    gy = np.random.default_rng(1).standard_normal(
        nf.conv_bias_relu(x, w, b, **kw).shape).astype(dtype)
    threads = _launch.num_threads()
    try:
        one, three = _run(x, w, b, gy, kw, 1), _run(x, w, b, gy, kw, 3)
    finally:
        _launch.set_num_threads(threads)
    for a, c in zip(one, three):
        assert a.tobytes() == c.tobytes()                         # no dependence on threads
    close(one[0], ref.conv_bias_relu(x, w, b, **kw), dtype, what="y")
    for got, want, what in zip(one[1:], ref.conv_bias_relu_backward(gy, x, w, b, **kw),
                               ("dx", "dw", "db")):
        assert got.shape == want.shape and got.dtype == dtype
        close(got, want, dtype, what=what)


def test_depthwise_chunks_cross_a_partial_last_chunk(monkeypatch):
    """NHWC: P = 5 output rows in chunks of 2 (a last chunk of 1), 6 chunks in 4 groups."""
    monkeypatch.setattr(cpu_depthwise, "CHUNK_ELEMENTS", 2 * 5 * 4)   # 2 rows of Q=5, K=4
    monkeypatch.setattr(cpu_depthwise, "DW_GROUPS", 4)
    x, w, b, kw = _problem("depthwise 3x3", "NHWC", np.float64)
    x, w, b = x[:, :5, :5, :4].copy(), w[:4], b[:4]
    kw = dict(kw, groups=4)
    geom = validate.conv_geometry("t", x.shape, w.shape, padding=1, layout="NHWC", groups=4)
    assert cpu_depthwise._rows_per_chunk(geom) == 2 and geom.P == 5
    y = nf.conv_bias_relu(x, w, b, **kw)
    gy = np.random.default_rng(2).standard_normal(y.shape)
    close(y, ref.conv_bias_relu(x, w, b, **kw), np.float64, what="y")
    for got, want in zip(nf.conv_bias_relu_backward(gy, x, w, y, **kw),
                         ref.conv_bias_relu_backward(gy, x, w, b, **kw)):
        close(got, want, np.float64)


# NHWC float32 depthwise forwards with C % 8 == 0 run the register tiles
# (cpu_depthwise_tiles), border pixels with their own tap tables: C = 8 to 88 cross the
# channel panels (64 + 16 + 8, 32 + 8 on AVX-512; 24s on AVX2), interior runs of 3 to 13
# pixels (AVX-512 tiles of DW_ROWS = 6 pixels, a run's rest by one of 4 or a last tile
# overlapping the one before: runs of 4, 5, 6, 7, 8, 10, 11, 13; AVX2 tiles of 4), border
# columns down 5 to 13 full rows, borders on every side, dilation and stride 2
TILED = [((2, 5, 6, 8), (3, 3), dict(padding=1)),
         ((1, 9, 13, 24), (3, 3), dict(stride=2, padding=(0, 2, 1, 0))),
         ((1, 11, 14, 88), (7, 7), dict(padding=3)),
         ((2, 8, 12, 16), (3, 3), dict(stride=(2, 1), padding=2, dilation=(2, 1))),
         ((1, 6, 7, 8), (2, 2), dict(padding=0)),
         ((1, 7, 11, 40), (5, 5), dict(padding=2)),
         # 7x7 at stride 2 (runs of 7: a 4-pixel tile and 3 single ones), stride 2 along
         # the row or the columns only, asymmetric padding
         ((2, 13, 21, 24), (7, 7), dict(stride=2, padding=3)),
         ((1, 10, 19, 40), (7, 7), dict(stride=(1, 2), padding=(3, 2, 2, 3))),
         ((1, 12, 16, 16), (7, 7), dict(stride=(2, 1), padding=3)),
         ((1, 8, 8, 72), (3, 3), dict(padding=1)),
         ((2, 19, 19, 32), (7, 7), dict(padding=3)),
         ((1, 4, 13, 16), (3, 3), dict(padding=1)),
         # the sliding tiles (7 tap columns, C % 16 == 0): interior runs of 8 or more cut
         # into slides of 8 to 16 pixels (cpu_depthwise_tiles.slides). Stride 2: 17 = 9 + 8,
         # 11, 8, 7 (none: the tap tiles), 33 = 11 + 11 + 11, 32 = 16 + 16, 15 (an odd W),
         # 16, and along the row only; stride 1: 24 = 12 + 12, 32 = 16 + 16, 18 = 9 + 9, 8,
         # 7 (none), and above 10 (stride (2, 1)) and 8 on 88 channels (not a multiple of 16:
         # none); bias and ReLU on several 16-channel panels
         ((1, 9, 40, 32), (7, 7), dict(stride=2, padding=3)),
         ((1, 5, 28, 32), (7, 7), dict(stride=2, padding=3)),
         ((1, 4, 22, 16), (7, 7), dict(stride=2, padding=3)),
         ((1, 4, 20, 16), (7, 7), dict(stride=2, padding=3)),
         ((1, 3, 72, 16), (7, 7), dict(stride=2, padding=3)),
         ((1, 3, 70, 16), (7, 7), dict(stride=2, padding=3)),
         ((1, 3, 37, 16), (7, 7), dict(stride=2, padding=3)),
         ((1, 3, 38, 16), (7, 7), dict(stride=2, padding=3)),
         ((1, 6, 28, 16), (7, 7), dict(stride=(1, 2), padding=3)),
         ((1, 5, 24, 32), (7, 7), dict(padding=3)),
         ((1, 4, 14, 16), (7, 7), dict(padding=3)),
         ((1, 4, 13, 16), (7, 7), dict(padding=3)),
         ((1, 8, 30, 16), (7, 7), dict(padding=3)),
         ((2, 7, 38, 48), (7, 7), dict(padding=3)),
         ((1, 7, 24, 16), (5, 5), dict(padding=2)),
         # 5 tap columns (sliding where SLIDE_TAPS has 5: Zen 4, and here always): stride 1
         # runs of 20 = 10 + 10 above, 24 = 12 + 12, 8, 7 (none); stride 2 12, 18 = 9 + 9
         ((1, 4, 28, 32), (5, 5), dict(padding=2)),
         ((1, 4, 12, 16), (5, 5), dict(padding=2)),
         ((1, 4, 11, 16), (5, 5), dict(padding=2)),
         ((1, 5, 28, 16), (5, 5), dict(stride=2, padding=2)),
         ((1, 5, 40, 16), (5, 5), dict(stride=2, padding=2))]


def _nhwc_depthwise(rng, x_shape, rs, kw):
    """x (x_shape, NHWC), w (C, 1, *rs), b (C,), float32 from rng in that order, and the
    call's keywords: kw with the layout and groups = C."""
    C = x_shape[3]
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((C, 1, *rs)).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    return x, w, b, dict(kw, layout="NHWC", groups=C)


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("x_shape, rs, kw", TILED,
                         ids=[f"{t[0][3]}ch-{t[1][0]}x{t[1][1]}-{i}" for i, t in enumerate(TILED)])
def test_depthwise_register_tiles_equal_the_per_pixel_loops(x_shape, rs, kw, wide,
                                                             monkeypatch):
    from numbafuse.kernels.conv import cpu_depthwise_slide
    from numbafuse.kernels.cpu import gemm_taps as cpu_gemm_taps
    monkeypatch.setattr(cpu_gemm_taps, "WIDE", wide)
    monkeypatch.setattr(cpu_depthwise_slide, "SLIDE_TAPS", (7, 5))     # on every CPU
    rng = np.random.default_rng(7)
    x, w, b, kw = _nhwc_depthwise(rng, x_shape, rs, kw)
    geom = validate.conv_geometry("t", x.shape, w.shape, **kw)
    assert cpu_depthwise._tiled(geom, x.dtype)
    y = nf.conv_bias_relu(x, w, b, **kw)
    close(y, ref.conv_bias_relu(x, w, b, **kw), np.float32, what="y")
    # the per-pixel loops (every pixel, taps skipped outside the image) give the same bits
    ref_y = np.empty_like(y)
    from numbafuse.kernels.conv import math as conv_math
    geo, rpc = conv_math.geo_tuple(geom), cpu_depthwise._rows_per_chunk(geom)
    _launch.launch(cpu_depthwise._forward_nhwc, geom.N * _launch.blocks(geom.P, rpc), x,
                   cpu_depthwise._taps_nhwc(w, geom.C, 1), b, True, geo, rpc, ref_y, work=0)
    assert y.tobytes() == ref_y.tobytes()


@pytest.mark.parametrize("x_shape, rs, kw", [
    ((2, 9, 11, 16), (3, 3), dict(padding=1)),
    ((1, 13, 21, 32), (7, 7), dict(stride=2, padding=3)),
    ((1, 10, 40, 32), (7, 7), dict(padding=3)),        # the sliding tiles
])
@pytest.mark.parametrize("offset", [4, 12])
def test_a_depthwise_input_off_a_cache_line_is_copied_per_task_with_the_same_bits(
        x_shape, rs, kw, offset):
    """An NHWC x that does not start on a 64-byte boundary (NumPy's large arrays start 16
    bytes past one) runs the forward's and dW's tiles over a copy of each task's input rows
    on one (``cpu_depthwise._copied``): the reference's values, bit for bit the aligned x's."""
    from numbafuse.kernels.cpu.buffers import aligned
    rng = np.random.default_rng(offset)
    x, w, b, kw = _nhwc_depthwise(rng, x_shape, rs, kw)
    xa = aligned(x)
    base = aligned(np.zeros(x.size + 16, np.float32))
    off = base[offset:offset + x.size].reshape(x.shape)           # offset floats past a line
    off[...] = x
    assert off.ctypes.data % 64 == 4 * offset and cpu_depthwise._copied(off, x.shape[3]) == 2
    assert cpu_depthwise._copied(xa, x.shape[3]) == 0
    y = nf.conv_bias_relu(off, w, b, **kw)
    close(y, ref.conv_bias_relu(x, w, b, **kw), np.float32, what="y")
    assert y.tobytes() == nf.conv_bias_relu(xa, w, b, **kw).tobytes()
    dy = rng.standard_normal(y.shape).astype(np.float32)
    got = nf.conv_bias_relu_backward(dy, off, w, y, **kw)
    want = ref.conv_bias_relu_backward(dy, x, w, b, **kw)
    for name, g, r, a in zip(("dx", "dw", "db"), got, want,
                             nf.conv_bias_relu_backward(dy, xa, w, y, **kw)):
        close(g, r, np.float32, what=name)
        assert g.tobytes() == a.tobytes(), name


# NCHW float32 depthwise forwards run the same tiles with output columns on the lanes: Q =
# 6 to 80 crosses the column panels (Qv = 8 to 80: 64 + 16, 32 + 8 on AVX-512; 24s on AVX2),
# P = 1 to 11 output rows (blocks of 4 and a remainder), multiplier 2, stride 2 (phases),
# dilation, asymmetric padding
TILED_NCHW = [((2, 3, 6, 6), 1, (3, 3), dict(padding=1)),
              ((1, 2, 9, 13), 2, (3, 3), dict(stride=2, padding=(0, 2, 1, 0))),
              ((1, 2, 11, 80), 1, (7, 7), dict(padding=3)),
              ((2, 2, 8, 33), 1, (3, 3), dict(stride=(2, 1), padding=2, dilation=(2, 1))),
              ((1, 2, 4, 7), 2, (2, 2), dict(padding=0)),
              ((1, 3, 7, 40), 1, (5, 5), dict(stride=2, padding=2)),
              # 7x7 at stride 1: depthwise_rows7 (this machine's tiles, whatever "wide"),
              # tiles of 4 rows and single rows, panels of 32 (+ 32 + 16 at Q = 80 above),
              # 16 and 8 on AVX-512, 16 and 8 on AVX2 (Q = 28: 16 + 16, rows through the
              # accumulator); rows but the last stored into y with the next row's first
              # columns overwritten (Qv one panel)
              ((1, 2, 9, 28), 1, (7, 7), dict(padding=3)),
              ((1, 2, 5, 14), 1, (7, 7), dict(padding=3)),
              ((2, 2, 6, 5), 2, (7, 7), dict(padding=3)),
              ((1, 3, 7, 9), 1, (7, 7), dict(padding=(3, 3, 1, 5))),
              # ... and at stride 2 (its four phase planes; an odd size, asymmetric padding)
              ((1, 2, 13, 30), 1, (7, 7), dict(stride=2, padding=3)),
              ((2, 2, 9, 61), 2, (7, 7), dict(stride=2, padding=(3, 2, 1, 3)))]


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("x_shape, mult, rs, kw", TILED_NCHW,
                         ids=[f"Q{t[0][3]}-m{t[1]}-{t[2][0]}x{t[2][1]}-{i}"
                              for i, t in enumerate(TILED_NCHW)])
def test_depthwise_nchw_tiles_equal_the_plane_loops(x_shape, mult, rs, kw, wide, monkeypatch):
    from numbafuse.kernels.cpu import gemm_taps as cpu_gemm_taps
    monkeypatch.setattr(cpu_gemm_taps, "WIDE", wide)
    rng = np.random.default_rng(8)
    C = x_shape[1]
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((C * mult, 1, *rs)).astype(np.float32)
    b = rng.standard_normal(C * mult).astype(np.float32)
    kw = dict(kw, groups=C)
    geom = validate.conv_geometry("t", x.shape, w.shape, **kw)
    y = nf.conv_bias_relu(x, w, b, **kw)
    close(y, ref.conv_bias_relu(x, w, b, **kw), np.float32, what="y")
    # the plane loops (one axpy of a whole phase plane per tap) give the same bits
    ref_y = np.empty_like(y)
    from numbafuse.kernels.conv import math as conv_math
    _launch.launch(cpu_depthwise._forward_nchw, geom.N * C, x,
                   w.reshape(geom.K, geom.R, geom.S), b, True, conv_math.geo_tuple(geom),
                   cpu_depthwise._phase_width(geom), ref_y, work=0)
    assert y.tobytes() == ref_y.tobytes()


# The NCHW 7x7 row tiles (cpu_depthwise_tiles._r7) of both widths, called directly: the kernel
# compiles only this machine's (ROWS7_WIDE), so the test above reaches the other width's on
# no machine of the other kind. Each tile against its definition in NumPy (float64): rows of 4
# and 1, panels of 2 and 1 vectors of 16 and 8 floats, strides 1 and 2 (four phase planes),
# the bias and ReLU, and the columns past the panel untouched.
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("rows", [4, 1])
@pytest.mark.parametrize("nv, width", [(2, 16), (1, 16), (1, 8), (2, 8)])
def test_the_7x7_row_tiles_of_both_widths(stride, rows, nv, width):
    from numba import njit
    from numbafuse.kernels.conv import cpu_depthwise_tiles as tiles
    tile = tiles._r7[stride, rows, nv, width]

    @njit
    def run(px, ldx, plane, pw, pc, ldc, pb, relu):
        tile(px, ldx, plane, pw, pc, ldc, pb, relu)

    n = nv * width
    prow, pcol = rows + 6 // stride, n + 6 // stride            # a phase plane's rows, columns
    rng = np.random.default_rng(rows * 100 + n + stride)
    x = rng.standard_normal((stride * stride, prow, pcol)).astype(np.float32)
    w = rng.standard_normal(49).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    c = np.full((rows, n + 3), np.nan, np.float32)
    run(np.int64(x.ctypes.data), np.int64(pcol), np.int64(prow * pcol), np.int64(w.ctypes.data),
        np.int64(c.ctypes.data), np.int64(n + 3), np.int64(bias.ctypes.data), np.int64(1))
    want = np.zeros((rows, n))
    for r in range(7):
        for s in range(7):
            phase = (r % stride) * stride + s % stride
            a, b = r // stride, s // stride
            want += np.float64(w[7 * r + s]) * x[phase, a:a + rows, b:b + n]
    close(c[:, :n], np.maximum(want + bias, 0.0), np.float32)
    assert np.isnan(c[:, n:]).all()


# NHWC float32 depthwise backwards with C % 8 == 0: dW by the dW register tiles
# (cpu_depthwise_tiles.depthwise_dw_taps), dX phase by phase as the forward's tiles over the gated
# g with flipped taps (cpu_depthwise_nhwc.dx_phases, in every case here). C = 8 to 104 crosses the
# dW channel panels (64 + 32 + 8 on AVX-512, 16s and 8 on AVX2); 2x2 to 7x7 taps cross the tap
# tiles (4 taps: one tile; 9: 5 + 4; 25: five of 5; 49: ten; dW by the tiles in every case); Q =
# 20 with 3x3 taps has an interior run of 18 pixels (a block of DW_PIXELS = 16 and 2); chunks of
# one or two dX rows cross the gated rows' buffer; strides 2 and 3 (phases of 2 and 3 taps, and
# with 2x2 taps at stride 3 phases with none), dilation with stride 2 (a phase's taps two rows
# apart in g), padding past the taps' reach (a phase's padding < 0)
TILED_BWD = [((2, 5, 20, 8), (3, 3), dict(padding=1)),
             ((1, 9, 13, 24), (5, 5), dict(stride=2, padding=(0, 2, 1, 0))),
             ((1, 11, 14, 104), (7, 7), dict(padding=3)),
             ((2, 8, 12, 16), (3, 3), dict(stride=(2, 1), padding=2, dilation=(2, 1))),
             ((1, 6, 7, 40), (2, 2), dict(padding=(1, 0, 0, 1))),
             ((1, 7, 11, 72), (5, 5), dict(padding=2, dilation=(1, 2))),
             ((1, 5, 6, 8), (3, 3), dict(padding=3)),
             # dX by the sliding tiles (stride 1, C % 16 == 0: a run of 16 + 4 in every row)
             ((1, 6, 26, 32), (7, 7), dict(padding=3)),
             ((2, 11, 10, 16), (3, 3), dict(stride=3, padding=(1, 0, 2, 1))),
             ((1, 10, 13, 8), (2, 2), dict(stride=3, padding=1)),
             ((1, 12, 11, 24), (3, 3), dict(stride=2, padding=2, dilation=2))]


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("chunk", [1, 200])
@pytest.mark.parametrize("x_shape, rs, kw", TILED_BWD, ids=[
    f"{t[0][3]}ch-{t[1][0]}x{t[1][1]}-{i}" for i, t in enumerate(TILED_BWD)])
def test_depthwise_backward_tiles_match_reference(x_shape, rs, kw, chunk, wide, monkeypatch):
    from numbafuse.kernels.cpu import gemm_taps as cpu_gemm_taps
    monkeypatch.setattr(cpu_gemm_taps, "WIDE", wide)
    monkeypatch.setattr(cpu_depthwise, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(cpu_depthwise, "DW_GROUPS", 3)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    rng = np.random.default_rng(11)
    x, w, b, kw = _nhwc_depthwise(rng, x_shape, rs, kw)
    geom = validate.conv_geometry("t", x.shape, w.shape, **kw)
    # dX by the phases in every case (the rule keeps the loops for few taps at stride > 1
    # where dX is computed alone)
    monkeypatch.setattr(cpu_depthwise, "_tiled_dx",
                        lambda geom, dtype, gated=False: cpu_depthwise._tiled(geom, dtype))
    assert cpu_depthwise._tiled_dw(geom, x.dtype)
    y = nf.conv_bias_relu(x, w, b, **kw)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    threads = _launch.num_threads()
    try:
        _launch.set_num_threads(1)
        one = nf.conv_bias_relu_backward(gy, x, w, y, **kw)
        # g gated once for both passes (gate_db) where dX and dW or db are asked for, each
        # pass gating its own otherwise: the same bits either way
        assert cpu_depthwise._gate_once(geom, x.dtype, True, (True, True, True))
        for need in [(True, False, False), (False, True, True), (False, True, False),
                     (False, False, True), (True, True, False), (True, False, True)]:
            part = nf.conv_bias_relu_backward(gy, x, w, y, need=need, **kw)
            for got, want, asked in zip(part, one, need):
                assert (got is None) != asked
                assert not asked or got.tobytes() == want.tobytes(), need
        _launch.set_num_threads(3)
        three = nf.conv_bias_relu_backward(gy, x, w, y, **kw)
    finally:
        _launch.set_num_threads(threads)
    for a, c in zip(one, three):
        assert a.tobytes() == c.tobytes()                         # no dependence on threads
    for got, want, what in zip(one, ref.conv_bias_relu_backward(gy, x, w, b, **kw),
                               ("dx", "dw", "db")):
        close(got, want, np.float32, what=what)
    # no ReLU (conv2d on the tape: g = gy, no gating buffer)
    tx, tw = nf.Tensor(x, requires_grad=True), nf.Tensor(w, requires_grad=True)
    nf.conv2d(tx, tw, **kw).backward(gy)
    dx_want, dw_want, _ = ref.conv_bias_relu_backward(gy, x, w, b, y=np.ones_like(y), **kw)
    close(tx.grad, dx_want, np.float32, what="dx (no ReLU)")
    close(tw.grad, dw_want, np.float32, what="dw (no ReLU)")


# Non-temporal stores (cpu_depthwise_nhwc.streams): the forward's y and dX's dx where they
# outgrow the last-level cache, aligned, C % 16 == 0. Forced here (a cache of 0 bytes, every
# output from the aligned output cache): stride 1 (sliding tiles at 7x7), stride 3 (phases
# with none), stride 2 with 48 channels (panels 32 + 16); 1 and 3 threads (the fence).
STREAMED = [((1, 6, 26, 32), (7, 7), dict(padding=3)),
            ((2, 11, 10, 16), (3, 3), dict(stride=3, padding=(1, 0, 2, 1))),
            ((2, 9, 12, 48), (3, 3), dict(stride=2, padding=1))]


def test_streams_only_aligned_float32_outputs_over_half_the_cache(monkeypatch):
    # cpu_depthwise_nhwc.streams: non-temporal stores need every vector aligned (a fault
    # otherwise), so the rule must refuse an unaligned output, C % 16 != 0 and float64,
    # whatever the size; and stream only past half the last-level cache
    from numbafuse.kernels.conv import cpu_depthwise_nhwc as nhwc, cpu_depthwise_tiles as tiles
    from numbafuse.kernels.cpu.buffers import aligned
    monkeypatch.setattr(nhwc, "LLC_BYTES", 4096)
    y = aligned(np.zeros((4, 4, 4, 16), np.float32))                  # 4096 bytes
    assert y.ctypes.data % 64 == 0
    want = tiles.STREAM if tiles.X86 else 0
    assert nhwc.streams(y, 0, 16) == want
    assert nhwc.streams(y, 0, 8) == 0                                 # C % 16
    assert nhwc.streams(y[:2], 10 ** 9, 16) == 0                      # 2048: not over half
    raw = np.zeros(4 * 4 * 4 * 16 + 1, np.float32)
    off = 1 if raw.ctypes.data % 64 == 0 else 0
    assert nhwc.streams(raw[off:off + 1024].reshape(4, 4, 4, 16), 0, 16) == 0   # unaligned
    assert nhwc.streams(aligned(np.zeros((4, 4, 4, 16))), 0, 16) == 0           # float64
    assert nhwc.LLC_BYTES > 0 and nhwc._last_level_cache() > 0


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("x_shape, rs, kw", STREAMED,
                         ids=[f"{t[0][3]}ch-{t[1][0]}x{t[1][1]}-{i}"
                              for i, t in enumerate(STREAMED)])
def test_depthwise_streamed_outputs_are_the_same_bits(x_shape, rs, kw, threads, monkeypatch):
    from numbafuse.kernels.conv import cpu_depthwise_nhwc as nhwc, cpu_depthwise_tiles as tiles
    if not tiles.X86:
        pytest.skip("non-temporal stores are x86's")
    rng = np.random.default_rng(5)
    x, w, b, kw = _nhwc_depthwise(rng, x_shape, rs, kw)
    saved = _launch.num_threads()
    try:
        _launch.set_num_threads(threads)
        plain = [nf.conv_bias_relu(x, w, b, **kw)]
        gy = rng.standard_normal(plain[0].shape).astype(np.float32)
        plain += nf.conv_bias_relu_backward(gy, x, w, plain[0], **kw)
        monkeypatch.setattr(nhwc, "LLC_BYTES", 0)
        monkeypatch.setattr(cpu_depthwise._out, "MIN_BYTES", 0)
        used = []
        streams = nhwc.streams
        monkeypatch.setattr(nhwc, "streams", lambda *a: used.append(streams(*a)) or used[-1])
        streamed = [nf.conv_bias_relu(x, w, b, **kw)]
        streamed += nf.conv_bias_relu_backward(gy, x, w, streamed[0], **kw)
    finally:
        _launch.set_num_threads(saved)
    assert used and all(u == tiles.STREAM for u in used)     # y and every phase of dx
    for got, want, what in zip(streamed, plain, ("y", "dx", "dw", "db")):
        assert got.tobytes() == want.tobytes(), what
    close(streamed[1], ref.conv_bias_relu_backward(gy, x, w, b, **kw)[0], np.float32, what="dx")


# The depthwise tiles are steps (cpu_depthwise_tiles: TAPS_TILES, DW_TILES; cpu_depthwise_slide:
# SLIDE_TILES, SLIDE5_TILES; the NCHW 7x7 tiles, depthwise_rows7, are called directly), and so
# are the NCHW phase planes (cpu_phases: PAD and CROP at stride 1, SPLIT and MERGE else): each
# pass run alone with every slot empty, as in a new process, readies the steps its kernels call
# (else a RuntimeError "called before its ready()"). NHWC 3x3, 7x7 and 5x5/2 (the sliding
# tiles) forward, dX (phases), dW; NCHW 3x3 (depthwise_taps) and 7x7 (rows7), strides 1 and 2.
@pytest.mark.parametrize("layout, k, stride", [("NHWC", 3, 1), ("NHWC", 7, 1), ("NHWC", 5, 2),
                                               ("NCHW", 3, 1), ("NCHW", 7, 1), ("NCHW", 3, 2)])
def test_each_depthwise_pass_readies_its_tile_steps(layout, k, stride, monkeypatch):
    from numbafuse.kernels.conv import cpu_depthwise_slide
    from .test_conv_plan import _step_slots_emptied
    monkeypatch.setattr(cpu_depthwise_slide, "SLIDE_TAPS", (7, 5))     # 5x5 slides too
    rng = np.random.default_rng(2)
    C = 32
    x = rng.standard_normal((1, C, 20, 20) if layout == "NCHW" else (1, 20, 20, C))
    x = x.astype(np.float32)
    w = rng.standard_normal((C, 1, k, k)).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    kw = dict(padding=k // 2, layout=layout, groups=C, stride=stride)
    y = nf.conv_bias_relu(x, w, b, **kw)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    runs = [lambda: [nf.conv_bias_relu(x, w, b, **kw)],
            lambda: nf.conv_bias_relu_backward(gy, x, w, y, need=(True, False, False), **kw)[:1],
            lambda: nf.conv_bias_relu_backward(gy, x, w, y, need=(False, True, False), **kw)[1:2],
            lambda: nf.conv_bias_relu_backward(gy, x, w, y, **kw)]
    for run in runs:
        want = [a.copy() for a in run()]
        with _step_slots_emptied():
            got = run()
        for g, v in zip(got, want):
            assert g.tobytes() == v.tobytes()


def test_conv2d_groups_need_and_tape():
    """conv2d (no ReLU, no mask) with groups on the tape: gradients equal the reference; the
    backward's ``need`` computes only what is asked."""
    x, w, _, kw = _problem("groups 3 stride 2", "NCHW", np.float64)
    tx, tw = nf.Tensor(x, requires_grad=True), nf.Tensor(w, requires_grad=True)
    y = nf.conv2d(tx, tw, **kw)
    gy = np.random.default_rng(3).standard_normal(y.shape)
    y.backward(gy)
    close(y.data, ref.conv2d(x, w, **kw), np.float64)
    dx, dw = ref.conv2d_backward(gy, x, w, **kw)
    close(tx.grad, dx, np.float64)
    close(tw.grad, dw, np.float64)
    x, w, b, kw = _problem("depthwise 3x3", "NHWC", np.float64)
    y = nf.conv_bias_relu(x, w, b, **kw)
    dx, dw, db = nf.conv_bias_relu_backward(y, x, w, y, need=(False, False, True), **kw)
    assert dx is None and dw is None
    close(db, ref.conv_bias_relu_backward(y, x, w, b, **kw)[2], np.float64)


def test_groups_one_is_the_ungrouped_path():
    x, w, b, kw = _problem("groups 2", "NCHW", np.float64)
    w = np.random.default_rng(4).standard_normal((6, 4, 3, 3))
    kw = dict(kw, groups=1)
    y = nf.conv_bias_relu(x, w, b, **kw)
    assert np.array_equal(y, nf.conv_bias_relu(x, w, b, padding=1))


@pytest.mark.parametrize("groups, w_shape, error, match", [
    (0, (6, 2, 3, 3), ValueError, "groups must be >= 1"),
    (-2, (6, 2, 3, 3), ValueError, "groups must be >= 1"),
    (2.0, (6, 2, 3, 3), TypeError, "groups must be an int"),
    (True, (6, 2, 3, 3), TypeError, "groups must be an int"),
    ("2", (6, 2, 3, 3), TypeError, "groups must be an int"),
    (4, (6, 1, 3, 3), ValueError, "groups=4 does not divide x's 6 channels"),
    (3, (4, 2, 3, 3), ValueError, "groups=3 does not divide w's 4 filters"),
    (3, (6, 3, 3, 3), ValueError, "w has 3 input channels, x has 6 in 3 groups"),
    (1, (6, 2, 3, 3), ValueError, "w has 2 input channels, x has 6"),
])
def test_groups_errors_name_the_op_and_argument(groups, w_shape, error, match):
    x = np.ones((1, 6, 5, 5))
    w = np.ones(w_shape)
    y = np.ones((1, w_shape[0], 3, 3))
    with pytest.raises(error, match=f"conv_bias_relu: {match}"):
        nf.conv_bias_relu(x, w, groups=groups)
    with pytest.raises(error, match=f"conv2d: {match}"):
        nf.conv2d(x, w, groups=groups)
    with pytest.raises(error, match=f"conv_bias_relu_backward: {match}"):
        nf.conv_bias_relu_backward(y, x, w, y, groups=groups)


def test_remapper_fuses_grouped_convs():
    """groups flows into conv_bias_relu, the inference fold, and the training
    conv_batchnorm_relu (recompute): the rewritten graphs equal the unfused ones."""
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((2, 4, 6, 6)), rng.standard_normal((4, 1, 3, 3)), np.ones(4)
    gamma, beta = rng.standard_normal(4) + 2, rng.standard_normal(4)

    def conv_relu(x):
        return nf.relu(nf.bias_add(nf.conv2d(x, w, padding=1, groups=4), b))

    def conv_bn(x, training, stats):
        return nf.relu(nf.batchnorm(nf.conv2d(x, w, padding=1, groups=4), gamma, beta,
                                    running_mean=stats[0], running_var=stats[1],
                                    training=training))

    fused = nf.remap(nf.trace(conv_relu, x))
    assert fused.ops == ["conv_bias_relu"]
    close(fused(x), ref.conv_bias_relu(x, w, b, padding=1, groups=4), np.float64)
    folded = nf.remap(nf.trace(lambda x: conv_bn(x, False, (np.zeros(4), np.ones(4))), x))
    assert folded.ops == ["conv_bias_relu"]
    close(folded(x), conv_bn(x, False, (np.zeros(4), np.ones(4))), np.float64)
    stats, unfused_stats = (np.zeros(4), np.ones(4)), (np.zeros(4), np.ones(4))
    trained = nf.remap(nf.trace(lambda x: conv_bn(x, True, stats), x))
    assert trained.ops == ["conv_batchnorm_relu"], trained.log
    stats[0][:], stats[1][:] = 0.0, 1.0                  # (tracing ran the ops once)
    close(trained(x), conv_bn(x, True, unfused_stats), np.float64)
    for a, e in zip(stats, unfused_stats):
        close(a, e, np.float64)


@pytest.mark.parametrize("layout, x_shape, w_shape, groups, kw", [
    ("NCHW", (2, 4, 6, 7), (6, 2, 3, 2), 2, dict(stride=2, padding=(1, 0, 1, 2))),
    ("NHWC", (2, 6, 7, 4), (8, 1, 3, 3), 4, dict(stride=2, padding=1)),   # depthwise x2
])
def test_groups_tape_matches_finite_differences(layout, x_shape, w_shape, groups, kw):
    rng = np.random.default_rng(6)
    x, w, b = (nf.Tensor(rng.standard_normal(s), requires_grad=True)
               for s in (x_shape, w_shape, (w_shape[0],)))
    assert nf.gradcheck(lambda x, w, b: nf.conv_bias_relu(x, w, b, layout=layout,
                                                          groups=groups, **kw), [x, w, b])


@pytest.mark.parametrize("name, layout", [("groups 4 of 8", "NHWC"),
                                          ("groups 8 of 4 stride 2", "NCHW"),
                                          ("groups 8 of 2x4 dilated", "NHWC")])
def test_grouped_implicit_gemms_against_the_loop_over_groups(name, layout, monkeypatch):
    """The cases above run ``cpu_grouped_taps`` (checked here: it fits them); ungated and
    gated backwards, with and without a bias, against the reference and against the loop
    over groups, which the implicit GEMMs replace (``cpu_grouped.TAPS``)."""
    x, w, b, kw = _problem(name, layout, np.float32)
    geom = validate.conv_geometry("t", x.shape, w.shape, kw.get("stride", 1),
                                  kw.get("padding", 0), kw.get("dilation", 1), layout,
                                  kw["groups"])
    assert cpu_grouped_taps.fits(geom, np.float32)
    assert not cpu_grouped_taps.fits(geom, np.float64)
    monkeypatch.setattr(cpu_grouped_taps, "ROWS_A_TASK", 40)     # a few images a task
    gy = np.random.default_rng(7).standard_normal(geom.y_shape).astype(np.float32)
    runs = {}
    for taps in (True, False):
        monkeypatch.setattr(cpu_grouped, "TAPS", taps)
        y = cpu_grouped.conv_forward(x, w, None, geom, False)
        yb = cpu_grouped.conv_forward(x, w, b, geom, True)
        runs[taps] = (y, yb, *cpu_grouped.conv_backward(gy, x, w, geom, None, (True, True, True)),
                      *cpu_grouped.conv_backward(gy, x, w, geom, yb, (True, True, True)))
    for got, want in zip(runs[True], runs[False]):
        close(got, want, np.float32)
    close(runs[True][0], ref.conv2d(x, w, **kw), np.float32, what="y")
    close(runs[True][1], ref.conv_bias_relu(x, w, b, **kw), np.float32, what="y relu")
    for got, want, what in zip(runs[True][2:4], ref.conv2d_backward(gy, x, w, **kw),
                               ("dx", "dw")):
        close(got, want, np.float32, what=what)
    close(runs[True][4], gy.sum(axis=(0, 1, 2) if layout == "NHWC" else (0, 2, 3)),
          np.float32, what="db")
    for got, want, what in zip(runs[True][5:], ref.conv_bias_relu_backward(gy, x, w, b, **kw),
                               ("dx gated", "dw gated", "db gated")):
        close(got, want, np.float32, what=what)


@pytest.mark.parametrize("band_bytes, chunks", [(1, None), (3000, None), (1 << 20, None),
                                               (1 << 20, "images")])
def test_nhwc_grouped_bands_equal_the_per_group_slabs(band_bytes, chunks, monkeypatch):
    """An NHWC grouped forward by ``cpu_grouped_bands`` (a chunk's slab of every channel, each
    group's taps offset into it), and a stride-1 dX by them on the transposed geometry after
    g is gated once (``_gated``; the dW and db read that g), give conv_tasks' bytes (a slab
    per group, ``BANDS`` False), the dW (banded where a merged group has 8 channels) their
    values and the reference's: chunks of one output row (``BAND_BYTES`` 1: every chunk's
    halo, a last chunk at the bottom padding), of a few rows (3000 bytes: a partial last
    chunk), of whole images, and of several images (``chunks`` "images": a task's rows cross
    images); groups of 8, 16 and 24 channels (merged pairs of 4 too), strides 1 and 2, 4-tuple
    padding, dilation, 1x1, and a padding past the filter's reach (that dX not banded)."""
    monkeypatch.setattr(cpu_grouped_bands, "BAND_BYTES", band_bytes)
    if chunks == "images":
        monkeypatch.setattr(cpu_grouped_bands, "TASKS_A_THREAD", 0.25)
    for name in ("groups 4 of 8", "groups 8 of 4 stride 2", "groups 8 of 2x4 dilated",
                 "groups 2 1x1 stride 2", "groups 2 of 16 stride 2", "groups 2 of 24",
                 "groups 2 of 16 dilated", "groups 4 of 8 wide padding"):
        x, w, b, kw = _problem(name, "NHWC", np.float32)
        geom = validate.conv_geometry("t", x.shape, w.shape, kw.get("stride", 1),
                                      kw.get("padding", 0), kw.get("dilation", 1), "NHWC",
                                      kw["groups"])
        ipc, rpc, nchunks = cpu_grouped_bands.bands(geom, 1)[:3]
        if band_bytes == 1:
            assert rpc == 1 and nchunks == geom.N * geom.P
        if chunks == "images":
            assert ipc > 1 and nchunks < geom.N, name
        monkeypatch.setattr(cpu_grouped_taps, "BANDS", True)
        banded_dx = cpu_grouped_bands.dx_geometry(geom) is not None
        assert banded_dx == (name in ("groups 4 of 8", "groups 2 of 16 dilated",
                                      "groups 2 of 24")), name
        gy = np.random.default_rng(2).standard_normal(geom.y_shape).astype(np.float32)
        out = {}
        for bands in (True, False):
            monkeypatch.setattr(cpu_grouped_taps, "BANDS", bands)
            y = cpu_grouped_taps.forward(x, w, b, geom, True).copy()
            out[bands] = [y, cpu_grouped_taps.forward(x, w, None, geom, False).copy()]
            for gate in (y, None):
                out[bands] += [a.copy() for a in cpu_grouped_taps.backward(
                    gy, x, w, geom, gate, (True, True, True))]
            out[bands] += [cpu_grouped_taps.backward(gy, x, w, geom, y, (True, False, False))[0]]
        for i, (got, want) in enumerate(zip(out[True], out[False])):
            if i in (3, 6):         # dW: the bands' own order of sums (parts of chunks)
                close(got, want, np.float32, what=f"{name} dw")
            else:
                assert got.tobytes() == want.tobytes(), (name, i)
        close(out[True][0], ref.conv_bias_relu(x, w, b, **kw), np.float32, what=name)
        want = ref.conv_bias_relu_backward(gy, x, w, b, **kw)
        close(out[True][2], want[0], np.float32, what=name + " dx")
        close(out[True][3], want[1], np.float32, what=name + " dw")
        close(out[True][6], ref.conv2d_backward(gy, x, w, **kw)[1], np.float32,
              what=name + " dw ungated")


@pytest.mark.parametrize("name", ["depthwise small map", "depthwise small map stride 2"])
def test_small_nchw_depthwise_maps_run_the_nhwc_tiles_with_the_planes_values(name,
                                                                            monkeypatch):
    """A float32 NCHW depthwise conv on a small map runs the NHWC tiles on transposed copies
    (checked: the geometry takes that path), forward and backward, with and without the ReLU's
    gate and with only some gradients asked: equal to the NCHW plane passes' results."""
    x, w, b, kw = _problem(name, "NCHW", np.float32)
    geom = validate.conv_geometry("t", x.shape, w.shape, kw.get("stride", 1),
                                  kw.get("padding", 0), 1, "NCHW", kw["groups"])
    nchw = cpu_depthwise_nchw
    assert nchw.by_nhwc(geom, np.float32, nchw.NHWC_FORWARD_MAX_PIXELS)
    assert nchw.by_nhwc(geom, np.float32, nchw.NHWC_BACKWARD_MAX_PIXELS)
    assert not nchw.by_nhwc(geom, np.float64, 1 << 30)
    gy = np.random.default_rng(8).standard_normal(geom.y_shape).astype(np.float32)
    runs = {}
    for limit in (1 << 30, 0):                              # (0: the NCHW planes)
        monkeypatch.setattr(nchw, "NHWC_FORWARD_MAX_PIXELS", limit)
        monkeypatch.setattr(nchw, "NHWC_BACKWARD_MAX_PIXELS", limit)
        y = cpu_depthwise.forward(x, w, b, geom, True)
        runs[limit] = (y, cpu_depthwise.forward(x, w, None, geom, False),
                       *cpu_depthwise.backward(gy, x, w, geom, y, (True, True, True)),
                       *cpu_depthwise.backward(gy, x, w, geom, None, (True, False, False)),
                       *cpu_depthwise.backward(gy, x, w, geom, None, (False, True, True)))
    for got, want in zip(runs[1 << 30], runs[0]):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.shape == want.shape and got.dtype == want.dtype
            close(got, want, np.float32)
    close(runs[1 << 30][0], ref.conv_bias_relu(x, w, b, **kw), np.float32, what="y")


def test_five_tap_columns_slide_where_the_cpu_splits_512_bit_fmas():
    from numbafuse.kernels.conv import cpu_depthwise_slide
    from numbafuse.kernels.cpu import gemm_taps
    assert cpu_depthwise_slide.SLIDE_TAPS == ((7, 5) if gemm_taps.SPLIT_512 else (7,))
    assert [cpu_depthwise_slide.slides(m) for m in (8, 11, 16, 17, 32, 33, 53)] == [
        (8, 0), (11, 0), (16, 0), (8, 1), (16, 0), (11, 0), (13, 1)]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("gated", [True, False])
def test_gated_channel_sums_are_the_bias_gradient_on_any_thread_count(layout, gated):
    # cpu_chunks.gated_channel_sums (the grouped implicit GEMMs' db): the float64 sums of
    # gy * (y > 0) per channel, an image a task, the images added in order
    from numbafuse.kernels.conv import cpu_chunks
    from .harness import on_threads
    rng = np.random.default_rng(5)
    shape = (5, 24, 3, 7) if layout == "NCHW" else (5, 3, 7, 24)
    gy = rng.standard_normal(shape).astype(np.float32)
    y = rng.standard_normal(shape).astype(np.float32) if gated else None
    axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
    g = gy.astype(np.float64) * ((y > 0) if gated else 1)
    want = g.sum(axis=axes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)                # always on the pool
        got = on_threads(lambda: cpu_chunks.gated_channel_sums(gy, y, layout).copy())
    assert got[1].dtype == np.float32 and got[1].shape == (24,)
    assert got[1].tobytes() == got[3].tobytes()
    np.testing.assert_allclose(got[1], want, rtol=1e-6, atol=1e-6)
