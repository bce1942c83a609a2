"""Host-side plans of the CUDA convolution GEMMs (``cuda.py``): per geometry, the int32 rows of
``FIELDS`` that tell the generated kernels their slices, strides and bounds, and the tap tables
(one row per filter tap: offset, row and column displacement, weight offset), so the kernels'
K-loops do adds and bound compares only. Built once per geometry (``lru_cache``), on the host,
and copied to the device once.
"""
from __future__ import annotations

import functools

import numpy as np

from ...cuda import to_device
from ..cuda import config

PAD_TAP = -(1 << 28)     # th/tw of a padding tap: every row/column test fails, it reads zero
INT32_MAX = 2**31 - 1

# geo: one int32 row of these fields per slice (the forward's and dw's single slice, or each
# dx phase). The gather loader reads rows (n, p, q) of the GEMM as source pixels
# (hh, ww) = (p*MUL_H + ADD_H, q*MUL_W + ADD_W); the epilogue writes row (n, p, q), column col
# at OUT_BASE + n*OUT_NS + p*OUT_HS + q*OUT_WS + col*OUT_CS (dw: z*OUT_ZS + woff + col*OUT_CS).
FIELDS = ("ROWS", "COLS", "K_LO", "K_HI", "PM", "QM", "MUL_H", "ADD_H", "MUL_W", "ADD_W",
          "SRC_NS", "SRC_HS", "SRC_WS", "SRC_H", "SRC_W", "USE_MASK", "LDW",
          "OUT_BASE", "OUT_NS", "OUT_HS", "OUT_WS", "OUT_CS", "OUT_ZS", "E0", "E1",
          "G_NS", "G_HS", "G_WS", "G_KS", "M", "SPLIT_LEN", "DQ", "DP", "DN")


def _strides(layout, C, H, W):
    """Element strides (n, c, h, w) of a contiguous activation."""
    if layout == "NHWC":
        return H * W * C, 1, W * C, C
    return C * H * W, H * W, W, 1


def _pad_rows(rows, multiple):
    """rows (list of 4-tuples) padded with reading-nothing taps to a multiple."""
    rows = list(rows)
    rows += [(0, PAD_TAP, PAD_TAP, -1)] * (-len(rows) % multiple)
    return rows


def _tap_order(g):
    """(c, r, s) of every k of forward/dw in GEMM order: (c, r, s) NCHW, (r, s, c) NHWC."""
    if g.layout == "NHWC":
        return [(c, r, s) for r in range(g.R) for s in range(g.S) for c in range(g.C)]
    return [(c, r, s) for c in range(g.C) for r in range(g.R) for s in range(g.S)]


def _forward_table(g, multiple):
    xs_n, xs_c, xs_h, xs_w = _strides(g.layout, g.C, g.H, g.W)
    RS = g.R * g.S
    rows = [(c * xs_c + r * g.dh * xs_h + s * g.dw * xs_w, r * g.dh, s * g.dw,
             c * RS + r * g.S + s) for c, r, s in _tap_order(g)]
    return _pad_rows(rows, multiple)


def _phase_taps(a, stride, pad, dil, taps):
    """[(t, off)]: the taps t that reach input phase a (rows a + stride*i) and the output row
    offset: the tap reads output row i + off (``conv_math.output_coord`` solved per phase)."""
    out = []
    for t in range(taps):
        num = a + pad - t * dil
        if num % stride == 0:
            out.append((t, num // stride))
    return out


def _geo_row(**fields):
    row = np.zeros(len(FIELDS), np.int64)
    for k, v in fields.items():
        row[FIELDS.index(k)] = v
    return row


def _check_int32(op, *values):
    if max(abs(int(v)) for v in values) > INT32_MAX // 2:
        raise ValueError(f"{op}: tensors of 2**30 elements or more are not supported on the "
                         f"device (the kernels index in int32)")


def _device_tables(rows, table):
    geo = np.stack(rows).astype(np.int32)                          # (slices, FIELDS)
    tab = np.asarray(table, np.int64).reshape(-1, 4).astype(np.int32)   # (T, 4)
    return to_device(geo), to_device(tab)


@functools.lru_cache(maxsize=256)
def forward_plan(g, tile, has_bias, relu):
    """(geo, table, grid) of the forward of geometry ``g`` (built once per geometry)."""
    _check_int32("conv_bias_relu", g.N * g.C * g.H * g.W, g.N * g.K * g.P * g.Q,
                 g.K * g.C * g.R * g.S)
    xs = _strides(g.layout, g.C, g.H, g.W)
    ys = _strides(g.layout, g.K, g.P, g.Q)
    CRS = g.C * g.R * g.S
    row = _geo_row(ROWS=g.N * g.P * g.Q, COLS=g.K, K_LO=0, K_HI=CRS, PM=g.P, QM=g.Q,
                   MUL_H=g.sh, ADD_H=-g.ph, MUL_W=g.sw, ADD_W=-g.pw,
                   SRC_NS=xs[0], SRC_HS=xs[2], SRC_WS=xs[3], SRC_H=g.H, SRC_W=g.W,
                   LDW=CRS, OUT_NS=ys[0], OUT_HS=ys[2], OUT_WS=ys[3], OUT_CS=ys[1],
                   E0=int(has_bias), E1=int(relu))
    geo, table = _device_tables([row], _forward_table(g, tile.BK))
    grid = (-(-(g.N * g.P * g.Q) // tile.BM), -(-g.K // tile.BN), 1)
    return geo, table, grid


@functools.lru_cache(maxsize=256)
def dx_plan(g, tile, use_mask, accumulate=False):
    """(geo, table, grid) of dx: one slice per output phase (ha, wb); ``accumulate``: the
    epilogue adds an addend of x's shape (flag E0)."""
    xs = _strides(g.layout, g.C, g.H, g.W)
    gs = _strides(g.layout, g.K, g.P, g.Q)
    rows, table = [], []
    for ha in range(g.sh):
        taps_h = _phase_taps(ha, g.sh, g.ph, g.dh, g.R)
        for wb in range(g.sw):
            taps_w = _phase_taps(wb, g.sw, g.pw, g.dw, g.S)
            Hi, Wj = max(0, -(-(g.H - ha) // g.sh)), max(0, -(-(g.W - wb) // g.sw))
            k_lo = len(table)
            for r, poff in taps_h:
                for s, qoff in taps_w:
                    for k in range(g.K):      # k fastest: contiguous in NHWC gy
                        table.append((k * gs[1] + poff * gs[2] + qoff * gs[3], poff, qoff,
                                      k * g.C * g.R * g.S + r * g.S + s))
            k_hi = len(table)
            table = _pad_rows(table, tile.BK)
            rows.append(_geo_row(ROWS=g.N * Hi * Wj, COLS=g.C, K_LO=k_lo, K_HI=k_hi, PM=Hi,
                                 QM=Wj, MUL_H=1, ADD_H=0, MUL_W=1, ADD_W=0,
                                 SRC_NS=gs[0], SRC_HS=gs[2], SRC_WS=gs[3], SRC_H=g.P,
                                 SRC_W=g.Q, USE_MASK=int(use_mask), LDW=g.R * g.S,
                                 OUT_BASE=ha * xs[2] + wb * xs[3], OUT_NS=xs[0],
                                 OUT_HS=g.sh * xs[2], OUT_WS=g.sw * xs[3], OUT_CS=xs[1],
                                 E0=int(accumulate)))
    if not table:
        table = _pad_rows([], tile.BK)
    geo, tab = _device_tables(rows, table)
    max_rows = max(int(r[FIELDS.index("ROWS")]) for r in rows)
    grid = (max(1, -(-max_rows // tile.BM)), -(-g.C // tile.BN), g.sh * g.sw)
    return geo, tab, grid


def splits(rows, granule):
    """(split_len, n_splits): ``rows`` cut into at most ``config.reduce_blocks`` fixed slices
    of whole granules. ``rows == 0``: one empty split."""
    rows = max(rows, 1)
    n = max(1, min(config.reduce_blocks, -(-rows // granule)))
    split_len = -(-rows // n)
    split_len = -(-split_len // granule) * granule
    return split_len, -(-rows // split_len)


@functools.lru_cache(maxsize=256)
def dw_plan(g, tile, use_mask, n_splits_max):
    """(geo, table, grid, n_splits) of dw: splits of the M output pixels (z)."""
    xs = _strides(g.layout, g.C, g.H, g.W)
    gs = _strides(g.layout, g.K, g.P, g.Q)
    CRS, M = g.C * g.R * g.S, g.N * g.P * g.Q
    tiles = -(-CRS // tile.BM) * -(-g.K // tile.BN)
    # enough splits to fill the GPU with (tile, split) blocks, each a whole number of K-steps
    want = max(1, min(n_splits_max, -(-config.dw_target_blocks // tiles)))
    split_len = max(tile.BK, -(-(-(-M // want)) // tile.BK) * tile.BK)
    n_splits = max(1, -(-M // split_len))
    step = tile.BK                           # the pixel counters advance BK = DN*PQ+DP*Q+DQ
    DN, rest = divmod(step, g.P * g.Q)
    DP, DQ = divmod(rest, g.Q)
    row = _geo_row(ROWS=CRS, COLS=g.K, PM=g.P, QM=g.Q, MUL_H=g.sh, ADD_H=-g.ph,
                   MUL_W=g.sw, ADD_W=-g.pw, SRC_NS=xs[0], SRC_HS=xs[2], SRC_WS=xs[3],
                   SRC_H=g.H, SRC_W=g.W, USE_MASK=int(use_mask), OUT_ZS=g.K * CRS,
                   OUT_CS=CRS, G_NS=gs[0], G_HS=gs[2], G_WS=gs[3], G_KS=gs[1], M=M,
                   SPLIT_LEN=split_len, DQ=DQ, DP=DP, DN=DN)
    geo, table = _device_tables([row], _forward_table(g, max(tile.BK, tile.BM)))
    grid = (-(-CRS // tile.BM), -(-g.K // tile.BN), n_splits)
    return geo, table, grid, n_splits


