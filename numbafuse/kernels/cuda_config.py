"""Launch sizes for every numba.cuda kernel, in one place.

Shared-memory shapes must be compile-time constants, so they are the ``*_TILE``/``BLOCK``
constants below and never change. Launch sizes (``threads``, ``max_blocks``...) are read at
launch time, so tests can shrink them (``monkeypatch.setattr(config, "max_blocks", 2)``) to
force tiny inputs across several blocks. A kernel never assumes more threads per block than
``BLOCK``.
"""

# Compile-time constants (shared-array shapes).
BLOCK = 256          # threads per block of 1-d kernels and of reductions; power of two
TILE = 16            # square tile edge of 2-d tiled kernels (GEMM-like); TILE*TILE <= BLOCK

# Launch-time knobs (tests patch these).
threads = 256        # threads per block for 1-d kernels; power of two, <= BLOCK
max_blocks = 1024    # grid-stride kernels never launch more blocks than this
reduce_blocks = 64   # blocks of per-block partials in a two-stage deterministic reduction
max_grid_y = 65535   # hardware limit of gridDim.y; kernels with a y grid stride over the rest


def block_threads() -> int:
    """``threads``, checked: the block reductions need a power of two no larger than BLOCK."""
    if threads < 1 or threads > BLOCK or threads & (threads - 1):
        raise ValueError(f"kernels.cuda_config: threads must be a power of two <= {BLOCK}, "
                         f"got {threads}")
    return threads


def grid_1d(n: int) -> tuple:
    """(blocks, threads) for a grid-stride loop over ``n`` items."""
    t = block_threads()
    return max(1, min(max_blocks, -(-n // t))), t
