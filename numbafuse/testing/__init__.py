"""Testing helpers users can reuse: :func:`gradcheck` and Hypothesis ``strategies``.

``numbafuse.testing.strategies`` needs Hypothesis (the ``test`` extra); it is imported only
when asked for.
"""
import importlib

from .finite_diff import GradcheckError, gradcheck

__all__ = ["gradcheck", "GradcheckError", "strategies"]


def __getattr__(name):
    if name == "strategies":
        return importlib.import_module(f"{__name__}.strategies")
    raise AttributeError(name)
