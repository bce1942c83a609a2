"""Block-level reductions shared by the numba.cuda kernels (device functions only).

``block_sum`` is the shared-memory tree every deterministic reduction here ends with: the
order of additions depends only on the block size, never on timing, so a result repeats bit
for bit. It is the portable path; the batch-norm kernels also have a warp-shuffle path for
real GPUs.
"""
from ..cuda import numba_cuda as cuda


@cuda.jit(device=True, inline=True)
def block_sum(buf, value):
    """The sum of ``value`` over the block's threads, returned to every thread.

    ``buf``: a shared float64 array of at least blockDim.x elements (blockDim.x a power of
    two). The block's threads must all call it (it synchronises).
    """
    t = cuda.threadIdx.x
    buf[t] = value
    cuda.syncthreads()  # every thread's value is in buf
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            buf[t] += buf[t + step]
        cuda.syncthreads()  # this level of the tree is complete before the next reads it
        step //= 2
    total = buf[0]
    cuda.syncthreads()  # everyone has read buf[0] before buf is reused
    return total
