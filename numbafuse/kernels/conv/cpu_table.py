"""A table of conv algorithms measured on this machine, which :func:`cpu_plan.plan` follows
where the default rules would guess.

The default rules (``cpu_plan.RULES``) pick each pass's algorithm from thresholds measured on
a few machines, and the machines disagree: ResNet-18's 3x3 64-channel forward at 16x16, batch
16, takes the implicit GEMM by a rule measured on a Zen 5 (0.72 ms against Winograd's 0.82
there), while on a Zen 4 with AVX-512 too Winograd takes 0.96 ms and the implicit GEMM 1.46
(``benchmarks/bench_conv_plan.py``). :func:`tune` times every algorithm that can run each pass
a model asks for, on this machine, and :func:`use` (or ``NUMBAFUSE_CONV_TABLE``, the path of a
saved table, read at the first plan) makes the plans follow the fastest, as cuDNN's benchmark
mode does, but measured once and kept in a file: the same algorithms, so the same bits, in
every later process.

    with recording() as asked:          # the (geometry, pass, dtype) that plan() is asked
        step()                          # e.g. one training step of the model
    table = tune(asked)                 # {key: {"algorithm": a, "ms": {variant: ms}}}
    save(table, "conv_table.json")      # NUMBAFUSE_CONV_TABLE=conv_table.json, or use(table)

The table picks parameters as well as algorithms: the blocks of channels that im2col's
whole-batch passes and tapwise split a pass into (``cpu_plan.k_block_choices``), which the
rules set from a block size measured elsewhere. On machine A (Zen 4), batch 16, ms by blocks:
ResNet-50's 1x1 256 -> 1024 at 4x4 dX by im2col in the rules' 2 blocks 1.80-1.91, in 4
0.96; its forward in 8 0.97, in 4 0.80; ResNet-18's 3x3 512 forward at 2x2 by tapwise in 8
1.88, in 16 1.67 (``"k_blocks"`` in an entry; the sums are a GEMM's per block, so other
blocks may round differently: a table's plans give the same bits in every process that reads
it, not the rules' bits).

The table applies only under the default rules: inside ``cpu_plan.using(...)`` (tests,
benchmarks) the rules decide. An entry whose algorithm cannot run its pass is not followed.
``python -m numbafuse.torch.tune`` tunes a ResNet's step (docs/pytorch.md, "A measured plan").
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import time

import numpy as np

from ..cpu import launch, recorded as _recorded
from . import cpu, cpu_plan

ENV = cpu_plan.TABLE_ENV
VERSION = cpu_plan.TABLE_VERSION
# another algorithm replaces the rules' choice only when it is this much faster (the timings
# of one pass move by a few per cent from run to run)
MARGIN = 0.05

key = cpu_plan.table_key
load = cpu_plan.read_table


def save(table, path):
    """Write ``table`` (from :func:`tune`) to ``path`` as JSON: into a file beside it, then
    renamed over it, so that a process reading the path meanwhile (``NUMBAFUSE_CONV_TABLE``
    on a shared file system) reads the old table or the new one, never part of one, and a
    write that fails leaves the old table."""
    path = os.fspath(path)
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


def use(table):
    """Plan by ``table`` (a table, a path to one, or None: no table) from now on, in every
    thread; returns the table in use."""
    if isinstance(table, (str, os.PathLike)):
        table = load(table)
    cpu_plan.use_table(table)
    return table


@contextlib.contextmanager
def recording():
    """Collect the (geometry, pass, dtype) that the plans made inside the block are asked
    for, under the default rules (a set, yielded). Prepared calls are off within: a replay
    asks no plan (``kernels/cpu/recorded.py``)."""
    asked = set()
    cpu_plan._RECORDING.append(asked)
    cpu_plan._PLANS.clear()              # memoised plans would not ask again
    try:
        with _recorded.off():
            yield asked
    finally:
        cpu_plan._RECORDING.remove(asked)


def variants(geom, pass_, dtype):
    """The names :func:`measure` times by default: every algorithm that can run the pass
    (with the rules' blocks of channels), and for those with blocks to choose
    (``cpu_plan.k_block_choices``) each other count, ``"im2col k_blocks=4"``."""
    names = []
    for algorithm in cpu_plan.ALGORITHMS:
        if not cpu_plan.supports(algorithm, geom, pass_, dtype):
            continue
        names.append(algorithm)
        ruled = cpu_plan.plan(geom, pass_, dtype, rules=cpu_plan.RULES, algorithm=algorithm)
        names += [name(algorithm, b)
                  for b in cpu_plan.k_block_choices(algorithm, geom, pass_, dtype)
                  if b != ruled.k_blocks]
    return names


def name(algorithm, k_blocks=None):
    """The :func:`variants` name of ``algorithm`` in ``k_blocks`` blocks (None: the rules'
    blocks, the algorithm's name); :func:`parse` inverts it."""
    return algorithm if k_blocks is None else f"{algorithm} k_blocks={k_blocks}"


def parse(name):
    """(algorithm, k_blocks or None) of a :func:`variants` name."""
    algorithm, _, blocks = name.partition(" k_blocks=")
    return algorithm, (int(blocks) if blocks else None)


def entry_variant(entry):
    """The :func:`variants` name of the variant a table ``entry`` keeps (its timings are
    ``entry["ms"][entry_variant(entry)]``)."""
    return name(entry["algorithm"], entry.get("k_blocks"))


def measure(geom, pass_, dtype, algorithms=None, repeats=5, rng=None):
    """{name: best ms of ``repeats`` calls} of ``pass_`` of ``geom`` on random ``dtype``
    inputs, for each of ``algorithms`` (names as :func:`variants`'; default: all of those);
    a first call of each is not timed (it compiles)."""
    rng = np.random.default_rng(0) if rng is None else rng
    dtype = np.dtype(dtype)
    x = rng.standard_normal(geom.x_shape).astype(dtype)
    w = (rng.standard_normal((geom.K, geom.C // geom.groups, geom.R, geom.S))
         / max(1, geom.C * geom.R)).astype(dtype)
    gy = rng.standard_normal(geom.y_shape).astype(dtype)
    if algorithms is None:
        algorithms = variants(geom, pass_, dtype)
    out = {}
    for algorithm in algorithms:
        plan = cpu_plan.plan(geom, pass_, dtype, cpu_plan.RULES, *parse(algorithm))
        if pass_ == "forward":
            def call():
                cpu.conv_forward(x, w, None, geom, False, plan=plan)
        else:
            need = (True, False, False) if pass_ == "dx" else (False, True, False)

            def call():
                cpu.conv_backward(gy, x, w, geom, None, need, plans=(plan, plan))
        call()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t0)
        out[algorithm] = best * 1e3
    return out


def _processor():
    """The CPU's model name (Linux's /proc/cpuinfo), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load_average():
    """The system's one-minute load average (None where the OS does not say)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def choose(timings, ruled, margin=MARGIN):
    """The algorithm a table keeps from ``timings`` ({algorithm: ms}): the fastest, unless
    the rules' choice ``ruled`` is within ``margin`` of it."""
    fastest = min(timings, key=timings.get)
    if ruled in timings and timings[ruled] <= timings[fastest] * (1 + margin):
        return ruled
    return fastest


def _rounded(timings):
    """``timings`` ({algorithm: ms}) as a table keeps them: to 0.1 us."""
    return {a: round(ms, 4) for a, ms in timings.items()}


def tune(asked, repeats=5, margin=MARGIN, progress=None):
    """A table of the passes in ``asked`` ((geometry, pass, dtype) triples, e.g. from
    :func:`recording`): each pass timed by every algorithm that runs it and each count of
    channel blocks those that split it may take (:func:`variants`, :func:`measure`), the
    fastest kept (:func:`choose`) where a second timing of it and the rules' choice alone
    agrees (``again_ms``), else the rules' choice; an entry ``{"algorithm": a, "rules": r,
    "ms": {...}}`` with ``"k_blocks": n`` where the blocks kept are not the rules'. Grouped
    convolutions are skipped (their kernels are not planned). ``progress(i, n, key)`` is
    called before each pass."""
    todo = sorted(((g, p, d) for g, p, d in asked if g.groups == 1 and g.N > 0),
                  key=lambda t: key(*t))
    entries = {}
    for i, (geom, pass_, dtype) in enumerate(todo):
        k = key(geom, pass_, dtype)
        if progress is not None:
            progress(i, len(todo), k)
        # chosen from the timings as the table records them (rounded), so that a reader of
        # the table reaches the same choice: two rounded to a tie go the same way for both
        timings = _rounded(measure(geom, pass_, dtype, repeats=repeats))
        ruled = cpu_plan.choose(geom, pass_, dtype, cpu_plan.RULES)
        chosen = choose(timings, ruled, margin)
        entry = {"rules": ruled, "ms": timings}
        if chosen != ruled:
            # timed again, the two alone: a pass slowed by something else running (another
            # process, a page fault) must not move the plan off the rules
            again = _rounded(measure(geom, pass_, dtype, algorithms=(ruled, chosen),
                                     repeats=repeats))
            entry["again_ms"] = again
            chosen = choose(again, ruled, margin)
        algorithm, blocks = parse(chosen)
        entry["algorithm"] = algorithm
        if blocks is not None:
            entry["k_blocks"] = blocks
        entries[k] = entry
    return {"version": VERSION, "entries": entries,
            "machine": {"processor": _processor(),
                        "threads": launch.num_threads(), "repeats": repeats,
                        "load_average": _load_average(),
                        "margin": margin,
                        "made": time.strftime("%Y-%m-%d %H:%M:%S")}}
