"""Every test that needs PyTorch carries the ``torch`` marker, so that .ci/run's torch leg
(``pytest -m torch``) runs it: the legs without torch only skip it (tests/conftest.py)."""
import ast
import pathlib
from types import SimpleNamespace

import pytest

from .conftest import unmarked_torch_skip

TESTS = pathlib.Path(__file__).resolve().parent


def _is_torch_importorskip(node):
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
            and node.args and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "torch")


def _marks_torch(value):
    """Whether a ``pytestmark = ...`` value is or holds ``pytest.mark.torch``."""
    items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return any(isinstance(v, ast.Attribute) and v.attr == "torch" for v in items)


def unmarked_modules(paths):
    """The test modules that skip at import for want of torch (a module-level
    ``pytest.importorskip("torch")``) and set no ``pytestmark`` with ``pytest.mark.torch``."""
    out = []
    for path in paths:
        tree = ast.parse(path.read_text())
        skips = any(_is_torch_importorskip(n) for stmt in tree.body
                    for n in ast.walk(stmt) if not isinstance(stmt, (ast.FunctionDef,
                                                                      ast.ClassDef)))
        marked = any(isinstance(stmt, ast.Assign) and any(
            getattr(t, "id", None) == "pytestmark" for t in stmt.targets)
            and _marks_torch(stmt.value) for stmt in tree.body)
        if skips and not marked:
            out.append(path.name)
    return out


def test_modules_that_skip_without_torch_at_import_are_marked():
    assert unmarked_modules(sorted(TESTS.glob("test_*.py"))) == []


def test_an_unmarked_module_is_found(tmp_path):
    body = 'import pytest\n\npytest.importorskip("torch")\n\n\ndef test_x():\n    pass\n'
    (tmp_path / "test_a.py").write_text(body)
    (tmp_path / "test_b.py").write_text(body + "\npytestmark = pytest.mark.torch\n")
    (tmp_path / "test_c.py").write_text(
        body + "\npytestmark = [pytest.mark.slow, pytest.mark.torch]\n")
    (tmp_path / "test_d.py").write_text(   # a test body's own importorskip: the hook's case
        'import pytest\n\n\ndef test_x():\n    pytest.importorskip("torch")\n')
    assert unmarked_modules(sorted(tmp_path.glob("test_*.py"))) == ["test_a.py"]


def _item(marked):
    return SimpleNamespace(nodeid="tests/test_x.py::test_y",
                           get_closest_marker=lambda name: object() if marked else None)


@pytest.mark.parametrize("reason", ["could not import 'torch': No module named 'torch'",
                                    "PyTorch is not installed (pip install 'numbafuse[torch]')"])
def test_a_skip_for_want_of_torch_fails_an_unmarked_test(reason):
    why = unmarked_torch_skip(_item(False), pytest.skip.Exception(reason))
    assert why is not None and "not marked torch" in why
    assert unmarked_torch_skip(_item(True), pytest.skip.Exception(reason)) is None


def test_other_skips_pass_through():
    for reason in ("NUMBAFUSE_TEST_SM90=0: CI compiles for sm_90 in its newest-Python leg only",
                   "the simulator has only numba's launch"):
        assert unmarked_torch_skip(_item(False), pytest.skip.Exception(reason)) is None
