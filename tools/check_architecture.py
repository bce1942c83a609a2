"""Check numbafuse's layering: no import cycle, no upward import, no module over 650 lines;
no function over 12 parameters, no private name imported from another module, no capability
probe (getattr/hasattr) in ``numbafuse/ops`` -- beyond the recorded debt.

    python tools/check_architecture.py          # prints the layers and exits 1 on a violation
    python tools/check_architecture.py --debt   # prints the debt found now, in DEBT's format

The debt (``tools/architecture_debt.txt``) lists what broke the last three rules when they
were added: one line ``kind name count`` each. It may only shrink: a new entry, or a count
that grew, is a violation, and so is an entry that no longer applies (delete its line).
Functions are named by module and qualified name (``numbafuse.nn.Linear.__init__``).
``PUBLIC_SIGNATURES`` names the public signatures allowed over the parameter limit, with
the reason for each.

Every ``import`` and ``from ... import`` in the package is read from the source (the ones
inside functions too) and resolved to a module of the package. The layers below go from the
bottom up; a module may import modules of lower layers and modules of its own package or
module (``numbafuse.kernels.conv.cpu`` may import ``numbafuse.kernels.conv.math`` and
``numbafuse.kernels``), never a module of a higher layer, and the whole import graph must be
free of cycles. ``numbafuse/__init__.py`` is the top: it re-exports the public names.
"""
from __future__ import annotations

import ast
import pathlib
import sys

PACKAGE = "numbafuse"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE
MAX_LINES = 650
MAX_PARAMETERS = 12
DEBT = pathlib.Path(__file__).resolve().parent / "architecture_debt.txt"

# Public signatures over MAX_PARAMETERS, each for its reason: options a user passes by
# keyword, named and ordered as PyTorch's (DESIGN.md's contract). The rule holds for every
# other function; an entry that falls within the limit is a violation (delete it).
_TORCH_CONV_BN = "F.conv2d's and F.batch_norm's arguments, as DESIGN.md's contract"
PUBLIC_SIGNATURES = {
    "numbafuse.ops.conv_batchnorm.conv_batchnorm_relu":
        _TORCH_CONV_BN + ", and relu, layout, comm, groups",
    "numbafuse.ops.conv_batchnorm.conv_batchnorm_relu_backward":
        "conv_batchnorm_relu's arguments, dy and need",
    "numbafuse.reference.conv_batchnorm_relu":
        "the public function's signature: the harness calls both with one set of arguments",
    "numbafuse.reference.conv_batchnorm_relu_backward":
        "the public backward's signature, as the forward's",
    "numbafuse.torch.conv_batchnorm.conv_batchnorm_relu":
        _TORCH_CONV_BN + " (in F.batch_norm's order), and relu, groups, recompute",
    "numbafuse.torch.conv_batchnorm.conv_batchnorm_add_relu":
        _TORCH_CONV_BN + " (in F.batch_norm's order), z, groups, recompute",
    "numbafuse.nn.ConvBatchNormReLU.__init__":
        "nn.Conv2d's and nn.BatchNorm2d's constructor arguments, relu, layout, dtype, rng",
    "numbafuse.train.fit":
        "the training loop's options, each a flag of python -m numbafuse.train",
}

# Bottom first. A name stands for that module and everything under it.
LAYERS = [
    ["numbafuse.jit_cache"],                 # numba's cache stamps: a file and its imports
    ["numbafuse.cuda"],                      # the one import of numba.cuda
    ["numbafuse.backend"],                   # host/device, allocation, copies
    ["numbafuse.validate"],                  # argument checks and geometry
    ["numbafuse.kernels"],                   # Numba CPU and CUDA kernels per op family
    ["numbafuse.reference"],                 # plain NumPy/SciPy: the specification
    ["numbafuse.autograd"],                  # Tensor, Function, the backward pass
    ["numbafuse.ops"],                       # Functions and public functions per op family
    ["numbafuse.nn", "numbafuse.optim", "numbafuse.data", "numbafuse.testing",
     "numbafuse.distributed"],
    ["numbafuse.fusion", "numbafuse.torch"],  # the remapper; PyTorch interoperation
    ["numbafuse.models"],                    # the digits ResNets
    ["numbafuse.train"],                     # fit / evaluate
    ["numbafuse.cli", "numbafuse.precompile"],   # the command lines
    ["numbafuse.__main__", "numbafuse.train.__main__"],   # python -m entry points
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    """{module name: path} of every module of the package."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(current: str, is_package: bool, node, known) -> list:
    """The package modules an import statement depends on (relative imports resolved):
    ``from p import m`` depends on the module ``p.m`` when there is one, else on ``p``
    (the parent packages Python imports on the way are not dependencies of the design)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = current if is_package else current.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
            for a in node.names]


def imports(known: dict) -> dict:
    """{module: set of package modules it imports, anywhere in its source}."""
    graph = {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(name, is_package, node, known):
                    if target in known and target != name:
                        found.add(target)
        graph[name] = found
    return graph


def layer_of(name: str):
    """(layer index, the LAYERS entry it falls under): the longest matching entry wins."""
    best = (None, None)
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and (
                    best[1] is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    return best


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def violations() -> list:
    """Every problem found, one line each (empty when the house is in order)."""
    known = modules()
    graph = imports(known)
    problems = []
    for name, path in known.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{name}: {lines} lines (> {MAX_LINES})")
        if name == PACKAGE:
            continue
        layer, home = layer_of(name)
        if layer is None:
            problems.append(f"{name}: in no layer (add it to LAYERS)")
            continue
        for target in sorted(graph[name]):
            if target == PACKAGE:
                problems.append(f"{name} imports the top-level package")
                continue
            t_layer, t_home = layer_of(target)
            if t_home == home:
                continue                 # within its own package or module
            if t_layer is None or t_layer >= layer:
                problems.append(f"{name} (layer {layer}) imports {target} "
                                f"(layer {t_layer}): not a lower layer")
    for component in cycles(graph):
        problems.append("import cycle: " + " -> ".join(component))
    return problems + debt_violations() + signature_violations()


def _parameters(fn) -> int:
    """Parameters a caller passes: a method's receiver (``self``, ``cls``) is not one."""
    a = fn.args
    receiver = int(bool(a.args) and a.args[0].arg in ("self", "cls"))
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - receiver


def _functions(tree, prefix=""):
    """(qualified name, node) of every function in ``tree``: ``f``, ``Class.method``,
    ``f.inner``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def over_the_limit() -> dict:
    """{module.qualname: parameters} of every function over MAX_PARAMETERS parameters."""
    found = {}
    for name, path in modules().items():
        for qualname, node in _functions(ast.parse(path.read_text(), str(path))):
            n = _parameters(node)
            if n > MAX_PARAMETERS:
                found[f"{name}.{qualname}"] = n
    return found


def signature_violations(over=None) -> list:
    """An entry of PUBLIC_SIGNATURES that is no longer over the limit (delete it)."""
    over = over_the_limit() if over is None else over
    return [f"parameters: {name}: within the limit now, delete its PUBLIC_SIGNATURES entry"
            for name in sorted(PUBLIC_SIGNATURES) if name not in over]


def debt_found() -> dict:
    """{(kind, name): count} of what breaks the three debt rules now: ``parameters`` (a
    function over MAX_PARAMETERS parameters: its count), ``private-import`` (module:name
    imported from another package module: 1 per importing module), ``probe`` (getattr or
    hasattr calls in a module of numbafuse.ops: their number)."""
    known = modules()
    found = {("parameters", name): n for name, n in over_the_limit().items()
             if name not in PUBLIC_SIGNATURES}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                targets = _resolve(name, is_package, node, known)
                for alias, target in zip(node.names, targets):
                    if (alias.name.startswith("_") and not alias.name.startswith("__")
                            and target != name):
                        key = ("private-import", f"{name}:{target}.{alias.name}")
                        found[key] = 1
            elif (name.startswith(PACKAGE + ".ops") and isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                            "hasattr")):
                found["probe", name] = found.get(("probe", name), 0) + 1
    return found


def debt_recorded() -> dict:
    out = {}
    for line in DEBT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            kind, name, count = line.split()
            out[kind, name] = int(count)
    return out


def debt_violations(found=None, recorded=None) -> list:
    """New debt, grown debt and paid debt still listed, one line each."""
    found = debt_found() if found is None else found
    recorded = debt_recorded() if recorded is None else recorded
    problems = []
    for key, n in sorted(found.items()):
        if key not in recorded:
            problems.append(f"{key[0]}: {key[1]} ({n}): new (limit: parameters "
                            f"{MAX_PARAMETERS}, no private import, no probe in ops)")
        elif n > recorded[key]:
            problems.append(f"{key[0]}: {key[1]}: {n}, more than the recorded {recorded[key]}")
    for key in sorted(set(recorded) - set(found)):
        problems.append(f"{key[0]}: {key[1]}: paid, delete its line from {DEBT.name}")
    return problems


def main() -> int:
    if "--debt" in sys.argv[1:]:
        for (kind, name), n in sorted(debt_found().items()):
            print(kind, name, n)
        return 0
    for i, layer in enumerate(LAYERS):
        print(f"  {i:2d}  {', '.join(m.removeprefix(PACKAGE + '.') for m in layer)}")
    problems = violations()
    for line in problems:
        print("VIOLATION", line)
    print(f"{len(modules())} modules, {len(problems)} violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
