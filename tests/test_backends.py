"""Every backend's kernel module implements its op family's Protocol in full
(``numbafuse/kernels/interfaces.py``): the ops call these functions without probing for them.
A module may take more parameters after the protocol's, with defaults (the CPU conv's
``plan=``, which tests and benchmarks pass)."""
import importlib
import inspect

import pytest

from numbafuse.kernels import interfaces


def _members(protocol):
    """{name: parameter names (without self)} of the protocol's methods, and its constants."""
    methods = {name: [p for p in inspect.signature(fn).parameters if p != "self"]
               for name, fn in vars(protocol).items()
               if inspect.isfunction(fn) and not name.startswith("_")}
    return methods, dict(getattr(protocol, "__annotations__", {}))


CASES = [(family, which) for family, (_, modules) in interfaces.FAMILIES.items()
         for which in modules]


@pytest.mark.parametrize("family, which", CASES)
def test_backend_module_implements_its_family_protocol(family, which):
    if which.startswith("cuda"):
        pytest.importorskip("numba.cuda")
    protocol = interfaces.FAMILIES[family][0]
    module = importlib.import_module(f"numbafuse.kernels.{family}.{which}")
    methods, constants = _members(protocol)
    assert methods, protocol
    for name, params in methods.items():
        fn = getattr(module, name, None)
        assert callable(fn), f"{module.__name__} lacks {name}"
        sig = inspect.signature(fn).parameters
        got = list(sig)
        assert got[:len(params)] == params, (
            f"{module.__name__}.{name}{tuple(got)}: the protocol has {params}")
        extra = [p for p in got[len(params):] if sig[p].default is inspect.Parameter.empty]
        assert not extra, f"{module.__name__}.{name}: required parameters {extra} beyond it"
    for name, kind in constants.items():
        assert isinstance(getattr(module, name, None), kind), f"{module.__name__}.{name}"


def test_the_check_sees_a_missing_function(monkeypatch):
    module = importlib.import_module("numbafuse.kernels.batchnorm.cpu")
    monkeypatch.delattr(module, "apply_running")
    with pytest.raises(AssertionError, match="lacks apply_running"):
        test_backend_module_implements_its_family_protocol("batchnorm", "cpu")
