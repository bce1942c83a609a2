"""torchvision's MobileNetV2, written here (torchvision is not a dependency): the same modules,
names, state_dict keys, initialisation and forward as ``torchvision.models.mobilenet_v2``.

    mobilenet_v2(num_classes=1000, width_mult=1.0, **kw)          torchvision's: ReLU6
    mobilenet_v2_relu(num_classes=1000, width_mult=1.0, **kw)     the same with nn.ReLU

Every conv is followed by a BatchNorm2d; the inverted residual blocks are a 1x1 expansion
(Conv-BN-ReLU6), a 3x3 depthwise conv (``groups`` = its channels, Conv-BN-ReLU6) and a 1x1
projection (Conv-BN, no activation), added to the block's input where the shapes allow.
``numbafuse.torch.fuse`` fuses each Conv-BN (and each Conv-BN-ReLU of the ``_relu`` variant);
ReLU6 is no pattern of numbafuse's (the fused Conv-BN's output goes through ``nn.ReLU6``),
nor is the residual add without a ReLU after it. Imports torch only, so that benchmarks can
load it from its file for the PyTorch side without numbafuse (``benchmarks/bench_resnet.py``).
"""
import torch
from torch import nn


def _make_divisible(v, divisor, min_value=None):
    """torchvision's channel rounding: ``v`` to a multiple of ``divisor``, not below 90% of v."""
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class Conv2dNormActivation(nn.Sequential):
    """torchvision.ops.misc.Conv2dNormActivation as MobileNetV2 uses it: conv, batch norm,
    activation (modules "0", "1", "2")."""

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, groups=1,
                 activation_layer=nn.ReLU6):
        padding = (kernel_size - 1) // 2
        layers = [nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding,
                            groups=groups, bias=False), nn.BatchNorm2d(out_channels)]
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)
        self.out_channels = out_channels


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio, activation_layer=nn.ReLU6):
        super().__init__()
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = self.stride == 1 and inp == oup
        layers = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden_dim, kernel_size=1,
                                               activation_layer=activation_layer))
        layers.extend([
            Conv2dNormActivation(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim,
                                 activation_layer=activation_layer),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ])
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup
        self._is_cn = stride > 1

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=1000, width_mult=1.0, round_nearest=8, dropout=0.2,
                 activation_layer=nn.ReLU6):
        super().__init__()
        input_channel, last_channel = 32, 1280
        setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1],
                   [6, 160, 3, 2], [6, 320, 1, 1]]
        input_channel = _make_divisible(input_channel * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features = [Conv2dNormActivation(3, input_channel, stride=2,
                                         activation_layer=activation_layer)]
        for t, c, n, s in setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel,
                                                 s if i == 0 else 1, t, activation_layer))
                input_channel = output_channel
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1,
                                             activation_layer=activation_layer))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout),
                                        nn.Linear(self.last_channel, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes=1000, **kwargs):
    """torchvision's ``mobilenet_v2()`` (untrained)."""
    return MobileNetV2(num_classes, **kwargs)


def mobilenet_v2_relu(num_classes=1000, **kwargs):
    """MobileNetV2 with ``nn.ReLU`` for ReLU6: every Conv-BN-activation a fused op."""
    return MobileNetV2(num_classes, activation_layer=nn.ReLU, **kwargs)
