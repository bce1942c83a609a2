"""Every numba.cuda kernel of the package, with its signature per dtype.

Each CUDA kernel module (an op family's ``kernels/<family>/cuda.py`` and ``cuda_*.py``, the
shared ``kernels/cuda/*.py``) lists its kernels once in ``PTX_SIGNATURES`` as
``(kernel, lambda f: signature)``, ``f`` the numba float type, and names its GEMM kernels in
``GEMM_KERNELS``. :func:`cases` reads those lists: ``python -m numbafuse.precompile --cuda``
compiles each case into Numba's disk cache, ``tests/test_ptx.py`` compiles each to sm_90 PTX,
and the static check (``numbafuse.testing.cuda_sass``, ``tests/test_sass.py``) reads each
one's machine code.
"""
from __future__ import annotations

import importlib
import pkgutil


def kernel_modules() -> list:
    """Every CUDA kernel module that lists kernels (``PTX_SIGNATURES``): each op family's
    ``kernels/<family>/cuda.py`` and ``cuda_*.py`` (e.g. ``conv/cuda_depthwise.py``), and the
    shared ``kernels/cuda/*.py``."""
    import numbafuse.kernels as pkg
    import numbafuse.kernels.cuda as shared
    names = []
    for m in pkgutil.iter_modules(pkg.__path__):
        if m.ispkg and m.name not in ("cpu", "cuda"):
            family = importlib.import_module(f"{pkg.__name__}.{m.name}")
            names += [f"{family.__name__}.{s.name}" for s in pkgutil.iter_modules(family.__path__)
                      if s.name == "cuda" or s.name.startswith("cuda_")]
    names += [f"{shared.__name__}.{m.name}" for m in pkgutil.iter_modules(shared.__path__)]
    mods = [importlib.import_module(n) for n in names]
    return sorted((m for m in mods if getattr(m, "PTX_SIGNATURES", None)),
                  key=lambda m: m.__name__)


def cases(dtypes=("float32", "float64")) -> list:
    """``(name, kernel, signature, is_gemm)`` for every listed kernel and dtype, ``name`` as
    ``family.kernel[f32]`` (an entry whose signature function returns None for a dtype is not
    compiled for it)."""
    import numba
    out = []
    for mod in kernel_modules():
        gemms = {id(k) for k in getattr(mod, "GEMM_KERNELS", ())}
        # "conv" for kernels/conv/cuda.py, "reduce" for kernels/cuda/reduce.py
        short = mod.__name__.removeprefix("numbafuse.kernels.").removesuffix(".cuda")
        short = short.removeprefix("cuda.").replace(".cuda_", "_")   # conv_depthwise
        for kernel, sig in mod.PTX_SIGNATURES:
            kname = getattr(kernel, "__name__", None) or kernel.py_func.__name__
            for dt in dtypes:
                tag = {"float32": "f32", "float64": "f64"}[dt]
                signature = sig(getattr(numba, dt))
                if signature is None:       # a kernel built for the other dtype only
                    continue
                out.append((f"{short}.{kname}[{tag}]", kernel, signature, id(kernel) in gemms))
    return out
