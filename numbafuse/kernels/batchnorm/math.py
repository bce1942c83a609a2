r"""Scalar math of batch norm (-> add -> ReLU), shared by the CPU and the CUDA kernels.

Plain Python, no decorators: ``kernels/batchnorm/cpu.py`` wraps these with
:func:`numbafuse.kernels.scalar.cpu_scalar`, ``kernels/batchnorm/cuda.py`` with
:func:`~numbafuse.kernels.scalar.cuda_scalar`. Every per-channel quantity (mean, invstd, the
backward coefficients) is float64. The CUDA kernels evaluate the per-element formulas in
float64 too, rounding once on the store (``x - mean`` is where a float32 computation would lose
the digits when channel means are large compared with their spread). The CPU kernels call the
same functions with arguments in x's dtype (twice the SIMD width for float32) and keep the
digits by splitting the mean: ``normalize_affine(x - mean_hi, mean_lo, scale, beta)`` and
``input_grad(g, x - mean_hi, mean_lo, ...)``, where ``mean = mean_hi + mean_lo`` and
``x - mean_hi`` is exact near the mean (Sterbenz).

Statistics are accumulated *shifted*: with ``shift`` one value of the channel,
``s1 = sum(x - shift)`` and ``s2 = sum((x - shift)**2)`` in float64, so the single-pass
variance ``(s2 - s1**2/M)/M`` does not cancel catastrophically when ``|mean| >> std``.
"""
import math

# The ReLU state a backward reads (``state_kind``), shared by the CPU and CUDA kernels and the
# ops layer: none (plain batch norm), the forward output y (open where y > 0), the packed
# 1-bit mask (bit ``j % 8`` of byte ``j // 8`` is set where the flat element j of y is > 0),
# or (CPU kernels only, no add) beta: the gate is re-derived from x itself, open where
# normalize_affine(x, mean, scale, beta) > 0, computed as the forward computed it (so the
# same bits decide), and no y is kept or rebuilt (Conv-BatchNorm-ReLU's recompute).
STATE_NONE, STATE_Y, STATE_MASK, STATE_AFFINE = 0, 1, 2, 3
BITS = 8                 # mask bits per byte


def mask_nbytes(size):
    """Bytes of the packed ReLU mask of ``size`` elements: ceil(size / 8)."""
    return -(-int(size) // BITS)


def finalize_mean(s1, shift, count):
    """Batch mean from the shifted sum ``s1 = sum(x - shift)`` over ``count`` values."""
    return shift + s1 / count


def finalize_var(s1, s2, count):
    """Biased batch variance from shifted sums; clamped at 0 against rounding."""
    var = (s2 - s1 * (s1 / count)) / count
    if var < 0.0:
        return 0.0
    return var


def invstd_of(var, eps):
    """1 / sqrt(var + eps)."""
    return 1.0 / math.sqrt(var + eps)


def unbiased_var(var, count):
    """var * M / (M - 1): the variance PyTorch feeds to the running statistics."""
    return var * count / (count - 1.0)


def running_update(running, batch, momentum):
    """PyTorch's running-statistics rule: (1 - m) * running + m * batch."""
    return (1.0 - momentum) * running + momentum * batch


def normalize_affine(x, mean, scale, beta):
    """gamma * xhat + beta with ``scale = gamma * invstd``: (x - mean) * scale + beta."""
    return (x - mean) * scale + beta


def mask_bit(mask_byte, j):
    """Bit ``j % 8`` of a packed ReLU mask byte: 1 where the forward output was > 0."""
    return (mask_byte >> (j & 7)) & 1


def gate(gy, open_):
    """The ReLU gate of the backward: ``g = gy`` where the ReLU was open, else 0."""
    if open_:
        return gy
    return 0.0


def coef_g(gamma, invstd):
    """dx = coef_g * g + coef_x * (x - mean) + coef_0; coef_g = gamma * invstd."""
    return gamma * invstd


def coef_x(gamma, invstd, ggamma, count, training):
    """coef_x = -gamma * invstd**2 * ggamma / M in training (the xhat * ggamma term), else 0."""
    if training:
        return -gamma * invstd * invstd * ggamma / count
    return 0.0


def coef_0(gamma, invstd, gbeta, count, training):
    """coef_0 = -gamma * invstd * gbeta / M in training (the mean's share of g), else 0."""
    if training:
        return -gamma * invstd * gbeta / count
    return 0.0


def input_grad(g, x, mean, cg, cx, c0):
    """dx = gamma*invstd/M * (M g - gbeta - xhat ggamma), written as cg*g + cx*(x - mean) + c0."""
    return cg * g + cx * (x - mean) + c0
