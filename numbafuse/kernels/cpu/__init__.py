"""The CPU runtime the op families' ``cpu*.py`` kernels share.

    launch.py     the thread pool: task kernels over [0, n), ``launch``/``launch_all``/
                  ``concurrently``; thread count (``set_num_threads``)
    team.py       tasks on PyTorch's GNU OpenMP team, where one is loaded
    sync.py       the pool's atomics: publish, park, spin
    buffers.py    reused output buffers (``output_cache``)
    blas.py       a private one-thread OpenBLAS (``gemm``, ``gemm_at``, bias + ReLU epilogues)
    gemm.py       register-tiled small GEMMs (n <= 64) in Numba
    gemm_taps.py  LLVM register tiles summing taps (implicit GEMM, 1x1 and phase passes)
    transpose.py  8x8-tile transposes (NCHW <-> NHWC, weights)
    steps.py      compiled steps their callers reach through slots (compiled once, not
                  again inside every kernel that calls them)
"""
