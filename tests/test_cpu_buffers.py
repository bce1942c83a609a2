"""The reused output buffers (``kernels/cpu/buffers.py``) and the convolution's use of them.

A buffer may be handed out again only when no array views it: a held output (or a view of
it) must never be overwritten by a later call; a released one is reused (same address, no new
bytes owned); the byte cap, the small-output and tracemalloc bypasses hold.
"""
import gc
import tracemalloc

import numpy as np
from hypothesis import given, settings, strategies as st

import numbafuse as nf
from numbafuse.kernels.cpu.buffers import OutputCache, output_cache

MIB = 1 << 20


def _addr(a):
    return a.__array_interface__["data"][0]


def _tiny(max_bytes=1 << 20):
    """A cache with its pools shrunk: requests from 64 bytes, up to SMALL 2 KiB from 4 KiB
    segments, up to LARGE 8 KiB from 16 KiB ones, larger ones in own segments of 4 KiB
    multiples."""
    cache = OutputCache(max_bytes=max_bytes)
    cache.MIN_BYTES, cache.SMALL, cache.SMALL_SEGMENT = 64, 2048, 4096
    cache.LARGE, cache.LARGE_SEGMENT, cache.ROUND_LARGE = 8192, 16384, 4096
    return cache


def test_released_buffers_are_reused_held_ones_never():
    cache = OutputCache(max_bytes=8 * MIB)
    a = cache.empty((MIB // 4,), np.float32)                     # 1 MiB
    assert a.shape == (MIB // 4,) and a.dtype == np.float32 and a.flags.c_contiguous
    assert _addr(a) % OutputCache.ALIGN == 0                      # a cache line's start
    view = a[10:20]
    del a
    b = cache.empty((512, 512), np.float32)                       # same bytes: a is in use
    assert not np.shares_memory(view, b) and cache.owned_bytes() == OutputCache.SMALL_SEGMENT
    address = _addr(view) - 10 * 4
    del view                                                      # a's block free again
    c = cache.empty((1024, 256), np.float32)
    assert _addr(c) == address and cache.owned_bytes() == OutputCache.SMALL_SEGMENT
    assert _addr(b) % 64 == 0 and _addr(c) % 64 == 0
    d = cache.empty((MIB // 8,), np.float64)                      # other dtype, same bytes
    assert not np.shares_memory(d, b) and not np.shares_memory(d, c)


def test_released_blocks_serve_other_sizes_and_merge_with_their_neighbours():
    cache = _tiny()
    a, b, c = (cache.empty((256,), np.float32) for _ in range(3))      # 1 KiB each, small
    assert cache.owned_bytes() == 4096 and _addr(b) - _addr(a) == 1024
    addr_a = _addr(a)
    del a
    half = cache.empty((128,), np.float32)              # 512 bytes: the first block, split
    assert _addr(half) == addr_a and cache.owned_bytes() == 4096
    del half, b                                         # 1 KiB + 1 KiB merged: 2 KiB from a's
    two = cache.empty((512,), np.float32)
    assert _addr(two) == addr_a and not np.shares_memory(two, c)
    assert cache.owned_bytes() == 4096
    big = cache.empty((3 * 1024,), np.uint8)            # large pool: a segment of its own kind
    assert cache.owned_bytes() == 4096 + 16384 and not np.shares_memory(big, two)
    del two, c, big
    cache.clear()
    assert cache.owned_bytes() == 0


def test_the_cap_drops_free_segments_then_falls_back_to_numpy():
    cache = _tiny(max_bytes=3 * 4096)
    held = [cache.empty((1024,), np.uint8) for _ in range(4)]     # one small segment, full
    free = cache.empty((1024,), np.uint8)                         # a second one
    del free                                                      # 8 KiB owned, 4 KiB free
    big = cache.empty((3 * 4096,), np.uint8)       # own 12 KiB segment: drops the free one,
    assert big.base is None and cache.owned_bytes() == 4096       # ... still too big: NumPy's
    del big
    other = cache.empty((8 * 1024,), np.uint8)   # its pool's 16 KiB > 12 - 4: its own 8 KiB
    assert _from_cache(cache, other) and cache.owned_bytes() == 4096 + 8192
    del other
    small = cache.empty((1024,), np.uint8)         # a small segment: other's (free) dropped
    assert _from_cache(cache, small) and cache.owned_bytes() == 2 * 4096
    cache.clear()                                                 # the held ones stay
    assert cache.owned_bytes() == 2 * 4096
    del held, small
    cache.clear()
    assert cache.owned_bytes() == 0


def test_a_large_pool_segment_is_an_arena_its_pages_reached_as_blocks_are():
    """Large requests of every size share the large pool's segments (arenas: address space,
    resident only where blocks reach): released blocks of one size merge and serve another,
    and touched_bytes is the highest block's end, not the segment's size."""
    cache = _tiny()
    a = cache.empty((3000,), np.uint8)                  # 3008 bytes (64-byte multiples)
    b = cache.empty((5000,), np.uint8)
    assert cache.owned_bytes() == 16384 and _addr(b) - _addr(a) == 3008
    assert cache.touched_bytes() == 3008 + 5056
    addr_a = _addr(a)
    del a, b
    c = cache.empty((8000,), np.uint8)                  # the two merged: from a's address
    assert _addr(c) == addr_a and cache.owned_bytes() == 16384
    assert cache.touched_bytes() == 3008 + 5056


def test_an_arena_refused_its_address_space_falls_back_to_a_segment_of_its_own(monkeypatch):
    import numbafuse.kernels.cpu.buffers as buffers
    made = buffers._Segment

    def strict(size, align, pool):                      # strict overcommit: no 16 KiB arena
        if size == 16384:
            raise MemoryError
        return made(size, align, pool)
    monkeypatch.setattr(buffers, "_Segment", strict)
    cache = _tiny()
    a = cache.empty((5000,), np.uint8)
    assert _from_cache(cache, a) and cache.owned_bytes() == 8192        # 4 KiB multiples


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(("new", "new", "new", "drop", "view", "clear")),
                          st.integers(1, 24 * 1024), st.integers(0, 1 << 30)),
                max_size=60))
def test_live_arrays_never_share_bytes(program):
    """Any program of requests (sizes in every pool, across the segment sizes and the cap),
    releases, views kept past their base and clears: no two live arrays share a byte, each
    keeps what was written into it, the bytes owned stay under the cap and are the segments'
    sum, and with everything released one clear leaves nothing owned."""
    cache = _tiny(max_bytes=64 * 1024)
    live = []                                          # (array, its fill byte)
    for k, (op, size, pick) in enumerate(program):
        if op == "new":
            a = cache.empty((size,), np.uint8)
            a[...] = k % 251
            live.append((a, k % 251))
        elif op == "drop" and live:
            live.pop(pick % len(live))
        elif op == "view" and live:
            a, fill = live.pop(pick % len(live))
            live.append((a[len(a) // 3:], fill))       # the base let go, a view of it kept
        elif op == "clear":
            cache.clear()
        for a, fill in live:
            assert (a == fill).all()
        for i in range(len(live)):
            for j in range(i):
                assert not np.shares_memory(live[i][0], live[j][0])
        assert cache.owned_bytes() <= cache.max_bytes
        assert cache.owned_bytes() == sum(seg.size for seg in cache._segments)
    live = a = None
    cache.clear()
    assert cache.owned_bytes() == 0 and not cache._segments
    assert not any(cache._free) and not cache._used


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


def _from_cache(cache, a):
    """Whether ``a`` views a block the cache handed out (its root array is a block's owner)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return any(block.ref() is a for block in cache._used)


def test_the_digits_models_activations_come_from_the_cache(rng):
    # The quick start's activations (batch 32, 24 channels, 8x8: 196 KB) are under glibc's
    # mmap threshold; as fresh arrays their pages went back to the OS each step and faulted
    # in again (buffers.py: why MIN_BYTES is 64 KiB). The forward's y and the backward's dx,
    # both layouts, and the smallest size the cache takes.
    assert OutputCache.MIN_BYTES <= 64 << 10
    for layout in ("NCHW", "NHWC"):
        shape = (32, 24, 8, 8) if layout == "NCHW" else (32, 8, 8, 24)
        x = rng.standard_normal(shape).astype(np.float32)
        w = (rng.standard_normal((24, 24, 3, 3)) / 8).astype(np.float32)
        y = nf.conv_bias_relu(x, w, None, padding=1, layout=layout)
        dx, _, _ = nf.conv_bias_relu_backward(np.ones_like(y), x, w, y, padding=1,
                                              layout=layout)
        assert _from_cache(output_cache, y) and _from_cache(output_cache, dx), layout
    small = output_cache.empty((OutputCache.MIN_BYTES // 4,), np.float32)
    assert _from_cache(output_cache, small)


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


def test_a_repeated_step_gets_the_same_blocks_back():
    """A step's requests made again after its arrays are gone get the same bytes back, size by
    size (the stash), with nothing more owned (released blocks still merge for a size not
    stashed: test_released_blocks_serve_other_sizes_and_merge_with_their_neighbours)."""
    cache = _tiny()
    sizes = (300, 1000, 5000, 300, 2000, 7000, 1000)

    def step():
        arrays = [cache.empty((n,), np.uint8) for n in sizes]
        return [_addr(a) for a in arrays]
    first = step()
    owned = cache.owned_bytes()
    for _ in range(3):
        assert step() == first and cache.owned_bytes() == owned
