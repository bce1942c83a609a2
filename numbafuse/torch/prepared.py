"""Calls whose signature passed every check before: the checks skipped (issue 34: the
per-call cost). Inference calls of ``batchnorm_add_relu`` then run the kernel that call ran
straight; the Conv-BatchNorm functions reuse what their checks returned (``CHECKED``).

A call of :func:`numbafuse.torch.batchnorm_add_relu` in inference (``training=False``) that
autograd does not record (``torch.no_grad()``, or no input requiring grad), outside a graph
capture, on CPU float32 or float64 tensors, is checked by reading its tensors' types,
shapes, strides, dtypes, devices and ``requires_grad``, and its ``eps``: nothing else. So a
call whose :func:`signature` (those, as one tuple) equals that of an earlier call that
passed every check passes them again, and runs what that call ran after them
(``ops.batchnorm.cpu_forward``: the same kernel on the same arrays, the same bits).

Nothing derived from a tensor's *values* is kept: the running statistics, weight and bias are
read anew at every call, so a write that no version counter sees (``t.data.copy_(...)``)
cannot leave a result stale. The Conv-BatchNorm functions' checks (``conv_batchnorm._check``:
the tensors' types, shapes, strides, dtypes and ``requires_grad`` on the CPU, the conv
arguments, training, momentum, eps) return the device, the geometry, momentum and eps, none
of them read from a value: a call with a signature checked before (:func:`checks_signature`)
takes them from :data:`CHECKED`, in training too. The signatures are kept in
:data:`VALIDATED` and :data:`CHECKED`, at most each
:data:`MAX_SIGNATURES` (then none is added: a long-running process with ever new shapes keeps
the first ones, each a tuple of a few dozen small objects).

Measured (``python benchmarks/bench_torch_call.py``, one thread, machine F): BN + add + ReLU
in inference at (2, 8, 4, 4), 82 us a call by the checked path, 29-30 so (PyTorch's three
unfused ops: 10); the Conv-BN-ReLU forward 183 -> 166 us in training, 139 -> 123 in eval.
"""
import torch

from ..kernels.conv import cpu_plan as _cpu_plan, weights as _weights
from ..kernels.cpu import launch as _launch, recorded as _recorded
from ..ops import batchnorm as _bn
from .bridge import FLOAT_DTYPES

VALIDATED = {}            # signature -> the layout (NCHW or NHWC) its x runs in
MAX_SIGNATURES = 1024


def checks_signature(op, tensors, scalars):
    """The tuple that decides every check of a call of ``op``: each of ``tensors`` (or None)
    by its type, shape, strides, dtype and ``requires_grad``, each of ``scalars`` (the conv
    arguments too) with its type; or None (a graph capture, a tensor off the CPU: a CUDA
    call's checks also read numba's current device; an unhashable argument such as a list)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    sigs = []
    for t in tensors:
        if t is None:
            sigs.append(None)
        elif not isinstance(t, torch.Tensor) or not t.is_cpu:
            return None
        else:
            sigs.append((type(t), t.shape, t.stride(), t.dtype, t.requires_grad))
    key = (op, tuple(sigs)) + tuple((type(v), v) for v in scalars)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def signature(training, x, z, weight, bias, running_mean, running_var, eps):
    """:func:`checks_signature` of a ``batchnorm_add_relu`` call this module runs, or None
    (training, recorded by autograd, not float32/float64, a None or non-tensor x, z, weight
    or bias, or as :func:`checks_signature`)."""
    if training is not False:
        return None
    try:
        if torch.is_grad_enabled() and (x.requires_grad or z.requires_grad
                                        or weight.requires_grad or bias.requires_grad):
            return None
        if x.dtype not in FLOAT_DTYPES:
            return None
    except AttributeError:                 # an argument that is not a tensor: the checks say
        return None
    return checks_signature("batchnorm_add_relu, inference",
                            (x, z, weight, bias, running_mean, running_var), (eps,))


CHECKED = {}              # checks_signature -> what the checks returned (no value read)


def keep(table, sig, value):
    """``table[sig] = value`` (:data:`VALIDATED` or :data:`CHECKED`: a call with ``sig``
    passed every check), unless ``sig`` is None or the table holds :data:`MAX_SIGNATURES`."""
    if sig is not None and len(table) < MAX_SIGNATURES:
        table[sig] = value


def checked(op, tensors, scalars, checks):
    """What ``checks()`` (every check of a call of ``op``: raises or returns what the call
    needs, nothing read from a value) returned for a call with this call's
    :func:`checks_signature` before (:data:`CHECKED`), else its result now, kept."""
    sig = checks_signature(op, tensors, scalars)
    found = CHECKED.get(sig)
    if found is None:
        found = checks()
        keep(CHECKED, sig, found)
    return found


def batchnorm_add_relu(layout, x, z, weight, bias, running_mean, running_var, eps):
    """y of a call whose signature is in :data:`VALIDATED` (with ``layout``): as
    ``layers.BatchNormAddReLUFunction.forward`` computes it in inference."""
    # (the views bridge.as_array makes, for the CPU float tensors a signature here has: its
    # device, dtype and contiguity tests cost 3 us of this call's ~30)
    arrays = [t.detach().numpy() if t.requires_grad else t.numpy()
              for t in (x, z, weight, bias, running_mean, running_var)]
    if layout == "NHWC":
        arrays[0], arrays[1] = (a.transpose(0, 2, 3, 1) for a in arrays[:2])
    y = torch.from_numpy(_bn.cpu_forward(*arrays, False, 0.0, float(eps), layout, False)[0])
    return y.permute(0, 3, 1, 2) if layout == "NHWC" else y


def core(device, dtype, fn, *args):
    """``fn(*args)``, a tape-free core of the ops layer (``ops.conv_batchnorm.forward``,
    ``backward``, ``add_forward``, ``add_backward``, ``inference``) on the arrays of a call's
    tensors: on CPU float32 or float64 tensors, with the weight cache off, a prepared call
    (``kernels/cpu/recorded.py``: its launches recorded for the call's signature and
    replayed, the same bits without the host path that chose them; its signature includes
    the conv rules in force, ``kernels.conv.cpu_plan.using``); else as it is."""
    if device.type != "cpu" or dtype not in FLOAT_DTYPES or _weights.is_enabled():
        return fn(*args)
    return _recorded.call(fn, args, (_launch.num_threads(), _cpu_plan.current_rules()))
