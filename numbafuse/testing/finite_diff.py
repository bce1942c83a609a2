"""Finite-difference checks of the tape, in float64.

Two modes (after HIPS autograd's check): ``"full"`` perturbs every input element and compares
each partial derivative; ``"directional"`` compares one scalar two ways, ``<u, J v>`` from the
tape (``u`` a random output cotangent, ``v`` a random input direction) against the central
difference of ``<u, f(x + eps v)>`` - cheap enough for property tests on large inputs.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..autograd import Tensor, no_grad

FULL_MAX_ELEMENTS = 64   # "auto" uses the full check up to this many input elements
EPS = 1e-6               # central-difference step (float64)
RTOL = 1e-6
ATOL = 1e-8


class GradcheckError(AssertionError):
    """The tape's gradient disagrees with finite differences."""


def _to_backend(a, device):
    return backend.to_device(a) if device == backend.CUDA else a


def _evaluate(fn, values, devices, mask):
    """fn's output, as a float64 host array, at host ``values`` (no tape)."""
    args = [Tensor(_to_backend(v, d)) if m else v for v, d, m in zip(values, devices, mask)]
    with no_grad():
        out = fn(*args)
    return backend.to_host(out.data if isinstance(out, Tensor) else out).astype(np.float64)


def gradcheck(fn, inputs, *, eps=EPS, rtol=RTOL, atol=ATOL, mode="auto", directions=3, seed=0):
    """Check the tape's gradients of ``fn`` against central finite differences, in float64.

    Parameters
    ----------
    fn : callable
        Takes the ``inputs`` (Tensors where differentiated) and returns one Tensor.
    inputs : sequence
        Tensors (differentiated when ``requires_grad``) and anything else (passed through).
        Floating Tensors are converted to float64; device Tensors stay on the device.
    mode : {"auto", "full", "directional"}
        ``auto`` is ``full`` up to ``FULL_MAX_ELEMENTS`` differentiated elements.
    directions : int
        Random directions tried in ``directional`` mode.

    Returns
    -------
    True, or raises :class:`GradcheckError` naming the input and the mismatch.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x = nf.Tensor(np.array([0.5, -1.0, 2.0]), requires_grad=True)
    >>> nf.gradcheck(lambda t: (t * t).sum(), [x])
    True
    """
    rng = np.random.default_rng(seed)
    mask = [isinstance(i, Tensor) and i.requires_grad for i in inputs]
    if not any(mask):
        raise ValueError("gradcheck: no input is a Tensor with requires_grad=True")
    devices = [i.device if isinstance(i, Tensor) else None for i in inputs]
    values = [i.numpy().astype(np.float64) if m else i for i, m in zip(inputs, mask)]

    def tape_vjp(u):
        leaves = [Tensor(_to_backend(v.copy(), d), requires_grad=True) if m else v
                  for v, d, m in zip(values, devices, mask)]
        out = fn(*leaves)
        if not isinstance(out, Tensor):
            raise TypeError("gradcheck: fn must return a Tensor")
        out.backward(_to_backend(u.astype(out.dtype), out.device))
        return [(backend.to_host(t.grad) if t.grad is not None else np.zeros(t.shape))
                if m else None for t, m in zip(leaves, mask)]

    y0 = _evaluate(fn, values, devices, mask)
    n_elements = sum(v.size for v, m in zip(values, mask) if m)
    if mode == "auto":
        mode = "full" if n_elements <= FULL_MAX_ELEMENTS else "directional"

    def f_dot(u, k, direction, step):
        shifted = list(values)
        shifted[k] = values[k] + step * direction
        return float(np.sum(u * _evaluate(fn, shifted, devices, mask)))

    if mode == "full":
        u = rng.standard_normal(y0.shape)
        grads = tape_vjp(u)
        for k, m in enumerate(mask):
            if not m:
                continue
            numeric = np.zeros(values[k].shape)
            for idx in np.ndindex(values[k].shape):
                e = np.zeros(values[k].shape)
                e[idx] = 1.0
                numeric[idx] = (f_dot(u, k, e, eps) - f_dot(u, k, e, -eps)) / (2 * eps)
            if not np.allclose(grads[k], numeric, rtol=rtol, atol=atol):
                worst = np.unravel_index(np.argmax(np.abs(grads[k] - numeric)), numeric.shape)
                raise GradcheckError(
                    f"gradcheck: input {k}: tape gradient {grads[k][worst]:.8g} vs finite "
                    f"difference {numeric[worst]:.8g} at index {worst}")
        return True
    if mode != "directional":
        raise ValueError(f"gradcheck: mode must be 'auto', 'full' or 'directional', got {mode!r}")
    for _ in range(directions):
        u = rng.standard_normal(y0.shape)
        grads = tape_vjp(u)
        for k, m in enumerate(mask):
            if not m:
                continue
            v = rng.standard_normal(values[k].shape)
            analytic = float(np.sum(grads[k] * v))
            numeric = (f_dot(u, k, v, eps) - f_dot(u, k, v, -eps)) / (2 * eps)
            if not np.isclose(analytic, numeric, rtol=rtol, atol=atol * max(1.0, np.sqrt(v.size))):
                raise GradcheckError(
                    f"gradcheck: input {k}: <u, J v> by the tape is {analytic:.10g}, by finite "
                    f"differences {numeric:.10g}")
    return True
