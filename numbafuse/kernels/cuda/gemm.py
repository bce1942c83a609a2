r"""The one register-blocked tiled-GEMM skeleton of the numba.cuda kernels.

``build(tile, a, b, problem, epilogue)`` returns a kernel computing, for each slice ``z =
blockIdx.z`` of a problem (a dx phase, a dw split, or the only slice of a forward),

    out[row, col] = epilogue( sum_{k_lo <= k < k_hi} A[k, row] * B[k, col] )

where the operands are never materialised: an *operand loader* (``Operand``) fetches the
elements a thread owns in one K-step straight from the source tensor (implicit GEMM).
Vocabulary after CUTLASS: the **block tile** is ``BM x BN`` outputs, the **K-step** ``BK``,
each thread accumulates a ``TM x TN`` **micro-tile** in registers (``cuda.local.array`` of
constant shape, indexed by constants once NVVM unrolls the loops: SASS shows it stays in
registers, ``numbafuse/testing/cuda_sass.py``).

One K-step of a thread, with two shared buffers (``cur`` read, ``nxt`` written)::

    regs  <- global loads of step s+1 (issued first, in flight during the multiply-adds)
    acc   += As[cur] (BK, BM) x Bs[cur] (BK, BN)     fragments read as VEC-wide groups
    Xs[nxt] <- regs (gated: 0 where the gate is shut);  syncthreads   one barrier a K-step

Shared reads are conflict-free: thread (tx, ty) reads rows ``tx*VEC + v + VEC*TX*g`` (a
quarter-warp covers 128 contiguous bytes, one vector load per group) and the columns'
``ty`` is shared by half a warp (a broadcast). Shared rows are padded by ``PAD`` elements so
that stores of k-fastest loaders (8 threads on 8 consecutive k) do not collide either.

Index math is int32 (numba widens ``int32 op int32`` to int64: every expression here is cast
back, and LLVM narrows the pair); offsets index arrays as uint32 (no negative-index
wraparound code). Nothing in the K-loop divides: loaders precompute per-thread row bases
once per tile and read per-k offsets from a host-built table, or advance (n, p, q) counters
with adds and compares.

Operand interface (``Operand``, the functions inlined into the kernel)::

    prep(src, aux, geo, table, z, r0, k_lo, k_hi, lr, lk, st)          once per tile
    fetch(src, aux, geo, table, z, st, k0, lr, lk, regs, gates)        once per K-step, in order

``regs`` is (NK, NR): element ``(k0 + lk + LK*jk, r0 + lr + LR*jr)`` of the operand, zero
outside it; ``st`` is the loader's (NSTATE,) int32 state. A *gated* operand (dx's and dw's
``g = gy * (y > 0)``) also fills ``gates`` (NK, NR) with each element's gate value (y, or 1
where nothing masks it), and the element goes to shared memory as ``regs if gates > 0 else
0``: the gate is applied when the tile is stored, after the multiply-adds, so the loads of
y and gy are issued together and their latency hides behind the FMAs (a gate tested in the
fetch made each load of gy wait for its y: four dependent round trips per K-step).
``problem(geo, z)`` returns ``(n_rows, n_cols, k_lo, k_hi, e0, e1)`` (``e0``, ``e1``: two
epilogue flags), and the epilogue is ``row_base(geo, table, z, row)``, ``col_offset(geo, z,
col)``, ``store(out, bias, off, col, value, e0, e1)``.
"""
from __future__ import annotations

import dataclasses

from numba import int32, uint32, uint64

from ...cuda import SIMULATOR, numba_cuda as cuda
from .config import Tile

PAD = 4          # elements of padding per shared row (keeps rows 16-byte aligned)
SHARED_ALIGN = 16  # bytes: vector (128-bit) shared loads of the fragments
if SIMULATOR:      # the simulator refuses an alignment (its arrays are NumPy's, aligned)
    SHARED_ALIGN = None


@dataclasses.dataclass(frozen=True)
class Operand:
    """An operand loader: its thread mapping and its two device functions.

    ``k_fastest``: consecutive threads take consecutive k (contiguous along k in memory,
    e.g. NHWC channels); else consecutive rows.
    """
    prep: object
    fetch: object
    nstate: int
    k_fastest: bool
    gated: bool = False


def mapping(rows: int, BK: int, threads: int, k_fastest: bool) -> tuple:
    """(LK, LR, NK, NR): a thread loads k = lk + LK*jk (jk < NK), row = lr + LR*jr (jr < NR)."""
    if k_fastest:
        LK = min(BK, threads)
        LR = threads // LK
    else:
        LR = min(rows, threads)
        LK = threads // LR
    if BK % LK or rows % LR or LK * LR != threads:
        raise ValueError(f"gemm: {threads} threads do not tile a {BK} x {rows} operand tile")
    return LK, LR, BK // LK, rows // LR


def device(fn):
    """A device function inlined into its caller by NVVM (``alwaysinline``): local arrays
    passed to it still become registers. (Numba-IR inlining, ``inline="always"``, does the
    same but copies the IR per call site: minutes of compile time for the unrolled code.)"""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def kernel(**options):
    """``cuda.jit`` with the code-generation options the simulator does not take dropped."""
    if SIMULATOR:
        options = {k: v for k, v in options.items() if k in ("fastmath", "cache")}
    return cuda.jit(**options)


# NVVM does not fully unroll loops of this size (the K-step's BK x TM x TN multiply-adds, the
# epilogue's TM x TN stores), and a micro-tile indexed by a loop variable lives in local
# memory. So these two are generated as straight-line code, every index a literal.

def _compile(name, lines, env):
    """A device function from generated source lines (inlined into its caller)."""
    src = "\n".join(lines) + "\n"
    scope = dict(env, int32=int32, uint32=uint32, uint64=uint64)
    exec(compile(src, f"<gemm.{name}>", "exec"), scope)
    fn = scope[name]
    fn.source = src
    return device(fn)


def _unrolled_mma(tile: Tile):
    """``mma(As, Bs, pa, pb, acc)``: acc += As^T Bs over one K-step, BK x TM x TN FMAs.

    As, Bs: flat shared buffers; ``pa``/``pb``: uint64 offset of the thread's first element
    in the current buffer (``cur*BK*SA + tx*VEC``). Thread (tx, ty) reads rows
    ``tx*VEC + v + g*VEC*TX`` and columns ``ty*VEC + u + h*VEC*TY``: VEC consecutive,
    16-byte aligned elements per group (one vector load), every offset a literal.
    """
    BK, TM, TN, VEC = tile.BK, tile.TM, tile.TN, tile.VEC
    TX, TY = tile.BM // TM, tile.BN // TN
    SA, SB = tile.BM + PAD, tile.BN + PAD
    lines = ["def mma(As, Bs, pa, pb, acc):"]
    for kk in range(BK):
        for i in range(TM):
            g, v = divmod(i, VEC)
            lines.append(f"    a{i} = As[pa + uint64({kk * SA + v + g * VEC * TX})]")
        for j in range(TN):
            h, u = divmod(j, VEC)
            lines.append(f"    b{j} = Bs[pb + uint64({kk * SB + u + h * VEC * TY})]")
        for i in range(TM):
            for j in range(TN):
                lines.append(f"    acc[{i}, {j}] += a{i} * b{j}")
    return _compile("mma", lines, {})


def _unrolled_store(NK, NR, k_stride, r_stride, gated):
    """``store(sh, base, regs, gates)``: sh[base + jk*k_stride + jr*r_stride] = regs[jk, jr]
    (``gated``: that value where gates[jk, jr] > 0, else 0)."""
    lines = ["def store(sh, base, regs, gates):"]
    for jk in range(NK):
        for jr in range(NR):
            slot = f"sh[base + uint64({jk * k_stride + jr * r_stride})]"
            if gated:
                lines.append(f"    {slot} = regs[{jk}, {jr}] if gates[{jk}, {jr}] > 0 else 0.0")
            else:
                lines.append(f"    {slot} = regs[{jk}, {jr}]")
    return _compile("store", lines, {})


def _unrolled_epilogue(tile: Tile, row_base, col_offset, store):
    """``epilogue(...)``: out[row, col] = store(acc) for the thread's TM x TN outputs inside
    (n_rows, n_cols); row bases and column offsets computed once each."""
    TM, TN, VEC = tile.TM, tile.TN, tile.VEC
    TX, TY = tile.BM // TM, tile.BN // TN
    lines = ["def epilogue(out, bias, geo, table, z, r0, c0, tx, ty, n_rows, n_cols, e0, e1,"
             " acc):"]
    for j in range(TN):
        h, u = divmod(j, VEC)
        lines += [f"    col{j} = int32(c0 + ty * {VEC} + {u + h * VEC * TY})",
                  f"    off{j} = col_offset(geo, z, col{j})"]
    for i in range(TM):
        g, v = divmod(i, VEC)
        lines += [f"    row = int32(r0 + tx * {VEC} + {v + g * VEC * TX})",
                  "    if row < n_rows:",
                  "        base = row_base(geo, table, z, row)"]
        for j in range(TN):
            lines += [f"        if col{j} < n_cols:",
                      f"            store(out, bias, uint32(base + off{j}), col{j}, acc[{i}, {j}],"
                      " e0, e1)"]
    return _compile("epilogue", lines, dict(row_base=row_base, col_offset=col_offset,
                                            store=store))


def build(tile: Tile, a: Operand, b: Operand, problem, row_base, col_offset, store,
          name="gemm"):
    """The GEMM kernel ``kernel(src_a, src_b, aux, out, bias, geo, table)`` of one tiling.

    ``name`` must differ between the kernels built: it is the kernel's qualified name, and
    Numba keeps one disk-cache index per qualified name, which processes compiling at once
    (``numbafuse.precompile``) would each rewrite, losing each other's entries.

    src_a, src_b, aux, out, bias: (n,) flat arrays (aux: the ReLU output masking an operand,
    read by the loaders); geo: (slices, fields) int32; table: (T, 4) int32 per-k offsets.
    Launch: grid (ceil(rows / BM), ceil(cols / BN), slices), ``tile.threads`` threads.
    """
    tile.check()
    BM, BN, BK, TM, TN, VEC = tile.BM, tile.BN, tile.BK, tile.TM, tile.TN, tile.VEC
    TX, TY = BM // TM, BN // TN
    THREADS = TX * TY
    SA, SB = BM + PAD, BN + PAD            # shared row lengths
    A_SIZE, B_SIZE = 2 * BK * SA, 2 * BK * SB
    A_LK, A_LR, A_NK, A_NR = mapping(BM, BK, THREADS, a.k_fastest)
    B_LK, B_LR, B_NK, B_NR = mapping(BN, BK, THREADS, b.k_fastest)
    A_KF, B_KF = a.k_fastest, b.k_fastest
    A_NS, B_NS = a.nstate, b.nstate
    a_prep, a_fetch, b_prep, b_fetch = a.prep, a.fetch, b.prep, b.fetch
    mma = _unrolled_mma(tile)
    store_a = _unrolled_store(A_NK, A_NR, A_LK * SA, A_LR, a.gated)
    store_b = _unrolled_store(B_NK, B_NR, B_LK * SB, B_LR, b.gated)
    epilogue = _unrolled_epilogue(tile, row_base, col_offset, store)

    def gemm(src_a, src_b, aux, out, bias, geo, table):
        z = int32(cuda.blockIdx.z)
        n_rows, n_cols, k_lo, k_hi, e0, e1 = problem(geo, z)
        r0 = int32(cuda.blockIdx.x * BM)
        c0 = int32(cuda.blockIdx.y * BN)
        if r0 >= n_rows or c0 >= n_cols:
            return      # the whole block leaves (a dx phase with fewer rows): no barrier met
        t = int32(cuda.threadIdx.x)
        tx = int32(t % TX)                  # TX, TY powers of two: an AND and a shift
        ty = int32(t // TX)
        if A_KF:
            a_lk, a_lr = int32(t % A_LK), int32(t // A_LK)
        else:
            a_lr, a_lk = int32(t % A_LR), int32(t // A_LR)
        if B_KF:
            b_lk, b_lr = int32(t % B_LK), int32(t // B_LK)
        else:
            b_lr, b_lk = int32(t % B_LR), int32(t // B_LR)
        # shared tiles, two buffers each, flat: As[(buf*BK + k)*SA + row], Bs[(buf*BK + k)*SB + col]
        As = cuda.shared.array(A_SIZE, src_a.dtype, alignment=SHARED_ALIGN)
        Bs = cuda.shared.array(B_SIZE, src_a.dtype, alignment=SHARED_ALIGN)
        acc = cuda.local.array((TM, TN), src_a.dtype)       # the micro-tile, in registers
        ra = cuda.local.array((A_NK, A_NR), src_a.dtype)    # A elements of the next K-step
        rb = cuda.local.array((B_NK, B_NR), src_a.dtype)    # B elements of the next K-step
        ga = cuda.local.array((A_NK, A_NR), src_a.dtype)    # their gates (gated operands)
        gb = cuda.local.array((B_NK, B_NR), src_a.dtype)
        sa = cuda.local.array(A_NS, int32)                  # A loader state
        sb = cuda.local.array(B_NS, int32)                  # B loader state
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        a_prep(src_a, aux, geo, table, z, r0, k_lo, k_hi, a_lr, a_lk, sa)
        b_prep(src_b, aux, geo, table, z, c0, k_lo, k_hi, b_lr, b_lk, sb)
        a_st = a_lk * SA + a_lr             # this thread's first store slot in a buffer
        b_st = b_lk * SB + b_lr
        a_ld = tx * VEC                     # this thread's first fragment element
        b_ld = ty * VEC
        n_steps = int32((k_hi - k_lo + BK - 1) // BK)
        if n_steps > 0:
            a_fetch(src_a, aux, geo, table, z, sa, k_lo, a_lr, a_lk, ra, ga)
            b_fetch(src_b, aux, geo, table, z, sb, k_lo, b_lr, b_lk, rb, gb)
            store_a(As, uint64(a_st), ra, ga)
            store_b(Bs, uint64(b_st), rb, gb)
        cuda.syncthreads()  # the first K-step's tiles are in buffer 0
        for s in range(n_steps):
            cur = s & 1
            more = s + 1 < n_steps
            if more:    # next step's global loads, in flight during the multiply-adds
                k_next = int32(k_lo + (s + 1) * BK)
                a_fetch(src_a, aux, geo, table, z, sa, k_next, a_lr, a_lk, ra, ga)
                b_fetch(src_b, aux, geo, table, z, sb, k_next, b_lr, b_lk, rb, gb)
            mma(As, Bs, uint64(cur * (BK * SA) + a_ld), uint64(cur * (BK * SB) + b_ld), acc)
            if more:
                store_a(As, uint64((1 - cur) * (BK * SA) + a_st), ra, ga)
                store_b(Bs, uint64((1 - cur) * (BK * SB) + b_st), rb, gb)
            # the next step's tiles are stored, and every thread is done reading buffer cur
            # (which the step after next overwrites)
            cuda.syncthreads()
        epilogue(out, bias, geo, table, z, r0, c0, tx, ty, n_rows, n_cols, e0, e1, acc)

    bounds = (THREADS, tile.min_blocks) if tile.min_blocks else THREADS
    gemm.__name__ = gemm.__qualname__ = name
    return kernel(fastmath=False, launch_bounds=bounds,
                  cache=True)(gemm)
