"""MobileNetV2 as torchvision builds it (`torchvision.models.mobilenet_v2`, width 1.0).

`features`: a 3x3/2 conv-BN-ReLU6 stem, seventeen `InvertedResidual` blocks
(1x1 expansion, 3x3 depthwise, linear 1x1 projection; residual when stride 1
and channels match) and a 1x1 conv-BN-ReLU6 to 1280 channels; then a global
average pool and `classifier` (dropout, linear). 3,504,872 parameters with 1000
classes. Any input of at least 1x1 runs.
"""

import equinox as eqx
import jax

from ._layers import (
    AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Dropout, FeaturesClassifier, Linear, ReLU6, sequential,
)

# expansion t, output channels c, repeats n, first stride s (MobileNetV2 paper, table 2)
_SETTINGS = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)


def _conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, *, key, name: str) -> tuple:
    """torchvision's `Conv2dNormActivation` with ReLU6: (conv, batch norm, ReLU6)."""
    conv = Conv2d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2, groups=groups,
                  bias=False, key=key, name=f"{name}.0")
    return conv, BatchNorm2d(cout, name=f"{name}.1"), ReLU6(name=f"{name}.2")


class InvertedResidual(eqx.Module):
    """Expand (1x1), filter (3x3 depthwise), project (1x1, no activation), maybe add the input."""

    conv: tuple
    use_res_connect: bool = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int, *, key: jax.Array, name: str):
        k1, k2, k3 = jax.random.split(key, 3)
        hidden = cin * expand_ratio
        layers = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(cin, hidden, 1, key=k1, name=f"{name}.conv.0"))
        i = len(layers)
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden, key=k2, name=f"{name}.conv.{i}"),
            Conv2d(hidden, cout, 1, bias=False, key=k3, name=f"{name}.conv.{i + 1}"),
            BatchNorm2d(cout, name=f"{name}.conv.{i + 2}"),
        ]
        self.conv = tuple(layers)
        self.use_res_connect = stride == 1 and cin == cout
        self.name = name

    def __call__(self, x: jax.Array) -> jax.Array:
        out = sequential(self.conv, x)
        if not self.use_res_connect:
            return out
        with jax.named_scope(self.name):
            return x + out


class MobileNetV2(FeaturesClassifier):
    """torchvision's MobileNetV2; input (N, 3, 224, 224)."""

    def __init__(self, key: jax.Array, *, num_classes: int = 1000):
        keys = iter(jax.random.split(key, 20))
        features = [_conv_bn_relu6(3, 32, 3, 2, key=next(keys), name="features.0")]
        cin = 32
        for t, c, n, s in _SETTINGS:
            for i in range(n):
                name = f"features.{len(features)}"
                features.append(InvertedResidual(cin, c, s if i == 0 else 1, t, key=next(keys), name=name))
                cin = c
        features.append(_conv_bn_relu6(cin, 1280, 1, key=next(keys), name=f"features.{len(features)}"))
        self.features = tuple(features)
        self.avgpool = AdaptiveAvgPool2d(1, name="avgpool")
        self.classifier = (
            Dropout(0.2, name="classifier.0"),
            Linear(1280, num_classes, key=next(keys), name="classifier.1"),
        )


__all__ = ["InvertedResidual", "MobileNetV2"]
