"""Testing helpers users can reuse: :func:`gradcheck` and Hypothesis ``strategies``.

``numbafuse.testing.strategies`` needs Hypothesis (the ``test`` extra); it is imported only
when asked for.
"""
from .gradcheck import GradcheckError, gradcheck

__all__ = ["gradcheck", "GradcheckError", "strategies"]


def __getattr__(name):
    if name == "strategies":
        from . import strategies
        return strategies
    raise AttributeError(name)
