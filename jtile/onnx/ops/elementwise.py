"""Elementwise ops with numpy broadcasting: arithmetic, comparisons, Where, unary math.

Before opset 7 the binary ops broadcast only with `broadcast=1` (and `axis`);
`legacy_broadcast` maps that onto numpy broadcasting.

`Mod` follows the divisor's sign (`fmod=0`) or the dividend's (`fmod=1`).
Integer `Div` truncates toward zero and `Pow` keeps the base's dtype, as in
the ONNX reference. Everything folds to numpy when its inputs are static.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import register, xp


def _div(m, a, b):
    if np.issubdtype(a.dtype, np.integer):
        if m is np:
            return np.trunc(a / b).astype(a.dtype)
        return jax.lax.div(*jnp.broadcast_arrays(a, b))
    return a / b


_BINARY = {
    "Add": lambda m, a, b: a + b,
    "Sub": lambda m, a, b: a - b,
    "Mul": lambda m, a, b: a * b,
    "Div": _div,
    "Pow": lambda m, a, b: m.power(a, b.astype(a.dtype) if np.issubdtype(a.dtype, np.integer) else b).astype(a.dtype),
    "Equal": lambda m, a, b: a == b,
    "Less": lambda m, a, b: a < b,
    "Greater": lambda m, a, b: a > b,
    "LessOrEqual": lambda m, a, b: a <= b,
    "GreaterOrEqual": lambda m, a, b: a >= b,
    "And": lambda m, a, b: m.logical_and(a, b),
    "Or": lambda m, a, b: m.logical_or(a, b),
    "Xor": lambda m, a, b: m.logical_xor(a, b),
}


def legacy_broadcast(node, a, b):
    """Before opset 7, `broadcast=1, axis=k` aligns B with A's dims from k on (else from the end)."""
    axis = node.attr("axis")
    if node.schema >= 7 or not node.attr("broadcast", 0) or axis is None:
        return b
    axis = node.axis(axis, np.ndim(a))
    trailing = np.ndim(a) - axis - np.ndim(b)
    if trailing < 0:
        raise node.fail(f"cannot broadcast {np.shape(b)} into {np.shape(a)} at axis {axis}")
    return xp(b).reshape(b, np.shape(b) + (1,) * trailing)


def _binary(fn, node, a, b):
    return fn(xp(a, b), a, legacy_broadcast(node, a, b))


for _name, _fn in _BINARY.items():
    register(_name, since=1)(functools.partial(_binary, _fn))

_UNARY = {
    "Sqrt": "sqrt", "Exp": "exp", "Tanh": "tanh", "Neg": "negative", "Abs": "abs",
    "Log": "log", "Floor": "floor", "Ceil": "ceil", "Sign": "sign", "Round": "round",
    "Sin": "sin", "Cos": "cos", "Tan": "tan", "Asin": "arcsin", "Acos": "arccos", "Atan": "arctan",
    "Sinh": "sinh", "Cosh": "cosh", "Asinh": "arcsinh", "Acosh": "arccosh", "Atanh": "arctanh",
    "IsNaN": "isnan",
}


def _unary(name, node, x):
    return getattr(xp(x), name)(x)


for _name, _fn in _UNARY.items():
    register(_name, since=6)(functools.partial(_unary, _fn))


@register("Not", since=1)
def not_(node, x):
    return xp(x).logical_not(x)


@register("IsInf", since=10)
def is_inf(node, x):
    m = xp(x)
    positive, negative = node.attr("detect_positive", 1), node.attr("detect_negative", 1)
    return m.logical_or(m.isposinf(x) if positive else m.zeros(np.shape(x), bool),
                        m.isneginf(x) if negative else m.zeros(np.shape(x), bool))


@register("Mod", since=10)
def mod(node, a, b):
    m = xp(a, b)
    return (m.fmod if node.attr("fmod", 0) else m.mod)(a, b)


@register("Reciprocal", since=6)
def reciprocal(node, x):
    return (np.ones((), x.dtype) / x).astype(x.dtype)


@register("Erf", since=9)
def erf(node, x):
    return jax.scipy.special.erf(x)


_VARIADIC = {"Sum": "add", "Max": "maximum", "Min": "minimum"}


def _variadic(name, node, *xs):
    m = xp(*xs)
    return functools.reduce(getattr(m, name), xs)


for _name, _fn in _VARIADIC.items():
    register(_name, since=1)(functools.partial(_variadic, _fn))


@register("Mean", since=8)
def mean(node, *xs):
    return (functools.reduce(xp(*xs).add, xs) / np.asarray(len(xs), xs[0].dtype)).astype(xs[0].dtype)


@register("Where", since=9)
def where(node, cond, a, b):
    return xp(cond, a, b).where(cond, a, b)


__all__ = ["legacy_broadcast", "not_", "reciprocal", "erf", "mean", "where"]
