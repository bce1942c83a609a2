"""The measured thresholds the CPU conv plan decides by (``cpu_plan.plan``): :class:`Rules`,
one field a decision, each with what it was measured on (docs/conv_bias_relu.md has the
tables); ``RULES`` the defaults, changed in a context by ``cpu_plan.using``."""
from typing import NamedTuple

from ..cpu import gemm_taps as _gemm_taps


class Rules(NamedTuple):
    """The thresholds :func:`plan` decides by (docs/conv_bias_relu.md has the measurements)."""
    # bytes of a chunk's gathered input + output: a chunk stays in one core's L2 (1 MiB)
    chunk_bytes: int = 768 << 10
    # ... up to this many times that for the implicit GEMM's and the pointwise GEMMs' dW where
    # its partial dW (K C R S values, added into once a chunk and tap) is more than half a
    # chunk: 2 partial / chunk times. Machine A, 2 threads, batch 16, alternating, best of
    # 12-18, ms 768 KiB / 3 MiB chunks (NCHW, a 224x224 input's maps): implicit, 3x3/2 128 ->
    # 256 at 28x28 11.86 / 10.66, 256 -> 256 25.46 / 22.51, 256 -> 512 at 14x14 12.67 / 11.63,
    # 512 -> 512 28.18 / 23.02, 1x1 2048 -> 512 at 7x7 13.14 / 10.14; pointwise, 256 -> 1024
    # at 14x14 10.71 / 9.66, 1024 -> 512 21.27 / 20.09; not the smaller partials: implicit 64
    # -> 128 at 56x56 (0.3 MB: 10.23 / 10.69), 128 -> 128 even (21.21 / 19.89); pointwise 64
    # -> 256 at 56x56 12.80 / 12.87, 128 -> 512 at 8x8 0.842 / 0.975. Batch 4 (4 chunks
    # either way, ``min_chunks``): 256 -> 512 5.43 / 5.28
    dw_chunk_scale: int = 4
    # whole-image im2col chunks of a batch, at least: a batch whose im2col fits one chunk
    # (the stem's C = 1) still splits over the threads (a fixed count, not the thread count)
    min_chunks: int = 4
    # fixed groups of chunks, each with its own dW and db partial, summed in group order
    dw_groups: int = 16
    # 2x2 output tiles per Winograd chunk (the GEMMs' n)
    winograd_tiles: int = 160
    # a 3x3 stride-1 forward and dW with fewer 2x2 output tiles in the whole batch run im2col:
    # the transformed taps (16 C K values, formed every call) and GEMMs of few rows cost more
    # than the products saved. fwd ms, 2 threads, NCHW, batch 16, 3x3 C = K: 2x2 maps, 512
    # channels (16 tiles) Winograd 33.0, im2col 7.9; 4x4, 256 (64 tiles) 8.3 and 4.3; 8x8,
    # 128 (256 tiles) 2.6 and 3.5. dW, 1 thread, batch 16 (CPU ms, NCHW / NHWC): 16 tiles
    # Winograd 26.7 / 18.8, im2col 15.4 / 11.8; 64 tiles 6.3 / 5.8 and 7.0 / 4.1; 256 tiles
    # 3.4 / 3.2 and 5.5 / 3.5. dX stays Winograd (16 tiles: 19.0 against im2col's 70.9)
    winograd_min_tiles: int = 128
    # fewer input or output channels: im2col (one GEMM with k = C*R*S; the GEMM paths' k = C).
    # dX's GEMMs have k = K (the phase planes') or T*K: its rule reads K alone. A stem's dX
    # (7x7/2, 3 -> 64, batch 16, 64x64, 1 thread): phase 8.9 / 9.5 ms, im2col 35.0 / 15.7
    min_gemm_channels: int = 16
    # NCHW forward and dW with fewer channels (not by Winograd): im2col; with more, a strided
    # NCHW forward and dW gathers over NHWC slabs of each chunk's rows (``Plan.slab``)
    nchw_im2col_channels: int = 32
    # what a strided forward and dW run that no implicit or stride-2 Winograd pass takes:
    # "im2col" (one GEMM with k = R*S*C) beat "phase" (R*S GEMMs with k = C)
    strided: str = "im2col"
    # the implicit GEMM runs a strided float32 forward only where the input has fewer
    # channels: at ResNet-18/50's 1x1/2 and 3x3/2 layers (batch 16, 64x64 input, 1 thread)
    # im2col took 0.6-0.9x its time (l4 3x3/2 256 -> 512: 2.8 against 10.1 ms), at the stem
    # (7x7/2, 3 -> 64) 1.5-1.9x (9.4 against 5.0 ms NCHW, 6.3 against 4.2 NHWC)
    implicit_max_channels: int = 15
    # ... and with 8-float tiles too (``taps`` off: AVX2) where the input is NHWC with at most
    # this many channels: machine F (Zen 3, AVX2), the 7x7/2 3 -> 64 stem forward, the two
    # alternating in one process, best / median of 7 x 3-10 calls, two runs, ms im2col /
    # implicit: batch 16, 64x64 3.93 / 2.78 and 5.23 / 4.10; batch 8, 224x224 22.67 / 17.59
    # and 25.89 / 17.43. NCHW only by output rows (``cpu_implicit.gathers``: at most 4
    # channels, rows of a multiple of 8 pixels; the NCHW slab's taps lost to im2col there,
    # 3.21 / 3.55 and 3.16 / 3.24; 16.48 / 19.02 and 17.60 / 19.90): im2col / the rows, best
    # of 30 alternating calls, 5.10 / 3.15 at batch 16, 64x64 and 18.80 / 13.92 at batch 8,
    # 224x224 (2026-12-02; in ResNet-18's training step 6.01 -> 4.43 ms a call, two a step),
    # and so its dW (rows in L2, ``cpu_implicit.DW_ROWS_BYTES``): 4.13 / 3.25 and 3.80 / 3.00,
    # 21.96 / 17.78 and 34.65 / 29.20 ms. The price: on AVX2 nothing else compiles the
    # implicit GEMM, so an empty cache's first NHWC stem forward takes 12.4-12.6 s of CPU
    # against im2col's 7.3-7.6 (two runs each, NUMBA_CACHE_DIR empty,
    # NUMBAFUSE_FIRST_CALL_WAIT=inf, (2, 32, 32, 3)); once per machine, for ~1 ms a call at
    # batch 16, 64x64, ~5-8 at batch 8, 224. NCHW's rows: forward 8.0-9.2
    # s against im2col's 14.0-15.0, backward after it 11.7-12.5 against 11.8-13.4 ((2, 3, 32,
    # 32), two runs each)
    narrow_implicit_channels: int = 15
    # ... and with 16-float tiles (``taps`` and ``wide``) the dW of a conv that runs by output
    # rows on 8-float tiles (``cpu_implicit.gathers``: the NCHW stem) by those rows too, its
    # products on 16-float tiles (``cpu_implicit.dw_by_rows``), not im2col. Machine A (Zen 4,
    # 2 threads), NCHW, the three alternating in one process, best of 10 x 5 calls, two runs, ms
    # im2col / rows on 8-float tiles / rows on 16-float tiles: 7x7/2 3 -> 64, batch 16, 64x64
    # 2.22 / 2.15 / 1.96 and 4.09 / 3.74 / 3.38; batch 32 4.89 / 4.58 / 4.00 and 4.92 / 4.54 /
    # 4.03; batch 8, 224x224 12.71 / 12.74 / 11.62 and 13.78 / 13.95 / 12.84; a CIFAR stem,
    # 3x3/1 3 -> 64, batch 16, 32x32 0.59 / 0.63 / 0.52 and 0.64 / 0.70 / 0.55. The price: with
    # an empty cache the first such dW compiles the rows' kernel, 2.3 s against im2col's 0.8
    # (after the stem's forward and another layer's im2col dW; NUMBA_CACHE_DIR empty,
    # NUMBAFUSE_FIRST_CALL_WAIT=inf, (2, 3, 32, 32)), once per machine
    wide_rows_dw: bool = True
    # a 3x3 stride-1 float32 forward with enough tiles for Winograd and at most this many
    # channels each side runs the implicit GEMM's register tiles instead (machine E, 2
    # threads, best of 5 x 5 calls, ms Winograd / implicit, NCHW then NHWC): C = K = 64 at
    # 16x16, batch 16 0.82 / 0.72 and 0.76 / 0.70; 32x32 3.47 / 3.03 and 3.03 / 2.67; 56x56,
    # batch 8 4.66 / 4.06 and 4.64 / 4.04; 32 channels at 32x32 1.32 / 1.04 and 1.12 / 0.83;
    # but 96 at 16x16 1.19 / 1.93 and 1.08 / 1.52, 128 at 8x8 0.54 / 0.91 and 0.54 / 0.76
    # (bench_conv_plan.py: ResNet-18's l1 3x3 64 forward was the one such pass > 10% off the
    # fastest). A training Conv-BN-ReLU then makes its statistics in a pass of their own, not
    # in Winograd's epilogue, and still gained: forward, C = K = 64, two runs each, ms before /
    # after: NCHW (16, 64, 16, 16) 0.98-0.99 / 0.85-0.90, (8, 64, 56, 56) 5.33-5.54 /
    # 4.75-4.80; NHWC 0.87-0.95 / 0.80-0.89, 5.06-5.36 / 4.62-4.83; forward + backward within
    # the spread (NCHW 3.45-3.87 / 3.44-3.52, 19.61-19.65 / 18.93-19.03; NHWC 3.27-3.31 /
    # 3.12-3.59, 19.21-19.67 / 18.89-19.66). Tests that mean Winograd set this to 0. Not
    # below implicit_s1_min_channels a side: 24 at 8x8, batch 32 (the digits model) 0.160 /
    # 0.161 and 0.131 / 0.137, no gain for the implicit kernels' first-call compile. None where
    # the CPU splits a 512-bit FMA in two (Zen 4, gemm_taps.SPLIT_512): machine A, 2 threads,
    # alternating, best of 8, ms Winograd / implicit (NCHW, NHWC), C -> K at size, batch 16:
    # 64 at 16x16 0.94 / 1.43, 0.89 / 1.40; 32 -> 64 0.56 / 0.76, 0.52 / 0.73; 32 0.37 /
    # 0.41, 0.34 / 0.39; 64 at 32x32 3.79 / 5.89, 3.34 / 5.46; 32 at 32x32 1.38 / 1.75, 1.18
    # / 1.58; batch 8, 64 at 56x56 5.50 / 8.67, 5.14 / 8.33
    implicit_s1_max_channels: int = 0 if _gemm_taps.SPLIT_512 else 64
    implicit_s1_min_channels: int = 32
    # 16-float register tiles (AVX-512) rather than 8-float ones
    wide: bool = _gemm_taps.WIDE
    # the register tiles of cpu.gemm_taps for the strided forward and dW (implicit), the NHWC
    # 1x1 forward and dX and the NHWC dX by phase: with 8-float vectors they measured no
    # faster than the BLAS paths they replace, so only where the tiles are wide
    taps: bool = _gemm_taps.WIDE
    # 3x3 stride-2 float32 passes by Winograd over input phases (either tile width): they beat
    # the implicit GEMM and phase dX (AVX-512) and im2col (AVX2) ...
    winograd_s2: bool = True
    # ... with transformed taps (25 C K floats, read by every chunk) of at most this many
    # bytes (forward, dW): at 256 -> 512 channels fwd+bwd took 1.2-1.3x the other paths'
    # time; l4 3x3/2 forward 10.8 against im2col's 2.8 ms, dW 24.6 against implicit's 9.6 ...
    winograd_s2_taps_bytes: int = 2 << 20
    # ... a forward's up to this many on batches of ``winograd_s2_wide_pixels`` output pixels:
    # machine A, 2 threads, alternating, best of 12-15, ms im2col (before) / implicit / stride-2
    # Winograd, 28x28 -> 14x14, batch 16 (3136 pixels): 128 -> 256 (3.3 MB of taps) NCHW 11.28
    # / 9.71 / 7.86, NHWC 10.59 / 8.93 / 8.08; 256 -> 256 (6.5 MB) 23.15 / 20.28 / 16.38; batch
    # 4 even (3.09 / 2.91 / 2.92). Not dW: the implicit GEMM's 11.19 against 13.07 at batch 16
    winograd_s2_wide_taps_bytes: int = 8 << 20
    winograd_s2_wide_pixels: int = 2048
    # ... and for dX (phase, the alternative, has more to gain from): 1 thread, batch 16, ms
    # NCHW / NHWC: 128 -> 256 (3.3 MB of taps) 2.3 / 2.2 against phase's 3.3 / 1.6; 256 ->
    # 512 (13 MB) 7.4 / 7.4 against 10.8 / 11.1
    winograd_s2_dx_taps_bytes: int = 16 << 20
    # 2x2 output tiles (dX: 4x4 blocks of dx) per stride-2 Winograd chunk: the GEMMs' m
    winograd_s2_tiles: int = 64
    # ... and its forward and dW on batches of at least this many output pixels: on fewer its
    # taps' transform costs more than it saves. Machine F (Zen 3, AVX2, 2 threads, NCHW), 3x3/2
    # 64 -> 128 on 8x8 (ResNet-18's l2 at a 32x32 input), ms stride-2 Winograd / the best other:
    # forward batch 2 0.22 / 0.11 (tapwise), batch 16 > 0.47 / 0.36 (im2col), batch 32 (512
    # pixels) 0.61 / 0.59; dW batch 2 0.38 / 0.24, batch 16 0.74 / 0.43 (implicit), batch 32
    # 0.74 / 0.68; at 1024 (ResNet-50's l2 3x3/2 128 at batch 16, 64x64) a tie forward, dW
    # 2.66-2.87 against im2col's 2.50-2.59 (left to it)
    winograd_s2_min_pixels: int = 1024
    # ... and a dW by it where the implicit GEMM's dW can run instead (the register tiles,
    # ``taps``, C % 8 == 0) only with this: the implicit dW won wherever it was measured
    # with the tiles, machine A (above: 11.19 against 13.07 ms) and machine B (an Intel Xeon,
    # 2026-12-02, batch 16 unless said, NCHW, one process, best of 3 x 8, ms implicit /
    # stride-2 Winograd: 64 -> 128 at 16x16 0.791 / 1.126, 128 -> 128 1.492 / 1.900, batch 32
    # 1.453 / 1.695 and 2.339 / 3.099; 32x32 64 -> 128 2.361 / 3.099, 128 -> 128 4.893 /
    # 6.157: ResNet-18's and -50's l2 3x3/2 at 64x64). Without the tiles (AVX2) as before.
    winograd_s2_dw: bool = not _gemm_taps.WIDE
    # an im2col forward with at least as many output channels as output pixels in the batch (deep
    # layers: the weights outweigh the activations) whose batch's cols take at most this
    # many bytes runs as one chunk of the whole batch (since the cols are gathered once and
    # each block reorders its own weights, also with as many channels as pixels: ResNet-18's
    # l3 3x3 256 at batch 16, 4x4, 2 threads, machine A: 1.84-1.86 ms against 2.19-2.20 in
    # chunks; l3 3x3/2 128 -> 256 0.92-1.03 against 1.01-1.03), its GEMM split over blocks of
    # ``k_block`` output channels, one task each: chunks of pixels each read every weight
    # and run GEMMs of few rows. NHWC, or NCHW gathered over HWC slabs (the NCHW gather of
    # single values cost 5.0 ms of an 8.4 ms forward at 2x2 maps, 512 channels, batch 16).
    # dW likewise with at least as many output channels as pixels: no partial dW per group
    # of chunks to write and sum (each a K x 9C matrix, for a GEMM whose inner size is a
    # group's few pixels). im2col dW, batch 16, 2 threads, best of 15 calls in three runs,
    # ms (groups / blocks): 3x3 512 at 2x2 NCHW 7.6-8.0 / 4.6-6.3, NHWC 8.3-8.6 / 4.7-5.2;
    # 256 at 4x4 NCHW 2.9-4.3 / 2.2-3.4, NHWC 2.7-4.0 / 3.0-3.2; 3x3/2 256->512 at 4x4
    # 3.7-4.2 / 2.5-2.9. At most K / k_block tasks: on many cores fewer than the groups' 16
    whole_batch_bytes: int = 4 << 20
    k_block: int = 128
    # ... and in at least this many blocks (of 32 channels at least): 64-255 channels made one
    # block, one task, one thread, at small batches. Machine F (AVX2, 2 threads, NCHW, ms one
    # block / two): 3x3 128 at 4x4 dW batch 1 0.25 / 0.19, 2 0.38 / 0.20, 4 0.62 / 0.35, 8
    # 0.98 / 0.60, dX batch 1 0.24 / 0.12; 3x3/2 64 -> 128 on 8x8 dW batch 1 0.20 / 0.09
    # (im2col; 2 0.27 / 0.11), dX 0.19 / 0.07; 3x3 64 at 8x8 dW batch 1 0.14 / 0.11; forwards
    # 3x3 128 at 4x4 batch 1 0.122 / 0.130, 2 0.153 / 0.156, 4 0.26 / 0.24, 8 0.44 / 0.38
    min_k_blocks: int = 2
    # ... a deep 1x1 likewise, by pass and layout, below this many pixels (_pointwise_blocked)
    pointwise_thin_pixels: int = 16
    # ... and a widening NCHW 1x1 forward on images of at most this many pixels runs im2col's
    # chunks (``_pointwise_chunked``: ResNet-50's 128 -> 512 at 8x8, 1.39x on machine E, a Zen
    # 5). On AMD's full-width AVX-512 only: with 8-float tiles (AVX2), where the CPU splits
    # 512-bit FMAs (SPLIT_512, Zen 4) and on Intel's AVX-512 the GEMM per image won (ms
    # pointwise / im2col, batch 16, ``bench_conv_plan.py --model resnet50``: machine F 1.51 /
    # 1.61, 1.20 / 1.47, 1.38 / 1.79; machine A 0.88 / 1.13; machine B, an Intel Xeon, with
    # the packed panels of 2026-12-02 and without (blas.PACK_B), one process, best of 5 x 15:
    # 128 -> 512 at 8x8 0.664 / 0.981 (1.133 unpacked), batch 32 1.363 / 2.063, 64 -> 256
    # 0.181 / 0.401, 128 -> 256 0.341 / 0.530, 256 -> 1024 at 4x4 0.689 / 0.714; ResNet-50's
    # eval forward runs four 128 -> 512 at 8x8)
    pointwise_chunked_pixels: int = (64 if _gemm_taps.WIDE and not _gemm_taps.SPLIT_512
                                     and _gemm_taps.AMD else 0)
    # ... and, with ``taps``, such a forward on images of at least this many pixels runs the
    # implicit GEMM in training (not ``forward_scaled``'s, inference: im2col applies the batch
    # norm and z in its epilogue, ``cpu_plan.scaled``). 2026-12-04, machine E,
    # ``bench_conv_plan.py --model resnet50``, batch 16, ms pointwise / im2col / implicit:
    # 128 -> 512 at 8x8 0.55 / 0.58 / 0.39 and 0.59 / 0.61 / 0.45 (PyTorch 0.36, 0.39); not
    # 256 -> 1024 at 4x4 0.60 / 0.46 / 0.80, 512 -> 2048 at 2x2 1.72 / 0.50 / 3.67. At every
    # chunked size (16 pixels and up) ResNet-50's step had run slower (``ab_rules.py``: median
    # slower in eight runs of nine; ``profile_resnet.py --host``: the Conv-BN-Add-ReLU
    # forwards' host path 153 -> 845 us a call, the implicit GEMM's (R*S, C, K) transposes of
    # the deep weights, made every call in training); from 64 pixels (8x8),
    # ``ab_rules.py --model resnet50 --variant 'off: pointwise_chunked_implicit_pixels=1000000'
    # --rounds 8 --block 6 --sites 'R=1,H=8'``, two runs, best / median ms, on against off:
    # 154.6 / 164.0 against 156.4 / 167.5 and 170.1 / 181.0 against 171.7 / 182.2, the fused
    # 1x1 calls at 8x8 1.3-1.6 ms a step faster
    pointwise_chunked_implicit_pixels: int = 64
    # Where SPLIT_512 or with 8-float tiles (AVX2), the deep NCHW 1x1 forwards and dX of
    # images of pointwise_thin_pixels to this many pixels (4x4) run the pointwise GEMMs, not
    # blocked (``_pointwise_blocked``): the blocked ones won on machine E (Zen 5) only (ms
    # pointwise / blocked, ``bench_conv_plan.py --model resnet50``, machine F: 256 -> 1024
    # forward 1.24 / 1.49, dX 1.24 / 1.68; 1024 -> 256 1.19 / 2.05, 1.49 / 1.54; 1024 -> 512
    # 2.39 / 3.48, 2.94 / 3.42; machine A: docs/conv_bias_relu.md, "The 1x1 rules on Zen 4") ...
    pointwise_nchw_unblocked_pixels: int = 0 if _gemm_taps.WIDE and not _gemm_taps.SPLIT_512 else 16
    # ... and with ``taps`` a stride-1 1x1's dW not blocked, of at most this many pixels an
    # image, runs the implicit GEMM (docs/conv_bias_relu.md, "The 1x1 rules on Zen 4"; not on
    # 8-float tiles, though faster there too at 8x8, machine F, ms pointwise / implicit: 128 ->
    # 512 1.76 / 1.48, 512 -> 128 1.61 / 1.55, 512 -> 256 3.71 / 3.25: ~1.8 ms of a ResNet-50
    # step, where the implicit dW, compiled for nothing else there, cost a 512 -> 128
    # backward's first call 9.4-9.9 s of CPU against 3.9-4.1 with an empty NUMBA_CACHE_DIR).
    # 64 pixels until 2026-12-02; the implicit dW won at 16x16 on machine A too (64 -> 256 0.87
    # against 1.03, 256 -> 64 0.94 / 1.21) and on machine B (an Intel Xeon) tied or won at
    # every size measured (ms implicit / pointwise, batch 16 NCHW, one process, best of 4 x
    # 10: 16x16 64 -> 64 0.231 / 0.242, 64 -> 256 0.674 / 0.830, 256 -> 64 0.820 / 0.804;
    # 32x32 64 -> 256 2.61 / 3.04, 256 -> 64 3.17 / 3.24, 256 -> 128 5.09 / 5.22; 56x56,
    # batch 8, 64 -> 256 4.18 / 4.87): ResNet-50's l1 dWs at 64x64, and at 224x224 its
    # l1-l2 ones (56x56, 28x28)
    pointwise_dw_implicit_pixels: int = 4096
    # a backward touching fewer elements (x, gy twice) whose dX and dW are both Winograd
    # passes runs their tasks in one job that the threads share, instead of one pass after the
    # other, each split over the threads: at the digits shapes (8x8, 24 channels) a split
    # pass gains less than waking a helper costs ...
    shared_max_elements: int = 1 << 20
    shared_backward: bool = True
    # ... and other passes touching fewer elements run at once, each whole on one thread. The
    # longer pass decides: ResNet-18's backwards at batch 16, 64x64 (2 threads, in a training
    # step on PyTorch's team, machine E, ms at once / in turn): 1x1/2 64 -> 128 0.96 / 0.69
    # (524 Ki elements), 128 -> 256 1.09 / 0.71 (262 Ki), 3x3 256 at 4x4 2.27 / 2.11 (196
    # Ki), 3x3/2 128 -> 256 1.74 / 1.67 (262 Ki), 3x3 512 at 2x2 2.77 / 2.69 (98 Ki), 3x3/2
    # 64 -> 128 1.15 / 1.24 (the one that gained: 524 Ki); 1 Mi elements until then
    concurrent_max_elements: int = 1 << 17
    # a forward whose products with the zero padding are more than this share of im2col's
    # (1 - ``tapwise_max_density``: a small map's) and with this many channels each side
    # runs tapwise, a GEMM per tap over only the outputs it reaches. Machine E, 2 threads,
    # NCHW, batch 16 unless said, 3x3 C -> K, best of 30, ms, the plan's before / tapwise:
    # 2x2 maps (density 0.44) 64 0.122 / 0.049, 128 0.254 / 0.088, 256 0.318 / 0.222, 512
    # 1.11 / 0.72 (NHWC 1.09 / 0.69), batch 8 0.692 / 0.434, batch 32 1.87 / 1.15; 4x4
    # (0.69) 64 0.173 / 0.118, 128 0.411 / 0.260, 256 0.879 / 0.735 (NHWC 0.800 / 0.705),
    # batch 32 Winograd 1.64 / 1.38, 512 3.97 / 2.56; stride 2 4x4 -> 2x2 (0.69) 256 -> 512
    # 0.577 / 0.532, 64 -> 128 (stride-2 Winograd) 0.153 / 0.076. Not at 8x8 stride 2 (0.84:
    # 128 -> 256 im2col 0.466 / 0.489) nor 7x7 (0.82, 512: Winograd 7.76 / 10.1). dX the
    # same (NCHW / NHWC): 2x2, 512, batch 16 (k-blocked im2col) 1.08-1.21 / 0.78-1.11 and
    # 1.01-1.19 / 0.82-1.16; 4x4, 256 1.11-1.16 / 0.69-0.74 and 1.13-1.17 / 0.67-0.99; 2x2,
    # 64 (Winograd) 0.078 / 0.050; 4x4, 128 0.371 / 0.336 and 0.314 / 0.306; 4x4, 256, batch
    # 32 2.32 / 1.52 and 2.04 / 1.28; 4x4 -> 2x2, 64 -> 128 (stride-2 Winograd) 0.205 / 0.119
    # and 0.185 / 0.107. Not at 8x8 (0.77, 128: Winograd 0.55 / 1.47)
    tapwise_max_density: float = 0.75
    # ... and a strided dX up to this share: the stride-2 Winograd dX it replaces at 8x8 -> 4x4
    # (0.84) was slower at every shape measured: 128 -> 256, batch 16, NCHW 0.84-1.01 / 0.53-0.57
    # ms, NHWC 0.75 / 0.49; 128 -> 128 0.485 / 0.432 and 0.420 / 0.381
    # (0.91 since 2026-12-01: a 224x224 input's 14x14 -> 7x7, 0.907, below)
    tapwise_strided_dx_max_density: float = 0.91
    # ... and a strided forward up to this share (since its products run on gemm_taps' tiles:
    # 8x8 -> 4x4 is 0.84). Machine A (Zen 4), 2 threads, batch 16, in one process alternating,
    # best of 10, ms im2col / tapwise (NCHW, NHWC): ResNet-18's l3 3x3/2 128 -> 256 1.00 /
    # 0.81, 0.89 / 0.78; ResNet-50's l3 3x3/2 256 1.82 / 1.45, 1.72 / 1.41; batch 32 1.76 /
    # 1.49, 1.76 / 1.48 (0.75 before the tiles). 0.91 (0.85 until 2026-12-01) for 14x14 ->
    # 7x7 (0.907): machine A, 2 threads, batch 16, alternating, best of 12-15, ms the plan before
    # / tapwise, forward, dX: ResNet-18's l4 3x3/2 256 -> 512 NCHW 12.18 / 9.77, 12.57 / 9.94,
    # NHWC 12.05 / 9.62, 13.87 / 10.31; ResNet-50's l4 3x3/2 512 NCHW 30.48 / 18.47, 33.57 /
    # 20.30. Not 16x16 -> 8x8 (0.918) nor 28x28 -> 14x14 (0.953: 128 -> 256 forward 11.84
    # against im2col's 11.28, stride-2 Winograd's 7.86; dX 15.15 against its 7.97)
    tapwise_strided_max_density: float = 0.91
    # ... and a strided dX that the k-blocked im2col runs (``_tapwise``) with at least this
    # many output pixels an image: ResNet-50's l3 3x3/2 256 at 8x8 -> 4x4, batch 16, machine F
    # (Zen 3, AVX2, 2 threads, ``bench_conv_plan.py --model resnet50``, ms im2col / tapwise):
    # NCHW 5.28 / 3.69, 4.07 / 3.53, 4.13 / 3.28; NHWC 4.14 / 2.94, 3.31 / 2.96. At 2x2 the
    # two were even (ResNet-18's l4 3x3/2 256 -> 512: machine E in ``_tapwise``; F NCHW 2.81 /
    # 2.22, 2.52 / 2.30, 1.93 / 2.43): im2col stays there
    tapwise_blocked_dx_min_pixels: int = 4
    # (16 until the tiles ran tapwise's products: at 2x2 it wins since, machine A, 2 threads,
    # batch 16, alternating, best of 10, ms im2col / tapwise (NCHW, NHWC): ResNet-18's l4
    # 3x3/2 256 -> 512 1.04 / 0.79, 1.11 / 0.78; ResNet-50's l4 3x3/2 512 2.14 / 1.74, 2.34 /
    # 1.67)
    # ... and no dX of a batch of fewer output pixels than this that the k-blocked im2col runs
    # (``_tiny_blocked_dx``). Machine F, NCHW, ms blocked im2col / tapwise: 3x3 256 at 2x2,
    # batch 1 (4 pixels) 0.23 / 0.37, 2 0.25 / 0.38, 8 (32) 0.74 / 0.54; 3x3/2 128 -> 256 at 4x4
    # -> 2x2, batch 1 0.13 / 0.21, 2 0.14 / 0.21, 8 0.41 / 0.37; 3x3 128 at 4x4, batch 1 (16)
    # 0.12 / 0.14, 2 0.21 / 0.18
    tapwise_dx_min_batch_pixels: int = 16
    tapwise_min_channels: int = 64
    # output channels per task of the tapwise forward, half of it where the batch has at
    # most 64 output pixels (512 channels at 2x2, batch 8 / 16 / 32: 0.434 / 0.722 / 1.237 ms
    # in blocks of 64, 0.515 / 0.797 / 1.153 in blocks of 128; 256 at 4x4 0.772 and 0.735)
    tapwise_k_block: int = 128
    # an NCHW strided 1x1 forward (ResNet's downsample) runs tapwise (blocks of output channels,
    # each reordering its weights) with at least this many output channels per output pixel of the
    # batch and ``strided_1x1_tapwise_min_channels`` input channels; else with ``taps`` the implicit
    # GEMM with at most ``strided_1x1_implicit_max_channels`` input channels on
    # ``strided_1x1_implicit_min_pixels`` output pixels; else im2col over HWC slabs. Machine A, 2
    # threads, batch 16, one process alternating, best of 15, ms im2col / implicit / tapwise, C -> K
    # at H -> P: 256 -> 512 at 4 -> 2 0.279 / 0.289 / 0.159; 512 -> 1024 at 8 -> 4 2.26 / 3.16 /
    # 1.73; 1024 -> 2048 at 4 -> 2 2.33 / 14.15 / 1.83, at 14 -> 7 25.15 / 33.93 / 19.85; 64 -> 128
    # at 56 -> 28 3.26 / 2.72 / 4.51, at 16 -> 8 0.280 / 0.233 / 0.305; 128 -> 256 at 28 -> 14 2.33
    # / 2.06 / 2.80; 256 -> 512 at 56 -> 28 23.87 / 20.42 / 31.01; not 512 -> 1024 at 28 -> 14
    # (20.87 / 22.30 / 23.39), 128 -> 256 at 8 -> 4 (0.214 / 0.219 / 0.237), 256 -> 512 at 14 -> 7
    # (1.85 / 1.80 / 1.85). NHWC im2col won or tied (its gather is whole channel vectors): 1.56 /
    # 1.50 / 3.01 at 56 -> 28, 1.67 / 2.91 / 1.81 at 512 -> 1024 8 -> 4. Batch 4: 256 -> 512 at 14
    # -> 7 0.468 / 0.467 / 0.425, 1024 -> 2048 6.04 / 17.71 / 5.30; not 128 -> 256 at 8 -> 4 (0.065
    # / 0.092 / 0.073). Batch 32: 1024 -> 2048 at 14 -> 7 46.3 / 66.2 / 43.5, 64 -> 128 at 16 -> 8
    # 0.501 / 0.406 / 0.665
    strided_1x1_deep: int = 2
    strided_1x1_tapwise_min_channels: int = 256
    strided_1x1_implicit_max_channels: int = 256
    # (from 2048: at 1024, 64 -> 128 at 16 -> 8, the training step's forwards took 0.79
    # against im2col's 0.76 ms, medians of 20, for alone 0.233 against 0.280)
    strided_1x1_implicit_min_pixels: int = 2048


RULES = Rules()
