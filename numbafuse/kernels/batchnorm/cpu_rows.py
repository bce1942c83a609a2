"""How the CPU batch-norm kernels see a 4-d activation: the row views and the per-channel
values laid along a row (the notation of ``kernels/batchnorm/cpu.py``).

Two families of kernels walk rows:

* ``"nchw"`` (``_*_nchw``): ``(N*C, HW)`` rows, one channel each, its per-channel values read
  once a row. At small maps the rows are short and the per-row work dominates: a row of a 2x2
  map holds 4 values.
* ``"nhwc"`` and ``"flat"`` (``_*_nhwc``): ``(R, L)`` rows whose element ``k`` has its
  per-channel values at index ``k`` of the ``(., L)`` value arrays, the loops vectorised along
  the whole row and the reductions kept per element, per task. NHWC: ``(N*H*W/m, m*C)`` rows,
  the values *tiled* m times (``NHWC_ROW``; channel ``k % C``). NCHW maps of at most
  ``FLAT_MAX_HW`` pixels take them too: ``(N, C*HW)`` rows, one sample each, the values
  *repeated* HW times (channel ``k // HW``), the reductions adding each channel's HW sums at
  the end of a task.
"""
import functools
from typing import NamedTuple

import numpy as np

from ..cpu import recorded as _rec
from .cpu_channels import spread_in_place


class RowView(NamedTuple):
    """One activation shape's view: ``family`` ("nchw"; "nhwc" or "flat", both walked by the
    "rows" kernels), the (R, L) row shape, the channels C, and how a channel's values spread
    along a row: ``m`` tiles (NHWC), each value ``rep`` times in a row (flat NCHW); both 1
    for "nchw"."""
    family: str
    shape: tuple
    C: int
    m: int
    rep: int

    def rows(self, x):
        """x's (R, L) row view."""
        return x.reshape(self.shape)

    def fill(self, out):
        """``out`` (k, m*rep*C), its columns [0, C) per-channel values, laid along a row in
        place: tiled m times (NHWC) or each value repeated rep times (flat NCHW)."""
        if self.m > 1 or self.rep > 1:
            _rec.step(spread_in_place, out, self.m, self.rep, self.C)
        return out

    def spread(self, rows):
        """(k, C) per-channel rows -> (k, L) (:meth:`fill`); ``rows`` itself when both m
        and rep are 1."""
        if self.m == 1 and self.rep == 1:
            return rows
        out = np.empty((rows.shape[0], self.m * self.rep * self.C), rows.dtype)
        _rec.copy(out[:, :self.C], rows)
        return self.fill(out)


def dims(shape, layout):
    """(N, C, HW) of a 4-d activation shape."""
    if layout == "NCHW":
        N, C, H, W = shape
    else:
        N, H, W, C = shape
    return N, C, H * W


@functools.lru_cache(maxsize=1024)
def view(shape, layout, nhwc_row, flat_max_hw, flat_max_row):
    """The :class:`RowView` of an activation shape in its layout (the knobs: ``kernels/
    batchnorm/cpu.py``'s NHWC_ROW, FLAT_MAX_HW, FLAT_MAX_ROW)."""
    N, C, HW = dims(shape, layout)
    if layout == "NCHW":
        if 0 < HW <= flat_max_hw and C * HW <= flat_max_row:
            return RowView("flat", (N, C * HW), C, 1, HW)
        return RowView("nchw", (N * C, HW), C, 1, 1)
    m = 1
    while m * C < nhwc_row and (N * HW) % (2 * m) == 0 and C:
        m *= 2
    return RowView("nhwc", (N * HW // m, m * C), C, m, 1)
