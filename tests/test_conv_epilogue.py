"""The batch-norm epilogue of the CPU Winograd forward (``kernels/conv/cpu_epilogue.py``).

Conv-BatchNorm-ReLU takes the batch statistics (forward) and the first pass of batch norm's
backward (recompute) from the conv's own chunks. Here both against NumPy, at shapes and
``winograd_tiles`` (a conv rule) that cut the output into one tile row a chunk (a last
partial one), a few rows, or several whole images; odd output sizes (the last tiles' second
row and column are not written, nor counted); channel counts whose rows are walked 64, 16,
8, 2 or 1 pixels at a time; channel means far from zero (the per-chunk shift); bitwise the
same on 1 and 3 threads, h bitwise the plain forward's. float32 only: the float64 kernels
are the same code typed wider, and each of their compilations cost CI ~40 s a leg.
"""
import numpy as np
import pytest

from numbafuse import validate
from numbafuse.kernels.cpu import launch as _launch
from numbafuse.kernels.batchnorm import cpu as bn_cpu
from numbafuse.kernels.conv import cpu as cpu_conv, cpu_epilogue, cpu_plan

from .harness import close
from .op_cases import CASES

TOL = CASES["conv_batchnorm_relu"].tol
EPS = 1e-5
SHAPES = [  # N, H, W, C, K
    (3, 9, 7, 5, 6),        # odd output sizes; rows of 64 pixels x 6 channels
    (2, 8, 8, 24, 24),      # the digits layer: rows of 16 pixels
    (4, 6, 11, 3, 40),      # rows of 8 pixels, an odd width
    (1, 13, 10, 8, 3),      # one image, many tile rows
    (2, 5, 5, 4, 300),      # more channels than a row holds: one pixel a row
]
TILES = [1, 7, cpu_plan.RULES.winograd_tiles]


def _problem(layout, N, H, W, C, K, dtype, padding=1, seed=0):
    rng = np.random.default_rng(seed + N * H * W + C * K)
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = (rng.standard_normal(shape) + 50.0).astype(dtype)
    sign = rng.choice([-1.0, 1.0], (K, 1, 1, 1))                  # channel means ~ +-50
    w = (sign * rng.uniform(0.5, 1.5, (K, C, 3, 3)) / (9 * C)).astype(dtype)
    geom = validate.conv_geometry("test", x.shape, w.shape, 1, padding, 1, layout)
    return x, w, geom


def _on_threads(threads, fn):
    before = _launch.num_threads()
    try:
        _launch.set_num_threads(threads)
        return fn()
    finally:
        _launch.set_num_threads(before)


@pytest.fixture
def winograd_everywhere(monkeypatch, conv_rules):
    """Small channel counts through Winograd, every call on the pool; returns a setter of
    the rules' winograd_tiles."""
    conv_rules(min_gemm_channels=1, nchw_im2col_channels=1, winograd_min_tiles=0,
               implicit_s1_max_channels=0)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    return lambda tiles: conv_rules(winograd_tiles=tiles)


def _channel_axes(layout):
    return (0, 2, 3) if layout == "NCHW" else (0, 1, 2)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("padding", [1, 0])
def test_forward_statistics(winograd_everywhere, layout, shape, tiles, padding, dtype=np.float32):
    winograd_everywhere(tiles)
    x, w, geom = _problem(layout, *shape, dtype, padding)
    one = _on_threads(1, lambda: cpu_conv.forward_stats(x, w, geom, EPS))
    three = _on_threads(3, lambda: cpu_conv.forward_stats(x, w, geom, EPS))
    assert one is not None
    for a, b in zip(one, three):
        assert a.tobytes() == b.tobytes()                          # no dependence on threads
    h, mean, var, invstd = one
    plain = cpu_conv.conv_forward(x, w, None, geom, False)
    assert h.tobytes() == plain.tobytes()
    h64 = h.astype(np.float64)
    axes = _channel_axes(layout)
    mean_ref = h64.mean(axis=axes)
    var_ref = ((h64 - np.expand_dims(mean_ref, axes)) ** 2).mean(axis=axes)
    if padding == 0:    # no zero padding in any window: channel means far from zero
        assert np.abs(mean_ref).min() > 10 * np.sqrt(var_ref).max()
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-12)
    np.testing.assert_allclose(var, var_ref, rtol=1e-8)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(var_ref + EPS), rtol=1e-8)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("relu", [True, False])
def test_backward_first_pass(winograd_everywhere, shape, tiles, relu, dtype=np.float32):
    winograd_everywhere(tiles)
    x, w, geom = _problem("NHWC", *shape, dtype)
    K = w.shape[0]
    rng = np.random.default_rng(K)
    h, mean, var, invstd = cpu_conv.forward_stats(x, w, geom, EPS)
    gamma = rng.uniform(0.5, 1.5, K).astype(dtype)
    beta = rng.uniform(-0.5, 0.5, K).astype(dtype)
    dy = rng.standard_normal(h.shape).astype(dtype)
    run = lambda: cpu_conv.forward_bn_sums(x, w, geom, dy, mean, invstd, gamma,   # noqa: E731
                                           beta if relu else None)
    one, three = _on_threads(1, run), _on_threads(3, run)
    for a, b in zip(one, three):
        assert a.tobytes() == b.tobytes()
    h2, g, sums = one
    assert h2.tobytes() == h.tobytes()                             # the recompute: same bits
    # g: the batch-norm backward's own gate (pass 1 writing gz), bit for bit
    state = (bn_cpu.STATE_AFFINE, beta) if relu else (bn_cpu.STATE_NONE, None)
    _, ggamma, gbeta, gz = bn_cpu.backward(dy, h, mean, invstd, gamma, *state, "NHWC", True,
                                           (False, True, True, True))
    assert g.tobytes() == gz.tobytes()
    if relu:
        assert 0.2 < np.mean(g == 0) < 0.8                         # the gate does close
    # the sums against NumPy's, from that g
    g64, h64 = g.astype(np.float64), h.astype(np.float64)
    np.testing.assert_allclose(sums.sum(axis=0)[0], g64.sum(axis=(0, 1, 2)), rtol=1e-9,
                               atol=1e-9 * np.abs(g64).sum())
    np.testing.assert_allclose(sums.sum(axis=0)[1], (g64 * (h64 - mean)).sum(axis=(0, 1, 2)),
                               rtol=1e-6, atol=1e-6 * np.abs(g64 * (h64 - mean)).sum())
    # and the backward's pass 2 from them: the same gradients as its own two passes
    got = bn_cpu.backward(g, h, mean, invstd, gamma, bn_cpu.STATE_NONE, None, "NHWC", True,
                          (True, True, True, False), sums=sums)
    want = bn_cpu.backward(dy, h, mean, invstd, gamma, *state, "NHWC", True,
                           (True, True, True, False))
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_no_epilogue_where_the_forward_is_not_winograd(winograd_everywhere):
    x, w, geom = _problem("NHWC", 2, 6, 6, 4, 5, np.float32)
    assert cpu_conv.forward_stats(x, w, geom, EPS) is not None
    strided = validate.conv_geometry("test", x.shape, w.shape, 2, 1, 1, "NHWC")
    assert cpu_conv.forward_stats(x, w, strided, EPS) is None
    nchw = validate.conv_geometry("test", (2, 4, 6, 6), w.shape, 1, 1, 1, "NCHW")
    dy = np.ones(nchw.y_shape, np.float32)
    ones = np.ones(5)
    assert cpu_conv.forward_bn_sums(x.reshape(2, 4, 6, 6), w, nchw, dy, ones, ones, ones,
                                    None) is None                  # (NHWC only)


def test_merge_stats_of_chunks():
    # Chan's merge of per-chunk shifted sums, empty chunks included, against NumPy
    rng = np.random.default_rng(3)
    values = [rng.standard_normal((n, 4)) * 2 + 1e4 for n in (5, 0, 1, 17, 3)]
    parts = np.zeros((len(values), 3, 4))
    for t, v in enumerate(values):
        if len(v):
            shift = v[0]
            parts[t] = ((v - shift).sum(0), ((v - shift) ** 2).sum(0), shift)
    counts = np.array([len(v) for v in values], np.float64)
    mean, var, invstd = np.empty((3, 4))
    cpu_epilogue.merge_stats(parts, counts, EPS, mean, var, invstd)
    allv = np.concatenate(values)
    np.testing.assert_allclose(mean, allv.mean(0), rtol=1e-14)
    np.testing.assert_allclose(var, allv.var(0), rtol=1e-9)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(allv.var(0) + EPS), rtol=1e-9)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("recompute", [True, False])
def test_conv_batchnorm_relu_through_the_epilogue(winograd_everywhere, monkeypatch, layout,
                                                  shape, relu, recompute):
    # the op end to end (forward, running statistics, backward) against the reference, the
    # epilogue's use counted
    from numbafuse import reference as ref
    from numbafuse.autograd import Tensor
    from numbafuse.ops.conv_batchnorm import ConvBatchNormReLU
    winograd_everywhere(7)
    used = {"forward_stats": 0, "forward_bn_sums": 0}
    for name in used:
        def spy(*args, _f=getattr(cpu_conv, name), _name=name):
            out = _f(*args)
            used[_name] += out is not None
            return out
        monkeypatch.setattr(cpu_conv, name, spy)
    x, w, _ = _problem(layout, *shape, np.float32)
    K = w.shape[0]
    rng = np.random.default_rng(K)
    gamma, beta = (rng.uniform(0.5, 1.5, K).astype(np.float32),
                   rng.uniform(-0.5, 0.5, K).astype(np.float32))
    rm, rv = rng.standard_normal(K).astype(np.float32), rng.uniform(0.5, 2, K).astype(np.float32)
    rm_ref, rv_ref = rm.copy(), rv.copy()
    ts = [Tensor(a, requires_grad=True) for a in (x, w, gamma, beta)]
    fn = ConvBatchNormReLU(running_mean=rm, running_var=rv, training=True, momentum=0.1,
                           eps=EPS, stride=1, padding=1, dilation=1, relu=relu, layout=layout,
                           recompute=recompute, comm=None)
    y = fn.apply(*ts)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(dy)
    kw = dict(eps=EPS, padding=1, relu=relu, layout=layout)
    y_ref, rm_new, rv_new = ref.conv_batchnorm_relu(x, w, gamma, beta, rm_ref, rv_ref, **kw)
    grads = ref.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)
    close(y.numpy(), y_ref, np.float32, TOL)
    close(rm, rm_new, np.float32, TOL)
    close(rv, rv_new, np.float32, TOL)
    for t, want in zip(ts, grads):
        close(t.grad, want, np.float32, TOL)
    assert used == {"forward_stats": 1,
                    "forward_bn_sums": int(recompute and layout == "NHWC")}


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("relu", [True, False])
def test_numpy_style_backward_takes_the_statistics_from_the_epilogue(winograd_everywhere,
                                                                     monkeypatch, layout,
                                                                     relu):
    # nf.conv_batchnorm_relu_backward recomputes h with its batch statistics from the conv's
    # chunks (forward_stats) and gates by gamma * xhat + beta of that h: against the reference
    import numbafuse as nf
    from numbafuse import reference as ref
    winograd_everywhere(7)
    used = []

    def spy(*args, _f=cpu_conv.forward_stats):
        out = _f(*args)
        used.append(out is not None)
        return out
    monkeypatch.setattr(cpu_conv, "forward_stats", spy)
    x, w, _ = _problem(layout, *SHAPES[0], np.float32)
    K = w.shape[0]
    rng = np.random.default_rng(K + 1)
    gamma, beta = (rng.uniform(0.5, 1.5, K).astype(np.float32),
                   rng.uniform(-0.5, 0.5, K).astype(np.float32))
    kw = dict(eps=EPS, padding=1, relu=relu, layout=layout)
    y_ref, _, _ = ref.conv_batchnorm_relu(x, w, gamma, beta, None, None, **kw)
    dy = rng.standard_normal(y_ref.shape).astype(np.float32)
    got = nf.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)
    want = ref.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)
    assert used == [True]
    for a, b in zip(got, want):
        close(a, b, np.float32, TOL)
