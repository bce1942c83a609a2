"""The measured table's state that :func:`cpu_plan.plan` reads (``cpu_table.py`` makes,
saves and loads tables; the rules live in ``cpu_plan.py``).

An entry names an algorithm and, for the algorithms that split a pass into blocks of
channels (im2col's whole-batch passes, tapwise: :data:`BLOCKED`), optionally its
``k_blocks``; an entry without one keeps the rules' blocks. The table is read from
``NUMBAFUSE_CONV_TABLE``'s path by the first plan that asks, unless :func:`use` set one.
"""
from __future__ import annotations

import json
import os

import numpy as np

ENV = "NUMBAFUSE_CONV_TABLE"
VERSION = 1
BLOCKED = ("im2col", "tapwise")     # algorithms whose entries may carry k_blocks
_TABLE = {}                         # key -> (algorithm, k_blocks or None)
_TABLE_READ = [False]


def key(geom, pass_, dtype) -> str:
    """The table's key of ``pass_`` of ``geom`` on ``dtype``: every field of the geometry."""
    g = geom
    return (f"{g.layout} {np.dtype(dtype).name} {pass_} N{g.N} C{g.C} H{g.H} W{g.W} K{g.K} "
            f"R{g.R} S{g.S} stride{g.sh}x{g.sw} pad{g.ph},{g.pw},{g.ph_end},{g.pw_end} "
            f"dil{g.dh}x{g.dw} groups{g.groups}")


def read(path, algorithms) -> dict:
    """The table saved at ``path`` (ValueError naming the file if it is not one: not JSON,
    another version, an entry whose algorithm is not one of ``algorithms`` or whose
    k_blocks is not a positive int of an algorithm in :data:`BLOCKED`)."""
    try:
        with open(path) as f:
            table = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"conv table {path}: not JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"conv table {path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(table, dict) or table.get("version") != VERSION:
        raise ValueError(f"conv table {path}: not a version-{VERSION} numbafuse conv table")
    entries = table.get("entries")
    if not isinstance(entries, dict):
        raise ValueError(f"conv table {path}: no entries")
    for k, entry in entries.items():
        algorithm = entry.get("algorithm") if isinstance(entry, dict) else None
        if algorithm not in algorithms:
            raise ValueError(f"conv table {path}: entry {k!r} has algorithm {algorithm!r}, "
                             f"not one of {algorithms}")
        blocks = entry.get("k_blocks")
        if blocks is not None and (algorithm not in BLOCKED or type(blocks) is not int
                                   or blocks < 1):
            raise ValueError(f"conv table {path}: entry {k!r} has k_blocks {blocks!r} "
                             f"(a positive int, for {' or '.join(BLOCKED)} only)")
    return table


def use(table):
    """Plan by ``table`` (from :func:`read`, or None: no table) from now on (the caller
    drops its memoised plans)."""
    _TABLE.clear()
    if table is not None:
        _TABLE.update({k: (e["algorithm"], e.get("k_blocks"))
                       for k, e in table["entries"].items()})
    _TABLE_READ[0] = True


def entry(geom, pass_, dtype, algorithms):
    """(algorithm, k_blocks or None) the table has for the pass, or None; the table named by
    :data:`ENV` read first if none was set (``algorithms``: those an entry may name)."""
    if not _TABLE_READ[0]:
        path = os.environ.get(ENV)
        use(read(path, algorithms) if path else None)
    return _TABLE.get(key(geom, pass_, dtype)) if _TABLE else None
