"""Fused ops: JAX primitives that one kernel call can implement.

`jtile.fuse` emits these; `jtile.swap_backend` maps them to kernels; without a
swap they lower to the jnp composition (XLA fuses that itself), so a fused
function always runs, differentiates and vmaps.

Two primitives, both `y = activate(op(lhs, rhs) + bias, activation)`:

- `conv_bias_act_p`, name `"conv_bias_act"`, operands `(x, w, bias)` or
  `(x, w, bias, residual)`, where `residual` has the output's shape and is
  added before the activation (a ResNet shortcut); params
  are exactly those of `lax.conv_general_dilated_p` (`window_strides`,
  `padding`, `lhs_dilation`, `rhs_dilation`, `dimension_numbers`,
  `feature_group_count`, `batch_group_count`, `precision`,
  `preferred_element_type`) plus `activation`.
- `dense_p`, name `"dense"`, operands `(lhs, rhs, bias)` or `(lhs, rhs, bias,
  residual)` (a transformer's shortcut, added before the activation); params
  `dimension_numbers`, `precision`, `preferred_element_type` (as
  `lax.dot_general_p`) plus `activation`. `lhs` is not necessarily the
  activation: `W @ x + b` fuses to `dense(W, x, b)`.

`bias` has the rank of the output and size 1 on every axis but one (the
output channels: `(1, C, 1, 1)` for an NCHW conv, `(1, N)` for `x @ W`,
`(N, 1)` for `W @ x`), or is a scalar.

`activation` is a hashable tuple: `()` none, `("relu",)`,
`("clip", lo, hi)` (relu6 is `("clip", 0.0, 6.0)`), `("leaky_relu", alpha)`,
`("sigmoid",)`, `("silu",)` (`y * sigmoid(y)`), `("hard_sigmoid", alpha,
beta)` (`clip(alpha * y + beta, 0, 1)`, ONNX HardSigmoid), `("hard_swish",
alpha, beta)` (`y * hard_sigmoid(y)`; ONNX HardSwish is alpha 1/6, beta 0.5),
`("gelu",)` (erf form) and `("gelu_tanh",)` (tanh approximation).

`describe` shows both as a `FusedLayer` (kind `"conv2d"` / `"dense"`, plus
`activation` and `bias_shape`).

A third primitive keeps an interpolation whole: `resize_p`, name `"resize"`,
operand `x`, params one entry per axis of `x` (`sizes`, `scales`, `roi` as
`(start, end)` pairs) plus ONNX Resize's attributes (`mode`, `nearest_mode`,
`coords`, `cubic_a`, `exclude_outside`, `extrapolation`, `antialias`); it
lowers to `jtile._resize.resize` (gathers and a weighted sum), `describe`
shows it as a `Layer` of kind `"resize"`, `swap_backend`'s `"resize"` kind
runs it on the `jtile_resize2d` kernel (the same taps, from
`jtile._resize.axis_taps`), and the exporter writes one ONNX `Resize`.

Two keep a row normalisation whole, over the trailing axes `axes` of `x`
(an imported ONNX Softmax and LayerNormalization): `softmax_p`, name
`"softmax"`, operand `x`; `layer_norm_p`, name `"layer_norm"`, operands
`(x, scale, bias)` broadcast against those axes, param `epsilon` too.
`describe` shows them as `Layer`s of kinds `"softmax"` and `"layer_norm"`,
which `swap_backend` runs on the `jtile_softmax` and `jtile_layer_norm`
kernels; the exporter writes one ONNX Softmax or LayerNormalization.
"""

import dataclasses
import functools
import math
from collections import Counter

import jax
import jax.extend.core as jcore
import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir

from . import _resize
from ._layers import Layer, _conv, layer_fields, scope_name
from ._registry import register

Activation = tuple


def activate(y, activation: Activation):
    """Apply an `activation` tuple (see the module docstring) to `y`."""
    if not activation:
        return y
    kind, *args = activation
    if kind == "relu":
        return lax.max(y, jnp.zeros((), y.dtype))
    if kind == "clip":
        lo, hi = args
        return jnp.clip(y, jnp.asarray(lo, y.dtype), jnp.asarray(hi, y.dtype))
    if kind == "leaky_relu":
        return jnp.where(y >= 0, y, jnp.asarray(args[0], y.dtype) * y)
    if kind == "sigmoid":
        return lax.logistic(y)
    if kind == "silu":
        return y * lax.logistic(y)
    if kind in ("hard_sigmoid", "hard_swish"):
        alpha, beta = (jnp.asarray(a, y.dtype) for a in args)
        gate = jnp.clip(y * alpha + beta, jnp.zeros((), y.dtype), jnp.ones((), y.dtype))
        return gate if kind == "hard_sigmoid" else y * gate
    if kind in ("gelu", "gelu_tanh"):
        return jax.nn.gelu(y, approximate=kind == "gelu_tanh")
    raise ValueError(f"unknown activation {activation!r}")


def _conv_bias_act(x, w, bias, *residual, activation, **conv_params):
    y = lax.conv_general_dilated_p.bind(x, w, **conv_params, out_sharding=None) + bias
    return activate(y + residual[0] if residual else y, activation)


def _dense(lhs, rhs, bias, *residual, activation, dimension_numbers, precision, preferred_element_type):
    y = lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
    ) + bias
    return activate(y + residual[0] if residual else y, activation)


def _primitive(name: str, composition) -> jcore.Primitive:
    """A primitive defined by its jnp `composition` (eval, lowering, JVP, batching)."""
    prim = jcore.Primitive(name)

    def abstract_eval(*avals, **params):
        out = jax.eval_shape(functools.partial(composition, **params), *avals)
        return jax.core.ShapedArray(out.shape, out.dtype)

    def jvp(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return jax.jvp(functools.partial(composition, **params), tuple(primals), tuple(tangents))

    def batch(args, dims, **params):
        fn = functools.partial(composition, **params)
        return jax.vmap(fn, in_axes=dims)(*args), 0

    prim.def_impl(lambda *args, **params: composition(*args, **params))
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(composition, multiple_results=False))
    ad.primitive_jvps[prim] = jvp
    batching.primitive_batchers[prim] = batch
    return prim


def shift_by_max(x, axes):
    """`x - max(x)` over `axes`, shifted twice. XLA on CPU may contract a
    producer of `x` (a mean's `sum * 1/n`) into an FMA with the subtraction,
    so `x - max(x)` is the product's rounding error rather than 0, and for
    |x| ~ 1e9 every exp underflows. The second shift subtracts that same
    error back out."""
    z = x - jnp.max(x, axis=axes, keepdims=True)
    return z - jnp.max(z, axis=axes, keepdims=True)


def _softmax(x, *, axes):
    e = jnp.exp(shift_by_max(x, axes))
    return e / jnp.sum(e, axis=axes, keepdims=True)


def _layer_norm(x, scale, bias, *, axes, epsilon):
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    inv_std = lax.rsqrt(jnp.mean(centred * centred, axis=axes, keepdims=True) + jnp.asarray(epsilon, x.dtype))
    return centred * inv_std * scale + bias


conv_bias_act_p = _primitive("conv_bias_act", _conv_bias_act)
dense_p = _primitive("dense", _dense)
resize_p = _primitive("resize", _resize.resize)
softmax_p = _primitive("softmax", _softmax)
layer_norm_p = _primitive("layer_norm", _layer_norm)


def softmax(x, *, axes: tuple[int, ...]):
    """Softmax of `x` over its trailing `axes`, as one `softmax_p`."""
    return softmax_p.bind(x, axes=tuple(axes))


def layer_norm(x, scale, bias, *, axes: tuple[int, ...], epsilon: float):
    """Layer norm of `x` over its trailing `axes`, then `* scale + bias`, as one `layer_norm_p`."""
    return layer_norm_p.bind(x, scale, bias, axes=tuple(axes), epsilon=float(epsilon))


def conv_bias_act(x, w, bias, residual=None, *, activation: Activation = (), **conv_params):
    """Bind `conv_bias_act_p`; `conv_params` are `conv_general_dilated_p`'s params."""
    conv_params.pop("out_sharding", None)
    operands = (x, w, bias) if residual is None else (x, w, bias, residual)
    return conv_bias_act_p.bind(*operands, activation=tuple(activation), **conv_params)


def dense(lhs, rhs, bias, residual=None, *, dimension_numbers, activation: Activation = (), precision=None,
          preferred_element_type=None):
    """Bind `dense_p`: `activate(dot_general(lhs, rhs) + bias [+ residual], activation)`."""
    operands = (lhs, rhs, bias) if residual is None else (lhs, rhs, bias, residual)
    return dense_p.bind(
        *operands, activation=tuple(activation), dimension_numbers=dimension_numbers,
        precision=precision, preferred_element_type=preferred_element_type,
    )


def resize(x, **params):
    """Bind `resize_p` (params as in the module docstring, one entry per axis of `x`)."""
    return resize_p.bind(x, **params)


@dataclasses.dataclass(frozen=True)
class FusedLayer(Layer):
    """A `Layer` made by fusion: the activation, the bias and whether it adds a residual."""

    activation: Activation = ()
    bias_shape: tuple[int, ...] = ()
    residual: bool = False


class _Operands:
    """The view of a fused eqn that `_layers._conv` expects: only (x, w)."""

    def __init__(self, eqn):
        self.params, self.invars, self.outvars = eqn.params, eqn.invars[:2], eqn.outvars
        self.source_info, self.primitive = eqn.source_info, eqn.primitive


def _describe_conv(eqn) -> FusedLayer:
    layer = _conv(_Operands(eqn))
    return FusedLayer(
        **{f.name: getattr(layer, f.name) for f in dataclasses.fields(Layer)},
        activation=eqn.params["activation"],
        bias_shape=tuple(eqn.invars[2].aval.shape),
        residual=len(eqn.invars) > 3,
    )


def _describe_dense(eqn) -> FusedLayer:
    lhs, rhs, bias = (tuple(v.aval.shape) for v in eqn.invars[:3])
    (lc, rc), _ = eqn.params["dimension_numbers"]
    k = 1
    for d in lc:
        k *= lhs[d]
    out = tuple(eqn.outvars[0].aval.shape)
    channels = [n for n, b in zip(out, bias) if b != 1]
    return FusedLayer(
        kind="dense",
        name=scope_name(eqn),
        primitive=eqn.primitive.name,
        in_shapes=(lhs, rhs, bias),
        out_shape=out,
        dtype=np.dtype(eqn.outvars[0].aval.dtype),
        in_channels=k,
        out_channels=channels[0] if channels else None,
        activation=eqn.params["activation"],
        bias_shape=bias,
        residual=len(eqn.invars) > 3,
    )


def _describe_resize(eqn) -> Layer:
    channels = eqn.invars[0].aval.shape[1] if eqn.invars[0].aval.ndim > 1 else None
    return Layer(kind="resize", **layer_fields(eqn), in_channels=channels, out_channels=channels)


register("conv_bias_act", describe=_describe_conv, weights=(1, 2), activations=(0, 3))
register("dense", describe=_describe_dense)
def _resize_macs(eqn) -> Counter:
    """Output elements x taps (linear 2, cubic 4, nearest 0) per resized axis."""
    taps = {"nearest": 0, "linear": 2, "cubic": 4}[eqn.params["mode"]]
    resized = sum(o != i for o, i in zip(eqn.params["sizes"], eqn.invars[0].aval.shape))
    return Counter({"elementwise": math.prod(eqn.outvars[0].aval.shape) * taps * resized})


register("resize", describe=_describe_resize, macs=_resize_macs, activations=(0,))


def describe_as(kind: str):
    """A `describe` facet: the equation as a plain `Layer` of `kind` (the row
    normalisations, as fused ops and as kernel calls)."""
    def describe(eqn) -> Layer:
        return Layer(kind=kind, **layer_fields(eqn))

    return describe


def element_macs(category: str):
    """A `macs` facet: one operation of `category` per element of the first operand."""
    def macs(eqn) -> Counter:
        return Counter({category: math.prod(eqn.invars[0].aval.shape)})

    return macs


register("softmax", describe=describe_as("softmax"), macs=element_macs("activation"), activations=(0,))
register("layer_norm", describe=describe_as("layer_norm"), macs=element_macs("norm"), weights=(1, 2),
         activations=(0,))
