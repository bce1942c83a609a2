"""The CUDA runtime the op families' ``cuda*.py`` kernels share (imported with them: only when a
device array comes, so CPU users never import numba-cuda).

    config.py   every launch size and tile (``Tile``, ``CONV_TILES``, block counts)
    launch.py   every kernel launch: prepared argument buffers, CUDA-graph capture
    gemm.py     the register-blocked implicit-GEMM skeleton the conv kernels are built from
    reduce.py   per-channel reductions (batch-norm statistics, bias gradients), block sums
"""
