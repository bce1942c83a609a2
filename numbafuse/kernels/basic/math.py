"""Scalar math of the unfused basic ops, shared by the CPU and the CUDA kernels.

Plain Python (no decorators): ``kernels/basic/cpu.py`` wraps these with
``scalar.cpu_scalar``, ``kernels/basic/cuda.py`` with ``scalar.cuda_scalar``.
"""
import math


def first_max_tap(x, start, kh, kw, s_h, s_w):
    """Row-major tap ``t = r * kw + s`` in ``[0, kh*kw)`` of the FIRST maximum of the kh x kw
    window of ``x`` at flat offset ``start``; the maximum is at ``start + r*s_h + s*s_w``.

    ``s_h``/``s_w`` are the element strides of a window row/column. A NaN wins over numbers
    and the first NaN is kept (``np.argmax`` semantics), so a window holding a NaN pools to
    NaN, as in PyTorch, and its gradient goes to that first NaN.
    """
    best_t = 0
    best = x[start]
    for r in range(kh):
        for s in range(kw):
            v = x[start + r * s_h + s * s_w]
            if best == best and (v > best or v != v):  # best not NaN, and v larger or NaN
                best = v
                best_t = r * kw + s
    return best_t


def row_logsumexp(logits, n, L):
    """log(sum_j exp(logits[n, j])), stable: shifted by the row max. Accumulates in float64."""
    m = logits[n, 0]
    for j in range(1, L):
        if logits[n, j] > m:
            m = logits[n, j]
    acc = 0.0
    for j in range(L):
        acc += math.exp(logits[n, j] - m)
    return m + math.log(acc)


def xent_grad(logit, lse, is_target, scale):
    """d loss / d logit = scale * (softmax - onehot), softmax = exp(logit - lse)."""
    return scale * (math.exp(logit - lse) - (1.0 if is_target else 0.0))
