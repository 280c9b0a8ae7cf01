"""The ConvNet of ai3's README example (`example/manual_conv2d.py`).

`conv1 (3->16, 3x3, pad 1) -> relu -> maxpool (2x2, stride 2) -> conv2 (16->32,
3x3, pad 1) -> relu -> flatten`, run by ai3 on a 10x3x224x224 input; there is no
linear layer, so the output is (N, 32 * (H/2) * (W/2)). ai3's README swaps its
two convolutions with a per-layer selector list such as `["direct", "smm"]`.

Source: https://github.com/KLab-AI3/ai3 (README, example/manual_conv2d.py)
"""

import equinox as eqx
import jax

from ._layers import Conv2d, MaxPool2d, ReLU, flatten


class AI3ConvNet(eqx.Module):
    """ai3's README ConvNet: two 3x3 convs around a 2x2 max pool; input (N, 3, 224, 224)."""

    conv1: Conv2d
    maxpool: MaxPool2d
    conv2: Conv2d
    relu: ReLU

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.conv1 = Conv2d(3, 16, 3, padding=1, key=k1, name="conv1")
        self.maxpool = MaxPool2d(2, 2, name="maxpool")
        self.conv2 = Conv2d(16, 32, 3, padding=1, key=k2, name="conv2")
        self.relu = ReLU(name="relu")

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.maxpool(self.relu(self.conv1(x)))
        return flatten(self.relu(self.conv2(x)))


__all__ = ["AI3ConvNet"]
