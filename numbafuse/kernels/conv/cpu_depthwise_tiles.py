"""A register-tiled micro-kernel for the depthwise NHWC forward, float32.

``depthwise_taps(m, n, ntaps, prow, paoff, pwoff, pw, pc, ldc, pbias, epilogue, wide)``
computes, for m output pixels and n channels (a multiple of 8),

    c[i, :n] = relu?(sum over t < ntaps of x(i, t)[:n] * w(t)[:n] + bias?)

where pixel i's tap t (channel 0) starts at the address ``row[i] + 4 * aoff[t]`` (``prow``,
``paoff``: addresses of int64 arrays of m addresses and ntaps element offsets), w(t) starts
``woff[t]`` float32 elements after ``pw`` (``pwoff``: an int64 table), and ``c`` (m, ldc) is
at ``pc``. A depthwise convolution passes one row per output pixel (the address of its
first tap in x itself: no copy) and the offsets of the taps that lie inside the image,
``(r*dh*W + s*dw)*C`` in x and ``(r*S + s)*C`` in w.

Each (pixels, vectors) block of c is summed in registers over every tap (a fused
multiply-add per tap, in tap order: the sum the other depthwise kernels make, each value
the same whatever the block), then the bias and ReLU, and stored once; the weights of a tap
are loaded once per block of ``DW_ROWS`` pixels (``ROWS`` on AVX2). The loops of
``cpu_depthwise`` kept the accumulator in memory and loaded and stored it at every tap.
A block of pixels goes through every channel panel before the next block starts, so its
input pixels are read whole while they are in L1; panel by panel over the whole run, each
panel read its slice of every pixel again (from L2: a 56-pixel run of 3x3 taps at 64
channels reads 43 KiB), and on machine F (Zen 3, AVX2) the tap loop, which issues ~1.25
loads per multiply-add, ran at ~6 cycles a multiply-add, the misses of the tile's last
pixel (the one reading new input columns) holding it: one thread, NHWC, 3x3 (32, 64, 56,
56) 11.3-12.8 -> 5.9-6.2 ms, 3x3/2 5.1-6.5 -> 4.6-4.7 (benchmarks and docs:
docs/conv_bias_relu.md, "Depthwise: panels inside the pixel blocks").
With the ``STREAM`` bit c goes out by non-temporal stores: an output larger than the caches
is then not read from memory before it is written (cpu_depthwise_nhwc.streams).
"""
import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..cpu import steps as _steps
from ..cpu.gemm import Vec
from ..cpu.gemm_taps import ROWS, WIDE, panel
from ..cpu.steps import Step

_I64 = ir.IntType(64)
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _dw_tile(rows, nv, width):
    """The micro-kernel intrinsic for a (rows, width * nv) block of c."""

    @intrinsic
    def tile(typingctx, ntaps, prow, paoff, xj, w, pwoff, c, ldc, bias, relu, stream):
        """c[r, :width*nv] = relu?(sum over t of x_r,t[:width*nv] * w[woff[t]:][:width*nv]
        + bias?) for r < rows; x_r,t = row[r] + aoff[t] + xj (float32 elements: xj, the
        block's first channel); prow, paoff, pwoff (int64 tables), w, c, bias: addresses
        (bias 0: none); ldc the row stride of c in elements; relu 0 or 1; stream not 0:
        c stored by non-temporal stores (Vec.store_rows)."""
        def codegen(context, builder, signature, args):
            ntaps, prow, paoff, xj, w, pwoff, c, ldc, bias, relu, stream = args
            V = Vec(builder, width)
            prow = builder.inttoptr(prow, _I64.as_pointer())
            paoff = builder.inttoptr(paoff, _I64.as_pointer())
            pwoff = builder.inttoptr(pwoff, _I64.as_pointer())
            w, c = V.floats(w), V.floats(c)
            row = [V.floats(builder.load(builder.gep(prow, [ir.Constant(_I64, r)])))
                   for r in range(rows)]
            acc = V.accumulators(rows, nv)
            zero = ir.Constant(_I64, 0)
            with cgutils.for_range(builder, ntaps) as taps:
                t = taps.index
                off = builder.add(builder.load(builder.gep(paoff, [t])), xj)
                wt = builder.gep(w, [builder.load(builder.gep(pwoff, [t]))])
                wv = [V.load(wt, zero, v) for v in range(nv)]
                for r in range(rows):
                    xr = builder.gep(row[r], [off])
                    for v in range(nv):
                        builder.store(builder.call(V._fma, [V.load(xr, zero, v), wv[v],
                                                            builder.load(acc[r][v])]),
                                      acc[r][v])
            V.bias_relu(acc, bias, relu)
            V.store_rows(acc, c, ldc, stream)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 11)), codegen

    return tile


@intrinsic
def store_fence(typingctx):
    """Orders this thread's non-temporal stores before its later stores (x86 ``sfence``): a
    kernel that streamed its output calls it before its task ends, so that the pool's hand-back
    publishes the values. Elsewhere a sequentially consistent fence."""
    def codegen(context, builder, signature, args):
        if X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.VoidType(), []), "llvm.x86.sse.sfence")
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


# AVX-512: panels of 64, 32, 16 channels (4, 2, 1 vectors of 16), then 8; AVX2: 24, 16, 8
# Pixels per AVX-512 tile: 6 (24 accumulators and 4 weight vectors of the 32 registers at 64
# channels). Every tap's multiply-adds take their x from memory, so a tile's loads per multiply-add
# are 1 + nv / rows (its weights): 1.25 at 4 pixels, 1.17 at 6 (the loads are the bound: Zen 4
# issues one 512-bit FMA a cycle, Zen 5 two). One thread, machine E (Zen 5), aligned NHWC inputs,
# three alternating processes (ms, 4 -> 6 pixels): 7x7 (32, 96, 28, 28) 1.98-2.03 -> 1.86-1.89,
# 7x7/2 0.600-0.612 -> 0.574-0.588, 3x3 (32, 64, 56, 56) 2.69-2.75 -> 2.14-2.20, 3x3/2 0.96-1.09 ->
# 0.91-1.01; the same bits (each sum in tap order whatever the tile). 8 pixels for the 32- and
# 16-channel panels measured no better. The 8-float tiles (AVX2's 16 registers, and the last 8
# channels on AVX-512) keep ROWS. A run's rest goes to a tile of ROWS pixels where that computes
# fewer pixels than a last 6-pixel tile overlapping the one before (a 22-pixel run, the 7x7 interior
# at 28x28: 6+6+6+4, not 6+6+6+6): 7x7 1.96-2.06 -> 1.86-1.97 ms (five alternating pairs, better in
# four), 7x7/2 the same; a cold first NHWC depthwise forward compiles 0.1-0.3 s longer (2.45-2.58 ->
# 2.63-2.79 s CPU).
DW_ROWS = 6
STREAM = 2         # depthwise_taps' epilogue bit: c by non-temporal stores
_w4, _w2, _w1 = (_dw_tile(DW_ROWS, 4, 16), _dw_tile(DW_ROWS, 2, 16),
                 _dw_tile(DW_ROWS, 1, 16))
_w4s, _w2s, _w1s = (_dw_tile(ROWS, 4, 16), _dw_tile(ROWS, 2, 16),    # a run's remainder
                    _dw_tile(ROWS, 1, 16))
_w4r, _w2r, _w1r = _dw_tile(1, 4, 16), _dw_tile(1, 2, 16), _dw_tile(1, 1, 16)
_n3, _n2, _n1 = _dw_tile(ROWS, 3, 8), _dw_tile(ROWS, 2, 8), _dw_tile(ROWS, 1, 8)
_n3r, _n2r, _n1r = _dw_tile(1, 3, 8), _dw_tile(1, 2, 8), _dw_tile(1, 1, 8)


@njit(nogil=True, cache=True)
def depthwise_taps(m, n, ntaps, prow, paoff, pwoff, pw, pc, ldc, pbias, epilogue, wide):
    """See the module docstring (tap t's weights at ``w + woff[t]``, pwoff the address of an
    int64 table; ``epilogue``: bit 0 the ReLU, bit 1 c streamed, ``STREAM``); every argument
    int64 (one compilation), n % 8 == 0."""
    relu, stream = epilogue & 1, epilogue & STREAM
    j0 = 0
    while j0 < n:
        # a group of panels with the same tiles of pixels: every panel on AVX2; on AVX-512
        # those of >= 16 channels (DW_ROWS pixels: all but a last 8, n % 8 == 0), then the
        # last 8 (ROWS)
        short = wide and n - j0 >= 16
        R = DW_ROWS if short else ROWS
        j1 = n - n % 16 if short else n
        i = 0
        while i < m:
            # k pixels from i: full tiles, then the fewest pixels that finish the run: a
            # last tile overlapping the one before (its pixels there get the same sums again,
            # the same bits) of R pixels for a remainder over ROWS, else (short) of ROWS;
            # 1-pixel tiles for a run shorter than any tile. Every panel of the group takes
            # the tile before the next tile starts: the tile's input pixels are read whole
            # while they are in the cache (panel by panel over the run, each panel read
            # its slice of every pixel again from L2)
            left = m - i
            k = 1
            if left >= R:
                k = R
            elif short and left >= ROWS and (left == ROWS or m < R):
                k = ROWS                                            # from i
            elif m >= R and (left > ROWS or not short):
                k = R                                               # overlapping
                i = m - R
            elif short and m >= ROWS:
                k = ROWS                                            # overlapping
                i = m - ROWS
            pr = prow + 8 * i
            j = j0
            while j < j1:
                cols = panel(wide, n - j)
                pwj = pw + 4 * j
                pbiasj = pbias + 4 * j if pbias != 0 else 0
                pcij = pc + 4 * (i * ldc + j)
                if k == ROWS and short:
                    if cols == 64:
                        _w4s(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    elif cols == 32:
                        _w2s(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    else:
                        _w1s(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                elif k == R:
                    if cols == 64:
                        _w4(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    elif cols == 32:
                        _w2(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    elif cols == 24:
                        _n3(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    elif cols == 16:
                        if wide:
                            _w1(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu,
                                stream)
                        else:
                            _n2(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu,
                                stream)
                    else:
                        _n1(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                else:
                    if cols == 64:
                        _w4r(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    elif cols == 32:
                        _w2r(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    elif cols == 24:
                        _n3r(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                    elif cols == 16:
                        if wide:
                            _w1r(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu,
                                 stream)
                        else:
                            _n2r(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu,
                                 stream)
                    else:
                        _n1r(ntaps, pr, paoff, j, pwj, pwoff, pcij, ldc, pbiasj, relu, stream)
                j += cols
            i += k
        j0 = j1



# ------------------------------------------------------- NCHW forward, 7x7, stride 1 or 2

ROWS7 = 4          # output rows of one 7x7 tile: at stride 1 10 input rows, each load used by
                   # up to 4 FMAs


def _rows7_tile(rows, nv, width, stride):
    """The NCHW 7x7 micro-kernel intrinsic (stride 1 or 2 in both directions) for a (rows,
    width * nv) block of c."""
    R = S = 7

    @intrinsic
    def tile(typingctx, px, ldx, plane, pw, c, ldc, bias, relu):
        """c[o, :width*nv] = relu?(sum over r, s < 7 in (r, s) order of w[7r + s] times the
        phase plane (r % stride, s % stride)'s row o + r // stride at column s // stride,
        + bias?) for o < rows: px the address of phase plane 0's row of output row 0 (float32,
        at the panel's first column), ldx the phase rows' stride and plane the phase planes'
        (in elements; planes r-phase-major as cpu_phases.split_phases makes them), pw the 49
        float32 weights, c (row stride ldc), bias (0: none; else one value per lane), relu 0
        or 1 (all int64). Each phase row's vector at a column offset is loaded once and used
        by every output row it reaches: at stride 1 4 FMAs a load in the middle of a tile,
        where depthwise_taps loads one vector per FMA. Each sum is still taken in (r, s)
        order (the loads go by phase row i, then row phase a, then s; output o's tap r is
        stride * (i - o) + a: ascending): the same bits as the general tiles."""
        def codegen(context, builder, signature, args):
            px, ldx, plane, pw, c, ldc, bias, relu = args
            V = Vec(builder, width)
            x, w, c = V.floats(px), V.floats(pw), V.floats(c)
            acc = V.accumulators(rows, nv)
            for i in range(rows + (R - 1) // stride):
                for a in range(stride):
                    taps_r = [(r, i - r // stride) for r in range(a, R, stride)
                              if 0 <= i - r // stride < rows]
                    if not taps_r:
                        continue
                    for s in range(S):
                        phase = a * stride + s % stride
                        off = builder.add(builder.add(
                            builder.mul(ir.Constant(_I64, phase), plane),
                            builder.mul(ir.Constant(_I64, i), ldx)),
                            ir.Constant(_I64, s // stride))
                        splats = [V.splat(builder.gep(w, [ir.Constant(_I64, r * S + s)]))
                                  for r, _ in taps_r]
                        for v in range(nv):
                            xv = V.load(x, off, v)
                            for (r, o), wv in zip(taps_r, splats):
                                a_ = acc[o][v]
                                builder.store(builder.call(V._fma, [xv, wv, builder.load(a_)]),
                                              a_)
            V.bias_relu(acc, bias, relu)
            V.store_rows(acc, c, ldc)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 8)), codegen

    return tile


_r7 = {(stride, rows, nv, width): _rows7_tile(rows, nv, width, stride)
       for stride in (1, 2) for rows in (ROWS7, 1)
       for nv, width in ((2, 16), (1, 16), (1, 8), (2, 8))}
_r7w2, _r7w1, _r7n1 = _r7[1, ROWS7, 2, 16], _r7[1, ROWS7, 1, 16], _r7[1, ROWS7, 1, 8]
_r7w2r, _r7w1r, _r7n1r = _r7[1, 1, 2, 16], _r7[1, 1, 1, 16], _r7[1, 1, 1, 8]
_r7w2s2, _r7w1s2, _r7n1s2 = _r7[2, ROWS7, 2, 16], _r7[2, ROWS7, 1, 16], _r7[2, ROWS7, 1, 8]
_r7w2rs2, _r7w1rs2, _r7n1rs2 = _r7[2, 1, 2, 16], _r7[2, 1, 1, 16], _r7[2, 1, 1, 8]
_r7n2, _r7n2r, _r7n2s2, _r7n2rs2 = (_r7[1, ROWS7, 2, 8], _r7[1, 1, 2, 8], _r7[2, ROWS7, 2, 8],
                                    _r7[2, 1, 2, 8])


# The tiles depthwise_rows7 compiles: this machine's only (a module constant, so numba prunes the
# other branch before typing it). With both sets behind a runtime flag (as depthwise_taps has) the
# first NCHW 7x7 forward compiled in 6.0-7.5 s of wall on machine F (AVX2), with this machine's
# only 3.9-4.2, the general tiles' path before 3.4-3.8. The other width's tiles are tested alone
# (test_conv_groups.py, test_the_7x7_row_tiles_of_both_widths). On AVX2, 16-column panels (8
# accumulators at 4 rows): 24 (12) measured 1.17x slower, and the 16-float tiles would take all 16
# registers at 32 columns.
ROWS7_WIDE = bool(WIDE)


@njit(nogil=True, cache=True, inline="always")
def rows7_panel(rem):
    """Columns of :func:`depthwise_rows7`'s next panel with ``rem`` (a multiple of 8) left:
    32, 16, 8 on AVX-512; 16, 8 on AVX2 (two 8-float vectors a row: 8 accumulators at 4
    rows, where 32 columns, four vectors a row, would take all 16 registers)."""
    if ROWS7_WIDE:
        return 32 if rem >= 32 else 16 if rem >= 16 else 8
    return 16 if rem >= 16 else 8


@njit(nogil=True, cache=True)
def depthwise_rows7(m, n, px, ldx, plane, stride2, pw, pc, ldc, pbias, relu):
    """c (m, n) = relu?(x (*) w + bias?) of a 7x7 depthwise plane at stride 1 (``stride2``
    0) or 2 (1) in both directions, n columns (a multiple of 8) in panels of
    :func:`rows7_panel` (this machine's tiles: ROWS7_WIDE): output row i's tap (r, s) in phase plane
    (r % stride, s % stride) at row i + r // stride, column s // stride (px: the address of
    phase plane 0's row 0, float32; ldx, plane: the rows' and planes' strides in elements),
    the 49 weights at pw, c at pc (row stride ldc), the bias per lane at pbias (0: none).
    Every argument int64."""
    j = 0
    while j < n:
        cols = rows7_panel(n - j)
        pxj, pbj = px + 4 * j, pbias + 4 * j if pbias != 0 else 0
        i = 0
        while i < m:
            pxi, pci = pxj + 4 * i * ldx, pc + 4 * (i * ldc + j)
            full = i + ROWS7 <= m
            if not ROWS7_WIDE:
                if stride2 == 0:
                    if full:
                        if cols == 16:
                            _r7n2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                        else:
                            _r7n1(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                    elif cols == 16:
                        _r7n2r(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                    else:
                        _r7n1r(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                elif full:
                    if cols == 16:
                        _r7n2s2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                    else:
                        _r7n1s2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                elif cols == 16:
                    _r7n2rs2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                else:
                    _r7n1rs2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
            elif stride2 == 0:
                if full:
                    if cols == 32:
                        _r7w2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                    elif cols == 16:
                        _r7w1(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                    else:
                        _r7n1(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                elif cols == 32:
                    _r7w2r(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                elif cols == 16:
                    _r7w1r(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                else:
                    _r7n1r(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
            elif full:
                if cols == 32:
                    _r7w2s2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                elif cols == 16:
                    _r7w1s2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
                else:
                    _r7n1s2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
            elif cols == 32:
                _r7w2rs2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
            elif cols == 16:
                _r7w1rs2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
            else:
                _r7n1rs2(pxi, ldx, plane, pw, pci, ldc, pbj, relu)
            i += ROWS7 if full else 1
        j += cols


# --------------------------------------------------------------------------- dW

DW_TAPS = 5        # taps of one dW tile: 5 x 4 vectors of accumulators, 4 of g
DW_PIXELS = 16     # pixels of one block: every tile of every channel panel, then the next


def _dw_tile(nv, width):
    """The dW micro-kernel intrinsic for up to ``DW_TAPS`` taps of ``nv`` vectors of
    ``width`` channels (a panel of nv * width channels)."""

    @intrinsic
    def tile(typingctx, nt, m, x, xs, paoff, g, ldg, acc, pwoff):
        """acc[woff[t]:][:nv*width] += sum over i < m of x[i*xs + aoff[t]:][:nv*width] *
        g[i*ldg:][:nv*width] for t < nt (1 <= nt <= DW_TAPS): the sums in registers, over i in
        order, each added once to acc; x, g, acc addresses of float32, xs, ldg strides in
        elements, paoff, pwoff addresses of int64 tables of nt element offsets (all int64).
        A pixel's x vectors of a tap are read together: whole cache lines, once a tile. The
        tile always sums DW_TAPS taps (one compiled tile whatever nt): taps past nt repeat
        the last one, and their sums are dropped."""
        def codegen(context, builder, signature, args):
            nt, m, x, xs, paoff, g, ldg, acc, pwoff = args
            V = Vec(builder, width)
            paoff = builder.inttoptr(paoff, _I64.as_pointer())
            pwoff = builder.inttoptr(pwoff, _I64.as_pointer())
            x, g, acc = V.floats(x), V.floats(g), V.floats(acc)
            last = builder.sub(nt, ir.Constant(_I64, 1))
            aoff = []
            for t in range(DW_TAPS):
                k = ir.Constant(_I64, t)
                idx = builder.select(builder.icmp_signed("<", k, nt), k, last)
                aoff.append(builder.load(builder.gep(paoff, [idx])))
            sums = [[cgutils.alloca_once_value(builder, V.zero) for _ in range(nv)]
                    for _ in range(DW_TAPS)]
            with cgutils.for_range(builder, m) as pixels:
                i = pixels.index
                gi = builder.mul(i, ldg)
                gv = [V.load(g, gi, v) for v in range(nv)]
                xi = builder.mul(i, xs)
                for t in range(DW_TAPS):
                    xt = builder.add(xi, aoff[t])
                    for v in range(nv):
                        a = sums[t][v]
                        builder.store(builder.call(V._fma, [V.load(x, xt, v), gv[v],
                                                            builder.load(a)]), a)
            for t in range(DW_TAPS):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(_I64, t), nt)):
                    woff = builder.load(builder.gep(pwoff, [ir.Constant(_I64, t)]))
                    for v in range(nv):
                        V.store(builder.fadd(V.load(acc, woff, v), builder.load(sums[t][v])),
                                acc, woff, v)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 9)), codegen

    return tile


# AVX-512: panels of 64, 32, 16 channels (4, 2, 1 vectors of 16), then 8; AVX2: 16, 8
_dw64, _dw32, _dw16 = _dw_tile(4, 16), _dw_tile(2, 16), _dw_tile(1, 16)
_dw16n, _dw8 = _dw_tile(2, 8), _dw_tile(1, 8)


@njit(nogil=True, cache=True)
def depthwise_dw_taps(m, n, ntaps, px, xs, paoff, pg, ldg, pacc, pwoff, wide):
    """For every tap t < ntaps and channel c < n (a multiple of 8):

        acc[woff[t] + c] += sum over i < m of x[i*xs + aoff[t] + c] * g[i*ldg + c]

    (px, pg, pacc: addresses of float32; paoff, pwoff: of int64 tables of ntaps element
    offsets; xs, ldg: strides in elements). The pixels go in blocks of ``DW_PIXELS`` (their x
    and g stay in L1 while every panel and tap tile passes over them), the channels in panels
    of up to 64 (``wide``: vectors of 16) or 16, the taps in balanced tiles of at most
    ``DW_TAPS``; each tile sums a block in registers, in pixel order, then adds it to acc: the
    same sums whatever the thread count. Every argument int64 (one compilation)."""
    ntiles = (ntaps + DW_TAPS - 1) // DW_TAPS
    for i0 in range(0, m, DW_PIXELS):
        mb = min(DW_PIXELS, m - i0)
        xb, gb = px + 4 * i0 * xs, pg + 4 * i0 * ldg
        j = 0
        while j < n:
            rem = n - j
            if wide:
                cols = 64 if rem >= 64 else 32 if rem >= 32 else 16 if rem >= 16 else 8
            else:
                cols = 16 if rem >= 16 else 8
            xj, gj, aj = xb + 4 * j, gb + 4 * j, pacc + 4 * j
            for k in range(ntiles):
                t0, t1 = ntaps * k // ntiles, ntaps * (k + 1) // ntiles
                pa, pw = paoff + 8 * t0, pwoff + 8 * t0
                if cols == 64:
                    _dw64(t1 - t0, mb, xj, xs, pa, gj, ldg, aj, pw)
                elif cols == 32:
                    _dw32(t1 - t0, mb, xj, xs, pa, gj, ldg, aj, pw)
                elif cols == 16:
                    if wide:
                        _dw16(t1 - t0, mb, xj, xs, pa, gj, ldg, aj, pw)
                    else:
                        _dw16n(t1 - t0, mb, xj, xs, pa, gj, ldg, aj, pw)
                else:
                    _dw8(t1 - t0, mb, xj, xs, pa, gj, ldg, aj, pw)
            j += cols


# ------------------------------------------------------------------ the tiles as steps

# The task kernels call the tile drivers through steps (kernels/cpu/steps.py), not by linking
# their code in: a driver's unrolled tiles were compiled again inside every kernel that called
# it (cpu_depthwise_nhwc.forward_tiled 1.41 s of self compile time with depthwise_taps and
# depthwise_slide linked in; cpu_depthwise_nchw.forward_tiled called depthwise_taps twice).
# Every argument int64: one signature each, whatever the dtype. (depthwise_rows7 stays a
# direct call: its NCHW 7x7/2 forward makes two calls a plane, 6144 at (32, 96, 28, 28),
# and took 9% longer through a step: 1.21-1.24 -> 1.32-1.36 ms.)
_ints = lambda k: lambda f: [(types.int64,) * k]                     # noqa: E731
TAPS_TILES = Step(depthwise_taps.py_func, _ints(12), per_dtype=False)
DW_TILES = Step(depthwise_dw_taps.py_func, _ints(11), per_dtype=False)
taps_step, dw_taps_step = TAPS_TILES.call, DW_TILES.call


def ready(*steps):
    """Fill the slots of ``steps`` (compiled or loaded from the disk cache once a process):
    the host calls it before it launches a kernel that calls them."""
    _steps.ready(None, steps)
