"""Grouped and depthwise convolutions on CUDA (``kernels/conv/cuda_grouped.py``: the GEMMs per
group), forward and backward against the float64 reference; tiny shapes for the simulator."""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.cuda import numba_cuda as cuda

from numbafuse.kernels.cuda import config
from numbafuse.kernels.elementwise import cuda as elementwise

from ..harness import close


@pytest.mark.parametrize("layout, C, K, groups, kw", [
    ("NCHW", 4, 6, 2, dict(stride=2, padding=(1, 0, 0, 1))),
    ("NHWC", 3, 6, 3, dict(padding=1)),                       # depthwise, multiplier 2
    ("NHWC", 6, 9, 3, dict(padding=1, stride=(1, 2))),        # per group, NHWC
    ("NCHW", 8, 4, 4, dict(padding=2, dilation=2)),           # per group, Kg < Cg
])
@pytest.mark.parametrize("direct", [16, 0], ids=["direct forward", "GEMM per group"])
def test_grouped_conv_on_the_device_matches_reference(monkeypatch, layout, C, K, groups, kw,
                                                      direct):
    monkeypatch.setattr(config, "direct_group_channels", direct)
    monkeypatch.setattr(config, "direct_group_channels_nhwc", direct)
    monkeypatch.setattr(config, "threads", 16)          # grid-stride loops of several rounds
    monkeypatch.setattr(config, "max_blocks", 3)
    monkeypatch.setattr(config, "depthwise_lanes", 2)   # dW: rows of w (k, cc) over lanes ...
    monkeypatch.setattr(config, "max_grid_y", 2)        # ... and several channel-block rounds
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, C, 5, 6) if layout == "NCHW" else (2, 5, 6, C))
    w, b = rng.standard_normal((K, C // groups, 3, 3)), rng.standard_normal(K)
    kw = dict(kw, layout=layout, groups=groups)
    dx_, dw_, db_ = (cuda.to_device(a) for a in (x, w, b))
    y = nf.conv_bias_relu(dx_, dw_, db_, **kw)
    close(y.copy_to_host(), ref.conv_bias_relu(x, w, b, **kw), np.float64, what="y")
    gy = rng.standard_normal(y.shape)
    got = nf.conv_bias_relu_backward(cuda.to_device(gy), dx_, dw_, y, **kw)
    for g, want, what in zip(got, ref.conv_bias_relu_backward(gy, x, w, b, **kw),
                             ("dx", "dw", "db")):
        close(g.copy_to_host(), want, np.float64, what=what)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("lo, hi", [(0, 2), (2, 5), (5, 7), (0, 7)])
def test_channel_blocks_copy_out_and_back(monkeypatch, layout, lo, hi):
    """The grouped path's channel-block copies (no numba view) against NumPy's slices, with
    the grid shrunk to 2 blocks of 8 threads so the copies run several grid-stride rounds."""
    monkeypatch.setattr(config, "threads", 8)
    monkeypatch.setattr(config, "max_blocks", 2)
    rng = np.random.default_rng(lo * 10 + hi)
    a = rng.standard_normal((3, 7, 2, 3) if layout == "NCHW" else (3, 2, 3, 7))
    block = (slice(None), slice(lo, hi)) if layout == "NCHW" else (Ellipsis, slice(lo, hi))
    got = elementwise.channel_slice(cuda.to_device(a), layout, lo, hi)
    np.testing.assert_array_equal(got.copy_to_host(), a[block])
    dst = cuda.to_device(a)
    new = rng.standard_normal(a[block].shape)
    elementwise.put_channels(cuda.to_device(new), dst, layout, lo)
    want = a.copy()
    want[block] = new
    np.testing.assert_array_equal(dst.copy_to_host(), want)
