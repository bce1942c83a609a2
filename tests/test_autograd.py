"""The tape itself (autograd.py, ops/arith.py, testing/finite_diff.py): Tensor basics, arithmetic
and its gradients, accumulation, no_grad, saved_bytes, gradcheck, the foundation's bad-input
rules, and the unfused Conv -> BiasAdd -> ReLU -> BatchNorm -> Add -> ReLU chain vs finite
differences.

Run: python -m pytest tests/test_autograd.py -q -p no:cacheprovider
"""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import numbafuse as nf
from numbafuse.autograd import Function, Tensor
from numbafuse.testing import GradcheckError

TOL = dict(rtol=1e-12, atol=1e-12)   # float64 arithmetic on the host: exact up to rounding


def t(a, requires_grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=requires_grad)


class FakeDeviceArray:
    """Looks like a CUDA array to the dispatcher; no GPU or simulator is needed, since mixing
    it with a host array must be refused before anything touches it."""

    def __init__(self, shape, dtype=np.float64):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": self.dtype.str,
                                         "data": (0, False), "version": 3}


# --------------------------------------------------------------------------- Tensor basics

def test_tensor_basics():
    a = np.arange(6.0).reshape(2, 3)
    x = Tensor(a, requires_grad=True)
    assert x.data is a and x.grad is None and x.requires_grad
    assert x.shape == (2, 3) and x.dtype == np.float64 and x.device == "cpu"
    assert x.ndim == 2 and x.size == 6 and len(x) == 2
    np.testing.assert_array_equal(x.numpy(), a)
    d = x.detach()
    assert isinstance(d, Tensor) and d.data is a and not d.requires_grad and d._fn is None
    assert not Tensor([1.0, 2.0]).requires_grad                    # lists become arrays
    assert Tensor(x).data is a                                      # a Tensor of a Tensor
    assert Tensor(np.zeros(2, np.float32)).dtype == np.float32


def test_operations_of_tensors_give_tensors_on_the_tape():
    x = t([1.0, 2.0])
    y = x * 2.0
    assert isinstance(y, Tensor) and y.requires_grad and y._fn is not None
    assert x._fn is None                                           # a leaf
    c = t([1.0, 2.0], requires_grad=False) * 2.0
    assert isinstance(c, Tensor) and not c.requires_grad and c._fn is None


# --------------------------------------------------------------------------- arithmetic

XS = np.array([0.5, -1.5, 2.0])
ZS = np.array([3.0, 0.25, -2.0])
GY = np.array([1.0, -2.0, 0.5])

ARITH = [
    # (name, f(x, z), expected y, expected gx, expected gz)
    ("add", lambda x, z: x + z, XS + ZS, GY, GY),
    ("sub", lambda x, z: x - z, XS - ZS, GY, -GY),
    ("mul", lambda x, z: x * z, XS * ZS, GY * ZS, GY * XS),
    ("add scalar", lambda x, z: x + 3.0, XS + 3.0, GY, None),
    ("radd scalar", lambda x, z: 3.0 + x, 3.0 + XS, GY, None),
    ("sub scalar", lambda x, z: x - 3.0, XS - 3.0, GY, None),
    ("rsub scalar", lambda x, z: 3.0 - x, 3.0 - XS, -GY, None),
    ("mul scalar", lambda x, z: x * 3.0, XS * 3.0, 3.0 * GY, None),
    ("rmul scalar", lambda x, z: 3.0 * x, 3.0 * XS, 3.0 * GY, None),
    ("neg", lambda x, z: -x, -XS, -GY, None),
    ("tensor op array", lambda x, z: x * ZS, XS * ZS, GY * ZS, None),
    ("array op tensor", lambda x, z: ZS - x, ZS - XS, -GY, None),
    ("nf.add", lambda x, z: nf.add(x, z), XS + ZS, GY, GY),
]


@pytest.mark.parametrize("f,y_expected,gx_expected,gz_expected",
                         [a[1:] for a in ARITH], ids=[a[0] for a in ARITH])
def test_arithmetic_and_its_gradients(f, y_expected, gx_expected, gz_expected):
    x, z = t(XS), t(ZS)
    y = f(x, z)
    assert isinstance(y, Tensor)
    np.testing.assert_allclose(y.data, y_expected, **TOL)
    y.backward(GY)
    np.testing.assert_allclose(x.grad, gx_expected, **TOL)
    if gz_expected is None:
        assert z.grad is None
    else:
        np.testing.assert_allclose(z.grad, gz_expected, **TOL)


def test_sum_mean_reshape_and_their_gradients():
    a = np.arange(6.0).reshape(2, 3)
    x = t(a)
    s = x.sum()
    assert s.shape == () and s.item() == 15.0
    s.backward()
    np.testing.assert_array_equal(x.grad, np.ones((2, 3)))

    x = t(a)
    m = x.mean()
    assert m.item() == 2.5
    m.backward()
    np.testing.assert_allclose(x.grad, np.full((2, 3), 1 / 6), **TOL)

    x = t(a)
    r = x.reshape(3, 2)
    assert r.shape == (3, 2) and x.reshape((6,)).shape == (6,)
    g = np.arange(6.0).reshape(3, 2) + 1
    r.backward(g)
    np.testing.assert_array_equal(x.grad, g.reshape(2, 3))


def test_gradient_accumulates_when_a_tensor_is_used_twice():
    x = t(XS)
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * XS, **TOL)
    x = t(XS)
    (x + x).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * np.ones(3), **TOL)
    x = t(XS)
    y = x * 2.0
    (y * x + y).sum().backward()                                   # x reached by three paths
    np.testing.assert_allclose(x.grad, 4 * XS + 2, **TOL)


def test_a_summed_gradient_passed_to_two_inputs_is_not_added_into_for_one():
    """y = a + b used twice: y's gradient is a sum the tape made (and may add into in place);
    add's backward hands that same array to a and b. A later contribution to a must not be
    added into it in place, or b's gradient changes too. (Before 3d5c375 the tape did: b.grad
    came out 10 where it is 5.)"""
    for order in range(2):
        a, b = t([1.0, 2.0]), t([3.0, 4.0])
        y = a + b
        if order == 0:
            loss = (y * 2.0).sum() + (y * 3.0).sum() + (a * 5.0).sum()
        else:
            loss = ((y * 2.0 + y * 3.0) + a * 5.0).sum()
        loss.backward()
        np.testing.assert_allclose(a.grad, [10.0, 10.0], **TOL)
        np.testing.assert_allclose(b.grad, [5.0, 5.0], **TOL)


class Twice(Function):
    """y = 2 * x * w, whose backward can add the tape's gradient of an input so far into
    its own (``backward_adding``), recording what it was offered."""
    name = "twice"

    def forward(self, x, w):
        self.save_for_backward(x=x, w=w)
        self.offered = []
        return 2 * x * w

    def backward(self, gy):
        return 2 * gy * self.saved.w, 2 * gy * self.saved.x

    def backward_adding(self, gy, addends):
        self.offered.append(addends)
        gx, gw = self.backward(gy)
        added = [i for i, a in enumerate(addends) if a is not None]
        return (gx + addends[0] if 0 in added else gx,
                gw + addends[1] if 1 in added else gw), added


def test_a_backward_that_adds_the_pending_gradient_replaces_it():
    # the skip connection's gradient reaches x first and is offered to the op, whose dx
    # comes back with it added (the CUDA conv's dx epilogue); a third path's gradient is then
    # added in place into that array (the tape owns it); nothing else is offered
    x, w = t(XS), t(XS + 1)
    op = Twice()
    y = op.apply(x, w)
    (y + x + x).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * (XS + 1) + 2, **TOL)
    np.testing.assert_allclose(w.grad, 2 * XS, **TOL)
    assert len(op.offered) == 1 and op.offered[0][1] is None
    np.testing.assert_allclose(op.offered[0][0], 2 * np.ones(3), **TOL)
    x = t(XS)
    op = Twice()
    (op.apply(x, t(XS + 1)) * 3.0).sum().backward()          # nothing pending: backward
    assert op.offered == [] and np.allclose(x.grad, 6 * (XS + 1))


def test_an_input_taken_twice_is_not_offered_its_pending_gradient():
    # twice(x, x) + x: adding x's pending gradient into both of its gradients would count
    # it twice, so it is offered neither
    x = t(XS)
    op = Twice()
    (op.apply(x, x) + x).sum().backward()
    np.testing.assert_allclose(x.grad, 4 * XS + 1, **TOL)
    assert op.offered == []


def test_gradient_accumulates_across_backward_calls():
    x = t(XS)
    (x * 3.0).sum().backward()
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad, 3.0 + 2 * XS, **TOL)
    x.zero_grad()
    assert x.grad is None


def test_leaves_do_not_share_one_gradient_array():
    # y = x + z: both gradients equal gy, but mutating one (an in-place clip, an optimizer)
    # must not change the other.
    x, z = t(XS), t(ZS)
    G = GY.copy()
    (x + z).backward(G)
    assert not np.shares_memory(x.grad, z.grad)
    assert not np.shares_memory(x.grad, G) and not np.shares_memory(z.grad, G)


@pytest.mark.parametrize("view", ["reshape", "flatten"])
def test_a_gradient_passed_through_a_view_op_is_still_its_own_array(view):
    # Reshape/flatten backward return views of gy: the leaf must not alias the caller's grad
    a, b = t(np.arange(6.0).reshape(2, 3)), t(np.arange(6.0).reshape(6) * 0.5)
    flat = a.reshape(6) if view == "reshape" else nf.flatten(a.reshape(1, 6)).reshape(6)
    G = np.arange(6.0)
    (flat + b).backward(G)
    for leaf in (a, b):
        assert not np.shares_memory(leaf.grad, G)
    G[:] = -1.0
    np.testing.assert_array_equal(a.grad, np.arange(6.0).reshape(2, 3))


def test_backward_refuses_a_grad_of_another_dtype():
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="backward: grad is a cpu float64 array but the tensor "
                                        "is cpu float32"):
        (x * 2.0).backward(np.ones(3))


def test_scalar_arithmetic_refuses_integer_arrays():
    # (mul and add take half precision too: the message lists float16 first)
    with pytest.raises(TypeError, match="mul: x must be float16, .*float32 or float64, got "
                                        "int64"):
        nf.Tensor(np.arange(3)) * 0.5
    with pytest.raises(TypeError, match="add: x must be float16, .*float32 or float64"):
        nf.add(np.arange(3), 0.5)
    with pytest.raises(TypeError, match="mean: x must be float32 or float64"):
        nf.Tensor(np.arange(3)).mean()


def test_backward_without_grad_needs_a_one_element_tensor():
    y = t(XS) * 2.0
    with pytest.raises(ValueError, match="backward"):
        y.backward()
    with pytest.raises(ValueError, match="backward"):
        y.backward(np.ones(2))                                     # wrong shape


def test_no_grad_records_nothing():
    x = t(XS)
    with nf.no_grad():
        y = (x * x).sum()
    assert isinstance(y, Tensor) and not y.requires_grad and y._fn is None
    assert nf.saved_bytes(y) == 0
    y = (x * x).sum()                                              # recording is back on
    assert y.requires_grad and nf.saved_bytes(y) > 0


def test_saved_bytes_counts_a_shared_array_once():
    x, z, w = t(np.ones(100)), t(np.ones(100)), t(np.ones(100))
    y = x * z + x * w                                               # both Muls save x.data
    assert nf.saved_bytes(y) == 3 * 800
    assert nf.saved_bytes(x * z) == 2 * 800


# --------------------------------------------------------------------------- gradcheck

class Cube(Function):
    """y = x**3, with a correct or a deliberately wrong backward."""
    name = "cube"

    @dataclasses.dataclass(frozen=True)
    class Params:
        wrong: bool

    def forward(self, x):
        self.save_for_backward(x=x)
        return x ** 3

    def backward(self, gy):
        x = self.saved.x
        return (gy * (2 if self.params.wrong else 3) * x ** 2,)


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_gradcheck_accepts_a_correct_op_and_raises_for_a_wrong_one(mode):
    x = t(np.array([0.5, -1.0, 2.0]))
    assert nf.gradcheck(lambda v: Cube(wrong=False).apply(v), [x], mode=mode) is True
    with pytest.raises(GradcheckError, match="gradcheck"):
        nf.gradcheck(lambda v: Cube(wrong=True).apply(v), [x], mode=mode)


class SlightlyWrongCube(Cube):
    def backward(self, gy):
        return (gy * 3 * self.saved.x ** 2 * (1 + 1e-5),)   # 1e-5 relative error


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_gradcheck_catches_a_relative_error_of_1e_5(mode):
    x = t(np.array([0.5, -1.0, 2.0]))
    with pytest.raises(GradcheckError):
        nf.gradcheck(lambda v: SlightlyWrongCube(wrong=False).apply(v), [x], mode=mode)


def test_gradcheck_passes_non_tensor_inputs_through_and_needs_a_differentiated_input():
    x = t(XS)
    assert nf.gradcheck(lambda v, c: (v * c).sum(), [x, ZS])
    with pytest.raises(ValueError, match="gradcheck"):
        nf.gradcheck(lambda v: v * 2.0, [t(XS, requires_grad=False)])


def test_hypothesis_strategies_import_as_documented():
    # in a fresh interpreter: once another test module has imported the submodule, the
    # documented spelling works whatever the package's __getattr__ does
    code = "from numbafuse.testing import strategies; print(strategies.conv_problems)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-500:]


# --------------------------------------------------------------------------- the unfused chain

@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_unfused_chain_matches_finite_differences(layout):
    # conv2d -> bias_add -> relu -> batchnorm -> add -> relu -> sum, float64
    rng = np.random.default_rng(0)
    N, C, H, W, K = 2, 2, 4, 4, 3
    x = rng.standard_normal((N, C, H, W) if layout == "NCHW" else (N, H, W, C))
    w = rng.standard_normal((K, C, 3, 3)) / 3
    b = rng.standard_normal(K)
    gamma, beta = rng.uniform(0.5, 1.5, K), rng.standard_normal(K)
    z = rng.standard_normal((N, K, H, W) if layout == "NCHW" else (N, H, W, K))

    def chain(x, w, b, gamma, beta, z):
        h = nf.relu(nf.bias_add(nf.conv2d(x, w, padding=1, layout=layout), b, layout=layout))
        h = nf.batchnorm(h, gamma, beta, training=True, layout=layout)
        return (nf.relu(nf.add(h, z)) * rng_weights).sum()

    rng_weights = rng.standard_normal(z.shape)                     # so sum is not symmetric
    inputs = [t(a) for a in (x, w, b, gamma, beta, z)]
    assert nf.gradcheck(chain, inputs, mode="directional", directions=3)


# --------------------------------------------------------------------------- foundation input rules

X4 = np.zeros((2, 3, 4, 4))
W4 = np.zeros((3, 3, 3, 3))
VEC = np.zeros(3)
DEV = FakeDeviceArray((2, 3, 4, 4))

FOUNDATION_BAD = [
    # host/device mix -> TypeError
    ("add", lambda: nf.add(X4, DEV), TypeError),
    ("conv2d", lambda: nf.conv2d(X4, FakeDeviceArray(W4.shape)), TypeError),
    ("conv_bias_relu", lambda: nf.conv_bias_relu(X4, W4, FakeDeviceArray((3,))), TypeError),
    ("batchnorm_add_relu", lambda: nf.batchnorm_add_relu(X4, DEV, VEC, VEC), TypeError),
    ("linear", lambda: nf.linear(np.zeros((2, 3)), FakeDeviceArray((4, 3))), TypeError),
    # non-float dtype -> TypeError
    ("add", lambda: nf.add(np.arange(3), np.arange(3)), TypeError),
    ("conv2d", lambda: nf.conv2d(X4.astype(np.int32), W4), TypeError),
    ("batchnorm", lambda: nf.batchnorm(X4.astype(np.int64), VEC, VEC), TypeError),
    ("relu", lambda: nf.relu(np.arange(3)), TypeError),
    # mixed float32/float64 -> TypeError
    ("add", lambda: nf.add(np.zeros(3, np.float32), np.zeros(3)), TypeError),
    ("mul", lambda: nf.Tensor(np.zeros(3, np.float32)) * np.zeros(3), TypeError),
    ("conv_bias_relu", lambda: nf.conv_bias_relu(X4.astype(np.float32), W4), TypeError),
    ("batchnorm_add_relu",
     lambda: nf.batchnorm_add_relu(X4, X4, VEC.astype(np.float32), VEC), TypeError),
    # bad layout name -> ValueError
    ("conv2d", lambda: nf.conv2d(X4, W4, layout="nchw4"), ValueError),
    ("bias_add", lambda: nf.bias_add(X4, VEC, layout="CHWN"), ValueError),
    ("batchnorm", lambda: nf.batchnorm(X4, VEC, VEC, layout="NCWH"), ValueError),
    ("conv_bias_relu", lambda: nf.conv_bias_relu(X4, W4, layout=""), ValueError),
    ("batchnorm_add_relu", lambda: nf.batchnorm_add_relu(X4, X4, VEC, VEC, layout=1),
     ValueError),
    ("max_pool2d", lambda: nf.max_pool2d(X4, 2, layout="HWC"), ValueError),
    ("global_avg_pool2d", lambda: nf.global_avg_pool2d(X4, layout="N"), ValueError),
]


@pytest.mark.parametrize("op,call,exc", FOUNDATION_BAD,
                         ids=[f"{i}-{case[0]}" for i, case in enumerate(FOUNDATION_BAD)])
def test_foundation_bad_input_raises_naming_the_op(op, call, exc):
    with pytest.raises(exc) as info:
        call()
    assert str(info.value).startswith(f"{op}:"), str(info.value)


def test_bad_input_writes_no_running_stats():
    running_mean, running_var = np.zeros(3), np.ones(3)
    for bad in (dict(layout="NHCW"), dict(momentum=2.0)):
        with pytest.raises(ValueError):
            nf.batchnorm(X4, VEC + 1, VEC, running_mean=running_mean, running_var=running_var,
                         **bad)
    with pytest.raises(TypeError):
        nf.batchnorm(X4.astype(np.float32), VEC + 1, VEC, running_mean=running_mean,
                     running_var=running_var)
    np.testing.assert_array_equal(running_mean, np.zeros(3))
    np.testing.assert_array_equal(running_var, np.ones(3))
