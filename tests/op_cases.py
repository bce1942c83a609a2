"""One :class:`~tests.harness.OpCase` per op of ``numbafuse.ops.OPS``: how to draw its inputs
and what the reference says (``numbafuse.reference``, or a line of plain NumPy for the shape and
arithmetic ops). ``tests/test_ops.py`` runs every check of ``tests/harness.py`` on each case and
each backend; ``test_every_op_has_a_case`` fails when an op has none.

Expected values are float64 NumPy, independent of the kernels; gradients come back in the
order of the forward's array arguments (None for those that get none).
"""
import numpy as np
from hypothesis import strategies as st

import numbafuse as nf
import numbafuse.testing.strategies as nfs
from numbafuse import reference as ref
from numbafuse import validate

from .harness import Example, OpCase

SAVE_POLICIES = validate.SAVE_POLICIES


def _f64(a):
    return None if a is None else np.asarray(a, np.float64)


def _limits(backend, small, normal, limits, grouped=False):
    """Strategy size limits: ``small`` on the simulator, ``normal`` elsewhere; the boundary
    table's ``limits`` override both. ``grouped`` (the conv ops): a draw without limits (every
    check of tests/test_ops.py, on each backend) draws ``groups`` too (GROUPS); a boundary
    table's draw has the groups its table says (none for the ungrouped kernels' tables)."""
    drawn = {"groups": GROUPS} if grouped and not limits else {}
    return {**(small if backend.small else normal), **drawn, **limits}


def _conv_limits(backend, limits):
    return _limits(backend, CONV_SMALL, CONV_NORMAL, limits, grouped=True)


def _conv_dims(x, w, kw, dtype):
    g = validate.conv_geometry("test", x.shape, w.shape, kw["stride"], kw["padding"],
                               kw["dilation"], kw["layout"], kw.get("groups", 1))
    d = {k: getattr(g, k) for k in ("N", "C", "H", "W", "K", "R", "S", "P", "Q", "groups")}
    return dict(d, M=g.N * g.P * g.Q, size=x.size, itemsize=np.dtype(dtype).itemsize,
                layout=kw["layout"], geometry=g)     # (the kernels' launch plans take g)


def _activation_dims(x, layout):
    N, C, H, W = x.shape if layout == "NCHW" else (x.shape[0], x.shape[3], *x.shape[1:3])
    return dict(N=N, C=C, H=H, W=W, M=N * H * W, size=x.size, layout=layout)


def _unbroadcast(g, shape):
    """Sum ``g`` back to ``shape`` (undo NumPy broadcasting): the gradient of a broadcast."""
    if shape == ():
        return None
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _draw_need(draw, n):
    """Which of n gradients a NumPy-style backward is asked for (at least one)."""
    need = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return need if any(need) else (True,) * n


CONV_SMALL = dict(max_batch=2, max_channels=3, max_size=5, max_kernel=3)
CONV_NORMAL = dict()
BN_SMALL = dict(max_batch=2, max_channels=3, max_size=3)
BN_NORMAL = dict()
HEAVY = 2          # a conv or batch norm example costs about two plain ones
# groups of a conv op's draw: half the examples ungrouped; G 2 or 3 divides C and K (C == G:
# depthwise; the simulator's 3 channels make every grouped draw depthwise, the CPU's 4 also
# 2 groups of 2 channels), so grouped and depthwise kernels meet every check of test_ops.py
GROUPS = st.sampled_from((1, 1, 2, 3))


# =========================================================================== convolution family

class Conv2d(OpCase):
    name, family, cost = "conv2d", "conv", HEAVY

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.conv_problems(dtype=dtype, bias=False,
                                   **_conv_limits(backend, limits)))
        return Example(dict(x=p.x, w=p.w), p.kwargs, _conv_dims(p.x, p.w, p.kwargs, p.x.dtype))

    def expected_grads(self, ex, dy):
        return ref.conv2d_backward(dy, *ex.arrays.values(), **ex.keywords)


class BiasAdd(OpCase):
    name, family = "bias_add", "conv"

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.batchnorm_problems(dtype=dtype, **_limits(backend, BN_SMALL, {}, limits)))
        b = p.beta.astype(p.x.dtype)          # a half x's beta may be float32: b is x's dtype
        return Example(dict(x=p.x, b=b), dict(layout=p.layout),
                       _activation_dims(p.x, p.layout))

    def expected_grads(self, ex, dy):
        return ref.bias_add_backward(dy, layout=ex.keywords["layout"])


class ConvBiasReLU(OpCase):
    name, family, cost = "conv_bias_relu", "conv", HEAVY

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.conv_problems(dtype=dtype,
                                   **_conv_limits(backend, limits)))
        return Example(dict(x=p.x, w=p.w, b=p.b), p.kwargs,
                       _conv_dims(p.x, p.w, p.kwargs, p.x.dtype))

    def expected_grads(self, ex, dy):
        # db: the gradient a bias would get, also when the forward had none
        x, w, b = ex.arrays.values()
        b = np.zeros(w.shape[0], x.dtype) if b is None else b
        return ref.conv_bias_relu_backward(dy, x, w, b, **ex.keywords)

    def numpy_backward(self, ex, dy, y, y_host, draw):
        need = _draw_need(draw, 3)
        return [dy, ex.arrays["x"], ex.arrays["w"], y], dict(ex.keywords, need=need), need

    def chain(self, ex):
        def unfused(x, w, b=None, **kw):
            h = nf.conv2d(x, w, **kw)
            return nf.relu(h if b is None else nf.bias_add(h, b, layout=kw["layout"]))
        return unfused


class ConvBias(ConvBiasReLU):
    name = "conv_bias"

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.conv_problems(dtype=dtype, bias=True,
                                   **_conv_limits(backend, limits)))
        return Example(dict(x=p.x, w=p.w, b=p.b), p.kwargs,
                       _conv_dims(p.x, p.w, p.kwargs, p.x.dtype))

    def expected(self, ex):
        x, w, b = (_f64(a) for a in ex.arrays.values())
        kw = ex.keywords
        y = ref.bias_add(ref.conv2d(x, w, **kw), b, layout=kw["layout"])
        return y.astype(ex.dtype), {}

    def expected_grads(self, ex, dy):
        x, w, _ = ex.arrays.values()
        return (*ref.conv2d_backward(dy, x, w, **ex.keywords),
                ref.bias_add_backward(dy, layout=ex.keywords["layout"])[1])

    def chain(self, ex):
        return lambda x, w, b, **kw: nf.bias_add(nf.conv2d(x, w, **kw), b, layout=kw["layout"])


# =========================================================================== batch norm family

def _bn_keywords(draw, p, C, layout_kw, training=None):
    """Running statistics (maybe none in training), training (drawn unless given: a strategy),
    momentum, eps."""
    training = draw(st.booleans() if training is None else training)
    with_stats = draw(st.booleans()) if training else True
    return dict(running_mean=p.running_mean if with_stats else None,
                running_var=p.running_var if with_stats else None, training=training,
                momentum=draw(st.floats(0.0, 1.0)), eps=draw(st.sampled_from([1e-5, 1e-3])),
                **layout_kw)


class BatchNorm(OpCase):
    name, family, cost = "batchnorm", "batchnorm", HEAVY
    state = ("running_mean", "running_var")

    def draw(self, draw, backend, dtype=None, **limits):
        training = limits.pop("training", None)     # a strategy, or None: drawn
        p = draw(nfs.batchnorm_problems(dtype=dtype,
                                        **_limits(backend, BN_SMALL, BN_NORMAL, limits)))
        kw = _bn_keywords(draw, p, p.gamma.size, dict(layout=p.layout), training)
        return Example(dict(x=p.x, gamma=p.gamma, beta=p.beta), kw,
                       _activation_dims(p.x, p.layout))

    def expected(self, ex):
        x, gamma, beta = ex.arrays.values()
        kw = ex.keywords
        rm, rv = kw["running_mean"], kw["running_var"]
        if not kw["training"]:
            y = ref.batchnorm_infer(x, gamma, beta, rm, rv, eps=kw["eps"], layout=kw["layout"])
            return y, dict(running_mean=rm, running_var=rv)
        y, mean, var = ref.batchnorm_train(_f64(x), _f64(gamma), _f64(beta), eps=kw["eps"],
                                           layout=kw["layout"])
        state = dict(running_mean=None, running_var=None)
        if rm is not None:
            new = ref.update_running_stats(rm, rv, mean, var, ex.dims["M"], kw["momentum"])
            state = dict(zip(self.state, new))
        return y.astype(ex.dtype), state

    def expected_grads(self, ex, dy):
        x, gamma, _ = ex.arrays.values()
        kw = ex.keywords
        if kw["training"]:
            grads = ref.batchnorm_backward(dy, x, gamma, eps=kw["eps"], layout=kw["layout"])
        else:
            grads = ref.batchnorm_infer_backward(dy, x, gamma, kw["running_var"], eps=kw["eps"],
                                                 layout=kw["layout"],
                                                 running_mean=kw["running_mean"])
        return grads                                              # (dx, dgamma, dbeta)


class BatchNormAddReLU(OpCase):
    name, family, cost = "batchnorm_add_relu", "batchnorm", HEAVY
    state = ("running_mean", "running_var")

    def draw(self, draw, backend, dtype=None, **limits):
        training = limits.pop("training", None)     # a strategy, or None: drawn
        p = draw(nfs.batchnorm_problems(dtype=dtype,
                                        **_limits(backend, BN_SMALL, BN_NORMAL, limits)))
        kw = _bn_keywords(draw, p, p.gamma.size,
                          dict(layout=p.layout, save=draw(st.sampled_from(SAVE_POLICIES))),
                          training)
        return Example(dict(x=p.x, z=p.z, gamma=p.gamma, beta=p.beta), kw,
                       _activation_dims(p.x, p.layout))

    def _reference_keywords(self, ex):
        return {k: v for k, v in ex.keywords.items() if k not in ("save", "momentum")}

    def expected_grads(self, ex, dy):
        return ref.batchnorm_add_relu_backward(dy, *ex.arrays.values(),
                                               **self._reference_keywords(ex))

    def numpy_backward(self, ex, dy, y, y_host, draw):
        # the ReLU state: the output y, a packed mask of y > 0 (packed here, by NumPy), or
        # nothing (recomputed from x, z, gamma, beta)
        kw = self._reference_keywords(ex)
        args = [dy, *ex.arrays.values(), kw.pop("running_mean"), kw.pop("running_var")]
        state = draw(st.sampled_from(["y", "mask", "recompute"]))
        if state == "y":
            kw["y"] = y
        elif state == "mask":
            kw["mask"] = np.packbits(y_host.reshape(-1) > 0, bitorder="little")
        return args, kw, (True,) * 4

    def chain(self, ex):
        def unfused(x, z, gamma, beta, save=None, **kw):
            return nf.relu(nf.add(nf.batchnorm(x, gamma, beta, **kw), z))
        return unfused


class ConvBatchNormReLU(OpCase):
    name, family, cost = "conv_batchnorm_relu", "batchnorm", HEAVY
    state = ("running_mean", "running_var")
    # gradients through a batch norm of a conv: gw sums M*C*R*S float32 products, amplified
    # by invstd (measured worst |error| / max(1, |expected|): 1.2e-5 over 3000 examples)
    tol = {np.dtype(np.float32): dict(rtol=1e-4, atol=5e-5),
           np.dtype(np.float64): dict(rtol=1e-9, atol=1e-10)}

    def draw(self, draw, backend, dtype=None, **limits):
        training = limits.pop("training", None)     # a strategy, or None: drawn
        small = dict(max_batch=2, max_channels=2, max_size=4, max_kernel=2)
        p = draw(nfs.conv_batchnorm_problems(dtype=dtype,
                                             **_limits(backend, small, {}, limits, grouped=True)))
        kw = _bn_keywords(draw, p, p.gamma.size, dict(p.kwargs, relu=draw(st.booleans())),
                          training)
        return Example(dict(x=p.x, w=p.w, gamma=p.gamma, beta=p.beta), kw,
                       _conv_dims(p.x, p.w, p.kwargs, p.x.dtype))

    def _reference_keywords(self, ex):
        return {k: v for k, v in ex.keywords.items() if k != "momentum"}

    def expected_grads(self, ex, dy):
        return ref.conv_batchnorm_relu_backward(dy, *ex.arrays.values(),
                                                **self._reference_keywords(ex))

    def numpy_backward(self, ex, dy, y, y_host, draw):
        need = _draw_need(draw, 4)
        return [dy, *ex.arrays.values()], dict(self._reference_keywords(ex), need=need), need

    def chain(self, ex):
        def unfused(x, w, gamma, beta, *, running_mean, running_var, training, momentum, eps,
                    stride, padding, dilation, relu, layout, groups=1):
            h = nf.conv2d(x, w, stride=stride, padding=padding, dilation=dilation,
                          layout=layout, groups=groups)
            y = nf.batchnorm(h, gamma, beta, running_mean=running_mean,
                             running_var=running_var, training=training, momentum=momentum,
                             eps=eps, layout=layout)
            return nf.relu(y) if relu else y
        return unfused


# =========================================================================== unfused ops

def _shape(draw, backend, limits, max_dims=4):
    if "shape" in limits:
        return draw(limits["shape"])
    dims = limits.get("dims")
    if dims and "H" in dims:                     # the boundary table's activation dims
        return tuple(draw(dims[k]) for k in ("N", "C", "H", "W"))
    return draw(nfs.shapes(max_dims=max_dims, max_side=4 if backend.small else 5))


def _array(draw, shape, dtype):
    dtype = draw(nfs.dtypes()) if dtype is None else dtype
    return draw(nfs.arrays(shape, dtype))


class ReLU(OpCase):
    name, family = "relu", "basic"

    def draw(self, draw, backend, dtype=None, **limits):
        x = _array(draw, _shape(draw, backend, limits), dtype)
        return Example(dict(x=x), {}, dict(size=x.size))

    def expected_grads(self, ex, dy):
        return (ref.relu_backward(dy, ex.arrays["x"]),)

    def for_gradcheck(self, ex):
        x = ex.arrays["x"].copy()
        x[np.abs(x) < 1e-3] = 0.5                                   # away from the kink
        return Example(dict(x=x), ex.keywords, ex.dims)


class Linear(OpCase):
    name, family = "linear", "basic"
    cost = 3           # the device matmul's blocks are TILE x TILE threads: dear on the simulator

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.linear_problems(dtype=dtype, max_size=4 if backend.small else 6,
                                     dims=limits.get("dims")))
        return Example(dict(x=p.x, w=p.w, b=p.b), {},
                       dict(size=p.x.shape[0] * p.w.shape[0]))

    def expected_grads(self, ex, dy):
        return ref.linear_backward(dy, ex.arrays["x"], ex.arrays["w"])


class MaxPool2d(OpCase):
    name, family = "max_pool2d", "basic"

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.pool_problems(dtype=dtype, max_size=5 if backend.small else 7,
                                   dims=limits.get("dims")))
        return Example(dict(x=p.x), dict(k=p.k, stride=p.stride, layout=p.layout),
                       dict(size=p.x.size))

    def expected_grads(self, ex, dy):
        return (ref.max_pool2d_backward(dy, ex.arrays["x"], **ex.keywords),)

    def for_gradcheck(self, ex):
        x = ex.arrays["x"]                  # distinct values: no tie for a difference to cross
        x = np.random.default_rng(x.size).permutation(x.size).reshape(x.shape)
        return Example(dict(x=x.astype(np.float64)), ex.keywords, ex.dims)


class GlobalAvgPool2d(OpCase):
    name, family = "global_avg_pool2d", "basic"

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.batchnorm_problems(dtype=dtype, **_limits(backend, BN_SMALL, {}, limits)))
        return Example(dict(x=p.x), dict(layout=p.layout), _activation_dims(p.x, p.layout))

    def expected_grads(self, ex, dy):
        x = ex.arrays["x"]
        return (ref.global_avg_pool2d_backward(dy, x.shape, **ex.keywords),)


class Flatten(OpCase):
    name, family = "flatten", "basic"

    def draw(self, draw, backend, dtype=None, **limits):
        x = _array(draw, _shape(draw, backend, limits), dtype)
        return Example(dict(x=x), {}, dict(size=x.size))

    def expected(self, ex):
        x = ex.arrays["x"]
        return x.reshape(x.shape[0], -1), {}

    def expected_grads(self, ex, dy):
        return (dy.reshape(ex.arrays["x"].shape),)


class Squeeze(OpCase):
    name, family = "squeeze", "basic"

    def draw(self, draw, backend, dtype=None, **limits):
        shape = _shape(draw, backend, limits, max_dims=3)
        axis = draw(st.integers(0, len(shape)))
        x = _array(draw, shape[:axis] + (1,) + shape[axis:], dtype)
        negative = draw(st.booleans())
        return Example(dict(x=x), dict(axis=axis - x.ndim if negative else axis),
                       dict(size=x.size))

    def expected(self, ex):
        return np.squeeze(ex.arrays["x"], ex.keywords["axis"]), {}

    def expected_grads(self, ex, dy):
        return (dy.reshape(ex.arrays["x"].shape),)


class CrossEntropy(OpCase):
    name, family = "cross_entropy", "basic"
    nondiff = ("labels",)

    def draw(self, draw, backend, dtype=None, **limits):
        p = draw(nfs.cross_entropy_problems(dtype=dtype, max_batch=4 if backend.small else 6,
                                            dims=limits.get("dims")))
        return Example(dict(logits=p.logits, labels=p.labels), {},
                       dict(size=p.logits.size, N=p.logits.shape[0]))

    def expected_grads(self, ex, dy):
        return ref.cross_entropy_backward(dy, *ex.arrays.values()), None

    def for_gradcheck(self, ex):
        return Example(dict(ex.arrays, logits=ex.arrays["logits"] / 10), {}, ex.dims)


# =========================================================================== arithmetic

class _Binary(OpCase):
    """x op z: same shapes; on the host also broadcasting shapes; either side may be a
    Python scalar."""
    family = "elementwise"

    def draw(self, draw, backend, dtype=None, **limits):
        shape = _shape(draw, backend, limits, max_dims=3)
        dtype = draw(nfs.dtypes()) if dtype is None else dtype
        x, z = _array(draw, shape, dtype), _array(draw, shape, dtype)
        kind = draw(st.sampled_from(["same", "broadcast", "scalar z", "scalar x"]))
        if kind == "broadcast" and backend.name == "cpu":          # NumPy broadcasting
            z = _array(draw, shape[1:-1] + (1,), dtype)            # fewer dims, last one 1
        elif kind == "scalar z":
            z = draw(st.floats(-2.0, 2.0, width=32))
        elif kind == "scalar x":
            x = draw(st.floats(-2.0, 2.0, width=32))
        return Example(dict(x=x, z=z), {}, dict(size=int(np.prod(shape))))

    def expected(self, ex):
        x, z = (_f64(a) for a in ex.arrays.values())
        return self.apply(x, z).astype(ex.dtype), {}

    def expected_grads(self, ex, dy):
        x, z = ex.arrays.values()
        dx, dz = self.grads(_f64(x), _f64(z), _f64(dy))
        return (_unbroadcast(dx, np.shape(x)), _unbroadcast(dz, np.shape(z)))


class Add(_Binary):
    name = "add"
    apply = staticmethod(np.add)

    @staticmethod
    def grads(x, z, dy):
        return dy, dy


class Sub(_Binary):
    name = "sub"
    apply = staticmethod(np.subtract)

    @staticmethod
    def grads(x, z, dy):
        return dy, -dy


class Mul(_Binary):
    name = "mul"
    apply = staticmethod(np.multiply)

    @staticmethod
    def grads(x, z, dy):
        return dy * z, dy * x


class Sum(OpCase):
    name, family = "sum", "elementwise"
    scale = staticmethod(lambda x: 1.0)

    def draw(self, draw, backend, dtype=None, **limits):
        x = _array(draw, _shape(draw, backend, limits), dtype)
        return Example(dict(x=x), {}, dict(size=x.size))

    def expected(self, ex):
        x = _f64(ex.arrays["x"])
        return np.asarray(x.sum() * self.scale(x), ex.dtype), {}

    def expected_grads(self, ex, dy):
        x = ex.arrays["x"]
        return (np.full(x.shape, float(dy) * self.scale(x)),)


class Mean(Sum):
    name = "mean"
    scale = staticmethod(lambda x: 1.0 / x.size)


class Reshape(OpCase):
    name, family = "reshape", "elementwise"

    def draw(self, draw, backend, dtype=None, **limits):
        x = _array(draw, _shape(draw, backend, limits), dtype)
        shape = draw(st.sampled_from([(-1,), (1, -1), x.shape[::-1], (x.shape[0], -1)]))
        return Example(dict(x=x), dict(shape=shape), dict(size=x.size))

    def expected(self, ex):
        return ex.arrays["x"].reshape(ex.keywords["shape"]), {}

    def expected_grads(self, ex, dy):
        return (dy.reshape(ex.arrays["x"].shape),)


CASES = {case.name: case for case in (
    Conv2d(), BiasAdd(), ConvBiasReLU(), ConvBias(), BatchNorm(), BatchNormAddReLU(),
    ConvBatchNormReLU(), ReLU(), Linear(), MaxPool2d(), GlobalAvgPool2d(), Flatten(),
    Squeeze(), CrossEntropy(), Add(), Sub(), Mul(), Sum(), Mean(), Reshape())}
