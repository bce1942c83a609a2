"""Where a fused ResNet's CPU training step spends its time: numbafuse's kernel launches, each
timed by name.

    python benchmarks/profile_resnet.py [--model resnet18] [--batch 16] [--size 64]
                                        [--steps 5] [--top 25] [--layers | --torch | --host]
                                        [--recompute True|False|auto]

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
ms a call and calls a step. ``--torch``: the same table for PyTorch's own unfused model in
this process (numbafuse not imported: resnet.py is loaded from its file), from
``torch.profiler`` (the self time of ``aten::mkldnn_convolution`` and
``aten::convolution_backward`` by input shapes, over ``--steps`` profiled steps after the
warm-up): the two tables, each from its own process, show every layer in the network side by
side. ``--host``: the fused ops' autograd Functions (Conv-BN-ReLU, Conv-BN-Add-ReLU; forward
and backward) timed whole and less numbafuse's outermost launches inside them: the rest is
their host path (Python, NumPy and torch calls, compiled helpers called straight), by
Function and direction, and SGD's step. One process, the library's default threads: a
profile, not a comparison (``bench_resnet.py`` compares against PyTorch;
``bench_conv_plan.py`` times each pass alone against PyTorch's).
"""
import argparse
import collections
import os
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

    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("numbafuse")
               and getattr(m, "launch", None) is original]
    for m in patched:
        m.launch = timed

    def undo():
        for m in patched:
            m.launch = original
    return undo


def _wrap_conv_passes(times, counts):
    """Time the Conv-BatchNorm ops' conv passes by layer shape; returns the undo."""
    from numbafuse.ops import conv_batchnorm as cbn
    forward, backward, stats = cbn._conv_forward, cbn._conv_backward, cbn._conv_and_stats

    def key(g, kind):
        return f"{kind} {g.R}x{g.S}/{g.sh} {g.C}->{g.K} at {g.H}x{g.W}"

    def timed_forward(which, x, w, b, geometry, relu):
        t0 = time.perf_counter()
        try:
            return forward(which, x, w, b, geometry, relu)
        finally:
            k = key(geometry, "forward")
            times[k] += time.perf_counter() - t0
            counts[k] += 1

    def timed_backward(which, dconv, x, w, geometry, need, dx_addend=None):
        t0 = time.perf_counter()
        try:
            return backward(which, dconv, x, w, geometry, need, dx_addend)
        finally:
            k = key(geometry, "backward (" + "+".join(
                n for n, on in zip(("dx", "dw"), need) if on) + ")")
            times[k] += time.perf_counter() - t0
            counts[k] += 1
    def timed_stats(which, x, w, geometry, eps):
        t0 = time.perf_counter()
        out = stats(which, x, w, geometry, eps)
        if out is not None:                  # (else the conv runs as _conv_forward)
            k = key(geometry, "forward with statistics")
            times[k] += time.perf_counter() - t0
            counts[k] += 1
        return out
    cbn._conv_forward, cbn._conv_backward = timed_forward, timed_backward
    cbn._conv_and_stats = timed_stats

    def undo():
        cbn._conv_forward, cbn._conv_backward, cbn._conv_and_stats = forward, backward, stats
    return undo


def _wrap_functions(times, counts):
    """Time the fused ops' autograd Functions (forward and backward of Conv-BN-ReLU and
    Conv-BN-Add-ReLU) and, inside each, numbafuse's outermost launches (``_wrap_launches``):
    what is left is the host path (Python, NumPy and torch calls, compiled code called
    straight); returns the undo."""
    from numbafuse.torch import conv_batchnorm as tcb
    undo_launches = _wrap_launches(times, counts)
    saved = []
    for cls, label in ((tcb.ConvBatchNormReLUFunction, "Conv-BN-ReLU"),
                       (tcb.ConvBatchNormAddReLUFunction, "Conv-BN-Add-ReLU")):
        for name in ("forward", "backward"):
            original = cls.__dict__[name]
            fn = original.__func__ if isinstance(original, staticmethod) else original

            def timed(ctx, *args, _fn=fn, _key=f"{label} {name}"):
                launched = times["(outermost launches)"]
                t0 = time.perf_counter()
                try:
                    return _fn(ctx, *args)
                finally:
                    times[_key] += time.perf_counter() - t0
                    times[_key + " launches"] += times["(outermost launches)"] - launched
                    counts[_key] += 1
            saved.append((cls, name, original))
            setattr(cls, name, staticmethod(timed))

    def undo():
        for cls, name, original in saved:
            setattr(cls, name, original)
        undo_launches()
    return undo


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


def main(argv=None):
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
    p.add_argument("--host", action="store_true",
                   help="the fused ops' autograd Functions timed, less their launches")
    p.add_argument("--recompute", default="True", choices=["True", "False", "auto"],
                   help="fuse(model, recompute=...) (default True, fuse's own default)")
    args = p.parse_args(argv)

    import torch
    from bench_resnet import model_function    # the model's file, no numbafuse import
    if not args.torch:
        import numbafuse.torch as nft

    torch.manual_seed(0)
    model = model_function(args.model)(num_classes=1000)
    recompute = {"True": True, "False": False}.get(args.recompute, args.recompute)
    model = model if args.torch else nft.fuse(model, recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(args.batch, 3, args.size, args.size)
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
    times, counts = collections.defaultdict(float), collections.Counter()
    undo = (_wrap_conv_passes if args.layers else _wrap_functions if args.host
            else _wrap_launches)(times, counts)
    t_sgd = 0.0
    try:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            t_sgd += step()
        total = (time.perf_counter() - t0) / args.steps
    finally:
        undo()
    n = args.steps
    if args.host:
        outer = times["(outermost launches)"] / n
        print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused "
              f"(recompute={args.recompute}), {torch.get_num_threads()} torch threads: "
              f"step {total * 1e3:.1f} ms, of which numbafuse's outermost launches "
              f"{outer * 1e3:.1f} ms, SGD {t_sgd / n * 1e3:.1f} ms (mean of {n} steps)")
        print("\n| fused Function | calls a step | ms a step | its launches ms | the rest ms "
              "| the rest a call us |\n|---|---:|---:|---:|---:|---:|")
        rest = 0.0
        for key in sorted(k for k in counts if k.endswith(("forward", "backward"))):
            c, t, la = counts[key] / n, times[key] / n, times[key + " launches"] / n
            rest += t - la
            print(f"| {key} | {c:g} | {t * 1e3:.2f} | {la * 1e3:.2f} | {(t - la) * 1e3:.2f} "
                  f"| {(t - la) / c * 1e6:.0f} |")
        print(f"\nThe fused Functions' host path: {rest * 1e3:.1f} ms a step "
              f"({rest / total:.0%} of the step).")
        return
    if args.layers:
        print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused "
              f"(recompute={args.recompute}), {torch.get_num_threads()} torch threads: "
              f"step {total * 1e3:.1f} ms, of which "
              f"the conv passes {sum(times.values()) / n * 1e3:.1f} ms (mean of {n} steps)")
        print("\n| conv pass | ms a call | calls a step |\n|---|---:|---:|")
        for name in sorted(times):
            print(f"| {name} | {times[name] / counts[name] * 1e3:.2f} | {counts[name] / n:g} |")
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
