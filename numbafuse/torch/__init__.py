r"""PyTorch interoperation (extra ``torch``): numbafuse's fused ops inside PyTorch models.

    fuse(model, *, leaf_modules=(), copy=True) -> torch.fx.GraphModule      # the remapper
    unfuse(fused) -> the model object (its own forward), sharing fused's modules
    with weight_cache(): ...   # reuse what the convs derive from unchanged weights (opt-in)
    conv_bias_relu(x, w, b=None, stride=1, padding=0, dilation=1, groups=1)
    batchnorm_add_relu(x, z, weight, bias, running_mean=None, running_var=None,
                       training=True, momentum=0.1, eps=1e-5)
    conv_batchnorm_relu(x, w, weight, bias, running_mean=None, running_var=None,
                        training=True, momentum=0.1, eps=1e-5, stride=1, padding=0,
                        dilation=1, relu=True, groups=1)
    conv_batchnorm_add_relu(x, w, z, weight, bias, running_mean=None, running_var=None,
                            training=True, momentum=0.1, eps=1e-5, stride=1, padding=0,
                            dilation=1, groups=1)
    ConvBiasReLU2d(...)        # the state_dict of torch.nn.Conv2d
    BatchNormAddReLU2d(...)    # m(x, z); the state_dict of torch.nn.BatchNorm2d
    ConvBatchNormReLU2d(...), ConvBatchNorm2d(...), ConvBatchNormAddReLU2d(...)   # m(x, z)
                               # sub-modules conv (torch.nn.Conv2d) and bn (BatchNorm2d)

Tensors may be contiguous or ``torch.channels_last`` (numbafuse's NHWC kernels, zero-copy;
the outputs keep the format); modules take ``device=`` and ``dtype=`` as torch's.
    resnet18(**kw), resnet50(**kw), resnext50_32x4d(**kw), ResNet, BasicBlock, Bottleneck,
    mobilenet_v2(**kw), MobileNetV2                 # torchvision's names

Modules of this package: ``bridge`` (the tensor/array bridge: checks, views, memory formats,
stream order), ``layers`` (Conv-Bias-ReLU, BatchNorm-Add-ReLU), ``prepared`` (calls whose
checks passed before), ``conv_batchnorm`` (Conv-BatchNorm(-ReLU) and Conv-BatchNorm-Add-ReLU
with recompute), ``modules`` (their torch modules), ``fx`` (:func:`fuse`), ``sites`` (what a
fused model calls), ``bfloat16`` (bfloat16 tensors without ``ml_dtypes``), ``resnet`` and
``mobilenet`` (torchvision-compatible ResNets and MobileNetV2, written here). Described in
docs/pytorch.md.
"""
try:
    import torch  # noqa: F401  (nft.torch: tests patch torch.cuda through it)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("numbafuse.torch needs PyTorch: pip install 'numbafuse[torch]' (the CPU "
                      "build: pip install torch --index-url "
                      "https://download.pytorch.org/whl/cpu)") from exc

from .. import backend  # noqa: F401  (tests patch backend.as_device_array through here)
from .conv_batchnorm import (ConvBatchNormAddReLUFunction, ConvBatchNormReLUFunction,
                             conv_batchnorm_add_relu, conv_batchnorm_relu)
from .fx import fuse, unfuse
from .modules import ConvBatchNorm2d, ConvBatchNormAddReLU2d, ConvBatchNormReLU2d
from . import library  # noqa: F401,E402  (registers torch.ops.numbafuse.*)
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50, resnext50_32x4d
from .mobilenet import MobileNetV2, mobilenet_v2, mobilenet_v2_relu
from .layers import (BatchNormAddReLU2d, BatchNormAddReLUFunction, ConvBiasReLU2d,
                     ConvBiasReLUFunction, batchnorm_add_relu, conv_bias_relu)
from .bridge import (  # noqa: F401  (the bridge's names, for tests and benchmarks)
                     DEVICE_TYPES, FLOAT_DTYPES, LAYOUT, as_array, as_tensor, check_tensors,
                     launch_order, weight_cache)

__all__ = ["fuse", "unfuse", "weight_cache", "conv_bias_relu", "batchnorm_add_relu",
           "conv_batchnorm_relu", "conv_batchnorm_add_relu", "ConvBiasReLU2d", "BatchNormAddReLU2d",
           "ConvBatchNormReLU2d", "ConvBatchNorm2d", "ConvBatchNormAddReLU2d",
           "ConvBiasReLUFunction", "BatchNormAddReLUFunction", "ConvBatchNormReLUFunction",
           "ConvBatchNormAddReLUFunction", "ResNet", "BasicBlock", "Bottleneck", "resnet18",
           "resnet50", "resnext50_32x4d", "MobileNetV2", "mobilenet_v2", "mobilenet_v2_relu"]
