"""What a backend's kernel module of each op family provides: one Protocol per family.

``kernels.conv_kernels(which, groups)`` and ``kernels.batchnorm_kernels(which)`` return the
module of backend ``which`` ("cpu" or "cuda"); each such module implements its family's
Protocol in full (``tests/test_backends.py`` checks every name
and parameter list), so the ops call any of these functions without asking first. Where a
backend has no fused form of a step it says so in the function: ``ConvKernels.forward_stats``
returns None on a backend without the conv's batch-norm epilogue, and the op then makes the
statistics pass; ``BatchNormKernels.AFFINE_GATE`` is False where the backward cannot re-derive
the ReLU gate from x; ``ConvKernels.DX_ADDEND`` is False where ``conv_backward`` cannot add a
pending gradient into dx (then it takes no ``dx_addend`` and the tape adds).

Arrays are host NumPy arrays (cpu) or device arrays (cuda), C-contiguous in their layout;
``geom`` is a ``validate.ConvGeometry``.
"""
from typing import Protocol


class ConvKernels(Protocol):
    """``kernels/conv/cpu_first.py`` (what the ops call on the CPU), ``cpu.py``, ``cuda.py``
    and, for ``groups > 1``, ``cpu_grouped.py`` and
    ``cuda_grouped.py``."""

    DX_ADDEND: bool     # conv_backward takes ``dx_addend=`` (an array of x's shape and gy's
                        # dtype, contiguous, that dx is returned plus: the tape's sum of two
                        # gradients of x done by the dx epilogue); given only where True

    def conv_forward(self, x, w, b, geom, relu):
        """``y = relu?(conv(x, w) + b?)``; ``b`` None: no bias."""

    def conv_backward(self, gy, x, w, geom, y=None, need=(True, True, True)):
        """``(dx, dw, db)``, each None unless flagged in ``need``; ``y`` given: the gradient
        gated where y > 0 (the fused ReLU)."""

    def bias_add(self, x, b, layout):
        """``x + b`` over the channel axis (the unfused op)."""

    def channel_sum(self, gy, layout):
        """Per-channel sum of ``gy`` (the unfused bias gradient)."""

    def forward_stats(self, x, w, geom, eps):
        """``(h, mean, var, invstd)``: a bias-free conv with h's batch statistics made by the
        conv's own chunks, or None where this backend has no such epilogue for ``geom``."""

    def forward_bn_sums(self, x, w, geom, dy, mean, invstd, gamma, beta):
        """``(h, g, sums)``: the conv recomputed with pass 1 of the batch-norm backward made
        by its chunks, or None where this backend has no such epilogue for ``geom``."""

    def forward_scaled(self, x, w, values, geom, relu, z=None):
        """``relu?(scale[k] * conv(x, w) + shift[k] [+ z])`` with ``(scale, shift) =
        values()`` (inference batch norm, not folded into w; ``z`` of y's shape, a residual),
        or None where this backend's conv for ``geom`` has no such epilogue (``values`` then
        not called)."""


class BatchNormKernels(Protocol):
    """``kernels/batchnorm/cpu.py`` and ``cuda.py``."""

    AFFINE_GATE: bool   # backward takes STATE_AFFINE (the gate re-derived from x)

    def stats(self, x, layout, eps):
        """``(mean, var, invstd)`` float64 (C,); var biased."""

    def stats_update(self, x, layout, eps, running_mean, running_var, momentum):
        """:meth:`stats`, and the running statistics (None: none) updated in place."""

    def inference_stats(self, running_mean, running_var, eps):
        """``(mean, invstd)`` float64 (C,) of the running statistics."""

    def update_running(self, running_mean, running_var, mean, var, count, momentum):
        """PyTorch's running-statistics update, in place."""

    def apply(self, x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
        """``(y, mask or None)``: y = [relu](gamma * xhat + beta [+ z])."""

    def apply_running(self, x, running_mean, running_var, eps, gamma, beta, z, relu, layout,
                      want_mask):
        """Inference: ``(y, mask or None, mean, invstd)`` from the running statistics."""

    def backward(self, gy, x, mean, invstd, gamma, state_kind, state, layout, training, need,
                 sync=None, sums=None):
        """``(gx, ggamma, gbeta, gz)``, each None unless asked for in ``need``; ``sync``: the
        synchronized batch norm's merge of the per-rank sums; ``sums``: pass 1's sums made by
        the conv's epilogue (``ConvKernels.forward_bn_sums``), given only where that returned
        them."""


FAMILIES = {"conv": (ConvKernels, ("cpu_first", "cpu", "cuda", "cpu_grouped", "cuda_grouped")),
            "batchnorm": (BatchNormKernels, ("cpu", "cuda"))}
