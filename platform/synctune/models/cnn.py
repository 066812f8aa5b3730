"""Image classifiers of the papers' benchmarks in plain PyTorch: VGG16, ResNet50/101, DenseNet121,
InceptionV3 (AutoDist §3.1, Appendix E), and a small CNN that trains in seconds on a CPU.

Layouts and widths follow the original papers (and match torchvision's parameter counts);
every model's ``forward(images, labels)`` returns the mean cross-entropy loss, so that the
engine, the spec extractor and the tests drive all zoo models the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["VGG16", "ResNet", "DenseNet121", "InceptionV3", "SmallCNN"]


class _Classifier(nn.Module):
    """Base: ``forward(images, labels) -> loss`` around ``logits(images)``."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """The class scores, ``(batch, num_classes)``, of the images ``x`` (``(batch, 3, H, W)``)."""
        raise NotImplementedError

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy loss of :meth:`logits` against ``labels`` (class indices)."""
        return F.cross_entropy(self.logits(images), labels)


class VGG16(_Classifier):
    """VGG-16 (configuration D, Simonyan & Zisserman 2015): 138,357,544 parameters at 1000 classes."""

    _CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in self._CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(_Classifier):
    """ResNet with bottleneck blocks (He et al. 2016): [3,4,6,3] is ResNet50 (25.6M), [3,4,23,3] ResNet101 (44.5M)."""

    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages = []
        in_ch = 64
        for i, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            stage = []
            for j in range(n):
                stage.append(_Bottleneck(in_ch, width, stride=2 if (j == 0 and i > 0) else 1))
                in_ch = width * _Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(in_ch, num_classes)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _DenseLayer(nn.Module):
    def __init__(self, in_ch: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_ch)
        self.conv1 = nn.Conv2d(in_ch, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(F.relu(self.norm1(x)))
        return torch.cat([x, self.conv2(F.relu(self.norm2(out)))], 1)


class DenseNet121(_Classifier):
    """DenseNet-121 (Huang et al. 2017), growth 32, blocks (6, 12, 24, 16): 7,978,856 parameters."""

    def __init__(self, num_classes: int = 1000, growth: int = 32, blocks=(6, 12, 24, 16), bn_size: int = 4) -> None:
        super().__init__()
        ch = 2 * growth
        layers: list[nn.Module] = [nn.Conv2d(3, ch, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(ch),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1)]
        for i, n in enumerate(blocks):
            for _ in range(n):
                layers.append(_DenseLayer(ch, growth, bn_size))
                ch += growth
            if i != len(blocks) - 1:
                layers += [nn.BatchNorm2d(ch), nn.ReLU(inplace=True), nn.Conv2d(ch, ch // 2, 1, bias=False),
                           nn.AvgPool2d(2, stride=2)]
                ch //= 2
        layers.append(nn.BatchNorm2d(ch))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(ch, num_classes)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.features(x))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _Conv(nn.Module):
    """Conv (no bias) + BatchNorm(eps=1e-3) + ReLU, the unit of Inception."""

    def __init__(self, in_ch: int, out_ch: int, kernel, stride=1, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_ch, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class _InceptionA(nn.Module):
    def __init__(self, in_ch: int, pool_features: int) -> None:
        super().__init__()
        self.b1 = _Conv(in_ch, 64, 1)
        self.b5_1, self.b5_2 = _Conv(in_ch, 48, 1), _Conv(48, 64, 5, padding=2)
        self.b3_1, self.b3_2, self.b3_3 = _Conv(in_ch, 64, 1), _Conv(64, 96, 3, padding=1), _Conv(96, 96, 3, padding=1)
        self.bp = _Conv(in_ch, pool_features, 1)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b5_2(self.b5_1(x)), self.b3_3(self.b3_2(self.b3_1(x))),
                          self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))], 1)


class _InceptionB(nn.Module):
    def __init__(self, in_ch: int) -> None:
        super().__init__()
        self.b3 = _Conv(in_ch, 384, 3, stride=2)
        self.bd_1, self.bd_2, self.bd_3 = _Conv(in_ch, 64, 1), _Conv(64, 96, 3, padding=1), _Conv(96, 96, 3, stride=2)

    def forward(self, x):
        return torch.cat([self.b3(x), self.bd_3(self.bd_2(self.bd_1(x))), F.max_pool2d(x, 3, stride=2)], 1)


class _InceptionC(nn.Module):
    def __init__(self, in_ch: int, c7: int) -> None:
        super().__init__()
        self.b1 = _Conv(in_ch, 192, 1)
        self.b7 = nn.Sequential(_Conv(in_ch, c7, 1), _Conv(c7, c7, (1, 7), padding=(0, 3)),
                                _Conv(c7, 192, (7, 1), padding=(3, 0)))
        self.bd = nn.Sequential(_Conv(in_ch, c7, 1), _Conv(c7, c7, (7, 1), padding=(3, 0)),
                                _Conv(c7, c7, (1, 7), padding=(0, 3)), _Conv(c7, c7, (7, 1), padding=(3, 0)),
                                _Conv(c7, 192, (1, 7), padding=(0, 3)))
        self.bp = _Conv(in_ch, 192, 1)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b7(x), self.bd(x), self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))], 1)


class _InceptionD(nn.Module):
    def __init__(self, in_ch: int) -> None:
        super().__init__()
        self.b3 = nn.Sequential(_Conv(in_ch, 192, 1), _Conv(192, 320, 3, stride=2))
        self.b7 = nn.Sequential(_Conv(in_ch, 192, 1), _Conv(192, 192, (1, 7), padding=(0, 3)),
                                _Conv(192, 192, (7, 1), padding=(3, 0)), _Conv(192, 192, 3, stride=2))

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, stride=2)], 1)


class _InceptionE(nn.Module):
    def __init__(self, in_ch: int) -> None:
        super().__init__()
        self.b1 = _Conv(in_ch, 320, 1)
        self.b3_1 = _Conv(in_ch, 384, 1)
        self.b3_2a, self.b3_2b = _Conv(384, 384, (1, 3), padding=(0, 1)), _Conv(384, 384, (3, 1), padding=(1, 0))
        self.bd_1, self.bd_2 = _Conv(in_ch, 448, 1), _Conv(448, 384, 3, padding=1)
        self.bd_3a, self.bd_3b = _Conv(384, 384, (1, 3), padding=(0, 1)), _Conv(384, 384, (3, 1), padding=(1, 0))
        self.bp = _Conv(in_ch, 192, 1)

    def forward(self, x):
        b3 = self.b3_1(x)
        bd = self.bd_2(self.bd_1(x))
        return torch.cat([self.b1(x), self.b3_2a(b3), self.b3_2b(b3), self.bd_3a(bd), self.bd_3b(bd),
                          self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))], 1)


class InceptionV3(_Classifier):
    """Inception-v3 (Szegedy et al. 2016) without the auxiliary head: 23.8M parameters, 299x299 input."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _Conv(3, 32, 3, stride=2), _Conv(32, 32, 3), _Conv(32, 64, 3, padding=1), nn.MaxPool2d(3, stride=2),
            _Conv(64, 80, 1), _Conv(80, 192, 3), nn.MaxPool2d(3, stride=2),
        )
        self.mixed = nn.Sequential(
            _InceptionA(192, 32), _InceptionA(256, 64), _InceptionA(288, 64), _InceptionB(288),
            _InceptionC(768, 128), _InceptionC(768, 160), _InceptionC(768, 160), _InceptionC(768, 192),
            _InceptionD(768), _InceptionE(1280), _InceptionE(2048),
        )
        self.fc = nn.Linear(2048, num_classes)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mixed(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class SmallCNN(_Classifier):
    """A 4-layer CNN for 32x32 images (~25k parameters). GroupNorm, not BatchNorm, so that a
    sample's gradient does not depend on its batch mates: data-parallel training is then
    exactly single-process training on the concatenated batch, which the engine tests rely on."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(4, 32)
        self.conv3 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.fc = nn.Linear(64, num_classes)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(self.conv2(x)))
        x = F.relu(self.conv3(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
