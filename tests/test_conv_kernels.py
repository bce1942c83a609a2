"""The CPU convolution kernels at shapes that cross every chunk, group and phase boundary.

``kernels/conv/cpu.py`` runs each pass as its plan says (``cpu_plan.py``): chunks of output
rows (``chunk_bytes``) or of 2x2 Winograd tiles (``winograd_tiles``: rows of tiles of one
image, or several whole images), dW and db summed over ``dw_groups`` fixed groups of chunks,
3x3 stride-1 convolutions by Winograd F(2x2, 3x3) (forward, dX and dW), other stride-1 ones as
shifted GEMMs over a padded chunk and other strides by im2col (forward, dW; NCHW over NHWC
slabs of a chunk's input rows, or by phase planes) and by phases (dX). Here the rules are
changed (``cpu_plan.using``) so that small drawn shapes span many chunks (one output row or
one tile row each, a last partial chunk, groups of uneven sizes, the sums of the groups'
partials in blocks of 7 values), and every result is compared with the reference
(``numbafuse.reference``, SciPy correlate) and must be bitwise the same on 1 and 3 threads.
"""
import functools

import numpy as np
import pytest
from hypothesis import given, strategies as st

import numbafuse as nf
import numbafuse.testing.strategies as nfs
from numbafuse import reference as ref
from numbafuse.kernels.cpu import launch as _launch
from numbafuse.kernels.conv import cpu as cpu_conv, cpu_chunks, cpu_plan

from .harness import on_threads

RULES = cpu_plan.RULES

TOL = {np.float32: dict(rtol=2e-4, atol=2e-4), np.float64: dict(rtol=1e-10, atol=1e-12)}
# CHUNK_BYTES values: 1 byte = one output row per chunk; a few rows; the default
CHUNKS = st.sampled_from([1, 700, 3000, RULES.chunk_bytes])
# WINOGRAD_TILES values (NCHW dW: twice as many): 1 = one tile row per chunk; 7 = a few rows,
# or whole images of small outputs; the default = several whole images per chunk
TILES = st.sampled_from([1, 7, RULES.winograd_tiles])


def _run(p, gy, threads):
    _launch.set_num_threads(threads)
    y = nf.conv_bias_relu(p.x, p.w, p.b, **p.kwargs)
    return (y, *nf.conv_bias_relu_backward(gy, p.x, p.w, y, **p.kwargs))


def _check(p, chunk_bytes, groups, tiles=None, min_channels=1, slab=True, min_chunks=1,
           **rules):
    tiles = {} if tiles is None else dict(winograd_tiles=tiles, winograd_s2_tiles=tiles)
    # the drawn channel counts are small: min_channels 1 sends them down the GEMM paths
    # (Winograd, phase planes), the default down im2col; Winograd at these small sizes;
    # strided forward and dW by im2col (NCHW over NHWC slabs) or by phase planes (``slab``);
    # min_chunks 1: the chunks chunk_bytes makes
    with cpu_plan.using(chunk_bytes=chunk_bytes, min_chunks=min_chunks, dw_groups=groups,
                        min_gemm_channels=min_channels, nchw_im2col_channels=min_channels,
                        winograd_min_tiles=0, strided="im2col" if slab else "phase",
                        **tiles, **rules), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_chunks, "SUM_BLOCK", 7)                 # the group sums: many tasks
        mp.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)        # always on the pool
        threads = _launch.num_threads()
        try:
            y0 = nf.conv_bias_relu(p.x, p.w, p.b, **p.kwargs)
            gy = np.random.default_rng(5).standard_normal(y0.shape).astype(y0.dtype)
            one = _run(p, gy, 1)
            three = _run(p, gy, 3)
        finally:
            _launch.set_num_threads(threads)
    for a, b in zip(one, three):
        assert a.tobytes() == b.tobytes()                     # no dependence on threads
    b = p.b if p.b is not None else np.zeros(p.w.shape[0], p.x.dtype)
    tol = TOL[p.x.dtype.type]
    np.testing.assert_allclose(one[0], ref.conv_bias_relu(p.x, p.w, p.b, **p.kwargs), **tol)
    for got, want in zip(one[1:], ref.conv_bias_relu_backward(gy, p.x, p.w, b, **p.kwargs)):
        np.testing.assert_allclose(got, want, **tol)


@given(nfs.conv_problems(max_batch=3, max_size=18, max_channels=3), CHUNKS,
       st.integers(1, 5), TILES, st.sampled_from([1, RULES.min_gemm_channels]),
       st.booleans())
def test_chunked_kernels_match_reference(p, chunk_bytes, groups, tiles, min_channels, slab):
    _check(p, chunk_bytes, groups, tiles, min_channels, slab)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("size, kernel, stride, padding, dilation", [
    (9, 3, 1, 1, 1), (17, 3, 1, 1, 1), (33, 3, 1, 1, 1),      # past row blocks, "same"
    (17, 3, 2, 1, 1), (33, 3, 2, 1, 1), (9, 1, 2, 0, 1),      # stride 2: im2col + phases
    (17, 3, 1, "valid", 2), (9, 2, 3, 2, 1), (17, 1, 1, 0, 1),  # dilated, stride 3, 1x1
    (8, 3, 1, 1, 1), (10, 3, 1, 0, 1), (7, 3, 1, 3, 1),      # Winograd: even, valid, pad > 2
    (12, 3, 2, 2, 2), (11, 4, 3, 1, 1), (9, 3, 2, 0, 1),     # phase planes: dilated, stride 3
    (10, 1, 1, 1, 1),                                         # 1x1 with padding: not pointwise
    (1, 3, 1, "same", 2),           # taps whose valid rows start past a chunk (im2col: the
])                                  # zeroing once ran into the next image's columns)
@pytest.mark.parametrize("chunk_bytes, tiles, min_channels", [
    (1, 1, 1), (3000, 7, 1), (3000, 200, 1), (3000, 7, RULES.min_gemm_channels)])
def test_boundary_shapes(layout, size, kernel, stride, padding, dilation, chunk_bytes, tiles,
                         min_channels, slab=True):
    rng = np.random.default_rng(size + kernel + stride)
    N, C, K = 3, 3, 5                                         # 3 images over uneven groups
    shape = (N, C, size, size + 2) if layout == "NCHW" else (N, size, size + 2, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, kernel, kernel)) / 3).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    p = nfs.ConvProblem(x, w, b, dict(stride=stride, padding=padding, dilation=dilation,
                                      layout=layout))
    _check(p, chunk_bytes, groups=4, tiles=tiles, min_channels=min_channels, slab=slab)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W, stride", [(9, 11, 2), (8, 8, 2), (10, 7, (3, 2)), (7, 9, (2, 3)),
                                          (1, 5, 3), (6, 6, 3)])
@pytest.mark.parametrize("chunk_bytes", [1, RULES.chunk_bytes])
@pytest.mark.parametrize("C, K", [(5, 7), (16, 24)])
def test_strided_pointwise_dx_scatters_the_compact_gradient(layout, dtype, H, W, stride,
                                                            chunk_bytes, C, K):
    """dX of a strided unpadded 1x1 conv (cpu_pointwise.dx): the pointwise GEMMs into the
    compact gradient of the pixels read, scattered into dx with zeros between: strides 2 and 3
    (per axis too), sizes a multiple of the stride and not (the last rows and columns unread),
    one row; chunks of one pixel row and the default; 16 input channels: NHWC float32 through
    the register tiles where the CPU has them; against the reference (float64 at 1e-10), the
    same bits on 1 and 3 threads. The path is asserted."""
    rng = np.random.default_rng(H * W)
    N = 3
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((K, C, 1, 1)).astype(dtype)
    b = rng.standard_normal(K).astype(dtype)
    kwargs = dict(stride=stride, padding=0, dilation=1, layout=layout)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, stride, 0, 1, layout)
    with cpu_plan.using(min_gemm_channels=1):
        assert cpu_conv.algorithm(geom, "dx", dtype) == "pointwise"
    _check(nfs.ConvProblem(x, w, b, kwargs), chunk_bytes, groups=4, min_channels=1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W", [(7, 9), (1, 5), (4, 4)])
@pytest.mark.parametrize("chunk_bytes", [1, 700, RULES.chunk_bytes])
def test_the_nchw_pointwise_forward_scales_and_adds_in_its_epilogue(dtype, H, W, chunk_bytes):
    """``forward_scaled`` on the NCHW pointwise GEMMs (inference Conv-BN(-Add)-ReLU in one
    pass): ``relu?(scale * conv + shift + z?)`` in each chunk's epilogue, against the float64
    reference; chunks of one pixel to whole images (a last partial chunk: 63 and 5 pixels an
    image), with and without z, ReLU and shift; the same bits on 1 and 3 threads. NHWC's
    pointwise forward has no such epilogue: None (the caller folds)."""
    rng = np.random.default_rng(H * 10 + W)
    N, C, K = 3, 6, 10
    x = rng.standard_normal((N, C, H, W)).astype(dtype)
    w = rng.standard_normal((K, C, 1, 1)).astype(dtype)
    z = rng.standard_normal((N, K, H, W)).astype(dtype)
    scale = np.linspace(-1.5, 2.0, K).astype(dtype)            # a negative scale too
    shift = rng.standard_normal(K).astype(dtype)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, 1, 0, 1, "NCHW")
    y64 = ref.conv2d(x.astype(np.float64), w.astype(np.float64))
    axis = (1, -1, 1, 1)
    with cpu_plan.using(chunk_bytes=chunk_bytes, min_gemm_channels=1):
        assert cpu_plan.plan(geom, "forward", dtype).algorithm == "pointwise"
        for with_z in (False, True):
            for relu in (False, True):
                want = y64 * scale.reshape(axis) + shift.reshape(axis) + (z if with_z else 0)
                want = np.maximum(want, 0) if relu else want
                got = [None, None]
                for i, threads in enumerate((1, 3)):
                    _launch.set_num_threads(threads)
                    got[i] = cpu_conv.forward_scaled(x, w, lambda: (scale, shift), geom, relu,
                                                     z=z if with_z else None)
                np.testing.assert_allclose(got[0], want, **TOL[dtype],
                                           err_msg=f"z {with_z} relu {relu}")
                assert np.array_equal(got[0], got[1])
        # a conv with a bias and no scale is the plain forward's epilogue, as before
        b = rng.standard_normal(K).astype(dtype)
        np.testing.assert_allclose(cpu_conv.conv_forward(x, w, b, geom, True),
                                   np.maximum(y64 + b.reshape(axis), 0), **TOL[dtype])
    nhwc = nf.validate.conv_geometry("t", (N, H, W, C), w.shape, 1, 0, 1, "NHWC")
    with cpu_plan.using(min_gemm_channels=1):
        assert cpu_plan.plan(nhwc, "forward", dtype).algorithm == "pointwise"
        assert cpu_conv.forward_scaled(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), w,
                                       lambda: (scale, shift), nhwc, True) is None


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W, tiles", [(9, 7, 1), (8, 8, 7), (5, 6, RULES.winograd_tiles)])
def test_the_winograd_forward_scales_in_its_output_transform(layout, dtype, H, W, tiles):
    """``forward_scaled`` on the Winograd plan (inference Conv-BN-ReLU of a 3x3): ``relu?(scale
    * conv + shift)`` in the output transform, against the float64 reference; chunks of one
    tile row to several images, odd sizes (a last half tile); with and without ReLU, a
    negative scale; the same bits on 1 and 3 threads. A residual is not the transform's:
    None (the caller runs the conv, then the batch norm's apply with z)."""
    rng = np.random.default_rng(H * 10 + W)
    N, C, K = 3, 8, 12
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal((K, C, 3, 3)) / np.sqrt(9 * C)).astype(dtype)
    scale = np.linspace(-1.5, 2.0, K).astype(dtype)
    shift = rng.standard_normal(K).astype(dtype)
    geom = nf.validate.conv_geometry("t", shape, w.shape, 1, 1, 1, layout)
    y64 = ref.conv2d(x.astype(np.float64), w.astype(np.float64), stride=1, padding=1,
                     layout=layout)
    axis = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)
    rules = dict(winograd_tiles=tiles, winograd_min_tiles=1, implicit_s1_max_channels=0,
                 tapwise_max_density=0.0, min_gemm_channels=1)
    with cpu_plan.using(**rules):
        assert cpu_plan.plan(geom, "forward", dtype).algorithm == "winograd"
        for relu in (False, True):
            want = y64 * scale.reshape(axis) + shift.reshape(axis)
            want = np.maximum(want, 0) if relu else want
            got = [None, None]
            for i, threads in enumerate((1, 3)):
                _launch.set_num_threads(threads)
                got[i] = cpu_conv.forward_scaled(x, w, lambda: (scale, shift), geom, relu)
            np.testing.assert_allclose(got[0], want, **TOL[dtype], err_msg=f"relu {relu}")
            assert np.array_equal(got[0], got[1])
        z = np.zeros(geom.y_shape, dtype)
        assert cpu_conv.forward_scaled(x, w, lambda: (scale, shift), geom, True, z=z) is None


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("N, stride", [(9, 1), (9, 2), (3, 1)])
def test_small_batches_split_into_min_chunks(layout, N, stride):
    # a stem (one input channel): the whole batch's im2col fits one chunk, so MIN_CHUNKS (the
    # default, 4) splits it: 9 images -> 2 a chunk, the last chunk 1; 3 images -> 1 a chunk
    rng = np.random.default_rng(N + stride)
    shape = (N, 1, 8, 7) if layout == "NCHW" else (N, 8, 7, 1)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((5, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    p = nfs.ConvProblem(x, w, b, dict(stride=stride, padding=1, dilation=1, layout=layout))
    plan = cpu_plan.plan(nf.validate.conv_geometry("t", x.shape, w.shape, stride, 1, 1, layout),
                         "forward", x.dtype)
    assert cpu_conv._chunking(plan, 56, 8, 7, 9 * 4, N)[0] == max(1, N // RULES.min_chunks)
    _check(p, RULES.chunk_bytes, groups=RULES.dw_groups, min_chunks=RULES.min_chunks)


@pytest.mark.parametrize("size, kernel, stride, padding, dilation", [
    (17, 3, 2, 1, 1), (9, 2, 3, 2, 1), (12, 3, 2, 2, 2), (11, 4, 3, 1, 1), (9, 3, 2, 0, 1)])
@pytest.mark.parametrize("chunk_bytes", [1, 3000])
def test_strided_nchw_by_phase_planes(size, kernel, stride, padding, dilation, chunk_bytes):
    # strided="phase": the phase planes, which can run these too
    test_boundary_shapes("NCHW", size, kernel, stride, padding, dilation, chunk_bytes, 7, 1,
                         slab=False)


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("size, kernel, stride, padding, dilation, C, K, kind", [
    (9, 3, 2, 1, 1, 3, 8, "implicit"), (17, 3, 2, 1, 1, 3, 24, "implicit"),
    (12, 3, 2, 2, 2, 5, 40, "implicit"), (11, 4, 3, 1, 1, 3, 72, "implicit"),  # dilated, s 3
    (9, 3, 2, 0, 1, 3, 136, "implicit"), (10, 4, 2, "same", 1, 3, 16, "implicit"),  # uneven
    (9, 1, 2, 0, 1, 3, 8, "implicit"), (7, 3, (1, 2), 1, 1, 2, 8, "implicit"),   # pads
    (9, 1, 1, 0, 1, 8, 24, "pointwise"), (5, 1, 1, 0, 1, 16, 40, "pointwise"),
    # C % 8 == 0: the NHWC dX by input phase through the tiles too (phases of 1, 2 and 4 taps;
    # stride 3 with a 2x2 kernel: phases without taps, zeros)
    (9, 3, 2, 1, 1, 8, 8, "implicit"), (12, 3, 2, 2, 2, 16, 24, "implicit"),
    (11, 4, 3, 1, 1, 8, 16, "implicit"), (9, 2, 3, 0, 1, 8, 8, "implicit")])
@pytest.mark.parametrize("chunk_bytes", [1, 3000, RULES.chunk_bytes])
def test_taps_tiles_at_boundary_shapes(wide, layout, size, kernel, stride, padding, dilation,
                                       C, K, kind, chunk_bytes, conv_rules):
    """The implicit-GEMM forward (cpu_implicit.py: a slab per chunk of one output row, a few
    rows, or whole images; the slab's padding on every side, uneven "same" padding, dilation,
    strides 2 and 3, K past every panel), its dW (C % 8 == 0: the slabs' rows gathered, in
    groups of chunks; and db alone; a 1x1's dW of <= 64 pixels an image too, 5x7), the NHWC
    1x1 forward and dX and the NHWC dX by input phase through the same tiles, at both vector
    widths whatever the CPU: against the reference, and bitwise the same on 1 and 3 threads.
    The path is asserted, so a change of the rules cannot skip it."""
    conv_rules(taps=True, wide=wide, winograd_s2=False,      # the stride-2 Winograd: below
               min_gemm_channels=1, nchw_im2col_channels=1, implicit_max_channels=1 << 30,
               pointwise_dw_implicit_pixels=64,    # (a 1x1's dW of <= 64 pixels: implicit)
               dw_chunk_scale=1)          # (dW's chunks of chunk_bytes too: rows)
    rng = np.random.default_rng(size + K)
    N = 3
    shape = (N, C, size, size + 2) if layout == "NCHW" else (N, size, size + 2, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, kernel, kernel)) / 3).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, stride, padding, dilation, layout)
    assert cpu_conv.algorithm(geom, "forward") == kind
    taps = cpu_plan.plan(geom, "dx", x.dtype).taps
    assert taps == ((2 if wide else 1) if layout == "NHWC" and C % 8 == 0 else 0)
    # a 1x1 (strided or not) unpadded: dX by the pointwise GEMMs (strided: then scattered)
    assert cpu_conv.algorithm(geom, "dx") == ("pointwise" if kernel == 1 and padding == 0
                                              else "phase")
    dw_kind = "implicit" if kind == "pointwise" and geom.P * geom.Q <= 64 else kind
    assert cpu_conv.algorithm(geom, "dw") == (dw_kind if C % 8 == 0 else "im2col")
    _check(nfs.ConvProblem(x, w, b, kwargs), chunk_bytes, groups=4, min_channels=1)
    if kind == "implicit":                          # db without dW: the same db, no dW
        with cpu_plan.using(chunk_bytes=chunk_bytes):
            y = nf.conv_bias_relu(x, w, b, **kwargs)
            gy = np.random.default_rng(6).standard_normal(y.shape).astype(np.float32)
            full = cpu_conv.conv_backward(gy, x, w, geom, y)
            part = cpu_conv.conv_backward(gy, x, w, geom, y, need=(True, False, True))
        assert part[1] is None
        assert part[0].tobytes() == full[0].tobytes() and part[2].tobytes() == full[2].tobytes()


def test_a_stems_nchw_forward_runs_by_output_rows_on_8_float_tiles(conv_rules):
    # the 7x7/2 on 3 channels (ResNet's stem) at 64x64 and 224x224 inputs: forward and dW by
    # output rows with 8-float tiles (AVX2: machine F, 1.3-1.6x im2col), im2col with 16-float
    # ones and no taps, the forward's taps with them and the dW by the rows on 16-float tiles
    # (Rules.wide_rows_dw; without it im2col); not where Q % 8 (a 60x60 input: Q 30) nor on 5
    # channels
    g = nf.validate.conv_geometry
    for size in (64, 224):
        stem = g("t", (16, 3, size, size), (64, 3, 7, 7), 2, 3, 1, "NCHW")
        conv_rules(taps=False, wide=False)
        assert cpu_conv.algorithm(stem, "forward") == cpu_conv.algorithm(stem, "dw") == (
            "implicit")
        assert cpu_plan.plan(stem, "dw", np.float32).taps == 1
        conv_rules(wide=True)
        assert cpu_conv.algorithm(stem, "forward") == cpu_conv.algorithm(stem, "dw") == "im2col"
        conv_rules(taps=True)
        assert cpu_conv.algorithm(stem, "forward") == cpu_conv.algorithm(stem, "dw") == (
            "implicit")
        assert cpu_plan.plan(stem, "dw", np.float32).taps == 2
        conv_rules(wide_rows_dw=False)
        assert cpu_conv.algorithm(stem, "dw") == "im2col"
        conv_rules(wide_rows_dw=True)
    conv_rules(taps=False, wide=False)
    for other in (g("t", (16, 3, 60, 60), (64, 3, 7, 7), 2, 3, 1, "NCHW"),
                  g("t", (16, 5, 64, 64), (64, 5, 7, 7), 2, 3, 1, "NCHW"),
                  g("t", (16, 32, 32, 3), (64, 3, 3, 3), 1, 1, 1, "NHWC")):
        assert cpu_conv.algorithm(other, "forward") == "im2col"
    # stride 1 too (a CIFAR stem, 3x3/1 on 3 channels): by rows on 8-float tiles; with
    # 16-float ones the forward by im2col, the dW by the rows where the tiles are on
    cifar = g("t", (16, 3, 32, 32), (64, 3, 3, 3), 1, 1, 1, "NCHW")
    assert cpu_conv.algorithm(cifar, "forward") == cpu_conv.algorithm(cifar, "dw") == "implicit"
    conv_rules(wide=True)
    assert cpu_conv.algorithm(cifar, "forward") == cpu_conv.algorithm(cifar, "dw") == "im2col"
    conv_rules(taps=True)
    assert cpu_conv.algorithm(cifar, "forward") == "im2col"
    assert cpu_conv.algorithm(cifar, "dw") == "implicit"


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("H, W, kernel, stride, padding, dilation, C, K", [
    (64, 64, 7, 2, 3, 1, 3, 64),     # a stem: Q 32 (a 24- and an 8-float panel), K 16 blocks
    (9, 15, 3, 1, 1, 1, 1, 8),       # stride 1, Q 15 -> not by rows (Q % 8)
    (9, 16, 3, 1, 1, 1, 1, 8),       # Q 16: by rows
    (11, 82, 5, (2, 1), (2, 1), 1, 4, 24),  # strides apart: one column phase; Q 80
    (10, 48, 3, 2, (0, 2), (2, 2), 2, 40),  # dilated: taps of one phase; Q 24
    (12, 48, 4, 3, "same", 1, 3, 8),        # stride 3: three phases; uneven "same"; Q 16
    (5, 48, 7, 3, 3, 1, 3, 16),      # padding past every edge: whole rows of zeros; Q 16
    (8, 16, 1, 1, 0, 1, 4, 16)])     # a 1x1 on 4 channels
@pytest.mark.parametrize("chunk_bytes", [1, 3000, RULES.chunk_bytes])
def test_the_nchw_forward_of_few_channels_runs_by_output_rows(
        wide, H, W, kernel, stride, padding, dilation, C, K, chunk_bytes, conv_rules):
    """The implicit NCHW forward on at most 4 input channels with output rows of a multiple
    of 8 pixels, with 8-float tiles (``cpu_implicit.gathers``): each output row is one
    ``gemm_gather`` of w by the column phases' rows, in tasks of one row to whole images
    (``chunk_bytes``), Q past the 24- and 16-float panels, the phases' zero padding on every
    side, one to three column phases; with
    and without bias and ReLU, against the reference, bitwise the same on 1 and 3 threads (the
    16-float tiles run the taps over a slab instead: the same values); and its dW by the same
    rows, on the plan's tiles (16-float where ``wide``)."""
    conv_rules(taps=True, wide=wide, chunk_bytes=chunk_bytes, min_chunks=1)
    rng = np.random.default_rng(H * W + K)
    x = rng.standard_normal((2, C, H, W)).astype(np.float32)
    w = (rng.standard_normal((K, C, kernel, kernel)) / (C * kernel)).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, stride, padding, dilation, "NCHW")
    from numbafuse.kernels.conv import cpu_implicit
    plan = cpu_plan.plan(geom, "forward", np.float32, algorithm="implicit")
    assert cpu_implicit.gathers(geom, plan.taps == 2) == (not wide and geom.Q % 8 == 0)
    for bias, relu in ((b, True), (None, False), (b, False)):
        want = ref.conv_bias_relu(x, w, np.zeros(K, np.float32) if bias is None else bias,
                                  **kwargs)
        want = want if relu else ref.conv2d(x, w, **kwargs) + (0 if bias is None
                                                               else bias[:, None, None])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)            # always on the pool
            got = on_threads(lambda: cpu_conv.conv_forward(x, w, bias, geom, relu,
                                                           plan=plan).copy())
        assert got[1].tobytes() == got[3].tobytes()
        np.testing.assert_allclose(got[1], want, rtol=2e-4, atol=2e-4)
    # dW (and db) by output rows: the same rows, each task's dW^T partial by gemm_taps (in
    # products of DW_ROWS_BYTES of g: all of a task's rows here, or one each), summed in task
    # order; db alone without dW; gated by y and not (C < 8: where it gathers only)
    assert cpu_implicit.fits(geom, np.float32, "dw") == (geom.Q % 8 == 0)
    if geom.Q % 8:
        return
    dplan = cpu_plan.plan(geom, "dw", np.float32, algorithm="implicit")
    y = np.ascontiguousarray(ref.conv_bias_relu(x, w, b, **kwargs))
    gy = rng.standard_normal(y.shape).astype(np.float32)
    for mask, rows_bytes in ((y, cpu_implicit.DW_ROWS_BYTES), (None, 1), (y, 1)):
        want = ((ref.conv2d_backward(gy, x, w, **kwargs)[1], gy.sum(axis=(0, 2, 3)))
                if mask is None else ref.conv_bias_relu_backward(gy, x, w, b, y=mask,
                                                                 **kwargs)[1:])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
            mp.setattr(cpu_implicit, "DW_ROWS_BYTES", rows_bytes)       # 1: a product a row
            got = on_threads(lambda: cpu_conv.conv_backward(
                gy, x, w, geom, mask, (False, True, True), plans=(dplan, dplan))[1:])
            db = cpu_conv.conv_backward(gy, x, w, geom, mask, (False, False, True),
                                        plans=(dplan, dplan))
        assert db[1] is None and db[2].tobytes() == got[1][1].tobytes()
        for a, c, r in zip(got[1], got[3], want):
            assert a.tobytes() == c.tobytes()
            np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("H, W, padding, C, K, bias", [
    (9, 11, 1, 8, 8, True),         # P odd (a last tile row with one output row), Q even
    (8, 8, 1, 16, 24, True),        # K: a 16- and an 8-float panel (wide), 3 x 8 (narrow)
    (12, 10, 0, 5, 72, False),      # unpadded; K past a 64-float panel; no bias; dW: C % 8
    (7, 13, 2, 8, 136, True),       # padding 2: whole patch rows of zeros; K = 2 x 64 + 8
    (10, 10, "same", 16, 16, True),  # uneven "same": nothing above, one row below
    (3, 3, 1, 8, 8, True),          # one tile an image
    (5, 4, 3, 8, 8, True),          # padding 3: patches wholly outside the input
    (9, 9, (0, 2), 24, 8, False),   # different padding per axis; Q odd; dW's C past a panel
    (6, 7, 1, 72, 8, True),         # dX and dW: C = 64 + 8 (two panels)
    (11, 9, (2, 1), 16, 16, True),  # dX: padding even above, odd on the left ...
    (9, 14, (1, 2), 8, 24, True),   # ... and the other way round
])
@pytest.mark.parametrize("tiles", [1, 7, 64])
def test_winograd_s2_at_boundary_shapes(wide, layout, H, W, padding, C, K, bias, tiles,
                                        conv_rules):
    """The 3x3 stride-2 forward, dX and dW by Winograd over input phases
    (cpu_winograd_s2.py, cpu_winograd_s2dx.py): chunks of one tile (block) row, a few rows,
    or several whole images (``tiles``), dW's in 4 groups; output rows and columns odd
    (half-empty last tiles), dx sizes past every 4x4 block boundary; padding 0 to 3, of
    either parity on each axis (the dX's two block forms); K (forward) and C (dX, dW) past
    every register panel; both vector widths and layouts. Against the reference with and
    without bias and ReLU (dX, dW and db from g = gy, and db alone), and bitwise the same on 1
    and 3 threads (in _check)."""
    conv_rules(wide=wide, winograd_s2_min_pixels=0,        # (its small maps take it)
               winograd_s2_dw=True)
    rng = np.random.default_rng(H * W + K)
    N = 3
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, 3, 3)) / 3).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32) if bias else None
    kwargs = dict(stride=2, padding=padding, dilation=1, layout=layout)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, 2, padding, 1, layout)
    conv_rules(min_gemm_channels=1)
    assert cpu_conv.algorithm(geom, "forward") == "winograd_s2"
    assert (cpu_conv.algorithm(geom, "dw") == "winograd_s2") == (C % 8 == 0)
    assert (cpu_conv.algorithm(geom, "dx") == "winograd_s2") == (C % 8 == 0)
    _check(nfs.ConvProblem(x, w, b, kwargs), 3000, groups=4, tiles=tiles, min_channels=1)
    conv_rules(winograd_s2_tiles=tiles, dw_groups=4)
    y = cpu_conv.conv_forward(x, w, b, geom, relu=False)          # no ReLU: negatives kept
    want = ref.conv2d(x, w, **kwargs)
    if bias:
        want = ref.bias_add(want, b, layout)
    np.testing.assert_allclose(y, want, **TOL[np.float32])
    assert (y < 0).any()
    gy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw, db = cpu_conv.conv_backward(gy, x, w, geom)           # no mask: g = gy
    rdx, rdw = ref.conv2d_backward(gy, x, w, **kwargs)
    np.testing.assert_allclose(dx, rdx, **TOL[np.float32])
    np.testing.assert_allclose(dw, rdw, **TOL[np.float32])
    np.testing.assert_allclose(db, gy.sum(axis=(0, 2, 3) if layout == "NCHW" else (0, 1, 2)),
                               **TOL[np.float32])
    part = cpu_conv.conv_backward(gy, x, w, geom, need=(False, False, True))
    assert part[0] is None and part[1] is None and part[2].tobytes() == db.tobytes()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_winograd_s2_under_conv_batchnorm(layout, conv_rules):
    """Conv-BatchNorm-ReLU (recompute) with a stride-2 conv on the stride-2 Winograd passes
    (the batch-norm sums come from separate passes there, not the stride-1 Winograd's
    epilogue): forward, running statistics and all four gradients against the reference."""
    conv_rules(winograd_s2_min_pixels=0, winograd_s2_dw=True)
    rng = np.random.default_rng(11)
    N, C, H, W, K = 3, 16, 9, 10, 16
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, 3, 3)) / 6).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, K).astype(np.float32)
    beta = rng.standard_normal(K).astype(np.float32)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, 2, 1, 1, layout)
    for pass_ in ("forward", "dx", "dw"):
        assert cpu_conv.algorithm(geom, pass_) == "winograd_s2"
    kw = dict(stride=2, padding=1, layout=layout)
    rm, rv = np.zeros(K, np.float32), np.ones(K, np.float32)
    want, want_rm, want_rv = ref.conv_batchnorm_relu(x, w, gamma, beta, running_mean=rm.copy(),
                                                     running_var=rv.copy(), **kw)
    y = nf.conv_batchnorm_relu(x, w, gamma, beta, running_mean=rm, running_var=rv, **kw)
    np.testing.assert_allclose(y, want, **TOL[np.float32])
    np.testing.assert_allclose(rm, want_rm, **TOL[np.float32])       # updated in place
    np.testing.assert_allclose(rv, want_rv, **TOL[np.float32])
    dy = rng.standard_normal(y.shape).astype(np.float32)
    got = nf.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)
    ref_grads = ref.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)
    for a, b in zip(got, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def test_winograd_s2_only_where_it_fits(conv_rules):
    """float64, K not a multiple of 8, other strides, kernels or dilations, the backward
    passes and the flag off keep the other paths; the transformed taps are G g G^T. (The
    tapwise passes off: they take some of these small maps, test_conv_tapwise.py.)"""
    g = nf.validate.conv_geometry
    conv_rules(taps=True, tapwise_max_density=0.0, tapwise_strided_dx_max_density=0.0,
               tapwise_strided_max_density=0.0)
    s2 = g("t", (2, 9, 9, 32), (32, 32, 3, 3), 2, 1, 1, "NHWC")
    # with the tiles, its dW only where the implicit GEMM's cannot run (C % 8) or the rule
    # says so (winograd_s2_dw: off by default with AVX-512's tiles)
    with cpu_plan.using(winograd_s2_min_pixels=0, winograd_s2_dw=False):
        assert cpu_conv.algorithm(s2, "forward") == "winograd_s2"
        assert cpu_conv.algorithm(s2, "dw") == "implicit"
        with cpu_plan.using(taps=False):
            assert cpu_conv.algorithm(s2, "dw") == "winograd_s2"
    assert cpu_plan.RULES.winograd_s2_dw == (not cpu_plan.RULES.taps)
    conv_rules(winograd_s2_dw=True)
    # its forward and dW on batches of winograd_s2_min_pixels output pixels and more (here
    # 2 x 5 x 5), its dX on any
    assert cpu_conv.algorithm(s2, "dx") == "winograd_s2"
    for pass_ in ("forward", "dw"):
        assert cpu_conv.algorithm(s2, pass_) != "winograd_s2"
        with cpu_plan.using(winograd_s2_min_pixels=50):
            assert cpu_conv.algorithm(s2, pass_) == "winograd_s2"
        with cpu_plan.using(winograd_s2_min_pixels=51):
            assert cpu_conv.algorithm(s2, pass_) != "winograd_s2"
    conv_rules(winograd_s2_min_pixels=0)
    assert cpu_conv.algorithm(s2, "forward") == "winograd_s2"
    assert cpu_conv.algorithm(s2, "dw") == "winograd_s2"
    assert cpu_conv.algorithm(s2, "dx") == "winograd_s2"
    for pass_ in ("forward", "dw"):
        assert cpu_conv.algorithm(s2, pass_, np.float64) == "im2col"
    assert cpu_conv.algorithm(s2, "dx", np.float64) == "phase"
    odd_c = g("t", (2, 9, 9, 36), (32, 36, 3, 3), 2, 1, 1, "NHWC")             # C % 8
    assert cpu_conv.algorithm(odd_c, "forward") == "winograd_s2"
    assert cpu_conv.algorithm(odd_c, "dw") != "winograd_s2"
    assert cpu_conv.algorithm(odd_c, "dx") != "winograd_s2"
    odd_k = g("t", (2, 9, 9, 32), (20, 32, 3, 3), 2, 1, 1, "NHWC")             # K % 8
    assert cpu_conv.algorithm(odd_k, "forward") != "winograd_s2"
    assert cpu_conv.algorithm(odd_k, "dx") == cpu_conv.algorithm(odd_k, "dw") == "winograd_s2"
    for other in (g("t", (2, 9, 9, 32), (16, 32, 3, 3), 3, 1, 1, "NHWC"),    # stride 3
                  g("t", (2, 9, 9, 32), (16, 32, 3, 3), (2, 1), 1, 1, "NHWC"),
                  g("t", (2, 9, 9, 32), (16, 32, 3, 3), 2, 2, 2, "NHWC"),    # dilated
                  g("t", (2, 9, 9, 32), (16, 32, 5, 5), 2, 1, 1, "NHWC")):
        for pass_ in ("forward", "dx", "dw"):
            assert cpu_conv.algorithm(other, pass_) != "winograd_s2"
    # C < 16: the forward by the implicit GEMM (a stem's), dW by im2col; dX's GEMMs have
    # k = K (32): Winograd
    few = g("t", (2, 9, 9, 8), (32, 8, 3, 3), 2, 1, 1, "NHWC")
    assert cpu_conv.algorithm(few, "forward") == "implicit"
    assert cpu_conv.algorithm(few, "dw") == "im2col"
    assert cpu_conv.algorithm(few, "dx") == "winograd_s2"
    # the transformed taps' limits: 2 MiB forward and dW, 16 MiB dX
    big = g("t", (2, 9, 9, 128), (160, 128, 3, 3), 2, 1, 1, "NHWC")          # U = 2000 KiB
    for pass_ in ("forward", "dx", "dw"):
        assert cpu_conv.algorithm(big, pass_) == "winograd_s2"
    bigger = g("t", (2, 9, 9, 128), (168, 128, 3, 3), 2, 1, 1, "NHWC")       # U = 2100 KiB
    assert cpu_conv.algorithm(bigger, "forward") != "winograd_s2"
    assert cpu_conv.algorithm(bigger, "dw") != "winograd_s2"
    assert cpu_conv.algorithm(bigger, "dx") == "winograd_s2"
    largest = g("t", (2, 9, 9, 512), (328, 512, 3, 3), 2, 1, 1, "NHWC")     # U = 16400 KiB
    assert cpu_conv.algorithm(largest, "dx") != "winograd_s2"
    # ... a forward's up to 8 MiB on batches of winograd_s2_wide_pixels output pixels (the
    # taps' transform spread over them), not a dW's: 2 x 5 x 5 pixels here
    with cpu_plan.using(winograd_s2_wide_pixels=50):
        assert cpu_conv.algorithm(bigger, "forward") == "winograd_s2"
        assert cpu_conv.algorithm(bigger, "dw") != "winograd_s2"
        widest = g("t", (2, 9, 9, 512), (160, 512, 3, 3), 2, 1, 1, "NHWC")  # U = 8000 KiB
        assert cpu_conv.algorithm(widest, "forward") == "winograd_s2"
        wider = g("t", (2, 9, 9, 512), (168, 512, 3, 3), 2, 1, 1, "NHWC")   # U = 8400 KiB
        assert cpu_conv.algorithm(wider, "forward") != "winograd_s2"
    with cpu_plan.using(winograd_s2_wide_pixels=51):
        assert cpu_conv.algorithm(bigger, "forward") != "winograd_s2"
    conv_rules(winograd_s2=False)
    assert cpu_conv.algorithm(s2, "forward") == "im2col"        # implicit: few channels only
    assert cpu_conv.algorithm(s2, "dw") == "implicit"
    assert cpu_conv.algorithm(s2, "dx") == "phase"
    # U = G g G^T with G = [1 0 0; 1 0 1; 0 0 1; 0 1 0; 0 1 0], rounded once from float64
    from numbafuse.kernels.conv import cpu_winograd_s2
    G = np.array([[1, 0, 0], [1, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0]], np.float64)
    w = np.random.default_rng(2).standard_normal((24, 5, 3, 3)).astype(np.float32)
    want = np.einsum("ir,kcrs,js->ijck", G, w.astype(np.float64), G).reshape(25, 5, 24)
    assert cpu_winograd_s2.taps(w).tobytes() == want.astype(np.float32).tobytes()


@pytest.mark.parametrize("K, C", [(9, 13), (17, 300), (128, 128)])
def test_winograd_s2_taps_in_tasks(K, C):
    # U[o] = sum of the taps q with GG[o, q] = 1 (forward: U (25, C, K); dX: U (25, K, C)
    # with the dX's GG), from tasks of 8 input channels (forward) or filters (dX): K and C of
    # 9, 13, 17 end a block or not, 300 values a row cross the transposes' 8-wide tiles;
    # (128, 128) (409 600 values) is split over the threads
    from numbafuse.kernels.conv import cpu_winograd_s2, cpu_winograd_s2dx
    w = np.random.default_rng(K + C).standard_normal((K, C, 3, 3)).astype(np.float32)
    taps9 = w.astype(np.float64).reshape(K, C, 9)
    for GG, dx in ((cpu_winograd_s2._GG, False), (cpu_winograd_s2dx._GG_DX, True)):
        want = np.einsum("oq,kcq->okc" if dx else "oq,kcq->ock", GG.astype(np.float64), taps9)
        got = cpu_winograd_s2.taps(w, GG, dx=dx)
        assert got.shape == want.shape and got.tobytes() == want.astype(np.float32).tobytes()


def test_taps_tiles_only_where_they_fit(conv_rules):
    """float64, K (forward) or C (dW) not a multiple of 8, NCHW 1x1 and the rules' ``taps``
    off keep the other paths."""
    conv_rules(winograd_s2=False, taps=True, implicit_max_channels=1 << 30)
    g = nf.validate.conv_geometry
    strided = g("t", (2, 9, 9, 32), (16, 32, 3, 3), 2, 1, 1, "NHWC")
    for pass_ in ("forward", "dw"):
        assert cpu_conv.algorithm(strided, pass_) == "implicit"
        assert cpu_conv.algorithm(strided, pass_, np.float64) == "im2col"
    assert cpu_conv.algorithm(strided, "dx") == "phase"
    odd = g("t", (2, 9, 9, 32), (20, 32, 3, 3), 2, 1, 1, "NHWC")
    assert cpu_conv.algorithm(odd, "forward") == "im2col"
    assert cpu_conv.algorithm(odd, "dw") == "implicit"
    odd_c = g("t", (2, 9, 9, 36), (16, 36, 3, 3), 2, 1, 1, "NHWC")
    assert cpu_conv.algorithm(odd_c, "forward") == "implicit"
    assert cpu_conv.algorithm(odd_c, "dw") == "im2col"
    taps = lambda geom, dtype=np.float32: cpu_plan.plan(geom, "forward", dtype).taps  # noqa
    pw = g("t", (2, 9, 9, 32), (16, 32, 1, 1), 1, 0, 1, "NHWC")
    assert taps(pw) in (1, 2)
    assert taps(g("t", (2, 9, 9, 32), (20, 32, 1, 1), 1, 0, 1, "NHWC")) == 0      # K % 8
    assert taps(pw, np.float64) == 0
    with cpu_plan.using(pointwise_dw_implicit_pixels=0):     # (else the implicit GEMM's)
        assert cpu_plan.plan(pw, "dw", np.float32).taps == 0               # dW: the BLAS
    assert taps(g("t", (2, 32, 9, 9), (16, 32, 1, 1), 1, 0, 1, "NCHW")) == 0
    conv_rules(taps=False)
    assert cpu_conv.algorithm(strided, "forward") == "im2col"
    assert cpu_conv.algorithm(strided, "dw") == "im2col"
    assert taps(pw) == 0


def test_a_narrow_nhwc_stem_forward_takes_the_implicit_gemm_on_narrow_tiles(conv_rules):
    """With 8-float tiles (``taps`` off: AVX2) the strided forward of an NHWC input with few
    channels (a 7x7/2 stem) runs the implicit GEMM (``narrow_implicit_channels``), an NCHW one
    and its dW im2col; the two forwards compute the same conv."""
    g = nf.validate.conv_geometry
    conv_rules(taps=False)
    stem = g("t", (2, 19, 19, 3), (16, 3, 7, 7), 2, 3, 1, "NHWC")
    assert cpu_conv.algorithm(stem, "forward") == "implicit"
    assert cpu_conv.algorithm(stem, "dw") == "im2col"
    assert cpu_conv.algorithm(g("t", (2, 3, 19, 19), (16, 3, 7, 7), 2, 3, 1, "NCHW"),
                              "forward") == "im2col"
    assert cpu_conv.algorithm(stem, "forward", np.float64) == "im2col"
    line = cpu_plan.RULES.narrow_implicit_channels
    at_line = g("t", (2, 19, 19, line), (16, line, 7, 7), 2, 3, 1, "NHWC")
    assert cpu_conv.algorithm(at_line, "forward") == "implicit"
    wide = g("t", (2, 19, 19, 16), (16, 16, 3, 3), 2, 1, 1, "NHWC")      # past the line
    assert cpu_conv.algorithm(wide, "forward") != "implicit"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 19, 19, 3)).astype(np.float32)
    w = rng.standard_normal((16, 3, 7, 7)).astype(np.float32)
    y = cpu_conv.conv_forward(x, w, None, stem, False)
    want = nf.reference.conv2d(x.astype(np.float64), w.astype(np.float64), stride=2,
                               padding=3, layout="NHWC")
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    conv_rules(narrow_implicit_channels=0)
    assert cpu_conv.algorithm(stem, "forward") == "im2col"


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("kind, kernel, stride", [
    ("winograd_s2", 3, 2), ("implicit", 3, 2), ("winograd", 3, 1), ("pointwise", 1, 1)])
def test_float64_keeps_its_precision_where_float32_has_own_paths(layout, kind, kernel, stride,
                                                                  conv_rules):
    """float64 at shapes whose float32 passes run float32-only kernels (the stride-2 Winograd's
    forward, dX and dW; the implicit GEMM's forward and dW, the NHWC dX by phase and 1x1
    through the taps tiles) and the stride-1 Winograd: y, dx, dw and db to float64 precision,
    not float32's (the dX once chose its kernel without the dtype and ran the stride-2
    Winograd on float64 data: dx to 2e-7)."""
    # the Winograd forward at 50 tiles; the stride-2 Winograd or else the implicit GEMM
    conv_rules(taps=True, winograd_min_tiles=0, winograd_s2=kind == "winograd_s2",
               implicit_max_channels=1 << 30, implicit_s1_max_channels=0,
               winograd_s2_min_pixels=0, winograd_s2_dw=True,
               pointwise_dw_implicit_pixels=0)           # (the pointwise dW: its own)
    rng = np.random.default_rng(34)
    N, C, K, H, W = 2, 32, 32, 9, 9
    x = rng.standard_normal((N, C, H, W) if layout == "NCHW" else (N, H, W, C))
    w = rng.standard_normal((K, C, kernel, kernel)) / C
    b = rng.standard_normal(K)
    padding = kernel // 2
    kwargs = dict(stride=stride, padding=padding, layout=layout)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, stride, padding, 1, layout)
    assert cpu_conv.algorithm(geom, "forward") == cpu_conv.algorithm(geom, "dw") == kind
    assert cpu_conv.algorithm(geom, "dx") == ("phase" if kind == "implicit" else kind)
    y = nf.conv_bias_relu(x, w, b, **kwargs)
    dy = rng.standard_normal(y.shape)
    got = (y, *nf.conv_bias_relu_backward(dy, x, w, y, **kwargs))
    want = (ref.conv_bias_relu(x, w, b, **kwargs),
            *ref.conv_bias_relu_backward(dy, x, w, b, **kwargs))
    for name, a, r in zip(("y", "dx", "dw", "db"), got, want):
        assert a.dtype == np.float64
        assert np.abs(a - r).max() / np.abs(r).max() < 1e-12, name


@functools.lru_cache(maxsize=None)
def _transpose_runner():
    from numba import njit
    from numbafuse.kernels.cpu.transpose import transpose

    @njit
    def run(src, dst):
        transpose(src, dst)
    return run


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, cols", [(8, 8), (19, 21), (64, 32), (3, 5), (16, 7), (7, 16),
                                        (0, 4), (9, 0)])
def test_transpose_tiles_and_edges(dtype, rows, cols):
    # cpu.transpose.transpose: 8x8 shuffle tiles inside, one value at a time at the edges; both
    # sides strided rows (views into wider arrays), whose margins stay untouched
    run = _transpose_runner()
    rng = np.random.default_rng(rows * 100 + cols)
    src = rng.standard_normal((rows, cols + 6)).astype(dtype)[:, 2:2 + cols]
    wide = np.full((cols, rows + 3), -7.0, dtype)
    run(src, wide[:, 1:1 + rows])
    np.testing.assert_array_equal(wide[:, 1:1 + rows], src.T)
    assert (wide[:, 0] == -7).all() and (wide[:, 1 + rows:] == -7).all()


@pytest.mark.parametrize("rows, cols", [(19, 21), (64, 32), (16, 40), (40, 16)])
@pytest.mark.parametrize("src_extra, dst_extra", [(6, 3), (200, 3), (3, 200), (130, 130)])
def test_transpose_tiles_in_either_order(rows, cols, src_extra, dst_extra):
    # transpose's tiles go along the source's rows where its row stride is at least
    # ORDER_RATIO times the destination's, else along the destination's: both orders, tiled
    # sides ended or not, the margins of both views untouched
    run = _transpose_runner()
    rng = np.random.default_rng(rows * 1000 + cols + src_extra)
    src = rng.standard_normal((rows, cols + src_extra)).astype(np.float32)[:, 1:1 + cols]
    wide = np.full((cols, rows + dst_extra), -7.0, np.float32)
    run(src, wide[:, 2:2 + rows])
    np.testing.assert_array_equal(wide[:, 2:2 + rows], src.T)
    assert (wide[:, :2] == -7).all() and (wide[:, 2 + rows:] == -7).all()


def test_transpose_order_cases_reach_both_orders():
    # (the grid of test_transpose_tiles_in_either_order runs each order more than once)
    from numbafuse.kernels.cpu.transpose import ORDER_RATIO
    grid = [(r, c, se, de) for r, c in [(19, 21), (64, 32), (16, 40), (40, 16)]
            for se, de in [(6, 3), (200, 3), (3, 200), (130, 130)]]
    first = [c + se >= ORDER_RATIO * (r + de) for r, c, se, de in grid]
    assert 2 <= sum(first) <= len(grid) - 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, cols", [(1, 9), (63, 17), (64, 8), (65, 33), (300, 130),
                                        (2048, 40)])
def test_transposed_in_row_blocks(dtype, rows, cols):
    # cpu.transpose.transposed: tasks of TRANSPOSE_ROWS (64) source rows, each into its own
    # columns of out, on two threads (work past the parallel threshold at 2048 x 40): a
    # block ended or not, a short last block; every value of out written (it starts NaN)
    from numbafuse.kernels.cpu import launch as cpu_launch
    from numbafuse.kernels.cpu.transpose import TRANSPOSE_ROWS, transposed
    assert TRANSPOSE_ROWS == 64
    a = np.random.default_rng(rows + cols).standard_normal((rows, cols)).astype(dtype)
    before = cpu_launch.num_threads()
    cpu_launch.set_num_threads(2)
    try:
        out = transposed(a, np.full((cols, rows), np.nan, dtype))
    finally:
        cpu_launch.set_num_threads(before)
    np.testing.assert_array_equal(out, a.T)


@pytest.mark.parametrize("N, rows, cols", [(1, 8, 8), (3, 9, 4), (5, 64, 17), (16, 32, 256)])
def test_transposed_images_an_image_a_task(N, rows, cols):
    # cpu.transpose.transposed_images: out[n] = a[n].T for each image, a task an image, on two
    # threads (work past the parallel threshold at (16, 32, 256)); tiles ended or not; every
    # value of out written (it starts NaN)
    from numbafuse.kernels.cpu import launch as cpu_launch
    from numbafuse.kernels.cpu.transpose import transposed_images
    a = np.random.default_rng(N + rows).standard_normal((N, rows, cols)).astype(np.float32)
    before = cpu_launch.num_threads()
    cpu_launch.set_num_threads(2)
    try:
        out = transposed_images(a, np.full((N, cols, rows), np.nan, np.float32))
    finally:
        cpu_launch.set_num_threads(before)
    np.testing.assert_array_equal(out, a.transpose(0, 2, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("K, C", [(5, 3), (16, 7), (17, 9), (40, 8), (260, 9), (9, 517)])
def test_winograd_taps_forward_and_flipped(dtype, K, C):
    # U = G g G^T per filter pair (F(2, 3)), formed in float64 and rounded once: the forward
    # (16, C, K), a task per 8 input channels (C 7, 8, 9: a block ended or not), and the dX's
    # (16, K, C) of the flipped taps, a task per 8 filters; rows of 260 and 517 values span
    # segments of 256 (the last one short)
    from numbafuse.kernels.conv import cpu_winograd
    G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    w = np.random.default_rng(K * C).standard_normal((K, C, 3, 3)).astype(dtype)
    U = np.einsum("xr,kcrs,ys->xykc", G, w.astype(np.float64), G).reshape(16, K, C)
    out = np.empty((16, C, K), dtype)
    cpu_winograd.winograd_taps(w, False, out)
    tol = 2 * np.finfo(dtype).eps * np.abs(U).max()
    np.testing.assert_allclose(out, U.transpose(0, 2, 1), rtol=0, atol=tol)
    Uf = np.einsum("xr,kcrs,ys->xykc", G, w[:, :, ::-1, ::-1].astype(np.float64), G)
    out = np.empty((16, K, C), dtype)
    cpu_winograd.winograd_taps(w, True, out)
    np.testing.assert_allclose(out, Uf.reshape(16, K, C), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("groups, K, C", [(1, 5, 3), (3, 17, 9), (2, 9, 300), (2, 260, 260)])
def test_winograd_dw_of_the_groups_sums_transforms_back(dtype, groups, K, C):
    # dw = G^T D G per filter pair, D the float64 sum of the groups' partial sums (summed in
    # group order by cpu_chunks.sum_groups, as the dW pass does): filters in tasks of 8 (K 5,
    # 9, 17, 260: a block ended or not); D of 16 x 260 x 260 values is split over the threads
    from numbafuse.kernels.conv import cpu_winograd
    from numbafuse.kernels.conv.cpu_chunks import sum_groups
    G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    parts = np.random.default_rng(K * C).standard_normal((groups, 16, K, C)).astype(dtype)
    D = parts.astype(np.float64).sum(axis=0).reshape(4, 4, K, C)
    want = np.einsum("xr,xykc,ys->kcrs", G, D, G)
    dw = np.full((K, C, 3, 3), np.nan, dtype)
    D64 = sum_groups(parts, np.float64)
    cpu_winograd.winograd_dw(D64, dw)
    tol = 8 * groups * np.finfo(dtype).eps * np.abs(parts).max()
    np.testing.assert_allclose(dw, want, rtol=0, atol=tol)
    # the same sums in the same order as G's rows taken one after the other, left to right
    # (the products with G's zeros add nothing, its ones and halves are exact): the same bits
    Dk = D64.reshape(4, 4, K, C)
    t = [[((G[0, r] * Dk[0, y] + G[1, r] * Dk[1, y]) + G[2, r] * Dk[2, y]) + G[3, r] * Dk[3, y]
          for y in range(4)] for r in range(3)]
    rows = np.stack([np.stack([((t[r][0] * G[0, s] + t[r][1] * G[1, s]) + t[r][2] * G[2, s])
                               + t[r][3] * G[3, s] for s in range(3)], -1) for r in range(3)], -2)
    assert np.array_equal(dw, rows.astype(dtype))


@pytest.mark.parametrize("C, W", [(8, 8), (19, 21), (16, 9)])
@pytest.mark.parametrize("chunk_bytes", [1, RULES.chunk_bytes])
def test_strided_nchw_slabs_of_whole_tiles(C, W, chunk_bytes):
    # channel counts and widths of 8 and more: the slabs' transposes run their 8x8 tiles, with
    # edge rows and columns (19, 21) or none (8, 8)
    rng = np.random.default_rng(C + W)
    x = rng.standard_normal((2, C, 11, W)).astype(np.float32)
    w = (rng.standard_normal((9, C, 3, 3)) / C).astype(np.float32)
    b = rng.standard_normal(9).astype(np.float32)
    p = nfs.ConvProblem(x, w, b, dict(stride=2, padding=1, dilation=1, layout="NCHW"))
    _check(p, chunk_bytes, groups=3, min_channels=8)


@pytest.mark.parametrize("C, H, W", [(8, 8, 8), (19, 13, 21), (16, 9, 17)])
@pytest.mark.parametrize("chunk_bytes, tiles", [(1, 1), (3000, 7), (RULES.chunk_bytes,
                                                                     RULES.winograd_tiles)])
def test_nchw_winograd_through_hwc_slabs(C, H, W, chunk_bytes, tiles):
    # 8 and more channels and columns: the slabs' transposes run 8x8 tiles and edges, in the
    # forward (x in, y out), dX (gy gated by y in, dx out) and dW (x, gy, y in); one tile row
    # a chunk, a few, whole images; odd output sizes (the last tile's second row and column)
    rng = np.random.default_rng(C * H + W)
    x = rng.standard_normal((3, C, H, W)).astype(np.float32)
    w = (rng.standard_normal((11, C, 3, 3)) / C).astype(np.float32)
    b = rng.standard_normal(11).astype(np.float32)
    p = nfs.ConvProblem(x, w, b, dict(stride=1, padding=1, dilation=1, layout="NCHW"))
    _check(p, chunk_bytes, groups=2, tiles=tiles, min_channels=8)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("kernel, stride, padding, dilation", [
    (3, 1, 1, 1), (1, 1, 0, 1), (3, 1, 2, 2), (3, 2, 1, 1)])  # Winograd, 1x1, phase, strided
@pytest.mark.parametrize("C, K, chunk_bytes, tiles", [
    (16, 24, 1, 1), (8, 40, RULES.chunk_bytes, RULES.winograd_tiles)])
def test_channel_counts_of_the_small_gemm(layout, kernel, stride, padding, dilation, C, K,
                                          chunk_bytes, tiles):
    # channel counts that are multiples of 8 send the float32 GEMMs of the forward (n = K) and
    # dX (n = C) to the register-tiled kernel (cpu/gemm.py): panels of 24 and 16 columns (K =
    # 24, 40) and of 16 and 8 (C = 16, 8), chunks of one row or tile row (m % 4 != 0) and the
    # default ones; the phase planes' GEMMs accumulate (beta = 1)
    rng = np.random.default_rng(C + K + kernel + stride)
    shape = (3, C, 9, 10) if layout == "NCHW" else (3, 9, 10, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, kernel, kernel)) / C).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    p = nfs.ConvProblem(x, w, b, dict(stride=stride, padding=padding, dilation=dilation,
                                      layout=layout))
    _check(p, chunk_bytes, groups=3, tiles=tiles, min_channels=8)


@pytest.mark.parametrize("N, size, forward", [(16, 2, "im2col"), (16, 4, "im2col"),
                                              (7, 8, "im2col"), (8, 8, "winograd"),
                                              (8, 7, "winograd"), (32, 8, "winograd")])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_winograd_forward_needs_enough_tiles(N, size, forward, layout, conv_rules):
    # a 3x3 stride-1 forward and dW with fewer than winograd_min_tiles (128) 2x2 output tiles in the
    # batch runs im2col (deep layers' 2x2 and 4x4 maps: 2-4x faster there); dX and dW stay
    # Winograd. 7 images of 8x8 are 112 tiles, 8 are 128 (the edge), and 7x7 maps have 4x4
    # tiles an image as 8x8 maps do (the few-channels forward rule off: 64 channels would
    # take the implicit GEMM, test_few_channels_forward_takes_the_implicit_gemm; the tapwise
    # forward off: it takes the 2x2 and 4x4 maps, test_conv_tapwise.py)
    conv_rules(implicit_s1_max_channels=0, tapwise_max_density=0.0)
    shape = (N, 64, size, size) if layout == "NCHW" else (N, size, size, 64)
    geom = nf.validate.conv_geometry("t", shape, (64, 64, 3, 3), 1, 1, 1, layout)
    tiles = N * ((geom.P + 1) // 2) * ((geom.Q + 1) // 2)
    assert (tiles >= RULES.winograd_min_tiles) == (forward == "winograd")
    assert cpu_conv.algorithm(geom, "forward") == cpu_conv.algorithm(geom, "dw") == forward
    assert cpu_conv.algorithm(geom, "dx") == "winograd"


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("C, K, forward", [(64, 64, "implicit"), (32, 64, "implicit"),
                                           (32, 32, "implicit"), (31, 64, "winograd"),
                                           (24, 24, "winograd"), (64, 65, "winograd"),
                                           (96, 96, "winograd"), (128, 128, "winograd")])
def test_few_channels_forward_takes_the_implicit_gemm(layout, C, K, forward, conv_rules):
    # a 3x3 stride-1 float32 forward with 32 to 64 channels each side (implicit_s1_min_channels,
    # implicit_s1_max_channels) and enough tiles for Winograd runs the implicit GEMM's register
    # tiles (10-35% faster at 32-64 channels, no faster at 24, slower from 96: the rule's
    # measurements); dX and dW stay
    # Winograd, float64 (which the tiles do not take) too, and so do narrow tiles (taps off)
    shape = (16, C, 16, 16) if layout == "NCHW" else (16, 16, 16, C)
    geom = nf.validate.conv_geometry("t", shape, (K, C, 3, 3), 1, 1, 1, layout)
    if forward == "implicit" and not cpu_plan.RULES.taps:
        pytest.skip("the implicit GEMM's tiles need AVX-512 here")
    # on a CPU that splits a 512-bit FMA in two (Zen 4) the rule is off: Winograd everywhere
    from numbafuse.kernels.cpu import gemm_taps
    assert cpu_plan.RULES.implicit_s1_max_channels == (0 if gemm_taps.SPLIT_512 else 64)
    conv_rules(implicit_s1_max_channels=0)
    assert cpu_conv.algorithm(geom, "forward") == "winograd"
    conv_rules(implicit_s1_max_channels=64)                    # the rule where it is on
    assert cpu_conv.algorithm(geom, "forward") == forward
    assert cpu_conv.algorithm(geom, "dx") == cpu_conv.algorithm(geom, "dw") == "winograd"
    assert cpu_plan.plan(geom, "forward", np.float64).algorithm == "winograd"
    conv_rules(taps=False)
    assert cpu_conv.algorithm(geom, "forward") == "winograd"


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("C, K, size", [(64, 128, 16), (128, 256, 8), (256, 512, 56)])
def test_strided_pointwise_dw_takes_im2col(layout, C, K, size):
    # the dW of an unpadded strided 1x1 (ResNet's downsample) runs im2col, faster than the
    # implicit GEMM at every shape measured (the rule's comment); its forward keeps its own
    # rules and its dX the pointwise GEMMs (or the k-blocked im2col)
    shape = (8, C, size, size) if layout == "NCHW" else (8, size, size, C)
    geom = nf.validate.conv_geometry("t", shape, (K, C, 1, 1), 2, 0, 1, layout)
    assert cpu_conv.algorithm(geom, "dw") == "im2col"
    assert cpu_conv.algorithm(geom, "dx") in ("pointwise", "im2col")
