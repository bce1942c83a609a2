"""Host/device dispatch, dtype and layout validation, and convolution geometry.

Every public op calls into this module before any kernel runs, so that bad input is refused
with a message naming the op and the argument, *before* anything is written (running
statistics included).

Notation used in shape comments across the package:

    N batch, C input channels, H/W input height/width, K output channels,
    R/S filter height/width, P/Q output height/width, M = N*P*Q (or N*H*W for batch norm).
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
LAYOUTS = ("NCHW", "NHWC")

CPU = "cpu"
CUDA = "cuda"


# --------------------------------------------------------------------------- host / device

def is_device_array(a) -> bool:
    """True for numba device arrays (real or simulated) and ``__cuda_array_interface__`` objects."""
    return bool(getattr(a, "__cuda_ndarray__", False)) or hasattr(a, "__cuda_array_interface__")


def _cuda():
    from . import cuda  # the CUDA backend, imported lazily: the CPU path never needs numba-cuda

    return cuda


def as_device_array(a):
    """A numba device array viewing ``a`` (zero-copy for ``__cuda_array_interface__`` objects)."""
    if getattr(a, "__cuda_ndarray__", False):
        return a
    return _cuda().as_device_array(a)


def data(a):
    """A ``Tensor``'s array (its ``.data``); anything else (an array, ``None``) as it is.

    Public functions call it on every array argument that is not a tape input (running
    statistics, the arrays of NumPy-style backwards, batch-norm folding), so a Tensor is
    accepted wherever an array is. Tape inputs are left to ``Function.apply``, which unwraps
    them itself and records the op.
    """
    from .autograd import Tensor  # lazily: autograd imports this module

    return a.data if isinstance(a, Tensor) else a


def backend_of(op: str, **arrays) -> str:
    """``"cpu"`` or ``"cuda"`` for the arrays of one call (``None`` entries are ignored).

    Raises ``TypeError`` when host and device arrays are mixed or an argument is not an array.
    """
    host, device = [], []
    for name, a in arrays.items():
        if a is None:
            continue
        if is_device_array(a):
            device.append(name)
        elif isinstance(a, np.ndarray):
            host.append(name)
        else:
            raise TypeError(
                f"{op}: {name} must be a NumPy array or a CUDA array, got {type(a).__name__}")
    if host and device:
        raise TypeError(
            f"{op}: cannot mix host and device arrays ({', '.join(host)} on the host, "
            f"{', '.join(device)} on the device)")
    return CUDA if device else CPU


def backend_of_array(a) -> str:
    """The backend of one array already validated by :func:`backend_of`."""
    return CPU if isinstance(a, np.ndarray) else CUDA


def kernels(family: str, backend: str):
    """The kernel module of an op family on ``backend``: ``numbafuse.kernels.cpu.<family>``
    or ``numbafuse.kernels.cuda.<family>`` (the same function names on both; the CUDA one is
    imported only when a device array comes, so CPU users never need numba-cuda).
    """
    return importlib.import_module(f"{__package__}.kernels.{backend}.{family}")


def to_host(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    return _cuda().to_host(a)


def to_device(a):
    if is_device_array(a):
        return as_device_array(a)
    return _cuda().to_device(_host_contiguous(np.asarray(a)))


def _host_contiguous(a: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray would turn a 0-d array into a 1-d one
    return a if a.flags.c_contiguous else np.array(a, order="C")


# --------------------------------------------------------------------------- dtype / rank

def check_float_dtypes(op: str, **arrays) -> np.dtype:
    """The one floating dtype (float32 or float64) shared by all non-``None`` arrays."""
    dtype, first = None, None
    for name, a in arrays.items():
        if a is None:
            continue
        dt = np.dtype(a.dtype)
        if dt not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32 or float64, got {dt}")
        if dtype is None:
            dtype, first = dt, name
        elif dt != dtype:
            raise TypeError(f"{op}: {name} is {dt} but {first} is {dtype}; "
                            f"all floating inputs of one call must share one dtype")
    return dtype


def check_ndim(op: str, name: str, a, ndim: int, what: str = "") -> None:
    if len(a.shape) != ndim:
        hint = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} must have {ndim} dimensions{hint}, got shape {tuple(a.shape)}")


def check_vector(op: str, name: str, a, length: int) -> None:
    """A per-channel vector of ``length`` values (``None`` passes)."""
    if a is None:
        return
    if len(a.shape) != 1 or a.shape[0] != length:
        raise ValueError(f"{op}: {name} must have shape ({length},), got {tuple(a.shape)}")


def check_same_shape(op: str, name: str, a, ref_name: str, ref) -> None:
    if tuple(a.shape) != tuple(ref.shape):
        raise ValueError(f"{op}: {name} has shape {tuple(a.shape)} but {ref_name} has shape "
                         f"{tuple(ref.shape)}")


def check_layout(op: str, layout) -> str:
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        raise ValueError(f"{op}: layout must be 'NCHW' or 'NHWC', got {layout!r}")
    return layout.upper()


def channel_axis(layout: str) -> int:
    return 1 if layout == "NCHW" else 3


def activation_shape(layout: str, N: int, C: int, H: int, W: int) -> tuple:
    """The shape of an (N, C, H, W) activation stored in ``layout``."""
    return (N, C, H, W) if layout == "NCHW" else (N, H, W, C)


def activation_dims(op: str, x, layout: str) -> tuple:
    """(N, C, H, W) of the 4-d activation ``x`` stored in ``layout``."""
    check_ndim(op, "x", x, 4, layout)
    N, A, B, D = x.shape
    return (N, A, B, D) if layout == "NCHW" else (N, D, A, B)


def check_scalar(op: str, name: str, value, lo=None, hi=None, lo_open=False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be a real number, got {value!r}") from None
    if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (
            hi is not None and v > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        bracket = "(" if lo_open else "["
        raise ValueError(f"{op}: {name} must lie in {bracket}{lo_s}, {hi_s}], got {value!r}")
    return v


def check_flag(op: str, name: str, value) -> bool:
    """A True/False argument (a string such as "no" is refused, not read as True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be True or False, got {value!r}")
    return bool(value)


# --------------------------------------------------------------------------- contiguity

def contiguous(a):
    """``a`` as a C-contiguous array on its own device (one copy at most)."""
    if isinstance(a, np.ndarray):
        return _host_contiguous(a)
    d = as_device_array(a)
    if d.is_c_contiguous():
        return d
    from .kernels.cuda.elementwise import contiguous_copy

    return contiguous_copy(d)


# --------------------------------------------------------------------------- geometry

def pair(op: str, name: str, value, minimum: int) -> tuple:
    """``value`` (an int or an ``(h, w)`` pair) as a pair of ints ``>= minimum``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        v = (int(value), int(value))
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in value):
        v = (int(value[0]), int(value[1]))
    else:
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
    if min(v) < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value!r}")
    return v


@dataclass(frozen=True)
class ConvGeometry:
    """Everything a convolution kernel needs to know about its shapes.

    Padding is stored as top/left (``ph``, ``pw``) and bottom/right (``ph_end``, ``pw_end``):
    "same" padding can be asymmetric. Kernels only need the top/left pad and ``P``, ``Q``;
    anything read past the bottom/right edge is a zero of the padding.
    """
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    P: int
    Q: int
    sh: int
    sw: int
    ph: int
    pw: int
    ph_end: int
    pw_end: int
    dh: int
    dw: int
    layout: str

    @property
    def x_shape(self):
        return activation_shape(self.layout, self.N, self.C, self.H, self.W)

    @property
    def y_shape(self):
        return activation_shape(self.layout, self.N, self.K, self.P, self.Q)

    @property
    def w_shape(self):
        return (self.K, self.C, self.R, self.S)

    @property
    def flops(self) -> int:
        """Multiply-adds times two of the forward convolution."""
        return 2 * self.N * self.K * self.P * self.Q * self.C * self.R * self.S


def _resolve_padding(op, padding, size, k, stride, dilation):
    """Per-dimension (begin, end) padding for one spatial dimension."""
    extent = dilation * (k - 1) + 1
    if padding == "valid":
        return 0, 0
    if padding == "same":
        # TensorFlow's rule: output = ceil(size / stride); extra padding goes to the end.
        out = -(-size // stride)
        total = max((out - 1) * stride + extent - size, 0)
        return total // 2, total - total // 2
    raise AssertionError(padding)


def conv_geometry(op: str, x_shape, w_shape, stride=1, padding=0, dilation=1,
                  layout="NCHW") -> ConvGeometry:
    """Validate conv arguments and compute the output geometry.

    ``x_shape`` is 4-d in ``layout``; ``w_shape`` is ``(K, C, R, S)``.
    """
    layout = check_layout(op, layout)
    if len(x_shape) != 4:
        raise ValueError(f"{op}: x must have 4 dimensions ({layout}), got shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        raise ValueError(f"{op}: w must have 4 dimensions (K, C, R, S), got shape {tuple(w_shape)}")
    if layout == "NCHW":
        N, C, H, W = x_shape
    else:
        N, H, W, C = x_shape
    K, Cw, R, S = w_shape
    if Cw != C:
        raise ValueError(f"{op}: w has {Cw} input channels, x has {C}")
    if min(N, C, H, W) < 1:
        raise ValueError(f"{op}: x must have no empty dimension, got shape {tuple(x_shape)}")
    if min(K, R, S) < 1:
        raise ValueError(f"{op}: w must have no empty dimension, got shape {tuple(w_shape)}")
    sh, sw = pair(op, "stride", stride, 1)
    dh, dw = pair(op, "dilation", dilation, 1)
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"{op}: padding must be an int, a pair, 'valid' or 'same', "
                             f"got {padding!r}")
        ph, ph_end = _resolve_padding(op, padding, H, R, sh, dh)
        pw, pw_end = _resolve_padding(op, padding, W, S, sw, dw)
    else:
        ph, pw = pair(op, "padding", padding, 0)
        ph_end, pw_end = ph, pw
    P = (H + ph + ph_end - dh * (R - 1) - 1) // sh + 1
    Q = (W + pw + pw_end - dw * (S - 1) - 1) // sw + 1
    if P < 1 or Q < 1:
        raise ValueError(
            f"{op}: output size would be {P}x{Q} (< 1): input {H}x{W}, filter {R}x{S}, "
            f"stride {(sh, sw)}, padding {(ph, pw)}, dilation {(dh, dw)}")
    return ConvGeometry(N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, ph_end, pw_end, dh, dw,
                        layout)


# --------------------------------------------------------------------------- allocation

def copy(a):
    """A fresh copy of ``a`` on its own device."""
    if isinstance(a, np.ndarray):
        return a.copy()
    out = _cuda().device_array(a.shape, a.dtype)
    out.copy_to_device(as_device_array(a))
    return out


def empty_like_backend(backend: str, shape, dtype):
    if backend == CPU:
        return np.empty(shape, dtype)
    return _cuda().device_array(shape, dtype)


def zeros(backend: str, shape, dtype):
    if backend == CPU:
        return np.zeros(shape, dtype)
    from .kernels.cuda.elementwise import fill

    out = _cuda().device_array(shape, dtype)
    fill(out, 0.0)
    return out
