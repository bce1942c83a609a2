"""The conv implicit GEMMs (kernels/cuda/conv.py on kernels/cuda/gemm.py), called directly,
against the NumPy/SciPy reference, at shapes past every tile boundary.

conftest shrinks every conv tiling to ``config.TINY_TILE`` (8 x 8 outputs, K-steps of 4,
2 x 2 per thread, 16 threads) and the dw splits to a handful, so these small problems have:
C*R*S and K above the tile (several K-steps, a partial last one, two column tiles), M over
several row tiles with a partial last one, dw cut into several splits, and strided dx with
phases that have different tap sets (or none). A second tiling with 4-wide vector groups
(``VEC_TILE``) runs the production thread mapping (VEC = 4) at simulator size.

Run: NUMBA_ENABLE_CUDASIM=1 python -m pytest -q tests/cuda/test_conv_gemm_cuda.py
"""
import os

import numpy as np
import pytest
from numba import cuda

from numbafuse import validate
from numbafuse import reference as ref
from numbafuse.kernels.cuda import config
from numbafuse.kernels.conv import cuda as conv

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
TOL = {np.float32: dict(rtol=2e-4, atol=2e-4), np.float64: dict(rtol=1e-10, atol=1e-11)}
VEC_TILE = config.Tile(16, 16, 4, 4, 4, 4)        # 16 threads, two K-steps of 4 per 8 taps

# (x shape in NCHW, w shape, stride, padding, dilation): every one crosses the tiny tile's
# boundaries (K > 8, C*R*S > 4 and not a multiple of 4, M > 8 and not a multiple of 8)
CASES = [
    ((2, 3, 5, 6), (10, 3, 3, 3), 1, 1, 1),             # CRS 27: 7 K-steps, the last of 3
    ((1, 5, 7, 7), (9, 5, 1, 1), 1, 0, 1),              # 1x1, CRS 5
    ((2, 2, 7, 6), (11, 2, 3, 2), 2, 1, (1, 2)),        # stride 2: 4 dx phases, dilation
    ((1, 3, 8, 7), (9, 3, 3, 3), 2, "same", 1),         # asymmetric "same" padding
    ((2, 2, 9, 8), (9, 2, 1, 1), 2, 0, 1),              # stride 2, 1x1: 3 phases with no tap
    ((1, 2, 9, 9), (10, 2, 2, 3), (3, 2), (2, 1), (2, 1)),   # 3 x 2 phases, uneven taps
]


def _to_layout(x, layout):
    return x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def _problem(case, layout, dtype, seed=0):
    x_shape, w_shape, stride, padding, dilation = case
    rng = np.random.default_rng(seed)
    x = _to_layout(rng.standard_normal(x_shape), layout).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    kw = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    geom = validate.conv_geometry("test", x.shape, w.shape, **kw)
    return x, w, b, kw, geom


def _close(actual, expected, dtype):
    np.testing.assert_allclose(actual.copy_to_host(), expected, **TOL[np.dtype(dtype).type])


def _run(case, layout, dtype):
    x, w, b, kw, geom = _problem(case, layout, dtype)
    dx_, dw_, db_ = (cuda.to_device(a) for a in (x, w, b))
    y = conv.conv_forward(dx_, dw_, db_, geom, relu=True)
    _close(y, ref.conv_bias_relu(x, w, b, **kw), dtype)
    gy = np.random.default_rng(1).standard_normal(geom.y_shape).astype(dtype)
    got = conv.conv_backward(cuda.to_device(gy), dx_, dw_, geom, y=y)
    for g, e in zip(got, ref.conv_bias_relu_backward(gy, x, w, b, **kw)):
        _close(g, e, dtype)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gemms_match_reference_float64(case, layout):
    _run(case, layout, np.float64)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gemms_match_reference_float32(layout):
    _run(CASES[2], layout, np.float32)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_vector_group_tiling(layout, monkeypatch):
    # VEC = 4 (the float32 production mapping: 4 consecutive rows per fragment group)
    monkeypatch.setattr(config, "tile_override", VEC_TILE)
    _run(((2, 3, 6, 7), (19, 3, 3, 3), 2, 1, 1), layout, np.float64)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_unmasked_and_partial_needs(layout):
    # no y (g = gy), no bias, no relu; only dw and db asked for
    x, w, b, kw, geom = _problem(CASES[0], layout, np.float64, seed=3)
    dx_, dw_ = cuda.to_device(x), cuda.to_device(w)
    y = conv.conv_forward(dx_, dw_, None, geom, relu=False)
    _close(y, ref.conv2d(x, w, **kw), np.float64)
    gy = np.random.default_rng(4).standard_normal(geom.y_shape)
    gx, gw, gb = conv.conv_backward(cuda.to_device(gy), dx_, dw_, geom, need=(False, True, True))
    assert gx is None
    ex, ew = ref.conv2d_backward(gy, x, w, **kw)
    _close(gw, ew, np.float64)
    _close(gb, gy.sum(axis=(0, 2, 3) if layout == "NCHW" else (0, 1, 2)), np.float64)


def test_dw_has_several_splits():
    # the planted-bug tests below rely on dw being cut into several splits here
    *_, geom = _problem(CASES[0], "NCHW", np.float64)
    tile = config.conv_tile("dw", np.float64)
    _, _, grid, n_splits = conv.dw_plan(geom, tile, True, config.dw_max_splits)
    assert n_splits >= 3 and grid[2] == n_splits


def test_reruns_are_bit_identical():
    """dw and db are split-K sums combined in a fixed order: reruns agree bit for bit."""
    x, w, b, kw, geom = _problem(CASES[2], "NHWC", np.float32, seed=5)
    gy = np.random.default_rng(6).standard_normal(geom.y_shape).astype(np.float32)
    runs = []
    for _ in range(2):
        dx_, dw_, db_ = (cuda.to_device(a) for a in (x, w, b))
        y = conv.conv_forward(dx_, dw_, db_, geom, relu=True)
        grads = conv.conv_backward(cuda.to_device(gy), dx_, dw_, geom, y=y)
        runs.append([a.copy_to_host() for a in (y,) + tuple(grads)])
    for a, b_ in zip(*runs):
        assert np.array_equal(a, b_)


def test_plans_are_built_once_per_geometry():
    *_, geom = _problem(CASES[1], "NCHW", np.float64)
    tile = config.conv_tile("fwd", np.float64)
    assert conv.forward_plan(geom, tile, True, True) is conv.forward_plan(geom, tile, True, True)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bias_add_and_channel_sum(layout):
    rng = np.random.default_rng(7)
    x = _to_layout(rng.standard_normal((2, 3, 5, 7)), layout)
    b = rng.standard_normal(3)
    out = conv.bias_add(cuda.to_device(x), cuda.to_device(b), layout).copy_to_host()
    np.testing.assert_allclose(out, ref.bias_add(x, b, layout=layout), **TOL[np.float64])
    s = conv.channel_sum(cuda.to_device(x), layout).copy_to_host()
    np.testing.assert_allclose(s, x.sum(axis=(0, 2, 3) if layout == "NCHW" else (0, 1, 2)),
                               **TOL[np.float64])


def test_narrow_tiles_take_gemms_of_at_most_their_columns(monkeypatch):
    """float32 fwd (columns: K) and dx (columns: C) take each tier's tiling up to its column
    bound and the next tier's (or the wide one) one column past it; float64, dw or no
    column count take the wide ones (dw in NHWC its own)."""
    monkeypatch.setattr(config, "tile_override", None)
    f32 = np.float32
    Tile = config.Tile
    narrow16, narrow8 = Tile(128, 64, 16, 8, 4, 4), Tile(128, 64, 8, 8, 4, 4)
    expected = {                                      # as measured (config's comment)
        ("fwd", "NCHW"): [(1, narrow16), (128, narrow16), (129, None)],
        ("fwd", "NHWC"): [(1, narrow16), (64, narrow16), (65, narrow8), (128, narrow8),
                          (129, None)],
        ("dx", "NCHW"): [(1, narrow8), (64, narrow8), (65, None)],
        ("dx", "NHWC"): [(1, narrow8), (64, narrow8), (65, None)],
    }
    for (kind, layout), cases in expected.items():
        wide = config.CONV_TILES[(kind, "float32")]
        for cols, tile in cases:
            assert config.conv_tile(kind, f32, cols, layout) == (tile or wide), (kind, cols)
        assert config.conv_tile(kind, f32, None, layout) == wide
        assert config.conv_tile(kind, np.float64, 1, layout) == config.CONV_TILES[
            (kind, "float64")]
    assert config.conv_tile("dw", f32, 64) == config.CONV_TILES[("dw", "float32")]
    # dw in NHWC: 16-deep at two blocks per SM (its 12-byte spill measured faster)
    assert config.conv_tile("dw", f32, None, "NHWC") == Tile(128, 64, 16, 8, 4, 4, min_blocks=2)
    assert config.conv_tile("dw", np.float64, None, "NHWC") == config.CONV_TILES[("dw", "float64")]


@pytest.mark.skipif(SIMULATOR, reason="production tiles: 256 Python threads a block in the "
                    "simulator; on a GPU they run")
@pytest.mark.parametrize("K, C", [(64, 64), (65, 65), (128, 64), (129, 65)])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_on_either_side_of_the_narrow_tiles(K, C, layout):
    """float32 fwd, dx and dw at the tilings' switches (forward: K = 64/65 in NHWC and
    128/129; dx: C = 64 and 65)."""
    x, w, b, kw, geom = _problem(((2, C, 9, 7), (K, C, 3, 3), 1, 1, 1), layout, np.float32)
    gy = np.random.default_rng(3).standard_normal(geom.y_shape).astype(np.float32)
    y = conv.conv_forward(cuda.to_device(x), cuda.to_device(w), cuda.to_device(b), geom,
                          relu=False)
    _close(y, ref.bias_add(ref.conv2d(x, w, **kw), b, layout=layout), np.float32)
    gx, gw, _ = conv.conv_backward(cuda.to_device(gy), cuda.to_device(x), cuda.to_device(w),
                                   geom)
    ex, ew = ref.conv2d_backward(gy, x, w, **kw)
    _close(gx, ex, np.float32)
    _close(gw, ew, np.float32)


@pytest.mark.parametrize("case, dtype", [(CASES[0], np.float32), (CASES[4], np.float64),
                                         (CASES[5], np.float32)], ids=["s1", "s2_1x1", "s32"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_dx_addend_is_added_by_the_epilogue(case, layout, dtype):
    """``dx_addend`` (the tape's gradient of x so far): dx comes back as the dx GEMM's sum
    plus the addend, bit for bit what adding them afterwards gives (one rounding, either
    order), at every phase (stride 2 with phases that have no tap: their dx is the addend
    itself; 3 x 2 phases) and both layouts; the addend is not written."""
    x, w, b, kw, geom = _problem(case, layout, dtype, seed=7)
    rng = np.random.default_rng(8)
    gy = rng.standard_normal(geom.y_shape).astype(dtype)
    addend = rng.standard_normal(x.shape).astype(dtype)
    d_x, d_w, d_gy, d_add = (cuda.to_device(a) for a in (x, w, gy, addend))
    y = conv.conv_forward(d_x, d_w, None, geom, relu=True)
    plain = conv.conv_backward(d_gy, d_x, d_w, geom, y=y, need=(True, True, False))
    added = conv.conv_backward(d_gy, d_x, d_w, geom, y=y, need=(True, True, False),
                               dx_addend=d_add)
    np.testing.assert_array_equal(added[0].copy_to_host(), plain[0].copy_to_host() + addend)
    np.testing.assert_array_equal(added[1].copy_to_host(), plain[1].copy_to_host())
    np.testing.assert_array_equal(d_add.copy_to_host(), addend)
    with pytest.raises(ValueError, match="dx_addend must be x's shape"):
        conv.conv_backward(d_gy, d_x, d_w, geom, y=y, dx_addend=d_gy)
