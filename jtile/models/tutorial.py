"""The four-layer network of Aidge's horizontal-tiling tutorial.

`LeakyReLU(1) -> Conv2D(3, 32, 3x3) -> BatchNorm2D(32) -> ReLU` on a
4x3x66x66 input, with the tutorial's layer names (`leakyrelu0`, `conv0`, `bn0`,
`relu0`). Aidge's `Conv2D` has no padding, so 66x66 becomes 64x64 and the output
is 4x32x64x64, which splits evenly into 2, 4, 8 or 16 stripes. `padding=1`
gives the padded variant (66x66 out), whose edge tiles keep their own padding.
A negative slope of 1 makes the LeakyReLU the identity, as in the tutorial.

Source: https://eclipse.dev/aidge/source/Tutorial/tiling.html
"""

import equinox as eqx
import jax

from ._layers import BatchNorm2d, Conv2d, LeakyReLU, ReLU


class Tutorial(eqx.Module):
    """Aidge's tiling-tutorial network; input (4, 3, 66, 66)."""

    leakyrelu0: LeakyReLU
    conv0: Conv2d
    bn0: BatchNorm2d
    relu0: ReLU

    def __init__(self, key: jax.Array, *, padding: int = 0, negative_slope: float = 1.0):
        self.leakyrelu0 = LeakyReLU(negative_slope, name="leakyrelu0")
        self.conv0 = Conv2d(3, 32, 3, padding=padding, key=key, name="conv0")
        self.bn0 = BatchNorm2d(32, name="bn0")
        self.relu0 = ReLU(name="relu0")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.relu0(self.bn0(self.conv0(self.leakyrelu0(x))))


__all__ = ["Tutorial"]
