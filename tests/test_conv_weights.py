"""``kernels/conv/weights.py``: what the CPU conv passes derive from a weight, cached only when
enabled and vouched for, and only while the owners keep their versions; and, through
``numbafuse.torch.weight_cache``, a fused model computing with the cache exactly what it
computes without, before and after its weights and batch-norm statistics change."""
import gc

import numpy as np
import pytest

from numbafuse.kernels.conv import weights


class Owner:
    """Stands in for a torch tensor: a weak-referenceable object with a ``_version``."""

    def __init__(self):
        self._version = 0


@pytest.fixture(autouse=True)
def _empty_cache():
    weights.clear()
    yield
    weights.clear()


def _counted(w):
    calls = []

    def make():
        calls.append(1)
        return w * 2
    return make, calls


def test_nothing_is_cached_unless_enabled_and_vouched():
    w, owner = np.ones((4, 3)), Owner()
    make, calls = _counted(w)
    weights.derived(w, "k", make)
    weights.derived(w, "k", make)
    with weights.vouch(w, owner):                        # vouched, not enabled
        weights.derived(w, "k", make)
        weights.derived(w, "k", make)
    with weights.enabled():                              # enabled, not vouched
        weights.derived(w, "k", make)
        weights.derived(w, "k", make)
    assert len(calls) == 6 and weights.stats()["entries"] == 0


def test_a_hit_needs_the_same_owners_at_the_same_versions():
    w, owner, other = np.ones((4, 3)), Owner(), Owner()
    make, calls = _counted(w)
    with weights.enabled():
        with weights.vouch(w, owner):
            first = weights.derived(w, "k", make)
            assert weights.derived(w, "k", make) is first and len(calls) == 1
            assert weights.derived(w, "other kind", make) is not first and len(calls) == 2
            assert weights.derived(w[:2], "k", make) is not first       # another shape
        owner._version += 1                                           # changed in place
        with weights.vouch(w, owner):
            second = weights.derived(w, "k", make)
            assert second is not first and len(calls) == 4
            assert weights.derived(w, "k", make) is second
        with weights.vouch(w, other):                                 # another tensor
            assert weights.derived(w, "k", make) is not second and len(calls) == 5
        bn = Owner()
        with weights.vouch(w, other, bn):                            # and one more owner
            third = weights.derived(w, "k", make)
            bn._version += 1
        with weights.vouch(w, other, bn):
            assert weights.derived(w, "k", make) is not third


def test_vouch_like_passes_the_owners_to_a_derived_array():
    w, owner = np.ones((4, 3)), Owner()
    folded = np.ones((4, 3)) * 3
    make, calls = _counted(folded)
    with weights.enabled(), weights.vouch(w, owner):
        with weights.vouch_like(folded, w):
            a = weights.derived(folded, "k", make)
        with weights.vouch_like(folded, w):
            assert weights.derived(folded, "k", make) is a and len(calls) == 1
    with weights.enabled(), weights.vouch_like(folded, w):            # w not vouched here
        assert weights.derived(folded, "k", make) is not a


def test_dead_owners_entries_go_and_the_size_is_bounded(monkeypatch):
    w = np.ones((16, 16))                                             # 2 KB derived
    with weights.enabled():
        owner = Owner()
        with weights.vouch(w, owner):
            weights.derived(w, "a", lambda: w * 2)
        del owner
        gc.collect()
        other = Owner()
        with weights.vouch(w, other):
            weights.derived(w, "b", lambda: w * 3)                    # drops the dead one
        assert weights.stats()["entries"] == 1
        monkeypatch.setattr(weights, "MAX_BYTES", 3 * w.nbytes)
        with weights.vouch(w, other):
            for kind in "cdef":
                weights.derived(w, kind, lambda: w * 4)
        stats = weights.stats()
        assert stats["entries"] == 3 and stats["bytes"] == 3 * w.nbytes
        assert stats["refused"] == 2                                  # full: e, f not kept
        assert [k[3] for k in weights._CACHE] == ["b", "c", "d"]      # b stays (no eviction)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_k_blocked_forward_keeps_the_blocks_reordered_weights(layout):
    # a deep layer (more output channels than pixels): each k block's task reorders its rows
    # of w; with the cache on, into one matrix kept for the next call, which then reads it
    import numbafuse as nf
    from numbafuse import reference as ref
    from numbafuse.kernels.conv import cpu as cpu_conv, cpu_plan
    rng = np.random.default_rng(5)
    shape = (2, 24, 3, 3) if layout == "NCHW" else (2, 3, 3, 24)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((40, 24, 3, 3)) / 20).astype(np.float32)
    b = np.zeros(40, np.float32)
    geom = nf.validate.conv_geometry("t", shape, w.shape, 1, 1, 1, layout)
    kw = dict(stride=1, padding=1, layout=layout)
    owner = Owner()
    with cpu_plan.using(k_block=16, winograd_min_tiles=10**9):
        plan = cpu_plan.plan(geom, "forward", np.float32)
        assert plan.algorithm == "im2col" and plan.k_blocks > 1
        want = cpu_conv.conv_forward(x, w, b, geom, True)             # no cache
        np.testing.assert_allclose(want, ref.conv_bias_relu(x, w, b, **kw), rtol=1e-5,
                                   atol=1e-5)
        with weights.enabled():
            for call in range(2):
                with weights.vouch(w, owner):
                    got = cpu_conv.conv_forward(x, w, b, geom, True)
                assert got.tobytes() == want.tobytes()
                assert [k[3] for k in weights._CACHE] == ["matrix"], list(weights._CACHE)
            assert weights.stats()["hits"] == 1, weights.stats()
            w *= -1.0                                                 # changed in place ...
            owner._version += 1                                       # ... and said so
            with weights.vouch(w, owner):
                got = cpu_conv.conv_forward(x, w, b, geom, True)
        np.testing.assert_allclose(got, ref.conv_bias_relu(x, w, b, **kw), rtol=1e-5,
                                   atol=1e-5)


def test_a_1x1_convs_transposed_weights_are_one_entry_for_the_nhwc_forward_and_nchw_dx():
    # cpu_pointwise.transposed_weights: w^T of a 1x1 conv, what the NHWC forward and the NCHW
    # dX multiply by, kept once with the cache on (the second use a hit), the same bits as
    # without it, and made again after w changes
    import numbafuse as nf
    from numbafuse.kernels.conv import cpu as cpu_conv, cpu_plan
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((24, 40, 1, 1)) / 10).astype(np.float32)
    b = np.zeros(24, np.float32)
    x = rng.standard_normal((2, 5, 6, 40)).astype(np.float32)                  # NHWC
    g_nhwc = nf.validate.conv_geometry("t", x.shape, w.shape, 1, 0, 1, "NHWC")
    xc = np.ascontiguousarray(x.transpose(0, 3, 1, 2))                         # NCHW
    g_nchw = nf.validate.conv_geometry("t", xc.shape, w.shape, 1, 0, 1, "NCHW")
    dy = rng.standard_normal((2, 24, 5, 6)).astype(np.float32)
    plans = tuple(cpu_plan.plan(g_nchw, p, np.float32, algorithm="pointwise")
                  for p in ("dx", "dw"))
    fwd = cpu_plan.plan(g_nhwc, "forward", np.float32, algorithm="pointwise")
    want_y = cpu_conv.conv_forward(x, w, b, g_nhwc, False, fwd)
    want_dx = cpu_conv.conv_backward(dy, xc, w, g_nchw, None, (True, False, False), plans)[0]
    w2 = w[:, :, 0, 0].astype(np.float64)                              # (K, C)
    np.testing.assert_allclose(want_y, np.einsum("nhwc,kc->nhwk", x, w2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(want_dx, np.einsum("kc,nkhw->nchw", w2, dy), rtol=1e-5,
                               atol=1e-5)
    owner = Owner()
    with weights.enabled():
        with weights.vouch(w, owner):
            y = cpu_conv.conv_forward(x, w, b, g_nhwc, False, fwd)
            dx = cpu_conv.conv_backward(dy, xc, w, g_nchw, None, (True, False, False), plans)[0]
        assert [k[3] for k in weights._CACHE] == ["transposed"], list(weights._CACHE)
        assert weights.stats()["hits"] == 1, weights.stats()
        assert y.tobytes() == want_y.tobytes() and dx.tobytes() == want_dx.tobytes()
        w *= -1.0                                                     # changed in place ...
        owner._version += 1                                           # ... and said so
        with weights.vouch(w, owner):
            dx = cpu_conv.conv_backward(dy, xc, w, g_nchw, None, (True, False, False), plans)[0]
    assert dx.tobytes() == (-want_dx).tobytes()


torch_tests = pytest.mark.torch


def _model(torch, nft):
    torch.manual_seed(0)
    model = nft.ResNet(nft.BasicBlock, [1, 1], num_classes=3, width=8)
    return nft.fuse(model)


@torch_tests
def test_fused_model_with_the_cache_computes_what_it_computes_without(conv_rules):
    torch = pytest.importorskip("torch")
    import numbafuse.torch as nft
    # the register-tile paths, which keep reordered weights, as AVX-512's plan takes them
    # (with 8-float tiles this model's small layers run im2col on w as it is: nothing kept)
    conv_rules(taps=True)
    fused = _model(torch, nft)
    x = torch.randn(4, 3, 16, 16)

    def forward():
        with torch.no_grad():
            return fused(x)

    def step():
        fused.zero_grad(set_to_none=True)
        out = fused(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in fused.parameters()]

    fused.eval()
    want = forward()
    with nft.weight_cache():
        assert torch.equal(forward(), want) and torch.equal(forward(), want)   # a hit
        assert weights.stats()["hits"] > 0
    bn = next(m for m in fused.modules() if isinstance(m, torch.nn.BatchNorm2d))
    for change in (lambda: bn.running_var.mul_(2.0),     # folded into its conv: seen too
                   lambda: bn.weight.add_(0.5),
                   lambda: [p.mul_(1.25) for p in fused.parameters()]):   # an optimizer step
        with torch.no_grad():
            change()
        changed = forward()                              # no cache: the truth
        with nft.weight_cache():
            assert torch.equal(forward(), changed)
    fused.train()
    y0, g0 = step()
    fused.load_state_dict(fused.state_dict())            # same values, new versions
    with nft.weight_cache():
        y1, g1 = step()
        y2, g2 = step()                                  # the recompute's hits
    assert torch.equal(y0, y1) and torch.equal(y1, y2)
    assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(g0, g1, g2))


@torch_tests
def test_without_the_cache_a_write_through_data_is_seen():
    # the reason the cache is opt-in: p.data writes do not bump p._version
    torch = pytest.importorskip("torch")
    import numbafuse.torch as nft
    fused = _model(torch, nft).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        before = fused(x)
        conv = next(m for m in fused.modules() if isinstance(m, torch.nn.Conv2d))
        version = conv.weight._version
        conv.weight.data.mul_(-1.0)
        assert conv.weight._version == version
        assert not torch.equal(fused(x), before)


@torch_tests
def test_grouped_taps_are_kept_per_groups_and_the_same_with_the_cache():
    # cpu_grouped_taps reorders w into its merged groups' taps (forward) and their flipped
    # transposes (dX): kept under the cache like the ungrouped passes' arrays, keyed by the
    # groups too (one (32, 4, 3, 3) w is 8 groups of 4 channels or 4 groups of 4 -> 8)
    torch = pytest.importorskip("torch")
    import numbafuse.torch as nft
    from numbafuse.kernels.conv import cpu_grouped_taps
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, groups=4, bias=False),
                          nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1, groups=8, bias=False),
                          nn.BatchNorm2d(32), nn.ReLU())
    fused = nft.fuse(model)
    x = torch.randn(3, 16, 8, 8)

    def step():
        fused.zero_grad(set_to_none=True)
        out = fused(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in fused.parameters()]

    kept = []
    make = cpu_grouped_taps._taps_of
    try:
        cpu_grouped_taps._taps_of = lambda w, geom, m: kept.append(geom.groups) or make(w, geom,
                                                                                         m)
        y0, g0 = step()
        made = [len(kept)]
        with nft.weight_cache():
            y1, g1 = step()
            made.append(len(kept))
            y2, g2 = step()
            made.append(len(kept))
    finally:
        cpu_grouped_taps._taps_of = make
    assert set(kept) == {4, 8}
    # uncached: each conv's forward and recompute, and the second's dX (x needs no gradient);
    # cached: those taps once each, and nothing again in the second step
    assert made == [5, 5 + 3, 5 + 3]
    assert torch.equal(y0, y1) and torch.equal(y1, y2)
    assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(g0, g1, g2))
