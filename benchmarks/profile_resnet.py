"""Where a fused ResNet's CPU training step spends its time: numbafuse's kernel launches, each
timed by name.

    python benchmarks/profile_resnet.py [--model resnet18] [--batch 16] [--size 64]
                                        [--steps 5] [--top 25]
                                        [--layers | --torch | --host | --exclusive | --gaps]
                                        [--replay REPEATS] [--recompute True|False|auto]
                                        [--channels-last] [--threads N]

The model is ``numbafuse/torch/resnet.py`` (torchvision's code; ``--model`` also takes
resnext50_32x4d and ``mobilenet.py``'s mobilenet_v2, mobilenet_v2_relu) converted by
``numbafuse.torch.fuse``; a step as in ``bench_resnet.py`` (gradients set to None, forward,
cross-entropy, backward, SGD with momentum and weight decay). Every ``launch`` of a compiled
task kernel is wrapped (``kernels/cpu/launch.launch`` and the names modules imported it
under) and its wall time added to the kernel's name, after three warm-up steps. A launch
made inside another's tasks (``launch.concurrently``, ``launch_all``: a pass's kernels run
side by side) is counted under both, so the column does not sum to the step; the rest of
the step (PyTorch's own ops, the autograd glue, Python) is the step's time less the
outermost launches'. ``--layers``: instead, the conv passes of the fused Conv-BatchNorm ops
timed by layer shape (``ops.conv_batchnorm._conv_and_stats``, ``_conv_forward`` and
``_conv_backward``: the forward with or without its statistics, the recompute, dX with dW),
ms a call and calls a step; with ``--replay REPEATS``, each pass's first call (its arrays
copied, in a step before the timed ones: not timed) is called again REPEATS times in a row
after them, and the table sets its time in the steps against that warm time (what the step's
cold caches and host path add to a pass), with the GMAC/s of a direct convolution's
multiply-adds at the warm time (what is left to the kernels: Winograd and tapwise passes do
fewer). ``--torch``: the same table for
PyTorch's own unfused model in this process (numbafuse not imported: resnet.py is loaded
from its file), from ``torch.profiler`` (the self time of ``aten::mkldnn_convolution`` and
``aten::convolution_backward`` by input shapes, over ``--steps`` profiled steps after the
warm-up): the two tables, each from its own process, show every layer in the network side by
side. ``--host``: the fused ops' autograd Functions (Conv-BN-ReLU, Conv-BN-Add-ReLU; forward
and backward) timed whole and less numbafuse's outermost launches inside them: the rest is
their host path (Python, NumPy and torch calls, compiled helpers called straight), by
Function and direction, split into the ops layer with the kernels' drivers below it and the
Functions' own torch layer, and SGD's step and the rest of the step. One process, the
library's default threads: a profile, not a comparison (``bench_resnet.py`` compares
against PyTorch; ``bench_conv_plan.py`` times each pass alone against PyTorch's).
``--exclusive``: every Python function and method that numbafuse's host side defines
(``numbafuse.torch``, ``numbafuse.ops``, the kernels' drivers; not the compiled kernels, not
the pool's modules under ``launch``) wrapped and timed *exclusive* of the wrapped functions it
calls, on every thread: ms a step, calls a step and us a call in the step, largest first, with
``launch``, ``launch_all`` and ``concurrently`` as units (their exclusive time is the kernels
and the hand-off). The wrappers cost time themselves (a few us a call with the caches cold):
the step is also timed without them, before, and both are printed; a short function
called often carries part of its callees' wrapper cost and can read high (time it by itself
before acting on it). ``--gaps``: inside the fused ops' autograd Functions, the host time
between events (the Function's start, each outermost launch's start and end, its end), each
gap added to the event it ends at: a launch by the chain of numbafuse frames that made it
(file:line(function), innermost first), or the Function's end; one clock read an event and no
other wrapper, so the step runs as unwrapped. ``--threads N``: torch's and numbafuse's
threads (default: torch's own count). The numbafuse side is profiled with prepared calls off
(``NUMBAFUSE_PREPARED=0``'s layered path, ``kernels/cpu/recorded.py``): a prepared call
replays the launches it recorded, past every wrapper here.
"""
import argparse
import collections
import contextlib
import functools
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _name(kernel):
    fn = getattr(kernel, "py_func", kernel)
    module = getattr(fn, "__module__", "") or ""
    return f"{module.rsplit('.', 1)[-1]}.{getattr(fn, '__qualname__', repr(fn))}"


def _wrap_launches(times, counts):
    """Replace ``launch`` in every numbafuse module that holds it; returns the undo."""
    from numbafuse.kernels.cpu import launch as launch_mod
    original = launch_mod.launch
    depth = [0]

    def timed(kernel, *args, **kwargs):
        name = _name(kernel)
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return original(kernel, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            depth[0] -= 1
            times[name] += dt
            counts[name] += 1
            if depth[0] == 0:
                times["(outermost launches)"] += dt

    return replace_in_numbafuse(lambda name, value: value is original, lambda value: timed)


def replace_in_numbafuse(pick, make):
    """Set each attribute of the imported numbafuse modules for which ``pick(name, value)``
    holds to ``make(value)`` (made once a value: a function imported into several modules
    gets one replacement); returns the undo. Prepared calls are off meanwhile: they replay
    the functions they recorded, past any name replaced here (``kernels/cpu/recorded.py``),
    so what is measured through the replacements is the layered path."""
    from numbafuse.kernels.cpu import recorded
    made, undo, layered = {}, [], contextlib.ExitStack()
    layered.enter_context(recorded.off())
    for m in list(sys.modules.values()):
        if not getattr(m, "__name__", "").startswith("numbafuse"):
            continue
        for name, value in list(vars(m).items()):
            if pick(name, value):
                if id(value) not in made:
                    made[id(value)] = make(value)
                setattr(m, name, made[id(value)])
                undo.append((m, name, value))

    def restore():
        for m, name, value in reversed(undo):
            setattr(m, name, value)
        layered.close()
    return restore


def _wrap_conv_passes(times, counts, captured=None):
    """Time the Conv-BatchNorm ops' conv passes by layer shape; returns the undo. ``captured``
    (a dict): each key's first call kept there as (function, arguments: arrays copied, its
    ConvGeometry), for :func:`_replayed` and the table's multiply-adds."""
    import numpy as np
    from numbafuse.ops import conv_batchnorm as cbn
    forward, backward, stats = cbn._conv_forward, cbn._conv_backward, cbn._conv_and_stats

    def key(g, kind):
        return f"{kind} {g.R}x{g.S}/{g.sh} {g.C}->{g.K} at {g.H}x{g.W}"

    def keep(k, fn, args, geometry):
        if captured is not None and k not in captured:
            captured[k] = (fn, tuple(a.copy() if isinstance(a, np.ndarray) else a
                                     for a in args), geometry)

    def timed_forward(which, x, w, b, geometry, relu):
        t0 = time.perf_counter()
        try:
            return forward(which, x, w, b, geometry, relu)
        finally:
            k = key(geometry, "forward")
            times[k] += time.perf_counter() - t0
            counts[k] += 1
            keep(k, forward, (which, x, w, b, geometry, relu), geometry)

    def timed_backward(which, dconv, x, w, geometry, need, dx_addend=None):
        t0 = time.perf_counter()
        try:
            return backward(which, dconv, x, w, geometry, need, dx_addend)
        finally:
            k = key(geometry, "backward (" + "+".join(
                n for n, on in zip(("dx", "dw"), need) if on) + ")")
            times[k] += time.perf_counter() - t0
            counts[k] += 1
            keep(k, backward, (which, dconv, x, w, geometry, need, dx_addend), geometry)

    def timed_stats(which, x, w, geometry, eps):
        t0 = time.perf_counter()
        out = stats(which, x, w, geometry, eps)
        if out is not None:                  # (else the conv runs as _conv_forward)
            k = key(geometry, "forward with statistics")
            times[k] += time.perf_counter() - t0
            counts[k] += 1
            keep(k, stats, (which, x, w, geometry, eps), geometry)
        return out
    cbn._conv_forward, cbn._conv_backward = timed_forward, timed_backward
    cbn._conv_and_stats = timed_stats

    def undo():
        cbn._conv_forward, cbn._conv_backward, cbn._conv_and_stats = forward, backward, stats
    return undo


def direct_macs(key, geom):
    """Multiply-adds of a ``--layers`` key's pass on ``geom`` (its ConvGeometry) as a direct
    convolution: N*P*Q*K*(C/groups)*R*S for a forward or a dW alone, twice that for dX and
    dW."""
    per = geom.N * geom.P * geom.Q * geom.K * (geom.C // geom.groups) * geom.R * geom.S
    return per * (2 if "(dx+dw)" in key else 1)


def _replayed(captured, repeats):
    """{key: median seconds} of each captured pass called again ``repeats`` times in a row on
    its own arguments (its data and code warm in the caches), after two calls not timed."""
    out = {}
    for k, (fn, args, _) in captured.items():
        for _ in range(2):
            fn(*args)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t0)
        out[k] = statistics.median(ts)
    return out


def _timed_with_launches(fn, key, times, counts):
    """``fn`` timed under ``key`` in ``times`` / ``counts``, and the outermost launches made
    inside it under ``key + " launches"`` (``_wrap_launches``' running total)."""
    def timed(*args, **kwargs):
        launched = times["(outermost launches)"]
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key] += time.perf_counter() - t0
            times[key + " launches"] += times["(outermost launches)"] - launched
            counts[key] += 1
    return timed


def _wrap_functions(times, counts):
    """Time the fused ops' autograd Functions (forward and backward of Conv-BN-ReLU and
    Conv-BN-Add-ReLU) and, inside each, numbafuse's outermost launches (``_wrap_launches``):
    what is left is the host path (Python, NumPy and torch calls, compiled code called
    straight); and the ops layer they call (``ops.conv_batchnorm``'s forward, backward,
    add_forward, add_backward: "ops ..." keys, with their launches) to split that host path
    into the ops layer and the kernels' drivers below it, and the Functions' own torch layer
    (tensor views, saving, the launch order) around it; returns the undo."""
    from numbafuse.ops import conv_batchnorm as cbn
    from numbafuse.torch import conv_batchnorm as tcb
    undo_launches = _wrap_launches(times, counts)
    saved = []
    ops = {name: getattr(cbn, name) for name in ("forward", "backward", "add_forward",
                                                 "add_backward")}
    for name, fn in ops.items():
        setattr(cbn, name, _timed_with_launches(fn, f"ops {name}", times, counts))
    for cls, label in ((tcb.ConvBatchNormReLUFunction, "Conv-BN-ReLU"),
                       (tcb.ConvBatchNormAddReLUFunction, "Conv-BN-Add-ReLU")):
        for name in ("forward", "backward"):
            original = cls.__dict__[name]
            fn = original.__func__ if isinstance(original, staticmethod) else original
            saved.append((cls, name, original))
            setattr(cls, name, staticmethod(
                _timed_with_launches(fn, f"{label} {name}", times, counts)))

    def undo():
        for cls, name, original in saved:
            setattr(cls, name, original)
        for name, fn in ops.items():
            setattr(cbn, name, fn)
        undo_launches()
    return undo


def _site(depth=4):
    """The chain of numbafuse frames (file:line(function), innermost first, at most
    ``depth``) that called the wrapper calling this: where a launch is made."""
    frame, out = sys._getframe(2), []
    while frame is not None and len(out) < depth:
        name = frame.f_code.co_filename
        if "numbafuse" in name:
            out.append(f"{os.path.basename(name)}:{frame.f_lineno}({frame.f_code.co_name})")
        frame = frame.f_back
    return " < ".join(out)


def _wrap_gaps(times, counts):
    """``--gaps``: inside the fused ops' autograd Functions, the host time between events (the
    Function's start, an outermost launch's start or end, the Function's end), each gap added
    to the event it ends at: a launch by where it is made (``_site``), or the Function's end;
    ``"(Function) forward"`` / ``backward`` keys hold each direction's gaps and calls. One
    clock read an event, no other wrapper: the step runs as it does unwrapped, with the
    Python frames walked at each launch (~a few us). Returns the undo."""
    from numbafuse.kernels.cpu import launch as launch_mod
    from numbafuse.torch import conv_batchnorm as tcb
    original = launch_mod.launch
    state = {"open": None, "last": 0.0, "depth": 0}      # open: the Function's key

    def gap(key):
        t = time.perf_counter()
        if state["open"] is not None:
            times[key] += t - state["last"]
            counts[key] += 1
            times[state["open"]] += t - state["last"]
        return t

    def timed(kernel, *args, **kwargs):
        outer = state["depth"] == 0 and state["open"] is not None
        if outer:
            gap("launch at " + _site())
        state["depth"] += 1
        try:
            return original(kernel, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if outer:
                state["last"] = time.perf_counter()

    undo_launches = replace_in_numbafuse(lambda name, value: value is original,
                                         lambda value: timed)
    saved = []
    for cls in (tcb.ConvBatchNormReLUFunction, tcb.ConvBatchNormAddReLUFunction):
        for name in ("forward", "backward"):
            method = cls.__dict__[name]
            fn = method.__func__ if isinstance(method, staticmethod) else method
            saved.append((cls, name, method))
            end = f"end of {cls.__name__}.{name}"

            def wrapped(*args, _fn=fn, _end=end, _key=f"(Function) {name}", **kwargs):
                state["open"], state["last"] = _key, time.perf_counter()
                counts[_key] += 1
                try:
                    return _fn(*args, **kwargs)
                finally:
                    gap(_end)
                    state["open"] = None
            setattr(cls, name, staticmethod(wrapped))

    def undo():
        for cls, name, method in saved:
            setattr(cls, name, method)
        undo_launches()
    return undo


def _print_gaps(times, counts, n, total, args):
    fwd, bwd = (times.pop(f"(Function) {d}", 0.0) / n for d in ("forward", "backward"))
    calls = {d: counts.pop(f"(Function) {d}", 0) / n for d in ("forward", "backward")}
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused "
          f"(recompute={args.recompute}), {_threads()} threads: step {total * 1e3:.1f} ms "
          f"(mean of {n} steps); inside the fused Functions, outside their launches "
          f"{(fwd + bwd) * 1e3:.2f} ms a step: forward {fwd * 1e3:.2f} ms in "
          f"{calls['forward']:g} calls ({fwd / max(calls['forward'], 1) * 1e6:.0f} us a "
          f"call), backward {bwd * 1e3:.2f} ms in {calls['backward']:g} "
          f"({bwd / max(calls['backward'], 1) * 1e6:.0f} us a call)")
    print("\n| the gap ends at | ms a step | gaps a step | us a gap |\n|---|---:|---:|---:|")
    for key, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {key} | {t / n * 1e3:.3f} | {counts[key] / n:g} "
              f"| {t / counts[key] * 1e6:.1f} |")


def _threads():
    import torch
    return torch.get_num_threads()


# --exclusive: the pool's own modules stay whole inside launch (their time is the launch's)
_OPAQUE = ("numbafuse.kernels.cpu.launch", "numbafuse.kernels.cpu.team",
           "numbafuse.kernels.cpu.native", "numbafuse.kernels.cpu.sync")
_UNITS = ("launch", "launch_all", "concurrently")


def _wrap_exclusive(times, counts):
    """Wrap numbafuse's host-side Python functions and methods (``--exclusive``), each timed
    exclusive of the wrapped functions it calls (a stack of child times per thread), in
    ``times``/``counts`` by qualified name; returns the undo."""
    import inspect
    import threading
    from numbafuse.kernels.cpu import launch as launch_mod
    local = threading.local()

    def wrapped(fn, name):
        def timed(*args, **kwargs):
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                times[name] += dt - stack.pop()
                counts[name] += 1
                if stack:
                    stack[-1] += dt
        return timed

    modules = [m for n, m in list(sys.modules.items())
               if n.startswith("numbafuse.") and m is not None and not n.startswith(_OPAQUE)
               and not n.startswith("numbafuse.kernels.cpu.first_calls")]
    originals = {}                                   # id(function) -> (function, wrapper)
    for m in modules:
        for v in list(vars(m).values()):
            if (inspect.isfunction(v) and v.__module__ == m.__name__
                    and not inspect.isgeneratorfunction(v) and id(v) not in originals):
                short = m.__name__.rsplit(".", 1)[-1]
                originals[id(v)] = (v, wrapped(v, f"{short}.{v.__qualname__}"))
    for unit in _UNITS:
        v = getattr(launch_mod, unit)
        originals[id(v)] = (v, wrapped(v, f"launch.{unit}"))
    patched = []                                     # (namespace, name, original)
    for m in modules + [launch_mod]:
        for k, v in list(vars(m).items()):
            if id(v) in originals and originals[id(v)][0] is v:
                patched.append((m, k, v))
                setattr(m, k, originals[id(v)][1])
    classes = {id(c): c for m in modules for c in vars(m).values()
               if inspect.isclass(c) and c.__module__ == m.__name__}
    for c in classes.values():
        for k, v in list(vars(c).items()):
            fn = v.__func__ if isinstance(v, staticmethod) else v
            if (k.startswith("__") or not inspect.isfunction(fn)
                    or inspect.isgeneratorfunction(fn)):
                continue
            w = wrapped(fn, f"{c.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}")
            patched.append((c, k, v))
            setattr(c, k, staticmethod(w) if isinstance(v, staticmethod) else w)

    def undo():
        for owner, k, v in reversed(patched):
            setattr(owner, k, v)
    return undo


def _print_exclusive(times, counts, n, total, bare, args):
    units = sum(times.get(f"launch.{u}", 0.0) for u in _UNITS) / n
    host = sum(times.values()) / n - units
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused "
          f"(recompute={args.recompute}): step {bare * 1e3:.1f} ms unwrapped, "
          f"{total * 1e3:.1f} wrapped (mean of {n} steps each); in the wrapped step "
          f"numbafuse's Python functions {host * 1e3:.1f} ms exclusive of the launches "
          f"(launch, launch_all, concurrently: {units * 1e3:.1f} ms, the kernels and their "
          f"hand-off), on every thread")
    print("\n| function | ms a step | calls a step | us a call |\n|---|---:|---:|---:|")
    for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| `{name}` | {t / n * 1e3:.2f} | {counts[name] / n:g} "
              f"| {t / counts[name] * 1e6:.1f} |")


def _torch_layers(model, step, steps):
    """(times, counts) of PyTorch's conv passes by layer shape, in ``--layers``' keys, from
    ``torch.profiler`` over ``steps`` calls of ``step``: forward, backward (dx+dw) or (dw)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    strides = {}

    def hook(module, inputs, output):
        strides[(tuple(inputs[0].shape), tuple(module.weight.shape))] = module.stride[0]
    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, torch.nn.Conv2d)]
    step()
    for h in handles:
        h.remove()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    times, counts = collections.defaultdict(float), collections.Counter()
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::mkldnn_convolution":
            x, w, kind = e.input_shapes[0], e.input_shapes[1], "forward"
        elif e.key == "aten::convolution_backward":
            x, w = e.input_shapes[1], e.input_shapes[2]
            kind = "backward (dx+dw)" if x[1] > 3 else "backward (dw)"   # the stem: no dx
        else:
            continue
        K, C, R, S = w
        stride = strides.get((tuple(x), tuple(w)), "?")
        key = f"{kind} {R}x{S}/{stride} {C}->{K} at {x[2]}x{x[3]}"
        times[key] += e.self_cpu_time_total / 1e6
        counts[key] += e.count
    return times, counts


def _print_replayed(times, counts, n, warm, captured, args):
    """``--layers --replay``'s table: each pass in the step against the same call repeated."""
    print(f"\nEach pass's first call in the steps called again {args.replay} times in a row "
          "after them (median; its arrays, code and weights warm), against its mean in the "
          "steps; GMAC/s: a direct convolution's multiply-adds (Winograd and tapwise passes "
          "do fewer) over the replayed time.")
    print("\n| conv pass | calls a step | in the step ms | replayed ms | step / replayed "
          "| GMAC/s replayed |\n|---|---:|---:|---:|---:|---:|")
    in_step = replayed = 0.0
    for name in sorted(times, key=lambda k: -(times[k] - warm[k] * counts[k])):
        calls, mean = counts[name] / n, times[name] / counts[name]
        in_step, replayed = in_step + mean * calls, replayed + warm[name] * calls
        macs = direct_macs(name, captured[name][2])
        print(f"| {name} | {calls:g} | {mean * 1e3:.3f} | {warm[name] * 1e3:.3f} "
              f"| {mean / warm[name]:.2f} | {macs / warm[name] / 1e9:.0f} |")
    print(f"\nThe conv passes: {in_step * 1e3:.1f} ms a step in the steps, {replayed * 1e3:.1f} "
          f"replayed ({in_step / replayed:.2f}x).")


def main(argv=None):
    from numbafuse.kernels.cpu import recorded
    with recorded.off():                 # (the wrappers see the layered path: module docstring)
        return _main(argv)


def _main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18",
                   choices=["resnet18", "resnet50", "resnext50_32x4d", "mobilenet_v2",
                            "mobilenet_v2_relu"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--layers", action="store_true",
                   help="time the conv passes by layer shape instead of the launches")
    p.add_argument("--torch", action="store_true",
                   help="PyTorch's own unfused model's conv passes by layer shape instead")
    p.add_argument("--replay", type=int, default=0, metavar="REPEATS",
                   help="with --layers: also call each conv pass again REPEATS times on its "
                        "own arguments after the steps (warm), and compare")
    p.add_argument("--host", action="store_true",
                   help="the fused ops' autograd Functions timed, less their launches")
    p.add_argument("--exclusive", action="store_true",
                   help="numbafuse's host-side Python functions timed, each exclusive of "
                        "those it calls")
    p.add_argument("--gaps", action="store_true",
                   help="the host time between the launches inside the fused Functions, by "
                        "where the next launch is made")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's and numbafuse's threads (default: torch's own count)")
    p.add_argument("--channels-last", action="store_true",
                   help="the model and input channels_last (numbafuse's NHWC kernels)")
    p.add_argument("--recompute", default="True", choices=["True", "False", "auto"],
                   help="fuse(model, recompute=...) (default True, fuse's own default)")
    args = p.parse_args(argv)
    if args.replay < 0 or (args.replay and not args.layers):
        p.error("--replay takes a count of calls >= 0, and needs --layers")

    import torch
    from bench_resnet import model_function    # the model's file, no numbafuse import
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.torch:
        import numbafuse.torch as nft
        if args.threads:
            from numbafuse.kernels.cpu import launch as launch_mod
            launch_mod.set_num_threads(args.threads)

    torch.manual_seed(0)
    memory = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model_function(args.model)(num_classes=1000).to(memory_format=memory)
    recompute = {"True": True, "False": False}.get(args.recompute, args.recompute)
    model = model if args.torch else nft.fuse(model, recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(args.batch, 3, args.size, args.size).contiguous(memory_format=memory)
    labels = torch.randint(0, 1000, (args.batch,))

    def step():
        """One training step; returns the seconds of its SGD step."""
        for param in model.parameters():
            param.grad = None
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(3):                   # compilation, buffers, the plans' caches
        step()
    if args.torch:
        times, counts = _torch_layers(model, step, args.steps)
        n = args.steps
        print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, PyTorch unfused, "
              f"{torch.get_num_threads()} torch threads, torch.profiler: the conv passes "
              f"{sum(times.values()) / n * 1e3:.1f} ms a step (mean of {n} steps)")
        print("\n| conv pass | ms a call | calls a step |\n|---|---:|---:|")
        for name in sorted(times):
            print(f"| {name} | {times[name] / counts[name] * 1e3:.2f} | {counts[name] / n:g} |")
        return
    bare = 0.0
    if args.exclusive:                   # the step unwrapped first, to set the wrapped beside
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        bare = (time.perf_counter() - t0) / args.steps
    times, counts = collections.defaultdict(float), collections.Counter()
    captured = {} if args.layers and args.replay > 0 else None
    undo = (functools.partial(_wrap_conv_passes, captured=captured) if args.layers
            else _wrap_functions if args.host else _wrap_exclusive if args.exclusive
            else _wrap_gaps if args.gaps else _wrap_launches)(times, counts)
    t_sgd = 0.0
    try:
        if captured is not None or args.exclusive or args.gaps:
            # a step of its own, not timed: --replay's copies of the passes' arguments (~100
            # MB of new pages at batch 16, 64x64, which made the first timed step's passes 10x
            # slower and the steps' means ~2x what they are without them); --exclusive's
            # and --gaps' wrappers' first calls (frames walked, keys made)
            step()
            times.clear()
            counts.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            t_sgd += step()
        total = (time.perf_counter() - t0) / args.steps
    finally:
        undo()
    n = args.steps
    if args.exclusive:
        _print_exclusive(times, counts, n, total, bare, args)
        return
    if args.gaps:
        _print_gaps(times, counts, n, total, args)
        return
    if args.host:
        outer = times["(outermost launches)"] / n
        print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused "
              f"(recompute={args.recompute}), {torch.get_num_threads()} torch threads: "
              f"step {total * 1e3:.1f} ms, of which numbafuse's outermost launches "
              f"{outer * 1e3:.1f} ms, SGD {t_sgd / n * 1e3:.1f} ms (mean of {n} steps)")
        print("\n| fused Function | calls a step | ms a step | its launches ms | the rest ms "
              "| the rest a call us |\n|---|---:|---:|---:|---:|---:|")
        rest = 0.0
        for key in sorted(k for k in counts if k.startswith("Conv-")
                         and k.endswith(("forward", "backward"))):
            c, t, la = counts[key] / n, times[key] / n, times[key + " launches"] / n
            rest += t - la
            print(f"| {key} | {c:g} | {t * 1e3:.2f} | {la * 1e3:.2f} | {(t - la) * 1e3:.2f} "
                  f"| {(t - la) / c * 1e6:.0f} |")
        in_ops = sum(times[k] - times[k + " launches"] for k in counts
                     if k.startswith("ops ")) / n
        functions = sum(times[k] for k in counts if k.startswith("Conv-")) / n
        print(f"\nThe fused Functions' host path: {rest * 1e3:.1f} ms a step "
              f"({rest / total:.0%} of the step): {in_ops * 1e3:.1f} ms in the ops layer and "
              f"the kernels' drivers below it (ops.conv_batchnorm's calls less their "
              f"launches), {(rest - in_ops) * 1e3:.1f} ms in the Functions' own torch layer "
              f"around it; SGD {t_sgd / n * 1e3:.1f} ms; the rest of the step (PyTorch's "
              f"autograd engine, the public functions' checks, Function.apply, the pool, "
              f"the head) {(total - functions - t_sgd / n) * 1e3:.1f} ms.")
        return
    if args.layers:
        print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused "
              f"(recompute={args.recompute}), {torch.get_num_threads()} torch threads: "
              f"step {total * 1e3:.1f} ms, of which "
              f"the conv passes {sum(times.values()) / n * 1e3:.1f} ms (mean of {n} steps)")
        if captured is None:
            print("\n| conv pass | ms a call | calls a step |\n|---|---:|---:|")
            for name in sorted(times):
                print(f"| {name} | {times[name] / counts[name] * 1e3:.2f} "
                      f"| {counts[name] / n:g} |")
            return
        _print_replayed(times, counts, n, _replayed(captured, args.replay), captured, args)
        return
    outer = times.pop("(outermost launches)", 0.0) / n
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused "
          f"(recompute={args.recompute}), {torch.get_num_threads()} torch threads: "
          f"step {total * 1e3:.1f} ms, of which "
          f"numbafuse's outermost launches {outer * 1e3:.1f} ms ({outer / total:.0%}), "
          f"the rest {(total - outer) * 1e3:.1f} ms (mean of {n} steps)")
    print("\n| kernel | ms a step | launches a step |\n|---|---:|---:|")
    for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| `{name}` | {t / n * 1e3:.2f} | {counts[name] / n:g} |")


if __name__ == "__main__":
    main()
