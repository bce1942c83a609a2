"""The Winograd F(2x2, 3x3) filter transforms of ``cpu_winograd`` (see its docstring): the
taps U = G g G^T of every filter pair, forward and dX (flipped, transposed), and dW = G^T D G
from the groups' partial transformed sums D. Task kernels over blocks of filters (or input
channels), vectorised over the rows' inner axis; short ones run on the calling thread."""
import numpy as np
from numba import njit

from ..cpu.launch import launch, task_kernel
from ..cpu.transpose import transpose

# G (4, 3), the taps transform, in float64 (U and dw are formed in float64, then cast)
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


# filters (forward: input channels) per task. A task transposes its block of w so that each
# tap is a row over the output's inner axis (forward: the K filters; dX: the C channels), then
# forms the 16 rows of U from those rows and writes them whole: the earlier loop over k wrote
# the forward's out[e, :, k] through 16-filter block transposes and ran on one thread, 131 us
# for 128 x 128 filters and 765 for 256 x 256 (5.5-8 GB/s written), 3.1 ms of a fused
# ResNet-18 training step (21 calls: the forward's, the recompute's and dX's taps of 7 convs)
_BLOCK = 8
# values of a row transformed at a time (the float64 rows of G g stay in L1)
_SEG = 256
# taps (elements of U) from which the tasks are split over the threads; fewer run on the
# calling thread. In a fused ResNet-18 step, on PyTorch's team, the 64 x 64 and 128 x 128
# filters' taps took 111 and 200 us a call launched against 33 and 92 called (one run each,
# machine E): a short job's worker asks for the GIL while the caller holds it, sleeps, and
# the region's end waits for it to wake
_PARALLEL_MIN = 1 << 20


@njit(nogil=True, cache=True)
def _transform(g, flip, out, i, t):
    """out[e, i, :] = (G g G^T)[e] for the 3x3 taps g (9, n), rows r*3 + s, each a vector over
    out's inner axis (flip: the taps g[2 - r, 2 - s]). Formed in float64, stored in out's
    dtype; t: a (4, 3, _SEG) float64 buffer."""
    n = g.shape[1]
    for j0 in range(0, n, _SEG):
        m = min(_SEG, n - j0)
        for s in range(3):
            sc = 2 - s if flip else s
            a = g[(2 if flip else 0) * 3 + sc, j0:j0 + m]
            b = g[3 + sc, j0:j0 + m]
            c = g[(0 if flip else 2) * 3 + sc, j0:j0 + m]
            t0, t1, t2, t3 = t[0, s, :m], t[1, s, :m], t[2, s, :m], t[3, s, :m]  # rows of G g
            for q in range(m):
                aq, bq, cq = np.float64(a[q]), np.float64(b[q]), np.float64(c[q])
                t0[q] = aq
                t1[q] = 0.5 * (aq + bq + cq)
                t2[q] = 0.5 * (aq - bq + cq)
                t3[q] = cq
        for x in range(4):                        # row e = 4x + y of G g G^T
            a, b, c = t[x, 0, :m], t[x, 1, :m], t[x, 2, :m]
            for y in range(4):
                dst = out[4 * x + y, i, j0:j0 + m]
                if y == 0:
                    for q in range(m):
                        dst[q] = a[q]
                elif y == 1:
                    for q in range(m):
                        dst[q] = 0.5 * (a[q] + b[q] + c[q])
                elif y == 2:
                    for q in range(m):
                        dst[q] = 0.5 * (a[q] - b[q] + c[q])
                else:
                    for q in range(m):
                        dst[q] = c[q]


@task_kernel
def taps_tasks(t0, t1, w, flip, out):
    # Task t: _BLOCK input channels (forward: out[e, c, :] over the K filters) or filters (dX:
    # out[e, k, :] over the C channels) of w (K, C, 3, 3), contiguous. See winograd_taps.
    K, C = w.shape[0], w.shape[1]
    t = np.empty((4, 3, _SEG))
    if flip:
        g = np.empty((9, C), w.dtype)
        for task in range(t0, t1):
            for k in range(task * _BLOCK, min(K, (task + 1) * _BLOCK)):
                transpose(w[k].reshape((C, 9)), g)                    # (C, 9) -> (9, C)
                _transform(g, True, out, k, t)
    else:
        w2 = w.reshape((K, C * 9))
        gb = np.empty((_BLOCK * 9, K), w.dtype)
        for task in range(t0, t1):
            c0 = task * _BLOCK
            cb = min(C, c0 + _BLOCK) - c0
            transpose(w2[:, c0 * 9:(c0 + cb) * 9], gb[:cb * 9])       # (K, 9cb) -> (9cb, K)
            for j in range(cb):
                _transform(gb[j * 9:(j + 1) * 9], False, out, c0 + j, t)


def winograd_taps(w, flip, out):
    """U = G g G^T for every filter pair, into ``out`` (16, A, B) in the GEMMs' orientation,
    the tasks split over the threads.

    w: (K, C, 3, 3). Forward (flip False): g[k, c] = w[k, c]; dX (flip True): g[c, k] =
    w[k, c, ::-1, ::-1], the flipped, transposed taps. out[e] is (Ci, Co): forward (C, K),
    dX (K, C). Formed in float64 (G's rows are adds and halves), stored in out's dtype.
    """
    w = np.ascontiguousarray(w)
    tasks = -(-(w.shape[0] if flip else w.shape[1]) // _BLOCK)
    if out.size < _PARALLEL_MIN:
        taps_tasks(0, tasks, w, bool(flip), out)
    else:
        launch(taps_tasks, tasks, w, bool(flip), out, grain=1)


@task_kernel
def dw_tasks(t0, t1, parts, dw):
    # Task t: filters [t*_BLOCK, ...) of dw (K, C, 3, 3) = G^T D G per filter pair, D (16, K,
    # C) the sum of parts (G, 16, K, C) over the groups in group order, in float64 (one row
    # D[:, k, :] at a time, vectorised over c; dw[k] through a (9, C) -> (C, 9) transpose)
    groups, K, C = parts.shape[0], parts.shape[2], parts.shape[3]
    d = np.empty((16, C))
    t = np.empty((3, 4, C))
    o = np.empty((9, C), dw.dtype)
    for task in range(t0, t1):
        for k in range(task * _BLOCK, min(K, (task + 1) * _BLOCK)):
            for e in range(16):
                de, src = d[e], parts[0, e, k]
                for c in range(C):
                    de[c] = src[c]
                for g in range(1, groups):
                    src = parts[g, e, k]
                    for c in range(C):
                        de[c] += src[c]
            for r in range(3):                    # G^T D
                for y in range(4):
                    tr = t[r, y]
                    for c in range(C):
                        tr[c] = 0.0
                    for x in range(4):
                        gx, dxy = _G[x, r], d[4 * x + y]
                        for c in range(C):
                            tr[c] += gx * dxy[c]
            for r in range(3):                    # (G^T D) G
                a, b, c_, e_ = t[r, 0], t[r, 1], t[r, 2], t[r, 3]
                for s_ in range(3):
                    g0, g1, g2, g3 = _G[0, s_], _G[1, s_], _G[2, s_], _G[3, s_]
                    orow = o[3 * r + s_]
                    for c in range(C):
                        orow[c] = a[c] * g0 + b[c] * g1 + c_[c] * g2 + e_[c] * g3
            transpose(o, dw[k].reshape((C, 9)))


def winograd_dw(parts, dw):
    """dw (K, C, 3, 3) = G^T D G per filter pair, D the float64 sum of ``parts`` (G, 16, K,
    C) over its groups in group order (the dW tasks' partial transformed sums), the tasks
    split over the threads from _PARALLEL_MIN partial values. It had been a sum over the
    groups into a float64 D (a launch), then a loop per filter pair holding the GIL: 1.1 ms
    of a fused ResNet-18 training step on one thread (py-spy)."""
    tasks = -(-parts.shape[2] // _BLOCK)
    if parts.size < _PARALLEL_MIN:
        dw_tasks(0, tasks, parts, dw)
    else:
        launch(dw_tasks, tasks, parts, dw, grain=1)
