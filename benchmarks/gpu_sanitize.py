"""Small GPU workloads for ``compute-sanitizer`` and a first real-GPU check of numbafuse.torch.

    python benchmarks/gpu_sanitize.py ops      # every fused op, fwd + bwd, both layouts
    python benchmarks/gpu_sanitize.py train    # a few training steps, fused and unfused, and
                                               # the same replayed from a CUDA graph
    python benchmarks/gpu_sanitize.py train_small   # two steps of a narrow model (racecheck)
    python benchmarks/gpu_sanitize.py torch    # numbafuse.torch on CUDA tensors vs torch

``benchmarks/gpu_check.sh`` runs ``ops`` and ``train`` under ``compute-sanitizer`` (memcheck,
racecheck, synccheck) and ``torch`` plainly. Shapes cross the production tiles' edges (128
rows, 128 / 64 columns, K-steps of 8) without being slow under the sanitizer. Each check
prints one line; the exit status is 1 if any result is off.
"""
import sys

import numpy as np

SHAPE = (2, 24, 13, 11)           # N, C, H, W: M = 2*13*11 = 286 rows, past two 128-row tiles
K = 136                           # output channels: past one 128-column tile
TOL = 1e-4                        # float32 relative error against the float64 reference


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def ops():
    import numbafuse as nf
    from numbafuse import cuda as nfcuda, reference as ref
    rng = np.random.default_rng(0)
    bad = 0
    N, C, H, W = SHAPE
    f32 = lambda a: nfcuda.to_device(np.ascontiguousarray(a, np.float32))  # noqa: E731
    for layout in ("NCHW", "NHWC"):
        # arrays are drawn NCHW and moved to the layout; the reference runs in the layout
        to = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) \
            if layout == "NHWC" else (lambda a: a)
        # (groups, filters, filter size, stride): plain convs, then grouped ones: depthwise
        # (groups == C; 7x7 stride 2 too) and few channels a group by the direct kernels
        # (groups 4: 6 channels), 12 channels a group (the direct kernels in NCHW, a GEMM
        # set per group in NHWC: config.direct_group_channels)
        for groups, k, r, stride in ((1, K, 3, 1), (1, K, 3, 2), (C, C, 3, 1), (C, 2 * C, 7, 2),
                                     (4, 32, 3, 1), (2, 32, 3, 1)):
            x = to(rng.standard_normal(SHAPE))
            w = rng.standard_normal((k, C // groups, r, r)) / np.sqrt(r * r * C // groups)
            b = rng.standard_normal(k) * 0.1
            kw = dict(stride=stride, padding=r // 2, layout=layout, groups=groups)
            y64 = ref.conv_bias_relu(x, w, b, **kw)
            gy = rng.standard_normal(y64.shape)
            g64 = ref.conv_bias_relu_backward(gy, x, w, b, **kw)
            y = nf.conv_bias_relu(f32(x), f32(w), f32(b), **kw)
            g = nf.conv_bias_relu_backward(f32(gy), f32(x), f32(w), y, **kw)
            errs = [_rel(y.copy_to_host(), y64)] + [_rel(a.copy_to_host(), e)
                                                     for a, e in zip(g, g64)]
            bad += max(errs) > TOL
            what = f"groups {groups} {r}x{r} " if groups > 1 else ""
            print(f"conv_bias_relu {layout} {what}stride {stride}: rel err y, dx, dw, db "
                  + " ".join(f"{e:.1e}" for e in errs), flush=True)
        xb, zb, gy = (to(rng.standard_normal((N, K, H, W))) for _ in range(3))
        gam, bet = rng.uniform(0.5, 1.5, K), rng.standard_normal(K)
        y64 = ref.batchnorm_add_relu(xb, zb, gam, bet, layout=layout)[0]
        g64 = ref.batchnorm_add_relu_backward(gy, xb, zb, gam, bet, layout=layout)
        y = nf.batchnorm_add_relu(f32(xb), f32(zb), f32(gam), f32(bet), layout=layout)
        g = nf.batchnorm_add_relu_backward(f32(gy), f32(xb), f32(zb), f32(gam), f32(bet), y=y,
                                           layout=layout)
        errs = [_rel(y.copy_to_host(), y64)] + [_rel(a.copy_to_host(), e)
                                                 for a, e in zip(g, g64)]
        bad += max(errs) > TOL
        print(f"batchnorm_add_relu {layout}: rel err y, dx, dz, dgamma, dbeta "
              + " ".join(f"{e:.1e}" for e in errs), flush=True)
    nfcuda.numba_cuda.synchronize()
    return bad


def train(steps=4):
    from numbafuse import models, optim
    from numbafuse import cuda as nfcuda
    from numbafuse.train import train_step
    rng = np.random.default_rng(0)
    xb = nfcuda.to_device(rng.standard_normal((32, 8, 8, 1)).astype(np.float32))
    yb = nfcuda.to_device(rng.integers(0, 10, 32))
    bad = 0
    for kind in ("fused", "unfused"):
        model = models.make_model(kind).to("cuda")
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        losses = [float(train_step(model, opt, xb, yb)[0].numpy()) for _ in range(steps)]
        ok = all(np.isfinite(losses)) and losses[-1] < losses[0]
        bad += not ok
        print(f"train {kind}: losses " + " ".join(f"{v:.4f}" for v in losses), flush=True)
        # the same steps through a CUDA graph (2 eager warm-up steps, the capture, replays):
        # the same losses and parameters as eager steps, bit for bit
        model = models.make_model(kind).to("cuda")
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        with nfcuda.graph(train_step, model, opt, xb, yb, warmup=2) as step:
            replayed = [float(step.replay()[0].numpy()) for _ in range(steps - 2)]
        eager = losses[2:]
        same = replayed == eager and all(
            np.array_equal(a, b) for (_, a), (k, b) in zip(
                model.state_dict().items(), _eager_state(kind, steps, xb, yb).items())
            if not k.endswith("num_batches_tracked"))
        bad += not same
        print(f"train {kind}, CUDA graph: losses " + " ".join(f"{v:.4f}" for v in replayed)
              + (" = eager, parameters equal" if same else f" != eager {eager}"), flush=True)
    return bad


def train_small(steps=2):
    """Two eager training steps of a narrow digits ResNet (width 4, one block, batch 4),
    fused and unfused: every kernel of a training step (conv GEMMs with dw's last-block
    sums, batch-norm reductions, pooling, the linear head, cross-entropy, SGD with momentum,
    the second step's steady path) launched over few blocks, for racecheck, where ``train``'s
    steps did not finish inside 60 s (runs 12, 13)."""
    from numbafuse import models, optim
    from numbafuse import cuda as nfcuda
    from numbafuse.train import train_step
    rng = np.random.default_rng(0)
    xb = nfcuda.to_device(rng.standard_normal((4, 8, 8, 1)).astype(np.float32))
    yb = rng.integers(0, 10, 4)                     # host labels, as fit passes them
    bad = 0
    for kind in ("fused", "unfused"):
        model = models.make_model(kind, width=4, blocks=1).to("cuda")
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        losses = [float(train_step(model, opt, xb, yb)[0].numpy()) for _ in range(steps)]
        bad += not all(np.isfinite(losses))
        print(f"train_small {kind}: losses " + " ".join(f"{v:.4f}" for v in losses),
              flush=True)
    return bad


def _eager_state(kind, steps, xb, yb):
    from numbafuse import models, optim
    from numbafuse.train import train_step
    model = models.make_model(kind).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(steps):
        train_step(model, opt, xb, yb)
    return model.state_dict()


def torch_check():
    import torch
    import torch.nn.functional as F
    import numbafuse.torch as nft
    torch.manual_seed(0)
    torch.backends.cudnn.allow_tf32 = False
    dev = dict(device="cuda", dtype=torch.float64)
    bad = 0
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(SHAPE, **dev).contiguous(memory_format=fmt)
        w = torch.randn(K, SHAPE[1], 3, 3, **dev) / 15
        b = torch.randn(K, **dev)
        gy = torch.randn(SHAPE[0], K, SHAPE[2], SHAPE[3], **dev)
        ins = [t.float().requires_grad_(True) for t in (x, w, b)]
        ins[0] = ins[0].detach().contiguous(memory_format=fmt).requires_grad_(True)
        y = nft.conv_bias_relu(*ins, padding=1)
        y.backward(gy.float())
        refs = [t.clone().requires_grad_(True) for t in (x, w, b)]
        yr = F.relu(F.conv2d(*refs, padding=1))
        yr.backward(gy)
        errs = [_rel(y.detach().cpu(), yr.detach().cpu())] + [
            _rel(a.grad.cpu(), r.grad.cpu()) for a, r in zip(ins, refs)]
        bad += max(errs) > TOL
        print(f"numbafuse.torch conv_bias_relu on cuda ({fmt}): rel err y, dx, dw, db "
              + " ".join(f"{e:.1e}" for e in errs), flush=True)
        xb = torch.randn(SHAPE, **dev).contiguous(memory_format=fmt)
        zb = torch.randn(SHAPE, **dev).contiguous(memory_format=fmt)
        gam, bet = torch.rand(SHAPE[1], **dev) + 0.5, torch.randn(SHAPE[1], **dev)
        ins = [t.float().detach().contiguous(memory_format=fmt if t.dim() == 4 else
                                              torch.contiguous_format).requires_grad_(True)
               for t in (xb, zb, gam, bet)]
        rm, rv = torch.zeros(SHAPE[1], device="cuda"), torch.ones(SHAPE[1], device="cuda")
        y = nft.batchnorm_add_relu(*ins, running_mean=rm, running_var=rv, training=True)
        y.backward(torch.ones_like(y))
        refs = [t.clone().requires_grad_(True) for t in (xb, zb, gam, bet)]
        rm64, rv64 = torch.zeros(SHAPE[1], **dev), torch.ones(SHAPE[1], **dev)
        yr = F.relu(F.batch_norm(refs[0], rm64, rv64, refs[2], refs[3], training=True)
                    + refs[1])
        yr.backward(torch.ones_like(yr))
        errs = [_rel(y.detach().cpu(), yr.detach().cpu()), _rel(rm.cpu(), rm64.cpu()),
                _rel(rv.cpu(), rv64.cpu())] + [_rel(a.grad.cpu(), r.grad.cpu())
                                               for a, r in zip(ins, refs)]
        bad += max(errs) > TOL
        print(f"numbafuse.torch batchnorm_add_relu on cuda ({fmt}): rel err y, r_mean, r_var,"
              f" dx, dz, dgamma, dbeta " + " ".join(f"{e:.1e}" for e in errs), flush=True)
        # Conv-BN-ReLU (training, recompute) with groups: depthwise and 4 groups
        for groups, k in ((SHAPE[1], SHAPE[1]), (4, 32)):
            x = torch.randn(SHAPE, **dev).contiguous(memory_format=fmt)
            w = torch.randn(k, SHAPE[1] // groups, 3, 3, **dev) / 5
            gam, bet = torch.rand(k, **dev) + 0.5, torch.randn(k, **dev)
            gy = torch.randn(SHAPE[0], k, SHAPE[2], SHAPE[3], **dev)
            ins = [t.float().detach().contiguous(memory_format=fmt if t.dim() == 4 else
                                                  torch.contiguous_format).requires_grad_(True)
                   for t in (x, w, gam, bet)]
            rm, rv = torch.zeros(k, device="cuda"), torch.ones(k, device="cuda")
            y = nft.conv_batchnorm_relu(ins[0], ins[1], ins[2], ins[3], rm, rv, training=True,
                                        padding=1, groups=groups)
            y.backward(gy.float())
            refs = [t.clone().requires_grad_(True) for t in (x, w, gam, bet)]
            rm64, rv64 = torch.zeros(k, **dev), torch.ones(k, **dev)
            yr = F.relu(F.batch_norm(F.conv2d(refs[0], refs[1], padding=1, groups=groups),
                                     rm64, rv64, refs[2], refs[3], training=True))
            yr.backward(gy)
            errs = [_rel(y.detach().cpu(), yr.detach().cpu()), _rel(rm.cpu(), rm64.cpu()),
                    _rel(rv.cpu(), rv64.cpu())] + [_rel(a.grad.cpu(), r.grad.cpu())
                                                   for a, r in zip(ins, refs)]
            bad += max(errs) > TOL
            print(f"numbafuse.torch conv_batchnorm_relu groups {groups} on cuda ({fmt}): rel "
                  "err y, r_mean, r_var, dx, dw, dgamma, dbeta "
                  + " ".join(f"{e:.1e}" for e in errs), flush=True)
    return bad


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "ops"
    failures = dict(ops=ops, train=train, train_small=train_small, torch=torch_check)[what]()
    print(f"gpu_sanitize {what}: {'OK' if not failures else f'{failures} checks off'}")
    sys.exit(1 if failures else 0)
