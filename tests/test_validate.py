"""Validation, dispatch and conv geometry (numbafuse/validate.py)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbafuse import backend, kernels, reference, validate


@given(size=st.integers(1, 20), k=st.integers(1, 5), stride=st.integers(1, 3),
       dilation=st.integers(1, 3),
       padding=st.one_of(st.integers(0, 4), st.sampled_from(["same", "valid"])))
def test_geometry_matches_the_reference_padding_rule(size, k, stride, dilation, padding):
    begin, end = reference.resolve_padding(size, k, stride, dilation, padding)
    out = (size + begin + end - dilation * (k - 1) - 1) // stride + 1
    if out < 1:
        with pytest.raises(ValueError, match="output size"):
            validate.conv_geometry("op", (1, 1, size, size), (1, 1, k, k), stride, padding,
                                  dilation)
        return
    g = validate.conv_geometry("op", (1, 1, size, size), (1, 1, k, k), stride, padding, dilation)
    assert (g.ph, g.ph_end, g.pw, g.pw_end) == (begin, end, begin, end)
    assert (g.P, g.Q) == (out, out)
    if padding == "same":
        assert g.P == -(-size // stride)


def test_geometry_layouts_and_shapes():
    g = validate.conv_geometry("op", (2, 5, 6, 3), (4, 3, 3, 1), 1, (1, 0), 1, "NHWC")
    assert (g.N, g.C, g.H, g.W, g.K, g.R, g.S, g.P, g.Q) == (2, 3, 5, 6, 4, 3, 1, 5, 6)
    assert g.x_shape == (2, 5, 6, 3) and g.y_shape == (2, 5, 6, 4) and g.w_shape == (4, 3, 3, 1)
    assert g.flops == 2 * 2 * 4 * 5 * 6 * 3 * 3 * 1


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(x_shape=(1, 3, 5, 5), w_shape=(2, 4, 3, 3)), ValueError, "w has 4 input channels, x has 3"),
    (dict(x_shape=(3, 5, 5), w_shape=(2, 3, 3, 3)), ValueError, "x must have 4 dimensions"),
    (dict(x_shape=(1, 3, 5, 5), w_shape=(2, 3, 3)), ValueError, "w must have 4 dimensions"),
    (dict(stride=0), ValueError, "stride must be >= 1"),
    (dict(dilation=(1, 0)), ValueError, "dilation must be >= 1"),
    (dict(padding=-1), ValueError, "padding must be >= 0"),
    (dict(padding="full"), ValueError, "padding must be"),
    (dict(stride=1.5), TypeError, "stride must be an int"),
    (dict(layout="CHWN"), ValueError, "layout must be 'NCHW' or 'NHWC'"),
    (dict(x_shape=(1, 3, 2, 2), w_shape=(2, 3, 3, 3)), ValueError, "output size"),
])
def test_geometry_errors_name_the_op_and_argument(kwargs, exc, match):
    args = dict(x_shape=(1, 3, 5, 5), w_shape=(2, 3, 3, 3), stride=1, padding=0, dilation=1,
                layout="NCHW")
    args.update(kwargs)
    with pytest.raises(exc, match=match) as info:
        validate.conv_geometry("conv2d", args.pop("x_shape"), args.pop("w_shape"), **args)
    assert str(info.value).startswith("conv2d: ")


def test_dtypes():
    f32, f64 = np.zeros(2, np.float32), np.zeros(2, np.float64)
    assert validate.check_float_dtypes("op", a=f32, b=None, c=f32) == np.float32
    with pytest.raises(TypeError, match="op: b is float64 but a is float32"):
        validate.check_float_dtypes("op", a=f32, b=f64)
    with pytest.raises(TypeError, match="op: a must be float32 or float64, got int64"):
        validate.check_float_dtypes("op", a=np.zeros(2, np.int64))


def test_backend_of():
    assert backend.backend_of("op", x=np.zeros(1), b=None) == "cpu"
    with pytest.raises(TypeError, match="op: x must be a NumPy array"):
        backend.backend_of("op", x=[1.0, 2.0])


def test_scalars_and_vectors():
    assert validate.check_scalar("bn", "momentum", 0.5, 0, 1) == 0.5
    with pytest.raises(ValueError, match=r"bn: momentum must lie in \[0, 1\]"):
        validate.check_scalar("bn", "momentum", 1.5, 0, 1)
    with pytest.raises(ValueError, match="bn: eps must lie in"):
        validate.check_scalar("bn", "eps", float("nan"), 0)
    with pytest.raises(TypeError, match="bn: eps must be a real number"):
        validate.check_scalar("bn", "eps", "small", 0)
    with pytest.raises(ValueError, match=r"bn: gamma must have shape \(3,\)"):
        validate.check_vector("bn", "gamma", np.zeros(4), 3)


def test_contiguous_keeps_zero_d_and_copies_views_once():
    assert kernels.contiguous(np.array(1.0)).shape == ()
    a = np.zeros((4, 3)).T
    c = kernels.contiguous(a)
    assert c.flags.c_contiguous and np.shares_memory(a, a) and not np.shares_memory(a, c)
    b = np.zeros((2, 2))
    assert kernels.contiguous(b) is b


def test_unwrap_takes_a_tensors_array_and_passes_anything_else():
    from numbafuse import Tensor, autograd
    a = np.ones(3)
    assert autograd.unwrap(Tensor(a)) is a
    assert autograd.unwrap(a) is a and autograd.unwrap(None) is None


def test_backend_of_names_what_it_accepts():
    with pytest.raises(TypeError, match=r"^op: x must be a NumPy array or a CUDA array, "
                                        r"got list$"):
        backend.backend_of("op", x=[1.0])
