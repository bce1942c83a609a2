"""numba.cuda kernels. Importing a module here needs numba-cuda but no GPU; kernels compile
lazily on first launch (or to PTX in tests/test_ptx.py)."""
