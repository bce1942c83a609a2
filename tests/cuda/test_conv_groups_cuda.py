"""Grouped and depthwise convolutions on CUDA (``kernels/conv/cuda_grouped.py``: the GEMMs per
group), forward and backward against the float64 reference; tiny shapes for the simulator."""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.cuda import numba_cuda as cuda

from ..harness import close


@pytest.mark.parametrize("layout, C, K, groups, kw", [
    ("NCHW", 4, 6, 2, dict(stride=2, padding=(1, 0, 0, 1))),
    ("NHWC", 3, 6, 3, dict(padding=1)),                       # depthwise, multiplier 2
])
def test_grouped_conv_on_the_device_matches_reference(layout, C, K, groups, kw):
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
