"""GoogLeNet as torchvision builds it (`torchvision.models.googlenet`), without aux heads.

Stem (7x7/2, max pool, 1x1, 3x3, max pool), nine `Inception` blocks with max
pools after 3b and 4e, global average pool, dropout and `fc`. Every conv is a
`BasicConv2d` (conv without bias, batch norm with eps 0.001, ReLU); max pools
use `ceil_mode=True`. As in torchvision, the "5x5" branch uses a 3x3 kernel and
`transform_input` is off. 6,624,904 parameters with 1000 classes. The smallest
input is 31x31.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

from ._layers import AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Dropout, Linear, MaxPool2d, ReLU, flatten, sequential


class BasicConv2d(eqx.Module):
    """Conv (no bias), batch norm (eps 0.001), ReLU."""

    conv: Conv2d
    bn: BatchNorm2d
    relu: ReLU

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0, *, key, name: str):
        self.conv = Conv2d(
            cin, cout, kernel, stride=stride, padding=padding, bias=False, key=key, name=f"{name}.conv"
        )
        self.bn = BatchNorm2d(cout, eps=0.001, name=f"{name}.bn")
        self.relu = ReLU(name=f"{name}.relu")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.relu(self.bn(self.conv(x)))


class Inception(eqx.Module):
    """Four branches (1x1; 1x1 -> 3x3; 1x1 -> 3x3; 3x3 max pool -> 1x1) concatenated on channels."""

    branch1: BasicConv2d
    branch2: tuple[BasicConv2d, BasicConv2d]
    branch3: tuple[BasicConv2d, BasicConv2d]
    branch4: tuple[MaxPool2d, BasicConv2d]
    name: str = eqx.field(static=True)

    def __init__(self, cin: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int,
                 pool_proj: int, *, key: jax.Array, name: str):
        k = iter(jax.random.split(key, 6))
        self.branch1 = BasicConv2d(cin, ch1x1, 1, key=next(k), name=f"{name}.branch1")
        self.branch2 = (BasicConv2d(cin, ch3x3red, 1, key=next(k), name=f"{name}.branch2.0"),
                        BasicConv2d(ch3x3red, ch3x3, 3, padding=1, key=next(k), name=f"{name}.branch2.1"))
        self.branch3 = (BasicConv2d(cin, ch5x5red, 1, key=next(k), name=f"{name}.branch3.0"),
                        BasicConv2d(ch5x5red, ch5x5, 3, padding=1, key=next(k), name=f"{name}.branch3.1"))
        self.branch4 = (MaxPool2d(3, 1, 1, ceil_mode=True, name=f"{name}.branch4.0"),
                        BasicConv2d(cin, pool_proj, 1, key=next(k), name=f"{name}.branch4.1"))
        self.name = name

    def __call__(self, x: jax.Array) -> jax.Array:
        outs = [self.branch1(x), *(sequential(b, x) for b in (self.branch2, self.branch3, self.branch4))]
        with jax.named_scope(self.name):
            return jnp.concatenate(outs, axis=1)


# name: in, 1x1, 3x3 reduce, 3x3, "5x5" reduce, "5x5", pool projection
_INCEPTIONS = {
    "inception3a": (192, 64, 96, 128, 16, 32, 32), "inception3b": (256, 128, 128, 192, 32, 96, 64),
    "inception4a": (480, 192, 96, 208, 16, 48, 64), "inception4b": (512, 160, 112, 224, 24, 64, 64),
    "inception4c": (512, 128, 128, 256, 24, 64, 64), "inception4d": (512, 112, 144, 288, 32, 64, 64),
    "inception4e": (528, 256, 160, 320, 32, 128, 128), "inception5a": (832, 256, 160, 320, 32, 128, 128),
    "inception5b": (832, 384, 192, 384, 48, 128, 128),
}


class GoogLeNet(eqx.Module):
    """torchvision's GoogLeNet (`aux_logits=False`, `transform_input=False`); input (N, 3, 224, 224)."""

    conv1: BasicConv2d
    maxpool1: MaxPool2d
    conv2: BasicConv2d
    conv3: BasicConv2d
    maxpool2: MaxPool2d
    inception3a: Inception
    inception3b: Inception
    maxpool3: MaxPool2d
    inception4a: Inception
    inception4b: Inception
    inception4c: Inception
    inception4d: Inception
    inception4e: Inception
    maxpool4: MaxPool2d
    inception5a: Inception
    inception5b: Inception
    avgpool: AdaptiveAvgPool2d
    dropout: Dropout
    fc: Linear

    def __init__(self, key: jax.Array, *, num_classes: int = 1000):
        k = iter(jax.random.split(key, 4 + len(_INCEPTIONS)))
        self.conv1 = BasicConv2d(3, 64, 7, stride=2, padding=3, key=next(k), name="conv1")
        self.maxpool1 = MaxPool2d(3, 2, ceil_mode=True, name="maxpool1")
        self.conv2 = BasicConv2d(64, 64, 1, key=next(k), name="conv2")
        self.conv3 = BasicConv2d(64, 192, 3, padding=1, key=next(k), name="conv3")
        self.maxpool2 = MaxPool2d(3, 2, ceil_mode=True, name="maxpool2")
        for name, channels in _INCEPTIONS.items():
            setattr(self, name, Inception(*channels, key=next(k), name=name))
        self.maxpool3 = MaxPool2d(3, 2, ceil_mode=True, name="maxpool3")
        self.maxpool4 = MaxPool2d(2, 2, ceil_mode=True, name="maxpool4")
        self.avgpool = AdaptiveAvgPool2d(1, name="avgpool")
        self.dropout = Dropout(0.2, name="dropout")
        self.fc = Linear(1024, num_classes, key=next(k), name="fc")

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.maxpool2(self.conv3(self.conv2(self.maxpool1(self.conv1(x)))))
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        for block in (self.inception4a, self.inception4b, self.inception4c, self.inception4d, self.inception4e):
            x = block(x)
        x = self.inception5b(self.inception5a(self.maxpool4(x)))
        return self.fc(self.dropout(flatten(self.avgpool(x))))


__all__ = ["BasicConv2d", "Inception", "GoogLeNet"]
