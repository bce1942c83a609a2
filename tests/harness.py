"""One test harness for every op, on every backend (after Chainer's ``FunctionTestCase`` with
injected backends, ``chainer/testing/function_link.py``).

How it fits together
--------------------
* **Backends** (:data:`BACKENDS`): :class:`Backend` objects that put host arrays where an op
  runs (NumPy for the CPU kernels, numba device arrays for the CUDA kernels) and bring results
  back, failing when a result left the backend. Any test with a ``backend`` argument is run on
  each of them (``tests/conftest.py``: ``pytest_generate_tests``); the CUDA one carries the
  ``cuda`` marker, so it runs only in the CUDA process (simulator or GPU).
* **Op cases** (``tests/op_cases.py``): one short :class:`OpCase` per op of
  ``numbafuse.ops.OPS``: how to draw its inputs (from ``numbafuse.testing.strategies``) and
  the expected results, from ``numbafuse.reference`` (plain NumPy, never the kernels).
* **Checks** (``check_*`` below), each run by :func:`run_property` over Hypothesis-drawn
  examples: forward vs reference (values, dtype, running statistics, inputs not written),
  the tape's backward vs the reference backward, the tape's directional derivative vs finite
  differences (``nf.gradcheck``, float64), the NumPy-style backward of fused ops (gradients
  in forward-argument order, only those asked for, nothing written), the fused op vs its
  unfused chain, and bit-identical reruns.
* **Boundaries** (:data:`BOUNDARIES`): per backend and op family, the kernel knobs a test
  patches and the shapes that then cross the kernels' block, chunk, tile and grid-stride
  boundaries; ``tests/test_boundaries.py`` runs the checks there.
* **Example counts** come from the active Hypothesis profile (``tests/conftest.py``):
  :func:`budget` divides the profile's ``max_examples`` by a check's cost, so ``thorough``
  deepens every property test, the simulator's and gradcheck's included. No test pins a count.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
import os
from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numbafuse as nf
from numbafuse import backend as nfb
from numbafuse.ops import OPS

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


# =========================================================================== boundary knobs
# ONE table per backend and op family: which kernel constants a test patches (launch-time
# knobs, read when a kernel runs), to what, and which shapes then cross the boundaries the
# kernels partition work by. Compile-time constants (frozen into @njit / cuda.jit code, e.g.
# the 16 x 16 TILE of basic/cuda.py) cannot be patched: the shapes are derived from their
# values instead. (Under the CUDA simulator, which runs a kernel's Python, conftest.py's
# small_launches sets basic/cuda.py's TILE to 4, and the shapes follow by name.)
# Everything is read from the kernel modules *by name* when a test runs, so when a kernel is
# rewritten, adapting the tests is a change to this table alone:
#
#   patch    {"<module>.<NAME>": value}, module relative to numbafuse.kernels, or
#            {"conv.rules.<field>": value}, a field of the CPU conv plan's rules
#            (kernels/conv/cpu_plan.Rules, set with cpu_plan.using). A value is a constant, a
#            tuple of alternatives (one drawn per example), or a function of the drawn
#            example's dims (e.g. bytes of two images' im2col matrix).
#   shapes   () -> keyword arguments of the op case's draw (``dims`` strategies, limits;
#            ``training``: batch norm in training, where the statistics are reduced)
#   crosses  (dims, knob) -> True when the drawn example crosses every boundary listed in
#            ``why``; asserted on each example (with the knobs patched), so a table that no
#            longer reaches its boundaries fails instead of passing quietly.
#   ops      the op cases run there (their forward, tape backward and NumPy-style backward)

RULES = "conv.rules."


def knob(path):
    """The current value of ``numbafuse.kernels.<path>``, e.g. ``knob("cpu.launch.
    PARALLEL_MIN_ELEMENTS")``, or of a CPU conv rule, e.g. ``knob("conv.rules.chunk_bytes")``."""
    if path.startswith(RULES):
        from numbafuse.kernels.conv import cpu_plan
        return getattr(cpu_plan.current_rules(), path[len(RULES):])
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(f"numbafuse.kernels.{module}"), name)


@dataclasses.dataclass(frozen=True)
class Boundary:
    why: str
    ops: tuple
    patch: dict
    shapes: Callable
    crosses: Callable


def _ints(lo, hi):
    return st.integers(lo, hi)


def _one_of(*values):
    return st.sampled_from(values)


def _images_per_chunk(images):
    """chunk_bytes holding ``images`` images' im2col matrix (C*R*S*P*Q elements each)."""
    return lambda d: images * d["C"] * d["R"] * d["S"] * d["P"] * d["Q"] * d["itemsize"]


def _group_images_per_chunk(images):
    """chunk_bytes holding ``images`` images' im2col matrix of one group (C/groups*R*S*P*Q
    elements each: cpu_grouped.py runs cpu.py's kernels on one group's channels)."""
    return lambda d: images * d["C"] // d["groups"] * d["R"] * d["S"] * d["P"] * d["Q"] * \
        d["itemsize"]


def _bn_flat(d, flat_max_hw):
    """Whether a CPU batch norm walks NCHW x as (N, C*H*W) rows (kernels/batchnorm/cpu_rows;
    the boundary's C*H*W is under FLAT_MAX_ROW)."""
    return d["layout"] == "NCHW" and d["H"] * d["W"] <= flat_max_hw


def _bn_tasks(d, chunk, nhwc_row, flat_max_hw):
    """Tasks of a CPU batch-norm pass over rows (R, L): NCHW (N*C, H*W), flat NCHW (N,
    C*H*W), NHWC (M/m, m*C) with m doubled while m*C < nhwc_row and 2m divides M, each task
    ~chunk elements of whole rows, a multiple of 8/gcd(L, 8) rows (whole mask bytes)."""
    R, L = (d["N"] * d["C"], d["H"] * d["W"]) if d["layout"] == "NCHW" else (d["M"], d["C"])
    if _bn_flat(d, flat_max_hw):
        R, L = d["N"], d["C"] * d["H"] * d["W"]
    while d["layout"] == "NHWC" and L < nhwc_row and R % 2 == 0:
        R, L = R // 2, L * 2
    group = 8 // math.gcd(L, 8)
    rows = -(-max(1, chunk // L) // group) * group
    return -(-R // rows)


DW_LANES = 2   # depthwise dW's NHWC lanes in BOUNDARIES["cuda", "grouped_conv"]


def _lane_groups(d):
    """Channel groups of a CUDA depthwise dW (cuda_depthwise.dw_launch's kblocks): K in groups
    of DW_LANES lanes in NHWC, one channel a group in NCHW."""
    return -(-d["K"] // (DW_LANES if d["layout"] == "NHWC" else 1))


def _cuda_grouped_crosses(d, k):
    """BOUNDARIES["cuda", "grouped_conv"]'s boundaries, from the kernels' own launch plans at
    the patched knobs: depthwise (cuda_depthwise.py), forward and dx over more values than
    one grid-stride step, dW's pixels in several parts and its lane groups more than the
    grid's z (the channel loop), db's channel sums over more channels than max_grid_y; per
    group (cuda_grouped.py), C past one tile, the group's GEMMs over several row tiles of M
    and several K-steps, its dw over several splits of M, the copies grid-striding."""
    from numbafuse.kernels.conv import cuda as conv_cuda
    from numbafuse.kernels.conv import cuda_depthwise
    from numbafuse.kernels.conv.math import group_geometry
    g, threads = d["geometry"], k("cuda.config.threads")
    step = threads * k("cuda.config.max_blocks")          # a grid-stride loop's step
    if g.groups < 2:
        return False
    if cuda_depthwise.is_depthwise(g):
        grid, dims, parts = cuda_depthwise.dw_launch(g, threads)
        kblocks = dims[13]              # dw_launch dims: (..., K, CW, kblocks, NPQ, chunk, DC, DM)
        assert kblocks == _lane_groups(d), (dims, d)
        return (min(g.N * g.K * g.P * g.Q, g.N * g.C * g.H * g.W) > step and parts > 1
                and kblocks > grid[2] and g.K > k("cuda.config.max_grid_y"))
    one, tile = group_geometry(g), k("cuda.config.tile_override")
    fwd_grid = conv_cuda.forward_plan(one, tile, False, False)[2]
    n_splits = conv_cuda.dw_plan(one, tile, False, k("cuda.config.dw_max_splits"))[3]
    return (g.C > tile.BN and fwd_grid[0] > 1 and one.C * one.R * one.S > tile.BK
            and n_splits > 1 and g.N * g.C * g.H * g.W > step)


BOUNDARIES = {
    ("cpu", "conv"): Boundary(
        why="each pass runs per chunk as its plan says (kernels/conv/cpu_plan.py): the "
            "rules' chunk_bytes cuts the batch into chunks of 1 or 2 images, or into blocks "
            "of rows of one image: N of 3 or 5 leaves a last, partial chunk and H of 5-9 "
            "several row blocks; min_chunks (whole-image chunks at least) 1 half the time "
            "(else 4: one image a chunk at these N); "
            "min_gemm_channels (and nchw_im2col_channels) 1 half the time, so the few "
            "channels drawn take the Winograd (3x3 stride 1, any width), phase-plane and "
            "pointwise paths as well as im2col; strided forward and dW by im2col (NCHW over "
            "NHWC slabs of a chunk's input rows) or by phase planes (the rules' strided both "
            "ways); Winograd chunks of winograd_tiles 1 or 3 2x2 tiles, NCHW through HWC "
            "slabs; dW and db in dw_groups 2 or 3 fixed groups of chunks, their sums in tasks "
            "of SUM_BLOCK 7 values; "
            "PARALLEL_MIN_ELEMENTS 0: every call runs on the thread pool",
        ops=("conv_bias_relu", "conv2d", "conv_batchnorm_relu"),
        patch={RULES + "chunk_bytes": (_images_per_chunk(1), _images_per_chunk(2), 64),
               RULES + "min_chunks": (1, 4),
               RULES + "min_gemm_channels": (1, 16),
               RULES + "nchw_im2col_channels": (1, 32),
               RULES + "winograd_tiles": (1, 3), RULES + "winograd_min_tiles": 0,
               RULES + "dw_groups": (2, 3), "conv.cpu_chunks.SUM_BLOCK": 7,
               RULES + "strided": ("im2col", "phase"),
               "cpu.launch.PARALLEL_MIN_ELEMENTS": 0},
        shapes=lambda: dict(max_channels=3, max_kernel=3, paddings=("int", "same"),
                            max_stride=2, max_dilation=1,
                            dims=dict(N=_one_of(3, 5), H=_ints(5, 9), W=_ints(4, 9))),
        crosses=lambda d, k: d["N"] % 2 == 1 and d["H"] >= 5),
    ("cpu", "grouped_conv"): Boundary(
        why="grouped convs (kernels/conv/cpu_grouped.py), groups 2, 3 or 4 with 1 channel "
            "per group (depthwise: cpu_depthwise.py, K = C or 2C) or an odd 3 or 5 (cpu.py's "
            "kernels on each group's channel slice, copied in and out): per group, the conv "
            "table's plan knobs (chunk_bytes of 1 or 2 images of one group's im2col: N of 3 "
            "or 5 leaves a partial last chunk), the few channels of a group taking the "
            "Winograd, phase-plane, pointwise and im2col paths; depthwise, CHUNK_ELEMENTS 1 "
            "or one output row (NHWC: P of 3-7 rows a chunk each) with dW and db summed in "
            "DW_GROUPS 2 or 3 groups of chunks (NCHW: of planes, N*C of them); "
            "PARALLEL_MIN_ELEMENTS 0",
        ops=("conv_bias_relu", "conv_batchnorm_relu"),
        patch={RULES + "chunk_bytes": (_group_images_per_chunk(1), _group_images_per_chunk(2),
                                       64),
               RULES + "min_chunks": (1, 4),
               RULES + "min_gemm_channels": (1, 16),
               RULES + "nchw_im2col_channels": (1, 32),
               RULES + "dw_groups": (2, 3),
               "conv.cpu_depthwise.CHUNK_ELEMENTS": (1, lambda d: d["Q"] * d["K"]),
               "conv.cpu_depthwise.DW_GROUPS": (2, 3),
               "cpu.launch.PARALLEL_MIN_ELEMENTS": 0},
        shapes=lambda: dict(groups=_one_of(2, 3, 4), max_kernel=3, paddings=("int", "same"),
                            max_stride=2, max_dilation=1,
                            dims=dict(N=_one_of(3, 5), H=_ints(5, 7), W=_ints(4, 6),
                                      Cg=_one_of(1, 3, 5))),
        crosses=lambda d, k: d["groups"] > 1 and d["N"] % 2 == 1 and d["H"] >= 5),
    ("cpu", "batchnorm"): Boundary(
        why="elementwise passes in tasks of ~CHUNK elements, the backward's reduction in "
            "tasks of ~REDUCE_CHUNK elements, both patched tiny (a task holds whole mask "
            "bytes: rows a multiple of 8/gcd(row length, 8)); NHWC statistics in tasks of "
            "REDUCE_CHUNK // C rows: every example spans several tasks of each, the last "
            "one partial; NHWC_ROW 1 (one NHWC row a row) or 16 (m of 2 to 8 rows walked as one "
            "where M is even); NCHW maps of at most FLAT_MAX_HW (0 or 9) pixels as one row a "
            "sample (flat: each channel's values repeated along the row, its sums folded at "
            "the end of a task; FLAT_CHUNK tiny as REDUCE_CHUNK), so NCHW reaches both "
            "families; PARALLEL_MIN_ELEMENTS 0: every call runs on the thread pool",
        ops=("batchnorm_add_relu", "batchnorm"),
        patch={"batchnorm.cpu.CHUNK": (8, 16), "batchnorm.cpu.REDUCE_CHUNK": (1, 8),
               "batchnorm.cpu.FLAT_CHUNK": (1, 24), "batchnorm.cpu.FLAT_MAX_HW": (0, 9),
               "batchnorm.cpu.NHWC_ROW": (1, 16), "cpu.launch.PARALLEL_MIN_ELEMENTS": 0},
        # N >= 9: a flat NCHW task holds whole mask bytes, up to 8 rows (samples) where
        # C*H*W is odd, so fewer samples can be one task (N 3-4 drew N=3, C=3, 2x3 in one)
        shapes=lambda: dict(training=st.just(True),
                            dims=dict(N=_ints(9, 10), C=_ints(3, 5), H=_ints(2, 4),
                                      W=_ints(2, 4))),
        crosses=lambda d, k: min(
            _bn_tasks(d, k("batchnorm.cpu.CHUNK"), k("batchnorm.cpu.NHWC_ROW"),
                      k("batchnorm.cpu.FLAT_MAX_HW")),
            _bn_tasks(d, k("batchnorm.cpu." + ("FLAT_CHUNK" if _bn_flat(
                d, k("batchnorm.cpu.FLAT_MAX_HW")) else "REDUCE_CHUNK")),
                k("batchnorm.cpu.NHWC_ROW"), k("batchnorm.cpu.FLAT_MAX_HW"))) >= 2),
    ("cpu", "basic"): Boundary(
        why="PARALLEL_MIN_ELEMENTS 0: relu, pooling and the loss run on the thread pool",
        ops=("relu", "max_pool2d", "global_avg_pool2d", "cross_entropy"),
        patch={"cpu.launch.PARALLEL_MIN_ELEMENTS": 0},
        shapes=lambda: dict(),
        crosses=lambda d, k: k("cpu.launch.PARALLEL_MIN_ELEMENTS") == 0),
    ("cuda", "conv"): Boundary(
        why="implicit GEMMs on the tiny test tile (cuda.config.tile_override = TINY_TILE: "
            "BM x BN = 8 x 8 outputs, K-steps of BK = 4): C and K past one tile (dx tiles over "
            "C, forward over K), the output pixels M past one tile, C*R*S over several "
            "K-steps, the last one partial; dw_target_blocks 24: dw splits M; max_blocks 2",
        ops=("conv_bias_relu", "conv_batchnorm_relu"),
        patch={"cuda.config.threads": 8, "cuda.config.max_blocks": 2,
               "cuda.config.reduce_blocks": 2,
               "cuda.config.tile_override": knob("cuda.config.TINY_TILE"),
               "cuda.config.dw_target_blocks": 24},
        shapes=lambda: dict(max_kernel=2, max_stride=1, max_dilation=1,
                            paddings=("int", "same"),
                            dims=dict(N=_one_of(2), C=_ints(9, 10), K=_ints(9, 10),
                                      H=_ints(4, 5), W=_ints(4, 5))),
        crosses=lambda d, k: (min(d["C"], d["K"], d["M"]) > k("cuda.config.TINY_TILE").BN
                              and d["C"] * d["R"] * d["S"] > k("cuda.config.TINY_TILE").BK)),
    ("cuda", "grouped_conv"): Boundary(
        why="grouped convs on CUDA (kernels/conv/cuda_grouped.py), groups 3 or 4, N 2, "
            "'same' padding, stride 1 or 2. With 3 channels per group (C = 9 or 12 > BN): "
            "cuda.py's GEMMs once per group on the tiny test tile (tile_override = "
            "TINY_TILE: BM x BN = 8 x 8 outputs, K-steps of BK = 4), so the groups split what "
            "would be one tile of C and of K (3-8 filters): each group's forward GEMM has one "
            "partial column tile of K/groups = 1 or 2 filters over several row tiles of M = "
            "N*P*Q (12-50), its reduction C/groups*R*S = 6-18 (R 2 or 3) over several "
            "K-steps, dx one partial tile of 3 channels, dw several splits of M "
            "(dw_target_blocks 4); each group's channel slices copied in and out by "
            "grid-striding kernels (threads 4, max_blocks 2). With 1 channel per group "
            "(depthwise, K = C or 2C: cuda_depthwise.py's stencils): the forward and dx "
            "grid-stride over more values than their 8 threads; dW's N*P*Q pixels in "
            "reduce_blocks 2 parts (U 1), NHWC's channels in lane groups of depthwise_lanes "
            "2 (the block's other threads 2 row groups, summed by the tree; the last lane "
            "group partial where K is odd), NCHW's one channel a group; max_grid_y one less "
            "than dW's channel groups (at least 1): the grid's z covers all but one, so the "
            "channel loop runs a second round, and db's channel sums (the batch norm's "
            "reductions too, grouped or not) loop over channels",
        ops=("conv_bias_relu", "conv_batchnorm_relu"),
        patch={"cuda.config.threads": 4, "cuda.config.max_blocks": 2,
               "cuda.config.reduce_blocks": 2, "cuda.reduce.U": 1,
               "cuda.config.tile_override": knob("cuda.config.TINY_TILE"),
               "cuda.config.dw_target_blocks": 4,
               "cuda.config.depthwise_lanes": DW_LANES,
               "cuda.config.max_grid_y": lambda d: max(1, _lane_groups(d) - 1)},
        shapes=lambda: dict(groups=_one_of(3, 4), max_kernel=3, paddings=("same",),
                            max_stride=2, max_dilation=1,
                            dims=dict(N=_one_of(2), H=_one_of(5), W=_ints(4, 5),
                                      R=_one_of(2, 3), S=_ints(1, 2), Cg=_one_of(1, 3))),
        crosses=_cuda_grouped_crosses),
    ("cuda", "batchnorm"): Boundary(
        why="reductions on a (parts, channels) grid: reduce_blocks 2 parts of M = N*H*W, "
            "each walked by threads 8 with U (patched 1; the simulator reads it at run time) "
            "loads in flight, so a walk step covers 8 values of a part of 9-20: the walk "
            "loop runs 2-3 times, threads leaving at different steps; max_grid_y 2 < C: "
            "blocks loop over channels; max_blocks 2: the elementwise kernels grid-stride too",
        ops=("batchnorm_add_relu", "batchnorm"),
        patch={"cuda.config.threads": 8, "cuda.config.reduce_blocks": 2,
               "cuda.config.max_blocks": 2, "cuda.config.max_grid_y": 2,
               "cuda.reduce.U": 1, "batchnorm.cuda.U": (1, 2)},
        shapes=lambda: dict(training=st.just(True),
                            dims=dict(N=_one_of(2), C=_ints(3, 4), H=_ints(3, 4),
                                      W=_ints(3, 5))),
        crosses=lambda d, k: (-(-d["M"] // k("cuda.config.reduce_blocks"))
                              > k("cuda.config.threads") * k("cuda.reduce.U")
                              and d["C"] > k("cuda.config.max_grid_y"))),
    ("cuda", "basic"): Boundary(
        why="linear's tiled matmul in TILE x TILE tiles (compile-time): rows, features and "
            "the reduction past one tile; max_blocks 2, threads 8: elementwise and pooling "
            "kernels grid-stride; the loss's one-block mean strides over N > threads",
        ops=("linear", "cross_entropy", "max_pool2d", "relu"),
        patch={"cuda.config.threads": 8, "cuda.config.max_blocks": 2,
               "cuda.config.reduce_blocks": 2},
        shapes=lambda: dict(dims=dict(
            N=_ints(max(knob("basic.cuda.TILE"), knob("cuda.config.threads")) + 1,
                    max(knob("basic.cuda.TILE"), knob("cuda.config.threads")) + 3),
            F_in=_ints(knob("basic.cuda.TILE") + 1, knob("basic.cuda.TILE") + 2),
            F_out=_ints(knob("basic.cuda.TILE") + 1, knob("basic.cuda.TILE") + 2),
            L=_ints(2, 3), C=_ints(2, 2), H=_ints(4, 5), W=_ints(4, 5))),
        crosses=lambda d, k: d["size"] > k("cuda.config.threads") * k("cuda.config.max_blocks")),
    ("cuda", "elementwise"): Boundary(
        why="sums in reduce_blocks 2 blocks of threads 8: more than 16 elements, so each "
            "block's grid-stride loop runs several times; max_blocks 2 for the rest",
        ops=("sum", "mean", "add", "mul"),
        patch={"cuda.config.threads": 8, "cuda.config.reduce_blocks": 2,
               "cuda.config.max_blocks": 2},
        shapes=lambda: dict(shape=st.tuples(_ints(5, 8), _ints(5, 8))),
        crosses=lambda d, k: d["size"] > k("cuda.config.threads") * k("cuda.config.reduce_blocks")),
}


@contextlib.contextmanager
def patched(boundary, draw, dims):
    """The boundary's knobs set (alternatives drawn, functions of ``dims`` evaluated)."""
    rules = {}
    with pytest.MonkeyPatch.context() as mp:
        for path, value in boundary.patch.items():
            if isinstance(value, tuple):
                value = draw(st.sampled_from(value))
            if callable(value):
                value = value(dims)
            if path.startswith(RULES):
                rules[path[len(RULES):]] = value
                continue
            module, _, name = path.rpartition(".")
            mp.setattr(importlib.import_module(f"numbafuse.kernels.{module}"), name, value)
        from numbafuse.kernels.conv import cpu_plan
        with cpu_plan.using(**rules):
            yield


# =========================================================================== backends

class Backend:
    """Where an op runs. ``put`` gives an op its input, ``get`` checks a result is on this
    backend and returns it as a host array."""
    name = ""
    small = False               # tiny shapes (the simulator runs a Python thread per GPU thread)
    cost = 1                    # relative cost of one example (divides the example budget)
    directions = 2              # gradcheck's random directions

    def put(self, a):
        raise NotImplementedError

    def get(self, a):
        raise NotImplementedError

    def on_backend(self, a):
        raise NotImplementedError

    def __repr__(self):
        return self.name


class CPU(Backend):
    name = nfb.CPU

    def put(self, a):
        return a.copy() if isinstance(a, np.ndarray) else a      # a copy: writes are seen

    def on_backend(self, a):
        return isinstance(a, np.ndarray)

    def get(self, a):
        assert self.on_backend(a), f"expected a NumPy array, got {type(a).__name__}"
        return a


class CUDA(Backend):
    name = nfb.CUDA
    small = SIMULATOR
    cost = 5 if SIMULATOR else 2
    directions = 1

    def put(self, a):
        return nfb.to_device(a) if isinstance(a, np.ndarray) else a

    def on_backend(self, a):
        return nfb.is_device_array(a)

    def get(self, a):
        assert self.on_backend(a), f"the result left the device: {type(a).__name__}"
        return nfb.to_host(a)


BACKENDS = {b.name: b for b in (CPU(), CUDA())}


def backend_params():
    """pytest parameters, one per backend; the CUDA one carries the ``cuda`` marker."""
    return [pytest.param(b, id=b.name, marks=[pytest.mark.cuda] if b.name == nfb.CUDA else [])
            for b in BACKENDS.values()]


# =========================================================================== tolerances

# atol is scaled by max(1, max |expected|): results through a batch norm scale with
# gamma*invstd. float32: the reference computes in float64 from the same float32 inputs.
# Half precision: float32 arithmetic, each result rounded once to half (at most 2**-11
# relative for float16, 2**-8 for bfloat16), against the float64 reference of the same inputs.
BF16_TOL = dict(rtol=8e-3, atol=1e-3)    # bfloat16 (also torch's, without ml_dtypes)
TOL = {np.dtype(np.float32): dict(rtol=1e-4, atol=2e-5),
       np.dtype(np.float64): dict(rtol=1e-10, atol=1e-12),
       **{d: dict(rtol=1e-3, atol=1e-4) if d == np.float16 else BF16_TOL
          for d in nf.validate.HALF_DTYPES}}


def close(actual, expected, dtype, tol=None, what=""):
    """``actual`` (host) equals the float64 reference ``expected`` within ``dtype``'s TOL."""
    tol = (tol or TOL)[np.dtype(dtype)]
    expected = np.asarray(expected)
    scale = max(1.0, float(np.nanmax(np.abs(expected)))) if expected.size else 1.0
    assert np.shape(actual) == expected.shape, f"{what}: shape {np.shape(actual)} vs " \
                                               f"{expected.shape}"
    np.testing.assert_allclose(actual, expected, rtol=tol["rtol"], atol=tol["atol"] * scale,
                               err_msg=what)


# =========================================================================== example budget

MIN_EXAMPLES = 3   # Hypothesis's first example is its simplest (1 x 1 x 1 x 1): never alone


def budget(cost):
    """Examples for a check ``cost`` times as expensive as a plain one: the active profile's
    ``max_examples`` divided by it, so every profile scales every test, and at least
    ``MIN_EXAMPLES``: with one example a check sees only the minimal input, whose numbers are
    too small to tell a wrong kernel (a 1.001 scale) from rounding."""
    return max(MIN_EXAMPLES, settings.default.max_examples // cost)


def run_property(key, cost, body):
    """Run ``body(draw)`` over ``budget(cost)`` Hypothesis examples. ``key`` names the
    property (its own seed under derandomized profiles and its own database entry)."""
    @settings(max_examples=budget(cost))
    @given(st.data())
    def prop(data):
        body(data.draw)

    prop.hypothesis.inner_test._hypothesis_internal_add_digest = key.encode()
    prop()


# =========================================================================== op cases

@dataclasses.dataclass
class Example:
    """One drawn call: ``OPS[name].function(*arrays.values(), **keywords)``.

    ``arrays`` are the forward's array arguments in order (host arrays, None or Python
    scalars); NumPy arrays among the ``keywords`` (running statistics) are put on the backend
    afresh for every call. ``dims`` are shape facts (N, C, H, W, K, M, size, itemsize...) the
    boundary table reads.
    """
    arrays: dict
    keywords: dict
    dims: dict = dataclasses.field(default_factory=dict)

    @property
    def dtype(self):
        return next(np.dtype(a.dtype) for a in self.arrays.values()
                    if isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.floating))


class OpCase:
    """How to test one op; subclasses (``tests/op_cases.py``) say how to draw its inputs and
    what the reference says. The checks below do the rest, on every backend.

    name      the op's key in ``numbafuse.ops.OPS``
    family    its kernel family (``BOUNDARIES``)
    nondiff   array arguments that get no gradient (integer labels)
    state     keyword arrays the op updates in place (running statistics)
    cost      how much dearer one example is than a plain one (divides the example budget)
    tol       a tolerance table in place of ``TOL``
    """
    name = ""
    family = ""
    nondiff = ()
    state = ()
    cost = 1
    tol = None

    @property
    def spec(self):
        return OPS[self.name]

    def __repr__(self):
        return self.name

    # ---------------------------------------------------------------- what a case defines
    def draw(self, draw, backend, dtype=None, **limits) -> Example:
        """An :class:`Example` (``limits``: the boundary table's strategy arguments)."""
        raise NotImplementedError

    def expected(self, ex):
        """(y, {state name: new value}) from the reference. Default: ``spec.reference``
        called with the keywords it takes; a tuple result is (y, *new state)."""
        reference = self.spec.reference
        taken = inspect.signature(reference).parameters
        out = reference(*ex.arrays.values(),
                        **{k: v for k, v in ex.keywords.items() if k in taken})
        if isinstance(out, tuple):
            return out[0], dict(zip(self.state, out[1:]))
        return out, {}

    def expected_grads(self, ex, dy):
        """The reference gradients, one per array argument in order (None: none)."""
        raise NotImplementedError

    def for_gradcheck(self, ex):
        """The example moved away from kinks and ties (default: as it is)."""
        return ex

    def numpy_backward(self, ex, dy, y, y_host, draw):
        """Fused ops: (args, keywords, need) of the NumPy-style backward (``spec.backward``);
        host arrays in them are put on the backend; ``need`` flags the gradients asked for."""
        raise NotImplementedError

    chain = None   # fused ops: (ex) -> fn(*inputs, **keywords) computing the unfused chain

    # ---------------------------------------------------------------- helpers
    def differentiable(self, ex):
        return [n not in self.nondiff and isinstance(a, np.ndarray)
                and np.issubdtype(a.dtype, np.floating) for n, a in ex.arrays.items()]

    def seed_dy(self, ex, shape, dtype, draw):
        seed = draw(st.integers(0, 2**32 - 1))
        return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def call_keywords(ex, backend):
    """The example's keywords with its arrays (running statistics) put on the backend anew."""
    return {k: backend.put(v) for k, v in ex.keywords.items()}


def host_copy(a):
    return a.copy() if isinstance(a, np.ndarray) else a


# =========================================================================== the checks

def check_forward(case, backend, ex, draw):
    """Forward vs reference: value, dtype, shape, on the backend; state updated as the
    reference updates it; the inputs not written."""
    args = [backend.put(a) for a in ex.arrays.values()]
    kw = call_keywords(ex, backend)
    y = case.spec.function(*args, **kw)
    y_host = backend.get(y)
    expected, state = case.expected(ex)
    assert y_host.dtype == ex.dtype, f"{case.name}: y is {y_host.dtype}, inputs {ex.dtype}"
    close(y_host, expected, ex.dtype, case.tol, f"{case.name} y")
    for name in case.state:
        if kw.get(name) is not None:
            close(backend.get(kw[name]), state[name], ex.dtype, case.tol, f"{case.name} {name}")
    for name, a, put in zip(ex.arrays, ex.arrays.values(), args):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(backend.get(put), a, err_msg=f"{name} was written")
    return y


def _tape_inputs(case, ex, backend):
    return [nf.Tensor(backend.put(a), requires_grad=True) if d else backend.put(a)
            for a, d in zip(ex.arrays.values(), case.differentiable(ex))]


def _tape_run(case, ex, backend, dy):
    """y (host) and each input's gradient (host, None where not differentiated)."""
    inputs = _tape_inputs(case, ex, backend)
    y = case.spec.function(*inputs, **call_keywords(ex, backend))
    assert isinstance(y, nf.Tensor) and y.device == backend.name, f"{case.name}: {y!r}"
    assert y._fn.name == case.name, f"{case.name} recorded as {y._fn.name!r} on the tape"
    y.backward(backend.put(dy))
    return backend.get(y.data), [backend.get(t.grad) if isinstance(t, nf.Tensor) else None
                                 for t in inputs]


def check_tape(case, backend, ex, draw):
    """The tape's gradients vs the reference backward, on the backend."""
    expected_y, _ = case.expected(ex)
    dy = case.seed_dy(ex, np.shape(expected_y), ex.dtype, draw)
    _, grads = _tape_run(case, ex, backend, dy)
    for name, g, e, d in zip(ex.arrays, grads, case.expected_grads(ex, dy),
                             case.differentiable(ex)):
        if d:
            assert g.dtype == ex.dtype, f"{case.name}: d{name} is {g.dtype}"
            close(g, e, ex.dtype, case.tol, f"{case.name} d{name}")


def check_gradcheck(case, backend, ex, draw):
    """The tape's directional derivative vs central differences, float64, on the backend."""
    ex = case.for_gradcheck(ex)

    def fn(*inputs):
        return case.spec.function(*inputs, **call_keywords(ex, backend))

    assert nf.gradcheck(fn, _tape_inputs(case, ex, backend), mode="directional",
                        directions=backend.directions)


def check_numpy_backward(case, backend, ex, draw):
    """The NumPy-style backward: gradients in forward-argument order, of the inputs' dtype,
    on the backend, None exactly where not asked for; nothing written."""
    y = case.spec.function(*[backend.put(a) for a in ex.arrays.values()],
                           **call_keywords(ex, backend))
    y_host = backend.get(y)
    dy = case.seed_dy(ex, y_host.shape, ex.dtype, draw)
    args, kw, need = case.numpy_backward(ex, dy, y, y_host, draw)
    before = [host_copy(a) for a in args] + [host_copy(v) for v in kw.values()]
    args = [backend.put(a) for a in args]
    kw = {k: backend.put(v) for k, v in kw.items()}
    grads = case.spec.backward(*args, **kw)
    assert isinstance(grads, tuple) and len(grads) == len(ex.arrays), grads
    for name, g, e, asked in zip(ex.arrays, grads, case.expected_grads(ex, dy), need):
        if not asked:
            assert g is None, f"{case.spec.backward.__name__}: d{name} computed, not asked"
            continue
        g = backend.get(g)
        assert g.dtype == ex.dtype, f"d{name} is {g.dtype}"
        close(g, e, ex.dtype, case.tol, f"{case.spec.backward.__name__} d{name}")
    for a, b in zip(list(args) + list(kw.values()), before):     # nothing written
        if isinstance(b, np.ndarray):
            np.testing.assert_array_equal(backend.get(a), b, err_msg="an input was written")


def check_chain(case, backend, ex, draw):
    """The fused op equals its unfused chain on the tape: value, state and gradients."""
    expected_y, _ = case.expected(ex)
    dy = case.seed_dy(ex, np.shape(expected_y), ex.dtype, draw)
    results = []
    for fn in (case.spec.function, case.chain(ex)):
        inputs = _tape_inputs(case, ex, backend)
        kw = call_keywords(ex, backend)
        y = fn(*inputs, **kw)
        y.backward(backend.put(dy))
        results.append([backend.get(y.data)]
                       + [backend.get(kw[s]) for s in case.state if kw.get(s) is not None]
                       + [backend.get(t.grad) for t in inputs if isinstance(t, nf.Tensor)])
    for fused, chain in zip(*results):
        close(fused, chain, ex.dtype, case.tol, f"{case.name} vs its unfused chain")


def check_deterministic(case, backend, ex, draw):
    """Two runs, forward and tape backward, give bit-identical results (fixed-order
    reductions, no atomics)."""
    expected_y, _ = case.expected(ex)
    dy = case.seed_dy(ex, np.shape(expected_y), ex.dtype, draw)
    runs = [_tape_run(case, ex, backend, dy) for _ in range(2)]
    (y1, g1), (y2, g2) = runs
    assert y1.tobytes() == y2.tobytes(), f"{case.name}: y differs between runs"
    for name, a, b in zip(ex.arrays, g1, g2):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.tobytes() == b.tobytes(), f"{case.name}: d{name} differs between runs"


# Each check with its cost (how many plain examples one of its examples is worth).
CHECKS = {"forward": (check_forward, 1), "tape": (check_tape, 1),
          "gradcheck": (check_gradcheck, 8), "numpy_backward": (check_numpy_backward, 1),
          "chain": (check_chain, 2), "deterministic": (check_deterministic, 5)}


def on_threads(call, counts=(1, 3)):
    """{n: call()} with numbafuse's CPU kernels on n threads; the thread count restored."""
    from numbafuse.kernels.cpu import launch as cpu_launch
    threads = cpu_launch.num_threads()
    out = {}
    try:
        for n in counts:
            cpu_launch.set_num_threads(n)
            out[n] = call()
    finally:
        cpu_launch.set_num_threads(threads)
    return out
