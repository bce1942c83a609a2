"""Argument checks and geometry: pure functions, each error naming the op and the argument.

Every public op calls into this module before any kernel runs, so bad input is refused with a
message such as ``conv_bias_relu: w has 5 input channels, x has 3`` *before* anything is
written (running statistics included).

Notation used in shape comments across the package:

    N batch, C input channels, H/W input height/width, K output channels,
    R/S filter height/width, P/Q output height/width, M = N*P*Q (or N*H*W for batch norm).
"""
from __future__ import annotations

import functools
import math
import types
import dataclasses
from dataclasses import dataclass

import numpy as np

from . import backend

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
LAYOUTS = ("NCHW", "NHWC")


def _half_dtypes():
    """float16, and bfloat16 where NumPy has it (``ml_dtypes``, optional: never required)."""
    found = [np.dtype(np.float16)]
    try:
        import ml_dtypes
    except ImportError:
        return tuple(found)
    return (*found, np.dtype(ml_dtypes.bfloat16))


HALF_DTYPES = _half_dtypes()
"""The half-precision storage dtypes: float16, plus bfloat16 when ``ml_dtypes`` is importable.
Ops that take them compute in :data:`COMPUTE_DTYPE` (see :func:`compute_dtype`)."""
COMPUTE_DTYPE = np.dtype(np.float32)


def is_half(dtype) -> bool:
    """Whether ``dtype`` is a half-precision storage dtype (:data:`HALF_DTYPES`)."""
    return dtype is not None and np.dtype(dtype) in HALF_DTYPES


def compute_dtype(dtype) -> np.dtype:
    """The dtype the kernels compute a ``dtype`` call in: float32 for a half dtype (float32
    accumulation, as cuDNN and PyTorch autocast), else ``dtype`` itself."""
    return COMPUTE_DTYPE if is_half(dtype) else np.dtype(dtype)


def _dtype_names(dtypes) -> str:
    names = [str(d) for d in dtypes]
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


# --------------------------------------------------------------------------- dtype / rank / values

def check_float_dtypes(op: str, *, half: bool = False, **arrays) -> np.dtype:
    """The one floating dtype shared by all non-``None`` arrays: float32 or float64, and
    with ``half`` (the ops that take half precision) also :data:`HALF_DTYPES`."""
    allowed = HALF_DTYPES + FLOAT_DTYPES if half else FLOAT_DTYPES
    dtype, first = None, None
    for name, a in arrays.items():
        if a is None:
            continue
        dt = np.dtype(a.dtype)
        if dt not in allowed:
            raise TypeError(f"{op}: {name} must be {_dtype_names(allowed)}, got {dt}")
        if dtype is None:
            dtype, first = dt, name
        elif dt != dtype:
            raise TypeError(f"{op}: {name} is {dt} but {first} is {dtype}; "
                            f"all floating inputs of one call must share one dtype")
    return dtype


def check_param_dtypes(op: str, dtype, **params) -> np.dtype:
    """The dtype of a batch norm's parameters (gamma, beta, running statistics; ``None``
    entries skipped) for an input of ``dtype``: all one dtype, ``dtype`` itself or, for a
    half ``dtype``, float32 (PyTorch's rule, CPU and CUDA alike: a float16 or bfloat16 x
    takes float32 or same-dtype parameters; float32 and float64 inputs take their own dtype
    only). Returns ``dtype`` when no parameter is given."""
    allowed = (np.dtype(dtype), COMPUTE_DTYPE) if is_half(dtype) else (np.dtype(dtype),)
    found, first = None, None
    for name, a in params.items():
        if a is None:
            continue
        dt = np.dtype(a.dtype)
        if dt not in allowed:
            raise TypeError(f"{op}: {name} is {dt} but x is {dtype}; batch-norm parameters and "
                            f"running statistics must be {_dtype_names(allowed)} for a "
                            f"{dtype} x")
        if found is None:
            found, first = dt, name
        elif dt != found:
            raise TypeError(f"{op}: {name} is {dt} but {first} is {found}; batch-norm "
                            f"parameters and running statistics must share one dtype")
    return np.dtype(dtype) if found is None else found


def check_half_backend(op: str, which: str, dtype) -> None:
    """bfloat16 runs on the CPU only: numba.cuda has no bfloat16 arrays."""
    if which != backend.CPU and is_half(dtype) and np.dtype(dtype) != np.float16:
        raise TypeError(f"{op}: {dtype} is supported on the CPU only (numba.cuda has no "
                        f"{dtype} arrays); use float16 on the device")


def check_half_dtypes(op: str, which: str, **arrays) -> np.dtype:
    """The one dtype of the arrays of an op that takes half precision, on backend ``which``:
    :func:`check_float_dtypes` with ``half``, then :func:`check_half_backend`."""
    dtype = check_float_dtypes(op, half=True, **arrays)
    check_half_backend(op, which, dtype)
    return dtype


def check_given(op: str, **arrays) -> None:
    """Every named argument is given: ``None`` is a ``TypeError`` naming the op and the
    arguments (instead of an ``AttributeError`` from deep inside the op)."""
    missing = [name for name, a in arrays.items() if a is None]
    if missing:
        raise TypeError(f"{op}: {', '.join(missing)} must be an array, got None")


def check_ndim(op: str, name: str, a, ndim: int, what: str = "") -> None:
    if len(a.shape) != ndim:
        hint = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} must have {ndim} dimensions{hint}, "
                         f"got shape {tuple(a.shape)}")


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


def check_recompute(op: str, value):
    """A Conv-BatchNorm op's ``recompute``: True, False or "auto" (the value, a bool as bool)."""
    if isinstance(value, str) and value == "auto":
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: recompute must be True, False or 'auto', got {value!r}")
    return bool(value)


def check_writable(op: str, name: str, a) -> None:
    """A host array the op updates in place must be writable."""
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"{op}: {name} is read-only, but it is updated in place")


def check_device_contiguous(op: str, name: str, a) -> None:
    """A device array the op updates in place must be C-contiguous (a host one is copied
    back through its view)."""
    if backend.is_device_array(a) and not backend.as_device_array(a).is_c_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous on the device "
                         f"(it is updated in place)")

# --------------------------------------------------------------------------- convolution geometry

def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def padding_quad(op: str, value) -> tuple:
    """An int, ``(h, w)`` pair or 4-tuple ``padding`` as ``(left, right, top, bottom)``.

    The 4-tuple's order is ``torch.nn.functional.pad``'s for the last two dimensions: the
    width's (left, right) first, then the height's (top, bottom). So
    ``conv(x, w, padding=p)`` computes ``conv(F.pad(x, p), w)`` for NCHW ``x``.
    """
    pads = (value, value) if _is_int(value) else value
    if not (isinstance(pads, (tuple, list)) and len(pads) in (2, 4)
            and all(map(_is_int, pads))):
        raise TypeError(f"{op}: padding must be an int, an (h, w) pair, a 4-tuple of ints "
                        f"(left, right, top, bottom), 'valid' or 'same', got {value!r}")
    if min(pads) < 0:
        raise ValueError(f"{op}: padding must be >= 0, got {value!r}")
    if len(pads) == 2:
        ph, pw = (int(v) for v in pads)
        return pw, pw, ph, ph
    return tuple(int(v) for v in pads)


def pair(op: str, name: str, value, minimum: int) -> tuple:
    """``value`` (an int or an ``(h, w)`` pair) as a pair of ints ``>= minimum``."""
    if _is_int(value):
        v = (int(value), int(value))
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_is_int, value)):
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
    "same" padding and a 4-tuple ``padding`` can be asymmetric. Kernels only need the top/left
    pad and ``P``, ``Q``; anything read past the bottom/right edge is a zero of the padding.
    ``N`` may be 0 (an empty batch: the ops return empty outputs, zero weight gradients).
    ``groups``: C and K split into that many groups, filters of group g seeing input channels of
    group g only; w is ``(K, C // groups, R, S)``. ``groups == C`` is a depthwise convolution.
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
    groups: int = 1

    def __hash__(self):     # (at every conv call: once per geometry; not pickled: __getstate__)
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = hash(tuple(self.__dict__[f] for f in _CONV_FIELDS))
        return self.__dict__["_hash"]

    def __getstate__(self):         # (a str's hash is the process's own)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def x_shape(self):
        return activation_shape(self.layout, self.N, self.C, self.H, self.W)

    @property
    def y_shape(self):
        return activation_shape(self.layout, self.N, self.K, self.P, self.Q)

    @property
    def w_shape(self):
        return (self.K, self.C // self.groups, self.R, self.S)

    @property
    def flops(self) -> int:
        """Multiply-adds times two of the forward convolution."""
        return 2 * self.N * self.K * self.P * self.Q * self.C * self.R * self.S


_CONV_FIELDS = tuple(f.name for f in dataclasses.fields(ConvGeometry))


def _resolve_padding(op, padding, size, k, stride, dilation):
    """Per-dimension (begin, end) padding for one spatial dimension."""
    extent = dilation * (k - 1) + 1
    if padding == "valid":
        return 0, 0
    if padding == "same":
        # TensorFlow's rule: output = ceil(size / stride); extra padding goes to the end. At
        # stride 1 that is PyTorch's "same": total = dilation*(k-1), begin = total//2, end =
        # total - begin (an even kernel's extra row/column at the bottom/right).
        out = -(-size // stride)
        total = max((out - 1) * stride + extent - size, 0)
        return total // 2, total - total // 2
    raise AssertionError(padding)


def conv_geometry(op: str, x_shape, w_shape, stride=1, padding=0, dilation=1,
                  layout="NCHW", groups=1) -> ConvGeometry:
    """Validate conv arguments and compute the output geometry.

    ``x_shape`` is 4-d in ``layout``; ``w_shape`` is ``(K, C // groups, R, S)``. Cached per argument
    signature (:func:`typed_key`: ``True`` and ``1.0`` are not ``1``), so a repeated call costs a
    dictionary look-up; a bad one raises again every time (errors are never cached).
    """
    key = typed_key(op, tuple(x_shape), tuple(w_shape), stride, padding, dilation, layout,
                    groups)
    if key is None:
        return _conv_geometry(op, x_shape, w_shape, stride, padding, dilation, layout, groups)
    return _conv_geometry_cached(key, op, tuple(x_shape), tuple(w_shape), stride, padding,
                                 dilation, layout, groups)


def typed_key(*args):
    """A hashable key of call arguments that tells apart values that are equal but not the
    same argument (each with its type: ``1``, ``True``, ``1.0`` and ``np.int64(1)`` differ;
    a tuple by its elements' types), or None when one is unhashable (a list): then the caller
    validates without its cache. Array shapes (tuples of ints) are keyed as they are. A value
    nested deeper than a pair is never valid, so it never reaches the cache."""
    key = tuple((v, tuple(map(type, v))) if type(v) is tuple else (v, type(v)) for v in args)
    try:
        hash(key)
    except TypeError:
        return None
    return key


@functools.lru_cache(maxsize=1024)
def _conv_geometry_cached(key, *args):
    return _conv_geometry(*args)


def _check_groups(op, groups, C, K, Cw):
    """``groups`` a positive int dividing C and K, with w's Cw == C // groups."""
    if not _is_int(groups):
        raise TypeError(f"{op}: groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"{op}: groups must be >= 1, got {groups!r}")
    if C % groups:
        raise ValueError(f"{op}: groups={groups} does not divide x's {C} channels")
    if K % groups:
        raise ValueError(f"{op}: groups={groups} does not divide w's {K} filters")
    if Cw != C // groups:
        if groups == 1:
            raise ValueError(f"{op}: w has {Cw} input channels, x has {C}")
        raise ValueError(f"{op}: w has {Cw} input channels, x has {C} in {groups} groups "
                         f"(w must have {C // groups})")
    return int(groups)


def _conv_geometry(op: str, x_shape, w_shape, stride=1, padding=0, dilation=1,
                   layout="NCHW", groups=1) -> ConvGeometry:
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
    groups = _check_groups(op, groups, C, K, Cw)
    if N < 0 or min(C, H, W) < 1:         # an empty batch (N = 0) is fine, as in PyTorch
        raise ValueError(f"{op}: x must have no empty dimension but the batch, got shape "
                         f"{tuple(x_shape)}")
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
        pw, pw_end, ph, ph_end = padding_quad(op, padding)
    P = (H + ph + ph_end - dh * (R - 1) - 1) // sh + 1
    Q = (W + pw + pw_end - dw * (S - 1) - 1) // sw + 1
    if P < 1 or Q < 1:
        raise ValueError(
            f"{op}: output size would be {P}x{Q} (< 1): input {H}x{W}, filter {R}x{S}, "
            f"stride {(sh, sw)}, padding (left, right, top, bottom) "
            f"{(pw, pw_end, ph, ph_end)}, dilation {(dh, dw)}")
    return ConvGeometry(N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, ph_end, pw_end, dh, dw,
                        layout, groups)


# --------------------------------------------------------------------------- batch norm

@dataclass(frozen=True)
class BatchNormArgs:
    """What :func:`batchnorm_args` established about one call."""
    backend: str
    dtype: np.dtype
    layout: str
    C: int
    M: int           # values per channel, N*H*W
    eps: float
    momentum: float
    param_dtype: np.dtype = None   # gamma, beta, running statistics: dtype, or float32 (half x)


SAVE_POLICIES = ("output", "mask")


def batchnorm_args(op, arrays, training=True, momentum=0.1, eps=1e-5, layout="NCHW",
                   save="output", synced=False, updates=True) -> BatchNormArgs:
    """Validate a batch-norm(-add-relu) call; a named ValueError/TypeError, nothing written.

    ``arrays``: the call's arrays by name, x, gamma, beta and (absent or None where the call
    has none) z, running_mean, running_var.

    ``synced``: the statistics are those of a batch spread over several processes
    (synchronized batch norm), so this process may hold no sample (N = 0) and the "more than
    one value per channel" rule is the caller's, on the global count. ``updates=False``: the
    call writes no running statistics (the NumPy-style backwards), so they may be read-only.
    x and z share one dtype, float32, float64 or half precision (:data:`HALF_DTYPES`); the
    parameters and running statistics x's dtype or, for a half x, float32
    (:func:`check_param_dtypes`).

    Per call: which backend, the dtypes, and that running statistics updated in place are
    writable (contiguous on the device). Everything that depends only on shapes and on the
    non-array arguments is checked by :func:`_batchnorm_static`, cached per signature
    (errors are raised again each time, never cached), in the same order as before.
    """
    x, z, gamma, beta, running_mean, running_var = (
        arrays.get(n) for n in ("x", "z", "gamma", "beta", "running_mean", "running_var"))
    if x is None or gamma is None or beta is None:
        missing = [n for n, a in (("x", x), ("gamma", gamma), ("beta", beta)) if a is None]
        raise TypeError(f"{op}: {', '.join(missing)} must be an array, got None")
    which = backend.backend_of(op, x=x, z=z, gamma=gamma, beta=beta,
                               running_mean=running_mean, running_var=running_var)
    dtype = check_half_dtypes(op, which, x=x, z=z)
    param_dtype = check_param_dtypes(op, dtype, gamma=gamma, beta=beta,
                                     running_mean=running_mean, running_var=running_var)
    shapes = tuple(None if a is None else tuple(a.shape)
                   for a in (x, z, gamma, beta, running_mean, running_var))
    args = (op, shapes, layout, save, training, momentum, eps, bool(synced))
    key = typed_key(*args)
    static = _batchnorm_static_cached(key, *args) if key is not None else \
        _batchnorm_static(*args)
    layout, C, M, momentum, eps = static
    _running_stats_arrays(op, running_mean, running_var, training and updates)
    _check_values_per_channel(op, M, training and not synced)
    return BatchNormArgs(which, dtype, layout, C, M, eps, momentum, param_dtype)


def _shaped(shape):
    """What the shape checks read of an array: its shape (None for an absent array)."""
    return None if shape is None else types.SimpleNamespace(shape=shape)


@functools.lru_cache(maxsize=1024)
def _batchnorm_static_cached(key, *args):
    return _batchnorm_static(*args)


def _batchnorm_static(op, shapes, layout, save, training, momentum, eps, synced):
    """(layout, C, M, momentum, eps): the checks of a batch-norm call that read only shapes
    and non-array arguments (``shapes``: of x, z, gamma, beta, running_mean, running_var)."""
    x, z, gamma, beta, running_mean, running_var = (_shaped(s) for s in shapes)
    layout = check_layout(op, layout)
    check_ndim(op, "x", x, 4, layout)
    if x.shape[channel_axis(layout)] < 1:      # N*H*W = 0 is an empty batch, as in PyTorch
        raise ValueError(f"{op}: x must have at least one channel, got shape {tuple(x.shape)}")
    if z is not None:
        check_same_shape(op, "z", z, "x", x)
    C = x.shape[channel_axis(layout)]
    check_vector(op, "gamma", gamma, C)
    check_vector(op, "beta", beta, C)
    if save not in SAVE_POLICIES:
        raise ValueError(f"{op}: save must be 'output' or 'mask', got {save!r}")
    M = math.prod(int(n) for n in x.shape) // C
    momentum, eps = _running_stats_static(op, C, running_mean, running_var, training,
                                          momentum, eps)
    return layout, C, M, momentum, eps


def running_stats(op, C, M, running_mean, running_var, training, momentum, eps, synced=False,
                  updates=True, static=False):
    """Validate the batch-norm state of a call: ``(momentum, eps)`` as floats.

    Shared by every op with a batch norm inside (``batchnorm``, ``batchnorm_add_relu``,
    ``conv_batchnorm_relu``, their NumPy-style backwards): running statistics of shape (C,),
    given both or neither, required in inference, writable when the call updates them
    (``updates`` and training; the NumPy-style backwards update nothing) and contiguous when
    on the device; ``training`` a real boolean (``"no"`` is not False);
    ``eps >= 0``; ``momentum`` in [0, 1] where it is used (training with running statistics;
    elsewhere it is not read, so any value passes); not exactly one value per channel (``M``)
    in training (unless ``synced``: then the caller checks the global count). ``M = 0`` (an
    empty batch) passes: the ops return empty outputs and update nothing, as PyTorch does.
    Backend and dtype agreement with the other arrays is the caller's ``backend_of`` /
    ``check_float_dtypes``. Raises a named ValueError/TypeError; writes nothing. ``static``:
    only the checks that read shapes and scalars (torch's fake tensors, while it captures a
    graph: numbafuse.torch's functions; their custom ops check the rest when they run).
    """
    momentum, eps = _running_stats_static(op, C, running_mean, running_var, training,
                                          momentum, eps)
    if not static:
        _running_stats_arrays(op, running_mean, running_var, training and updates)
    _check_values_per_channel(op, M, training and not synced)
    return momentum, eps


def _running_stats_static(op, C, running_mean, running_var, training, momentum, eps):
    # the checks of running_stats that read shapes and scalars only (in its order)
    check_vector(op, "running_mean", running_mean, C)
    check_vector(op, "running_var", running_var, C)
    eps = check_scalar(op, "eps", eps, lo=0.0)
    check_flag(op, "training", training)
    if (running_mean is None) != (running_var is None):
        given = "running_mean" if running_mean is not None else "running_var"
        raise ValueError(f"{op}: running_mean and running_var go together; only {given} "
                         f"was given")
    if not training and running_mean is None:
        raise ValueError(f"{op}: inference (training=False) needs running_mean and running_var")
    return check_momentum(op, momentum, training and running_mean is not None), eps


def check_momentum(op, momentum, used) -> float:
    """The running-statistics factor as a float in [0, 1] where it is ``used`` (training with
    running statistics); elsewhere it is never read, so any value passes (as 0.0).

    ``momentum=None`` is PyTorch's cumulative moving average, a layer option: its factor is
    ``1 / num_batches_tracked``, a count the layers keep (``nn.BatchNorm2d(C, momentum=None)``)
    and a functional call does not, so there it is refused where it would be used, as
    ``torch.nn.functional.batch_norm`` refuses it.
    """
    if not used:
        return 0.0
    if momentum is None:
        raise TypeError(f"{op}: momentum=None (the cumulative moving average) needs the count "
                        f"of batches a layer keeps (nn.BatchNorm2d(C, momentum=None)); a "
                        f"functional call has none: pass momentum=1/n for the n-th batch")
    return check_scalar(op, "momentum", momentum, lo=0.0, hi=1.0)


def _running_stats_arrays(op, running_mean, running_var, training):
    # running statistics updated in place: contiguous on the device, writable on the host
    for name, v in (("running_mean", running_mean), ("running_var", running_var)):
        check_device_contiguous(op, name, v)
        if training:
            check_writable(op, name, v)


def _check_values_per_channel(op, M, training):
    # one value per channel has no variance to normalise by (PyTorch's "Expected more than 1
    # value per channel when training"); none (an empty batch) gives an empty output
    if training and M == 1:
        raise ValueError(f"{op}: training needs more than one value per channel to "
                         f"normalise over, got {M}")


# --------------------------------------------------------------------------- pooling

@dataclass(frozen=True)
class PoolGeometry:
    """Shapes of a pooling call, and the element strides kernels address both layouts with."""
    N: int
    C: int
    H: int
    W: int
    P: int
    Q: int
    kh: int
    kw: int
    sh: int
    sw: int
    layout: str
    ph: int = 0                  # padding (the window's taps outside the map never win)
    pw: int = 0

    @staticmethod
    def _strides(layout, C, H, W):
        # element strides (sN, sC, sH, sW) of a C-contiguous activation in ``layout``
        if layout == "NCHW":
            return (C * H * W, H * W, W, 1)
        return (H * W * C, 1, W * C, C)

    @property
    def x_shape(self):
        return activation_shape(self.layout, self.N, self.C, self.H, self.W)

    @property
    def y_shape(self):
        return activation_shape(self.layout, self.N, self.C, self.P, self.Q)

    @property
    def argmax_dtype(self):
        """Smallest unsigned dtype of a window tap ``r * kw + s`` in ``[0, kh*kw)``: uint8 up
        to 256 taps (16x16), then uint16, uint32."""
        return np.min_scalar_type(self.kh * self.kw - 1)

    @property
    def x_strides(self):
        return self._strides(self.layout, self.C, self.H, self.W)

    @property
    def y_strides(self):
        return self._strides(self.layout, self.C, self.P, self.Q)


def pool_geometry(op, x, k, stride, layout, padding=0) -> PoolGeometry:
    """Validate a max-pool call and compute its :class:`PoolGeometry` (padding at most half
    the window, as PyTorch requires: every window keeps a tap inside the map)."""
    layout = check_layout(op, layout)
    N, C, H, W = activation_dims(op, x, layout)
    kh, kw = pair(op, "k", k, 1)
    sh, sw = (kh, kw) if stride is None else pair(op, "stride", stride, 1)
    ph, pw = pair(op, "padding", padding, 0)
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"{op}: padding must be at most half the {kh}x{kw} window, got "
                         f"{padding!r}")
    if kh > H + 2 * ph or kw > W + 2 * pw:
        raise ValueError(f"{op}: k: the {kh}x{kw} window is larger than the {H}x{W} input "
                         f"with its padding")
    P, Q = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1    # floor
    return PoolGeometry(N, C, H, W, P, Q, kh, kw, sh, sw, layout, ph, pw)
