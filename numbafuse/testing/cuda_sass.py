"""Static analysis of the package's numba.cuda kernels as sm_90 machine code (no GPU needed).

A kernel is compiled by numba to PTX, assembled by ``ptxas -arch=sm_90 -O3 -v`` and
disassembled by ``cuobjdump -sass`` (which runs ``nvdisasm``); the tools come from NVIDIA's pip
wheels (``nvidia-cuda-nvcc``, ``nvidia-cuda-cuobjdump``, ``nvidia-cuda-nvdisasm``: the ``sass``
extra, also in ``test``).
What is read from them:

- ``ptxas -v``: registers per thread, stack frame bytes, spill store/load bytes, shared memory;
- the SASS: every loop (a backward branch and its target), its instruction mix, and which of
  them is the *hot loop* of a GEMM: the loop with the most FFMA/DFMA instructions (the
  unrolled multiply-add K-loop; when a kernel has a fast and a slow path, the faster).

``tests/test_sass.py`` turns these into checks (and ``tests/test_ptx.py`` compiles every kernel
with :func:`compile_ptx`); ``benchmarks/gpu_static.py`` into the table of
``docs/benchmarks.md``, section "CUDA kernels as sm_90 code". The kernels and their signatures
come from :mod:`numbafuse.kernels.catalog`. A development tool: nothing in the runtime
package imports it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types

CC = (9, 0)
ARCH = "sm_90"

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
_PTXAS_V = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "smem": re.compile(r"(\d+) bytes smem"),
}


def tool(name: str) -> str | None:
    """Path of an NVIDIA tool: the pip wheel's (``nvidia/cu*/bin``) first, then PATH."""
    try:
        import nvidia
        for base in nvidia.__path__:
            for sub in sorted(os.listdir(base), reverse=True):
                path = os.path.join(base, sub, "bin", name)
                if sub.startswith("cu") and os.access(path, os.X_OK):
                    return path
    except ImportError:
        pass
    return shutil.which(name)


def missing_tools() -> list:
    """The tools this module needs that are not installed (empty: it can run)."""
    return [t for t in ("ptxas", "cuobjdump", "nvdisasm") if tool(t) is None]


@dataclasses.dataclass
class Insn:
    addr: int
    op: str          # mnemonic with modifiers, e.g. "FFMA", "LDS.128", "CALL.REL.NOINC"
    operands: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


@dataclasses.dataclass
class Loop:
    start: int       # address of the branch target (the loop head)
    end: int         # address of the backward branch
    insns: list

    def count(self, *bases) -> int:
        return sum(1 for i in self.insns if i.base in bases)

    @property
    def fma(self) -> int:
        return self.count("FFMA", "DFMA")

    @property
    def shared_loads(self) -> int:
        return self.count("LDS")

    @property
    def fma_share(self) -> float:
        return self.fma / max(1, len(self.insns))

    @property
    def fma_per_lds(self) -> float:
        return self.fma / self.shared_loads if self.shared_loads else float("inf")

    def mix(self) -> dict:
        out = {}
        for i in self.insns:
            out[i.base] = out.get(i.base, 0) + 1
        return out


@dataclasses.dataclass
class Report:
    name: str                 # "module.kernel[f32]"
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    smem: int
    insns: list
    loops: list

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def local_memory_ops(self) -> int:
        """LDL/STL anywhere: a local array that did not stay in registers."""
        return sum(1 for i in self.insns if i.base in ("LDL", "STL"))

    def hot_loop(self) -> Loop | None:
        """The loop with the most FFMA/DFMA (ties: the smaller loop, i.e. the innermost)."""
        loops = [lp for lp in self.loops if lp.fma]
        return max(loops, key=lambda lp: (lp.fma, -len(lp.insns))) if loops else None

    def calls_in_loops(self) -> list:
        """``CALL`` instructions inside any loop (64-bit division, float64 division...)."""
        return [i for lp in self.loops for i in lp.insns if i.base == "CALL"]

    def callee(self, call: Insn) -> list:
        """The instructions of the subroutine a ``CALL`` enters, up to its ``RET``."""
        t = _TARGET.search(call.operands)
        body = []
        for i in self.insns:
            if t and i.addr >= int(t.group(1), 16):
                body.append(i)
                if i.base == "RET":
                    break
        return body

    def is_integer_division(self, call: Insn) -> bool:
        """ptxas's 64-bit integer division/remainder subroutine: a reciprocal refined with
        ``IMAD.HI.U32`` and no floating-point FMA (float64 division's slow path has DFMA)."""
        ops = {i.op for i in self.callee(call)}
        return "IMAD.HI.U32" in ops and not ops & {"DFMA", "FFMA"}

    def integer_division_calls_in_loops(self) -> list:
        """64-bit integer division calls inside any loop."""
        return [c for c in self.calls_in_loops() if self.is_integer_division(c)]

    def divisions_in(self, loop: Loop) -> list:
        """Integer-division footprints in ``loop``: calls, and the inline 32-bit sequence's
        reciprocal (``MUFU.RCP`` after ``I2F``...)."""
        return [i for i in loop.insns if i.base == "CALL" or i.op.startswith("MUFU.RCP")]


def parse_sass(text: str) -> tuple:
    """(instructions, loops) of one function's ``cuobjdump -sass`` listing."""
    insns = []
    for m in _INSN.finditer(text):
        insns.append(Insn(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    loops = []
    for i, ins in enumerate(insns):
        if ins.base != "BRA":
            continue
        t = _TARGET.search(ins.operands)
        if t is None:
            continue
        target = int(t.group(1), 16)
        if target <= ins.addr:
            body = [x for x in insns if target <= x.addr <= ins.addr]
            loops.append(Loop(target, ins.addr, body))
    return insns, loops


def _run(cmd):
    """A tool's CompletedProcess; a RuntimeError with its own message when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"sass: {' '.join(cmd)} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return done


def _ptxas_info(text: str) -> dict:
    out = {}
    for key, rx in _PTXAS_V.items():
        m = rx.search(text)
        out[key] = int(m.group(1)) if m else 0
    return out


def assemble(ptx: str, max_registers: int | None = None) -> tuple:
    """(ptxas -v text, SASS text) of one PTX module, for sm_90."""
    ptxas, cuobjdump = tool("ptxas"), tool("cuobjdump")
    if ptxas is None or cuobjdump is None or tool("nvdisasm") is None:
        raise RuntimeError("sass: ptxas/cuobjdump/nvdisasm not found: pip install "
                           "'numbafuse[sass]' (nvidia-cuda-nvcc, -cuobjdump, -nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, f"-arch={ARCH}", "-O3", "-v", src, "-o", cubin]
        if max_registers:
            cmd[1:1] = [f"-maxrregcount={max_registers}"]
        info = _run(cmd)
        sass = _run([cuobjdump, "-sass", cubin])
    return info.stdout + info.stderr, sass.stdout


@contextlib.contextmanager
def offline_target(cc=CC):
    """Compile for ``cc`` on a machine without a GPU.

    numba-cuda compiles a device function that is called (not inlined at Numba-IR level:
    ``forceinline`` ones, see ``gemm.device``) for the *current* device's compute capability,
    and asks the driver which that is; with no GPU there is none. This stands one in while
    compiling (the kernel itself gets ``cc`` from ``compile_ptx``). No effect with a GPU.
    """
    from ..cuda import numba_cuda as cuda
    dispatcher = cuda.dispatcher
    if cuda.is_available():
        yield
        return
    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


_PTX = {}


def compile_ptx(kernel, signature) -> str:
    """PTX of a kernel for sm_90 with the kernel's own code-generation options (cached per
    process: the PTX and SASS tests share one compilation)."""
    key = (id(kernel), str(signature))
    if key not in _PTX:
        _PTX[key] = (kernel, _compile_ptx(kernel, signature))   # kernel kept: id stays valid
    return _PTX[key][1]


def _compile_case(name: str) -> str:
    """PTX of the catalog case ``name`` (a worker process's task)."""
    from ..kernels import catalog
    for case, kernel, signature, _ in catalog.cases():
        if case == name:
            return _compile_ptx(kernel, signature)
    raise KeyError(name)


def compile_all(cases, jobs=None) -> None:
    """Compile the catalog ``cases`` (``catalog.cases()`` entries) to PTX in ``jobs`` worker
    processes (default: the cores, at most 8) and keep each in :func:`compile_ptx`'s cache.

    Worker processes, not this one: compiling numbafuse's conv GEMMs took 20-22 s each in a
    fresh process and 31-40 s inside a pytest process that had collected the test suite
    (numba-cuda 0.30.4, machine F), and workers run side by side where there are cores.
    Each worker compiles several cases, so the numba import is paid once per worker."""
    import concurrent.futures as futures
    import multiprocessing
    todo = [(name, kernel, sig) for name, kernel, sig, _ in cases
            if (id(kernel), str(sig)) not in _PTX]
    if not todo:
        return
    jobs = max(1, min(jobs or os.cpu_count() or 1, 8, len(todo)))
    context = multiprocessing.get_context("spawn")    # never fork a process holding numba
    with futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        # the longest first (the GEMMs: gemm_*), so no worker is left with one at the end
        order = sorted(todo, key=lambda c: "gemm_" not in c[0])
        done = pool.map(_compile_case, [name for name, _, _ in order])
        for (name, kernel, sig), ptx in zip(order, done):
            _PTX[(id(kernel), str(sig))] = (kernel, ptx)


def _compile_ptx(kernel, signature) -> str:
    from ..cuda import numba_cuda as cuda
    opts = kernel.targetoptions
    with offline_target():
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=CC,
                                  fastmath=bool(opts.get("fastmath", False)),
                                  launch_bounds=opts.get("launch_bounds"),
                                  forceinline=bool(opts.get("forceinline", False)))
    return ptx


def analyse(kernel, signature, name: str) -> Report:
    """Compile ``kernel`` (a CUDA dispatcher) for ``signature`` to sm_90 and read its SASS.

    The kernel's own ``max_registers``, ``launch_bounds``, ``fastmath`` and ``forceinline``
    options are honoured, as at a real launch.
    """
    info, sass = assemble(compile_ptx(kernel, signature),
                          kernel.targetoptions.get("max_registers"))
    insns, loops = parse_sass(sass)
    return Report(name, insns=insns, loops=loops, **_ptxas_info(info))


def versions() -> str:
    """The versions behind a report: Python, numba, numba-cuda, ptxas."""
    from importlib import metadata
    ptxas = tool("ptxas")
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout \
        if ptxas else ""
    rel = re.search(r"release ([0-9.]+), V([0-9.]+)", out)
    return (f"Python {sys.version.split()[0]}, numba {metadata.version('numba')}, "
            f"numba-cuda {metadata.version('numba-cuda')}, "
            f"ptxas {rel.group(2) if rel else 'unknown'} ({ptxas})")
