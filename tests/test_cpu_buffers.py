"""The reused output buffers (``kernels/cpu/buffers.py``) and the convolution's use of them.

A buffer may be handed out again only when no array views it: a held output (or a view of
it) must never be overwritten by a later call; a released one is reused (same address, no new
bytes owned); the byte cap, the small-output and tracemalloc bypasses hold.
"""
import gc
import tracemalloc

import numpy as np

import numbafuse as nf
from numbafuse.kernels.cpu.buffers import OutputCache, output_cache

MIB = 1 << 20


def _addr(a):
    return a.__array_interface__["data"][0]


def test_released_buffers_are_reused_held_ones_never():
    cache = OutputCache(max_bytes=8 * MIB)
    a = cache.empty((MIB // 4,), np.float32)                     # 1 MiB
    assert a.shape == (MIB // 4,) and a.dtype == np.float32 and a.flags.c_contiguous
    assert _addr(a) % OutputCache.ALIGN == 0                      # a cache line's start
    view = a[10:20]
    del a
    b = cache.empty((512, 512), np.float32)                       # same bytes: a is in use
    assert not np.shares_memory(view, b) and cache.owned_bytes() == 2 * MIB
    address = _addr(view) - 10 * 4
    del view                                                      # a's buffer free again
    c = cache.empty((1024, 256), np.float32)
    assert _addr(c) == address and cache.owned_bytes() == 2 * MIB
    assert _addr(b) % 64 == 0 and _addr(c) % 64 == 0
    d = cache.empty((MIB // 8,), np.float64)                      # other dtype, same bytes
    assert not np.shares_memory(d, b) and not np.shares_memory(d, c)


def test_the_cap_evicts_free_buffers_then_falls_back_to_numpy():
    cache = OutputCache(max_bytes=3 * MIB)
    held = [cache.empty((MIB,), np.uint8) for _ in range(2)]
    free = cache.empty((MIB,), np.uint8)
    del free                                                      # 3 MiB owned, 1 free
    big = cache.empty((2 * MIB,), np.uint8)                       # evicts the free one: 4 > 3
    assert cache.owned_bytes() == 2 * MIB and big.base is None    # ... still too big: NumPy's
    del big
    other = cache.empty((MIB,), np.uint8)
    assert cache.owned_bytes() == 3 * MIB and other.base is not None
    cache.clear()                                                 # the held ones stay
    assert cache.owned_bytes() == 3 * MIB
    del held, other
    cache.clear()
    assert cache.owned_bytes() == 0


def test_buffers_are_found_by_size_and_evicted_from_every_index():
    # buffers of two sizes, two of each: a request reuses a free buffer of its own size only,
    # never a held one; an evicted buffer is gone from the lookup by size too (a later request
    # of its size makes a new one, counted), and the bytes owned stay the buffers' sum
    cache = OutputCache(max_bytes=6 * MIB)
    a1, a2 = cache.empty((MIB,), np.uint8), cache.empty((MIB,), np.uint8)
    b = cache.empty((2 * MIB,), np.uint8)
    c = cache.empty((MIB // 4,), np.float64)                         # 2 MiB too, other dtype
    assert cache.owned_bytes() == 6 * MIB
    addr_a2, addr_b = _addr(a2), _addr(b)
    del a2, b
    again = cache.empty((MIB // 2,), np.uint16)                      # 1 MiB: a2's (a1 held)
    two = cache.empty((2 * MIB,), np.uint8)                          # 2 MiB: b's (c held)
    assert _addr(again) == addr_a2 and _addr(two) == addr_b
    assert cache.owned_bytes() == 6 * MIB
    del again                                                        # a2's buffer free
    three = cache.empty((3 * MIB,), np.uint8)      # evicts a2's buffer, still too big: NumPy's
    assert three.base is None and cache.owned_bytes() == 5 * MIB
    one = cache.empty((MIB,), np.uint8)            # a1 held, a2's gone: a new buffer
    assert not np.shares_memory(one, a1) and cache.owned_bytes() == 6 * MIB
    assert len(cache._by_size[MIB + OutputCache.ALIGN]) == 2 and len(cache._buffers) == 4
    del a1, c, two, one
    cache.clear()
    assert cache.owned_bytes() == 0 and not cache._by_size and not cache._buffers


def test_small_outputs_and_tracemalloc_bypass_the_cache():
    cache = OutputCache()
    assert cache.empty((OutputCache.MIN_BYTES // 8,), np.float32).base is None
    tracemalloc.start()
    try:
        assert cache.empty((MIB,), np.float32).base is None
    finally:
        tracemalloc.stop()
    assert cache.owned_bytes() == 0


def test_conv_outputs_held_by_the_caller_are_never_overwritten(rng):
    # outputs of 1 MiB and more (above MIN_BYTES): forward (y) and backward (dx) of the 1x1
    # and the strided paths
    for kw, layout in ((dict(stride=1, padding=0), "NHWC"), (dict(stride=2, padding=1), "NCHW")):
        shape = (8, 32, 64, 64) if layout == "NCHW" else (8, 64, 64, 32)
        k = 1 if kw["stride"] == 1 else 3
        w = (rng.standard_normal((32, 32, k, k)) / 8).astype(np.float32)
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
        ys = [nf.conv_bias_relu(x, w, None, layout=layout, **kw) for x in xs]   # all held
        assert ys[0].nbytes >= OutputCache.MIN_BYTES
        for i, x in enumerate(xs):
            np.testing.assert_array_equal(ys[i], nf.conv_bias_relu(x, w, None, layout=layout,
                                                                   **kw))
        for i in range(3):
            for j in range(i):
                assert not np.shares_memory(ys[i], ys[j])
        gy = np.ones_like(ys[0])
        dx0 = nf.conv_bias_relu_backward(gy, xs[0], w, ys[0], layout=layout, **kw)[0]
        kept = dx0.copy()
        dx1 = nf.conv_bias_relu_backward(gy, xs[1], w, ys[1], layout=layout, **kw)[0]
        assert not np.shares_memory(dx0, dx1)
        np.testing.assert_array_equal(dx0, kept)


def test_released_conv_outputs_are_reused(rng):
    x = rng.standard_normal((4, 64, 64, 32)).astype(np.float32)
    w = (rng.standard_normal((64, 32, 1, 1)) / 8).astype(np.float32)
    # an earlier test's array of this size freed by the cyclic collector mid-loop would be
    # taken instead (the first free buffer of the size): collect first
    gc.collect()
    addresses, owned = set(), set()
    for _ in range(4):
        y = nf.conv_bias_relu(x, w, None, layout="NHWC")
        addresses.add(_addr(y))
        del y
        owned.add(output_cache.owned_bytes())
    assert len(addresses) == 1 and len(owned) == 1


def _root(a):
    while a.base is not None:
        a = a.base
    return a


def test_the_digits_models_activations_come_from_the_cache(rng):
    # The quick start's activations (batch 32, 24 channels, 8x8: 196 KB) are under glibc's
    # mmap threshold; as fresh arrays their pages went back to the OS each step and faulted
    # in again (buffers.py: why MIN_BYTES is 64 KiB). The forward's y and the backward's dx,
    # both layouts, and the smallest size the cache takes.
    assert OutputCache.MIN_BYTES <= 64 << 10
    owned = {id(e[0]) for e in output_cache._buffers}
    for layout in ("NCHW", "NHWC"):
        shape = (32, 24, 8, 8) if layout == "NCHW" else (32, 8, 8, 24)
        x = rng.standard_normal(shape).astype(np.float32)
        w = (rng.standard_normal((24, 24, 3, 3)) / 8).astype(np.float32)
        y = nf.conv_bias_relu(x, w, None, padding=1, layout=layout)
        dx, _, _ = nf.conv_bias_relu_backward(np.ones_like(y), x, w, y, padding=1,
                                              layout=layout)
        owned = {id(e[0]) for e in output_cache._buffers}
        assert id(_root(y)) in owned and id(_root(dx)) in owned, layout
    small = output_cache.empty((OutputCache.MIN_BYTES // 4,), np.float32)
    assert id(_root(small)) in {id(e[0]) for e in output_cache._buffers}


def test_aligned_starts_on_a_cache_line_and_keeps_the_values():
    """buffers.aligned: a C-contiguous copy on a 64-byte boundary (the depthwise kernels'
    taps and bias), or the array itself where it is one already."""
    from numbafuse.kernels.cpu.buffers import aligned
    rng = np.random.default_rng(0)
    for shape in ((96,), (49, 96), (7, 5, 3)):
        for dtype in (np.float32, np.float64):
            base = rng.standard_normal(shape).astype(dtype)
            raw = np.empty(base.nbytes + 128, np.uint8)
            for off in (0, 4, 16, 48):               # every start NumPy gives, and odd ones
                start = -raw.ctypes.data % 64 + off
                a = raw[start:start + base.nbytes].view(dtype).reshape(shape)
                a[...] = base
                for src in (a, a.T):                 # contiguous, and a transposed view
                    out = aligned(src)
                    assert out.ctypes.data % 64 == 0 and out.flags.c_contiguous
                    assert out.shape == src.shape and out.dtype == src.dtype
                    assert out.tobytes() == np.ascontiguousarray(src).tobytes()
                    if off == 0 and src is a:
                        assert out is a                      # nothing copied
