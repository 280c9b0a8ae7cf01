"""Reductions: ReduceMean, ReduceMax, ReduceMin, ReduceSum, ReduceProd, ReduceSumSquare,
ReduceL1, ReduceL2, ReduceLogSum, ReduceLogSumExp, ArgMax, ArgMin.

Axes come from the attribute before the op's opset-13/18 change and from the
(static) second input after it; `noop_with_empty_axes` is honoured.
"""

import functools

import numpy as np

from . import jax_dtype, register, xp

# op type -> (numpy/jnp function name, first schema version taking axes as an input)
_REDUCE = {
    "ReduceMean": ("mean", 18), "ReduceMax": ("max", 18), "ReduceMin": ("min", 18),
    "ReduceSum": ("sum", 13), "ReduceProd": ("prod", 18), "ReduceSumSquare": ("sum", 18),
    "ReduceL1": ("sum", 18), "ReduceL2": ("sum", 18), "ReduceLogSum": ("sum", 18), "ReduceLogSumExp": ("sum", 18),
}
# op type -> (applied before the reduction, applied after it)
_AROUND = {
    "ReduceSumSquare": (lambda m, x: x * x, None),
    "ReduceL1": (lambda m, x: m.abs(x), None),
    "ReduceL2": (lambda m, x: x * x, lambda m, y: m.sqrt(y)),
    "ReduceLogSum": (None, lambda m, y: m.log(y)),
    "ReduceLogSumExp": (lambda m, x: m.exp(x), lambda m, y: m.log(y)),
}


def _reduce(op_type, node, x, axes=None):
    name, input_from = _REDUCE[op_type]
    if node.schema < input_from:
        axes = node.attr("axes")
    elif axes is not None:
        axes = node.ints(axes, "axes")
    if not axes:
        if node.attr("noop_with_empty_axes", 0):
            return x
        axes = range(np.ndim(x))
    axes = tuple(sorted({node.axis(a, np.ndim(x)) for a in axes}))
    before, after = _AROUND.get(op_type, (None, None))
    m = xp(x)
    if before:
        x = before(m, x)
    kwargs = {}
    if name in ("max", "min") and any(np.shape(x)[a] == 0 for a in axes):
        if np.issubdtype(x.dtype, np.floating):
            kwargs["initial"] = -np.inf if name == "max" else np.inf
        elif x.dtype == np.bool_:
            kwargs["initial"] = name == "min"
        else:
            kwargs["initial"] = np.iinfo(x.dtype).min if name == "max" else np.iinfo(x.dtype).max
    out = getattr(m, name)(x, axis=axes, keepdims=bool(node.attr("keepdims", 1)), **kwargs)
    return (after(m, out) if after else out).astype(x.dtype)


for _op in _REDUCE:
    register(_op, since=1, static=(1,))(functools.partial(_reduce, _op))


def _arg(name, node, x):
    axis = node.axis(node.attr("axis", 0), np.ndim(x))
    m = xp(x)
    if node.attr("select_last_index", 0):
        x = m.flip(x, axis)
    index = getattr(m, name)(x, axis=axis, keepdims=bool(node.attr("keepdims", 1)))
    if node.attr("select_last_index", 0):
        index = np.shape(x)[axis] - 1 - index
    return index.astype(jax_dtype(np.int64)) if m is not np else index.astype(np.int64)


register("ArgMax", since=1)(functools.partial(_arg, "argmax"))
register("ArgMin", since=1)(functools.partial(_arg, "argmin"))


__all__ = []
