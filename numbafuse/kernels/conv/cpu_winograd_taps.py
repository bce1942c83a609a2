"""The Winograd F(2x2, 3x3) filter transforms of ``cpu_winograd`` (see its docstring): the
taps U = G g G^T of every filter pair, forward and dX (flipped, transposed), and dW = G^T D G
from the transformed sums D. Task kernels over blocks of filters (or input
channels), vectorised over the rows' inner axis; short ones run on the calling thread."""
import numpy as np

from ..cpu.launch import launch, task_kernel

# G (4, 3), the taps transform, in float64 (U and dw are formed in float64, then cast)
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


# filters (forward: input channels) per task. A task forms the 16 rows of U along the output's
# inner axis (forward: the K filters; dX: the C channels) and writes them whole: the earlier
# loop over k wrote the forward's out[e, :, k] through 16-filter block transposes on one
# thread, 131 us for 128 x 128 filters and 765 for 256 x 256 (now 103 and 226 alone; in a
# ResNet-18 step, beside the other thread's work, no change was measurable: 2-3 ms a step)
_BLOCK = 8
# values of a row transformed at a time (the float64 rows of G g stay in L1)
_SEG = 256
# taps (elements of U) from which the tasks are split over the threads; fewer run on the
# calling thread. In a fused ResNet-18 step, on PyTorch's team, the 64 x 64 and 128 x 128
# filters' taps took 111 and 200 us a call launched against 33 and 92 called (one run each,
# machine E): a short job's worker asks for the GIL while the caller holds it, sleeps, and
# the region's end waits for it to wake. 2^18 since 2026-12-02 (launches compiled, no GIL:
# machine A, PyTorch's team, us serial / split, warm and after a 64 MiB write: 64 x 64 26 /
# 23 and 90 / 94, 128 x 128 103 / 89 and 257 / 197, flipped alike; in the 64x64 step,
# alternating, taps_tasks 2.10 -> 1.65 ms a ResNet-18 step, dw_tasks 1.18 -> 0.91)
_PARALLEL_MIN = 1 << 18


@task_kernel
def taps_tasks(t0, t1, w, flip, out):
    # Task t: _BLOCK input channels (forward: out[e, c, :] over the K filters) or filters (dX:
    # out[e, k, :] over the C channels) of w (K, C, 3, 3). See winograd_taps. Per output row
    # i, G g a column s at a time (the taps read at w's stride: C*9 values forward, 9 dX),
    # then a row x of (G g) G^T at a time, four rows each, all along out's inner axis in
    # float64 (rows of _SEG values): written whole. (A transpose of w's block first, for
    # contiguous reads, took 1.6 s more to compile.)
    K, C = w.shape[0], w.shape[1]
    n = C if flip else K
    t = np.empty((4, 3, _SEG))
    for task in range(t0, t1):
        for i in range(task * _BLOCK, min(K if flip else C, (task + 1) * _BLOCK)):
            for j0 in range(0, n, _SEG):
                m = min(_SEG, n - j0)
                for s in range(3):
                    sc = 2 - s if flip else s
                    if flip:                                  # g[c] = w[i, c, ::-1, ::-1]
                        a = w[i, j0:j0 + m, 2, sc]
                        b = w[i, j0:j0 + m, 1, sc]
                        c = w[i, j0:j0 + m, 0, sc]
                    else:                                     # g[k] = w[k, i]
                        a = w[j0:j0 + m, i, 0, sc]
                        b = w[j0:j0 + m, i, 1, sc]
                        c = w[j0:j0 + m, i, 2, sc]
                    r0, r1, r2, r3 = t[0, s, :m], t[1, s, :m], t[2, s, :m], t[3, s, :m]
                    for q in range(m):                       # rows of G g
                        aq, bq, cq = np.float64(a[q]), np.float64(b[q]), np.float64(c[q])
                        r0[q] = aq
                        r1[q] = 0.5 * (aq + bq + cq)
                        r2[q] = 0.5 * (aq - bq + cq)
                        r3[q] = cq
                for x in range(4):                           # rows e = 4x + y of G g G^T
                    a, b, c = t[x, 0, :m], t[x, 1, :m], t[x, 2, :m]
                    d0, d1 = out[4 * x, i, j0:j0 + m], out[4 * x + 1, i, j0:j0 + m]
                    d2, d3 = out[4 * x + 2, i, j0:j0 + m], out[4 * x + 3, i, j0:j0 + m]
                    for q in range(m):
                        aq, bq, cq = a[q], b[q], c[q]
                        d0[q] = aq
                        d1[q] = 0.5 * (aq + bq + cq)
                        d2[q] = 0.5 * (aq - bq + cq)
                        d3[q] = cq


def winograd_taps(w, flip, out):
    """U = G g G^T for every filter pair, into ``out`` (16, A, B) in the GEMMs' orientation,
    the tasks split over the threads.

    w: (K, C, 3, 3). Forward (flip False): g[k, c] = w[k, c]; dX (flip True): g[c, k] =
    w[k, c, ::-1, ::-1], the flipped, transposed taps. out[e] is (Ci, Co): forward (C, K),
    dX (K, C). Formed in float64 (G's rows are adds and halves), stored in out's dtype.
    """
    w = np.ascontiguousarray(w)
    launch(taps_tasks, -(-(w.shape[0] if flip else w.shape[1]) // _BLOCK), w, bool(flip), out,
           work=out.size, grain=1, parallel_min=_PARALLEL_MIN)


@task_kernel
def dw_tasks(t0, t1, D, dw):
    # Task t: filters [t*_BLOCK, ...) of dw (K, C, 3, 3) = G^T D G per filter pair, D (16, K,
    # C) float64. G's entries are 1, 1/2, -1/2 and 0, so each pair's 21 sums are written out
    # (the products with 0 and 1 dropped): the same values as the sums over G's rows, term
    # by term in the same order (G's zeros add nothing, its ones and halves are exact), and
    # 2.9x faster than a loop over G (0.24 against 0.70 ms at 128 x 128, one thread; a
    # version through a (9, C) row buffer, for stores along c, 0.29)
    K, C = D.shape[1], D.shape[2]
    for task in range(t0, t1):
        for k in range(task * _BLOCK, min(K, (task + 1) * _BLOCK)):
            o = dw[k].reshape(C * 9)
            for c in range(C):
                d00, d01, d02, d03 = D[0, k, c], D[1, k, c], D[2, k, c], D[3, k, c]
                d10, d11, d12, d13 = D[4, k, c], D[5, k, c], D[6, k, c], D[7, k, c]
                d20, d21, d22, d23 = D[8, k, c], D[9, k, c], D[10, k, c], D[11, k, c]
                d30, d31, d32, d33 = D[12, k, c], D[13, k, c], D[14, k, c], D[15, k, c]
                # t = G^T D (3, 4), a row r at a time
                a0, a1 = (d00 + 0.5 * d10) + 0.5 * d20, (d01 + 0.5 * d11) + 0.5 * d21
                a2, a3 = (d02 + 0.5 * d12) + 0.5 * d22, (d03 + 0.5 * d13) + 0.5 * d23
                b0, b1 = 0.5 * d10 - 0.5 * d20, 0.5 * d11 - 0.5 * d21
                b2, b3 = 0.5 * d12 - 0.5 * d22, 0.5 * d13 - 0.5 * d23
                e0, e1 = (0.5 * d10 + 0.5 * d20) + d30, (0.5 * d11 + 0.5 * d21) + d31
                e2, e3 = (0.5 * d12 + 0.5 * d22) + d32, (0.5 * d13 + 0.5 * d23) + d33
                j = 9 * c                                            # dw[k, c] = t G
                o[j] = (a0 + 0.5 * a1) + 0.5 * a2
                o[j + 1] = 0.5 * a1 - 0.5 * a2
                o[j + 2] = (0.5 * a1 + 0.5 * a2) + a3
                o[j + 3] = (b0 + 0.5 * b1) + 0.5 * b2
                o[j + 4] = 0.5 * b1 - 0.5 * b2
                o[j + 5] = (0.5 * b1 + 0.5 * b2) + b3
                o[j + 6] = (e0 + 0.5 * e1) + 0.5 * e2
                o[j + 7] = 0.5 * e1 - 0.5 * e2
                o[j + 8] = (0.5 * e1 + 0.5 * e2) + e3


def winograd_dw(D, dw):
    """dw (K, C, 3, 3) = G^T D G per filter pair, from D (16, K, C), the float64 sums of the
    dW tasks' groups (``cpu_chunks.sum_groups``), the tasks split over the threads from
    _PARALLEL_MIN values of D. It had been a loop per filter pair holding the GIL: 1.1 ms of
    a fused ResNet-18 training step on one thread (py-spy)."""
    launch(dw_tasks, -(-D.shape[1] // _BLOCK), D, dw, work=D.size, grain=1,
           parallel_min=_PARALLEL_MIN)
