"""ResNet-18 as torchvision builds it (`torchvision.models.resnet18`).

Stem (7x7/2 conv, batch norm, ReLU, 3x3/2 max pool), four stages of two
`BasicBlock`s (64, 128, 256, 512 channels; stages 2-4 start with stride 2 and a
1x1 conv + batch norm `downsample`), global average pool and `fc`.
11,689,512 parameters with 1000 classes. Any input of at least 1x1 runs.
"""

import equinox as eqx
import jax

from ._layers import AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Linear, MaxPool2d, ReLU, flatten


class BasicBlock(eqx.Module):
    """Two 3x3 conv + batch norm layers and a residual connection."""

    conv1: Conv2d
    bn1: BatchNorm2d
    relu: ReLU
    conv2: Conv2d
    bn2: BatchNorm2d
    downsample: tuple[Conv2d, BatchNorm2d] | None
    name: str = eqx.field(static=True)

    def __init__(self, cin: int, cout: int, stride: int, *, key: jax.Array, name: str):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False, key=k1, name=f"{name}.conv1")
        self.bn1 = BatchNorm2d(cout, name=f"{name}.bn1")
        self.relu = ReLU(name=f"{name}.relu")
        self.conv2 = Conv2d(cout, cout, 3, padding=1, bias=False, key=k2, name=f"{name}.conv2")
        self.bn2 = BatchNorm2d(cout, name=f"{name}.bn2")
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = (
                Conv2d(cin, cout, 1, stride=stride, bias=False, key=k3, name=f"{name}.downsample.0"),
                BatchNorm2d(cout, name=f"{name}.downsample.1"),
            )
        self.name = name

    def __call__(self, x: jax.Array) -> jax.Array:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        if self.downsample is not None:
            conv, bn = self.downsample
            x = bn(conv(x))
        with jax.named_scope(self.name):
            out = out + x
        return self.relu(out)


class ResNet18(eqx.Module):
    """torchvision's ResNet-18; input (N, 3, 224, 224)."""

    conv1: Conv2d
    bn1: BatchNorm2d
    relu: ReLU
    maxpool: MaxPool2d
    layer1: tuple[BasicBlock, BasicBlock]
    layer2: tuple[BasicBlock, BasicBlock]
    layer3: tuple[BasicBlock, BasicBlock]
    layer4: tuple[BasicBlock, BasicBlock]
    avgpool: AdaptiveAvgPool2d
    fc: Linear

    def __init__(self, key: jax.Array, *, num_classes: int = 1000):
        keys = iter(jax.random.split(key, 10))
        self.conv1 = Conv2d(3, 64, 7, stride=2, padding=3, bias=False, key=next(keys), name="conv1")
        self.bn1 = BatchNorm2d(64, name="bn1")
        self.relu = ReLU(name="relu")
        self.maxpool = MaxPool2d(3, 2, 1, name="maxpool")
        stages, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512), start=1):
            stride = 1 if i == 1 else 2
            stages.append((
                BasicBlock(cin, cout, stride, key=next(keys), name=f"layer{i}.0"),
                BasicBlock(cout, cout, 1, key=next(keys), name=f"layer{i}.1"),
            ))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = AdaptiveAvgPool2d(1, name="avgpool")
        self.fc = Linear(512, num_classes, key=next(keys), name="fc")

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for block in (*self.layer1, *self.layer2, *self.layer3, *self.layer4):
            x = block(x)
        return self.fc(flatten(self.avgpool(x)))


__all__ = ["BasicBlock", "ResNet18"]
