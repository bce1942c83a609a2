"""The unfused ops of ops/basic.py: what the harness does not ask of every op, on every
backend (``backend`` injected: CPU, and CUDA in the ``-m cuda`` process).

Forward, backward, gradcheck and reruns of each op are in ``tests/test_ops.py``; grid-stride
and tile boundaries in ``tests/test_boundaries.py``; bad input in ``tests/test_errors.py``.
Here: what is saved (y for relu, a one-byte window argmax for pooling), where a max pool's
gradient goes (first maximum, overlapping windows, NaN, windows over 256 taps), the loss's
stability, a small network's gradcheck, and GPU-like block sizes.
"""
import numpy as np
import pytest

import numbafuse as nf
import numbafuse.testing.strategies as nfs
from numbafuse import reference as ref

from .harness import BACKENDS, close, run_property


def _seeded(shape, seed=0, dtype=np.float64, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _tensor(backend, a, requires_grad=True):
    return nf.Tensor(backend.put(a), requires_grad=requires_grad)


# --------------------------------------------------------------------------- relu, linear

def test_relu_saves_its_output_and_keeps_nan(backend):
    x = _tensor(backend, np.array([-1.0, np.nan, 0.0, 2.0]))
    y = nf.relu(x)
    assert y._fn.saved.y is y.data and nf.saved_bytes(y) == y.data.nbytes
    np.testing.assert_array_equal(backend.get(y.data), [0.0, np.nan, 0.0, 2.0])
    y.backward(backend.put(np.ones(4)))
    np.testing.assert_array_equal(backend.get(x.grad), [0.0, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("n", [1, 16383, 16384, 2 * 16384 + 3])
def test_cpu_relu_kernels_across_their_blocks(n):
    """The CPU relu kernels' tasks take blocks of ELEMENT_BLOCK elements: sizes below, at and
    past a block (a partial last one), against NumPy (NaN kept), relu_backward also into
    ``out`` (the grouped convs' gate)."""
    from numbafuse.kernels.basic import cpu as basic_cpu
    assert basic_cpu.ELEMENT_BLOCK == 16384
    x, gy = _seeded((n,), 1, np.float32), _seeded((n,), 2, np.float32)
    x[n // 2] = np.nan
    y = basic_cpu.relu_forward(x)
    want = np.where(x > 0, x, np.where(np.isnan(x), x, 0)).astype(np.float32)
    assert y.tobytes() == want.tobytes()
    want_gx = np.where(y > 0, gy, 0).astype(np.float32)
    assert basic_cpu.relu_backward(gy, y).tobytes() == want_gx.tobytes()
    out = np.full(n, 7.0, np.float32)
    assert basic_cpu.relu_backward(gy, y, out=out) is out
    assert out.tobytes() == want_gx.tobytes()


def test_relu_of_a_non_contiguous_view(backend):
    x = _seeded((3, 4))
    view = backend.put(x).T                                        # (4, 3), F-ordered
    close(backend.get(nf.relu(view)), ref.relu(x.T), np.float64)


def test_linear_computes_only_the_gradients_asked_for(backend):
    w = _tensor(backend, _seeded((4, 3), 1))
    y = nf.linear(backend.put(_seeded((2, 3))), w)
    dx, dw, db = y._fn.backward(backend.put(np.ones((2, 4))))
    assert dx is None and db is None and dw is not None


# --------------------------------------------------------------------------- pooling

def _first_max_taps(x, k, stride, layout):
    """Row-major tap r*kw + s of each window's first maximum, shaped like y (NumPy argmax)."""
    kh, kw = (k, k) if np.isscalar(k) else k
    sh, sw = (kh, kw) if stride is None else stride
    xc = x if layout == "NCHW" else x.transpose(0, 3, 1, 2)       # (N, C, H, W)
    P, Q = (xc.shape[2] - kh) // sh + 1, (xc.shape[3] - kw) // sw + 1
    taps = np.stack([xc[:, :, r:r + (P - 1) * sh + 1:sh, s:s + (Q - 1) * sw + 1:sw]
                     for r in range(kh) for s in range(kw)]).argmax(axis=0)  # (N, C, P, Q)
    return taps if layout == "NCHW" else taps.transpose(0, 2, 3, 1)


def test_max_pool2d_saves_the_first_maximum_tap(backend):
    def body(draw):
        p = draw(nfs.pool_problems(max_size=5 if backend.small else 7))
        y = nf.max_pool2d(_tensor(backend, p.x), p.k, p.stride, layout=p.layout)
        assert set(vars(y._fn.saved)) == {"argmax"}
        np.testing.assert_array_equal(backend.get(y._fn.saved.argmax),
                                      _first_max_taps(p.x, p.k, p.stride, p.layout))

    run_property(f"pool-argmax:{backend.name}", backend.cost, body)


def test_max_pool2d_gradient_goes_to_the_first_maximum(backend):
    t = _tensor(backend, np.array([[[[1.0, 3.0], [3.0, 3.0]]]]))
    y = nf.max_pool2d(t, 2)
    np.testing.assert_array_equal(backend.get(y._fn.saved.argmax), [[[[1]]]])  # tap (0, 1)
    y.backward(backend.put(np.ones((1, 1, 1, 1))))
    np.testing.assert_array_equal(backend.get(t.grad)[0, 0], [[0.0, 1.0], [0.0, 0.0]])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pool2d_overlapping_windows_accumulate(backend, dtype, layout):
    # 3x3 plane, 2x2 windows, stride 1: the centre is the max of all four windows
    plane = np.array([[0.0, 1.0, 0.0], [2.0, 9.0, 3.0], [0.0, 4.0, 0.0]])
    x = np.stack([plane, -plane])[None].astype(dtype)               # (1, 2, 3, 3)
    x = x if layout == "NCHW" else x.transpose(0, 2, 3, 1).copy()
    t = _tensor(backend, x)
    y = nf.max_pool2d(t, 2, 1, layout=layout)
    dy = _seeded(y.shape, 0, dtype)
    y.backward(backend.put(dy))
    dx = backend.get(t.grad)
    close(dx, ref.max_pool2d_backward(dy, x, 2, 1, layout), dtype)
    dx_c = dx if layout == "NCHW" else dx.transpose(0, 3, 1, 2)
    dy_c = dy if layout == "NCHW" else dy.transpose(0, 3, 1, 2)
    close(dx_c[0, 0, 1, 1], dy_c[0, 0].sum(), dtype)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_max_pool2d_propagates_nan_and_routes_its_gradient_to_the_first_nan(backend, layout):
    # 2x2 windows, stride 1 over a 3x3 plane: the NaN at the centre is every window's max
    x = np.array([[[[0.0, 1.0, 0.0], [2.0, np.nan, 3.0], [0.0, np.nan, 0.0]]]])  # (1, 1, 3, 3)
    x = x if layout == "NCHW" else x.transpose(0, 2, 3, 1).copy()
    dy = _seeded((1, 2, 2, 1) if layout == "NHWC" else (1, 1, 2, 2))
    t = _tensor(backend, x)
    y = nf.max_pool2d(t, 2, 1, layout=layout)
    assert np.isnan(backend.get(y.data)).all()
    y.backward(backend.put(dy))
    dx = backend.get(t.grad)
    close(dx, ref.max_pool2d_backward(dy, x, 2, 1, layout), np.float64)
    assert dx.reshape(9)[4] == pytest.approx(dy.sum())


def test_max_pool2d_saves_a_one_byte_argmax_not_x(backend):
    x = _tensor(backend, _seeded((2, 3, 6, 6), 0, np.float32))
    y = nf.max_pool2d(x, 2)
    argmax = y._fn.saved.argmax
    assert backend.on_backend(argmax) and argmax.dtype == np.uint8 and argmax.shape == y.shape
    assert nf.saved_bytes(y) == y.data.size                          # 1 byte per output


def test_max_pool2d_windows_over_256_taps_use_uint16(backend):
    x = _seeded((1, 2, 17, 18), 1)
    t = _tensor(backend, x)
    y = nf.max_pool2d(t, (17, 16), (1, 2))                           # 272 taps, 2 windows
    assert y._fn.saved.argmax.dtype == np.uint16
    np.testing.assert_array_equal(backend.get(y._fn.saved.argmax),
                                  _first_max_taps(x, (17, 16), (1, 2), "NCHW"))
    dy = _seeded(y.shape, 2)
    y.backward(backend.put(dy))
    close(backend.get(t.grad), ref.max_pool2d_backward(dy, x, (17, 16), (1, 2), "NCHW"),
          np.float64)


# --------------------------------------------------------------------------- loss, networks

def test_cross_entropy_is_stable_for_huge_logits(backend):
    logits = backend.put(np.array([[1000.0, 0.0], [-1000.0, 1000.0]]))
    loss = nf.cross_entropy(logits, backend.put(np.array([0, 1])))
    np.testing.assert_allclose(backend.get(loss), 0.0, atol=1e-12)


def test_gradcheck_small_network(backend):
    # the conv-free head of a CNN: relu -> max_pool -> flatten -> linear -> cross_entropy
    def body(draw):
        seed = draw(nfs.SEEDS)
        x, w = _seeded((2, 2, 4, 4), seed), _seeded((3, 8), seed + 1)
        labels = backend.put(np.array([2, 0]))

        def net(x, w):
            return nf.cross_entropy(nf.linear(nf.flatten(nf.max_pool2d(nf.relu(x), 2)), w),
                                    labels)

        assert nf.gradcheck(net, [_tensor(backend, x), _tensor(backend, w)],
                            mode="directional", directions=backend.directions)

    run_property(f"small-network:{backend.name}", 8 * backend.cost, body)


def test_array_in_array_out_and_tensor_in_tensor_out(backend):
    x = backend.put(_seeded((1, 1, 2, 2), 0, np.float32))
    assert backend.on_backend(nf.max_pool2d(x, 2))
    y = nf.max_pool2d(nf.Tensor(x), 2)
    assert isinstance(y, nf.Tensor) and not y.requires_grad and y.device == backend.name
    with nf.no_grad():
        y = nf.relu(nf.Tensor(x, requires_grad=True))
    assert not y.requires_grad and nf.saved_bytes(y) == 0


def test_remapper_can_rebuild_each_op_from_its_params():
    t = nf.Tensor(_seeded((1, 4, 4, 2)), requires_grad=True)
    y = nf.max_pool2d(t, (2, 1), (1, 2), layout="NHWC")
    fn = y._fn
    rebuilt = type(fn)(**fn.param_dict()).apply(t.data)
    np.testing.assert_array_equal(rebuilt, y.data)


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [32, 64])
def test_cross_entropy_in_one_block_is_the_two_launch_result(threads, monkeypatch):
    """Up to ``config.xent_one_block_elements`` logits the forward is one launch (rows and
    mean in one block): the loss and the saved log-sum-exps must be the bits of the two
    launches (rows, then the one-block mean) at N = 77 rows over 32/64 threads (uneven
    strides), and both the reference's."""
    from numbafuse.kernels.basic import cuda as basic_cuda
    from numbafuse.kernels.cuda import config
    cuda = BACKENDS["cuda"]
    monkeypatch.setattr(config, "threads", threads)
    logits = _seeded((77, 3), 5)
    labels = np.random.default_rng(5).integers(0, 3, 77)
    d_logits, d_labels = cuda.put(logits), cuda.put(labels)
    got = {}
    for limit in (77 * 3, 77 * 3 - 1):               # one block; two launches
        monkeypatch.setattr(config, "xent_one_block_elements", limit)
        loss, lse = basic_cuda.cross_entropy_forward(d_logits, d_labels)
        got[limit] = cuda.get(loss), cuda.get(lse)
    (loss1, lse1), (loss2, lse2) = got.values()
    assert loss1.tobytes() == loss2.tobytes() and lse1.tobytes() == lse2.tobytes()
    close(loss1, ref.cross_entropy(logits, labels), np.float64)


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [32, 64])
def test_cross_entropy_and_linear_with_warp_sized_blocks(threads, monkeypatch):
    # GPU-like block sizes: the one-block loss mean strides unevenly over N = 77 rows (its
    # shared-memory tree over 32/64 threads), linear's tiles grid-stride over 3 blocks
    from numbafuse.kernels.cuda import config
    cuda = BACKENDS["cuda"]
    monkeypatch.setattr(config, "threads", threads)
    logits = _seeded((77, 3), 3)
    labels = np.random.default_rng(3).integers(0, 3, 77)
    t = _tensor(cuda, logits)
    y = nf.cross_entropy(t, cuda.put(labels))
    close(cuda.get(y.data), ref.cross_entropy(logits, labels), np.float64)
    y.backward()
    close(cuda.get(t.grad), ref.cross_entropy_backward(1.0, logits, labels), np.float64)
    x, w, b = (_seeded(s, i) for i, s in enumerate([(20, 17), (18, 17), 18]))
    ts = [_tensor(cuda, a) for a in (x, w, b)]
    y = nf.linear(*ts)
    dy = _seeded((20, 18), 7)
    y.backward(cuda.put(dy))
    close(cuda.get(y.data), ref.linear(x, w, b), np.float64)
    for t, r in zip(ts, ref.linear_backward(dy, x, w)):
        close(cuda.get(t.grad), r, np.float64)


# --------------------------------------------------------------------------- max pool, padded

# (shape NCHW, k, stride, padding): ResNet's stem pool, channels in 64-lane blocks with a
# partial last (80: 64 + 16; 17), odd maps, stride 1, a non-square window and padding
POOL_PADDED = [((2, 64, 12, 12), 3, 2, 1), ((2, 80, 9, 7), 3, 2, 1), ((3, 17, 10, 11), 3, 1, 1),
               ((1, 5, 6, 8), (3, 2), (2, 1), (1, 1)), ((2, 3, 5, 5), 2, 2, 0)]


def _padded_pool_case(shape, layout, seed):
    x = _seeded(shape, seed, np.float32)
    x[0, 0, 0, :3] = x[0, 0, 0, 0]                     # a tie in the first window
    x[-1, -1, -1, -1] = np.nan                         # a NaN in the last
    return x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape, k, stride, padding", POOL_PADDED)
def test_max_pool2d_with_padding_matches_the_reference(shape, k, stride, padding, layout):
    """CPU (padding is CPU-only): the padded rows and columns never win, every pixel's
    gradient sums its windows' dy, both layouts, NaN and a tie."""
    x = _padded_pool_case(shape, layout, 3)
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, k, stride, padding=padding, layout=layout)
    want = ref.max_pool2d(x, k, stride, layout, padding)
    np.testing.assert_array_equal(y.data, want)
    dy = _seeded(y.shape, 4, np.float32)
    y.backward(dy)
    np.testing.assert_allclose(t.grad, ref.max_pool2d_backward(dy, x, k, stride, layout,
                                                               padding), rtol=1e-6, atol=1e-6)


@pytest.mark.torch
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape, k, stride, padding", POOL_PADDED)
def test_max_pool2d_with_padding_is_pytorchs_bit_for_bit(shape, k, stride, padding, layout):
    """Values and gradients equal to ``torch.nn.functional.max_pool2d``'s bit for bit (the
    first maximum wins; gradients summed per pixel in PyTorch's order), without NaN (PyTorch
    sends a window's gradient to its last NaN, numbafuse to its first)."""
    torch = pytest.importorskip("torch")
    x = _padded_pool_case(shape, layout, 5)
    x = np.nan_to_num(x, nan=0.5)
    xt = torch.from_numpy(x if layout == "NCHW" else x.transpose(0, 3, 1, 2)).requires_grad_()
    yt = torch.nn.functional.max_pool2d(xt, k, stride, padding)
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, k, stride, padding=padding, layout=layout)
    to_nchw = (lambda a: a) if layout == "NCHW" else (lambda a: a.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(to_nchw(y.data), yt.detach().numpy())
    dy = _seeded(yt.shape, 6, np.float32)
    yt.backward(torch.from_numpy(dy))
    y.backward(dy if layout == "NCHW" else np.ascontiguousarray(dy.transpose(0, 2, 3, 1)))
    np.testing.assert_array_equal(to_nchw(t.grad), xt.grad.numpy())


# The CPU forwards compare whole rows of channels at a time (cpu_pool._pool_rows: float lanes
# with int32 argmax lanes, narrowed to a byte as they are written; NCHW in blocks of 64
# channels: 80 = 64 + 16). NaNs and ties in many lanes, -inf and +inf, padding at every edge:
# each lane's value and its argmax (the first maximum, a NaN beating every number) as NumPy's.
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("C", [8, 24, 80])
def test_max_pool2d_lanes_keep_the_first_maximum_and_nan(C, layout):
    rng = np.random.default_rng(C)
    x = rng.standard_normal((2, C, 7, 6)).astype(np.float32)
    x[0, :, 0, :3] = x[0, :, 0, :1]                       # ties in the first windows
    x[:, ::3, 2, 3] = np.nan                              # NaNs in every third lane
    x[1, 1::4, 4, 1:3] = np.nan                           # two in one window
    x[1, 2::5, 6, :] = -np.inf
    x[0, 5 % C, 3, 2] = np.inf
    xl = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    y = nf.max_pool2d(nf.Tensor(xl, requires_grad=True), 3, 2, padding=1, layout=layout)
    np.testing.assert_array_equal(y.data, ref.max_pool2d(xl, 3, 2, layout, 1))
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    want = _first_max_taps(padded, 3, (2, 2), "NCHW")     # padding taps never win here
    got = y._fn.saved.argmax
    np.testing.assert_array_equal(got if layout == "NCHW" else got.transpose(0, 3, 1, 2), want)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_max_pool2d_backward_zeroes_a_reused_buffer(layout):
    """The CPU backward's dx comes from the output cache, uninitialised (a block released
    before, here filled with NaN): every pixel that no window picked must still be 0, over
    two of the NCHW kernel's 64-channel blocks (80 channels)."""
    from numbafuse.kernels.cpu.buffers import output_cache
    x = _padded_pool_case((2, 80, 12, 10), layout, 7)
    x = np.nan_to_num(x, nan=0.5)
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, 3, 2, padding=1, layout=layout)
    dy = _seeded(y.shape, 8, np.float32)
    assert x.nbytes >= output_cache.MIN_BYTES and output_cache.max_bytes
    dirty = output_cache.empty(x.shape, x.dtype)
    dirty[...] = np.nan
    del dirty                                             # its block is free again
    y.backward(dy)
    np.testing.assert_allclose(t.grad, ref.max_pool2d_backward(dy, x, 3, 2, layout, 1),
                               rtol=1e-6, atol=1e-6)
    assert (t.grad == 0).sum() > x.size // 2


def test_max_pool2d_padding_is_at_most_half_the_window():
    x = np.zeros((1, 1, 6, 6), np.float32)
    with pytest.raises(ValueError, match="padding must be at most half"):
        nf.max_pool2d(x, 3, 2, padding=2)
    with pytest.raises(ValueError, match="padding must be >= 0"):
        nf.max_pool2d(x, 3, 2, padding=-1)
