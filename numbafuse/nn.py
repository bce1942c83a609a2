"""Layers: a tiny ``torch.nn`` for numbafuse ops.

A :class:`Module` holds parameters (``Tensor`` with ``requires_grad=True``), buffers (plain
arrays such as batch norm's running statistics, updated in place by the ops) and sub-modules.
Parameters and sub-modules are registered by attribute assignment, buffers by
:meth:`Module.register_buffer`; assigning a new array to a buffer's name keeps it a buffer
(as in PyTorch). ``m(x)`` calls ``m.forward(x)``; ``m.train()`` / ``m.eval()`` set the
``training`` flag of the whole tree; ``m.to("cuda")`` moves every parameter and buffer to the
device (numba device arrays), keeping the same ``Tensor`` objects so an optimizer built before
the move still holds them.

Unfused layers: :class:`Conv2d`, :class:`BatchNorm2d`, :class:`ReLU`, :class:`Linear`,
:class:`MaxPool2d`, :class:`Flatten`, :class:`GlobalAvgPool2d`.
Fused layers: :class:`Conv2dBiasReLU` (conv -> bias -> relu), :class:`BatchNormAddReLU`
(batch norm -> add the residual ``z`` -> relu, called as ``m(x, z)``) and
:class:`ConvBatchNormReLU` (conv -> batch norm [-> relu] trained with recompute; in ``eval()``
the batch norm is folded into the conv's weights and bias).

Names, state and initialisation are PyTorch's. Parameters are ``weight`` and ``bias``;
batch norm's buffers are ``running_mean``, ``running_var`` and ``num_batches_tracked`` (a 0-d
int64 counter of training batches, kept on the host), so :meth:`Module.state_dict` has the keys,
shapes and dtypes of the ``torch.nn`` layer's, and :meth:`Module.load_state_dict` takes a PyTorch
``state_dict()`` as it is (torch tensors, NumPy or CUDA arrays; without ``num_batches_tracked``,
as PyTorch accepts). :class:`ConvBatchNormReLU` keeps its batch norm in a ``bn`` sub-module, as
PyTorch's ``torch.ao.nn.intrinsic.qat.ConvBnReLU2d`` does (keys ``weight``, ``bn.weight``,
``bn.bias``, ``bn.running_mean``...). Conv and linear weights are ``kaiming_uniform(a=sqrt(5))``,
i.e. ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, and so are biases; batch norm starts at
``weight=1, bias=0, running_mean=0, running_var=1``. Draws come from the
``rng`` argument (a ``numpy.random.Generator``) or from the module-level generator that
:func:`init.seed` resets, so the same seed builds the same weights, and a fused model and its
unfused twin built with the same seed draw the same weights in the same order.

Examples
--------
>>> import numpy as np
>>> from numbafuse import nn
>>> nn.init.seed(0)
>>> m = nn.Sequential(nn.Conv2dBiasReLU(1, 4, 3, padding=1), nn.GlobalAvgPool2d(),
...                   nn.Linear(4, 10))
>>> m(np.zeros((2, 1, 8, 8), np.float32)).shape
(2, 10)
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from . import backend, validate
from .autograd import Tensor
from .ops.basic import flatten, global_avg_pool2d, linear, max_pool2d, relu
from .ops.batchnorm import batchnorm, batchnorm_add_relu
from .ops.conv import bias_add, conv2d, conv_bias_relu
from .ops.conv_batchnorm import ConvBatchNormReLU as _ConvBatchNormReLUFn

DEFAULT_DTYPE = np.float32
KAIMING_A = math.sqrt(5.0)     # PyTorch's default negative slope for conv/linear weights


# --------------------------------------------------------------------------- initialisation

class _Init:
    """PyTorch-style initialisers drawing from one module-level, re-seedable generator."""

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def seed(self, s):
        """Reset the module-level generator: the same seed builds the same weights."""
        self.rng = np.random.default_rng(s)

    def generator(self, rng=None):
        return self.rng if rng is None else rng

    @staticmethod
    def kaiming_uniform_bound(fan_in, a=KAIMING_A):
        """``gain * sqrt(3 / fan_in)`` with ``gain = sqrt(2 / (1 + a^2))`` (leaky-ReLU gain)."""
        gain = math.sqrt(2.0 / (1.0 + a * a))
        return gain * math.sqrt(3.0 / fan_in)

    def kaiming_uniform(self, shape, fan_in, dtype=DEFAULT_DTYPE, rng=None, a=KAIMING_A):
        bound = self.kaiming_uniform_bound(fan_in, a)
        return self.generator(rng).uniform(-bound, bound, shape).astype(dtype)

    def bias_uniform(self, n, fan_in, dtype=DEFAULT_DTYPE, rng=None):
        """PyTorch's bias default, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
        bound = 1.0 / math.sqrt(fan_in)
        return self.generator(rng).uniform(-bound, bound, (n,)).astype(dtype)


init = _Init()


def _param(array):
    return Tensor(array, requires_grad=True)


# --------------------------------------------------------------------------- Module

class Module:
    """Base class: registers parameters, buffers and sub-modules by attribute assignment."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_host_buffers", set())   # buffer names that .to() leaves
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call Module.__init__() first")
        is_param = isinstance(value, Tensor) and value.requires_grad
        if name in self._buffers and not is_param and not isinstance(value, Module):
            self._buffers[name] = value       # still a buffer: .to() and state_dict see it
            return
        for registry in (self._parameters, self._buffers, self._modules):
            registry.pop(name, None)
        if is_param:
            self.__dict__.pop(name, None)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self.__dict__.pop(name, None)
            self._modules[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name):  # only called when normal lookup fails
        for registry in ("_parameters", "_buffers", "_modules"):
            d = self.__dict__.get(registry)
            if d is not None and name in d:
                return d[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def register_buffer(self, name, array, host=False):
        """A non-trainable array (e.g. running statistics), moved by :meth:`to`; with
        ``host=True`` it stays on the host (a counter such as ``num_batches_tracked``)."""
        self._parameters.pop(name, None)
        self.__dict__.pop(name, None)
        self._buffers[name] = array
        if host:
            self._host_buffers.add(name)

    # -- calling
    def forward(self, *inputs):
        raise NotImplementedError

    def __call__(self, *inputs):
        return self.forward(*inputs)

    # -- traversal
    def named_modules(self, prefix=""):
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        return (m for _, m in self.named_modules())

    def children(self):
        return iter(self._modules.values())

    def named_parameters(self, prefix=""):
        """``(dotted name, Tensor)`` of every parameter, each once, in registration order."""
        seen = set()
        for mname, m in self.named_modules(prefix):
            for pname, p in m._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mname}.{pname}" if mname else pname), p

    def parameters(self):
        """Every trainable Tensor (``requires_grad=True``), each once."""
        return (p for _, p in self.named_parameters())

    def named_buffers(self, prefix=""):
        for mname, m in self.named_modules(prefix):
            for bname, b in m._buffers.items():
                yield (f"{mname}.{bname}" if mname else bname), b

    # -- modes
    def train(self, mode=True):
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    # -- state
    def _state_entries(self):
        """``(dotted name, module, registry, key)`` of every parameter and buffer, module by
        module (each module's parameters, then its buffers), in PyTorch's ``state_dict`` order."""
        for m_name, m in self.named_modules():
            for registry in ("_parameters", "_buffers"):
                for key in getattr(m, registry):
                    yield (f"{m_name}.{key}" if m_name else key), m, registry, key

    def state_dict(self):
        """Host copies of every parameter and buffer, by dotted name, in PyTorch's order and
        with PyTorch's names (``num_batches_tracked`` a 0-d int64 array)."""
        state = OrderedDict()
        for name, m, registry, key in self._state_entries():
            value = getattr(m, registry)[key]
            state[name] = (value.numpy() if isinstance(value, Tensor)
                           else backend.to_host(value)).copy()
        return state

    def load_state_dict(self, state):
        """Copy the arrays of ``state`` into this module's parameters and buffers.

        ``state`` maps dotted names to NumPy arrays, CUDA arrays or torch tensors (a PyTorch
        ``state_dict()`` as it is: tensors are read through ``.detach().cpu().numpy()``, so
        numbafuse never imports torch). Values are cast to each parameter's dtype. Missing or
        unexpected keys raise ``KeyError`` and a wrong shape ``ValueError``, before anything is
        written; a missing ``num_batches_tracked`` keeps the module's count, as PyTorch does.
        """
        entries = {name: (m, registry, key) for name, m, registry, key in self._state_entries()}
        missing = [n for n in entries if n not in state and not _optional_key(n)]
        unexpected = [n for n in state if n not in entries]
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
        updates = []
        for name, (m, registry, key) in entries.items():
            if name not in state:
                continue
            old = getattr(m, registry)[key]
            old_data = old.data if isinstance(old, Tensor) else old
            updates.append((m, registry, key, _like(old_data, _host_array(state[name]), name)))
        for m, registry, key, new in updates:          # every value checked: now write
            if registry == "_parameters":
                m._parameters[key].data = new
                m._parameters[key].grad = None
            else:
                m._buffers[key] = new
        return self

    # -- device
    def to(self, device):
        """Move parameters and buffers to ``"cpu"`` or ``"cuda"`` (in place; returns self)."""
        if device not in (backend.CPU, backend.CUDA):
            raise ValueError(f"Module.to: device must be 'cpu' or 'cuda', got {device!r}")
        move = backend.to_device if device == backend.CUDA else backend.to_host
        for p in self.parameters():
            p.data = move(p.data)
            p.grad = None
        for m in self.modules():
            for name in list(m._buffers):
                if name not in m._host_buffers:
                    m._buffers[name] = move(m._buffers[name])
        return self

    @property
    def device(self):
        p = next(iter(self.parameters()), None)
        return backend.CPU if p is None else p.device

    # -- printing
    def extra_repr(self):
        return ""

    def __repr__(self):
        if not self._modules:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"  {self.extra_repr()}"] if self.extra_repr() else []
        lines += [f"  ({name}): " + repr(m).replace("\n", "\n  ")
                  for name, m in self._modules.items()]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


OPTIONAL_STATE = ("num_batches_tracked",)   # keys a state dict may lack (PyTorch's rule)


def _optional_key(name):
    return name.rpartition(".")[2] in OPTIONAL_STATE


def _host_array(value):
    """A state-dict value as a host NumPy array: NumPy and CUDA arrays, and torch tensors
    (duck-typed by ``detach``/``cpu``/``numpy``: this module never imports torch)."""
    if isinstance(value, np.ndarray):
        return value
    if all(hasattr(value, a) for a in ("detach", "cpu", "numpy")):
        return value.detach().cpu().numpy()
    if backend.is_device_array(value):
        return backend.to_host(value)
    return np.asarray(value)


def _like(old, new_host, name):
    """``new_host`` cast to ``old``'s dtype, on ``old``'s device, after a shape check."""
    if tuple(np.shape(old)) != new_host.shape:
        raise ValueError(f"load_state_dict: {name} has shape {new_host.shape}, "
                         f"expected {tuple(np.shape(old))}")
    new_host = np.array(new_host, dtype=old.dtype, order="C")          # a copy of its own
    return backend.to_device(new_host) if backend.is_device_array(old) else new_host


class Sequential(Module):
    """Modules applied in order: ``Sequential(a, b)(x) == b(a(x))``."""

    def __init__(self, *modules):
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


# --------------------------------------------------------------------------- shared pieces

def _conv_weight(in_channels, out_channels, k, dtype, rng, groups=1):
    """(K, C/groups, R, S) kaiming-uniform conv weight; fan_in = C/groups*R*S."""
    R, S = (k, k) if np.ndim(k) == 0 else tuple(k)
    fan_in = in_channels // groups * R * S
    return (init.kaiming_uniform((out_channels, in_channels // groups, R, S), fan_in, dtype,
                                 rng), fan_in)


def _check_groups(layer, in_channels, out_channels, groups):
    """``groups`` a positive int dividing both channel counts (the layer's error)."""
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)):
        raise TypeError(f"{layer}: groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"{layer}: groups must be >= 1, got {groups!r}")
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"{layer}: groups={groups} must divide in_channels={in_channels} and "
                         f"out_channels={out_channels}")
    return int(groups)


class _BatchNormState(Module):
    """The state of ``torch.nn.BatchNorm2d``, names and order included: parameters
    ``weight = 1``, ``bias = 0``; buffers ``running_mean = 0``, ``running_var = 1`` and
    ``num_batches_tracked = 0`` (0-d int64, on the host).

    ``momentum=None`` is PyTorch's cumulative moving average: each training batch (an empty
    one included) is counted, then weighted ``1 / num_batches_tracked``; an empty batch
    updates no statistic, and a refused one is not counted (:meth:`counted`). ``momentum``
    is checked (in [0, 1], or None) where it is used, at a training call, before anything is
    written, naming the layer called (``ConvBatchNormReLU``, not its ``bn``); construction
    and inference take any value, as PyTorch's layers do. ``comm`` (a
    ``numbafuse.distributed.Communicator``): synchronized batch norm in training, the
    statistics of the batch of all ranks.
    """

    def __init__(self, num_features, eps, momentum, layout, dtype, comm=None):
        super().__init__()
        self.comm = comm
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.layout = validate.check_layout(type(self).__name__, layout)
        self.weight = _param(np.ones(num_features, dtype))
        self.bias = _param(np.zeros(num_features, dtype))
        self.register_buffer("running_mean", np.zeros(num_features, dtype))
        self.register_buffer("running_var", np.ones(num_features, dtype))
        self.register_buffer("num_batches_tracked", np.zeros((), np.int64), host=True)

    def step_momentum(self, layer=None):
        """The running-statistics factor of this call; in training, first checks ``momentum``
        (an error naming ``layer``, this layer's class by default) and counts the batch
        (``num_batches_tracked += 1``, in place), as ``torch.nn.BatchNorm2d.forward`` does."""
        if not self.training:
            return 0.0 if self.momentum is None else self.momentum    # unused in inference
        if self.momentum is not None:
            validate.check_scalar(layer or type(self).__name__, "momentum", self.momentum,
                                  lo=0.0, hi=1.0)
        self.num_batches_tracked[...] += 1
        if self.momentum is None:                                      # cumulative average
            backend.require_eager("batch norm with momentum=None (its factor, 1 / "
                                  "num_batches_tracked, is counted on the host)")
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def counted(self, call, layer=None):
        """``call(momentum)`` with this batch's factor (:meth:`step_momentum`, errors naming
        ``layer``); a call that raises (bad input) leaves ``num_batches_tracked`` as it was, so
        a refused batch changes no state. (PyTorch counts the batch before ``F.batch_norm``
        checks it.)"""
        before = int(self.num_batches_tracked)
        try:
            return call(self.step_momentum(layer))
        except BaseException:
            self.num_batches_tracked[...] = before
            raise

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


def _geometry_repr(m):
    return (f"{m.in_channels}, {m.out_channels}, kernel_size={m.kernel_size}, "
            f"stride={m.stride}, padding={m.padding}, dilation={m.dilation}, "
            f"layout={m.layout!r}" + (f", groups={m.groups}" if m.groups != 1 else ""))


# --------------------------------------------------------------------------- unfused layers

class Conv2d(Module):
    """``conv2d(x, w) [+ b]`` with ``w`` of shape ``(out, in/groups, k, k)`` (unfused);
    ``groups`` as PyTorch's (``groups == in_channels``: depthwise)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 dilation=1, bias=True, layout="NCHW", *, groups=1, dtype=DEFAULT_DTYPE,
                 rng=None):
        super().__init__()
        self.in_channels, self.out_channels, self.kernel_size = (in_channels, out_channels,
                                                                 kernel_size)
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.groups = _check_groups(type(self).__name__, in_channels, out_channels, groups)
        self.layout = validate.check_layout(type(self).__name__, layout)
        w, fan_in = _conv_weight(in_channels, out_channels, kernel_size, dtype, rng,
                                 self.groups)
        self.weight = _param(w)
        self.bias = _param(init.bias_uniform(out_channels, fan_in, dtype, rng)) if bias else None

    def forward(self, x):
        y = conv2d(x, self.weight, stride=self.stride, padding=self.padding,
                   dilation=self.dilation, layout=self.layout, groups=self.groups)
        return y if self.bias is None else bias_add(y, self.bias, layout=self.layout)

    def extra_repr(self):
        return _geometry_repr(self) + f", bias={self.bias is not None}"


class BatchNorm2d(_BatchNormState):
    """Batch norm over ``N, H, W`` per channel (unfused); the state of ``torch.nn.BatchNorm2d``."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, layout="NCHW", *,
                 dtype=DEFAULT_DTYPE, comm=None):
        super().__init__(num_features, eps, momentum, layout, dtype, comm)

    def forward(self, x):
        return self.counted(lambda momentum: batchnorm(
            x, self.weight, self.bias, running_mean=self.running_mean,
            running_var=self.running_var, training=self.training, momentum=momentum,
            eps=self.eps, layout=self.layout, comm=self.comm))


class ReLU(Module):
    def forward(self, x):
        return relu(x)


class Linear(Module):
    """``x @ w.T + b`` with ``w`` of shape ``(out_features, in_features)``."""

    def __init__(self, in_features, out_features, bias=True, *, dtype=DEFAULT_DTYPE, rng=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(init.kaiming_uniform((out_features, in_features), in_features,
                                                  dtype, rng))
        self.bias = _param(init.bias_uniform(out_features, in_features, dtype, rng)) if (
            bias) else None

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class MaxPool2d(Module):
    """Max over ``k x k`` windows, stride ``k`` by default, no padding."""

    def __init__(self, kernel_size, stride=None, layout="NCHW"):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride
        self.layout = validate.check_layout("MaxPool2d", layout)

    def forward(self, x):
        if self.layout == "NCHW":
            return max_pool2d(x, self.kernel_size, self.stride)
        return max_pool2d(x, self.kernel_size, self.stride, layout=self.layout)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}"


class Flatten(Module):
    """``(N, ...) -> (N, prod(...))``."""

    def forward(self, x):
        return flatten(x)


class GlobalAvgPool2d(Module):
    """Mean over ``H, W``: ``(N, C, H, W) -> (N, C)``."""

    def __init__(self, layout="NCHW"):
        super().__init__()
        self.layout = validate.check_layout("GlobalAvgPool2d", layout)

    def forward(self, x):
        if self.layout == "NCHW":
            return global_avg_pool2d(x)
        return global_avg_pool2d(x, layout=self.layout)


# --------------------------------------------------------------------------- fused layers

class Conv2dBiasReLU(Conv2d):
    """Fused ``relu(conv2d(x, w) + b)``; the parameters, init and arguments of ``Conv2d``."""

    def forward(self, x):
        return conv_bias_relu(x, self.weight, self.bias, stride=self.stride,
                              padding=self.padding, dilation=self.dilation, layout=self.layout,
                              groups=self.groups)


class BatchNormAddReLU(_BatchNormState):
    """Fused ``relu(batchnorm(x) + z)``, called as ``m(x, z)``; the state of ``BatchNorm2d``
    (and so of ``torch.nn.BatchNorm2d``)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, layout="NCHW", *,
                 dtype=DEFAULT_DTYPE, comm=None):
        super().__init__(num_features, eps, momentum, layout, dtype, comm)

    def forward(self, x, z):
        return self.counted(lambda momentum: batchnorm_add_relu(
            x, z, self.weight, self.bias, running_mean=self.running_mean,
            running_var=self.running_var, training=self.training, momentum=momentum,
            eps=self.eps, layout=self.layout, comm=self.comm))


class ConvBatchNormReLU(Module):
    """Fused conv (no bias) -> batch norm [-> relu].

    Training saves only the conv input (the conv is recomputed in backward); ``eval()``
    folds the batch norm into the conv's weights and bias. ``recompute=False`` trades memory
    for speed: the conv output and a 1-bit ReLU mask are kept instead (still less than the
    unfused chain keeps). State: the conv's ``weight`` (as ``Conv2d(bias=False)``) and the
    batch norm's in the sub-module ``bn`` (a :class:`BatchNorm2d`: ``bn.weight``, ``bn.bias``,
    ``bn.running_mean``, ``bn.running_var``, ``bn.num_batches_tracked``), the keys of
    PyTorch's ``torch.ao.nn.intrinsic.qat.ConvBnReLU2d``. A PyTorch ``Conv2d`` + ``BatchNorm2d``
    pair loads as ``{"weight": conv["weight"], **{"bn." + k: v for k, v in bn.items()}}``.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 dilation=1, relu=True, eps=1e-5, momentum=0.1, layout="NCHW", *,
                 recompute=True, groups=1, dtype=DEFAULT_DTYPE, rng=None, comm=None):
        super().__init__()
        self.in_channels, self.out_channels, self.kernel_size = (in_channels, out_channels,
                                                                 kernel_size)
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.groups = _check_groups("ConvBatchNormReLU", in_channels, out_channels, groups)
        self.relu = bool(relu)
        self.recompute = bool(recompute)
        self.layout = validate.check_layout("ConvBatchNormReLU", layout)
        self.weight = _param(_conv_weight(in_channels, out_channels, kernel_size, dtype, rng,
                                          self.groups)[0])
        self.bn = BatchNorm2d(out_channels, eps, momentum, layout, dtype=dtype, comm=comm)

    def forward(self, x):
        # conv_batchnorm_relu(...) with the recompute policy (not in the public signature)
        bn = self.bn
        return bn.counted(lambda momentum: _ConvBatchNormReLUFn(
            running_mean=bn.running_mean, running_var=bn.running_var,
            training=self.training, momentum=momentum, eps=bn.eps,
            stride=self.stride, padding=self.padding, dilation=self.dilation, relu=self.relu,
            layout=self.layout, recompute=self.recompute, comm=bn.comm,
            groups=self.groups).apply(
                x, self.weight, bn.weight, bn.bias), layer="ConvBatchNormReLU")

    # the batch norm's running statistics, read through the conv layer too (``self.bn`` owns
    # them: the state_dict lists them once, as bn.running_mean / bn.running_var)
    running_mean = property(lambda self: self.bn.running_mean)
    running_var = property(lambda self: self.bn.running_var)

    def extra_repr(self):
        return _geometry_repr(self) + f", relu={self.relu}, recompute={self.recompute}"


__all__ = ["Module", "Sequential", "Conv2d", "BatchNorm2d", "ReLU", "Linear", "MaxPool2d",
           "Flatten", "GlobalAvgPool2d", "Conv2dBiasReLU", "BatchNormAddReLU",
           "ConvBatchNormReLU", "init"]
