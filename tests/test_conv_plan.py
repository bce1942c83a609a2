"""The CPU conv plan (``kernels/conv/cpu_plan.py``): every algorithm that can run a pass,
forced through ``plan=``, against the reference; the rules as a value (``using``)."""
import contextlib
import itertools

import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.kernels.conv import cpu as cpu_conv, cpu_plan, cpu_winograd as _wino
from numbafuse.kernels.cpu import gemm_taps, steps as cpu_steps

from .harness import on_threads as _on_threads

TOL = {np.float32: dict(rtol=2e-4, atol=2e-4), np.float64: dict(rtol=1e-10, atol=1e-11)}

# (kernel, stride, padding, dilation, C, K): each runs on several algorithms per pass
GEOMETRIES = [
    (3, 1, 1, 1, 16, 16),       # winograd, im2col, phase
    (3, 2, 1, 1, 16, 16),       # winograd_s2, implicit (forward, dW), im2col, phase
    (1, 1, 0, 1, 16, 24),       # pointwise, implicit, im2col, phase
    (3, 2, (0, 2), 2, 8, 16),   # dilated, strided, uneven padding: implicit, im2col, phase
    # the implicit forward's taps of a filter row's S*C values (cpu_implicit.forward_taps):
    # dilated along H only, and a stem's 7x7/2 on 3 channels (taps of 21 values)
    (3, 2, 1, (2, 1), 8, 16),
    (7, 2, 3, 1, 3, 8),
]


def _cases():
    # float32: float64 runs the same compiled code typed wider (each float64 compilation of a
    # path costs CI ~20-50 s a leg); test_conv_kernels checks float64 on the float32-only
    # paths' shapes, and the whole-batch test below runs float64 through plan=
    for kernel, stride, padding, dilation, C, K in GEOMETRIES:
        for layout in ("NCHW", "NHWC"):
            yield kernel, stride, padding, dilation, C, K, layout, np.float32


def _problem(kernel, stride, padding, dilation, C, K, layout, dtype):
    rng = np.random.default_rng(kernel * 100 + stride * 10 + C + K)
    N, H, W = 3, 9, 10
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal((K, C, kernel, kernel)) / (C * kernel)).astype(dtype)
    b = rng.standard_normal(K).astype(dtype)
    geom = nf.validate.conv_geometry("t", shape, w.shape, stride, padding, dilation, layout)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    return x, w, b, geom, kwargs


@pytest.mark.parametrize("kernel, stride, padding, dilation, C, K, layout, dtype", list(_cases()))
def test_every_supported_algorithm_of_every_pass_matches_the_reference(
        kernel, stride, padding, dilation, C, K, layout, dtype):
    x, w, b, geom, kwargs = _problem(kernel, stride, padding, dilation, C, K, layout, dtype)
    want_y = ref.conv_bias_relu(x, w, b, **kwargs)
    rng = np.random.default_rng(7)
    gy = rng.standard_normal(want_y.shape).astype(dtype)
    want_dx, want_dw, want_db = ref.conv_bias_relu_backward(gy, x, w, b, **kwargs)
    tol = TOL[dtype]
    ran = {}
    for pass_ in cpu_plan.PASSES:
        ran[pass_] = [a for a in cpu_plan.ALGORITHMS if cpu_plan.supports(a, geom, pass_, dtype)]
        assert {"im2col", "phase"} <= set(ran[pass_])
    for algorithm in ran["forward"]:
        y = cpu_conv.conv_forward(x, w, b, geom, True,
                                  plan=cpu_plan.plan(geom, "forward", dtype, algorithm=algorithm))
        np.testing.assert_allclose(y, want_y, **tol, err_msg=algorithm)
    y = np.ascontiguousarray(want_y, dtype)            # the ReLU mask, as the op passes it
    for dx_alg in ran["dx"]:
        for dw_alg in ran["dw"]:
            plans = (cpu_plan.plan(geom, "dx", dtype, algorithm=dx_alg),
                     cpu_plan.plan(geom, "dw", dtype, algorithm=dw_alg))
            dx, dw, db = cpu_conv.conv_backward(gy, x, w, geom, y, plans=plans)
            for name, got, want in (("dx", dx, want_dx), ("dw", dw, want_dw), ("db", db, want_db)):
                np.testing.assert_allclose(got, want, **tol, err_msg=f"{name} {dx_alg}/{dw_alg}")


def test_a_plan_refuses_an_algorithm_that_cannot_run_the_pass():
    g = nf.validate.conv_geometry("t", (2, 16, 9, 9), (16, 16, 5, 5), 1, 2, 1, "NCHW")
    for algorithm in ("winograd", "winograd_s2", "pointwise"):
        with pytest.raises(ValueError, match=algorithm):
            cpu_plan.plan(g, "forward", np.float32, algorithm=algorithm)
    with pytest.raises(ValueError, match="implicit"):                # no implicit dX
        cpu_plan.plan(g, "dx", np.float32, algorithm="implicit")
    with pytest.raises(ValueError, match="one of"):
        cpu_plan.plan(g, "forward", np.float32, algorithm="fft")
    with pytest.raises(ValueError, match="pass"):
        cpu_plan.plan(g, "backward", np.float32)


def test_rules_are_a_value_that_using_changes_for_a_block_only():
    g = nf.validate.conv_geometry("t", (2, 9, 9, 32), (32, 32, 3, 3), 1, 1, 1, "NHWC")
    before = cpu_plan.current_rules()
    assert before == cpu_plan.RULES
    assert cpu_plan.plan(g, "forward", np.float32).algorithm == "im2col"   # 50 tiles < 128
    with cpu_plan.using(winograd_min_tiles=0, winograd_tiles=7,
                        implicit_s1_max_channels=0) as rules:
        assert rules.winograd_tiles == 7 and cpu_plan.current_rules() is rules
        plan = cpu_plan.plan(g, "forward", np.float32)
        assert (plan.algorithm, plan.tiles) == ("winograd", 7)
        with cpu_plan.using(min_gemm_channels=64):                        # nested
            assert cpu_plan.plan(g, "forward", np.float32).algorithm == "im2col"
        assert cpu_plan.plan(g, "forward", np.float32).algorithm == "winograd"
    assert cpu_plan.current_rules() == before
    with pytest.raises(RuntimeError):
        with cpu_plan.using(chunk_bytes=1):
            raise RuntimeError
    assert cpu_plan.current_rules() == before
    with pytest.raises(TypeError, match="no rule named no_such_rule"):
        with cpu_plan.using(no_such_rule=1):
            pass
    assert cpu_plan.current_rules() == before
    # an explicit rules value wins over the context's
    assert cpu_plan.plan(g, "forward", np.float32, cpu_plan.RULES._replace(
        winograd_min_tiles=0, implicit_s1_max_channels=0)).algorithm == "winograd"


def test_the_plan_under_using_reaches_the_kernels_through_the_op(monkeypatch):
    """The public op plans with the context's rules: a planted rule that sends a 3x3 conv to
    the phase planes is seen by the driver."""
    seen = []
    real = cpu_plan.plan

    def spy(geom, pass_, dtype, rules=None, algorithm=None):
        p = real(geom, pass_, dtype, rules, algorithm)
        seen.append((pass_, p.algorithm, p.chunk_bytes))
        return p
    monkeypatch.setattr(cpu_conv, "_plan", spy)
    x = np.ones((2, 16, 6, 6), np.float32)
    w = np.ones((16, 16, 3, 3), np.float32) / 100
    with cpu_plan.using(chunk_bytes=4096, winograd_min_tiles=10**9):
        y = nf.conv_bias_relu(x, w, None, padding=1)
        nf.conv_bias_relu_backward(np.ones_like(y), x, w, y, padding=1)
    assert ("forward", "im2col", 4096) in seen
    assert ("dx", "winograd", 4096) in seen and ("dw", "im2col", 4096) in seen


def _deep_layer(seed, layout, stride, size, C, K):
    """A deep layer's float32 case of 2 images, 3x3, padding 1: (x, w, b, the reference's
    keywords, the geometry, the rng that drew them)."""
    rng = np.random.default_rng(seed)
    shape = (2, C, size, size) if layout == "NCHW" else (2, size, size, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, 3, 3)) / 20).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    geom = nf.validate.conv_geometry("t", shape, w.shape, stride, 1, 1, layout)
    return x, w, b, dict(stride=stride, padding=1, layout=layout), geom, rng


def _relu_output_and_gradient(x, w, b, kwargs, rng):
    """(y, dy): the reference forward (its ReLU gates the backward) and a random gradient."""
    y = np.ascontiguousarray(ref.conv_bias_relu(x, w, b, **kwargs), np.float32)
    return y, rng.standard_normal(y.shape).astype(np.float32)


def _deep_pointwise(layout, size, C, K):
    """A deep 1x1 layer's float32 case of 2 images, stride 1, unpadded: (x, w, b, the
    reference's keywords, the geometry, the reference's y and a random dy)."""
    rng = np.random.default_rng(C + K + size)
    shape = (2, C, size, size) if layout == "NCHW" else (2, size, size, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, 1, 1)) / 10).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    kwargs = dict(layout=layout)
    geom = nf.validate.conv_geometry("t", shape, w.shape, 1, 0, 1, layout)
    return (x, w, b, kwargs, geom, *_relu_output_and_gradient(x, w, b, kwargs, rng))


@pytest.mark.parametrize("unblocked", [0, 16])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("size", [2, 4])                   # 4 and 16 pixels an image
@pytest.mark.parametrize("C, K", [(40, 36), (100, 48)])   # blocks of 16: the last partial
def test_deep_pointwise_passes_run_blocked_where_the_rule_says(layout, size, C, K, unblocked):
    """A deep 1x1 conv (more channels than the batch's pixels): the passes that
    ``cpu_plan._pointwise_blocked`` names run as the whole batch's k-blocked GEMM (k_block 16
    here: blocks of 16, the last partial or empty), the others as pointwise GEMMs (a dW of
    few pixels an image by the implicit GEMM where it fits, ``pointwise_dw_implicit_pixels``:
    off here, below on); NCHW forwards and dX of 16 pixels an image not blocked where
    ``pointwise_nchw_unblocked_pixels`` reaches 16 (both settings, whatever this CPU's
    default); forward, dX, dW and db against the reference with bias and the ReLU's gate,
    bitwise the same on 1 and 3 threads."""
    x, w, b, kwargs, geom, y, dy = _deep_pointwise(layout, size, C, K)
    want = ref.conv_bias_relu_backward(dy, x, w, b, y=y, **kwargs)
    thin = size * size < cpu_plan.RULES.pointwise_thin_pixels
    nchw = layout == "NCHW"
    wide = size * size > unblocked
    blocked = {"forward": not nchw or thin or wide, "dx": nchw and (thin or wide),
               "dw": True if nchw else thin}
    with cpu_plan.using(k_block=16, pointwise_nchw_unblocked_pixels=unblocked,
                        pointwise_dw_implicit_pixels=0):
        for pass_, expect in blocked.items():
            plan = cpu_plan.plan(geom, pass_, np.float32)
            assert (plan.algorithm, plan.k_blocks > 1) == (("im2col", True) if expect
                                                           else ("pointwise", False)), pass_
            assert not plan.slab        # NCHW: the channels' planes whole, not HWC slabs
        got = _on_threads(lambda: (nf.conv_bias_relu(x, w, b, **kwargs),
                                   *cpu_conv.conv_backward(dy, x, w, geom, y)))
    np.testing.assert_allclose(got[1][0], ref.conv_bias_relu(x, w, b, **kwargs),
                               **TOL[np.float32])
    for g, r in zip(got[1][1:], want):
        np.testing.assert_allclose(g, r, **TOL[np.float32])
    for a, c in zip(got[1], got[3]):
        assert a.tobytes() == c.tobytes()


def test_deep_nchw_1x1_forwards_at_4x4_only_leave_the_blocked_gemms_by_the_rule():
    # pointwise_nchw_unblocked_pixels = 16 (but on full-width AVX-512, machine E): ResNet-50's
    # deep NCHW 1x1 forwards and dX at 4x4 (64x64 input) run the pointwise GEMMs, at 2x2 and
    # at 7x7 (224x224 input) the blocked ones, as with 0 (machine E's rule) everywhere. (The
    # widening forwards' im2col chunks off: on full-width AVX-512 they take the 4x4 ones first.)
    def chosen(C, K, H, pass_, unblocked):
        g = nf.validate.conv_geometry("t", (16, C, H, H), (K, C, 1, 1), 1, 0, 1, "NCHW")
        with cpu_plan.using(pointwise_nchw_unblocked_pixels=unblocked,
                            pointwise_chunked_pixels=0):
            plan = cpu_plan.plan(g, pass_, np.float32)
        return plan.algorithm, plan.k_blocks > 1
    for pass_ in ("forward", "dx"):
        assert chosen(256, 1024, 4, pass_, 16) == ("pointwise", False)
        assert chosen(1024, 256, 4, pass_, 16) == ("pointwise", False)
        assert chosen(256, 1024, 4, pass_, 0) == ("im2col", True)
        for unblocked in (0, 16):
            assert chosen(512, 2048, 2, pass_, unblocked) == ("im2col", True)
            assert chosen(512, 2048, 7, pass_, unblocked) == ("im2col", True)
    assert cpu_plan.RULES.pointwise_nchw_unblocked_pixels == (
        0 if gemm_taps.WIDE and not gemm_taps.SPLIT_512 else 16)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("H, W, C", [(8, 8, 24), (8, 9, 24), (8, 8, 20), (2, 2, 40)])
def test_small_pointwise_dw_runs_the_implicit_gemm_where_the_rule_says(layout, H, W, C):
    """The dW of a stride-1 1x1 conv with at most ``pointwise_dw_implicit_pixels`` pixels an
    image runs the implicit GEMM where it fits (C a multiple of 8) and the tiles are on
    (``taps``), else the pointwise GEMMs (8x8 = 64 pixels: implicit, 8x9 = 72: not; C = 20:
    not; a blocked one stays blocked);
    dW and db against the reference with the ReLU's gate, bitwise the same on 1 and 3
    threads."""
    rng = np.random.default_rng(H * W + C)
    N, K = 2, (48 if H * W < 16 else 16)           # (a deep one at 2x2: blocked, as above)
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, 1, 1)) / 10).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    kwargs = dict(layout=layout)
    geom = nf.validate.conv_geometry("t", shape, w.shape, 1, 0, 1, layout)
    y, dy = _relu_output_and_gradient(x, w, b, kwargs, rng)
    want = ref.conv_bias_relu_backward(dy, x, w, b, y=y, **kwargs)
    blocked = H * W < 16                           # (in blocks of 16 below)
    expect = ("im2col" if blocked else "implicit" if H * W <= 64 and C % 8 == 0
              else "pointwise")
    with cpu_plan.using(pointwise_dw_implicit_pixels=64, k_block=16, taps=True):
        assert cpu_plan.plan(geom, "dw", np.float32).algorithm == expect
        got = _on_threads(lambda: cpu_conv.conv_backward(dy, x, w, geom, y))
    for off in (dict(pointwise_dw_implicit_pixels=0), dict(taps=False)):   # the rule off
        with cpu_plan.using(k_block=16, **off):
            assert cpu_plan.plan(geom, "dw", np.float32).algorithm == (
                "im2col" if blocked else "pointwise")
    for g, r in zip(got[1], want):
        np.testing.assert_allclose(g, r, **TOL[np.float32])
    for a, c in zip(got[1], got[3]):
        assert a.tobytes() == c.tobytes()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("C, K", [(40, 36), (100, 48)])   # blocks of 16: the last partial
def test_k_blocked_pointwise_dx_copies_its_blocks_into_dx(layout, size, C, K):
    """The k-blocked dX of a 1x1 stride-1 unpadded conv (``cpu_im2col.dx_block_tasks``): its
    GEMM's rows are dx's pixels in order, copied into dx instead of scattered tap by tap (NHWC
    runs it only when a plan names it: the rule sends NHWC 1x1 dX to the pointwise GEMMs);
    against the reference with the ReLU's gate, bitwise the same on 1 and 3 threads."""
    x, w, b, kwargs, geom, y, dy = _deep_pointwise(layout, size, C, K)
    want = ref.conv_bias_relu_backward(dy, x, w, b, y=y, **kwargs)[0]
    with cpu_plan.using(k_block=16):
        plans = (cpu_plan.plan(geom, "dx", np.float32, algorithm="im2col"),
                 cpu_plan.plan(geom, "dw", np.float32))
        assert plans[0].k_blocks == C // 16
        got = _on_threads(lambda: cpu_conv.conv_backward(dy, x, w, geom, y, plans=plans)[0])
    np.testing.assert_allclose(got[1], want, **TOL[np.float32])
    assert got[1].tobytes() == got[3].tobytes()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("stride, size", [(1, 3), (2, 5), (1, 1)])
@pytest.mark.parametrize("K", [40, 100])        # blocks of 32 (the last 8), of 32 (two empty)
def test_whole_batch_im2col_forward_in_blocks_of_output_channels(layout, stride, size, K):
    """A deep layer (more output channels than output pixels in the batch): one chunk of the
    whole batch, the GEMM split over blocks of output channels (k_block 16 here: blocks of a
    multiple of 16, the last partial, trailing ones empty), NCHW over HWC slabs; against the
    reference with bias and ReLU, and bitwise the same on 1 and 3 threads."""
    x, w, b, kwargs, geom, _ = _deep_layer(K + size, layout, stride, size, 24, K)
    want = ref.conv_bias_relu(x, w, b, **kwargs)
    with cpu_plan.using(k_block=16, winograd_min_tiles=10**9, winograd_s2=False):
        plan = cpu_plan.plan(geom, "forward", np.float32)
        assert plan.algorithm == "im2col" and plan.k_blocks == K // 16
        assert plan.slab == (layout == "NCHW")
        got = _on_threads(lambda: nf.conv_bias_relu(x, w, b, **kwargs))
    np.testing.assert_allclose(got[1], want, **TOL[np.float32])
    assert got[1].tobytes() == got[3].tobytes()
    # the same blocks through the plan: float64 reaches it too (no float32-only step)
    x64, w64, b64 = x.astype(np.float64), w.astype(np.float64), b.astype(np.float64)
    plan = cpu_plan.plan(geom, "forward", np.float64, cpu_plan.RULES._replace(k_block=16),
                         algorithm="im2col")
    assert plan.k_blocks > 1
    np.testing.assert_allclose(cpu_conv.conv_forward(x64, w64, b64, geom, True, plan=plan),
                               ref.conv_bias_relu(x64, w64, b64, **kwargs), **TOL[np.float64])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("stride, size", [(1, 3), (2, 5), (1, 1)])
@pytest.mark.parametrize("K", [40, 100])        # blocks of 32 (the last 8), of 32 (two empty)
def test_whole_batch_im2col_dw_in_blocks_of_output_channels(layout, stride, size, K):
    """A deep layer's dW (at least as many output channels as output pixels in the batch):
    the whole batch's GEMM split over blocks of output channels, no partial sums (k_block 16
    here), NCHW over HWC slabs; dW and db of g = dy * (y > 0) against the reference, with and
    without dW, and bitwise the same on 1 and 3 threads; float64 through the plan."""
    x, w, b, kwargs, geom, rng = _deep_layer(K + size + 1, layout, stride, size, 24, K)
    y, dy = _relu_output_and_gradient(x, w, b, kwargs, rng)
    _, dw_want, db_want = ref.conv_bias_relu_backward(dy, x, w, b, y=y, **kwargs)
    with cpu_plan.using(k_block=16, winograd_min_tiles=10**9, winograd_s2=False):
        plan = cpu_plan.plan(geom, "dw", np.float32, algorithm="im2col")
        assert plan.k_blocks == K // 16 and plan.slab == (layout == "NCHW")
        if stride == 2:              # a deep strided dW: these blocks, not implicit GEMMs
            assert cpu_plan.plan(geom, "dw", np.float32).algorithm == "im2col"
        assert cpu_plan.plan(geom, "dx", np.float32).k_blocks == 1
        got = _on_threads(lambda: cpu_conv.conv_backward(dy, x, w, geom, y, (False, True, True),
                                                         plans=(plan, plan))[1:])
        _, no_dw, db_only = cpu_conv.conv_backward(dy, x, w, geom, y, (False, False, True),
                                                   plans=(plan, plan))
    np.testing.assert_allclose(got[1][0], dw_want, **TOL[np.float32])
    np.testing.assert_allclose(got[1][1], db_want, **TOL[np.float32])
    assert no_dw is None
    np.testing.assert_allclose(db_only, db_want, **TOL[np.float32])
    assert got[1][0].tobytes() == got[3][0].tobytes()
    assert got[1][1].tobytes() == got[3][1].tobytes()
    x64, w64, y64, dy64 = (a.astype(np.float64) for a in (x, w, y, dy))
    plan = cpu_plan.plan(geom, "dw", np.float64, cpu_plan.RULES._replace(k_block=16),
                         algorithm="im2col")
    assert plan.k_blocks > 1
    dw64 = cpu_conv.conv_backward(dy64, x64, w64, geom, y64, (False, True, False),
                                  plans=(plan, plan))[1]
    np.testing.assert_allclose(dw64, ref.conv_bias_relu_backward(dy64, x64, w64, b, y=y64,
                                                                 **kwargs)[1], **TOL[np.float64])


@pytest.mark.parametrize("wide", [True, False])                 # 16- and 8-float tiles
@pytest.mark.parametrize("C, K, slab, gathers", [
    (3, 120, False, True),     # dW^T (27, 120): 6 tiles of 4 rows + 3 of 1; panels 64+32+16+8
    (8, 40, True, True),       # dW (40, 72): cols' rows gathered (blas.gemm's route)
    (3, 12, False, False),     # K % 8: OpenBLAS
    (5, 24, True, False),      # R*S*C = 45 % 8: OpenBLAS
])
def test_nchw_im2col_dw_chunks_by_the_gather_tiles(monkeypatch, wide, C, K, slab, gathers):
    """The NCHW im2col dW over chunks (``cpu_im2col_dw.dw_tasks``) sums its products by
    ``gemm_gather``'s register tiles (float32; without slab the transposed product where
    ``gathers_dw`` says, with slab the cols' rows gathered, both by ``blas.gemm``'s route):
    several chunks a group (the first overwrites, the rest add), a last partial chunk, the
    ReLU's gate, stride 2; dW and db against the reference and bitwise the same on 1 and 3
    threads, on both tile widths."""
    monkeypatch.setattr(gemm_taps, "WIDE", wide)
    rng = np.random.default_rng(C * 1000 + K)
    x = rng.standard_normal((5, C, 13, 9)).astype(np.float32)          # P, Q = 7, 5
    w = (rng.standard_normal((K, C, 3, 3)) / 10).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    kwargs = dict(stride=2, padding=1, layout="NCHW")
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, 2, 1, 1, "NCHW")
    y, dy = _relu_output_and_gradient(x, w, b, kwargs, rng)
    _, dw_want, db_want = ref.conv_bias_relu_backward(dy, x, w, b, y=y, **kwargs)
    from numbafuse.kernels.conv import cpu_im2col_dw
    if not slab:                  # from this many output pixels an image (here 7 x 5): on
        monkeypatch.setattr(cpu_im2col_dw, "GATHER_MIN_PIXELS", 36)
        assert not cpu_im2col_dw.gathers_dw(geom, slab, np.float32)
        monkeypatch.setattr(cpu_im2col_dw, "GATHER_MIN_PIXELS", 35)
    assert cpu_im2col_dw.gathers_dw(geom, slab, np.float32) == (gathers and not slab)
    assert not cpu_im2col_dw.gathers_dw(geom, slab, np.float64)
    # chunks of 2 output rows (an image's 7: 2, 2, 2, 1), 4 groups of 5 chunks
    with cpu_plan.using(chunk_bytes=2 * 5 * 9 * C * 4 + 1, min_chunks=1, dw_groups=4):
        plan = cpu_plan.plan(geom, "dw", np.float32, algorithm="im2col")._replace(slab=slab)
        assert plan.k_blocks == 1
        assert cpu_conv._chunking(plan, 35, 7, 5, 9 * C * 4, 5) == (1, 2)
        got = _on_threads(lambda: cpu_conv.conv_backward(dy, x, w, geom, y, (False, True, True),
                                                         plans=(plan, plan))[1:])
    np.testing.assert_allclose(got[1][0], dw_want, **TOL[np.float32])
    np.testing.assert_allclose(got[1][1], db_want, **TOL[np.float32])
    assert got[1][0].tobytes() == got[3][0].tobytes()
    assert got[1][1].tobytes() == got[3][1].tobytes()


def test_a_widening_nchw_1x1_forward_on_small_images_runs_im2col_chunks():
    # (cpu_plan._pointwise_chunked: ResNet-50's 128 -> 512 at 8x8), with 16-float tiles
    # (AVX-512) on AMD only, and not where the CPU splits 512-bit FMAs: with 8-float ones, on
    # Zen 4 and on Intel's AVX-512, the GEMM per image measured faster
    def chosen(C, K, H, layout="NCHW", N=16, pass_="forward"):
        shape = (N, C, H, H) if layout == "NCHW" else (N, H, H, C)
        g = nf.validate.conv_geometry("t", shape, (K, C, 1, 1), 1, 0, 1, layout)
        plan = cpu_plan.plan(g, pass_, np.float32)
        return plan.algorithm, plan.k_blocks
    chunks = cpu_plan.RULES.wide and not gemm_taps.SPLIT_512 and gemm_taps.AMD
    assert cpu_plan.RULES.pointwise_chunked_pixels == (64 if chunks else 0)
    if not chunks:
        assert chosen(128, 512, 8)[0] == "pointwise"
    with cpu_plan.using(pointwise_chunked_pixels=64, pointwise_dw_implicit_pixels=0):
        _the_chunked_rule(chosen)


def _the_chunked_rule(chosen):
    # 8x8: the implicit GEMM where it has its register tiles (taps; pointwise_chunked_implicit_
    # pixels), im2col below that and without them
    eight = ("implicit", 1) if cpu_plan.current_rules().taps else ("im2col", 1)
    assert chosen(128, 512, 8) == eight
    assert chosen(64, 256, 8) == eight
    assert chosen(256, 1024, 4)[0] == "im2col"
    with cpu_plan.using(pointwise_chunked_implicit_pixels=65):
        assert chosen(128, 512, 8) == ("im2col", 1)
    assert chosen(128, 512, 16, N=4)[0] == "pointwise"              # 256 pixels an image
    assert chosen(512, 128, 8)[0] == "pointwise"                    # narrowing
    assert chosen(32, 128, 8)[0] == "pointwise"                     # few channels
    assert chosen(128, 512, 8, "NHWC")[0] == "pointwise"
    for pass_ in ("dx", "dw"):
        assert chosen(128, 512, 8, pass_=pass_)[0] == "pointwise"
    with cpu_plan.using(pointwise_chunked_pixels=63):                 # 64 pixels: the line
        assert chosen(128, 512, 8)[0] == "pointwise"


@pytest.mark.skipif(not cpu_plan.RULES.taps, reason="the implicit GEMM's register tiles: "
                    "16-float (AVX-512) only")
def test_the_chunked_1x1_forward_on_the_implicit_gemm_keeps_im2col_for_inference():
    # Rules.pointwise_chunked_implicit_pixels: the widening NCHW 1x1 forward that
    # _pointwise_chunked admits, on images of at least that many pixels (64: 8x8), runs the
    # implicit GEMM, the float64 reference's values; on fewer pixels im2col; forward_scaled
    # (inference, batch norm and z in the epilogue) keeps the im2col plan (cpu_plan.scaled),
    # the same bits as with the rule off, not None (a fold)
    rng = np.random.default_rng(7)
    N, C, K, H = 3, 64, 128, 8                       # 64 pixels an image: the chunked line
    x = rng.standard_normal((N, C, H, H)).astype(np.float32)
    w = rng.standard_normal((K, C, 1, 1)).astype(np.float32)
    z = rng.standard_normal((N, K, H, H)).astype(np.float32)
    scale = np.linspace(-1.5, 2.0, K).astype(np.float32)
    shift = rng.standard_normal(K).astype(np.float32)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, 1, 0, 1, "NCHW")
    y64 = ref.conv2d(x.astype(np.float64), w.astype(np.float64))
    axis = (1, -1, 1, 1)
    want = np.maximum(y64 * scale.reshape(axis) + shift.reshape(axis) + z, 0)
    scaled = {}
    for on in (False, True):
        with cpu_plan.using(pointwise_chunked_pixels=64,
                            pointwise_chunked_implicit_pixels=64 if on else 65):
            assert cpu_plan.plan(geom, "forward", np.float32).algorithm == (
                "implicit" if on else "im2col")
            assert cpu_plan.plan(geom, "dx", np.float32).algorithm == "pointwise"
            assert cpu_plan.scaled(geom, np.float32).algorithm == "im2col"
            np.testing.assert_allclose(cpu_conv.conv_forward(x, w, None, geom, False), y64,
                                       **TOL[np.float32])
            scaled[on] = cpu_conv.forward_scaled(x, w, lambda: (scale, shift), geom, True, z=z)
            np.testing.assert_allclose(scaled[on], want, **TOL[np.float32])
        with cpu_plan.using(pointwise_chunked_pixels=63,
                            pointwise_chunked_implicit_pixels=64 if on else 65):
            assert cpu_plan.plan(geom, "forward", np.float32).algorithm == "pointwise"
    assert cpu_plan.RULES.pointwise_chunked_implicit_pixels == 64
    small = nf.validate.conv_geometry("t", (N, C, 4, 4), w.shape, 1, 0, 1, "NCHW")
    with cpu_plan.using(pointwise_chunked_pixels=64):                 # 16 pixels: im2col
        assert cpu_plan.plan(small, "forward", np.float32).algorithm == "im2col"
    assert scaled[True].tobytes() == scaled[False].tobytes()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_a_strided_dw_with_as_many_channels_as_pixels_runs_blocked(layout):
    # ResNet-18's l3 3x3/2 128 -> 256 at batch 16: 256 output pixels, K = 256 (the k-blocked
    # im2col dW measured faster than the implicit GEMM there: cpu_plan.choose); one channel
    # fewer than pixels stays implicit (the register tiles: AVX-512; else im2col in chunks)
    for K, want in ((256, "im2col"), (255, "implicit" if cpu_plan.RULES.taps else "chunks")):
        shape = (16, 128, 8, 8) if layout == "NCHW" else (16, 8, 8, 128)
        g = nf.validate.conv_geometry("t", shape, (K, 128, 3, 3), 2, 1, 1, layout)
        assert g.N * g.P * g.Q == 256
        plan = cpu_plan.plan(g, "dw", np.float32)
        assert plan.algorithm == want.replace("chunks", "im2col")
        assert (plan.k_blocks > 1) == (want == "im2col")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("stride, size", [(1, 3), (2, 5), (1, 1)])
@pytest.mark.parametrize("C", [40, 100])        # blocks of 32 (the last 8), of 32 (two empty)
def test_whole_batch_im2col_dx_in_blocks_of_input_channels(layout, stride, size, C):
    """A deep layer's dX (at least as many output channels as output pixels in the batch):
    the plan's pick is one GEMM of the whole batch split over blocks of input channels
    (k_block 16 here), then col2im; dx of g = dy * (y > 0) against the reference, bitwise the
    same on 1 and 3 threads; float64 through the plan."""
    x, w, b, kwargs, geom, rng = _deep_layer(C + size + 2, layout, stride, size, C, 48)
    y, dy = _relu_output_and_gradient(x, w, b, kwargs, rng)
    dx_want = ref.conv_bias_relu_backward(dy, x, w, b, y=y, **kwargs)[0]
    with cpu_plan.using(k_block=16):
        plan = cpu_plan.plan(geom, "dx", np.float32)
        assert plan.algorithm == "im2col" and plan.k_blocks == C // 16
        got = _on_threads(lambda: cpu_conv.conv_backward(dy, x, w, geom, y, (True, False, False),
                                                         plans=(plan, plan))[0])
    np.testing.assert_allclose(got[1], dx_want, **TOL[np.float32])
    assert got[1].tobytes() == got[3].tobytes()
    x64, w64, y64, dy64 = (a.astype(np.float64) for a in (x, w, y, dy))
    plan = cpu_plan.plan(geom, "dx", np.float64, cpu_plan.RULES._replace(k_block=16))
    assert plan.algorithm == "im2col" and plan.k_blocks > 1
    dx64 = cpu_conv.conv_backward(dy64, x64, w64, geom, y64, (True, False, False),
                                  plans=(plan, plan))[0]
    np.testing.assert_allclose(dx64, ref.conv_bias_relu_backward(dy64, x64, w64, b, y=y64,
                                                                 **kwargs)[0], **TOL[np.float64])


@contextlib.contextmanager
def _step_slots_emptied():
    """Every step's slot empty and not ready (kernels/cpu/steps.py), as in a new process
    whose first conv is the one run inside; restored after."""
    steps_ = cpu_steps.made()
    values = {name: slot.value for name, slot in cpu_steps._SLOTS.items()}
    ready = {id(s): set(s._ready) for s in steps_}
    for slot in cpu_steps._SLOTS.values():
        slot.value = 0
    for s in steps_:
        s._ready.clear()
    try:
        yield
    finally:
        for name, value in values.items():
            cpu_steps._SLOTS[name].value = value
        for s in steps_:
            s._ready.clear()
            s._ready |= ready[id(s)]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_each_algorithm_readies_the_steps_its_kernels_call():
    # A pass run alone, every slot empty: its host entry must ready each step its kernels
    # call (else the kernel raises RuntimeError: "step ... called before ready"; inside a
    # step, where it cannot raise, it is reported as unraisable and the results are wrong:
    # both fail here). Results equal to the same plan's run with the slots filled. One test
    # for both layouts (the kernels take the layout at run time): its compilations, ~50 s on
    # a cold cache, land in one CI leg.
    for (kernel, stride, padding, dilation, C, K), layout in itertools.product(
            GEOMETRIES[:3], ("NCHW", "NHWC")):
        x, w, b, geom, _ = _problem(kernel, stride, padding, dilation, C, K, layout,
                                    np.float32)
        y = cpu_conv.conv_forward(x, w, b, geom, True)
        gy = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
        for pass_ in cpu_plan.PASSES:
            for algorithm in cpu_plan.ALGORITHMS:
                if not cpu_plan.supports(algorithm, geom, pass_, np.float32):
                    continue
                plan = cpu_plan.plan(geom, pass_, np.float32, algorithm=algorithm)
                if pass_ == "forward":
                    def run():
                        return cpu_conv.conv_forward(x, w, b, geom, True, plan=plan)
                else:
                    other = cpu_plan.plan(geom, "dw" if pass_ == "dx" else "dx", np.float32)
                    plans = (plan, other) if pass_ == "dx" else (other, plan)
                    need = (pass_ == "dx", pass_ == "dw", False)

                    def run():
                        grads = cpu_conv.conv_backward(gy, x, w, geom, y, need=need,
                                                       plans=plans)
                        return grads[0 if pass_ == "dx" else 1]
                want = run().copy()
                with _step_slots_emptied():
                    got = run()
                    if algorithm.startswith("winograd"):   # the other layout's rows: not
                        other = _wino.ROWS_SLABS if layout == "NHWC" else _wino.ROWS_HWC
                        assert not other._ready, f"{pass_} {algorithm} {layout}"   # compiled
                    if algorithm in ("pointwise", "phase"):     # their kernels call taps only
                        assert not gemm_taps.GEMM_GATHER._ready, f"{pass_} {algorithm}"
                np.testing.assert_array_equal(got, want, err_msg=f"{pass_} {algorithm}")


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_batchnorm_epilogue_readies_its_steps(layout, conv_rules):
    """The Winograd forward with batch norm's sums (cpu.forward_stats, forward_bn_sums: the
    Conv-BN ops) run with every slot empty, as a new process's first Conv-BN: the same bits
    as with the slots filled (cpu_epilogue.block is a step)."""
    conv_rules(min_gemm_channels=1, nchw_im2col_channels=1, winograd_min_tiles=0,
               implicit_s1_max_channels=0)
    x, w, b, geom, _ = _problem(3, 1, 1, 1, 16, 16, layout, np.float32)
    want = cpu_conv.forward_stats(x, w, geom, 1e-5)
    assert want is not None                          # the epilogue ran, not the fallback
    want = [a.copy() for a in want]
    with _step_slots_emptied():
        got = cpu_conv.forward_stats(x, w, geom, 1e-5)
    for a, g in zip(want, got):
        np.testing.assert_array_equal(g, a)


def test_plans_are_made_once_per_geometry_pass_dtype_and_rules(monkeypatch):
    """plan() keeps what it made (a pure function of its arguments): the same Plan object
    again, a new one under other rules (``using``), the kept one back after them; forced
    algorithms and a full table are planned anew."""
    monkeypatch.setattr(cpu_plan, "_PLANS", {})
    g = nf.validate.conv_geometry("t", (2, 16, 9, 9), (16, 16, 3, 3), 1, 1, 1, "NCHW")
    first = cpu_plan.plan(g, "forward", np.float32)
    assert cpu_plan.plan(g, "forward", np.float32) is first
    assert cpu_plan.plan(g, "dx", np.float32) is not first
    with cpu_plan.using(chunk_bytes=first.chunk_bytes + 4096):
        other = cpu_plan.plan(g, "forward", np.float32)
        assert other.chunk_bytes == first.chunk_bytes + 4096
    assert cpu_plan.plan(g, "forward", np.float32) is first
    forced = cpu_plan.plan(g, "forward", np.float32, algorithm="im2col")
    assert forced.algorithm == "im2col" and cpu_plan.plan(g, "forward", np.float32) is first
    monkeypatch.setattr(cpu_plan, "MAX_PLANS", len(cpu_plan._PLANS))
    g2 = nf.validate.conv_geometry("t", (2, 16, 9, 9), (8, 16, 3, 3), 1, 1, 1, "NCHW")
    made = cpu_plan.plan(g2, "forward", np.float32)
    assert cpu_plan.plan(g2, "forward", np.float32) == made and len(cpu_plan._PLANS) == 3


def test_deep_layers_split_into_at_least_two_blocks_of_channels():
    """A deep layer's whole-batch im2col (more channels than the batch's output pixels) runs
    in min_k_blocks blocks at least (of 32 channels at least; 128 channels were one block,
    one task, one thread), else in blocks of k_block; the dX rules measured on k_block
    blocks keep them."""
    def blocks(K, C=128, N=2, size=4, pass_="dw", **rules):
        g = nf.validate.conv_geometry("t", (N, C, size, size), (K, C, 3, 3), 1, 1, 1, "NCHW")
        with cpu_plan.using(**rules):
            return cpu_plan.plan(g, pass_, np.float32, algorithm="im2col").k_blocks
    assert blocks(128) == 2 and blocks(128, min_k_blocks=1) == 1
    assert blocks(64) == 2 and blocks(63) == 1 and blocks(48) == 1           # 32 a block
    assert blocks(256) == 2 and blocks(512) == 4 and blocks(512, min_k_blocks=8) == 8
    assert blocks(128, N=16) == 1                                # 256 pixels: not deep
    assert blocks(48, C=64, pass_="dx") == 2                     # dX: input channels
    # 3x3 64 at 2x2, batch 16: a deep dX, two blocks of 32, stays Winograd (0.125 ms against
    # the blocked im2col's 0.192 on machine F) where tapwise does not take it
    g = nf.validate.conv_geometry("t", (16, 64, 2, 2), (64, 64, 3, 3), 1, 1, 1, "NCHW")
    with cpu_plan.using(tapwise_max_density=0.0):
        assert cpu_plan.plan(g, "dx", np.float32).algorithm == "winograd"
        assert cpu_plan.plan(g, "dw", np.float32).algorithm == "im2col"


def test_a_tiny_batch_dx_runs_the_blocked_im2col():
    """A dX of a batch of fewer than tapwise_dx_min_batch_pixels output pixels that the
    k-blocked im2col runs goes there, not tapwise (3x3 256 at 2x2, batch 1-2; 3x3/2 128 ->
    256 to 2x2); from that many pixels tapwise as before."""
    def dx(N, C, K, size, stride=1, **rules):
        g = nf.validate.conv_geometry("t", (N, C, size, size), (K, C, 3, 3), stride, 1, 1,
                                      "NCHW")
        with cpu_plan.using(**rules):
            return cpu_plan.plan(g, "dx", np.float32).algorithm
    assert dx(2, 256, 256, 2) == "im2col" and dx(3, 256, 256, 2) == "im2col"       # 8, 12
    assert dx(4, 256, 256, 2) == "tapwise"                                         # 16
    assert dx(2, 256, 256, 2, tapwise_dx_min_batch_pixels=8) == "tapwise"
    assert dx(2, 128, 256, 4, stride=2) == "im2col"                    # 2 blocks of 64
    assert dx(4, 128, 256, 4, stride=2) == "tapwise"                                # 16
    assert dx(2, 128, 256, 4, stride=2, min_k_blocks=1) == "tapwise"  # one block: no rule


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("kernel, stride, padding, channels", [
    (3, 1, 1, 48),      # 2 blocks of 32 and 16 channels
    (3, 2, 1, 80),      # 4 blocks: 32, 32, 16 and an empty one (block_len rounds to 16s)
    (1, 1, 0, 80),
])
def test_every_count_of_blocks_a_table_may_choose_matches_the_reference(
        layout, kernel, stride, padding, channels):
    """A measured table may run im2col and tapwise in any count of channel blocks that
    ``cpu_plan.k_block_choices`` offers (``cpu_table.tune`` times them all): each count, every
    pass, against the reference, blocks that do not divide the channels included."""
    rng = np.random.default_rng(channels + stride)
    C = K = channels
    shape = (2, C, 5, 5) if layout == "NCHW" else (2, 5, 5, C)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, C, kernel, kernel)) / (C * kernel)).astype(np.float32)
    kwargs = dict(stride=stride, padding=padding, layout=layout)
    geom = nf.validate.conv_geometry("t", shape, w.shape, stride, padding, 1, layout)
    want_y = ref.conv_bias_relu(x, w, None, **kwargs)
    gy = rng.standard_normal(want_y.shape).astype(np.float32)
    y = np.ascontiguousarray(want_y, np.float32)
    want_dx, want_dw, _ = ref.conv_bias_relu_backward(gy, x, w, None, **kwargs)
    ran = 0
    for algorithm in ("im2col", "tapwise"):
        for pass_ in cpu_plan.PASSES:
            if not cpu_plan.supports(algorithm, geom, pass_, np.float32):
                continue
            for blocks in cpu_plan.k_block_choices(algorithm, geom, pass_, np.float32):
                plan = cpu_plan.plan(geom, pass_, np.float32, algorithm=algorithm,
                                     k_blocks=blocks)
                assert plan.k_blocks == blocks
                msg = f"{algorithm} {pass_} k_blocks={blocks}"
                if pass_ == "forward":
                    got = cpu_conv.conv_forward(x, w, None, geom, True, plan=plan)
                    np.testing.assert_allclose(got, want_y, **TOL[np.float32], err_msg=msg)
                    ran += 1
                    continue
                need = (pass_ == "dx", pass_ == "dw", False)
                dx, dw, _ = cpu_conv.conv_backward(gy, x, w, geom, y, need, plans=(plan, plan))
                got, want = (dx, want_dx) if pass_ == "dx" else (dw, want_dw)
                np.testing.assert_allclose(got, want, **TOL[np.float32], err_msg=msg)
                ran += 1
    assert ran >= 3 * 2 + 2 * 2      # im2col's three passes, tapwise's two, in >= 2 counts


def test_a_strided_1x1_nchw_forward_by_the_rule():
    """ResNet's downsample forward (NCHW 1x1/2): tapwise where the batch has at most
    ``1 / strided_1x1_deep`` output pixels per output channel and 256+ input channels; else
    the implicit GEMM (with the tiles on) from 2048 output pixels with at most 256 input
    channels; else im2col. NHWC stays im2col."""
    def chosen(N, C, K, H, layout="NCHW", **changes):
        shape = (N, C, H, H) if layout == "NCHW" else (N, H, H, C)
        geom = nf.validate.conv_geometry("t", shape, (K, C, 1, 1), 2, 0, 1, layout)
        with cpu_plan.using(**{"taps": True, **changes}):
            return cpu_plan.plan(geom, "forward", np.float32).algorithm
    assert chosen(16, 256, 512, 4) == "tapwise"             # 64 pixels, 8 channels each
    assert chosen(16, 1024, 2048, 14) == "tapwise"          # 784 pixels: 2048 >= 2 x 784
    assert chosen(32, 1024, 2048, 14) == "im2col"           # 1568: 2048 < 2 x 1568
    assert chosen(4, 128, 256, 8) == "im2col"               # 128 input channels
    assert chosen(4, 128, 256, 8, strided_1x1_tapwise_min_channels=128) == "tapwise"
    assert chosen(32, 64, 128, 16) == "implicit"            # 2048 pixels
    assert chosen(16, 64, 128, 16) == "im2col"              # 1024
    assert chosen(32, 64, 128, 16, strided_1x1_implicit_min_pixels=2049) == "im2col"
    assert chosen(16, 256, 512, 56) == "implicit"
    assert chosen(16, 512, 1024, 28) == "im2col"            # 512 input channels
    assert chosen(32, 64, 128, 16, taps=False) == "im2col"  # (the tiles off: 8-float vectors)
    for N, C, K, H in ((16, 256, 512, 4), (32, 64, 128, 16), (16, 256, 512, 56)):
        assert chosen(N, C, K, H, "NHWC") == "im2col"


def test_the_implicit_dw_takes_larger_chunks_where_its_partial_dw_is_large():
    """``Rules.dw_chunk_scale``: the implicit GEMM's and the pointwise GEMMs' dW chunks grow
    to 2 partial dW (K C R S values) over a chunk times ``chunk_bytes``, at most 4 times;
    other passes and algorithms keep ``chunk_bytes``; a test's tiny chunks stay tiny."""
    def dw_chunk(C, K, H, R, stride, **changes):
        geom = nf.validate.conv_geometry("t", (16, C, H, H), (K, C, R, R), stride, R // 2, 1,
                                         "NCHW")
        with cpu_plan.using(**changes):
            return (cpu_plan.plan(geom, "dw", np.float32, algorithm="implicit").chunk_bytes,
                    cpu_plan.plan(geom, "dw", np.float32, algorithm="im2col").chunk_bytes,
                    cpu_plan.plan(geom, "forward", np.float32, algorithm="implicit").chunk_bytes)
    base = cpu_plan.RULES.chunk_bytes
    assert base == 768 << 10 and cpu_plan.RULES.dw_chunk_scale == 4
    assert dw_chunk(64, 128, 56, 3, 2) == (base, base, base)       # 288 KiB of partial
    assert dw_chunk(128, 128, 56, 3, 2)[0] == base                  # 576 KiB: 2 x 576 < 2 x 768
    assert dw_chunk(128, 256, 28, 3, 2) == (3 * base, base, base)   # 1152 KiB: 3 chunks' worth
    assert dw_chunk(512, 512, 14, 3, 2)[0] == 4 * base              # (at most 4)
    assert dw_chunk(2048, 512, 7, 1, 1)[0] == 4 * base
    assert dw_chunk(512, 512, 14, 3, 2, dw_chunk_scale=1)[0] == base
    assert dw_chunk(512, 512, 14, 3, 2, chunk_bytes=1)[0] == 4      # tests' one-row chunks
    pointwise = nf.validate.conv_geometry("t", (16, 256, 14, 14), (1024, 256, 1, 1), 1, 0, 1,
                                          "NCHW")                   # 1 MiB of partial
    for pass_, want in (("dw", 2 * base), ("forward", base), ("dx", base)):
        assert cpu_plan.plan(pointwise, pass_, np.float32,
                             algorithm="pointwise").chunk_bytes == want
