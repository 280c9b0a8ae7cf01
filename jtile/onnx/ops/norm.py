"""Normalisation and inference-time regularisers: BatchNormalization, LayerNormalization,
GroupNormalization, InstanceNormalization, LRN, Dropout.

BatchNormalization also implements `training_mode=1` (batch statistics and
updated running stats, as the ONNX reference). Layer and group statistics are
computed in float32 (`stash_type=1`) whatever the input dtype. Dropout is the identity at
inference; training-mode dropout with a non-zero ratio is random and raises.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

from ... import _fused
from ..._regions import centered
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
    pads = ((0, 0), centered(size)) + ((0, 0),) * (rank - 2)
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


def _stash(node, x):
    """`x` in the dtype the statistics are computed in (`stash_type`, default float32)."""
    stash = node.attr("stash_type", 1)
    return x.astype(jnp.float32) if stash == 1 and x.dtype != jnp.float32 else x


@register("LayerNormalization", since=17)
def layer_norm(node, x, scale, bias=None):
    rank = np.ndim(x)
    axis = node.axis(node.attr("axis", -1), rank)
    axes = tuple(range(axis, rank))
    if node.n_outputs <= 1 and jnp.result_type(x, scale, *([] if bias is None else [bias])) == jnp.float32:
        zero = np.zeros((), np.float32)
        return _fused.layer_norm(x, scale, zero if bias is None else bias, axes=axes,
                                 epsilon=node.attr("epsilon", 1e-5))
    z = _stash(node, jnp.asarray(x))
    mean = jnp.mean(z, axis=axes, keepdims=True)
    centred = z - mean
    inv_std = lax.rsqrt(jnp.mean(centred * centred, axis=axes, keepdims=True) + node.attr("epsilon", 1e-5))
    y = (centred * inv_std).astype(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return (y, mean, inv_std)[: max(node.n_outputs, 1)]


@register("GroupNormalization", since=21)  # GroupNormalization-18 (per-group scale) is deprecated
def group_norm(node, x, scale, bias):
    groups = node.attr("num_groups")
    n, c, *spatial = np.shape(x)
    if not isinstance(groups, int) or groups < 1 or c % groups:
        raise node.fail(f"num_groups {groups!r} must be a positive divisor of the {c} channels")
    if np.shape(scale) != (c,) or np.shape(bias) != (c,):
        raise node.fail(f"scale {np.shape(scale)} and bias {np.shape(bias)} should have shape ({c},)")
    z = _stash(node, jnp.asarray(x)).reshape(n, groups, -1)
    mean = jnp.mean(z, axis=2, keepdims=True)
    var = jnp.mean(jnp.square(z - mean), axis=2, keepdims=True)
    y = ((z - mean) * lax.rsqrt(var + node.attr("epsilon", 1e-5))).astype(x.dtype).reshape(np.shape(x))
    return y * _per_channel(scale, np.ndim(x)) + _per_channel(bias, np.ndim(x))


@register("InstanceNormalization", since=6)
def instance_norm(node, x, scale, bias):
    axes = tuple(range(2, np.ndim(x)))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) * lax.rsqrt(var + np.asarray(node.attr("epsilon", 1e-5), x.dtype))
    return y * _per_channel(scale, np.ndim(x)) + _per_channel(bias, np.ndim(x))


__all__ = ["batch_norm", "lrn", "dropout", "layer_norm", "group_norm", "instance_norm"]
