"""``fuse(model)``: numbafuse's remapper for PyTorch models, on ``torch.fx``.

    fuse(model, *, leaf_modules=(), copy=True) -> torch.fx.GraphModule

The model is traced by ``torch.fx`` (``torch.nn`` layers, numbafuse's own modules and the
``leaf_modules`` given are leaves: called, not traced into), then its graph is visited from the
output back, as numbafuse's remapper visits its own (:mod:`numbafuse.fusion.remap`); at each
node the patterns ending there are tried, longest first:

    Conv2d -> BatchNorm2d -> add -> ReLU    conv_batchnorm_add_relu (recompute)
    BatchNorm2d -> add -> ReLU              batchnorm_add_relu
    Conv2d -> BatchNorm2d -> ReLU           conv_batchnorm_relu (recompute)
    Conv2d -> ReLU   (bias or not)          conv_bias_relu
    Conv2d -> BatchNorm2d                   conv_batchnorm_relu(relu=False) (recompute)
    MaxPool2d                               numbafuse's max pool (``numbafuse.torch.pool``:
                                            not a fusion; PyTorch's NCHW CPU kernel is slow)

``add`` is ``a + b``, ``a += b``, ``torch.add(a, b)``, ``a.add(b)`` or ``a.add_(b)`` (no
``alpha``); ReLU is an ``nn.ReLU`` module (in place or not, shared by several call sites or
not), ``torch.relu``, ``F.relu`` or ``.relu()`` and their in-place forms. A match replaces its
nodes by one call of a *site function* (:mod:`numbafuse.torch.sites`), whose arguments are the
activations and the modules themselves (``get_attr`` nodes): the conv and batch-norm modules
stay where they were in the module tree, registered once, and the fused op reads their
parameters, buffers, ``training``, ``momentum`` and ``eps`` at each call, updates the running
statistics in their buffers and counts ``num_batches_tracked`` as ``BatchNorm2d.forward``
does. A site function checks its modules and tensors at every call and runs the original
modules instead (logging a warning once per site) when numbafuse's kernels cannot stand for
them: a module replaced or given hooks after ``fuse``, a dtype other than float32/float64/half, an
input neither contiguous nor channels_last, a residual of another shape (broadcast), autocast.
Grouped and depthwise convs (``groups``) fuse; channels_last activations run numbafuse's NHWC
kernels without a copy and the fused model's outputs keep that memory format.

Every match and every refusal (a pattern whose nodes match but a condition does not hold) is
logged with its reason: to the ``numbafuse.torch`` logger (INFO), to stderr with
``NUMBAFUSE_LOG=fuse``, and in the returned module's ``fuse_log`` (a list of lines).
"""
from __future__ import annotations

import copy as _copy
import dataclasses
import logging
import operator
import os
import sys

import torch
from torch import nn

from .. import validate
from .layers import BatchNormAddReLU2d, ConvBiasReLU2d
from .sites import (SITE_FUNCTIONS, bn_refusal, conv_refusal, fused_bn_add_relu,
                    fused_conv_bn_add_relu, fused_conv_bn_relu, fused_conv_relu, pool_refusal,
                    pooled_max)

F = nn.functional
LOG_ENV = "NUMBAFUSE_LOG"      # NUMBAFUSE_LOG=fuse prints fuse's log to stderr
LOG_TOPIC = "fuse"
logger = logging.getLogger("numbafuse.torch")

FUSE_CONV_BN_ADD_RELU = "Fuse Conv2d with BatchNorm2d, add and ReLU"
FUSE_BN_ADD_RELU = "Fuse BatchNorm2d with add and ReLU"
FUSE_CONV_BN_RELU = "Fuse Conv2d with BatchNorm2d and ReLU"
FUSE_CONV_RELU = "Fuse Conv2d with ReLU"
FUSE_CONV_BN = "Fuse Conv2d with BatchNorm2d"
RUN_MAX_POOL = "Run MaxPool2d on numbafuse's max pool"

NUMBAFUSE_MODULES = (ConvBiasReLU2d, BatchNormAddReLU2d)     # leaves: never traced into
RELU_FUNCTIONS = (torch.relu, torch.relu_, F.relu, F.relu_)
RELU_METHODS = ("relu", "relu_")
ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
ADD_METHODS = ("add", "add_")
INPLACE_FUNCTIONS = (operator.iadd, operator.isub, operator.imul, operator.itruediv,
                     operator.setitem, torch.relu_, F.relu_)


# --------------------------------------------------------------------------- matching

@dataclasses.dataclass
class Match:
    """A fusion: ``chain`` (nodes, the root last) becomes one call of ``function``."""
    title: str
    chain: list
    function: object
    args: tuple                # fx Nodes, constants, and _Module(target) for get_attr nodes


@dataclasses.dataclass
class Refusal:
    chain: list
    reason: str


@dataclasses.dataclass(frozen=True)
class _Module:
    target: str                # the module's qualified name, read by a get_attr node


class _Matcher:
    """The facts every pattern needs about one traced graph."""

    def __init__(self, gm):
        self.modules = dict(gm.named_modules())
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.fused = set()

    def module(self, node, kind):
        """The module of ``node`` if it is a live call of a ``kind`` module (else None)."""
        if not isinstance(node, torch.fx.Node) or node in self.fused:
            return None
        if node.op == "call_module" and isinstance(self.modules[node.target], kind):
            return self.modules[node.target]
        return None

    def relu_input(self, node):
        """The input of ``node`` if it is a live ReLU (else None)."""
        if node in self.fused or not node.args or len(node.args) > 2:
            return None
        if node.op == "call_module" and type(self.modules[node.target]) is nn.ReLU:
            return node.args[0]
        if node.op == "call_function" and node.target in RELU_FUNCTIONS:
            return node.args[0]
        if node.op == "call_method" and node.target in RELU_METHODS and len(node.args) == 1:
            return node.args[0]
        return None

    def add_operands(self, node):
        """(a, b, in_place) if ``node`` is a live ``a + b`` of two graph values (else None)."""
        if not isinstance(node, torch.fx.Node) or node in self.fused:
            return None
        if len(node.args) != 2 or node.kwargs or not all(isinstance(a, torch.fx.Node)
                                                         for a in node.args):
            return None
        if node.op == "call_function" and node.target in ADD_FUNCTIONS:
            return node.args[0], node.args[1], node.target is operator.iadd
        if node.op == "call_method" and node.target in ADD_METHODS:
            return node.args[0], node.args[1], node.target == "add_"
        return None

    def users_reason(self, chain):
        """Why the chain's intermediate values cannot disappear (None if they can)."""
        for node, after in zip(chain, chain[1:]):
            if list(node.users) != [after]:
                return f"{name(node)}'s output has {len(node.users)} users"
        return None

    def writes_into(self, node, value):
        """Does ``node`` modify ``value`` in place?"""
        if not node.args or node.args[0] is not value:
            return False
        if node.op == "call_method":
            return node.target.endswith("_")
        if node.op == "call_function":
            return (node.target in INPLACE_FUNCTIONS or bool(node.kwargs.get("inplace"))
                    or (node.target is F.relu and len(node.args) > 1 and bool(node.args[1])))
        if node.op == "call_module":
            return bool(getattr(self.modules[node.target], "inplace", False))
        return False

    def mutation_reason(self, value, start, root):
        """Why ``value``, read at ``start``, cannot be read at ``root`` instead (None if it
        can): a node between them modifies it in place."""
        for node in value.users:             # (nodes inserted by fuse write into nothing)
            if self.order[start] < self.order.get(node, -1) < self.order[root] and \
                    self.writes_into(node, value):
                return f"{name(value)} is modified in place by {name(node)} before {name(root)}"
        return None


def name(node):
    """A node's name in the log: the module's qualified name, else the node's."""
    return node.target if node.op == "call_module" else node.name


def _conv_bn_reason(m, conv_node, bn_node):
    return (conv_refusal(m.modules[conv_node.target], with_bn=True)
            or bn_refusal(m.modules[bn_node.target]))


def _bn_side(m, root):
    """(add, bn_node, z, refusal) for ``relu(add(bn(...), z))`` ending at ``root``."""
    add = m.relu_input(root)
    operands = m.add_operands(add)
    if operands is None:
        return None
    a, b, in_place = operands
    if m.module(a, nn.BatchNorm2d) is not None:
        return add, a, b, None
    if m.module(b, nn.BatchNorm2d) is not None:
        if in_place:
            return add, b, a, (f"{name(add)} adds in place into {name(a)}, not into the batch "
                               f"norm's output")
        return add, b, a, None
    return None


def conv_bn_add_relu(m, root):
    found = _bn_side(m, root)
    if found is None:
        return None
    add, bn_node, z, reason = found
    conv_node = bn_node.args[0] if len(bn_node.args) == 1 else None
    if m.module(conv_node, nn.Conv2d) is None or len(conv_node.args) != 1:
        return None
    chain = [conv_node, bn_node, add, root]
    x = conv_node.args[0]
    reason = (reason or _conv_bn_reason(m, conv_node, bn_node) or m.users_reason(chain)
              or (z in chain and "the residual is the batch norm's output")
              or m.mutation_reason(x, conv_node, root) or m.mutation_reason(z, add, root))
    if reason:
        return Refusal(chain, reason)
    return Match(FUSE_CONV_BN_ADD_RELU, chain, fused_conv_bn_add_relu,
                 (x, z, _Module(conv_node.target), _Module(bn_node.target)))


def bn_add_relu(m, root):
    found = _bn_side(m, root)
    if found is None:
        return None
    add, bn_node, z, reason = found
    if len(bn_node.args) != 1:
        return None
    chain = [bn_node, add, root]
    x = bn_node.args[0]
    reason = (reason or bn_refusal(m.modules[bn_node.target]) or m.users_reason(chain)
              or (z in chain and "the residual is the batch norm's output")
              or m.mutation_reason(x, bn_node, root) or m.mutation_reason(z, add, root))
    if reason:
        return Refusal(chain, reason)
    return Match(FUSE_BN_ADD_RELU, chain, fused_bn_add_relu, (x, z, _Module(bn_node.target)))


def _conv_bn(m, bn_node, root, title, relu):
    conv_node = bn_node.args[0] if len(bn_node.args) == 1 else None
    if m.module(conv_node, nn.Conv2d) is None or len(conv_node.args) != 1:
        return None
    chain = [conv_node, bn_node] + ([root] if root is not bn_node else [])
    x = conv_node.args[0]
    reason = (_conv_bn_reason(m, conv_node, bn_node) or m.users_reason(chain)
              or m.mutation_reason(x, conv_node, root))
    if reason:
        return Refusal(chain, reason)
    return Match(title, chain, fused_conv_bn_relu,
                 (x, _Module(conv_node.target), _Module(bn_node.target), relu))


def conv_bn_relu(m, root):
    bn_node = m.relu_input(root)
    if m.module(bn_node, nn.BatchNorm2d) is None:
        return None
    return _conv_bn(m, bn_node, root, FUSE_CONV_BN_RELU, True)


def conv_bn(m, root):
    if m.module(root, nn.BatchNorm2d) is None:
        return None
    return _conv_bn(m, root, root, FUSE_CONV_BN, False)


def conv_relu(m, root):
    conv_node = m.relu_input(root)
    if m.module(conv_node, nn.Conv2d) is None or len(conv_node.args) != 1:
        return None
    chain = [conv_node, root]
    reason = (conv_refusal(m.modules[conv_node.target]) or m.users_reason(chain)
              or m.mutation_reason(conv_node.args[0], conv_node, root))
    if reason:
        return Refusal(chain, reason)
    return Match(FUSE_CONV_RELU, chain, fused_conv_relu,
                 (conv_node.args[0], _Module(conv_node.target)))


def max_pool(m, root):
    pool = m.module(root, nn.MaxPool2d)
    if pool is None or len(root.args) != 1 or root.kwargs:
        return None
    reason = pool_refusal(pool)
    if reason:
        return Refusal([root], reason)
    return Match(RUN_MAX_POOL, [root], pooled_max, (root.args[0], _Module(root.target)))


# patterns ending at a ReLU, longest first; then those ending at a batch norm; the max pool
PATTERNS = (conv_bn_add_relu, bn_add_relu, conv_bn_relu, conv_relu, conv_bn, max_pool)


# --------------------------------------------------------------------------- fuse

class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer with numbafuse's modules and the user's leaves kept as leaves, and
    the site functions of an already fused model kept as calls."""

    def __init__(self, leaf_modules=()):     # (no argument: torch.load re-traces with it)
        super().__init__(autowrap_functions=SITE_FUNCTIONS)
        self.leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
        self.leaf_names = {t for t in leaf_modules if isinstance(t, str)}
        self.user_leaves = {}              # qualified name -> type name, as traced

    def is_leaf_module(self, module, qualified_name):
        if isinstance(module, self.leaf_types) or qualified_name in self.leaf_names:
            self.user_leaves[qualified_name] = type(module).__name__
            return True
        if isinstance(module, NUMBAFUSE_MODULES):
            return True
        return super().is_leaf_module(module, qualified_name)


def fuse(model, *, leaf_modules=(), copy=True, recompute=True):
    """Rewrite ``model``'s Conv/BatchNorm/add/ReLU chains into numbafuse's fused ops.

    Parameters
    ----------
    model : torch.nn.Module
        Traced with ``torch.fx`` (its ``forward`` must be symbolically traceable: no control
        flow on tensor values; mark a submodule that is not as a leaf).
    leaf_modules : iterable of module types or qualified names
        Submodules called as they are, not traced into (nothing inside them is fused).
    copy : bool
        True (default): the result owns a deep copy of ``model``'s modules; False: it shares
        them (parameters, buffers) with ``model``, whose own ``forward`` is left as it is.
    recompute : True, False or "auto"
        True (default, the design's contract: backward keeps only the conv input): each fused
        Conv-BatchNorm chain keeps its conv's input and recomputes the conv output in
        backward (the least memory). False: it keeps the conv output too (and a 1-bit ReLU
        mask) and backward runs no conv forward: faster, with about the memory of PyTorch's
        unfused chain (less: a Conv-BN-ReLU's output feeding another fused conv is not
        kept, that conv keeps the producer's h instead and rebuilds the output from it in
        backward, ``numbafuse.torch.conv_batchnorm.SOURCE``). "auto": False where a value
        of the conv output costs at least ``numbafuse.torch.conv_batchnorm.KEEP_H_MIN_MACS``
        (256) multiply-adds to recompute (C/groups * R * S; in a CNN all but the stem and
        the narrowest 1x1 convs) or where it has at most half the input's values (a
        strided 1x1 downsample), True elsewhere: at batch 16, 64x64, activations kept 15.0
        MB on ResNet-18 (PyTorch's 29.1: 0.52) and 61.1 on ResNet-50 (112.8: 0.54)
        (``benchmarks/fuse_saved_bytes.py``).
        (Under ``torch.compile`` the custom ops recompute.)

    The convs it fuses get their weights in torch's default memory format, in place (the
    same Parameters and values): a channels_last model's (``model.to(memory_format=
    torch.channels_last)``, for oneDNN) would be copied to that at every call. Inputs and
    outputs keep channels_last (numbafuse's NHWC kernels); refused convs keep their format.

    Returns
    -------
    FusedModule (a torch.fx.GraphModule)
        Computes what ``model`` computes. Its module tree, parameters, buffers and
        ``state_dict`` keys (in order) are ``model``'s (the conv and BatchNorm2d modules
        included, so checkpoints load both ways and ``isinstance(m, nn.BatchNorm2d)`` recipes
        find them); only ``forward`` is the rewritten graph. ``fuse_log``: one line per fusion
        made or refused, and per user leaf.

    Examples
    --------
    >>> import torch, numbafuse.torch as nft
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False),
    ...                             torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    >>> fused = nft.fuse(model)
    >>> fused.fuse_log
    ['Fuse Conv2d with BatchNorm2d and ReLU: 0, 1, 2 -> fused_0_1_2']
    >>> list(fused.state_dict()) == list(model.state_dict())
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"numbafuse.torch.fuse: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    recompute = validate.check_recompute("numbafuse.torch.fuse", recompute)
    fused = _fuse(_copy.deepcopy(model) if copy else model, tuple(leaf_modules), recompute)
    if LOG_TOPIC in os.environ.get(LOG_ENV, "").split(","):
        for line in fused.fuse_log:
            print(f"numbafuse.torch.fuse: {line}", file=sys.stderr)
    for line in fused.fuse_log:
        logger.info(line)
    return fused


class FusedModule(torch.fx.GraphModule):
    """What :func:`fuse` returns: a ``torch.fx.GraphModule`` (named after the model's class)
    whose module tree is the model's. ``copy.deepcopy`` and pickling (``torch.save``) copy the
    model (``unfuse(fused)``) and fuse the copy again, the same way (``torch.fx``'s own copy
    would rebuild the module tree from the traced paths only), so a copy is the same module
    tree and graph; edits made to ``graph`` by hand are not carried over."""

    def __deepcopy__(self, memo):
        result = _fuse(_copy.deepcopy(unfuse(self), memo), self._fuse_leaves,
                       self._fuse_recompute)
        memo[id(self)] = result
        return result

    def __reduce__(self):
        return _fuse, (unfuse(self), self._fuse_leaves, self._fuse_recompute)


def _fuse(root, leaf_modules, recompute=True):
    """Trace ``root``, rewrite the graph, give the result ``root``'s module tree (shared)."""
    tracer = _Tracer(leaf_modules)
    graph = tracer.trace(root)
    fused = FusedModule(tracer.root, graph, type(root).__name__)
    log = [f"kept {qualname} ({kind}) as a leaf: not traced into, nothing inside it fused"
           for qualname, kind in tracer.user_leaves.items()]
    log += _rewrite(fused, recompute)
    _adopt_module_tree(fused, root)
    _contiguous_weights(fused)
    fused.training = root.training       # the flag only: the modules keep their own modes
    fused.graph.lint()
    fused.recompile()
    fused.fuse_log = log
    fused._fuse_leaves = leaf_modules
    fused._fuse_recompute = recompute
    fused.__dict__["_numbafuse_unfused"] = root     # for unfuse; not a submodule (no new keys)
    return fused


def unfuse(fused):
    """``fuse``'s inverse: the model object whose modules ``fused`` holds, with its own
    (unfused) ``forward``: ``model`` itself after ``fuse(model, copy=False)``, else the deep
    copy ``fuse`` made. It shares every module, parameter and buffer with ``fused``, so what
    ``fused`` learned is in it (and ``unfuse(fused).state_dict()`` is ``fused``'s).

    Examples
    --------
    >>> import torch, numbafuse.torch as nft
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    >>> fused = nft.fuse(model)
    >>> back = nft.unfuse(fused)
    >>> type(back).__name__, back[0] is fused.get_submodule("0")
    ('Sequential', True)
    """
    model = getattr(fused, "__dict__", {}).get("_numbafuse_unfused")
    if model is None:
        raise TypeError(f"numbafuse.torch.unfuse: {type(fused).__name__} is not a model made "
                        f"by numbafuse.torch.fuse")
    model.training = fused.training      # its children are fused's: only its own flag lags
    return model


def _rewrite(gm, recompute=True):
    """Apply the patterns to ``gm.graph`` in place, visiting it from the output back; the
    log lines, in the order decided. ``recompute``: the Conv-BatchNorm sites' (True, False or
    "auto")."""
    m = _Matcher(gm)
    refusals, log = [], []
    for root in reversed(list(gm.graph.nodes)):
        if root in m.fused or root.op not in ("call_module", "call_function", "call_method"):
            continue
        for pattern in PATTERNS:
            result = pattern(m, root)
            if result is None or _already_refused(result, refusals):
                continue
            if isinstance(result, Refusal):
                refusals.append(result)
                log.append(f"refused {'->'.join(_kind(m, n) for n in result.chain)}: "
                           f"{result.reason} [nodes {', '.join(name(n) for n in result.chain)}]")
                continue
            chain = ", ".join(name(n) for n in result.chain)     # before the nodes go
            new = _replace(gm.graph, result, recompute)
            m.fused.update(result.chain)
            log.append(f"{result.title}: {chain} -> {new.name}")
            break
    return log


def _already_refused(result, refusals):
    """A refusal already logged for a longer chain, with the same reason (say it once)."""
    return isinstance(result, Refusal) and any(
        r.reason == result.reason and set(result.chain) <= set(r.chain) for r in refusals)


def _kind(m, node):
    """A node's kind in the log: its module's class, ``add`` or ``relu``."""
    if node.op == "call_module":
        return type(m.modules[node.target]).__name__
    return "add" if m.add_operands(node) is not None else "relu"


# the sites that take recompute= (their chains begin with a conv whose output feeds a batch norm)
_KEEPS_H = (fused_conv_bn_relu, fused_conv_bn_add_relu)


def _replace(graph, match, recompute=True):
    """Insert the site call before the chain's root, reroute the root's users, erase the
    chain; the new node (a Conv-BatchNorm site's gets ``recompute=`` unless it is True, the
    site's default)."""
    root = match.chain[-1]
    site = ", ".join(name(n) for n in match.chain)
    with graph.inserting_before(root):
        args = tuple(graph.get_attr(a.target) if isinstance(a, _Module) else a
                     for a in match.args)
        short = [name(match.chain[0])] + [name(n).rpartition(".")[2] for n in match.chain[1:]]
        kwargs = ({} if recompute is True or match.function not in _KEEPS_H
                  else {"recompute": recompute})
        new = graph.create_node("call_function", match.function, args + (site,), kwargs,
                                name="fused_" + "_".join(short).replace(".", "_"))
    root.replace_all_uses_with(new)
    for node in reversed(match.chain):
        graph.erase_node(node)
    return new


def _contiguous_weights(gm):
    """The weights of the convs the fused sites call, in torch's default memory format, in
    place (``w.data``; the same values and Parameter objects): numbafuse's kernels read
    (K, C, R, S). A channels_last weight (``model.to(memory_format=torch.channels_last)``,
    which a PyTorch user makes for oneDNN's convs) was copied to that at every call and its
    gradient copied back: ~16 ms a step of a channels_last ResNet-50 at batch 16, 64x64 on
    machine A, where the whole step took 270-280 ms. The convs fuse refused, which PyTorch
    runs, keep their format."""
    for node in gm.graph.nodes:
        sites = [u for u in node.users if u.op == "call_function" and u.target in SITE_FUNCTIONS]
        if node.op != "get_attr" or not sites:
            continue
        try:
            conv = gm.get_submodule(node.target)
        except AttributeError:                  # (a tensor attribute, not a module)
            continue
        w = getattr(conv, "weight", None) if isinstance(conv, nn.Conv2d) else None
        if isinstance(w, torch.Tensor) and w.dim() == 4 and not w.is_contiguous():
            with torch.no_grad():
                w.data = w.data.contiguous()


def _adopt_module_tree(gm, model):
    """Give ``gm`` ``model``'s own children, parameters and buffers (in ``model``'s order), in
    place of the shells ``GraphModule`` builds from the traced paths: the same module objects,
    the same ``state_dict`` keys in the same order, and the modules no node calls are kept.
    What the tracer added (tensor constants) stays, after them, out of the state_dict."""
    extra = ({k: v for k, v in gm._modules.items() if k not in model._modules},
             {k: v for k, v in gm._parameters.items() if k not in model._parameters},
             {k: v for k, v in gm._buffers.items() if k not in model._buffers})
    gm._modules.clear()
    gm._parameters.clear()
    gm._buffers.clear()
    gm._non_persistent_buffers_set.clear()
    for name_, child in model._modules.items():
        gm._modules[name_] = child
    for name_, p in model._parameters.items():
        gm.register_parameter(name_, p)
    for name_, b in model._buffers.items():
        gm.register_buffer(name_, b, persistent=name_ not in model._non_persistent_buffers_set)
    for name_, child in extra[0].items():
        gm._modules[name_] = child
    for name_, p in extra[1].items():
        gm.register_parameter(name_, p)
    for name_, b in extra[2].items():
        gm.register_buffer(name_, b, persistent=False)


__all__ = ["fuse", "unfuse", "FusedModule", "PATTERNS"]
