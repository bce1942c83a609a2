"""Launch sizes and GEMM tilings for every numba.cuda kernel, in one place.

Shared-memory shapes must be compile-time constants, so they are the ``*_TILE``/``BLOCK``
constants below and never change. Launch sizes (``threads``, ``max_blocks``...) are read at
launch time, so tests can shrink them (``monkeypatch.setattr(config, "max_blocks", 2)``) to
force tiny inputs across several blocks. A kernel never assumes more threads per block than
``BLOCK``.
"""

import dataclasses
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tile:
    """A GEMM tiling (``kernels/cuda/gemm.py``): block tile BM x BN outputs, K-step BK,
    micro-tile TM x TN per thread ((BM/TM) * (BN/TN) threads), shared fragments read VEC
    elements at a time (16 bytes: 4 float32, 2 float64); ``min_blocks``: blocks per SM that
    the registers must allow (launch_bounds' second value, PTX ``.minnctapersm``: ptxas caps
    a thread at 65536 / (threads * min_blocks) registers, spilling if it must). A register
    cap through ``max_registers`` (``-maxrregcount``) is not used: ptxas ignores it in a
    kernel with ``.maxntid``, which every GEMM has (seen: 167 registers under a cap of 128).
    """
    BM: int
    BN: int
    BK: int
    TM: int
    TN: int
    VEC: int = 4
    min_blocks: int | None = None

    @property
    def threads(self) -> int:
        return (self.BM // self.TM) * (self.BN // self.TN)

    def check(self):
        TX, TY = self.BM // self.TM, self.BN // self.TN
        ok = (self.BM % self.TM == 0 and self.BN % self.TN == 0 and self.TM % self.VEC == 0
              and self.TN % self.VEC == 0 and self.threads <= 1024
              and TX & (TX - 1) == 0 and TY & (TY - 1) == 0)
        if not ok:
            raise ValueError(f"kernels.cuda.config: tile {self} does not divide into "
                             f"{self.VEC}-wide groups over a power-of-two thread grid")
        return self


# Conv GEMM tilings per (pass, dtype); compile-time (each is its own compiled kernel).
# float32: 128 x 128 outputs per 256-thread block, 8 x 8 per thread (64 FFMA per 4 vector
# shared loads per k); dw's output (CRS x K) is narrow in K, so 128 x 64, with K-steps of 16
# (measured on an H100, run 10, `benchmarks/gpu_probe.py tiles`: 128 x 64 x 16 beat 128 x 64
# x 8 by 6-14% at all four benchmark shapes, at 127 registers, two blocks per SM).
# float64: half the registers per value and half the FMA rate: 64 x 64, 4 x 4 per thread.
CONV_TILES = {
    ("fwd", "float32"): Tile(128, 128, 8, 8, 8, 4),
    # (min_blocks=2: the dx epilogue's addend, 3d5c375, took the NHWC one from 127 to 129
    # registers, under two blocks per SM; capped, it has 128 and no spill, ptxas 13.5)
    ("dx", "float32"): Tile(128, 128, 8, 8, 8, 4, min_blocks=2),
    ("dw", "float32"): Tile(128, 64, 16, 8, 4, 4),
    ("fwd", "float64"): Tile(64, 64, 8, 4, 4, 2),
    ("dx", "float64"): Tile(64, 64, 8, 4, 4, 2),
    ("dw", "float64"): Tile(64, 64, 8, 4, 4, 2),
}
# float32 GEMMs of few output columns (forward: K filters; dx: C input channels) take narrow
# tilings: with 64 columns a 128 x 128 tile wastes half its multiply-adds (three of the four
# benchmark shapes have K = 64). CONV_TILE_TIERS[(pass, layout)]: ((most columns, tiling),
# ...) in rising order, the first whose bound holds; past the last, the wide tiling. Measured
# (graph-replayed device time per pass, `benchmarks/gpu_probe.py tiles` / `tiles_nhwc`):
# - NCHW (run 10, H100): the forward's 128 x 64 x 16 was the fastest tiling at all four
#   shapes, K = 128 included (stride 2: 262 us against 335 for 128 x 128 x 8); dx's 128 x 64
#   x 8 was fastest at C = 64 only (at C = 128 and 256 the wide tiling was, by 19% and 11%).
# - NHWC (run 12, H200): the forward's 128 x 64 x 16 at K = 64 with 3 x 3 filters (289 and
#   101 us against 297 and 113 for 128 x 64 x 8; at the 1 x 1 shape 166 against 156), but at
#   K = 128 (stride 2) 375 us against 290 for 128 x 64 x 8 (80 registers, three blocks per
#   SM; the 16-deep one has 127, two): so 16-deep up to 64 filters, 8-deep up to 128. dx as
#   in NCHW (128 x 64 x 8 fastest at C = 64 on (32, 64, 56, 56); the wide one at C = 128, 256).
NARROW_16 = Tile(128, 64, 16, 8, 4, 4)
NARROW_8 = Tile(128, 64, 8, 8, 4, 4)
CONV_TILE_TIERS = {
    ("fwd", "NCHW"): ((128, NARROW_16),),
    ("fwd", "NHWC"): ((64, NARROW_16), (128, NARROW_8)),
    ("dx", "NCHW"): ((64, NARROW_8),),
    ("dx", "NHWC"): ((64, NARROW_8),),
}
# Where a layout's loaders need other wide tilings: dw in NHWC at 128 x 64 x 16 takes 167
# registers alone (one block per SM); with two blocks per SM asked of ptxas (min_blocks=2) it
# takes 128 and spills 12 bytes (3 local loads/stores in a K-step of 512 FMA), and measured
# faster than the 128 x 64 x 8 it replaces at all four benchmark shapes (run 12, H200: 576,
# 230, 342, 554 us against 675, 249, 389, 617; tests/test_sass.py allows that spill by name).
CONV_TILES_NHWC = {
    ("dw", "float32"): Tile(128, 64, 16, 8, 4, 4, min_blocks=2),
}
# Tests shrink every conv tiling to this one (the simulator runs each thread in Python).
TINY_TILE = Tile(8, 8, 4, 2, 2, 2)
tile_override = None     # a Tile used for every conv pass and dtype when set (tests)

dw_target_blocks = 512   # dw: (tile, split) blocks to aim for (fills a GPU a few times)
dw_max_splits = 256      # dw: at most this many splits of M (partials memory: splits*K*CRS)


_DTYPE_NAMES = {}


def conv_tile(kind: str, dtype, cols: int | None = None, layout: str = "NCHW") -> Tile:
    """The tiling of conv pass ``kind`` ("fwd", "dx", "dw") at ``dtype`` for a GEMM of
    ``cols`` output columns (None: the wide tiling) in ``layout``."""
    if tile_override is not None:
        return tile_override.check()
    name = _DTYPE_NAMES.get(dtype)
    if name is None:              # (NumPy's dtype.name is Python code: kept per dtype)
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    key = (kind, name)
    if cols is not None and name == "float32":
        for most, tile in CONV_TILE_TIERS.get((kind, layout), ()):
            if cols <= most:
                return tile.check()
    if layout == "NHWC" and key in CONV_TILES_NHWC:
        return CONV_TILES_NHWC[key].check()
    return CONV_TILES[key].check()


# Compile-time constants (shared-array shapes).
BLOCK = 256          # threads per block of 1-d kernels and of reductions; power of two
TILE = 16            # square tile edge of 2-d tiled kernels (GEMM-like); TILE*TILE <= BLOCK

# Launch-time knobs (tests patch these).
threads = 256        # threads per block for 1-d kernels; power of two, <= BLOCK
max_blocks = 1024    # grid-stride kernels never launch more blocks than this
# cross-entropy's forward in one block (rows and their mean, one launch) up to this many
# logits: 64 per thread of a 256-thread block (6 rows of 10 classes); past it, two launches
xent_one_block_elements = 16384
reduce_blocks = 64   # blocks of per-block partials in a two-stage deterministic reduction
# a per-channel reduction (kernels/cuda/reduce.channel_partials) makes at most this many
# blocks in all: parts = reduce_target_blocks / block rows, so a block of many channels walks
# long stretches (with 256 channels and 64 parts each block's threads read 12 values, and
# the block's own reduction, fence and count outweighed them)
reduce_target_blocks = 1024
max_grid_y = 65535   # hardware limit of gridDim.y; kernels with a y grid stride over the rest
sgd_chunk = 8192     # elements of one parameter per block row of the fused SGD step
# depthwise conv dW in NHWC (kernels/conv/cuda_depthwise.py): a block's lanes take this many
# consecutive channels (a warp: 128 contiguous bytes of float32 a load), its other threads
# rows of pixels; a power of two
depthwise_lanes = 32
# grouped convs with at most this many input channels a group run the direct stencils
# (cuda_depthwise's forward, and since a8ab719 its dx and dW) instead of a GEMM set per group;
# 0: a GEMM set per group always. GPU run 18 (an H200, gpu_probe.py groups, graph replays, ms,
# forward, direct / GEMM per group): 4 channels 0.651 / 1.303 NCHW, 0.632 / 1.533 NHWC; 8
# (stride 2) 0.638 / 0.889, 0.695 / 0.850; 16 0.567 / 0.821 NCHW but 0.990 / 0.749 NHWC. Run 19,
# fwd+bwd: direct 3.29 / 3.56 (4 channels), 4.13 / 4.21 (8), 3.30 NCHW (16) against the GEMMs
# per group's 6.47 / 8.85, 4.36 / 5.28, 3.79; NHWC at 16 not yet timed both ways
direct_group_channels = 16
direct_group_channels_nhwc = 8


# How kernels are launched (kernels/cuda/launch.py): "prepared" (numbafuse lays out the
# arguments, cuda.core launches) or "numba" (numba's kernel[grid, block](...)). The simulator
# always takes numba's path.
LAUNCHES = ("prepared", "numba")
launch = os.environ.get("NUMBAFUSE_CUDA_LAUNCH", "prepared")
if launch not in LAUNCHES:
    raise ValueError(f"NUMBAFUSE_CUDA_LAUNCH must be one of {LAUNCHES}, got {launch!r}")


def block_threads() -> int:
    """``threads``, checked: the block reductions need a power of two no larger than BLOCK."""
    if threads < 1 or threads > BLOCK or threads & (threads - 1):
        raise ValueError(f"kernels.cuda.config: threads must be a power of two <= {BLOCK}, "
                         f"got {threads}")
    return threads


def grid_1d(n: int) -> tuple:
    """(blocks, threads) for a grid-stride loop over ``n`` items (n < 2**32: the kernels'
    per-element index math is unsigned 32-bit)."""
    if n >= 2**32:
        raise ValueError(f"kernels.cuda: {n} elements in one launch; at most 2**32 - 1 are "
                         f"supported on the device")
    t = block_threads()
    return max(1, min(max_blocks, -(-n // t))), t
