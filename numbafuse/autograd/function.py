"""``Function``: one forward/backward pair on the tape, its typed parameters and named
residuals; the grad mode (``no_grad``) and the apply hooks (how the remapper traces).

A subclass declares its non-array parameters as a frozen dataclass ``Params`` (no defaults:
the public function's signature is the one source of defaults), implements
``forward(*arrays) -> array`` and ``backward(dy) -> one gradient per forward argument``, and
declares what backward reads with ``save_for_backward(name=array, ...)``, read back as
``self.saved.name``. The grad mode and the hooks are per thread, like PyTorch's grad mode.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import types

from .. import validate
from .tensor import Tensor


class _ThreadState(threading.local):
    def __init__(self):
        self.recording = True     # is the tape recording? (no_grad turns it off)
        self.depth = 0            # Function.apply calls on the stack
        self.hooks = []           # callables hook(function, inputs, output)


_state = _ThreadState()


@contextlib.contextmanager
def no_grad():
    """Context manager: nothing is recorded on the tape inside it (in this thread)."""
    previous, _state.recording = _state.recording, False
    try:
        yield
    finally:
        _state.recording = previous


def is_recording() -> bool:
    return _state.recording


@contextlib.contextmanager
def apply_hook(hook):
    """Call ``hook(function, inputs, output)`` after every *outermost* ``Function.apply`` in
    this thread while the context is open (ops that an op calls inside its forward are part of
    that op and are not reported). ``inputs`` are the arguments as given (Tensors, arrays,
    None); ``output`` what ``apply`` returns."""
    _state.hooks.append(hook)
    try:
        yield hook
    finally:
        _state.hooks.remove(hook)


@dataclasses.dataclass(frozen=True)
class NoParams:
    """The parameters of an op that has none."""


class Function:
    """One forward/backward pair. Subclasses define ``Params``, ``forward`` and ``backward``.

    ``forward`` receives plain arrays (``None`` for absent optional inputs) and returns one
    array; ``backward`` receives the output's gradient ``dy`` and returns one gradient (or
    ``None``) per forward argument, in the forward's argument order, computing only those
    flagged in ``self.needs_input_grad``. Parameters are ``self.params.<name>``.
    """

    name = "function"  # the public op name (``"conv2d"``...), used by the remapper and in errors
    Params = NoParams

    def __init__(self, **params):
        try:
            self.params = self.Params(**params)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from None
        self.saved = types.SimpleNamespace()
        self.inputs = ()
        self.needs_input_grad = ()

    def param_dict(self) -> dict:
        """The parameters by name (arrays by reference, not copied)."""
        return {f.name: getattr(self.params, f.name) for f in dataclasses.fields(self.params)}

    def forward(self, *arrays):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def save_for_backward(self, **residuals):
        """Declare what backward reads: ``self.saved.<name>``; counted by ``saved_bytes``."""
        self.saved = types.SimpleNamespace(**residuals)

    @classmethod
    @functools.cache
    def required_inputs(cls) -> tuple:
        """The names of ``forward``'s arguments without a default: the arrays it requires
        (an optional one, such as a bias, has the default ``None``)."""
        return tuple(p.name for p in list(inspect.signature(cls.forward).parameters.values())[1:]
                     if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty)

    def apply(self, *inputs):
        """Run forward. Arrays in: an array out. Any Tensor in: a Tensor out, on the tape.
        ``None`` for a required array is a TypeError naming the op and the argument."""
        if any(i is None for i in inputs):
            validate.check_given(self.name, **dict(zip(self.required_inputs(), inputs)))
        any_tensor = any(isinstance(i, Tensor) for i in inputs)
        arrays = [i.data if isinstance(i, Tensor) else i for i in inputs]
        recording = _state.recording
        self.needs_input_grad = tuple(recording and isinstance(i, Tensor) and i.requires_grad
                                      for i in inputs)
        _state.depth += 1
        try:
            out = self.forward(*arrays)
        finally:
            _state.depth -= 1
        if any_tensor:
            out = Tensor(out)
            if recording and any(self.needs_input_grad):
                out.requires_grad = True
                out._fn = self
                self.inputs = tuple(i if isinstance(i, Tensor) else None for i in inputs)
        if out is None or not getattr(out, "_fn", None):
            self.saved = types.SimpleNamespace()  # nothing will read it: free it now
        if _state.depth == 0:
            for hook in tuple(_state.hooks):
                hook(self, inputs, out)
        return out
