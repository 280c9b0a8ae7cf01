"""Activations: Relu, LeakyRelu, PRelu, Clip, Sigmoid, HardSigmoid, HardSwish, Softmax, LogSoftmax,
Gelu, Elu, Selu, Celu, Softplus, Softsign, Mish, ThresholdedRelu.

Softmax and LogSoftmax before opset 13 normalise over all axes from `axis` on
(the old "coerce to 2-D" rule); from 13 on over `axis` alone.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ... import _fused
from . import register, xp


@register("Relu", since=6)
def relu(node, x):
    return xp(x).maximum(x, np.zeros((), x.dtype))


@register("LeakyRelu", since=6)
def leaky_relu(node, x):
    alpha = np.asarray(node.attr("alpha", 0.01), x.dtype)
    return xp(x).where(x >= 0, x, x * alpha)


@register("PRelu", since=1)
def prelu(node, x, slope):
    if node.schema < 7 and np.ndim(slope) == 1 and np.ndim(x) > 1 and np.size(slope) == np.shape(x)[1]:
        slope = xp(slope).reshape(slope, (-1,) + (1,) * (np.ndim(x) - 2))  # per channel before opset 7
    return xp(x, slope).where(x >= 0, x, x * slope)


@register("Clip", since=6)
def clip(node, x, lo=None, hi=None):
    if node.schema < 11:
        lo, hi = node.attr("min"), node.attr("max")
    m = xp(x, lo, hi)
    if lo is not None:
        x = m.maximum(x, m.asarray(lo, dtype=x.dtype))
    if hi is not None:
        x = m.minimum(x, m.asarray(hi, dtype=x.dtype))
    return x


@register("Sigmoid", since=6)
def sigmoid(node, x):
    return jax.nn.sigmoid(x)


@register("HardSigmoid", since=6)
def hard_sigmoid(node, x):
    alpha, beta = node.attr("alpha", 0.2), node.attr("beta", 0.5)
    return jnp.clip(x * np.asarray(alpha, x.dtype) + np.asarray(beta, x.dtype), 0, 1).astype(x.dtype)


@register("HardSwish", since=14)
def hard_swish(node, x):
    return x * jnp.clip(x * np.asarray(1 / 6, x.dtype) + np.asarray(0.5, x.dtype), 0, 1).astype(x.dtype)


def _softmax_axes(node, x) -> tuple[int, ...]:
    rank = np.ndim(x)
    if node.schema < 13:
        return tuple(range(node.axis(node.attr("axis", 1), rank), rank))
    return (node.axis(node.attr("axis", -1), rank),)


@register("Softmax", since=1)
def softmax(node, x):
    """jtile's fused `softmax` (`jtile._fused.softmax_p`), which a swap runs on a kernel."""
    return _fused.softmax(x, axes=_softmax_axes(node, x))


@register("LogSoftmax", since=1)
def log_softmax(node, x):
    z = _fused.shift_by_max(x, _softmax_axes(node, x))
    return z - jnp.log(jnp.sum(jnp.exp(z), axis=_softmax_axes(node, x), keepdims=True))


@register("Gelu", since=20)
def gelu(node, x):
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise node.fail(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@register("Elu", since=6)
def elu(node, x):
    alpha = np.asarray(node.attr("alpha", 1.0), x.dtype)
    return jnp.where(x > 0, x, alpha * jnp.expm1(x))


@register("Selu", since=6)
def selu(node, x):
    alpha = np.asarray(node.attr("alpha", 1.67326319217681884765625), x.dtype)
    gamma = np.asarray(node.attr("gamma", 1.05070102214813232421875), x.dtype)
    return gamma * jnp.where(x > 0, x, alpha * jnp.expm1(x))


@register("Celu", since=12)
def celu(node, x):
    alpha = np.asarray(node.attr("alpha", 1.0), x.dtype)
    return jnp.maximum(x, 0) + jnp.minimum(0, alpha * jnp.expm1(x / alpha))


@register("Softplus", since=1)
def softplus(node, x):
    return jax.nn.softplus(x)


@register("Softsign", since=1)
def softsign(node, x):
    return x / (1 + jnp.abs(x))


@register("Mish", since=18)
def mish(node, x):
    return x * jnp.tanh(jax.nn.softplus(x))


@register("ThresholdedRelu", since=10)
def thresholded_relu(node, x):
    return jnp.where(x > np.asarray(node.attr("alpha", 1.0), x.dtype), x, jnp.zeros((), x.dtype))


__all__ = [
    "relu", "leaky_relu", "prelu", "clip", "sigmoid", "hard_sigmoid", "hard_swish", "softmax",
    "log_softmax", "gelu", "elu", "selu", "celu", "softplus", "softsign", "mish",
    "thresholded_relu",
]
