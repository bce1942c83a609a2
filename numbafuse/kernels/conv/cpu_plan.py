r"""How the CPU runs a convolution pass: :func:`plan` maps (geometry, pass, dtype) to a
:class:`Plan`, a value that the drivers in ``cpu.py`` follow.

    plan(geom, "forward" | "dx" | "dw", dtype, rules=None) -> Plan(algorithm, chunk_bytes,
                                                                 min_chunks, tiles, dw_groups,
                                                                 taps, slab)

The choice reads :class:`Rules`, a table of measured thresholds (``RULES``, in
``cpu_rules.py``; each field says what it decides and what it was measured on). Results never
depend on the thread count, so neither does the plan: chunks and dW groups are functions of
the shape only, which keeps every result bitwise the same on 1 and 64 threads.

Algorithms (``ALGORITHMS``) and what they compute:

    pointwise    1x1, stride 1, unpadded: GEMMs straight on x, y, dx; the dX of a strided
                 unpadded 1x1 into the pixels it reads, then scattered   (cpu_pointwise.py)
    im2col       per chunk an im2col matrix and one GEMM with k = C*R*S; dX by input phase
                 over im2col chunks of the gated gradient; strided NCHW over NHWC slabs of a
                 chunk's rows (``slab``)                                      (cpu_im2col.py)
    implicit     strided float32 forward (K % 8 == 0) and dW (C % 8 == 0): register tiles
                 over a zero-padded slab of each chunk's input, no im2col; an NCHW stem's
                 (C <= 4) forward and dW (K % 8 == 0) by output rows      (cpu_implicit.py)
    winograd     3x3, stride 1, no dilation: F(2x2, 3x3) forward, dX and dW on HWC slabs of
                 each chunk's rows                                           (cpu_winograd.py)
    winograd_s2  3x3 stride 2 float32 (K % 8 == 0 forward, C % 8 == 0 dX and dW): Winograd
                 over the input's phases, 25 products instead of 36
                                                    (cpu_winograd_s2.py, cpu_winograd_s2dx.py)
    phase        any convolution: shifted GEMMs over phase planes (forward, dW), dX by input
                 phase over one padded copy of the gradient                    (cpu_direct.py)
    tapwise      forward and dX: a GEMM per tap over only the outputs it reaches inside the
                 map (no products with the padding: small maps), in blocks of channels
                                                                            (cpu_tapwise.py)

A table of algorithms measured on this machine (``cpu_table``: ``NUMBAFUSE_CONV_TABLE`` or
``cpu_table.use``) replaces the default rules' choice for the passes it has.

Tests and benchmarks choose other rules with :func:`using` (a context: the ops called inside
it plan with the changed rules) or hand a plan to ``cpu.conv_forward`` / ``conv_backward``;
:func:`supports` says which algorithms can run a pass at all.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import numpy as np

from ..cpu import recorded as _recorded
from . import cpu_implicit as _implicit
from . import cpu_plan_table as _ptable
from .cpu_rules import RULES, Rules
from .math import tap_spans, tapwise_density  # noqa: F401 (the plan's names, as before)
from . import cpu_winograd_s2 as _wino_s2

PASSES = ("forward", "dx", "dw")
ALGORITHMS = ("pointwise", "im2col", "implicit", "winograd", "winograd_s2", "phase", "tapwise")


class Plan(NamedTuple):
    """How one pass runs: ``algorithm`` (one of ``ALGORITHMS``), chunks of about
    ``chunk_bytes`` (im2col, implicit, phase, pointwise) or ``tiles`` 2x2 tiles (winograd,
    winograd_s2), whole-image chunks at least ``min_chunks`` to a batch, dW in ``dw_groups``
    fixed groups; ``taps``: the register tiles' width mode (0: none, the BLAS; 1: 8 floats;
    2: 16), ``slab``: im2col over NHWC slabs of an NCHW input's rows."""
    algorithm: str
    chunk_bytes: int
    min_chunks: int
    tiles: int
    dw_groups: int
    taps: int
    slab: bool
    k_blocks: int = 1


_CURRENT = contextvars.ContextVar("numbafuse_conv_cpu_rules", default=RULES)


def current_rules():
    """The rules the CPU conv passes plan with in this context (``RULES`` unless changed)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(**changes):
    """Plan the conv passes run inside the ``with`` block by the current rules with
    ``changes`` (fields of :class:`Rules`); yields the rules in force. The rules are a context
    variable, like NumPy's ``errstate``: other threads keep theirs (a thread started in the
    block sees the change if it runs in ``contextvars.copy_context()``). Plans are made on
    the calling thread, before any work goes to numbafuse's thread pool."""
    unknown = sorted(set(changes) - set(Rules._fields))
    if unknown:
        raise TypeError(f"conv rules: no rule named {', '.join(unknown)} "
                        f"(the rules: {', '.join(Rules._fields)})")
    token = _CURRENT.set(_CURRENT.get()._replace(**changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def _unpadded_1x1(geom):
    return (geom.R == geom.S == 1 and geom.ph == geom.pw == 0
            and geom.ph_end == geom.pw_end == 0)


def is_pointwise(geom):
    """1x1, stride 1, unpadded: the cols matrix is x itself."""
    return _unpadded_1x1(geom) and geom.sh == geom.sw == geom.dh == geom.dw == 1


def _strided_pointwise(geom):
    """A strided 1x1 conv without padding (ResNet's downsample 1x1/2): its dX is a pointwise
    GEMM into the pixels it reads, zeros elsewhere (``cpu_pointwise.dx``)."""
    return _unpadded_1x1(geom) and (geom.sh > 1 or geom.sw > 1)


def _is_winograd(geom):
    return geom.R == geom.S == 3 and geom.sh == geom.sw == 1 and geom.dh == geom.dw == 1


def supports(algorithm, geom, pass_, dtype):
    """Whether ``algorithm`` computes ``pass_`` of ``geom`` on ``dtype`` inputs at all (the
    rules aside)."""
    if algorithm in ("im2col", "phase"):
        return True
    if algorithm == "pointwise":
        return is_pointwise(geom) or pass_ == "dx" and _strided_pointwise(geom)
    if algorithm == "winograd":
        return _is_winograd(geom)
    if algorithm == "winograd_s2":
        return _wino_s2.fits(geom, dtype, pass_)
    if algorithm == "implicit":
        return pass_ != "dx" and _implicit.fits(geom, dtype, pass_)
    if algorithm == "tapwise":
        return pass_ != "dw"
    raise ValueError(f"conv plan: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def _slab(geom, rules):
    """im2col over NHWC slabs of each chunk's input rows: a strided NCHW convolution with
    ``nchw_im2col_channels`` or more channels each side. The rows are transposed to
    (rows, W, C) in cache and gathered as whole channel vectors: that beat the phase planes'
    R*S GEMMs with k = C, where the NCHW gather of single strided values did not."""
    return (geom.layout == "NCHW" and (geom.sh > 1 or geom.sw > 1) and not is_pointwise(geom)
            and min(geom.C, geom.K) >= rules.nchw_im2col_channels)


def _pointwise_blocked(geom, pass_, dtype, rules):
    """Whether a deep 1x1 pass runs as one GEMM of the whole batch in blocks of channels (the
    k-blocked im2col passes) instead of the pointwise passes' GEMMs per chunk of an image's
    pixels, which read every weight once per image and, for dW, write a partial dW per group
    of images: with few pixels an image (ResNet-50's last stage at 64x64 input: 2x2) those
    GEMMs are thin and the weights outweigh the pixels. Batch 16, 2 threads, ms pointwise /
    blocked (fwd, dx, dw; machine E): NCHW 2048 -> 512 at 2x2 1.39 / 0.84, 3.91 / 0.95, 8.84
    / 0.56; 512 -> 2048 at 2x2 1.43 / 0.85, 4.03 / 0.72, 7.80 / 0.64; 1024 -> 512 at 4x4
    1.07 / 1.04, 2.03 / 1.16, 3.19 / 0.89; 256 -> 1024 at 4x4 0.45 / 0.52, 0.78 / 0.53,
    0.80 / 0.54. NHWC: 2048 -> 512 at 2x2 3.32 / 0.80, 0.85 / 0.78, 0.78 / 0.51; 1024 -> 512
    at 4x4 1.92 / 0.87, 0.90 / 2.90, 0.73 / 0.90; 256 -> 1024 at 4x4 0.88 / 0.46, 0.48 /
    1.16, 0.39 / 0.45. So: NCHW dX and dW and NHWC forwards whenever blocked (``_k_blocks``),
    NHWC dW below ``pointwise_thin_pixels`` pixels an image, NHWC dX never. NCHW forwards
    whenever blocked too since the blocked 1x1 passes gather the channels' planes whole
    (``plan``'s ``slab`` False) instead of HWC slabs: forward, pointwise / blocked over slabs /
    blocked over planes (machine E, two runs each): 1024 -> 256 at 4x4 0.50-0.54 / 0.53 /
    0.39-0.48, 256 -> 1024 0.46-0.48 / 0.44 / 0.39-0.45, 1024 -> 512 0.90-0.94 / - /
    0.71-0.83; at 2x2 (blocked before) 2048 -> 512 0.51-0.59 -> 0.42-0.52, 512 -> 2048
    0.48-0.64 -> 0.44-0.59; dW over slabs / planes 1024 -> 256 at 4x4 0.60-0.63 / 0.49-0.50,
    2048 -> 512 at 2x2 0.58-0.63 / 0.51-0.54, 1024 -> 512 at 4x4 0.95 / 0.83, the same bits."""
    if _k_blocks(geom, pass_, dtype, rules) <= 1:
        return False
    thin = geom.P * geom.Q < rules.pointwise_thin_pixels
    if geom.layout == "NHWC":
        return pass_ == "forward" or (pass_ == "dw" and thin)
    return pass_ == "dw" or thin or geom.P * geom.Q > rules.pointwise_nchw_unblocked_pixels


def _pointwise_chunked(geom, pass_, rules):
    """An NCHW 1x1 forward that widens (K >= 2C, C >= 64) on images of few pixels: im2col's
    chunks of several images (one GEMM a chunk) rather than a GEMM an image of P*Q columns.
    Machine E, batch 16, 2 threads, interleaved in one process, ms pointwise / im2col: at
    8x8 128 -> 512 0.554 / 0.400 (batch 32 1.091 / 0.770), 64 -> 256 0.162 / 0.140, 128 ->
    256 0.291 / 0.233; not at 16x16 (64 -> 256 0.335 / 0.415, 128 -> 512 at batch 4 0.308 /
    0.348), nor narrowing (512 -> 128 at 8x8 0.372 / 0.550) or with few channels (64 -> 128
    0.092 / 0.097)."""
    return (pass_ == "forward" and geom.layout == "NCHW"
            and geom.P * geom.Q <= rules.pointwise_chunked_pixels
            and geom.K >= 2 * geom.C and geom.C >= 64)


def _strided_1x1_forward(geom, dtype, rules):
    """An NCHW strided 1x1 forward off im2col's slabs (``Rules.strided_1x1_deep``), or None."""
    pixels = geom.N * geom.P * geom.Q
    if (geom.C >= rules.strided_1x1_tapwise_min_channels
            and geom.K >= rules.strided_1x1_deep * pixels):
        return "tapwise"
    if (rules.taps and geom.C <= rules.strided_1x1_implicit_max_channels
            and pixels >= rules.strided_1x1_implicit_min_pixels
            and supports("implicit", geom, "forward", dtype)):
        return "implicit"
    return None


def choose(geom, pass_, dtype, rules):
    """The algorithm ``rules`` pick for ``pass_`` of ``geom`` on ``dtype`` inputs."""
    strided = geom.sh > 1 or geom.sw > 1
    # (by output rows stride 1 too: a CIFAR stem, 3x3/1 on 3 channels at 32x32, batch 16,
    # machine F, ms im2col / rows: forward 1.22 / 0.64, dW 1.86 / 1.12; batch 128 10.08 /
    # 5.13, 11.08 / 8.54)
    rows_dw = (pass_ == "dw" and rules.taps and rules.wide_rows_dw
               and _implicit.gathers(geom))         # the dW by output rows, 16-float tiles
    implicit = ((strided or _implicit.gathers(geom, rules.wide) or rows_dw)
                and supports("implicit", geom, pass_, dtype)
                and (rules.taps and (pass_ == "dw" and geom.C % 8 == 0
                                     or pass_ == "forward"
                                     and geom.C <= rules.implicit_max_channels)
                     or rows_dw
                     or geom.C <= rules.narrow_implicit_channels
                     and (pass_ == "forward" and geom.layout == "NHWC"
                          or _implicit.gathers(geom, rules.wide))))
    if is_pointwise(geom):
        if _pointwise_chunked(geom, pass_, rules):
            return ("implicit" if rules.taps
                    and geom.P * geom.Q >= rules.pointwise_chunked_implicit_pixels
                    and supports("implicit", geom, pass_, dtype) else "im2col")
        if _pointwise_blocked(geom, pass_, dtype, rules):
            return "im2col"
        if (pass_ == "dw" and rules.taps and geom.P * geom.Q <= rules.pointwise_dw_implicit_pixels
                and supports("implicit", geom, pass_, dtype)):
            return "implicit"
        return "pointwise"
    if pass_ == "dx" and _strided_pointwise(geom):
        # dX of a strided 1x1: the pointwise GEMMs into the pixels read, then scattered (by
        # phase 2-3x the time: cpu_pointwise's docstring); a deep one k-blocked (ResNet-18's
        # l4 1x1/2 at 2x2, NCHW / NHWC: 0.13 / 0.12 ms against 0.24 / 0.11)
        return "im2col" if _k_blocks(geom, pass_, dtype, rules) > 1 else "pointwise"
    if pass_ == "dw" and _strided_pointwise(geom):
        # dW of a strided 1x1: im2col (its cols are the strided pixels) beat the implicit GEMM
        # at every shape measured, machine E, 2 threads, best of 5 x 5, ms NCHW / NHWC:
        # 64 -> 128 at 16x16, batch 16 0.116 / 0.089 against 0.166 / 0.152; 128 -> 256 at 8x8
        # 0.116 / 0.114 against 0.140 / 0.121; 64 -> 128 at 56x56, batch 8 0.478 / 0.460
        # against 0.541 / 0.544; ResNet-50's 256 -> 512 at 56x56, batch 4 2.52 / 2.21 against
        # 3.79 / 2.77, 512 -> 1024 at 28x28, batch 8 4.98 / 4.26 against 7.85 / 7.14
        # (machine B's bench_conv_plan.py table too: 0.19 against 0.22-0.23)
        return "im2col"
    if (geom.K if pass_ == "dx" else min(geom.C, geom.K)) < rules.min_gemm_channels:
        # (a dW by the implicit GEMM on so few channels: by output rows, C % 8 != 0)
        return "implicit" if implicit and (pass_ == "forward" or geom.C % 8) else "im2col"
    if pass_ == "forward" and _strided_pointwise(geom) and geom.layout == "NCHW":
        strided_1x1 = _strided_1x1_forward(geom, dtype, rules)
        if strided_1x1:
            return strided_1x1
    if _tapwise(geom, pass_, dtype, rules):
        return "tapwise"
    if pass_ == "dx" and (_k_blocks(geom, pass_, dtype, rules, least=1) > 1
                          or _tiny_blocked_dx(geom, pass_, dtype, rules)):
        # a deep layer's dX: one GEMM of the whole batch in blocks of input channels, then
        # col2im. ms, batch 16, 2 threads, best of 15 (NCHW / NHWC): 3x3 512 at 2x2 4.7 / 4.5
        # by Winograd, 1.9 / 1.9 so; 256 at 4x4 2.0 / 1.9 and 1.6 / 1.7; 3x3/2 256->512 at
        # 4x4 3.4 / 3.5 by the stride-2 Winograd, 1.0 / 1.4 so
        return "im2col"
    if _is_winograd(geom):
        # on HWC slabs for NCHW too: Winograd won at every width and channel count measured
        # from 16 up, except the forward and dW of few tiles and the forward of 32-64 channels
        # (implicit_s1_min_channels, implicit_s1_max_channels)
        tiles = geom.N * ((geom.P + 1) // 2) * ((geom.Q + 1) // 2)
        if pass_ != "dx" and tiles < rules.winograd_min_tiles:
            return "im2col"
        if (pass_ == "forward" and rules.taps
                and rules.implicit_s1_min_channels <= min(geom.C, geom.K)
                and max(geom.C, geom.K) <= rules.implicit_s1_max_channels
                and supports("implicit", geom, pass_, dtype)):
            return "implicit"
        return "winograd"
    pixels = geom.N * geom.P * geom.Q
    limit = (rules.winograd_s2_dx_taps_bytes if pass_ == "dx" else
             rules.winograd_s2_wide_taps_bytes if (pass_ == "forward"
                                                   and pixels >= rules.winograd_s2_wide_pixels)
             else rules.winograd_s2_taps_bytes)
    if (rules.winograd_s2 and _wino_s2.fits(geom, dtype, pass_)
            and _wino_s2.POSITIONS * geom.C * geom.K * 4 <= limit
            and (pass_ == "dx" or pixels >= rules.winograd_s2_min_pixels)
            and (pass_ != "dw" or rules.winograd_s2_dw or not implicit)):
        return "winograd_s2"
    if geom.layout == "NCHW" and pass_ != "dx" and min(geom.C, geom.K) < rules.nchw_im2col_channels:
        return "im2col"
    if not strided or pass_ == "dx":
        return "phase"
    if pass_ == "dw" and geom.K >= geom.N * geom.P * geom.Q and _k_blocks(geom, pass_, dtype,
                                                                          rules) > 1:
        # a deep strided layer's dW: the whole batch in blocks of output channels (ResNet-18's
        # l4 3x3/2, batch 16, 2x2 output: 2.1 ms against the implicit GEMM's 3.2). Also where K
        # equals the pixels (l3 3x3/2 128 -> 256, 4x4 output): machine E, four runs of
        # bench_conv_plan.py, 0.44-0.49 ms against the implicit GEMM's 0.54-0.55 (an older
        # machine had measured 1.2 against 1.0 there: implicit, until 2026-11-29)
        return "im2col"
    return "implicit" if implicit else rules.strided


def _taps_mode(algorithm, geom, pass_, dtype, rules):
    """The register tiles a pass runs on: 0 (none: the BLAS), 1 (8-float) or 2 (16-float).
    implicit and winograd_s2 always run on them; the pointwise passes and the phase dX where
    ``rules.taps`` and the product is an NHWC float32 one with a multiple of 8 columns."""
    width = 2 if rules.wide else 1
    if algorithm in ("implicit", "winograd_s2"):
        return width
    cols = geom.K if pass_ == "forward" else geom.C
    if (rules.taps and (algorithm == "pointwise" and pass_ != "dw"
                        or algorithm == "phase" and pass_ == "dx")
            and geom.layout == "NHWC" and np.dtype(dtype) == np.float32 and cols % 8 == 0):
        return width
    return 0


def plan(geom, pass_, dtype, rules=None, algorithm=None, k_blocks=None):
    """The :class:`Plan` of ``pass_`` ("forward", "dx" or "dw") of ``geom`` on ``dtype``
    inputs by ``rules`` (default: :func:`current_rules`); ``algorithm`` given: that one,
    which must :func:`support <supports>` the pass (ValueError otherwise), in ``k_blocks``
    blocks of channels where given (one of :func:`k_block_choices`, else ValueError)."""
    if pass_ not in PASSES:
        raise ValueError(f"conv plan: pass must be one of {PASSES}, got {pass_!r}")
    rules = current_rules() if rules is None else rules
    if algorithm is None:         # a pure function of these: made once (the host path's cost)
        key = (geom, pass_, dtype, id(rules))
        made = _kept(key, rules)
        if made is not None:
            return made
        chosen = None
        if rules is RULES or rules == RULES:    # the defaults: or what this machine measured
            chosen = _measured(geom, pass_, dtype)
            if chosen is not None and not (
                    supports(chosen[0], geom, pass_, dtype)
                    and chosen[1] in (None, *k_block_choices(chosen[0], geom, pass_, dtype))):
                chosen = None
        return _keep(key, rules,
                     _planned(geom, pass_, dtype, rules, *chosen) if chosen else
                     _planned(geom, pass_, dtype, rules, choose(geom, pass_, dtype, rules)))
    if not supports(algorithm, geom, pass_, dtype):
        raise ValueError(f"conv plan: {algorithm} cannot run the {pass_} of this convolution "
                         f"({geom.R}x{geom.S}, stride {geom.sh}x{geom.sw}, C={geom.C}, "
                         f"K={geom.K}, {np.dtype(dtype)})")
    if k_blocks is not None and k_blocks not in k_block_choices(algorithm, geom, pass_, dtype,
                                                                rules):
        raise ValueError(f"conv plan: {algorithm}'s {pass_} of this convolution takes "
                         f"k_blocks in {k_block_choices(algorithm, geom, pass_, dtype, rules)}"
                         f", got {k_blocks!r}")
    return _planned(geom, pass_, dtype, rules, algorithm, k_blocks)


def scaled(geom, dtype):
    """The :class:`Plan` of a forward with the scale (and residual) epilogue
    (``cpu.forward_scaled``, inference): :func:`plan`'s, but where that is the implicit GEMM of
    a widening 1x1 that ``_pointwise_chunked`` admits (no such epilogue), im2col's, which the
    rules pick there without ``pointwise_chunked_implicit_pixels`` (its epilogue applies the
    batch norm and z)."""
    made = plan(geom, "forward", dtype)
    rules = current_rules()
    if made.algorithm != "implicit" or not _pointwise_chunked(geom, "forward", rules):
        return made
    key = (geom, "scaled", dtype, id(rules))
    made = _kept(key, rules)
    return made if made is not None else _keep(
        key, rules, _planned(geom, "forward", dtype, rules, "im2col"))


# plan()'s plans by (geometry, pass, dtype, the rules' id), and scaled()'s ("scaled" for the
# pass): at most MAX_PLANS (then made anew each call). A conv call made three of them
# (forward, dX, dW) at 5-12 us each, every call.
_PLANS = {}
MAX_PLANS = 4096


def _kept(key, rules):
    """The plan kept under ``key`` for these ``rules`` (the same object), or None."""
    hit = _PLANS.get(key)
    return hit[1] if hit is not None and hit[0] is rules else None


def _keep(key, rules, made):
    """``made``, kept under ``key`` with its ``rules`` while there is room."""
    if len(_PLANS) < MAX_PLANS:
        _PLANS[key] = (rules, made)            # (rules kept: their id stays theirs)
    return made


# The measured table (cpu_plan_table.py, made by cpu_table.py): followed under the default rules.
TABLE_ENV, TABLE_VERSION = _ptable.ENV, _ptable.VERSION
table_key = _ptable.key
_RECORDING = []           # sets of (geometry, pass, dtype) asked for (cpu_table.recording)


def read_table(path) -> dict:
    """The table saved at ``path`` (ValueError naming the file if it is not one)."""
    return _ptable.read(path, ALGORITHMS)


def use_table(table):
    """Plan by ``table`` (from :func:`read_table`, or None: no table) from now on."""
    _ptable.use(table)
    _PLANS.clear()                       # plans made by the previous table
    _recorded.clear()                    # and the prepared calls that followed them


def _measured(geom, pass_, dtype):
    """The table's (algorithm, k_blocks or None) for the pass (recorded where
    cpu_table.recording asks), or None."""
    for asked in _RECORDING:
        asked.add((geom, pass_, np.dtype(dtype)))
    return _ptable.entry(geom, pass_, dtype, ALGORITHMS)


def k_block_choices(algorithm, geom, pass_, dtype, rules=RULES):
    """The k_blocks a table may give ``algorithm`` for ``pass_`` (what ``cpu_table.tune``
    times): tapwise's forward and dX 1, 2, 4, 8 or 16 blocks of at least 16 channels (the
    output channels of the forward, the input ones of dX); im2col 1 (its chunks) and, where
    the whole batch's columns fit ``rules.whole_batch_bytes``, the whole batch in 2 to 16
    such blocks; () for the other algorithms (nothing to choose)."""
    channels = geom.C if pass_ == "dx" else geom.K
    most = [b for b in (1, 2, 4, 8, 16) if b == 1 or b <= channels // 16]
    if algorithm == "tapwise" and pass_ != "dw":
        return tuple(most)
    if algorithm == "im2col":
        cols = (geom.N * geom.P * geom.Q * geom.R * geom.S * geom.C
                * np.dtype(dtype).itemsize)
        return tuple(b for b in most if b == 1 or cols <= rules.whole_batch_bytes)
    return ()


def _planned(geom, pass_, dtype, rules, algorithm, k_blocks=None):
    """The :class:`Plan` of ``algorithm`` for ``pass_`` of ``geom`` by ``rules`` (in
    ``k_blocks`` blocks of channels where given: one of :func:`k_block_choices`)."""
    tiles = (rules.winograd_tiles if algorithm == "winograd" else
             rules.winograd_s2_tiles if algorithm == "winograd_s2" else 0)
    if k_blocks is None:
        k_blocks = (_k_blocks(geom, pass_, dtype, rules) if algorithm == "im2col" else
                    _tapwise_blocks(geom, pass_, rules) if algorithm == "tapwise" else 1)
    # a k-blocked NCHW forward or dW gathers HWC slabs, except a 1x1's: its cols are the
    # channels' planes, copied whole (``_pointwise_blocked`` has the measurements)
    slab = algorithm == "im2col" and pass_ != "dx" and (_slab(geom, rules) or k_blocks > 1
                                                       and geom.layout == "NCHW"
                                                       and not is_pointwise(geom))
    chunk_bytes = rules.chunk_bytes
    if algorithm in ("implicit", "pointwise") and pass_ == "dw":   # (Rules.dw_chunk_scale)
        partial = geom.K * geom.C * geom.R * geom.S * np.dtype(dtype).itemsize
        chunk_bytes *= max(1, min(rules.dw_chunk_scale, 2 * partial // chunk_bytes))
    return Plan(algorithm, chunk_bytes, rules.min_chunks, tiles, rules.dw_groups,
                _taps_mode(algorithm, geom, pass_, dtype, rules), slab, k_blocks)


def _k_blocks(geom, pass_, dtype, rules, least=None):
    """Blocks of output channels of a whole-batch im2col forward or dW, of input channels of
    its dX (``Rules.whole_batch_bytes``; at least ``least``, default ``rules.min_k_blocks``,
    where there are 32 channels a block), or 1. (The rules that send a deep dX to im2col
    were measured on blocks of ``k_block``: they ask with ``least`` 1.)"""
    pixels = geom.N * geom.P * geom.Q
    cols = pixels * geom.R * geom.S * geom.C * np.dtype(dtype).itemsize
    deep = geom.K >= pixels
    if not deep or pixels == 0 or cols > rules.whole_batch_bytes:
        return 1
    channels = geom.C if pass_ == "dx" else geom.K
    least = rules.min_k_blocks if least is None else least
    return max(1, min(least, channels // 32), channels // rules.k_block)


def _tapwise_blocks(geom, pass_, rules):
    """Blocks of output channels of the tapwise forward, of input channels of its dX:
    ``rules.tapwise_k_block`` each (half that where the batch has at most 64 output pixels),
    at least two (the threads) where there are 32 channels."""
    block = rules.tapwise_k_block // (2 if geom.N * geom.P * geom.Q <= 64 else 1)
    channels = geom.C if pass_ == "dx" else geom.K
    return max(1, min(channels // 16, max(2, channels // max(block, 16))))


def _tapwise(geom, pass_, dtype, rules):
    """The forward or dX by tap (``Rules.tapwise_max_density``), but not a strided dX that
    the k-blocked im2col runs on images of fewer than ``Rules.tapwise_blocked_dx_min_pixels``
    output pixels (ResNet-18's l4 3x3/2 256 -> 512 at batch 16, 2x2 output, machine E, ms
    im2col / tapwise over four runs: NCHW 0.578-0.584 / 0.561-0.637, NHWC 0.520-0.526 /
    0.498-0.588: the weights' reordering costs what the padding's products did)."""
    if pass_ == "dw" or geom.R * geom.S == 1 or geom.P * geom.Q > 64:
        return False
    strided_dx = pass_ == "dx" and (geom.sh > 1 or geom.sw > 1)
    if (strided_dx and geom.P * geom.Q < rules.tapwise_blocked_dx_min_pixels
            and _k_blocks(geom, pass_, dtype, rules, least=1) > 1):
        return False        # (blocks of k_block: 64 -> 128 at 4x4 -> 2x2, batch 16, machine F,
        # ms two blocks of 32 / tapwise: 0.285 / 0.200)
    if _tiny_blocked_dx(geom, pass_, dtype, rules):
        return False
    strided = geom.sh > 1 or geom.sw > 1
    limit = (rules.tapwise_strided_dx_max_density if strided_dx else
             rules.tapwise_strided_max_density if strided else rules.tapwise_max_density)
    return (min(geom.C, geom.K) >= rules.tapwise_min_channels
            and tapwise_density(geom) <= limit)


def _tiny_blocked_dx(geom, pass_, dtype, rules):
    """A dX of a batch of fewer than ``Rules.tapwise_dx_min_batch_pixels`` output pixels that
    the k-blocked im2col runs (its GEMM's rows are the batch's pixels; tapwise reorders every
    tap's weights for a few products each)."""
    return (pass_ == "dx" and geom.N * geom.P * geom.Q < rules.tapwise_dx_min_batch_pixels
            and _k_blocks(geom, pass_, dtype, rules) > 1)


def algorithm(geom, pass_="forward", dtype=np.float32):
    """The algorithm of ``pass_`` of ``geom`` on ``dtype`` inputs by the current rules."""
    return plan(geom, pass_, dtype).algorithm
