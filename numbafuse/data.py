"""The 8x8 handwritten digits that scikit-learn ships (no download), ready for a conv net.

``load_digits()`` returns a :class:`Digits` split: 1797 images of 8x8 pixels, values 0..16,
scaled to [0, 1] and then standardised with the training set's mean and standard deviation,
as ``(N, 1, 8, 8)`` (NCHW) or ``(N, 8, 8, 1)`` (NHWC) float32 arrays, and int64 labels 0..9.
The train/test split is stratified (the same fraction of every class goes to the test set)
and fixed by a seed. :func:`batches` yields seeded, shuffled mini-batches.

Needs scikit-learn (``pip install 'numbafuse[data]'``).

Examples
--------
>>> from numbafuse.data import load_digits, batches
>>> d = load_digits()
>>> d.x_train.shape, d.x_test.shape
((1438, 1, 8, 8), (359, 1, 8, 8))
>>> xb, yb = next(batches(d.x_train, d.y_train, 32, seed=0))
>>> xb.shape, yb.shape
((32, 1, 8, 8), (32,))
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate

INSTALL_HINT = "scikit-learn is needed for the digits data: pip install 'numbafuse[data]'"
PIXEL_MAX = 16.0         # load_digits pixels are integers 0..16
IMAGE_SIZE = 8
NUM_CLASSES = 10
TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass
class Digits:
    """A train/test split of the digits: images ``(N, 1, 8, 8)`` (or NHWC), int64 labels."""
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    layout: str = "NCHW"
    num_classes: int = NUM_CLASSES

    def subset(self, n_train=None, n_test=None):
        """The first ``n_train`` training and ``n_test`` test examples (for quick runs)."""
        return Digits(self.x_train[:n_train], self.y_train[:n_train], self.x_test[:n_test],
                      self.y_test[:n_test], self.layout, self.num_classes)


def _sklearn_digits():
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    bunch = sk_load_digits()
    return bunch.images, bunch.target                       # (1797, 8, 8) floats, (1797,)


def stratified_split(labels, test_fraction=TEST_FRACTION, seed=SPLIT_SEED):
    """(train_idx, test_idx): per class, a seeded permutation sends ``test_fraction`` to test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"stratified_split: test_fraction must lie in (0, 1), got "
                         f"{test_fraction!r}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    # a seeded shuffle so classes are interleaved (subsets stay balanced)
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load_digits(layout="NCHW", dtype=np.float32, test_fraction=TEST_FRACTION,
                seed=SPLIT_SEED):
    """The scikit-learn digits as a standardised, stratified, seeded :class:`Digits` split.

    Parameters
    ----------
    layout : {"NCHW", "NHWC"}
        ``(N, 1, 8, 8)`` or ``(N, 8, 8, 1)`` images.
    dtype : float32 or float64
    test_fraction : float
        Fraction of each class held out for testing.
    seed : int
        Seed of the split (the same seed always gives the same split).
    """
    layout = validate.check_layout("load_digits", layout)
    images, labels = _sklearn_digits()
    x = images.astype(np.float64) / PIXEL_MAX               # [0, 1], (N, 8, 8)
    train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    mean, std = x[train_idx].mean(), x[train_idx].std()     # training-set statistics only
    x = (x - mean) / std
    x = x[:, None, :, :] if layout == "NCHW" else x[:, :, :, None]   # (N,1,8,8) or (N,8,8,1)
    x = np.ascontiguousarray(x, dtype=dtype)
    y = labels.astype(np.int64)
    return Digits(x[train_idx], y[train_idx], x[test_idx], y[test_idx], layout)


def batches(x, y, batch_size, *, shuffle=True, seed=0, drop_last=False):
    """Yield ``(x_batch, y_batch)`` pairs, shuffled by a seeded permutation.

    Parameters
    ----------
    x, y : arrays with the same first dimension
    batch_size : int
    shuffle : bool
        Permute the examples first (``seed`` fixes the permutation).
    seed : int or numpy.random.Generator
    drop_last : bool
        Skip a last batch smaller than ``batch_size``.
    """
    n = len(x)
    if len(y) != n:
        raise ValueError(f"batches: x has {n} examples but y has {len(y)}")
    if int(batch_size) < 1:
        raise ValueError(f"batches: batch_size must be >= 1, got {batch_size!r}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    order = rng.permutation(n) if shuffle else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        yield np.ascontiguousarray(x[idx]), np.ascontiguousarray(y[idx])


def random_shift(x, rng, max_shift=1, layout="NCHW"):
    """Each image translated by its own random (dy, dx) in [-max_shift, max_shift], zero-filled.

    The usual augmentation for small digit images; ``x`` is ``(N, 1, 8, 8)`` (or NHWC).
    Returns a new array; ``x`` is not modified.
    """
    if max_shift <= 0:
        return x
    x4 = x if layout == "NCHW" else x.transpose(0, 3, 1, 2)        # (N, C, H, W) view
    N, _, H, W = x4.shape
    m = max_shift
    padded = np.pad(x4, ((0, 0), (0, 0), (m, m), (m, m)))           # (N, C, H+2m, W+2m)
    dy, dx = rng.integers(0, 2 * m + 1, size=(2, N))                # top-left corner per image
    out = np.empty_like(x4)
    for n in range(N):
        out[n] = padded[n, :, dy[n]:dy[n] + H, dx[n]:dx[n] + W]
    return out if layout == "NCHW" else np.ascontiguousarray(out.transpose(0, 2, 3, 1))


def num_batches(n, batch_size, drop_last=False):
    return n // batch_size if drop_last else -(-n // batch_size)
