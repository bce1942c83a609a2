"""torchvision's ResNets, written here in plain ``torch.nn`` (torchvision is not a dependency):
the same classes, module names, ``state_dict`` keys, initialisation and forward code, so a
torchvision checkpoint loads as it is and :func:`numbafuse.torch.fuse` sees the code a user
has. (torchvision's dilation and ``norm_layer`` options are left out; ``width`` and any number
of stages are added, for small test models.)

    resnet18(num_classes=1000, **kw)          ResNet(BasicBlock, [2, 2, 2, 2])
    resnet50(num_classes=1000, **kw)          ResNet(Bottleneck, [3, 4, 6, 3])
    resnext50_32x4d(num_classes=1000, **kw)   ResNet(Bottleneck, [3, 4, 6, 3], groups=32,
                                                     width_per_group=4)
    ResNet(block, layers, num_classes=1000, zero_init_residual=False, groups=1,
           width_per_group=64, width=64)

``groups`` and ``width_per_group`` are torchvision's (ResNeXt): each Bottleneck's 3x3 conv is
grouped, ``int(planes * width_per_group / 64) * groups`` channels wide.

``width`` is the stem's channels (torchvision: 64); stage i has ``width * 2**i`` planes. With
``width=64`` and four stages the keys are torchvision's (``conv1.weight``, ``bn1.running_mean``,
``layer1.0.conv1.weight``, ``layer2.0.downsample.0.weight``, ``layer2.0.downsample.1.weight``,
..., ``fc.weight``).
"""
from __future__ import annotations

import torch
from torch import nn


def conv3x3(in_planes, out_planes, stride=1, groups=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1,
                     groups=groups, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock only supports groups=1 and base_width=64")
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)

        if self.downsample is not None:
            identity = self.downsample(x)

        out += identity
        out = self.relu(out)

        return out


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride, groups)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)

        out = self.conv3(out)
        out = self.bn3(out)

        if self.downsample is not None:
            identity = self.downsample(x)

        out += identity
        out = self.relu(out)

        return out


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000, zero_init_residual=False, groups=1,
                 width_per_group=64, width=64):
        super().__init__()
        self.inplanes = width
        self.groups, self.base_width = groups, width_per_group
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        for i, blocks in enumerate(layers):            # layer1, layer2, ...
            setattr(self, f"layer{i + 1}",
                    self._make_layer(block, width * 2 ** i, blocks, stride=1 if i == 0 else 2))
        self.num_layers = len(layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 2 ** (len(layers) - 1) * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.groups,
                        self.base_width)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes, groups=self.groups,
                                base_width=self.base_width))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)

        for i in range(self.num_layers):
            x = getattr(self, f"layer{i + 1}")(x)

        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)

        return x


def resnet18(num_classes=1000, **kwargs):
    """torchvision's ``resnet18()`` (untrained)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, **kwargs)


def resnet50(num_classes=1000, **kwargs):
    """torchvision's ``resnet50()`` (untrained)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, **kwargs)


def resnext50_32x4d(num_classes=1000, **kwargs):
    """torchvision's ``resnext50_32x4d()`` (untrained): grouped 3x3 convs, 32 groups."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, groups=32, width_per_group=4,
                  **kwargs)
