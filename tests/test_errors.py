"""Bad input, on every backend: a ``ValueError``/``TypeError`` that names the op and the
argument, raised before anything is written - no kernel runs, the inputs and the running
statistics are left as they were.

Covered: the NumPy-style backward functions (``conv_bias_relu_backward``,
``batchnorm_add_relu_backward``, ``conv_batchnorm_relu_backward``: shapes, ``need``, the
packed ``mask``, host/device and dtype mixes), the forward ops with running statistics (every
bad argument leaves them untouched; a read-only ``running_mean``/``running_var`` in training),
and the conv ops' geometry.
"""
import contextlib
import inspect
import re

import numpy as np
import pytest

import numbafuse as nf
from numbafuse import kernels
from numbafuse.ops import OPS

from .harness import BACKENDS, host_copy


class FakeDeviceArray:
    """Looks like a CUDA array to the dispatcher (no GPU needed)."""
    __cuda_array_interface__ = {}
    shape, dtype = (4,), np.dtype(np.float64)


class Foreign:
    """An argument to pass on the *other* side of the host/device line from the backend:
    a fake device array for the CPU, the host array itself for CUDA."""

    def __init__(self, a):
        self.a = a


def _put(backend, a):
    if isinstance(a, Foreign):
        return FakeDeviceArray() if backend.name == "cpu" else a.a
    return backend.put(a)


def _host(a):
    return a.a if isinstance(a, Foreign) else a


# Kernels that validation may run: they read and write nothing of the caller's (the label
# range check of cross_entropy needs the labels, which may be on the device).
VALIDATION_KERNELS = {"count_bad_labels"}


@contextlib.contextmanager
def no_kernel_runs(backend):
    """Every host-level entry point of the backend's kernel modules (but the validation
    kernels) replaced by a spy; the block fails if any was called."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for family in kernels.FAMILIES:
            module = kernels.module(family, backend.name)
            for name, fn in list(vars(module).items()):
                if inspect.isfunction(fn) and fn.__module__ == module.__name__ \
                        and name not in VALIDATION_KERNELS:
                    mp.setattr(module, name,
                               lambda *a, _name=name, **k: calls.append(_name))
        yield
    assert not calls, f"kernels ran before the error: {calls}"


def each_call(calls):
    """Parametrize ``row`` over ``calls``, rows (call, op, args, kwargs, exc, argument,
    pattern), each named op-index-argument."""
    return pytest.mark.parametrize("row", calls,
                                   ids=[f"{c[1]}-{i}-{c[5]}" for i, c in enumerate(calls)])


def assert_row_refused(backend, row):
    """:func:`assert_refused` of one (call, op, args, kwargs, exc, argument, pattern) row."""
    call, op, args, kwargs, exc, argument, pattern = row
    assert_refused(backend, call, list(args), kwargs, exc, op, argument, pattern)


def assert_refused(backend, call, args, kwargs, exc, op, argument, pattern=""):
    """``call(*args, **kwargs)`` (host arrays put on ``backend``) raises ``exc`` whose message
    starts with ``op: `` and names ``argument``; no kernel ran and no array was written."""
    put = [_put(backend, a) for a in args]
    kw = {k: _put(backend, v) for k, v in kwargs.items()}
    before = [host_copy(_host(a)) for a in list(args) + list(kwargs.values())]
    with no_kernel_runs(backend), pytest.raises(exc) as info:
        call(*put, **kw)
    message = str(info.value)
    assert message.startswith(f"{op}: "), message
    assert re.search(rf"\b{argument}\b", message), f"{argument!r} not named: {message}"
    assert re.search(pattern, message), f"{pattern!r} not in: {message}"
    for a, b in zip(put + list(kw.values()), before):
        if isinstance(b, np.ndarray) and not isinstance(a, FakeDeviceArray):
            got = backend.get(a) if backend.on_backend(a) else a
            np.testing.assert_array_equal(got, b, err_msg="an input was written")


# =========================================================================== NumPy-style backwards

def _conv_problem(dtype=np.float64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 5)).astype(dtype)
    w = rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    y = nf.conv_bias_relu(x, w, padding=1)                          # (2, 4, 5, 5), host
    dy = rng.standard_normal(y.shape).astype(dtype)
    return dict(dy=dy, x=x, w=w, y=y)


def _conv_bias_relu_backward_cases():
    """(name, args change, keywords change, exception, argument, pattern)."""
    p = _conv_problem()
    return [
        ("y shape", dict(y=p["y"][:, :, :3]), {}, ValueError, "y", "y has shape"),
        ("dy shape", dict(dy=p["dy"][:, :2]), {}, ValueError, "dy", "has shape"),
        ("x rank", dict(x=p["x"][0]), {}, ValueError, "x", "4 dimensions"),
        ("w channels", dict(w=np.ones((4, 2, 3, 3))), {}, ValueError, "w", "input channels"),
        ("need short", {}, dict(need=(True, True)), ValueError, "need", ""),
        ("need long", {}, dict(need=(True,) * 4), ValueError, "need", ""),
        ("need str", {}, dict(need="all"), ValueError, "need", ""),
        ("layout", {}, dict(layout="NCWH"), ValueError, "layout", ""),
        ("y float32", dict(y=p["y"].astype(np.float32)), {}, TypeError, "y", "float32"),
        ("dy float32", dict(dy=p["dy"].astype(np.float32)), {}, TypeError, "dy", "float32"),
        ("w int", dict(w=p["w"].astype(np.int64)), {}, TypeError, "w", "int64"),
        ("y foreign", dict(y="foreign"), {}, TypeError, "y", "cannot mix host and device"),
        ("dy foreign", dict(dy="foreign"), {}, TypeError, "dy", "cannot mix host and device"),
        ("dy None", dict(dy=None), {}, TypeError, "dy", "got None"),
        ("x None", dict(x=None), {}, TypeError, "x", "got None"),
        ("w None", dict(w=None), {}, TypeError, "w", "got None"),
        ("y None", dict(y=None), {}, TypeError, "y", "got None"),
    ]


def _bn_problem(dtype=np.float64):
    rng = np.random.default_rng(1)
    x, z = (rng.standard_normal((2, 3, 4, 5)).astype(dtype) for _ in range(2))
    gamma, beta = rng.uniform(0.5, 1.5, 3).astype(dtype), rng.standard_normal(3).astype(dtype)
    rm, rv = rng.standard_normal(3).astype(dtype), rng.uniform(0.5, 2, 3).astype(dtype)
    y = nf.batchnorm_add_relu(x, z, gamma, beta)
    mask = np.packbits(y.reshape(-1) > 0, bitorder="little")          # (15,) uint8
    dy = rng.standard_normal(x.shape).astype(dtype)
    return dict(dy=dy, x=x, z=z, gamma=gamma, beta=beta, running_mean=rm, running_var=rv,
                y=y, mask=mask)


BN_ARGS = ("dy", "x", "z", "gamma", "beta", "running_mean", "running_var")


def _batchnorm_add_relu_backward_cases():
    p = _bn_problem()
    return [
        ("dy shape", dict(dy=p["dy"][:1]), {}, ValueError, "dy", "has shape"),
        ("z shape", dict(z=p["z"][:, :, :2]), {}, ValueError, "z", "has shape"),
        ("gamma length", dict(gamma=np.ones(4)), {}, ValueError, "gamma", r"\(3,\)"),
        ("running_var length", dict(running_var=np.ones(2)), {}, ValueError, "running_var",
         r"\(3,\)"),
        ("y shape", {}, dict(y=p["y"][:, :2]), ValueError, "y", "has shape"),
        ("mask short", {}, dict(mask=p["mask"][:-1]), ValueError, "mask", r"\(15,\)"),
        ("mask long", {}, dict(mask=np.zeros(16, np.uint8)), ValueError, "mask", r"\(15,\)"),
        ("mask dtype", {}, dict(mask=p["mask"].astype(np.float64)), ValueError, "mask",
         "uint8"),
        ("mask foreign", {}, dict(mask="foreign"), TypeError, "mask",
         "cannot mix host and device"),
        ("y foreign", {}, dict(y="foreign"), TypeError, "y", "cannot mix host and device"),
        ("dy foreign", dict(dy="foreign"), {}, TypeError, "dy", "cannot mix host and device"),
        ("dy float32", dict(dy=p["dy"].astype(np.float32)), {}, TypeError, "dy", "float32"),
        ("y float32", {}, dict(y=p["y"].astype(np.float32)), TypeError, "y", "float32"),
        ("gamma float32", dict(gamma=p["gamma"].astype(np.float32)), {}, TypeError, "gamma",
         "float32"),
        ("no state, no z", dict(z=None), {}, ValueError, "z", "needed"),
        ("training", {}, dict(training="yes"), TypeError, "training", ""),
        ("inference without stats", dict(running_mean=None, running_var=None),
         dict(training=False), ValueError, "running_mean", "inference"),
        ("layout", {}, dict(layout="CHWN"), ValueError, "layout", ""),
        ("dy None", dict(dy=None), {}, TypeError, "dy", "got None"),
        ("x None", dict(x=None), {}, TypeError, "x", "got None"),
        ("gamma None", dict(gamma=None), {}, TypeError, "gamma", "got None"),
    ]


def _conv_bn_problem(dtype=np.float64):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 5, 5)).astype(dtype)
    w = rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    dy = rng.standard_normal((2, 4, 3, 3)).astype(dtype)
    return dict(dy=dy, x=x, w=w, gamma=np.ones(4, dtype), beta=np.zeros(4, dtype),
                running_mean=np.zeros(4, dtype), running_var=np.ones(4, dtype))


CONV_BN_ARGS = ("dy", "x", "w", "gamma", "beta")


def _conv_batchnorm_relu_backward_cases():
    p = _conv_bn_problem()
    return [
        ("dy shape", dict(dy=p["dy"][:, :, :2]), {}, ValueError, "dy", "has shape"),
        ("need short", {}, dict(need=(True,) * 3), ValueError, "need", "four"),
        ("need long", {}, dict(need=(True,) * 5), ValueError, "need", "four"),
        ("need str", {}, dict(need="abcd"), ValueError, "need", "four"),
        ("gamma length", dict(gamma=np.ones(3)), {}, ValueError, "gamma", r"\(4,\)"),
        ("running_mean length", {}, dict(running_mean=np.ones(5)), ValueError,
         "running_mean", r"\(4,\)"),
        ("w channels", dict(w=np.ones((4, 2, 3, 3))), {}, ValueError, "w", "input channels"),
        ("dy foreign", dict(dy="foreign"), {}, TypeError, "dy", "cannot mix host and device"),
        ("running_var foreign", {}, dict(running_var="foreign"), TypeError, "running_var",
         "cannot mix host and device"),
        ("dy float32", dict(dy=p["dy"].astype(np.float32)), {}, TypeError, "dy", "float32"),
        ("beta float32", dict(beta=p["beta"].astype(np.float32)), {}, TypeError, "beta",
         "float32"),
        ("training", {}, dict(training="no"), TypeError, "training", ""),
        ("relu", {}, dict(relu="no"), TypeError, "relu", ""),
        ("dy None", dict(dy=None), {}, TypeError, "dy", "got None"),
        ("w None", dict(w=None), {}, TypeError, "w", "got None"),
        ("beta None", dict(beta=None), {}, TypeError, "beta", "got None"),
    ]


def _resolve(changes, problem, names):
    """The positional arguments: the problem's, changed; "foreign" -> :class:`Foreign`."""
    args = [changes.get(k, problem[k]) if k in changes else problem[k] for k in names]
    return [Foreign(problem[k]) if isinstance(a, str) and a == "foreign" else a
            for k, a in zip(names, args)]


def _resolve_kw(changes, problem):
    return {k: Foreign(problem[k]) if isinstance(v, str) and v == "foreign" else v
            for k, v in changes.items()}


def _numpy_backward_calls():
    """(op, case name, call, args, kwargs, exception, argument, pattern) of every bad call."""
    out = []
    conv = _conv_problem()
    for name, args, kw, exc, arg, pattern in _conv_bias_relu_backward_cases():
        out.append(("conv_bias_relu_backward", name, nf.conv_bias_relu_backward,
                    _resolve(args, conv, ("dy", "x", "w", "y")),
                    dict(dict(padding=1), **_resolve_kw(kw, conv)), exc, arg, pattern))
    bn = _bn_problem()
    for name, args, kw, exc, arg, pattern in _batchnorm_add_relu_backward_cases():
        state = {} if name == "no state, no z" or "y" in kw or "mask" in kw else \
            dict(mask=bn["mask"])
        out.append(("batchnorm_add_relu_backward", name, nf.batchnorm_add_relu_backward,
                    _resolve(args, bn, BN_ARGS), dict(state, **_resolve_kw(kw, bn)), exc,
                    arg, pattern))
    cbn = _conv_bn_problem()
    for name, args, kw, exc, arg, pattern in _conv_batchnorm_relu_backward_cases():
        stats = dict(running_mean=cbn["running_mean"], running_var=cbn["running_var"])
        out.append(("conv_batchnorm_relu_backward", name, nf.conv_batchnorm_relu_backward,
                    _resolve(args, cbn, CONV_BN_ARGS),
                    dict(stats, **_resolve_kw(kw, cbn)), exc, arg, pattern))
    return out


BACKWARD_CALLS = _numpy_backward_calls()


@pytest.mark.parametrize("index", range(len(BACKWARD_CALLS)),
                         ids=[f"{c[0]}-{c[1]}" for c in BACKWARD_CALLS])
def test_numpy_style_backward_refuses_bad_input_and_writes_nothing(index, backend):
    op, _, call, args, kwargs, exc, argument, pattern = BACKWARD_CALLS[index]
    assert_refused(backend, call, args, kwargs, exc, op, argument, pattern)


# =========================================================================== forward ops

def _bn_forward_cases(C):
    """(override of a good call, exception, argument, pattern)."""
    p = _bn_problem()
    return [
        (dict(z=p["z"][:, :, :-1]), ValueError, "z", "has shape"),
        (dict(gamma=np.ones(C + 1)), ValueError, "gamma", rf"\({C},\)"),
        (dict(beta=np.ones(C - 1)), ValueError, "beta", rf"\({C},\)"),
        (dict(running_mean=np.zeros(C + 1)), ValueError, "running_mean", rf"\({C},\)"),
        (dict(running_var=np.ones(C - 1)), ValueError, "running_var", rf"\({C},\)"),
        (dict(x=p["x"].astype(np.int32)), TypeError, "x", "float32 or float64"),
        (dict(z=p["z"].astype(np.float32)), TypeError, "z", "float32 but x is float64"),
        (dict(running_mean=p["running_mean"].astype(np.float32)), TypeError, "running_mean",
         "float32"),
        (dict(eps=-1e-5), ValueError, "eps", "must lie in"),
        (dict(momentum=1.5), ValueError, "momentum", "must lie in"),
        (dict(momentum=-0.1), ValueError, "momentum", "must lie in"),
        (dict(momentum=None), TypeError, "momentum", "cumulative moving average"),
        (dict(momentum="0.1x"), TypeError, "momentum", "real number"),
        (dict(layout="NCWH"), ValueError, "layout", "must be"),
        (dict(save="bits"), ValueError, "save", "'output' or 'mask'"),
        (dict(running_var=None), ValueError, "running_mean", "only running_mean was given"),
        (dict(x=p["x"][0], z=p["z"][0]), ValueError, "x", "4 dimensions"),
        (dict(x=p["x"][:1, :, :1, :1], z=p["z"][:1, :, :1, :1]), ValueError, "value",
         "more than one value per channel"),
        (dict(gamma=[1.0] * C), TypeError, "gamma", "must be a NumPy array or a CUDA array"),
        (dict(gamma="foreign"), TypeError, "gamma", "cannot mix host and device"),
        (dict(running_var="foreign"), TypeError, "running_var", "cannot mix host and device"),
        (dict(training="yes"), TypeError, "training", "True or False"),
        (dict(training=False, running_mean=None, running_var=None), ValueError,
         "running_mean", "inference"),
        (dict(x=None), TypeError, "x", "got None"),
        (dict(gamma=None), TypeError, "gamma", "got None"),
        (dict(beta=None), TypeError, "beta", "got None"),
        (dict(z=None), TypeError, "z", "got None"),
    ]


def _conv_bn_forward_cases():
    p = _conv_bn_problem()
    return [
        (dict(w=np.ones((4, 5, 3, 3))), ValueError, "w", "5 input channels, x has 3"),
        (dict(x=np.ones((2, 3, 5))), ValueError, "x", "4 dimensions"),
        (dict(gamma=np.ones(3)), ValueError, "gamma", r"\(4,\)"),
        (dict(beta=np.ones(5)), ValueError, "beta", r"\(4,\)"),
        (dict(running_mean=np.ones(3)), ValueError, "running_mean", r"\(4,\)"),
        (dict(running_var=None), ValueError, "running_mean", "only running_mean was given"),
        (dict(gamma=p["gamma"].astype(np.float32)), TypeError, "gamma", "float32"),
        (dict(x=p["x"].astype(np.int32)), TypeError, "x", "float32 or float64"),
        (dict(layout="NWHC"), ValueError, "layout", ""),
        (dict(stride=0), ValueError, "stride", ""),
        (dict(padding="full"), ValueError, "padding", ""),
        (dict(momentum=1.5), ValueError, "momentum", ""),
        (dict(momentum=None), TypeError, "momentum", "cumulative moving average"),
        (dict(eps=-1.0), ValueError, "eps", ""),
        (dict(x=np.ones((1, 3, 3, 3))), ValueError, "value", "more than one value per channel"),
        (dict(training=False, running_mean=None, running_var=None), ValueError,
         "running_mean", "inference"),
        (dict(training="no"), TypeError, "training", "True or False"),
        (dict(training=0), TypeError, "training", "True or False"),
        (dict(relu="no"), TypeError, "relu", "True or False"),
        (dict(x="foreign"), TypeError, "x", "cannot mix host and device"),
        (dict(running_mean="foreign"), TypeError, "running_mean", "cannot mix host and device"),
        (dict(x=None), TypeError, "x", "got None"),
        (dict(w=None), TypeError, "w", "got None"),
        (dict(gamma=None), TypeError, "gamma", "got None"),
        (dict(beta=None), TypeError, "beta", "got None"),
    ]


def _forward_calls():
    """(op, call, positional names, good arrays, cases) of the ops with running statistics."""
    bn, cbn = _bn_problem(), _conv_bn_problem()
    stats = ("running_mean", "running_var")
    bn_good = {k: bn[k] for k in ("x", "z", "gamma", "beta") + stats}
    plain_bn_cases = [c for c in _bn_forward_cases(3)
                      if not {"z", "save"} & set(c[0])]
    return [("batchnorm_add_relu", nf.batchnorm_add_relu, ("x", "z", "gamma", "beta"),
             bn_good, _bn_forward_cases(3)),
            ("batchnorm", nf.batchnorm, ("x", "gamma", "beta"),
             {k: v for k, v in bn_good.items() if k != "z"},
             [(dict((k, v) for k, v in c[0].items() if k != "z"), *c[1:])
              for c in plain_bn_cases]),
            ("conv_batchnorm_relu", nf.conv_batchnorm_relu, ("x", "w", "gamma", "beta"),
             {k: cbn[k] for k in ("x", "w", "gamma", "beta") + stats}, _conv_bn_forward_cases())]


FORWARD_CALLS = [(op, call, names, good, *case) for op, call, names, good, cases
                 in _forward_calls() for case in cases]


@pytest.mark.parametrize("index", range(len(FORWARD_CALLS)),
                         ids=[f"{c[0]}-{i}-{c[6]}" for i, c in enumerate(FORWARD_CALLS)])
def test_forward_refuses_bad_input_and_leaves_running_stats(index, backend):
    op, call, names, good, override, exc, argument, pattern = FORWARD_CALLS[index]
    arrays = dict(good, **{k: Foreign(good[k]) if isinstance(v, str) and v == "foreign" else v
                           for k, v in override.items()})
    args = [arrays.pop(k) for k in names]
    assert_refused(backend, call, args, arrays, exc, op, argument, pattern)


def _conv_forward_calls():
    X, W, B = np.zeros((1, 3, 5, 5)), np.zeros((2, 3, 3, 3)), np.zeros(2)
    conv = nf.conv_bias_relu
    return [
        (conv, "conv_bias_relu", (np.zeros((3, 5, 5)), W, B), {}, ValueError, "x",
         "4 dimensions"),
        (conv, "conv_bias_relu", (X, np.zeros((2, 3, 3)), B), {}, ValueError, "w",
         "4 dimensions"),
        (conv, "conv_bias_relu", (X, np.zeros((2, 5, 3, 3)), B), {}, ValueError, "w",
         "w has 5 input channels, x has 3"),
        (conv, "conv_bias_relu", (X, W, B), dict(layout="NCWH"), ValueError, "layout", ""),
        (conv, "conv_bias_relu", (X, W, B), dict(stride=0), ValueError, "stride", ""),
        (conv, "conv_bias_relu", (X, W, B), dict(dilation=(1, 0)), ValueError, "dilation", ""),
        (conv, "conv_bias_relu", (X, W, B), dict(padding=-1), ValueError, "padding", ""),
        (conv, "conv_bias_relu", (X, W, B), dict(padding="full"), ValueError, "padding", ""),
        (conv, "conv_bias_relu", (X, W, B), dict(stride=1.5), TypeError, "stride", ""),
        (conv, "conv_bias_relu", (X, np.zeros((2, 3, 7, 7)), B), {}, ValueError, "output",
         "output size"),
        (conv, "conv_bias_relu", (X, W, np.zeros(3)), {}, ValueError, "b", r"\(2,\)"),
        (conv, "conv_bias_relu", (X, W, np.zeros((2, 1))), {}, ValueError, "b", r"\(2,\)"),
        (conv, "conv_bias_relu", (X.astype(np.float32), W, B), {}, TypeError, "w",
         "w is float64 but x is float32"),
        (conv, "conv_bias_relu", (X.astype(np.int64), W.astype(np.int64), None), {},
         TypeError, "x", "float32 or float64"),
        (conv, "conv_bias_relu", (X, W, Foreign(B)), {}, TypeError, "b",
         "cannot mix host and device"),
        (conv, "conv_bias_relu", ([[1.0]], W, B), {}, TypeError, "x",
         "must be a NumPy array or a CUDA array"),
        (conv, "conv_bias_relu", (None, W, B), {}, TypeError, "x", "got None"),
        (conv, "conv_bias_relu", (X, None, B), {}, TypeError, "w", "got None"),
        (conv, "conv_bias_relu", (X, W, B), dict(padding=(1, 2, 3)), TypeError, "padding",
         "4-tuple"),
        (conv, "conv_bias_relu", (X, W, B), dict(padding=(1, 2, -1, 0)), ValueError,
         "padding", ">= 0"),
        (conv, "conv_bias_relu", (X, W, B), dict(padding=(1, 0, 1.0, 0)), TypeError,
         "padding", "4-tuple"),
        (conv, "conv_bias_relu", (X, np.zeros((2, 3, 3, 9)), B), dict(padding=(1, 0, 1, 1)),
         ValueError, "output", r"\(left, right, top, bottom\) \(1, 0, 1, 1\)"),
        (nf.conv2d, "conv2d", (None, W), {}, TypeError, "x", "got None"),
        (nf.conv2d, "conv2d", (X, None), {}, TypeError, "w", "got None"),
        (nf.bias_add, "bias_add", (X, None), {}, TypeError, "b", "got None"),
        (nf.conv2d, "conv2d", (X, np.zeros((2, 5, 3, 3))), {}, ValueError, "w",
         "5 input channels, x has 3"),
        (nf.bias_add, "bias_add", (X, np.zeros(2)), {}, ValueError, "b", r"\(3,\)"),
        (nf.bias_add, "bias_add", (np.zeros((3, 5)), np.zeros(3)), {}, ValueError, "x",
         "4 dimensions"),
        (nf.bias_add, "bias_add", (X, np.zeros(3, np.float32)), {}, TypeError, "b", "float32"),
        (nf.bias_add, "bias_add", (X, Foreign(np.zeros(3))), {}, TypeError, "b",
         "cannot mix host and device"),
    ]


CONV_CALLS = _conv_forward_calls()


@each_call(CONV_CALLS)
def test_conv_ops_refuse_bad_input(row, backend):
    assert_row_refused(backend, row)


# =========================================================================== half precision

def _half_calls():
    """Mixed dtypes where PyTorch refuses them: a half x takes float32 or same-dtype batch-norm
    parameters (all one dtype), anything else one dtype for every array."""
    rng = np.random.default_rng(2)
    h, f = np.float16, np.float32
    x, z = (rng.standard_normal((2, 3, 2, 3)).astype(h) for _ in range(2))
    g, b, rm, rv = np.ones(3, f), np.zeros(3, f), np.zeros(3, f), np.ones(3, f)
    w = rng.standard_normal((2, 3, 3, 3)).astype(h)
    y = nf.conv_bias_relu(x, w, padding=1)
    bn = nf.batchnorm_add_relu
    return [
        (bn, "batchnorm_add_relu", (x, z, g.astype(np.float64), b), {}, TypeError, "gamma",
         "float16 or float32 for a float16 x"),
        (bn, "batchnorm_add_relu", (x, z, g, b), dict(running_mean=rm.astype(h),
                                                      running_var=rv), TypeError,
         "running_mean", "share one dtype"),
        (bn, "batchnorm_add_relu", (x.astype(f), z.astype(f), g.astype(h), b.astype(h)), {},
         TypeError, "gamma", "must be float32 for a float32 x"),
        (bn, "batchnorm_add_relu", (x, z.astype(f), g, b), {}, TypeError, "z",
         "z is float32 but x is float16"),
        (nf.batchnorm, "batchnorm", (x, g.astype(np.float64), b.astype(np.float64)), {},
         TypeError, "gamma", "float16 or float32"),
        (nf.batchnorm_add_relu_backward, "batchnorm_add_relu_backward", (x, x, z, g, b),
         dict(y=x.astype(f)), TypeError, "y", "y is float32 but dy is float16"),
        (nf.conv_bias_relu, "conv_bias_relu", (x, w.astype(f)), {}, TypeError, "w",
         "w is float32 but x is float16"),
        (nf.conv_bias_relu, "conv_bias_relu", (x, w, np.zeros(2, f)), {}, TypeError, "b",
         "b is float32 but x is float16"),
        (nf.conv_bias_relu_backward, "conv_bias_relu_backward", (y.astype(f), x, w, y),
         dict(padding=1), TypeError, "x", "x is float16 but dy is float32"),
        (nf.bias_add, "bias_add", (x, np.zeros(3, f)), {}, TypeError, "b",
         "b is float32 but x is float16"),
        (nf.add, "add", (x, z.astype(f)), {}, TypeError, "z", "z is float32 but x is float16"),
    ]


HALF_CALLS = _half_calls()


@each_call(HALF_CALLS)
def test_half_precision_mixes_are_refused(row, backend):
    assert_row_refused(backend, row)


# =========================================================================== read-only state

STATEFUL = [("batchnorm_add_relu", lambda p, **kw: nf.batchnorm_add_relu(
                p["x"], p["z"], p["gamma"], p["beta"], **kw), _bn_problem),
            ("batchnorm", lambda p, **kw: nf.batchnorm(p["x"], p["gamma"], p["beta"], **kw),
             _bn_problem),
            ("conv_batchnorm_relu", lambda p, **kw: nf.conv_batchnorm_relu(
                p["x"], p["w"], p["gamma"], p["beta"], **kw), _conv_bn_problem)]


@pytest.mark.parametrize("read_only", ["running_mean", "running_var"])
@pytest.mark.parametrize("op,call,problem", STATEFUL, ids=[s[0] for s in STATEFUL])
def test_read_only_running_stats_are_refused_in_training(op, call, problem, read_only):
    """Host arrays only (device arrays have no read-only flag): the named ValueError before
    anything is written, not a Numba TypingError from inside a kernel."""
    p = problem()
    stats = {k: p[k].copy() for k in ("running_mean", "running_var")}
    stats[read_only].flags.writeable = False
    inputs = {k: v.copy() for k, v in p.items() if k not in stats}
    with no_kernel_runs(BACKENDS["cpu"]), \
            pytest.raises(ValueError, match=rf"^{op}: {read_only} is read-only"):
        call(p, training=True, **stats)
    for k in stats:
        np.testing.assert_array_equal(stats[k], p[k])
    for k, v in inputs.items():
        np.testing.assert_array_equal(p[k], v)


@pytest.mark.parametrize("op,call,problem", STATEFUL, ids=[s[0] for s in STATEFUL])
def test_read_only_running_stats_are_fine_in_inference(op, call, problem):
    p = problem()
    stats = {k: p[k].copy() for k in ("running_mean", "running_var")}
    writable = call(p, training=False, **stats)
    for v in stats.values():
        v.flags.writeable = False
    np.testing.assert_array_equal(call(p, training=False, **stats), writable)


BACKWARDS = [("batchnorm_add_relu_backward", lambda p, **kw: nf.batchnorm_add_relu_backward(
                 p["dy"], p["x"], p["z"], p["gamma"], p["beta"], **kw), _bn_problem),
             ("conv_batchnorm_relu_backward", lambda p, **kw: nf.conv_batchnorm_relu_backward(
                 p["dy"], p["x"], p["w"], p["gamma"], p["beta"], **kw), _conv_bn_problem)]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("op,call,problem", BACKWARDS, ids=[b[0] for b in BACKWARDS])
def test_numpy_style_backwards_take_read_only_running_stats(op, call, problem, training):
    """They write nothing (the running statistics least of all), so read-only ones are fine."""
    p = problem()
    stats = {k: p[k].copy() for k in ("running_mean", "running_var")}
    writable = call(p, training=training, **stats)
    for v in stats.values():
        v.flags.writeable = False
    for got, expected in zip(call(p, training=training, **stats), writable):
        np.testing.assert_array_equal(got, expected)


# =========================================================================== the unfused ops

def _basic_calls():
    F64, F32, LOGITS = np.zeros((2, 3, 4, 4)), np.zeros((2, 3, 4, 4), np.float32), np.zeros((3, 4))
    i012 = np.array([0, 1, 2])
    return [
        # (call, op, args, keywords, exception, argument, pattern)
        (nf.relu, "relu", ([1.0, 2.0],), {}, TypeError, "x", "NumPy array or a CUDA array"),
        (nf.relu, "relu", (np.arange(3),), {}, TypeError, "x", "float32 or float64"),
        (nf.linear, "linear", (np.zeros((2, 3)), np.zeros((4, 5))), {}, ValueError, "w",
         "input features"),
        (nf.linear, "linear", (np.zeros(3), np.zeros((4, 3))), {}, ValueError, "x", "2 dim"),
        (nf.linear, "linear", (np.zeros((2, 3)), np.zeros((4, 3, 1))), {}, ValueError, "w",
         "2 dim"),
        (nf.linear, "linear", (np.zeros((2, 3)), np.zeros((4, 3)), np.zeros(5)), {},
         ValueError, "b", r"\(4,\)"),
        (nf.linear, "linear", (np.zeros((2, 3), np.float32), np.zeros((4, 3))), {}, TypeError,
         "w", "float32"),
        (nf.linear, "linear", (np.zeros((2, 3)), Foreign(np.zeros((4, 3)))), {}, TypeError,
         "w", "cannot mix host and device"),
        (nf.max_pool2d, "max_pool2d", (np.zeros((2, 3, 4)), 2), {}, ValueError, "x", "4 dim"),
        (nf.max_pool2d, "max_pool2d", (F64, 5), {}, ValueError, "k", "larger"),
        (nf.max_pool2d, "max_pool2d", (F64, 0), {}, ValueError, "k", ""),
        (nf.max_pool2d, "max_pool2d", (F64, 2.5), {}, TypeError, "k", ""),
        (nf.max_pool2d, "max_pool2d", (F64, 2, 0), {}, ValueError, "stride", ""),
        (nf.max_pool2d, "max_pool2d", (F64, 2), dict(layout="NWHC"), ValueError, "layout", ""),
        (nf.max_pool2d, "max_pool2d", (F32.astype(np.int32), 2), {}, TypeError, "x", ""),
        (nf.global_avg_pool2d, "global_avg_pool2d", (np.zeros((2, 3)),), {}, ValueError, "x",
         "4 dim"),
        (nf.global_avg_pool2d, "global_avg_pool2d", (F64,), dict(layout="CHWN"), ValueError,
         "layout", ""),
        (nf.global_avg_pool2d, "global_avg_pool2d", (np.zeros((2, 3, 0, 4)),), {}, ValueError,
         "x", "empty"),
        (nf.flatten, "flatten", (np.zeros(()),), {}, ValueError, "x", ""),
        (nf.flatten, "flatten", (np.zeros(3, np.int64),), {}, TypeError, "x", ""),
        (nf.squeeze, "squeeze", (F64, 1), {}, ValueError, "axis", "size 3"),
        (nf.squeeze, "squeeze", (F64, 4), {}, ValueError, "axis", "out of range"),
        (nf.squeeze, "squeeze", (F64, "1"), {}, TypeError, "axis", ""),
        (nf.cross_entropy, "cross_entropy", (LOGITS, np.array([0, 1, 4])), {}, ValueError,
         "labels", r"\[0, 4\)"),
        (nf.cross_entropy, "cross_entropy", (LOGITS, np.array([0, -1, 2], np.int32)), {},
         ValueError, "labels", ""),
        (nf.cross_entropy, "cross_entropy", (LOGITS, np.array([0.0, 1.0, 2.0])), {}, TypeError,
         "labels", "integers"),
        (nf.cross_entropy, "cross_entropy", (LOGITS, np.array([0, 1])), {}, ValueError,
         "labels", r"\(3,\)"),
        (nf.cross_entropy, "cross_entropy", (np.zeros(4), np.array([0])), {}, ValueError,
         "logits", "2 dim"),
        (nf.cross_entropy, "cross_entropy", (LOGITS.astype(np.int64), i012), {}, TypeError,
         "logits", ""),
        (nf.cross_entropy, "cross_entropy", (LOGITS, [0, 1, 2]), {}, TypeError, "labels", ""),
        (nf.cross_entropy, "cross_entropy", (LOGITS, Foreign(i012)), {}, TypeError, "labels",
         "cannot mix host and device"),
        (nf.add, "add", (np.zeros((2, 3)), Foreign(np.zeros((2, 3)))), {}, TypeError, "z",
         "cannot mix host and device"),
        (nf.add, "add", (np.zeros((2, 3)), np.zeros((3, 2))), {}, ValueError, "z", ""),
        (nf.add, "add", (np.zeros(3), np.zeros(3, np.float32)), {}, TypeError, "z", "float32"),
        (OPS["mul"].function, "mul", (np.zeros(3), np.zeros(3, np.int64)), {}, TypeError, "z",
         "int64"),
        # None for a required array: Function.apply names it (forward's arguments without
        # a default), for every op
        (nf.relu, "relu", (None,), {}, TypeError, "x", "got None"),
        (nf.add, "add", (F64, None), {}, TypeError, "z", "got None"),
        (nf.linear, "linear", (None, np.zeros((4, 3))), {}, TypeError, "x", "got None"),
        (nf.max_pool2d, "max_pool2d", (None, 2), {}, TypeError, "x", "got None"),
        (nf.cross_entropy, "cross_entropy", (LOGITS, None), {}, TypeError, "labels",
         "got None"),
    ]


BASIC_CALLS = _basic_calls()


@each_call(BASIC_CALLS)
def test_unfused_ops_refuse_bad_input(row, backend):
    call, op, args = row[:3]
    if op == "cross_entropy" and isinstance(args[1], Foreign) and backend.name == "cuda":
        # host labels with device logits: accepted on CUDA (checked on the host, then
        # uploaded; tests/cuda/test_launches_cuda.py); device labels with host logits are
        # what the CPU run of this row refuses
        loss = call(*(_put(backend, a) for a in args))
        assert np.isfinite(backend.get(loss)).all()
        return
    assert_row_refused(backend, row)


@pytest.mark.cuda
def test_strided_device_running_stats_are_refused():
    """Device running statistics must be contiguous (they are updated in place)."""
    cuda = BACKENDS["cuda"]
    p = _conv_bn_problem()
    args = [cuda.put(p[k]) for k in ("x", "w", "gamma", "beta")]
    strided = cuda.put(np.repeat(p["running_mean"], 2))[::2]          # (4,), stride 2
    rv = cuda.put(p["running_var"])
    with no_kernel_runs(cuda), pytest.raises(ValueError, match="conv_batchnorm_relu: "
                                             "running_mean must be contiguous on the device"):
        nf.conv_batchnorm_relu(*args, running_mean=strided, running_var=rv)
    np.testing.assert_array_equal(cuda.get(strided), p["running_mean"])
    np.testing.assert_array_equal(cuda.get(rv), p["running_var"])


# =========================================================================== momentum

@pytest.mark.parametrize("momentum", [None, -2.0])
@pytest.mark.parametrize("op,call,problem", STATEFUL, ids=[s[0] for s in STATEFUL])
def test_momentum_is_checked_only_where_it_is_used(backend, op, call, problem, momentum):
    """Inference reads no momentum, nor does training without running statistics: any value
    passes there, the result is that of momentum=0.1, nothing is written."""
    p = problem()
    arrays = {k: backend.put(v) for k, v in p.items()}
    stats = {k: arrays[k] for k in ("running_mean", "running_var")}
    for kw in (dict(training=False, **stats), dict(training=True)):
        expected = backend.get(call(arrays, momentum=0.1, **kw))
        np.testing.assert_array_equal(backend.get(call(arrays, momentum=momentum, **kw)),
                                      expected)
    for k, v in stats.items():
        np.testing.assert_array_equal(backend.get(v), p[k])
