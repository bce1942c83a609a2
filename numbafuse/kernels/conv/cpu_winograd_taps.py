"""The Winograd F(2x2, 3x3) filter transforms of ``cpu_winograd`` (see its docstring): the
taps U = G g G^T of every filter pair, forward and dX (flipped, transposed), and dW = G^T D G
from the transformed sums D."""
import numpy as np
from numba import njit

from ..cpu.transpose import transpose

# G (4, 3), the taps transform, in float64 (U and dw are formed in float64, then cast)
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


# filters per block of the forward taps: stored one k at a time, out[e, :, k] strides K
# elements a value (6.5 ms for 256 x 256 filters, 32 ms for 512 x 512, against 0.9 and 4.3
# for the dX's contiguous rows); 16 k transposed at a time write whole cache lines
_TAPS_BLOCK = 16
# input channels per block of the transform: its float64 rows stay in L1 (all C at once, and
# the 16 rows of G g G^T through a buffer, the dX taps of 512 x 512 filters took 8.6 ms; by
# blocks of 64 written straight out 5.0)
_TAPS_CHANNELS = 64


@njit(cache=True)
def winograd_taps(w, flip, out):
    """U = G g G^T for every filter pair, into ``out`` (16, A, B) in the GEMMs' orientation.

    w: (K, C, 3, 3). Forward (flip False): g[k, c] = w[k, c]; dX (flip True): g[c, k] =
    w[k, c, ::-1, ::-1], the flipped, transposed taps. out[e] is (Ci, Co).
    Formed in float64 (vectorised over c, G's rows are adds and halves), stored in out's dtype.
    """
    K, C = w.shape[0], w.shape[1]
    t = np.empty((4, 3, _TAPS_CHANNELS))                          # G g over c, one k
    ub = np.empty((16, _TAPS_BLOCK, C), out.dtype)                # forward: a block of k
    for k in range(K):
        kb = k % _TAPS_BLOCK
        for c0 in range(0, C, _TAPS_CHANNELS):
            n = min(_TAPS_CHANNELS, C - c0)
            for s in range(3):
                sc = 2 - s if flip else s
                a = w[k, c0:c0 + n, 2 if flip else 0, sc]
                b = w[k, c0:c0 + n, 1, sc]
                c = w[k, c0:c0 + n, 0 if flip else 2, sc]
                t0, t1, t2, t3 = t[0, s], t[1, s], t[2, s], t[3, s]   # rows of G g
                for i in range(n):
                    ai, bi, ci = np.float64(a[i]), np.float64(b[i]), np.float64(c[i])
                    t0[i] = ai
                    t1[i] = 0.5 * (ai + bi + ci)
                    t2[i] = 0.5 * (ai - bi + ci)
                    t3[i] = ci
            for x in range(4):                    # row e = 4x + y of G g G^T, stored as
                a, b, c = t[x, 0], t[x, 1], t[x, 2]   # out[e, k, :] (dX) or a block of k
                for y in range(4):
                    e = 4 * x + y
                    dst = out[e, k, c0:c0 + n] if flip else ub[e, kb, c0:c0 + n]
                    if y == 0:
                        for i in range(n):
                            dst[i] = a[i]
                    elif y == 1:
                        for i in range(n):
                            dst[i] = 0.5 * (a[i] + b[i] + c[i])
                    elif y == 2:
                        for i in range(n):
                            dst[i] = 0.5 * (a[i] - b[i] + c[i])
                    else:
                        for i in range(n):
                            dst[i] = c[i]
        # forward: out[e, :, k] through the block of k transposed (a store per k strides)
        if not flip and (kb == _TAPS_BLOCK - 1 or k == K - 1):
            for e in range(16):
                transpose(ub[e, :kb + 1], out[e, :, k - kb:k + 1])


@njit(cache=True)
def winograd_dw(D, dw):
    """dw (K, C, 3, 3) = G^T D G per filter pair, from D (16, K, C) (float64 sums)."""
    K, C = D.shape[1], D.shape[2]
    t = np.empty((3, 4))                                          # G^T D, one pair
    for k in range(K):
        for c in range(C):
            for r in range(3):
                for y in range(4):
                    acc = 0.0
                    for x in range(4):
                        acc += _G[x, r] * D[4 * x + y, k, c]
                    t[r, y] = acc
            for r in range(3):
                for s in range(3):
                    dw[k, c, r, s] = (t[r, 0] * _G[0, s] + t[r, 1] * _G[1, s]
                                      + t[r, 2] * _G[2, s] + t[r, 3] * _G[3, s])
