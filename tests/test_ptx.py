"""Compile every numba.cuda kernel in the package to PTX for a real target (cc 9.0).

The CUDA simulator does no type checking and ignores shared-memory shape rules, so this is
what proves the kernels compile for a GPU. It needs NVVM (numba-cuda[cu13]) but no GPU, and
must run outside the simulator: it is skipped there and runs in the CPU test process.

Each CUDA kernel module (``numbafuse/kernels/<family>/cuda.py``, ``cuda/reduce.py``) lists its
kernels in ``PTX_SIGNATURES`` as
``(kernel, lambda f: signature)`` with ``f`` the numba float type; a kernel missing from that
list fails ``test_every_kernel_is_listed``. The list is read by ``numbafuse.kernels.catalog``,
the compilation is ``numbafuse.testing.cuda_sass.compile_ptx``.
"""
import os

import pytest

SKIPPED = (os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
           or os.environ.get("NUMBAFUSE_TEST_SM90", "1") == "0")
pytestmark = [pytest.mark.ptx, pytest.mark.usefixtures("compiled_in_workers"),
              pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1",
    reason="PTX compilation needs the real numba.cuda, not the simulator"), pytest.mark.skipif(
    os.environ.get("NUMBAFUSE_TEST_SM90", "1") == "0",
    reason="NUMBAFUSE_TEST_SM90=0: CI compiles for sm_90 in its newest-Python leg only")]

CC = (9, 0)


def _cuda_modules():
    if SKIPPED:         # no kernel module imported to collect tests that skip
        return []
    from numbafuse.kernels import catalog
    return catalog.kernel_modules()


def _kernels(module):
    from numba.cuda.dispatcher import CUDADispatcher
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device")
            and obj.py_func.__module__ == module.__name__}


def _cases():
    cases = []
    for module in _cuda_modules():
        for kernel, signature in getattr(module, "PTX_SIGNATURES", []):
            cases.append(pytest.param(kernel, signature,
                                      id=f"{module.__name__.removeprefix('numbafuse.kernels.')}.{kernel.__name__}"))
    return cases


def test_there_are_kernels():
    assert len(_cases()) >= 6


@pytest.mark.parametrize("module", _cuda_modules(),
                         ids=lambda m: m.__name__.removeprefix("numbafuse.kernels."))
def test_every_kernel_is_listed(module):
    listed = {id(k) for k, _ in getattr(module, "PTX_SIGNATURES", [])}
    missing = [name for name, k in _kernels(module).items() if id(k) not in listed]
    assert not missing, f"{module.__name__}: kernels missing from PTX_SIGNATURES: {missing}"


@pytest.mark.parametrize("kernel,signature", _cases())
@pytest.mark.parametrize("ftype", ["float32", "float64"])
def test_compiles_to_ptx(kernel, signature, ftype):
    import numba
    from numbafuse.testing import cuda_sass as sass
    sig = signature(getattr(numba, ftype))
    if sig is None:
        pytest.skip("built for the other dtype only (a tiling per dtype)")
    ptx = sass.compile_ptx(kernel, sig)
    assert ".target sm_90" in ptx
    assert ".entry" in ptx


_PTX_SCRIPT = """
import sys
import numbafuse.cuda
from numba.cuda import lowering
from numbafuse.kernels import catalog
from numbafuse.testing import cuda_sass
if sys.argv[1] == "scanning":
    lowering.Lower._find_singly_assigned_variable = \\
        lowering.Lower._scanning_singly_assigned_variable
cases = {name: (kernel, sig) for name, kernel, sig, _ in catalog.cases()}
for name in sys.argv[2:]:
    sys.stdout.write(cuda_sass._compile_ptx(*cases[name]) + "\\f")
"""


def _ptx_lines(ptx):
    # the module's .common .global declarations (numba's environments) come in an order that
    # varies with the process's string hashing, with numba-cuda's own lowering too: a set
    lines = ptx.splitlines()
    return (sorted(ln for ln in lines if ln.startswith(".common .global")),
            [ln for ln in lines if not ln.startswith(".common .global")])


def test_the_linear_lowering_count_generates_the_same_ptx():
    """numbafuse.cuda replaces numba-cuda's quadratic search for singly assigned variables
    (numbafuse/cuda/compat.py: speed_up_lowering) with a count: the same PTX comes out, for a
    conv GEMM (long unrolled blocks) and the depthwise forward (loops over taps)."""
    import subprocess
    import sys

    import numbafuse.cuda  # noqa: F401  (installs the count)
    from numba.cuda import lowering
    assert hasattr(lowering.Lower, "_scanning_singly_assigned_variable"), (
        "numba-cuda's lowering no longer scans: drop numbafuse.cuda.compat.speed_up_lowering")
    names = ["conv.gemm_dw_nhwc_64[f64]", "conv_depthwise._forward[f32]"]
    out = {}
    # both in fresh processes compiling the same kernels in the same order: the mangled names
    # in the PTX carry a counter of the process's compilations (the workers' PTX, compiled
    # after other kernels, has other names)
    for how in ("scanning", "counted"):
        run = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, how, *names],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        out[how] = run.stdout.split("\f")[:-1]
        assert len(out[how]) == len(names)
    for name, scanning, counted in zip(names, out["scanning"], out["counted"]):
        assert ".entry" in counted
        assert _ptx_lines(scanning) == _ptx_lines(counted), name
