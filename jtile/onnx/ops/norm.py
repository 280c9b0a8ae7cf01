"""Normalisation and inference-time regularisers: BatchNormalization, LRN, Dropout.

BatchNormalization also implements `training_mode=1` (batch statistics and
updated running stats, as the ONNX reference). Dropout is the identity at
inference; training-mode dropout with a non-zero ratio is random and raises.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import register


def _per_channel(v, rank):
    return jnp.reshape(v, (-1,) + (1,) * (rank - 2))


@register("BatchNormalization", since=6)
def batch_norm(node, x, scale, bias, mean, var):
    if node.schema < 7 and not node.attr("is_test", 0):
        raise node.unsupported("is_test=0 (training statistics of BatchNormalization-6) is not supported")
    if node.schema < 9 and node.attr("spatial", 1) != 1:
        raise node.unsupported("spatial=0 (per-activation statistics) is not supported")
    eps = np.asarray(node.attr("epsilon", 1e-5), x.dtype)
    rank = np.ndim(x)
    if node.attr("training_mode", 0):
        axes = tuple(i for i in range(rank) if i != 1)
        momentum = np.asarray(node.attr("momentum", 0.9), x.dtype)
        batch_mean, batch_var = jnp.mean(x, axis=axes), jnp.var(x, axis=axes)
        y = _normalise(x, scale, bias, batch_mean, batch_var, eps)
        running = (mean * momentum + batch_mean * (1 - momentum), var * momentum + batch_var * (1 - momentum))
        return (y, *running)[: node.n_outputs]
    return _normalise(x, scale, bias, mean, var, eps)


def _normalise(x, scale, bias, mean, var, eps):
    rank = np.ndim(x)
    inv = _per_channel(scale / jnp.sqrt(var + eps), rank)
    return ((x - _per_channel(mean, rank)) * inv + _per_channel(bias, rank)).astype(x.dtype)


@register("LRN", since=1)
def lrn(node, x):
    size = node.attr("size")
    if not isinstance(size, int) or size < 1:
        raise node.fail(f"size must be a positive int, got {size!r}")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    rank = np.ndim(x)
    window = (1, size) + (1,) * (rank - 2)
    pads = ((0, 0), ((size - 1) // 2, size // 2)) + ((0, 0),) * (rank - 2)
    square_sum = lax.reduce_window(x * x, np.zeros((), x.dtype), lax.add, window, (1,) * rank, pads)
    scale = np.asarray(bias, x.dtype) + np.asarray(alpha / size, x.dtype) * square_sum
    return x / scale ** np.asarray(beta, x.dtype)


@register("Dropout", since=1, static=(1, 2))
def dropout(node, x, ratio=None, training_mode=None):
    training = bool(node.static(training_mode, "training_mode").item()) if training_mode is not None else False
    if node.schema < 7 and not node.attr("is_test", 0):
        training = True
    rate = float(node.static(ratio, "ratio").item()) if ratio is not None else node.attr("ratio", 0.5)
    if training and rate != 0.0:
        raise node.unsupported("training-mode dropout is random; only inference (or ratio 0) is supported")
    if node.n_outputs == 1:
        return x
    return x, jnp.ones(np.shape(x), bool)


__all__ = ["batch_norm", "lrn", "dropout"]
