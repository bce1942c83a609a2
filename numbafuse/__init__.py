"""numbafuse: fused deep-learning layers on Numba, for CPU and CUDA, forward and backward.

Two fused patterns, Conv2D -> BiasAdd -> ReLU and BatchNorm -> Add -> ReLU, plus
Conv -> BatchNorm (-> ReLU) trained with recompute, batch-norm folding for inference, a
small tape autograd, layers, a training loop and a Grappler-style remapper.

NumPy arrays in run the Numba CPU kernels; CUDA arrays in run the numba.cuda kernels; Tensors
in are recorded on the tape. See README.md and docs/.
"""
from . import nn, optim
from .autograd import Tensor, no_grad, saved_bytes
from .ops.arith import add
from .ops.basic import (cross_entropy, flatten, global_avg_pool2d, linear, max_pool2d, relu,
                        squeeze)
from .ops.batchnorm import batchnorm, batchnorm_add_relu, batchnorm_add_relu_backward
from .ops.conv import bias_add, conv2d, conv_bias_relu, conv_bias_relu_backward
from .ops.conv_batchnorm import (conv_batchnorm_relu, conv_batchnorm_relu_backward,
                                 fold_batchnorm)
from .fusion.compile import compile
from .fusion.ir import Graph
from .fusion.remap import remap
from .fusion.trace import trace
from .testing.finite_diff import gradcheck

__version__ = "0.1.0"

# Submodules with optional dependencies, imported on first use: ``numbafuse.cuda`` needs
# numba-cuda, ``numbafuse.torch`` PyTorch. (``import numbafuse.cuda`` works too; both give the
# same module.) ``import numbafuse`` imports neither.
_LAZY_SUBMODULES = ("cuda", "torch")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Tensor", "no_grad", "saved_bytes", "gradcheck",
    "conv_bias_relu", "conv_bias_relu_backward", "batchnorm_add_relu",
    "batchnorm_add_relu_backward", "conv_batchnorm_relu", "conv_batchnorm_relu_backward",
    "fold_batchnorm", "conv2d", "bias_add", "relu", "add", "batchnorm", "linear", "max_pool2d",
    "global_avg_pool2d", "flatten", "squeeze", "cross_entropy",
    "trace", "remap", "Graph", "compile", "nn", "optim",
]
