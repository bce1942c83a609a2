r"""Plain NumPy unfused forward and backward of every op: the specification.

Every numbafuse kernel, CPU or CUDA, fused or not, is tested against these functions, and the
benchmarks time them as "the NumPy/SciPy reference". They are written to be obviously right
rather than fast: no Numba, nothing imported from the rest of numbafuse (padding is resolved
here, independently), one short vectorised formula per op. Convolutions loop over the R*S filter
taps, never over pixels, so they are not absurdly slow either.

Every function computes in float64 and casts its results back to the floating dtype of its
inputs (float32 in, float32 out; integer inputs give float64). The composites
(``conv_bias_relu`` ...) do the same once, around the whole chain, so no intermediate is rounded.
Nothing here mutates an argument: running statistics are returned as new arrays.

Notation
--------
N batch, C input channels, H, W input height and width, K output channels (filters),
R, S filter height and width, P, Q output height and width, M = N*H*W (the number of values
per channel that batch norm reduces over). Internally everything is NCHW; ``layout="NHWC"``
transposes in and out. Conv weights are always (K, C, R, S). Gradients are named after what they
are the gradient of: ``dy`` (upstream), ``dx``, ``dw``, ``db``, ``dgamma``, ``dbeta``, ``dz``.

The math, in short
------------------
conv2d (cross-correlation, like PyTorch and TensorFlow), with stride (sh, sw), dilation (dil_h, dil_w)
and x_pad the zero-padded input::

    y[n,k,p,q] = sum_{c,r,s} x_pad[n, c, p*sh + r*dil_h, q*sw + s*dil_w] * w[k,c,r,s]
    P = (H + pad_top + pad_bottom - dil_h*(R-1) - 1) // sh + 1        (Q likewise)
    dw[k,c,r,s] = sum_{n,p,q} dy[n,k,p,q] * x_pad[n, c, p*sh + r*dil_h, q*sw + s*dil_w]
    dx_pad[n, c, p*sh + r*dil_h, q*sw + s*dil_w] += sum_k dy[n,k,p,q] * w[k,c,r,s];  dx = crop(dx_pad)

Padding: an int is symmetric; "valid" is none; "same" follows TensorFlow: per spatial dim
out = ceil(size/stride), total = max((out-1)*stride + dilation*(k-1) + 1 - size, 0),
begin = total//2, end = total - begin (the odd one goes to the bottom/right; at stride 1 this
is PyTorch's "same", even kernels included). A 4-tuple is (left, right, top, bottom), the
order of torch.nn.functional.pad: x_pad = np.pad(x, ((0, 0), (0, 0), (top, bottom),
(left, right))).

bias_add: y = x + b[c];  dx = dy, db[c] = sum_{n,h,w} dy.
relu: y = max(x, 0);  dx = dy * (x > 0)  (gradient 0 at x == 0).
add: y = x + z;  dx = dz = dy.
batchnorm, training: mean, var (biased) per channel over N, H, W; invstd = 1/sqrt(var + eps);
xhat = (x - mean)*invstd; y = gamma*xhat + beta.  Backward, with g = dy:
dbeta = sum g, dgamma = sum g*xhat, dx = gamma*invstd/M * (M*g - dbeta - xhat*dgamma).
Running stats (PyTorch): r_mean <- (1-m) r_mean + m mean, r_var <- (1-m) r_var + m var*M/(M-1).
batchnorm, inference: as above with running_mean, running_var in place of the batch statistics,
which are then constants: dx = gamma*invstd*g, dgamma = sum g*xhat, dbeta = sum g.
linear: y = x @ w.T + b with w (out_features, in_features);  dx = dy @ w, dw = dy.T @ x,
db = sum_n dy.
max_pool2d: y = max over each k x k window (stride defaults to k, padding never wins, floor);
the gradient goes to the FIRST maximum of its window in row-major order, like PyTorch.
global_avg_pool2d: y[n,c] = mean_{h,w} x;  dx = dy[n,c] / (H*W) everywhere.
cross_entropy: L = mean_n (logsumexp(logits[n]) - logits[n, label[n]]);
dlogits = dy * (softmax(logits) - onehot(labels)) / N.
fold_batchnorm: scale = gamma/sqrt(running_var + eps); w' = w*scale[k], b' = (b - running_mean)*
scale + beta, so that conv2d(x, w') + b' == batchnorm_infer(conv2d(x, w) + b).

The derivations are in docs/derivations.md.
"""

import numpy as np

LAYOUTS = ("NCHW", "NHWC")


# --------------------------------------------------------------------------- helpers

def _f64(a):
    """``a`` as a float64 array (``None`` stays ``None``)."""
    return None if a is None else np.asarray(a, dtype=np.float64)


def _result_dtype(*arrays):
    """The floating dtype results are cast back to: float32 in -> float32 out, ints -> float64."""
    return np.result_type(*[np.asarray(a).dtype for a in arrays if a is not None], np.float32)


def _cast(a, dtype):
    return None if a is None else np.asarray(a, dtype=dtype)


def _check_layout(op, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be 'NCHW' or 'NHWC', got {layout!r}")


def _check_4d(op, name, a):
    if np.ndim(a) != 4:
        raise ValueError(f"{op}: {name} must have 4 dimensions, got shape {np.shape(a)}")


def _to_nchw(a, layout):
    """(N, H, W, C) -> (N, C, H, W) when layout is NHWC; NCHW passes through."""
    return a.transpose(0, 3, 1, 2) if layout == "NHWC" else a


def _from_nchw(a, layout):
    """(N, C, H, W) -> (N, H, W, C) when layout is NHWC; NCHW passes through."""
    return a.transpose(0, 2, 3, 1) if layout == "NHWC" else a


def _pair(op, name, value):
    """An int or an (h, w) pair, as a pair."""
    if isinstance(value, str):
        return value, value
    if np.ndim(value) == 0:
        return int(value), int(value)
    if len(value) != 2:
        raise ValueError(f"{op}: {name} must be an int or an (h, w) pair, got {value!r}")
    return value[0] if isinstance(value[0], str) else int(value[0]), (
        value[1] if isinstance(value[1], str) else int(value[1]))


def _channel(v):
    """A per-channel vector (C,) as (1, C, 1, 1), to broadcast against NCHW."""
    return np.asarray(v).reshape(1, -1, 1, 1)


def _taps(k, dilation, stride, out):
    """For each filter tap t, the slice of padded-input rows t*dilation + p*stride, p < out."""
    return [slice(t * dilation, t * dilation + (out - 1) * stride + 1, stride) for t in range(k)]


# --------------------------------------------------------------------------- geometry

def resolve_padding(size, k, stride, dilation, padding):
    """(begin, end) zero padding of one spatial dimension.

    ``padding`` is an int (symmetric), ``"valid"`` (none) or ``"same"`` (TensorFlow's rule:
    output ceil(size/stride), the odd padding element at the end).
    """
    if stride < 1 or dilation < 1 or k < 1:
        raise ValueError(f"resolve_padding: need k, stride, dilation >= 1, "
                         f"got k={k}, stride={stride}, dilation={dilation}")
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0
        if padding == "same":
            out = -(-size // stride)                       # ceil(size / stride)
            extent = dilation * (k - 1) + 1                # the dilated filter's footprint
            total = max((out - 1) * stride + extent - size, 0)
            return total // 2, total - total // 2
        raise ValueError(f"resolve_padding: padding must be an int, 'valid' or 'same', "
                         f"got {padding!r}")
    padding = int(padding)
    if padding < 0:
        raise ValueError(f"resolve_padding: padding must be >= 0, got {padding}")
    return padding, padding


def conv_output_size(size, k, stride=1, padding=0, dilation=1):
    """Output size of one dimension: (size + begin + end - dilation*(k-1) - 1) // stride + 1."""
    begin, end = resolve_padding(size, k, stride, dilation, padding)
    return (size + begin + end - dilation * (k - 1) - 1) // stride + 1


def _conv_geometry(op, x_nchw, w, stride, padding, dilation):
    """((sh, sw), (dil_h, dil_w), ((top, bottom), (left, right)), (P, Q)) of a convolution."""
    _check_4d(op, "x", x_nchw)
    _check_4d(op, "w", w)
    C, (K, Cw, R, S) = x_nchw.shape[1], w.shape
    if Cw != C:
        raise ValueError(f"{op}: w has {Cw} input channels, x has {C}")
    H, W = x_nchw.shape[2:]
    sh, sw = _pair(op, "stride", stride)
    dil_h, dil_w = _pair(op, "dilation", dilation)
    if min(sh, sw, dil_h, dil_w) < 1:
        raise ValueError(f"{op}: stride and dilation must be >= 1, got {stride!r}, {dilation!r}")
    if not isinstance(padding, str) and np.ndim(padding) == 1 and len(padding) == 4:
        left, right, top, bottom = (int(p) for p in padding)     # F.pad's order
        if min(left, right, top, bottom) < 0:
            raise ValueError(f"{op}: padding must be >= 0, got {padding!r}")
        pad_h, pad_w = (top, bottom), (left, right)
    else:
        ph, pw = _pair(op, "padding", padding)
        pad_h = resolve_padding(H, R, sh, dil_h, ph)
        pad_w = resolve_padding(W, S, sw, dil_w, pw)
    P = (H + sum(pad_h) - dil_h * (R - 1) - 1) // sh + 1
    Q = (W + sum(pad_w) - dil_w * (S - 1) - 1) // sw + 1
    if P < 1 or Q < 1:
        raise ValueError(f"{op}: output size would be {P}x{Q} (< 1)")
    return (sh, sw), (dil_h, dil_w), (pad_h, pad_w), (P, Q)


# --------------------------------------------------------------------------- conv2d

def _block_diagonal(op, w, C, groups):
    """w (K, C/groups, R, S) as the block-diagonal (K, C, R, S) of the same ungrouped conv."""
    K, Cg = w.shape[:2]
    if not isinstance(groups, (int, np.integer)) or groups < 1 or K % groups or Cg * groups != C:
        raise ValueError(f"{op}: groups={groups!r} does not fit x's {C} channels, w's {K} x {Cg}")
    full, k = np.zeros((K, C) + w.shape[2:]), K // groups
    for g in range(groups):
        full[g * k:(g + 1) * k, g * Cg:(g + 1) * Cg] = w[g * k:(g + 1) * k]
    return full


def conv2d(x, w, stride=1, padding=0, dilation=1, layout="NCHW", groups=1):
    """2-d cross-correlation of x with w (K, C/groups, R, S): one tensordot per filter tap."""
    _check_layout("conv2d", layout)
    dtype = _result_dtype(x, w)
    x, w = _to_nchw(_f64(x), layout), _f64(w)                      # x: (N, C, H, W)
    w = w if groups == 1 else _block_diagonal("conv2d", w, x.shape[1], groups)   # (K, C, R, S)
    (sh, sw), (dil_h, dil_w), pads, (P, Q) = _conv_geometry("conv2d", x, w, stride, padding, dilation)
    x_pad = np.pad(x, ((0, 0), (0, 0)) + pads)                     # (N, C, H+pt+pb, W+pl+pr)
    N, (K, C, R, S) = x.shape[0], w.shape
    y = np.zeros((N, P, Q, K))                                     # (N, P, Q, K)
    for r, rows in enumerate(_taps(R, dil_h, sh, P)):
        for s, cols in enumerate(_taps(S, dil_w, sw, Q)):
            x_tap = x_pad[:, :, rows, cols]                        # (N, C, P, Q)
            # einsum("ncpq,kc->npqk", x_tap, w[:, :, r, s])
            y += np.tensordot(x_tap, w[:, :, r, s], axes=([1], [1]))   # (N, P, Q, K)
    y = y.transpose(0, 3, 1, 2)                                    # (N, P, Q, K) -> (N, K, P, Q)
    return _cast(_from_nchw(y, layout), dtype)


def conv2d_backward(dy, x, w, stride=1, padding=0, dilation=1, layout="NCHW", groups=1):
    """(dx, dw) of conv2d: each tap scatters dy*w back into dx, and correlates x with dy into dw."""
    _check_layout("conv2d_backward", layout)
    dtype = _result_dtype(dy, x, w)
    dy, x, w = _to_nchw(_f64(dy), layout), _to_nchw(_f64(x), layout), _f64(w)
    w = w if groups == 1 else _block_diagonal("conv2d_backward", w, x.shape[1], groups)
    (sh, sw), (dil_h, dil_w), pads, (P, Q) = _conv_geometry(
        "conv2d_backward", x, w, stride, padding, dilation)
    (N, C, H, W), (K, _, R, S) = x.shape, w.shape
    if dy.shape != (N, K, P, Q):
        raise ValueError(f"conv2d_backward: dy has shape {dy.shape}, expected {(N, K, P, Q)}")
    (pt, _), (pl, _) = pads
    x_pad = np.pad(x, ((0, 0), (0, 0)) + pads)                     # (N, C, Hp, Wp)
    dx_pad = np.zeros_like(x_pad)                                  # (N, C, Hp, Wp)
    dw = np.zeros_like(w)                                          # (K, C, R, S)
    for r, rows in enumerate(_taps(R, dil_h, sh, P)):
        for s, cols in enumerate(_taps(S, dil_w, sw, Q)):
            # einsum("nkpq,ncpq->kc", dy, x_tap)
            dw[:, :, r, s] = np.tensordot(dy, x_pad[:, :, rows, cols],
                                          axes=([0, 2, 3], [0, 2, 3]))     # (K, C)
            # einsum("nkpq,kc->ncpq", dy, w[:, :, r, s])
            g_tap = np.tensordot(dy, w[:, :, r, s], axes=([1], [0]))       # (N, P, Q, C)
            dx_pad[:, :, rows, cols] += g_tap.transpose(0, 3, 1, 2)        # (N, C, P, Q)
    dx = dx_pad[:, :, pt:pt + H, pl:pl + W]                        # crop the padding away
    g = np.arange(groups)                                          # dw's diagonal blocks:
    dw = dw.reshape(groups, K // groups, groups, -1)[g, :, g].reshape(K, C // groups, R, S)
    return _cast(_from_nchw(dx, layout), dtype), _cast(dw, dtype)


# --------------------------------------------------------------------------- elementwise

def bias_add(x, b, layout="NCHW"):
    """y = x + b[c], b of shape (C,)."""
    _check_layout("bias_add", layout)
    dtype = _result_dtype(x, b)
    y = _to_nchw(_f64(x), layout) + _channel(_f64(b))
    return _cast(_from_nchw(y, layout), dtype)


def bias_add_backward(dy, layout="NCHW"):
    """(dx, db): dx = dy, db[c] = sum of dy over N, H, W."""
    _check_layout("bias_add_backward", layout)
    dtype = _result_dtype(dy)
    db = _to_nchw(_f64(dy), layout).sum(axis=(0, 2, 3))           # (C,)
    return np.array(dy, dtype=dtype), _cast(db, dtype)


def relu(x):
    """y = max(x, 0)."""
    dtype = _result_dtype(x)
    return _cast(np.maximum(_f64(x), 0.0), dtype)


_relu = relu    # conv_batchnorm_relu's ``relu`` flag shadows the function inside it


def relu_backward(dy, x):
    """dx = dy * (x > 0): the gradient at x == 0 is 0."""
    dtype = _result_dtype(dy, x)
    return _cast(_f64(dy) * (_f64(x) > 0), dtype)


def add(x, z):
    """y = x + z."""
    dtype = _result_dtype(x, z)
    return _cast(_f64(x) + _f64(z), dtype)


def add_backward(dy):
    """(dx, dz) = (dy, dy), as two new arrays."""
    dtype = _result_dtype(dy)
    return np.array(dy, dtype=dtype), np.array(dy, dtype=dtype)


# --------------------------------------------------------------------------- batch norm

def _batch_stats(x_nchw):
    """Per-channel mean and biased variance over N, H, W of an NCHW array."""
    return x_nchw.mean(axis=(0, 2, 3)), x_nchw.var(axis=(0, 2, 3))   # (C,), (C,)


def _check_vectors(op, C, **vectors):
    for name, v in vectors.items():
        if v is not None and np.shape(v) != (C,):
            raise ValueError(f"{op}: {name} must have shape ({C},), got {np.shape(v)}")


def batchnorm_train(x, gamma, beta, eps=1e-5, layout="NCHW"):
    """(y, mean, var) of training batch norm; var is the biased batch variance."""
    op = "batchnorm_train"
    _check_layout(op, layout)
    _check_4d(op, "x", x)
    dtype = _result_dtype(x, gamma, beta)
    x = _to_nchw(_f64(x), layout)                                  # (N, C, H, W)
    _check_vectors(op, x.shape[1], gamma=gamma, beta=beta)
    mean, var = _batch_stats(x)
    xhat = (x - _channel(mean)) / np.sqrt(_channel(var) + eps)
    y = _channel(_f64(gamma)) * xhat + _channel(_f64(beta))
    return _cast(_from_nchw(y, layout), dtype), _cast(mean, dtype), _cast(var, dtype)


def batchnorm_backward(dy, x, gamma, eps=1e-5, layout="NCHW"):
    """(dx, dgamma, dbeta) of training batch norm; the batch statistics are recomputed from x."""
    op = "batchnorm_backward"
    _check_layout(op, layout)
    _check_4d(op, "x", x)
    dtype = _result_dtype(dy, x, gamma)
    g, x = _to_nchw(_f64(dy), layout), _to_nchw(_f64(x), layout)  # (N, C, H, W)
    _check_vectors(op, x.shape[1], gamma=gamma)
    N, C, H, W = x.shape
    M = N * H * W
    mean, var = _batch_stats(x)
    invstd = 1.0 / np.sqrt(var + eps)                              # (C,)
    xhat = (x - _channel(mean)) * _channel(invstd)
    dbeta = g.sum(axis=(0, 2, 3))                                  # (C,)
    dgamma = (g * xhat).sum(axis=(0, 2, 3))                        # (C,)
    dx = _channel(_f64(gamma) * invstd / M) * (
        M * g - _channel(dbeta) - xhat * _channel(dgamma))
    return _cast(_from_nchw(dx, layout), dtype), _cast(dgamma, dtype), _cast(dbeta, dtype)


def batchnorm_infer(x, gamma, beta, running_mean, running_var, eps=1e-5, layout="NCHW"):
    """Inference batch norm: y = gamma * (x - running_mean)/sqrt(running_var + eps) + beta."""
    op = "batchnorm_infer"
    _check_layout(op, layout)
    _check_4d(op, "x", x)
    dtype = _result_dtype(x, gamma, beta, running_mean, running_var)
    x = _to_nchw(_f64(x), layout)                                  # (N, C, H, W)
    _check_vectors(op, x.shape[1], gamma=gamma, beta=beta, running_mean=running_mean,
                   running_var=running_var)
    invstd = 1.0 / np.sqrt(_f64(running_var) + eps)
    xhat = (x - _channel(_f64(running_mean))) * _channel(invstd)
    y = _channel(_f64(gamma)) * xhat + _channel(_f64(beta))
    return _cast(_from_nchw(y, layout), dtype)


def batchnorm_infer_backward(dy, x, gamma, running_var, eps=1e-5, layout="NCHW", *,
                             running_mean=None):
    """(dx, dgamma, dbeta) of inference batch norm; the running statistics are constants.

    dx = gamma*invstd*dy needs only ``running_var``; dgamma = sum dy*xhat needs xhat =
    (x - running_mean)*invstd, so ``running_mean`` (keyword) is required.
    """
    op = "batchnorm_infer_backward"
    _check_layout(op, layout)
    _check_4d(op, "x", x)
    if running_mean is None:
        raise ValueError(f"{op}: running_mean is required (dgamma = sum dy * xhat, "
                         f"xhat = (x - running_mean) * invstd); pass running_mean=...")
    dtype = _result_dtype(dy, x, gamma, running_var, running_mean)
    g, x = _to_nchw(_f64(dy), layout), _to_nchw(_f64(x), layout)  # (N, C, H, W)
    _check_vectors(op, x.shape[1], gamma=gamma, running_var=running_var,
                   running_mean=running_mean)
    invstd = 1.0 / np.sqrt(_f64(running_var) + eps)                # (C,)
    xhat = (x - _channel(_f64(running_mean))) * _channel(invstd)
    dbeta = g.sum(axis=(0, 2, 3))                                  # (C,)
    dgamma = (g * xhat).sum(axis=(0, 2, 3))                        # (C,)
    dx = g * _channel(_f64(gamma) * invstd)
    return _cast(_from_nchw(dx, layout), dtype), _cast(dgamma, dtype), _cast(dbeta, dtype)


def update_running_stats(running_mean, running_var, mean, var, count, momentum):
    """New (running_mean, running_var), PyTorch's convention; var is biased over count values.

    r_mean' = (1-m) r_mean + m mean,  r_var' = (1-m) r_var + m var*count/(count-1).
    """
    if count < 2:
        raise ValueError(f"update_running_stats: need more than one value per channel "
                         f"for the unbiased variance, got count={count}")
    dtype = _result_dtype(running_mean, running_var)
    var_unbiased = _f64(var) * count / (count - 1)
    new_mean = (1.0 - momentum) * _f64(running_mean) + momentum * _f64(mean)
    new_var = (1.0 - momentum) * _f64(running_var) + momentum * var_unbiased
    return _cast(new_mean, dtype), _cast(new_var, dtype)


# --------------------------------------------------------------------------- linear, pooling, loss

def linear(x, w, b=None):
    """y = x @ w.T + b, x (N, in_features), w (out_features, in_features)."""
    dtype = _result_dtype(x, w, b)
    y = _f64(x) @ _f64(w).T                                        # (N, out)
    if b is not None:
        y = y + _f64(b)
    return _cast(y, dtype)


def linear_backward(dy, x, w):
    """(dx, dw, db): dx = dy @ w, dw = dy.T @ x, db = sum_n dy."""
    dtype = _result_dtype(dy, x, w)
    dy, x, w = _f64(dy), _f64(x), _f64(w)
    return _cast(dy @ w, dtype), _cast(dy.T @ x, dtype), _cast(dy.sum(axis=0), dtype)


def _pool_windows(x_nchw, k, stride, padding=0):
    """All k*k window taps of x padded by -inf (wins only where nothing is larger: not the
    kernels' rule), (kh*kw, N, C, P, Q), taps in row-major order; and (slices, ph, pw)."""
    kh, kw = _pair("max_pool2d", "k", k)
    sh, sw = (kh, kw) if stride is None else _pair("max_pool2d", "stride", stride)
    ph, pw = _pair("max_pool2d", "padding", padding)
    if min(kh, kw, sh, sw) < 1:
        raise ValueError(f"max_pool2d: k and stride must be >= 1, got {k!r}, {stride!r}")
    x_nchw = np.pad(x_nchw, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    P, Q = (x_nchw.shape[2] - kh) // sh + 1, (x_nchw.shape[3] - kw) // sw + 1
    if P < 1 or Q < 1:
        raise ValueError(f"max_pool2d: output size would be {P}x{Q} (< 1)")
    slices = [(rows, cols) for rows in _taps(kh, 1, sh, P) for cols in _taps(kw, 1, sw, Q)]
    return np.stack([x_nchw[:, :, rows, cols] for rows, cols in slices]), (slices, ph, pw)


def max_pool2d(x, k, stride=None, layout="NCHW", padding=0):
    """Max over each k x k window; stride defaults to k; padding never wins; floor size."""
    _check_layout("max_pool2d", layout)
    _check_4d("max_pool2d", "x", x)
    windows, _ = _pool_windows(_to_nchw(_f64(x), layout), k, stride, padding)
    return _cast(_from_nchw(windows.max(axis=0), layout), _result_dtype(x))


def max_pool2d_backward(dy, x, k, stride=None, layout="NCHW", padding=0):
    """dx: each dy goes to the FIRST maximum (row-major) of its window; overlaps accumulate."""
    _check_layout("max_pool2d_backward", layout)
    _check_4d("max_pool2d_backward", "x", x)
    dtype, x, dy = _result_dtype(dy, x), _to_nchw(_f64(x), layout), _to_nchw(_f64(dy), layout)
    windows, (slices, ph, pw) = _pool_windows(x, k, stride, padding)   # (kh*kw, N, C, P, Q)
    first_max = windows.argmax(axis=0)                             # (N, C, P, Q); argmax: first
    dx = np.zeros(windows.shape[1:3] + (x.shape[2] + 2 * ph, x.shape[3] + 2 * pw))
    for t, (rows, cols) in enumerate(slices):
        dx[:, :, rows, cols] += dy * (first_max == t)
    return _cast(_from_nchw(dx[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]], layout), dtype)


def global_avg_pool2d(x, layout="NCHW"):
    """(N, C) mean over H, W."""
    _check_layout("global_avg_pool2d", layout)
    _check_4d("global_avg_pool2d", "x", x)
    dtype = _result_dtype(x)
    return _cast(_to_nchw(_f64(x), layout).mean(axis=(2, 3)), dtype)


def global_avg_pool2d_backward(dy, x_shape, layout="NCHW"):
    """dx of shape x_shape (in layout): dy[n, c] / (H*W) at every pixel."""
    _check_layout("global_avg_pool2d_backward", layout)
    dtype = _result_dtype(dy)
    if layout == "NCHW":
        N, C, H, W = x_shape
    else:
        N, H, W, C = x_shape
    dx = np.broadcast_to(_f64(dy).reshape(N, C, 1, 1) / (H * W), (N, C, H, W))
    return _cast(_from_nchw(dx, layout), dtype).copy()


def _log_softmax(logits):
    """Row-wise log softmax, stable: shift by the row max before exp."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _check_labels(op, logits, labels):
    labels = np.asarray(labels)
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"{op}: need logits (N, classes) and labels (N,), "
                         f"got {logits.shape} and {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise TypeError(f"{op}: labels must be integers, got {labels.dtype}")
    return labels


def cross_entropy(logits, labels):
    """0-d mean over the batch of -log softmax(logits)[label]."""
    dtype = _result_dtype(logits)
    logits = _f64(logits)                                          # (N, classes)
    labels = _check_labels("cross_entropy", logits, labels)        # (N,)
    nll = -_log_softmax(logits)[np.arange(len(labels)), labels]    # (N,)
    return np.asarray(nll.mean(), dtype=dtype)


def cross_entropy_backward(dy, logits, labels):
    """dlogits = dy * (softmax(logits) - onehot(labels)) / N; dy is the scalar upstream grad."""
    dtype = _result_dtype(logits)
    logits = _f64(logits)                                          # (N, classes)
    labels = _check_labels("cross_entropy_backward", logits, labels)
    N = logits.shape[0]
    dlogits = np.exp(_log_softmax(logits))                         # softmax, (N, classes)
    dlogits[np.arange(N), labels] -= 1.0
    return _cast(float(np.asarray(dy, dtype=np.float64)) * dlogits / N, dtype)


# --------------------------------------------------------------------------- composites
# The chains the fused ops must equal. Forward and backward are written by chaining the unfused
# pieces above, in float64 end to end, with one cast back at the end.

def conv_bias_relu(x, w, b=None, stride=1, padding=0, dilation=1, layout="NCHW", groups=1):
    """y = relu(conv2d(x, w) + b); no bias when b is None."""
    dtype = _result_dtype(x, w, b)
    h = conv2d(_f64(x), _f64(w), stride=stride, padding=padding, dilation=dilation,
               layout=layout, groups=groups)
    if b is not None:
        h = bias_add(h, _f64(b), layout=layout)
    return _cast(relu(h), dtype)


def conv_bias_relu_backward(dy, x, w, b=None, stride=1, padding=0, dilation=1, layout="NCHW",
                            groups=1, *, y=None):
    """(dx, dw, db) of conv_bias_relu, db None when b is None; the ReLU mask from ``y`` (the
    forward's output, as the fused backward reads it) if given, else recomputed."""
    dtype = _result_dtype(dy, x, w, b)
    dy, x, w, b = _f64(dy), _f64(x), _f64(w), _f64(b)
    geometry = dict(stride=stride, padding=padding, dilation=dilation, layout=layout, groups=groups)
    h = conv2d(x, w, **geometry)                                   # pre-bias
    h = h if b is None else bias_add(h, b, layout=layout)          # pre-activation
    g = relu_backward(dy, h if y is None else _f64(y))
    db = None
    if b is not None:
        g, db = bias_add_backward(g, layout=layout)
    dx, dw = conv2d_backward(g, x, w, **geometry)
    return _cast(dx, dtype), _cast(dw, dtype), _cast(db, dtype)


def _running_pair(op, running_mean, running_var, training):
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: pass both running_mean and running_var, or neither")
    if not training and running_mean is None:
        raise ValueError(f"{op}: inference (training=False) needs running_mean and running_var")


def _batchnorm_forward(op, x, gamma, beta, running_mean, running_var, training, momentum, eps,
                       layout):
    """(y, new_running_mean, new_running_var) of batch norm, float64, nothing mutated."""
    _running_pair(op, running_mean, running_var, training)
    if not training:
        y = batchnorm_infer(x, gamma, beta, running_mean, running_var, eps=eps, layout=layout)
        return y, running_mean.copy(), running_var.copy()         # unchanged, but new arrays
    y, mean, var = batchnorm_train(x, gamma, beta, eps=eps, layout=layout)
    if running_mean is None:
        return y, None, None
    N, C, H, W = _to_nchw(x, layout).shape
    new_mean, new_var = update_running_stats(running_mean, running_var, mean, var,
                                             count=N * H * W, momentum=momentum)
    return y, new_mean, new_var


def _batchnorm_backward(g, x, gamma, running_mean, running_var, training, eps, layout):
    """(dx, dgamma, dbeta) of batch norm, training or inference."""
    if training:
        return batchnorm_backward(g, x, gamma, eps=eps, layout=layout)
    return batchnorm_infer_backward(g, x, gamma, running_var, eps=eps, layout=layout,
                                    running_mean=running_mean)


def batchnorm_add_relu(x, z, gamma, beta, running_mean=None, running_var=None, training=True,
                       momentum=0.1, eps=1e-5, layout="NCHW"):
    """(y, new_running_mean, new_running_var) with y = relu(batchnorm(x) + z).

    Training uses batch statistics and returns updated running stats (None when not given);
    inference uses the running stats and returns them unchanged. Inputs are never mutated.
    """
    op = "batchnorm_add_relu"
    dtype = _result_dtype(x, z, gamma, beta)
    stats_dtype = _result_dtype(running_mean, running_var)
    h, new_mean, new_var = _batchnorm_forward(
        op, _f64(x), _f64(gamma), _f64(beta), _f64(running_mean), _f64(running_var), training,
        momentum, eps, layout)
    y = relu(add(h, _f64(z)))
    return _cast(y, dtype), _cast(new_mean, stats_dtype), _cast(new_var, stats_dtype)


def batchnorm_add_relu_backward(dy, x, z, gamma, beta, running_mean=None, running_var=None,
                                training=True, eps=1e-5, layout="NCHW", *, y=None):
    """(dx, dz, dgamma, dbeta) of batchnorm_add_relu (the forward's argument order); the ReLU
    mask from ``y`` (the forward's output) if given, else recomputed."""
    op = "batchnorm_add_relu_backward"
    dtype = _result_dtype(dy, x, z, gamma, beta)
    dy, x, z, gamma, beta = _f64(dy), _f64(x), _f64(z), _f64(gamma), _f64(beta)
    running_mean, running_var = _f64(running_mean), _f64(running_var)
    h, _, _ = _batchnorm_forward(op, x, gamma, beta, running_mean, running_var, training,
                                 0.0, eps, layout)
    g = relu_backward(dy, add(h, z) if y is None else _f64(y))    # mask: pre-activation or y
    dh, dz = add_backward(g)
    dx, dgamma, dbeta = _batchnorm_backward(dh, x, gamma, running_mean, running_var, training,
                                            eps, layout)
    return _cast(dx, dtype), _cast(dz, dtype), _cast(dgamma, dtype), _cast(dbeta, dtype)


def conv_batchnorm_relu(x, w, gamma, beta, running_mean=None, running_var=None, training=True,
                        momentum=0.1, eps=1e-5, stride=1, padding=0, dilation=1, relu=True,
                        layout="NCHW", groups=1):
    """(y, new_running_mean, new_running_var) with y = relu(batchnorm(conv2d(x, w))).

    ``relu=False`` leaves the ReLU out; ``groups``: conv2d's. Running stats: batchnorm_add_relu's.
    """
    op = "conv_batchnorm_relu"
    dtype = _result_dtype(x, w, gamma, beta)
    stats_dtype = _result_dtype(running_mean, running_var)
    h = conv2d(_f64(x), _f64(w), stride=stride, padding=padding, dilation=dilation,
               layout=layout, groups=groups)
    y, new_mean, new_var = _batchnorm_forward(
        op, h, _f64(gamma), _f64(beta), _f64(running_mean), _f64(running_var), training,
        momentum, eps, layout)
    if relu:
        y = _relu(y)
    return _cast(y, dtype), _cast(new_mean, stats_dtype), _cast(new_var, stats_dtype)


def conv_batchnorm_relu_backward(dy, x, w, gamma, beta, running_mean=None, running_var=None,
                                 training=True, eps=1e-5, stride=1, padding=0, dilation=1,
                                 relu=True, layout="NCHW", groups=1):
    """(dx, dw, dgamma, dbeta) of conv_batchnorm_relu; recomputes the conv (and batch norm)."""
    op = "conv_batchnorm_relu_backward"
    dtype = _result_dtype(dy, x, w, gamma, beta)
    dy, x, w, gamma, beta = _f64(dy), _f64(x), _f64(w), _f64(gamma), _f64(beta)
    running_mean, running_var = _f64(running_mean), _f64(running_var)
    geometry = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    h = conv2d(x, w, groups=groups, **geometry)                    # batch-norm input
    g = dy
    if relu:
        pre, _, _ = _batchnorm_forward(op, h, gamma, beta, running_mean, running_var, training,
                                       0.0, eps, layout)
        g = relu_backward(dy, pre)
    dh, dgamma, dbeta = _batchnorm_backward(g, h, gamma, running_mean, running_var, training,
                                            eps, layout)
    dx, dw = conv2d_backward(dh, x, w, groups=groups, **geometry)
    return _cast(dx, dtype), _cast(dw, dtype), _cast(dgamma, dtype), _cast(dbeta, dtype)


def fold_batchnorm(w, b, gamma, beta, running_mean, running_var, eps=1e-5):
    """(w_folded, b_folded) so that conv2d(x, w_folded) + b_folded equals inference
    batch norm of conv2d(x, w) + b; b may be None (a conv without bias)."""
    dtype = _result_dtype(w, b, gamma, beta, running_mean, running_var)
    w = _f64(w)                                                    # (K, C, R, S)
    scale = _f64(gamma) / np.sqrt(_f64(running_var) + eps)         # (K,)
    b = np.zeros(w.shape[0]) if b is None else _f64(b)             # (K,)
    w_folded = w * scale.reshape(-1, 1, 1, 1)                      # (K, C, R, S)
    b_folded = (b - _f64(running_mean)) * scale + _f64(beta)       # (K,)
    return _cast(w_folded, dtype), _cast(b_folded, dtype)
