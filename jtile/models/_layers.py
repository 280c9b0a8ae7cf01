"""The layers the model zoo is built from, in plain `jax.lax` / `jnp` ops.

Every layer is an equinox module with torch's weight layout (conv weights OIHW,
linear weights `(out, in)`), takes NCHW float32 input, and runs inside
`jax.named_scope(layer.name)`, so jaxpr equations carry torchvision-style names
such as `"features.0"` or `"layer1.0.conv1"`. Batch norm is inference-mode only:
its running statistics are `Buffer`s, which parameter counts leave out (as torch
counts buffers apart from parameters).

Weights are drawn on the host by numpy's generator seeded with the key's data:
`jax.random` compiles one kernel per weight shape (about a second each here),
which made building GoogLeNet take half a minute; numpy compiles nothing. Under
`jax.jit` or `jax.eval_shape` the same draw runs as a `jax.pure_callback`, so a
key gives the same weights eagerly and traced.

!!! warning

    Inference only: `Dropout` is the identity and `BatchNorm2d` never updates
    its statistics. Pooling `ceil_mode` exists for max pooling only.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._errors import ConfigError
from .._interpreter import is_known
from .._regions import SlidingWindow, adaptive

_NCHW = ("NCHW", "OIHW", "NCHW")


class Buffer(eqx.Module):
    """A non-trainable array (torch's `register_buffer`), e.g. batch-norm running stats."""

    value: jax.Array


def _host_draw(key_data, shape: tuple[int, ...], scale: float, uniform: bool) -> np.ndarray:
    rng = np.random.default_rng(np.asarray(key_data))
    if uniform:
        return rng.random(shape, np.float32) * np.float32(2 * scale) - np.float32(scale)
    return rng.standard_normal(shape, np.float32) * np.float32(scale)


def _draw(key: jax.Array, shape: tuple[int, ...], scale: float, *, uniform: bool = False) -> jax.Array:
    """`scale` times N(0, 1) (or U(-1, 1)) float32 samples, a function of `key` only."""
    data = jax.random.key_data(key)
    draw = functools.partial(_host_draw, shape=shape, scale=scale, uniform=uniform)
    if not is_known(data):
        out = jax.ShapeDtypeStruct(shape, jnp.float32)
        return jax.pure_callback(draw, out, data, vmap_method="sequential")
    return jnp.asarray(draw(data))


def _const(value: float, n: int) -> jax.Array:
    return jnp.asarray(np.full((n,), value, np.float32))


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _scoped(call):
    """Run a layer's `__call__` inside `jax.named_scope(self.name)`."""

    @functools.wraps(call)
    def scoped_call(self, x):
        with jax.named_scope(self.name):
            return call(self, x)

    return scoped_call


def _check_nchw(name: str, x, channels: int | None = None) -> None:
    if x.ndim != 4:
        raise ConfigError(f"{name}: expected NCHW input of rank 4, got shape {x.shape}")
    if channels is not None and x.shape[1] != channels:
        raise ConfigError(
            f"{name}: expected {channels} input channels, got shape {x.shape}; "
            "check the input shape (see jtile.models.input_shape)"
        )


def _window_out(
    name: str, size: int, kernel: int, stride: int, lo: int, hi: int, dilation: int = 1
) -> int:
    """Output length of a sliding window, or `ConfigError` when the input is too small."""
    window = SlidingWindow(size, kernel, stride, lo, hi, dilation)
    if window.out_size < 1:
        raise ConfigError(
            f"{name}: spatial size {size} (padded {size + lo + hi}) is smaller than the "
            f"window {window.span}; use a larger input size"
        )
    return window.out_size


class Conv2d(eqx.Module):
    """`torch.nn.Conv2d`: He-normal (fan-in) weights, zero bias."""

    weight: jax.Array
    bias: jax.Array | None
    stride: tuple[int, int] = eqx.field(static=True)
    padding: tuple[int, int] = eqx.field(static=True)
    dilation: tuple[int, int] = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size, *, stride=1, padding=0,
        dilation=1, groups: int = 1, bias: bool = True, key, name: str,
    ):
        kh, kw = _pair(kernel_size)
        fan_in = in_channels // groups * kh * kw
        shape = (out_channels, in_channels // groups, kh, kw)
        self.weight = _draw(key, shape, math.sqrt(2.0 / fan_in))
        self.bias = _const(0.0, out_channels) if bias else None
        self.stride, self.padding, self.dilation = _pair(stride), _pair(padding), _pair(dilation)
        self.groups, self.name = groups, name

    @_scoped
    def __call__(self, x):
        _check_nchw(self.name, x, self.weight.shape[1] * self.groups)
        for size, k, d, p in zip(x.shape[2:], self.weight.shape[2:], self.dilation, self.padding):
            _window_out(self.name, size, k, 1, p, p, d)
        y = lax.conv_general_dilated(
            x, self.weight, self.stride, [(p, p) for p in self.padding],
            rhs_dilation=self.dilation, dimension_numbers=_NCHW,
            feature_group_count=self.groups,
        )
        return y if self.bias is None else y + self.bias.reshape(1, -1, 1, 1)


class BatchNorm2d(eqx.Module):
    """`torch.nn.BatchNorm2d` in eval mode: `(x - mean) / sqrt(var + eps) * weight + bias`."""

    weight: jax.Array
    bias: jax.Array
    running_mean: Buffer
    running_var: Buffer
    eps: float = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(self, num_features: int, *, eps: float = 1e-5, name: str):
        self.weight, self.bias = _const(1.0, num_features), _const(0.0, num_features)
        self.running_mean = Buffer(_const(0.0, num_features))
        self.running_var = Buffer(_const(1.0, num_features))
        self.eps, self.name = eps, name

    @_scoped
    def __call__(self, x):
        _check_nchw(self.name, x, self.weight.shape[0])
        scale = self.weight * lax.rsqrt(self.running_var.value + self.eps)
        shift = self.bias - self.running_mean.value * scale
        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


class Linear(eqx.Module):
    """`torch.nn.Linear`, weight `(out, in)`; torch's default U(±1/sqrt(in)) init."""

    weight: jax.Array
    bias: jax.Array
    name: str = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, *, key, name: str):
        wkey, bkey = jax.random.split(key)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = _draw(wkey, (out_features, in_features), bound, uniform=True)
        self.bias = _draw(bkey, (out_features,), bound, uniform=True)
        self.name = name

    @_scoped
    def __call__(self, x):
        if x.ndim != 2 or x.shape[1] != self.weight.shape[1]:
            raise ConfigError(
                f"{self.name}: expected input of shape (batch, {self.weight.shape[1]}), "
                f"got {x.shape}; check the input size (see jtile.models.input_shape)"
            )
        return x @ self.weight.T + self.bias


def _pool(x, init, op, kernel, stride, padding):
    return lax.reduce_window(
        x, init, op, (1, 1, *kernel), (1, 1, *stride), ((0, 0), (0, 0), *padding)
    )


class MaxPool2d(eqx.Module):
    """`torch.nn.MaxPool2d`, including `ceil_mode` (padding counts as -inf)."""

    kernel_size: tuple[int, int] = eqx.field(static=True)
    stride: tuple[int, int] = eqx.field(static=True)
    padding: tuple[int, int] = eqx.field(static=True)
    ceil_mode: bool = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, *, name: str):
        self.kernel_size = _pair(kernel_size)
        self.stride = self.kernel_size if stride is None else _pair(stride)
        self.padding, self.ceil_mode, self.name = _pair(padding), ceil_mode, name

    def _pads(self, size: int, k: int, s: int, p: int) -> tuple[int, int]:
        _window_out(self.name, size, k, s, p, p)
        window = SlidingWindow(size, k, s, p, p)
        window = window.ceil_mode() if self.ceil_mode else window
        return window.pad_lo, window.pad_hi

    @_scoped
    def __call__(self, x):
        _check_nchw(self.name, x)
        pads = [self._pads(*a) for a in zip(x.shape[2:], self.kernel_size, self.stride, self.padding)]
        return _pool(x, -jnp.inf, lax.max, self.kernel_size, self.stride, pads)


def _avg_pool(x, kernel, stride, padding):
    """Average over each window, padding counted as zeros (torch's `count_include_pad`)."""
    return _pool(x, 0.0, lax.add, kernel, stride, padding) / (kernel[0] * kernel[1])


class AvgPool2d(eqx.Module):
    """`torch.nn.AvgPool2d` with `count_include_pad=True` and `ceil_mode=False`."""

    kernel_size: tuple[int, int] = eqx.field(static=True)
    stride: tuple[int, int] = eqx.field(static=True)
    padding: tuple[int, int] = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(self, kernel_size, stride=None, padding=0, *, name: str):
        self.kernel_size = _pair(kernel_size)
        self.stride = self.kernel_size if stride is None else _pair(stride)
        self.padding, self.name = _pair(padding), name

    @_scoped
    def __call__(self, x):
        _check_nchw(self.name, x)
        for size, k, p in zip(x.shape[2:], self.kernel_size, self.padding):
            _window_out(self.name, size, k, 1, p, p)
        return _avg_pool(x, self.kernel_size, self.stride, [(p, p) for p in self.padding])


def _adaptive_mean(x, axis: int, out: int):
    """torch's adaptive average along `axis` (windows from `_regions.adaptive`)."""
    windows = adaptive(x.shape[axis], out)
    parts = [jnp.mean(lax.slice_in_dim(x, w.start, w.stop, axis=axis), axis, keepdims=True) for w in windows]
    return jnp.concatenate(parts, axis)


class AdaptiveAvgPool2d(eqx.Module):
    """`torch.nn.AdaptiveAvgPool2d`, exact for every input size.

    The output size must divide the input size for the pool to be one
    `reduce_window` (the identity when they are equal, a global pool for 1x1);
    other sizes, larger outputs included, average torch's uneven windows slice
    by slice.
    """

    output_size: tuple[int, int] = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(self, output_size, *, name: str):
        self.output_size = _pair(output_size)
        if min(self.output_size) < 1:
            raise ConfigError(f"{name}: output_size must be positive, got {output_size!r}")
        self.name = name

    @_scoped
    def __call__(self, x):
        _check_nchw(self.name, x)
        sizes, outs = x.shape[2:], self.output_size
        if sizes == outs:
            return x
        if all(n % o == 0 for n, o in zip(sizes, outs)):
            kernel = tuple(n // o for n, o in zip(sizes, outs))
            return _avg_pool(x, kernel, kernel, [(0, 0), (0, 0)])
        return _adaptive_mean(_adaptive_mean(x, 2, outs[0]), 3, outs[1])


class ReLU(eqx.Module):
    """`torch.nn.ReLU`."""

    name: str = eqx.field(static=True)

    @_scoped
    def __call__(self, x):
        return jnp.maximum(x, 0.0)


class ReLU6(eqx.Module):
    """`torch.nn.ReLU6`: `min(max(x, 0), 6)`."""

    name: str = eqx.field(static=True)

    @_scoped
    def __call__(self, x):
        return jnp.minimum(jnp.maximum(x, 0.0), 6.0)


class LeakyReLU(eqx.Module):
    """`torch.nn.LeakyReLU`: `x` where `x >= 0`, else `negative_slope * x`."""

    negative_slope: float = eqx.field(static=True)
    name: str = eqx.field(static=True)

    @_scoped
    def __call__(self, x):
        return jnp.where(x >= 0, x, self.negative_slope * x)


class Dropout(eqx.Module):
    """`torch.nn.Dropout` at inference: the identity. Kept so layer indices match torchvision."""

    p: float = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __call__(self, x):
        return x


def sequential(layers: tuple, x):
    """Apply `layers` in order, nested tuples included (torch's `nn.Sequential`)."""
    for layer in layers:
        x = sequential(layer, x) if isinstance(layer, tuple) else layer(x)
    return x


def flatten(x):
    """`torch.flatten(x, 1)`."""
    return x.reshape(x.shape[0], -1)


class FeaturesClassifier(eqx.Module):
    """torchvision's usual model shape: `classifier(flatten(avgpool(features(x))))`.

    Subclasses (AlexNet, VGG-16, MobileNetV2) only build the three parts.
    """

    features: tuple
    avgpool: AdaptiveAvgPool2d
    classifier: tuple

    def __call__(self, x: jax.Array) -> jax.Array:
        return sequential(self.classifier, flatten(self.avgpool(sequential(self.features, x))))
