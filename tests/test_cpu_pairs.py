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


# Not cache=True: these inline kernels/cpu/pairs.py's code, and Numba keys a test file's cache
# on the test file alone (numbafuse.jit_cache covers the package's own modules), so a cached
# copy kept testing the old pairs.py after it changed (found when a planted bug passed)
@njit
def _split(src, even, odd):
    split_pairs(src, even, odd)


@njit
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


def _phases_reference(src, top, left, sh, sw, Wph, Hph):
    """split_phases' definition in NumPy: out[a*sw + b, i*Wph + j] = src[i*sh + a - top,
    j*sw + b - left], 0 outside src."""
    H, W = src.shape
    out = np.zeros((sh * sw, Hph, Wph), src.dtype)
    for a in range(sh):
        for b in range(sw):
            for i in range(Hph):
                for j in range(Wph):
                    h, c = i * sh + a - top, j * sw + b - left
                    if 0 <= h < H and 0 <= c < W:
                        out[a * sw + b, i, j] = src[h, c]
    return out.reshape(sh * sw, Hph * Wph)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_phases_equals_its_definition(dtype):
    """cpu_phases.split_phases (the NCHW depthwise kernels' phase planes) against its
    definition: strides 1-3 each way, even and odd left and top padding, widths whose rows
    are shorter than one block of 8 pairs, one block, several and a remainder, with even and
    odd source widths (rows of pairs only, or a last even column); planes contiguous and
    strided (a column slice). Only the values from src are written (the rest stays as the
    caller left it: zero)."""
    from numbafuse.kernels.conv.cpu_phases import merge_phases, split_phases
    rng = np.random.default_rng(5)
    for H, W in ((5, 7), (9, 16), (7, 28), (6, 33), (4, 41)):
        full = rng.standard_normal((H, W + 3)).astype(dtype)
        for src in (np.ascontiguousarray(full[:, :W]), full[:, 1:W + 1]):
            for sh in (1, 2, 3):
                for sw in (1, 2, 3):
                    for top, left in ((0, 0), (1, 3), (3, 2), (2, 1)):
                        Hph = (H + top) // sh + 2
                        Wph = (W + left) // sw + 3
                        want = _phases_reference(src, top, left, sh, sw, Wph, Hph)
                        got = np.zeros_like(want)
                        split_phases(src, top, left, sh, sw, Wph, got)
                        case = (H, W, src.flags.c_contiguous, sh, sw, top, left)
                        assert got.tobytes() == want.tobytes(), case
                        back = np.full_like(src, 7.0)       # the inverse: every value back
                        merge_phases(got, top, left, sh, sw, Wph, back)
                        assert back.tobytes() == src.tobytes(), case
