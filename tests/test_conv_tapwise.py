"""The tapwise forward and dX (``kernels/conv/cpu_tapwise.py``): a GEMM per tap over only the
outputs it reaches, in blocks of channels; against the float64 reference (plain NumPy), at
the blocks' edges (a partial last block, empty trailing ones), taps that reach nothing (and
input pixels no tap reaches: dX zeros there), strides, dilations, uneven padding, both
layouts, the ReLU gate, the scaled epilogue and the weight cache; and the plan's rule."""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.kernels.conv import cpu as cpu_conv, cpu_plan, cpu_tapwise, weights
from numbafuse.kernels.conv.math import geo_tuple
from numbafuse.kernels.cpu import gemm_taps

TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float64: dict(rtol=1e-12, atol=1e-12)}

# (N, C, K, H, W, kernel, stride, padding, dilation)
CASES = [
    (3, 16, 40, 2, 2, 3, 1, 1, 1),          # 2x2: 4 of 9 taps a pixel; K = 40: blocks 32 + 8
    (2, 24, 100, 4, 3, 3, 1, 1, 1),         # 4x3; K = 100 in 16-blocks: 6 tasks, one empty
    (2, 16, 16, 1, 1, 3, 1, 1, 1),          # a 1x1 map: eight taps reach nothing
    (2, 16, 33, 2, 3, 5, 1, 2, 1),          # 5x5 over 2x3: most taps reach nothing
    (3, 17, 24, 5, 4, 3, 2, (0, 2), 1),     # strided, uneven padding, odd C
    (2, 16, 48, 5, 5, 3, 1, 2, 2),          # dilated
    (2, 16, 32, 4, 4, (1, 3), 1, (0, 1), 1),  # a 1x3 kernel
    (2, 32, 40, 14, 14, 3, 2, 1, 1),        # 14x14 -> 7x7 stride 2 (the plan's 0.907)
    (3, 32, 40, 7, 6, 1, 2, 0, 1),          # a strided 1x1 (a deep downsample's forward)
]


def _problem(case, layout, dtype, seed=0):
    N, C, K, H, W, kernel, stride, padding, dilation = case
    R, S = (kernel, kernel) if isinstance(kernel, int) else kernel
    rng = np.random.default_rng(seed + N * 7 + C + K)
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal((K, C, R, S)) / np.sqrt(C * R * S)).astype(dtype)
    b = rng.standard_normal(K).astype(dtype)
    geom = nf.validate.conv_geometry("t", shape, w.shape, stride, padding, dilation, layout)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    return x, w, b, geom, kwargs


def _tapwise(geom, dtype, pass_="forward"):
    return cpu_plan.plan(geom, pass_, dtype, algorithm="tapwise")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", CASES)
def test_tapwise_forward_matches_the_reference(monkeypatch, case, layout):
    x, w, b, geom, kwargs = _problem(case, layout, np.float64)
    want = ref.conv_bias_relu(x, w, b, **kwargs)
    with cpu_plan.using(tapwise_k_block=16):                  # as many blocks as can be
        plan = _tapwise(geom, np.float64)
        assert plan.k_blocks == max(1, min(geom.K // 16, max(2, geom.K // 16)))
        got = cpu_conv.conv_forward(x, w, b, geom, True, plan=plan)
        np.testing.assert_allclose(got, want, **TOL[np.float64])
    # no bias, no ReLU, float32, the default blocks
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    want = ref.conv2d(x32.astype(np.float64), w32.astype(np.float64), **kwargs)
    got = cpu_conv.conv_forward(x32, w32, None, geom, False, plan=_tapwise(geom, np.float32))
    np.testing.assert_allclose(got, want, **TOL[np.float32])
    # float32 in blocks of 16 channels: the products on gemm_taps' tiles (K % 8 == 0; each
    # block's weights transposed by its task) of both widths, else OpenBLAS
    assert cpu_tapwise.tiles_forward(geom, np.float32) == (geom.K % 8 == 0)
    assert not cpu_tapwise.tiles_forward(geom, np.float64)
    for wide in (True, False):
        monkeypatch.setattr(gemm_taps, "WIDE", wide)
        with cpu_plan.using(tapwise_k_block=16):
            got = cpu_conv.conv_forward(x32, w32, None, geom, False,
                                        plan=_tapwise(geom, np.float32))
        np.testing.assert_allclose(got, want, **TOL[np.float32])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", CASES + [
    (2, 40, 16, 2, 2, 3, 1, 1, 1),          # C = 40: dX's blocks 32 + 8
    (2, 100, 24, 4, 3, 3, 2, 1, 1),         # C = 100 in 16-blocks: 6 tasks, one empty; strided
    (2, 16, 24, 5, 5, 1, 2, 0, 1)])
def test_tapwise_dx_matches_the_reference(monkeypatch, case, layout):
    # (the last case: a 1x1/2 reaches every other input pixel, dX zero between; the rule
    # never takes a 1x1, plan= can)
    x, w, b, geom, kwargs = _problem(case, layout, np.float64, seed=1)
    y = ref.conv_bias_relu(x, w, b, **kwargs)                    # the ReLU mask: y > 0
    gy = np.random.default_rng(2).standard_normal(y.shape)
    want = ref.conv_bias_relu_backward(gy, x, w, b, y=y, **kwargs)[0]
    unmasked = ref.conv2d_backward(gy, x, w, **kwargs)[0]
    dw_plan = cpu_plan.plan(geom, "dw", np.float64, algorithm="im2col")
    with cpu_plan.using(tapwise_k_block=16):                  # as many blocks as can be
        plan = _tapwise(geom, np.float64, "dx")
        assert plan.k_blocks == max(1, min(geom.C // 16, max(2, geom.C // 16)))
        got = cpu_conv.conv_backward(gy, x, w, geom, y, need=(True, False, False),
                                     plans=(plan, dw_plan))[0]
        np.testing.assert_allclose(got, want, **TOL[np.float64])
        got = cpu_conv.conv_backward(gy, x, w, geom, None, need=(True, False, False),
                                     plans=(plan, dw_plan))[0]
        np.testing.assert_allclose(got, unmasked, **TOL[np.float64])
    g32, x32, w32, y32 = (a.astype(np.float32) for a in (gy, x, w, y))
    plan = _tapwise(geom, np.float32, "dx")
    got = cpu_conv.conv_backward(g32, x32, w32, geom, y32, need=(True, False, False),
                                 plans=(plan, cpu_plan.plan(geom, "dw", np.float32)))[0]
    want = ref.conv_bias_relu_backward(g32.astype(np.float64), x, w32.astype(np.float64), b,
                                       y=y32.astype(np.float64), **kwargs)[0]
    np.testing.assert_allclose(got, want, **TOL[np.float32])
    # float32 in blocks of 16 channels: the products on gemm_taps' tiles (blas.gemm's route:
    # C % 8 == 0, 16 rows a tap or more) of both widths, else OpenBLAS
    for wide in (True, False):
        monkeypatch.setattr(gemm_taps, "WIDE", wide)
        with cpu_plan.using(tapwise_k_block=16):
            got = cpu_conv.conv_backward(g32, x32, w32, geom, y32, need=(True, False, False),
                                         plans=(_tapwise(geom, np.float32, "dx"), dw_plan))[0]
        np.testing.assert_allclose(got, want, **TOL[np.float32])


@pytest.mark.torch
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", [CASES[1], CASES[0]])     # K = 100: OpenBLAS; 40: the tiles
def test_tapwise_scaled_epilogue_and_the_weight_cache(layout, case):
    torch = pytest.importorskip("torch")
    x, w, b, geom, kwargs = _problem(case, layout, np.float32)
    tiles = cpu_tapwise.tiles_forward(geom, np.float32)
    assert tiles == (geom.K == 40)
    scale = np.linspace(0.5, 2.0, geom.K).astype(np.float32)
    y64 = ref.conv2d(x.astype(np.float64), w.astype(np.float64), **kwargs)
    axis = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)
    want = np.maximum(y64 * scale.reshape(axis) + b.reshape(axis), 0)
    plan = _tapwise(geom, np.float32)
    fresh = cpu_conv.conv_forward(x, w, b, geom, True, plan=plan, scale=scale)
    np.testing.assert_allclose(fresh, want, **TOL[np.float32])
    owner = torch.from_numpy(w)
    weights.clear()
    with weights.enabled(), weights.vouch(w, owner):
        stored = cpu_conv.conv_forward(x, w, b, geom, True, plan=plan, scale=scale)
        hits = weights.stats()["hits"]
        kept = cpu_conv.conv_forward(x, w, b, geom, True, plan=plan, scale=scale)
        assert weights.stats()["hits"] == hits + 1        # the reordered weights, kept
        gy = np.ones_like(fresh)
        plans = (_tapwise(geom, np.float32, "dx"), cpu_plan.plan(geom, "dw", np.float32))
        dx_kept = cpu_conv.conv_backward(gy, x, w, geom, fresh, need=(True, False, False),
                                         plans=plans)[0]
        # dX read them too: OpenBLAS's (K, R*S*C), not the tiles' transposed blocks
        assert weights.stats()["hits"] == hits + (1 if tiles else 2)
    weights.clear()
    np.testing.assert_array_equal(stored, fresh)
    np.testing.assert_array_equal(kept, fresh)
    dx_own = cpu_conv.conv_backward(gy, x, w, geom, fresh, need=(True, False, False),
                                    plans=plans)[0]
    np.testing.assert_array_equal(dx_kept, dx_own)


@pytest.mark.parametrize("case", CASES)
def test_the_tables_count_what_the_plan_computes_as_density(case):
    _, _, _, geom, _ = _problem(case, "NCHW", np.float32)
    offsets, src, dst = cpu_tapwise.tables(geo_tuple(geom))
    assert src.size == dst.size == offsets[-1]
    assert np.all(np.diff(offsets) >= 0)
    total = geom.N * geom.P * geom.Q * geom.R * geom.S
    assert offsets[-1] / total == pytest.approx(cpu_plan.tapwise_density(geom))
    # every output pixel is reached by some tap or by none (all padding), and no pixel twice
    # by one tap
    for t in range(geom.R * geom.S):
        rows = dst[offsets[t]:offsets[t + 1]]
        assert np.unique(rows).size == rows.size


def test_the_plan_takes_tapwise_for_small_maps_only():
    def chosen(N, C, K, H, stride=1, kernel=3, layout="NCHW"):
        shape = (N, C, H, H) if layout == "NCHW" else (N, H, H, C)
        g = nf.validate.conv_geometry("t", shape, (K, C, kernel, kernel), stride,
                                      kernel // 2, 1, layout)
        return cpu_plan.plan(g, "forward", np.float32).algorithm

    # ResNet-18's l4 and l3 3x3 convs at a 64x64 input, their stride-2 entries, both layouts
    for layout in ("NCHW", "NHWC"):
        assert chosen(16, 512, 512, 2, layout=layout) == "tapwise"
        assert chosen(16, 256, 256, 4, layout=layout) == "tapwise"
        assert chosen(16, 256, 512, 4, 2, layout=layout) == "tapwise"
    assert chosen(16, 64, 128, 4, 2) == "tapwise"
    assert chosen(16, 128, 256, 8, 2) == "tapwise"               # strided, density 0.84
    assert chosen(16, 128, 256, 16, 2) != "tapwise"              # 0.92
    assert chosen(16, 128, 128, 8) != "tapwise"                  # stride 1, 0.77
    assert chosen(16, 512, 512, 7) != "tapwise"                  # 0.82
    assert chosen(16, 32, 32, 2) != "tapwise"                    # few channels
    assert chosen(16, 512, 512, 2, kernel=1) != "tapwise"        # one tap: nothing to skip
    g = nf.validate.conv_geometry("t", (16, 512, 2, 2), (512, 512, 3, 3), 1, 1, 1, "NCHW")
    assert cpu_plan.plan(g, "dx", np.float32).algorithm == "tapwise"
    assert cpu_plan.plan(g, "dw", np.float32).algorithm != "tapwise"
    assert not cpu_plan.supports("tapwise", g, "dw", np.float32)
    with cpu_plan.using(tapwise_max_density=0.0):
        for pass_ in ("forward", "dx"):
            assert cpu_plan.plan(g, pass_, np.float32).algorithm != "tapwise"
    # a strided dX that the k-blocked im2col runs stays there on images of fewer than
    # tapwise_blocked_dx_min_pixels output pixels (4: a 1x1 output); one that it does not,
    # not; from that many on (ResNet-18's l4 3x3/2 at 4x4 -> 2x2, ResNet-50's l3 3x3/2 256
    # at 8x8 -> 4x4) tapwise
    for layout in ("NCHW", "NHWC"):
        shape = (16, 256, 2, 2) if layout == "NCHW" else (16, 2, 2, 256)
        s2 = nf.validate.conv_geometry("t", shape, (512, 256, 3, 3), 2, 1, 1, layout)
        assert s2.P * s2.Q == 1
        assert cpu_plan.plan(s2, "dx", np.float32).algorithm == "im2col"
        shape = (16, 256, 4, 4) if layout == "NCHW" else (16, 4, 4, 256)
        s2 = nf.validate.conv_geometry("t", shape, (512, 256, 3, 3), 2, 1, 1, layout)
        assert s2.P * s2.Q == cpu_plan.RULES.tapwise_blocked_dx_min_pixels
        assert cpu_plan.plan(s2, "dx", np.float32, algorithm="im2col").k_blocks > 1
        assert cpu_plan.plan(s2, "dx", np.float32).algorithm == "tapwise"
        assert cpu_plan.plan(s2, "forward", np.float32).algorithm == "tapwise"
        with cpu_plan.using(tapwise_blocked_dx_min_pixels=5):
            assert cpu_plan.plan(s2, "dx", np.float32).algorithm == "im2col"
        shape = (16, 256, 8, 8) if layout == "NCHW" else (16, 8, 8, 256)
        s2 = nf.validate.conv_geometry("t", shape, (256, 256, 3, 3), 2, 1, 1, layout)
        assert cpu_plan.plan(s2, "dx", np.float32).algorithm == "tapwise"
    s2 = nf.validate.conv_geometry("t", (16, 64, 4, 4), (128, 64, 3, 3), 2, 1, 1, "NCHW")
    assert cpu_plan.plan(s2, "dx", np.float32).algorithm == "tapwise"
    # a strided dX and forward up to density 0.85 (ResNet-18's l3 3x3/2 at 8x8 -> 4x4: 0.84);
    # a stride-1 dX at 8x8 (0.77) not
    s2 = nf.validate.conv_geometry("t", (16, 128, 8, 8), (256, 128, 3, 3), 2, 1, 1, "NCHW")
    assert cpu_plan.plan(s2, "dx", np.float32).algorithm == "tapwise"
    assert cpu_plan.plan(s2, "forward", np.float32).algorithm == "tapwise"
    with cpu_plan.using(tapwise_strided_max_density=0.83):
        assert cpu_plan.plan(s2, "forward", np.float32).algorithm != "tapwise"
    s1 = nf.validate.conv_geometry("t", (16, 128, 8, 8), (128, 128, 3, 3), 1, 1, 1, "NCHW")
    assert cpu_plan.plan(s1, "dx", np.float32).algorithm != "tapwise"
    # ... up to 0.91: a 224x224 input's l4 3x3/2 at 14x14 -> 7x7 (0.907), not 16x16 -> 8x8
    # (0.918) nor 28x28 -> 14x14 (0.953), at any batch
    for batch in (4, 16, 32):
        for size, want in ((14, True), (16, False), (28, False)):
            s2 = nf.validate.conv_geometry("t", (batch, 256, size, size), (512, 256, 3, 3), 2,
                                           1, 1, "NCHW")
            for pass_ in ("forward", "dx"):
                assert (cpu_plan.plan(s2, pass_, np.float32).algorithm == "tapwise") == want


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", [CASES[1], CASES[0], CASES[4]])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_residual_in_the_scaled_epilogue(layout, case, dtype):
    """``forward_scaled``'s z (inference Conv-BN-Add-ReLU in one pass): relu(scale * conv +
    shift + z) against the float64 reference, through every plan that has the epilogue:
    tapwise in each of its k-block counts, im2col in chunks and in whole-batch k-blocks (the
    NCHW slab's and the strided columns' orders), both layouts; other plans say None."""
    x, w, b, geom, kwargs = _problem(case, layout, dtype)
    rng = np.random.default_rng(5)
    z = rng.standard_normal(geom.y_shape).astype(dtype)
    scale = np.linspace(0.5, 2.0, geom.K).astype(dtype)
    y64 = ref.conv2d(x.astype(np.float64), w.astype(np.float64), **kwargs)
    axis = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)
    want = np.maximum(y64 * scale.reshape(axis) + b.reshape(axis) + z, 0)
    plans = [cpu_plan.plan(geom, "forward", dtype, algorithm=a, k_blocks=kb)
             for a in ("tapwise", "im2col") if cpu_plan.supports(a, geom, "forward", dtype)
             for kb in cpu_plan.k_block_choices(a, geom, "forward", dtype)]
    assert len({(p.algorithm, p.k_blocks > 1) for p in plans}) >= 2
    for plan in plans:
        for slab in ({False, True} if plan.algorithm == "im2col" and layout == "NCHW"
                     else {plan.slab}):
            got = cpu_conv.conv_forward(x, w, b, geom, True, plan=plan._replace(slab=slab),
                                        scale=scale, z=z)
            np.testing.assert_allclose(got, want, **TOL[dtype],
                                       err_msg=f"{plan.algorithm} {plan.k_blocks} {slab}")
            got = cpu_conv.conv_forward(x, w, b, geom, False, plan=plan._replace(slab=slab),
                                        scale=scale, z=z)         # no ReLU: negatives kept
            np.testing.assert_allclose(got, want + np.minimum(
                y64 * scale.reshape(axis) + b.reshape(axis) + z, 0), **TOL[dtype])
    with pytest.raises(ValueError, match="z= need"):
        cpu_conv.conv_forward(x, w, b, geom, True, plan=cpu_plan.plan(
            geom, "forward", dtype, algorithm="phase"), scale=scale, z=z)
    with cpu_plan.using(tapwise_min_channels=10**6, tapwise_max_density=0.0):
        if cpu_plan.plan(geom, "forward", dtype).algorithm not in ("im2col", "tapwise"):
            assert cpu_conv.forward_scaled(x, w, lambda: (scale, b), geom, True, z=z) is None
