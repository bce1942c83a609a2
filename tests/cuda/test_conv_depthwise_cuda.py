"""Depthwise convolutions on CUDA (``kernels/conv/cuda_depthwise.py``: direct stencils, no GEMM),
forward and backward through the public ops against the float64 reference.

The launch sizes are shrunk (``small_launches``) so that tiny inputs cross every boundary the
kernels partition work by: the forward's and dx's grid-stride loops run several rounds of a
few blocks, the last one partial (their index digits carried across every radix); dW's
pixels fall into several fixed parts, NHWC's lanes into several channel groups, more than
the grid's z covers (its channel loop), with several row groups combined by the tree.
"""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.cuda import numba_cuda as cuda
from numbafuse.kernels.conv import cuda_depthwise
from numbafuse.kernels.cuda import config

from ..harness import close
from .launches import recording

THREADS, MAX_BLOCKS, LANES, MAX_GRID_Z = 8, 3, 2, 2


@pytest.fixture
def small_launches(monkeypatch):
    monkeypatch.setattr(config, "threads", THREADS)        # grid-stride rounds of 24 threads
    monkeypatch.setattr(config, "max_blocks", MAX_BLOCKS)
    monkeypatch.setattr(config, "depthwise_lanes", LANES)  # NHWC dW: 4 row groups of 2 lanes
    monkeypatch.setattr(config, "max_grid_y", MAX_GRID_Z)  # dW's channel groups loop


def _arrays(rng, layout, N, C, H, W, K, R, S, dtype):
    x = rng.standard_normal((N, C, H, W) if layout == "NCHW" else (N, H, W, C)).astype(dtype)
    w = rng.standard_normal((K, 1, R, S)).astype(dtype)
    return x, w, rng.standard_normal(K).astype(dtype)


# (layout, (N, C, H, W), (K, R, S), geometry, bias): multiplier K / C
CASES = [
    ("NCHW", (2, 3, 7, 6), (6, 3, 3), dict(stride=2, padding=(2, 0, 1, 2), dilation=2), True),
    ("NHWC", (2, 3, 7, 6), (6, 3, 3), dict(stride=2, padding=(2, 0, 1, 2), dilation=2), True),
    ("NCHW", (1, 2, 6, 7), (2, 7, 7), dict(padding=3), False),
    ("NHWC", (1, 5, 9, 8), (5, 7, 7), dict(stride=2, padding=(3, 1, 2, 0)), True),
    ("NHWC", (2, 5, 4, 7), (5, 1, 3), dict(stride=(1, 2), padding=(0, 1)), False),
    ("NCHW", (2, 3, 5, 7), (6, 1, 3), dict(padding=(1, 0, 0, 0), dilation=(1, 2)), True),
]
IDS = [f"{c[0]}-C{c[1][1]}-K{c[2][0]}-{c[2][1]}x{c[2][2]}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize("layout, xs, ws, kw, bias", CASES, ids=IDS)
def test_depthwise_conv_bias_relu_matches_reference(small_launches, layout, xs, ws, kw, bias):
    rng = np.random.default_rng(sum(xs) + sum(ws))
    (N, C, H, W), (K, R, S) = xs, ws
    x, w, b = _arrays(rng, layout, N, C, H, W, K, R, S, np.float64)
    b = b if bias else None
    kw = dict(kw, layout=layout, groups=C)
    d_x, d_w = cuda.to_device(x), cuda.to_device(w)
    with recording() as rec:
        y = nf.conv_bias_relu(d_x, d_w, None if b is None else cuda.to_device(b), **kw)
    assert rec.names == ["_forward"]                        # one direct launch, no GEMM
    close(y.copy_to_host(), ref.conv_bias_relu(x, w, b, **kw), np.float64, what="y")
    gy = rng.standard_normal(y.shape)
    with recording() as rec:
        got = nf.conv_bias_relu_backward(cuda.to_device(gy), d_x, d_w, y, **kw)
    names = [n for n in rec.names if n != "_zero_int"]    # (reduce.counters, made once)
    assert names == ["_dx", "_dw_partials", "_sum_parts", f"channel_reduce_grad_{layout.lower()}"]
    # (the reference's db is the gradient a bias would get: the same with or without one)
    want = ref.conv_bias_relu_backward(gy, x, w, np.zeros(K), **kw, y=y.copy_to_host())
    for g, e, what in zip(got, want, ("dx", "dw", "db")):
        close(g.copy_to_host(), e, np.float64, what=what)


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False),
                                  (False, False, True), (False, True, True)])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_only_the_gradients_asked_for(small_launches, layout, need):
    rng = np.random.default_rng(7)
    x, w, b = _arrays(rng, layout, 2, 3, 5, 6, 6, 3, 3, np.float32)
    kw = dict(stride=2, padding=(0, 1, 1, 0), layout=layout, groups=3)
    d_x, d_w = cuda.to_device(x), cuda.to_device(w)
    y = nf.conv_bias_relu(d_x, d_w, cuda.to_device(b), **kw)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    got = nf.conv_bias_relu_backward(cuda.to_device(gy), d_x, d_w, y, need=need, **kw)
    want = ref.conv_bias_relu_backward(gy, x, w, b, **kw, y=y.copy_to_host())
    for asked, g, e, what in zip(need, got, want, ("dx", "dw", "db")):
        if asked:
            assert g.dtype == np.float32
            close(g.copy_to_host(), e, np.float32, what=what)
        else:
            assert g is None, what


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_ungated_conv2d_through_the_tape(small_launches, layout):
    """conv2d (no bias, no ReLU: the forward's relu off, the backward's g = gy ungated),
    float32, multiplier 2, through the tape."""
    rng = np.random.default_rng(3)
    x, w, _ = _arrays(rng, layout, 2, 2, 6, 5, 4, 3, 2, np.float32)
    kw = dict(stride=(2, 1), padding=(1, 1, 2, 0), dilation=(1, 2), layout=layout, groups=2)
    tx = nf.Tensor(cuda.to_device(x), requires_grad=True)
    tw = nf.Tensor(cuda.to_device(w), requires_grad=True)
    y = nf.conv2d(tx, tw, **kw)
    want_y = ref.conv2d(x, w, **kw)
    close(y.numpy(), want_y, np.float32, what="y")
    assert (want_y < 0).any()                                # values the ReLU would cut
    gy = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(cuda.to_device(gy))
    want_dx, want_dw = ref.conv2d_backward(gy, x, w, **kw)
    close(tx.grad.copy_to_host(), want_dx, np.float32, what="dx")
    close(tw.grad.copy_to_host(), want_dw, np.float32, what="dw")


def test_the_cases_cross_the_launch_boundaries(small_launches):
    """CASES reach what the fixture shrank: every forward and dx runs several grid-stride
    rounds; dW's pixels fall into several parts in both layouts, and
    NHWC's channel groups outnumber the grid's z (its channel loop)."""
    rounds = THREADS * MAX_BLOCKS
    parts_by_layout, z_loop = {"NCHW": 0, "NHWC": 0}, False
    for layout, xs, (K, R, S), kw, _ in CASES:
        N, C, H, W = xs
        shape = xs if layout == "NCHW" else (N, H, W, C)
        g = nf.validate.conv_geometry("t", shape, (K, 1, R, S), kw.get("stride", 1),
                                      kw.get("padding", 0), kw.get("dilation", 1), layout, C)
        for size in (N * K * g.P * g.Q, N * C * H * W):
            assert size > rounds
        grid, _, parts = cuda_depthwise.dw_launch(g, THREADS)
        parts_by_layout[layout] = max(parts_by_layout[layout], parts)
        z_loop |= layout == "NHWC" and -(-K // LANES) > grid[2]
    assert min(parts_by_layout.values()) > 1 and z_loop


def test_dx_taps_table():
    """Per input row, the taps reaching it form a progression (stride 2, dilation 3: every
    second tap, three output rows apart), cut to the output rows that exist."""
    table, tstep, ostep = cuda_depthwise.dx_taps(6, 5, 2, 1, 3, 3)
    assert (tstep, ostep) == (2, 3)
    for i, (t0, o0, count) in enumerate(table):
        hits = [(t, (i + 1 - 3 * t) // 2) for t in range(5)
                if (i + 1 - 3 * t) % 2 == 0 and 0 <= (i + 1 - 3 * t) // 2 < 3]
        assert [(t0 + j * tstep, o0 - j * ostep) for j in range(count)] == hits
