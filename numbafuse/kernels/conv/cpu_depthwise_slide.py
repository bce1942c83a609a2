"""The sliding tiles of the depthwise NHWC forward (``cpu_depthwise_nhwc.forward_tiled``):
an output row's interior run of pixels, float32, one 16-float vector of channels at a time,
each input vector of a tap row loaded once for every pixel it reaches.

    depthwise_slide(m, n, R, S, sw, px, ldr, pw, pc, ldc, pbias, relu)     # 7 tap columns
    depthwise_slide5(...)                                                 # 5, where SLIDE_TAPS

A run of m >= SLIDE_MIN pixels is cut into :func:`slides`, each computed by the tile of its
size (8 to 16 pixels, compiled for each stride, 1 or 2, and tap count); :func:`slid` says how
many a run gets (the rest goes to ``cpu_depthwise_tiles.depthwise_taps``). Each value is the
sum over the taps in (r, s) order: the other NHWC kernels' bits.
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..cpu import gemm_taps as _gemm_taps
from ..cpu import steps as _steps
from ..cpu.gemm import Vec
from ..cpu.steps import Step

_I64 = ir.IntType(64)

# Output pixels of a sliding tile (one 16-float vector of channels): 16 accumulators, 16 independent
# chains of multiply-adds (8 had too few in flight: 3x3 and 3x3/2 forwards 1.2-1.5x slower than the
# tap tiles), 7 weight vectors and the input vector in registers. Made for 7 tap columns (dw 1; sw 1
# or 2) only: with 3 and 5 the tap tiles measured faster (3x3 at 56x56: 2.7-2.9 ms against 2.1-2.5;
# 5x5 (32, 96, 28, 28): 1.55-1.73 against 1.16-1.50; and 8 pixels x 32 channels at 3: 2.93-3.01
# against 2.20-2.51). One thread, machine E (Zen 5), aligned, three alternating processes (ms; the
# tap tiles alone -> with the sliding ones): 7x7 (32, 96, 28, 28) 1.83-1.87 -> 1.58-1.62 (a 22-pixel
# run: 16 + 6 by the tap tiles); 7x7/2 (11-pixel runs: unused) 0.574-0.592 -> 0.567-0.576.
#
# A run is covered exactly by slides of 8 to 16 pixels (``slides``: as few as 16-pixel ones
# would take, their sizes within one of each other), not by 16-pixel slides and the tap tiles
# for the rest: 7x7 interior runs are W - 6 pixels at stride 1 and W/2 - 3 at stride 2 (11 at
# a 28x28 input: none slid before). Machine A, (32, 96, 28, 28), two threads: 7x7/2 0.59-0.79
# -> 0.46-0.50 ms (PyTorch 0.48-0.57), 7x7 1.47-1.58 -> 1.35-1.37 (docs/conv_bias_relu.md,
# "The NHWC 7x7 runs cut exactly into sliding tiles").
SLIDE = 16
SLIDE_MIN = 8


def _emit_slide(builder, S, sw, n, args, width=16):
    """The sliding micro-kernel for ``n`` consecutive output pixels of a row (pixel i's tap
    column s reads input column i*sw + s) and one vector of channels, emitted at the builder;
    args = (R, px, ldr, ld, pw, c, ldc, bias, relu), int64 values: c[i, :width] = relu?(sum
    over r < R, s < S of x[r*ldr + (i*sw + s)*ld][:width] * w[(r*S + s)*ld][:width] + bias?)
    for i < n, each sum in (r, s) order; px, pw, c, bias:
    addresses (bias 0: none); ldr, ld, ldc: strides in float32 elements. Per tap row its S
    weight vectors stay in registers and each input vector of the row is loaded once and
    added into every pixel whose tap it is ((n-1)*sw + S loads for n*S multiply-adds, against
    one load each in ``depthwise_taps``)."""
    R, px, ldr, ld, pw, c, ldc, bias, relu = args
    V = Vec(builder, width)
    x0, w0, c = V.floats(px), V.floats(pw), V.floats(c)
    acc = V.accumulators(n, 1)
    with cgutils.for_range(builder, R) as rows:
        r = rows.index
        xr = builder.gep(x0, [builder.mul(r, ldr)])
        wr = builder.gep(w0, [builder.mul(builder.mul(r, ir.Constant(_I64, S)), ld)])
        wv = [V.load(wr, builder.mul(ir.Constant(_I64, t), ld)) for t in range(S)]
        for u in range((n - 1) * sw + S):
            xv = V.load(xr, builder.mul(ir.Constant(_I64, u), ld))
            for i in range(n):                      # ascending u: each pixel's s ascending
                t = u - i * sw
                if 0 <= t < S:
                    builder.store(builder.call(V._fma, [xv, wv[t], builder.load(acc[i][0])]),
                                  acc[i][0])
    V.bias_relu(acc, bias, relu)
    V.store_rows(acc, c, ldc)


def _slide_tiles(S, width=16):
    """An intrinsic ``tile(k, sw, R, px, ldr, ld, pw, c, ldc, bias, relu)`` (all int64): the
    sliding tile of k pixels (SLIDE_MIN <= k <= SLIDE; another k computes nothing) at stride
    sw (1 or 2) with S tap columns, :func:`_emit_slide`'s, one case of a switch on (sw, k)
    in the compiled code for each."""
    @intrinsic
    def tile(typingctx, k, sw, R, px, ldr, ld, pw, c, ldc, bias, relu):
        def codegen(context, builder, signature, args):
            k, sw, rest = args[0], args[1], args[2:]
            key = builder.add(builder.mul(sw, ir.Constant(_I64, SLIDE + 1)), k)
            done = builder.append_basic_block("slide.done")
            cases = builder.switch(key, done)
            for stride in (1, 2):
                for n in range(SLIDE_MIN, SLIDE + 1):
                    block = builder.append_basic_block(f"slide.{stride}.{n}")
                    cases.add_case(ir.Constant(_I64, stride * (SLIDE + 1) + n), block)
                    with builder.goto_block(block):
                        _emit_slide(builder, S, stride, n, rest, width)
                        builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 11)), codegen

    return tile


# Tap columns that slide: 7 everywhere (AVX-512), 5 where the CPU splits 512-bit FMAs in two
# (Zen 4, ``gemm_taps.SPLIT_512``), whose tap tiles run at half the rate of Zen 5's. Machine A
# (Zen 4), aligned NHWC, 5x5, one thread, two alternating processes twice, best of 10 x 10, ms
# the tap tiles / the sliding ones: (32, 96, 28, 28) 2.36-2.45 / 1.59-1.85, its stride 2
# 0.65-0.73 / 0.50-0.57, (32, 192, 14, 14) 0.94-1.03 / 0.73, (8, 144, 56, 56) 4.10 / 2.49-2.59
# and stride 2 1.10-1.13 / 0.97-1.32, (8, 240, 28, 28) 1.21-1.40 / 0.88-0.89. (3x3 was not made
# to slide: at (32, 64, 56, 56) 3.3-4.1 against 6.7-6.8 ms.)
SLIDE_TAPS = (7, 5) if _gemm_taps.SPLIT_512 else (7,)

_slide7, _slide5 = _slide_tiles(7), _slide_tiles(5)


@njit(nogil=True, cache=True)
def depthwise_slide(m, n, R, S, sw, px, ldr, pw, pc, ldc, pbias, relu):
    """A run of m output pixels of one row by the sliding tiles, n (a multiple of 16)
    channels: every pixel, by the slides :func:`slides` cuts the run into (none under
    SLIDE_MIN: :func:`slid`). Pixel i's first tap at ``px + 4*i*sw*n`` (tap (r, s) then
    ``r*ldr + s*n`` elements on), tap (r, s)'s weights at ``pw + 4*(r*S + s)*n``, its output
    at ``pc + 4*i*ldc``; S in SLIDE_TAPS, sw 1 or 2; every argument int64. (A step, which
    returns nothing: the caller learns the count from :func:`slid`.)"""
    done = slid(m)
    k, big = slides(done)
    for j in range(0, n, 16):
        pwj = pw + 4 * j
        pbiasj = pbias + 4 * j if pbias != 0 else 0
        i = 0
        t = 0
        while i < done:
            size = k + 1 if t < big else k              # (the larger ones first)
            _slide7(size, sw, R, px + 4 * (i * sw * n + j), ldr, n, pwj,
                    pc + 4 * (i * ldc + j), ldc, pbiasj, relu)
            i += size
            t += 1


@njit(nogil=True, cache=True)
def depthwise_slide5(m, n, R, S, sw, px, ldr, pw, pc, ldc, pbias, relu):
    """As :func:`depthwise_slide`, 5 tap columns (S == 5)."""
    done = slid(m)
    k, big = slides(done)
    for j in range(0, n, 16):
        pwj = pw + 4 * j
        pbiasj = pbias + 4 * j if pbias != 0 else 0
        i = 0
        t = 0
        while i < done:
            size = k + 1 if t < big else k              # (the larger ones first)
            _slide5(size, sw, R, px + 4 * (i * sw * n + j), ldr, n, pwj,
                    pc + 4 * (i * ldc + j), ldc, pbiasj, relu)
            i += size
            t += 1


@njit(inline="always")
def slides(m):
    """(k, big): a run of m >= SLIDE_MIN pixels as ceil(m / SLIDE) slides, ``big`` of k + 1
    pixels, then the rest of k (SLIDE_MIN <= k <= SLIDE: every pixel once)."""
    count = max(1, (m + SLIDE - 1) // SLIDE)
    return m // count, m % count


@njit(inline="always")
def slid(m):
    """How many of a run's m pixels :func:`depthwise_slide` computes: none under
    SLIDE_MIN, else all."""
    return m if m >= SLIDE_MIN else 0


# steps (kernels/cpu/steps.py), as cpu_depthwise_tiles' tiles: every argument int64
SLIDE_TILES = Step(depthwise_slide.py_func, lambda f: [(types.int64,) * 12], per_dtype=False)
SLIDE5_TILES = Step(depthwise_slide5.py_func, lambda f: [(types.int64,) * 12],
                    per_dtype=False)
slide_step, slide5_step = SLIDE_TILES.call, SLIDE5_TILES.call


def steps_for(taps):
    """The steps a launch whose sliding problems have these tap-column counts calls."""
    return tuple(step for S, step in ((7, SLIDE_TILES), (5, SLIDE5_TILES)) if S in taps)


def ready(*steps):
    """Fill the slots of ``steps`` (as ``cpu_depthwise_tiles.ready``)."""
    _steps.ready(None, steps)
