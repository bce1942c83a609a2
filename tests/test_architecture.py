"""The house: layers without cycles (tools/check_architecture.py), modules and public names
that never disagree, the public API of DESIGN.md, and ops described once (numbafuse.ops.OPS)."""
import importlib
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import numbafuse as nf
from numbafuse.ops import OPS

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_architecture  # noqa: E402

# The names DESIGN.md's public API promises at the top level.
PUBLIC = ["conv_bias_relu", "batchnorm_add_relu", "conv_batchnorm_relu", "conv2d", "bias_add",
          "relu", "add", "batchnorm", "linear", "max_pool2d", "global_avg_pool2d", "flatten",
          "squeeze", "cross_entropy", "conv_bias_relu_backward", "batchnorm_add_relu_backward",
          "Tensor", "no_grad", "gradcheck", "saved_bytes", "trace", "remap", "compile", "nn",
          "optim"]


def test_no_upward_import_no_cycle_no_module_over_650_lines():
    assert check_architecture.violations() == []


def test_the_checker_finds_a_cycle():
    assert check_architecture.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]]
    assert check_architecture.cycles({"a": {"b"}, "b": set()}) == []


def _submodules():
    return [m.name for m in pkgutil.walk_packages(nf.__path__, "numbafuse.")
            if not m.name.endswith("__main__")]


# Submodules with an optional dependency: (module, the distribution it needs)
OPTIONAL = {"numbafuse.torch": "torch"}


@pytest.mark.parametrize("name", sorted(set(_submodules()) | set(OPTIONAL)))
def test_a_module_and_its_attribute_never_disagree(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name], reason=f"{name} needs {OPTIONAL[name]}")
    module = importlib.import_module(name)
    parent, _, leaf = name.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is module


def test_fusion_is_a_module_and_the_remapper_functions_are_top_level():
    import numbafuse.fusion
    assert type(numbafuse.fusion).__name__ == "module"
    assert callable(nf.remap) and callable(nf.trace) and callable(nf.compile)
    assert nf.remap.__module__ == "numbafuse.fusion.remap"


@pytest.mark.parametrize("name", PUBLIC)
def test_design_public_api_is_exported(name):
    assert hasattr(nf, name)


def test_importing_numbafuse_does_not_import_numba_cuda_or_torch():
    code = ("import sys, numbafuse; bad = [m for m in ('numba.cuda', 'torch', 'numbafuse.cuda')"
            " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_is_described_once_and_consistently(name):
    spec = OPS[name]
    assert spec.function.__name__ == name
    assert spec.arrays, f"{name}: no array arguments"
    assert not set(spec.arrays) & set(spec.keywords), f"{name}: an argument is both"
    for param in spec.params:    # every Function parameter is a keyword of the function
        assert param in spec.keywords or param in ("sign", "op", "scale", "shape", "recompute"), \
            f"{name}: Function parameter {param!r} is not an argument of {name}()"


@pytest.mark.parametrize("name", [n for n in sorted(OPS) if OPS[n].backward])
def test_numpy_style_backwards_return_gradients_in_forward_argument_order(name):
    spec = OPS[name]
    doc = spec.backward.__doc__
    expected = "(" + ", ".join("d" + a for a in spec.arrays) + ")"
    assert expected in doc.replace("\n", " "), f"{spec.backward.__name__}: {expected} not in " \
                                               f"its docstring"


def test_docs_ops_table_is_generated_from_ops():
    from numbafuse.ops.__main__ import table
    assert (ROOT / "docs" / "ops.md").read_text() == table(), \
        "docs/ops.md is stale: python -m numbafuse.ops > docs/ops.md"


def test_numbafuse_torch_without_torch_says_how_to_install_it():
    code = ("import sys; sys.modules['torch'] = None\n"      # import torch -> ImportError
            "try:\n    import numbafuse.torch\nexcept ImportError as e:\n    print(e)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install 'numbafuse[torch]'" in run.stdout, run.stdout + run.stderr


def test_the_debt_only_shrinks():
    # tools/architecture_debt.txt: functions over 12 parameters, private names imported from
    # another module, capability probes in ops/ -- a new one, a grown one, or a paid one still
    # listed is a violation
    recorded = {("parameters", "m.f"): 14, ("private-import", "m:n._x"): 1}
    assert check_architecture.debt_violations(dict(recorded), recorded) == []
    grown = check_architecture.debt_violations({("parameters", "m.f"): 15,
                                                ("private-import", "m:n._x"): 1}, recorded)
    assert grown == ["parameters: m.f: 15, more than the recorded 14"]
    new = check_architecture.debt_violations({**recorded, ("probe", "numbafuse.ops.x"): 1},
                                             recorded)
    assert len(new) == 1 and new[0].startswith("probe: numbafuse.ops.x (1): new")
    paid = check_architecture.debt_violations({("parameters", "m.f"): 14}, recorded)
    assert paid == ["private-import: m:n._x: paid, delete its line from "
                    "architecture_debt.txt"]


def test_the_debt_rules_see_what_they_count(tmp_path, monkeypatch):
    # the rules read real source: a 13-parameter function, a private import from a sibling
    # module and a getattr in ops/ are found; 12 parameters and a dunder import are not
    pkg = tmp_path / "numbafuse"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _h(): pass\n__all__ = []\n"
                              "def ok(a, b, c, d, e, f, g, h, i, j, k, l): pass\n"
                              "def long(a, b, c, d, e, f, g, h, i, j, k, l, *, m): pass\n"
                              "class K:\n"
                              "    def m(self, a, b, c, d, e, f, g, h, i, j, k, l, m): pass\n"
                              "def public(a, b, c, d, e, f, g, h, i, j, k, l, m, n): pass\n")
    (pkg / "ops" / "b.py").write_text("from ..a import _h, __all__\n"
                                      "x = getattr(_h, 'y', None)\n")
    monkeypatch.setattr(check_architecture, "ROOT", pkg)
    monkeypatch.setattr(check_architecture, "PUBLIC_SIGNATURES",
                        {"numbafuse.a.public": "a reason", "numbafuse.a.ok": "a reason"})
    assert check_architecture.debt_found() == {
        ("parameters", "numbafuse.a.long"): 13,
        ("parameters", "numbafuse.a.K.m"): 13,           # a method: by its qualified name
        ("private-import", "numbafuse.ops.b:numbafuse.a._h"): 1,
        ("probe", "numbafuse.ops.b"): 1}
    # a listed public signature is no debt; a listed one within the limit is a violation
    assert check_architecture.signature_violations() == [
        "parameters: numbafuse.a.ok: within the limit now, delete its PUBLIC_SIGNATURES entry"]


def test_public_signatures_over_the_limit_are_public_and_say_why():
    # each exemption names a public function (no underscore in its path) with a reason
    for name, reason in check_architecture.PUBLIC_SIGNATURES.items():
        assert not any(part.startswith("_") and part != "__init__"
                       for part in name.split(".")), name
        assert len(reason) > 20, name
