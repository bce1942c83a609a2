"""``kernels/cpu/pairs.py``: stride-2 splits and merges of a row in blocks of 8 pairs, against
NumPy's slicing, at every length around the block boundaries, both float dtypes, odd halves
one shorter, and through the depthwise NCHW phase split / merge of a conv wide enough for
several blocks."""
import numpy as np
import pytest
from numba import njit

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.kernels.cpu.pairs import merge_pairs, split_pairs

from .harness import close


@njit(cache=True)
def _split(src, even, odd):
    split_pairs(src, even, odd)


@njit(cache=True)
def _merge(even, odd, dst):
    merge_pairs(even, odd, dst)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_and_merge_equal_slicing_at_every_length(dtype):
    rng = np.random.default_rng(0)
    for n in range(0, 27):                           # 0-3 blocks of 8 and every remainder
        for short in (0, 1):                         # odd as long as even, or one shorter
            if short and n == 0:
                continue
            src = rng.standard_normal(2 * n - short + 3).astype(dtype)   # + values not read
            even, odd = np.full(n, 7, dtype), np.full(n - short, 7, dtype)
            _split(src, even, odd)
            assert even.tobytes() == src[0:2 * n - short:2].tobytes()
            assert odd.tobytes() == src[1:2 * n - short:2].tobytes()
            dst = np.full(2 * n - short + 3, 9, dtype)
            _merge(even, odd, dst)
            assert dst[:2 * n - short].tobytes() == src[:2 * n - short].tobytes()
            assert (dst[2 * n - short:] == 9).all()           # nothing written past the pairs


@pytest.mark.parametrize("padding", [1, 2, (0, 3, 1, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_depthwise_nchw_stride2_rows_of_several_blocks(padding, dtype):
    # W = 41: rows of 20-21 pairs (two blocks of 8 and a remainder), even and odd left padding
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 9, 41)).astype(dtype)
    w = rng.standard_normal((3, 1, 3, 3)).astype(dtype)
    b = rng.standard_normal(3).astype(dtype)
    kw = dict(stride=2, padding=padding, groups=3)
    y = nf.conv_bias_relu(x, w, b, **kw)
    close(y, ref.conv_bias_relu(x, w, b, **kw), dtype, what="y")
    gy = rng.standard_normal(y.shape).astype(dtype)
    for got, want, what in zip(nf.conv_bias_relu_backward(gy, x, w, y, **kw),
                               ref.conv_bias_relu_backward(gy, x, w, b, **kw),
                               ("dx", "dw", "db")):
        close(got, want, dtype, what=what)
