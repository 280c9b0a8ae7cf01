"""Reductions: ReduceMean, ReduceMax, ReduceMin, ReduceSum, ReduceProd, ReduceSumSquare.

Axes come from the attribute before the op's opset-13/18 change and from the
(static) second input after it; `noop_with_empty_axes` is honoured.
"""

import functools

import numpy as np

from . import register, xp

# op type -> (numpy/jnp function name, first schema version taking axes as an input)
_REDUCE = {
    "ReduceMean": ("mean", 18), "ReduceMax": ("max", 18), "ReduceMin": ("min", 18),
    "ReduceSum": ("sum", 13), "ReduceProd": ("prod", 18), "ReduceSumSquare": ("sum", 18),
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
    if op_type == "ReduceSumSquare":
        x = x * x
    kwargs = {}
    if name in ("max", "min") and any(np.shape(x)[a] == 0 for a in axes):
        if np.issubdtype(x.dtype, np.floating):
            kwargs["initial"] = -np.inf if name == "max" else np.inf
        elif x.dtype == np.bool_:
            kwargs["initial"] = name == "min"
        else:
            kwargs["initial"] = np.iinfo(x.dtype).min if name == "max" else np.iinfo(x.dtype).max
    out = getattr(xp(x), name)(x, axis=axes, keepdims=bool(node.attr("keepdims", 1)), **kwargs)
    return out.astype(x.dtype)


for _op in _REDUCE:
    register(_op, since=1, static=(1,))(functools.partial(_reduce, _op))


__all__ = []
