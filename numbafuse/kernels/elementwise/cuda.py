"""Small numba.cuda kernels the tape needs on the device: fill, copy, a*x + b*y, x*y, sum,
and the float16 <-> float32 conversion of the ops that take half precision (``cast``).

All work on flat (1-d, C-contiguous) views; the wrappers reshape. The sum is deterministic:
fixed per-block partials (a shared-memory tree), then one block reduces the partials.
"""
import numpy as np
from numba import float32, float64, int64, types, uint32

from ...cuda import empty, flat, numba_cuda as cuda

from ..cuda import config
from ..cuda.launch import launch
from ..cuda.reduce import block_sum

BLOCK = config.BLOCK


@cuda.jit(device=True, inline=True)
def _div(a, b):
    """a // b for 0 <= a, b < 2**32 as an inline unsigned 32-bit division (Python-semantics
    int64 ``//`` is a subroutine call per element; ``config.grid_1d`` refuses 2**32 items)."""
    return int64(uint32(a) // uint32(b))


@cuda.jit(device=True, inline=True)
def _mod(a, b):
    """a % b for 0 <= a, b < 2**32 (see ``_div``)."""
    return int64(uint32(a) % uint32(b))


@cuda.jit(cache=True)
def _fill(out, value):
    # out: (n,)
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = value


@cuda.jit(device=True, inline=True)
def _axpby_value(a, x, b, y):
    """``a*x + b*y`` as ``fma(a, x, b*y)``: one expression shared by ``_axpby`` and ``_sgd``,
    with the contraction written out, so both compile to the same arithmetic and the fused
    SGD step gives the bits of the per-parameter one. (Left to NVVM, ``a*x + b*y`` contracted
    differently in the two kernels: float64 results 1 ulp apart on an H100.)"""
    return cuda.fma(a, x, b * y)


@cuda.jit(cache=True)
def _axpby(a, x, b, y, out):
    # x, y, out: (n,);  out = a*x + b*y, and a*x when b == 0 (BLAS rule: y is not read, so an
    # inf or NaN in y does not turn into 0*inf = NaN; the wrappers scale with axpby(a, x, 0, x))
    if b == 0:
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = a * x[i]
    else:
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = _axpby_value(a, x[i], b, y[i])


# SGD table columns: the gradient's index in the tuple, its elements [lo, hi) taken by this
# row, the offset of the parameter in the flat buffers, 1 on the parameter's first momentum step
SGD_T, SGD_LO, SGD_HI, SGD_OFF, SGD_FIRST = range(5)


@cuda.jit(cache=True)
def _sgd(p, buf, grads, table, lr, momentum, wd, one):
    # p, buf: (n,) flat parameters and momentum buffers of one dtype, updated in place;
    # grads: a tuple of (n_t,) gradients; table: (rows, 5) int64, one row per chunk of a
    # parameter (columns SGD_*); a block per row (grid-stride), threads over its elements.
    # Per element, in the order of the per-parameter path (each step rounded to p's dtype):
    #   g <- 1*g + wd*p;  b <- g (first step) or m*b + 1*g;  p <- 1*p + (-lr)*b
    # ``one`` is 1.0 passed at run time: a literal 1.0 would be folded away and change the
    # FMA contraction of _axpby_value, so the bits would differ from the per-parameter path.
    g = cuda.local.array(1, p.dtype)            # the gradient as the update uses it
    for r in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
        grad = grads[table[r, SGD_T]]
        off = table[r, SGD_OFF]
        first = table[r, SGD_FIRST]
        hi = table[r, SGD_HI]
        k = table[r, SGD_LO] + cuda.threadIdx.x
        while k < hi:                              # (a range() here would divide per row)
            j = off + k
            g[0] = grad[k]
            if wd != 0.0:
                g[0] = _axpby_value(one, g[0], wd, p[j])
            if momentum != 0.0:
                if first == 0:
                    g[0] = _axpby_value(momentum, buf[j], one, g[0])
                buf[j] = g[0]
            p[j] = _axpby_value(one, p[j], -lr, g[0])
            k += cuda.blockDim.x


@cuda.jit(cache=True)
def _mul(x, y, out):
    # x, y, out: (n,)
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = x[i] * y[i]


@cuda.jit(cache=True)
def _scale_broadcast(scale, x, out):
    # scale: (1,) a device scalar, x/out: (n,);  out = scale[0] * x
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = scale[0] * x[i]


@cuda.jit(cache=True)
def _copy_strided1(src, dst):
    # src: any-strided (A,); dst: (A,), contiguous (or any-strided: copy_into)
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = src[i]


@cuda.jit(cache=True)
def _copy_strided2(src, dst):
    # src: any-strided (A, B); dst: C-contiguous (A, B) (or any-strided: copy_into)
    B = src.shape[1]
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        a, b = _div(i, B), _mod(i, B)
        dst[a, b] = src[a, b]


@cuda.jit(cache=True)
def _copy_strided3(src, dst):
    # src: any-strided (A, B, C); dst: C-contiguous (or any-strided: copy_into)
    B, C = src.shape[1], src.shape[2]
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        c = _mod(i, C)
        b = _mod(_div(i, C), B)
        a = _div(i, B * C)
        dst[a, b, c] = src[a, b, c]


@cuda.jit(cache=True)
def _copy_strided4(src, dst):
    # src: any-strided (A, B, C, D); dst: C-contiguous (or any-strided: copy_into)
    B, C, D = src.shape[1], src.shape[2], src.shape[3]
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        d = _mod(i, D)
        c = _mod(_div(i, D), C)
        b = _mod(_div(i, C * D), B)
        a = _div(i, B * C * D)
        dst[a, b, c, d] = src[a, b, c, d]


@cuda.jit(cache=True)
def _cast(src, dst):
    # src, dst: (n,) C-contiguous, float16 -> float32 or float32 -> float16 (round to nearest
    # even): dst[i] = src[i] in dst's dtype
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = src[i]


_COPY_BY_RANK = {1: _copy_strided1, 2: _copy_strided2, 3: _copy_strided3, 4: _copy_strided4}


@cuda.jit(cache=True)
def _copy_block(src, dst, inner, outer, base, put):
    # src, dst: flat, C-contiguous. A block of channels is runs of ``inner`` elements (one an
    # image in NCHW, one a pixel in NHWC), ``outer`` apart in the whole array, the first at
    # ``base`` (_channel_runs). put 0: dst (the block, i its index) = the whole's runs; put 1:
    # the whole's runs (dst) = src (the block)
    n = src.size if put else dst.size
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        row = _div(i, inner)
        j = row * outer + base + (i - row * inner)
        if put:
            dst[j] = src[i]
        else:
            dst[i] = src[j]


def _channel_runs(shape, layout, lo, hi):
    """(inner, outer, base) of channels [lo, hi) of a C-contiguous 4-d ``shape``."""
    N, A, B, D = shape
    if layout == "NCHW":              # (N, C, H, W): per image one run of (hi - lo) planes
        return (hi - lo) * B * D, A * B * D, lo * B * D
    return hi - lo, D, lo             # (N, H, W, C): per pixel one run of (hi - lo) values


def channel_slice(src, layout, lo, hi):
    """A C-contiguous copy of channels [lo, hi) of a C-contiguous 4-d device array in
    ``layout``. (numba's own view ``src[:, lo:hi]`` walks every contiguous run of the view in
    Python: ~10 ms for an NHWC block of (32, 56, 56) pixels; this takes none.)"""
    N, A, B, D = src.shape
    shape = (N, hi - lo, B, D) if layout == "NCHW" else (N, A, B, hi - lo)
    dst = empty(shape, src.dtype)
    if dst.size:
        inner, outer, base = _channel_runs(src.shape, layout, lo, hi)
        blocks, threads = config.grid_1d(dst.size)
        launch(_copy_block, blocks, threads, flat(src), flat(dst), inner, outer, base, 0)
    return dst


def put_channels(src, dst, layout, lo):
    """Channels [lo, lo + src's channels) of ``dst`` = ``src``, both C-contiguous 4-d device
    arrays in ``layout``, alike but for their channel counts; returns ``dst``."""
    hi = lo + (src.shape[1] if layout == "NCHW" else src.shape[3])
    if src.size:
        inner, outer, base = _channel_runs(dst.shape, layout, lo, hi)
        blocks, threads = config.grid_1d(src.size)
        launch(_copy_block, blocks, threads, flat(src), flat(dst), inner, outer, base, 1)
    return dst


@cuda.jit(cache=True)
def _sum_partials(x, partials):
    # x: (n,), partials: (gridDim.x,). Block b writes the sum of its grid-stride share.
    buf = cuda.shared.array(BLOCK, float64)
    acc = float64(0.0)         # (float64 in the simulator too: numba's type on a GPU)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        acc += float64(x[i])
    total = block_sum(buf, acc)
    if cuda.threadIdx.x == 0:
        partials[cuda.blockIdx.x] = total


def fill(out, value):
    of = flat(out)
    if of.size:
        blocks, threads = config.grid_1d(of.size)
        launch(_fill, blocks, threads, of, value)
    return out


def axpby(a, x, b, y, out=None):
    """``a*x + b*y`` for same-shape contiguous device arrays; ``b == 0``: ``a*x`` (y unread).

    Into ``out`` when given (it may be ``x`` or ``y``: each element is read before it is
    written), else into a new array.
    """
    out = empty(x.shape, x.dtype) if out is None else out
    if x.size:
        blocks, threads = config.grid_1d(x.size)
        launch(_axpby, blocks, threads, a, flat(x), b, flat(y),
               flat(out))
    return out


def mul(x, y):
    out = empty(x.shape, x.dtype)
    if x.size:
        blocks, threads = config.grid_1d(x.size)
        launch(_mul, blocks, threads, flat(x), flat(y), flat(out))
    return out


def scale_by_device_scalar(scale, x):
    """``scale[0] * x`` where ``scale`` is a one-element device array (no host round trip)."""
    out = empty(x.shape, x.dtype)
    if x.size:
        blocks, threads = config.grid_1d(x.size)
        launch(_scale_broadcast, blocks, threads, scale.reshape(1), flat(x),
                                          flat(out))
    return out


def contiguous_copy(src):
    """A C-contiguous copy of a (rank 1 to 4) device array."""
    rank = len(src.shape)
    if rank not in _COPY_BY_RANK:
        raise ValueError(f"contiguous_copy: rank {rank} is not supported on the device (1 to 4)")
    dst = empty(src.shape, src.dtype)
    if dst.size:
        blocks, threads = config.grid_1d(dst.size)
        launch(_COPY_BY_RANK[rank], blocks, threads, src, dst)
    return dst


def copy_into(src, dst):
    """``dst[...] = src`` for device arrays of one shape (rank 1 to 4), each any-strided (``dst``
    may be a view, e.g. a channel block of a larger array); returns ``dst``."""
    rank = len(src.shape)
    if rank not in _COPY_BY_RANK or tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_into: shapes {tuple(src.shape)} and {tuple(dst.shape)} (rank 1 "
                         f"to 4, equal) are not supported on the device")
    if dst.size:
        blocks, threads = config.grid_1d(dst.size)
        launch(_COPY_BY_RANK[rank], blocks, threads, src, dst)
    return dst


def cast(src, dtype):
    """A C-contiguous device array of ``src`` (C-contiguous) converted to ``dtype`` (float16
    <-> float32); ``src`` itself when it already is ``dtype``."""
    if np.dtype(src.dtype) == np.dtype(dtype):
        return src
    return cast_into(src, empty(src.shape, dtype))


def cast_into(src, dst):
    """``dst[...] = src`` converted to dst's dtype, both C-contiguous of one shape; returns
    ``dst``."""
    if dst.size:
        blocks, threads = config.grid_1d(dst.size)
        launch(_cast, blocks, threads, flat(src), flat(dst))
    return dst


def sum_all(x, scale=1.0):
    """``scale`` times the sum of every element (both in float64), as a 0-d device array;
    deterministic (fixed partial order)."""
    xf = flat(x)
    nblocks = max(1, min(config.reduce_blocks, -(-xf.size // config.block_threads())))
    partials = empty(nblocks, np.float64)
    launch(_sum_partials, nblocks, config.block_threads(), xf, partials)
    total = empty(1, np.float64)
    launch(_sum_partials, 1, config.block_threads(), partials, total)
    out = empty(1, x.dtype)
    blocks, threads = config.grid_1d(1)
    launch(_axpby, blocks, threads, scale, total, 0.0, total, out)
    return out.reshape(())


SGD_BUCKETS = (1, 2, 4, 8, 16, 32)   # gradients per launch: the tuple's size is compiled in


def sgd_chunks(sizes, offsets, firsts, indices):
    """The (rows, 5) int64 host table of :func:`sgd_step`: parameter ``indices[t]`` (size,
    offset, first-step flag from the lists) cut into chunks of ``config.sgd_chunk`` elements,
    ``t`` its place in the gradient tuple."""
    chunk = max(1, int(config.sgd_chunk))
    rows = []
    for t, i in enumerate(indices):
        for lo in range(0, sizes[i], chunk):
            rows.append((t, lo, min(sizes[i], lo + chunk), offsets[i], int(firsts[i])))
    return np.asarray(rows, np.int64).reshape(-1, 5)


def sgd_step(p, buf, grads, table, lr, momentum, weight_decay):
    """One SGD step (PyTorch semantics) of every parameter in ``table`` in one launch.

    ``p``, ``buf``: flat (n,) device buffers holding the parameters and their momentum
    buffers (``buf`` may be ``p`` itself when ``momentum == 0``: never read or written then);
    ``grads``: at most ``SGD_BUCKETS[-1]`` C-contiguous gradients of p's dtype (flattened
    here), padded here to the next bucket size (so a handful of signatures is compiled);
    ``table``: a device array from :func:`sgd_chunks`.
    """
    n = len(grads)
    if n == 0 or table.shape[0] == 0:
        return
    size = next(b for b in SGD_BUCKETS if b >= n)
    grads = tuple(map(flat, grads))
    grads += (grads[0],) * (size - n)                      # padding: never in the table
    blocks = max(1, min(config.max_blocks, table.shape[0]))
    launch(_sgd, blocks, config.block_threads(), p, buf, grads, table, float(lr), float(momentum),
                                         float(weight_decay), 1.0)


# Every kernel above with the signatures it is compiled for, as a function of the numba
# scalar type (float32, float64); tests/test_ptx.py compiles each to PTX for a real target and
# fails if a kernel of this module is missing here.
PTX_SIGNATURES = [
    (_fill, lambda f: (f[::1], f)),
    (_axpby, lambda f: (f, f[::1], f, f[::1], f[::1])),
    (_mul, lambda f: (f[::1], f[::1], f[::1])),
    (_scale_broadcast, lambda f: (f[::1], f[::1], f[::1])),
    (_copy_strided1, lambda f: (f[:], f[::1])),
    (_copy_strided2, lambda f: (f[:, :], f[:, ::1])),
    (_copy_strided3, lambda f: (f[:, :, :], f[:, :, ::1])),
    (_copy_strided4, lambda f: (f[:, :, :, :], f[:, :, :, ::1])),
    (_copy_block, lambda f: (f[::1], f[::1]) + (types.int64,) * 4),
    (_sum_partials, lambda f: (f[::1], float64[::1])),
    # half precision: float16 <-> float32 only (a float64 signature is never launched)
    (_cast, lambda f: (types.float16[::1], f[::1]) if f == float32 else None),
    (_cast, lambda f: (f[::1], types.float16[::1]) if f == float32 else None),
    (_sgd, lambda f: (f[::1], f[::1], types.UniTuple(f[::1], 16), int64[:, ::1], float64,
                      float64, float64, float64)),
    (_sgd, lambda f: (f[::1], f[::1], types.UniTuple(f[::1], SGD_BUCKETS[-1]), int64[:, ::1],
                      float64, float64, float64, float64)),
]
