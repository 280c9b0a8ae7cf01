"""Which array leaves of a call are parameters, and which parameters are buffers.

Parameters are the array leaves of `fn` itself (an equinox module or any
callable pytree); otherwise, when `fn` takes two or more positional
arguments, those of the first one (the `fn(params, *inputs)` convention of
`jtile.models.as_function` and `jtile.onnx`); and always the arrays the
function closes over (named after the module a transform or `jax.jit`
wraps, when found there). Every other array leaf is an input. An `OnnxModel`
is analysed as `model.fn(model.params, *inputs)`.

Buffers (non-trainable parameters) are leaves inside a `jtile.models.Buffer`,
the initializers an ONNX BatchNormalization reads as mean and variance, and
(decided later, from the jaxpr) parameters no gradient from an activation
reaches, such as those read only through `lax.stop_gradient`.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from ._interpreter import is_array


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array leaf of the arguments, or one closed-over constant."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    is_param: bool
    is_buffer: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def _onnx_statistics(model) -> set[str]:
    nodes = (n for n in model.proto.graph.node if n.op_type == "BatchNormalization")
    return {name for n in nodes for name in n.input[3:5]}


def as_call(fn, args: tuple) -> tuple:
    """`(fn, args, names of buffers among the first argument's dict keys)`."""
    from .onnx import OnnxModel

    if isinstance(fn, OnnxModel):
        return fn.fn, (fn.params, *args), _onnx_statistics(fn)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, OnnxModel) and fn == owner.fn:
        return fn, args, _onnx_statistics(owner)
    return fn, args, set()


def _is_buffer(x) -> bool:
    from .models import Buffer

    return isinstance(x, Buffer)


def _flat(tree, in_buffer: Callable[[tuple], bool]):
    """`(path, leaf, is a buffer)` for every leaf of `tree`, in `jax.tree.leaves` order."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_buffer)[0]:
        inside = _is_buffer(x) or in_buffer(path)
        for sub, y in jax.tree_util.tree_flatten_with_path(x)[0]:
            yield path + sub, y, inside


def input_leaves(fn, args: tuple, kwargs: dict, buffer_keys: set[str]) -> list[Leaf]:
    """One `Leaf` per array leaf of `(fn, args, kwargs)`, in tracing order."""
    params_from_fn = any(is_array(x) for x in jax.tree.leaves(fn))
    first_is_params = not params_from_fn and len(args) >= 2

    def is_param(path) -> bool:
        return (path[0].idx == 0 and params_from_fn) or (
            path[0].idx == 1 and first_is_params and path[1].idx == 0
        )

    def is_statistic(path) -> bool:
        return is_param(path) and len(path) > 2 and getattr(path[2], "key", None) in buffer_keys

    return [
        Leaf(
            ("fn", "args", "kwargs")[path[0].idx] + jax.tree_util.keystr(path[1:]),
            tuple(x.shape), np.dtype(x.dtype), is_param(path), is_param(path) and buffer,
        )
        for path, x, buffer in _flat((fn, args, kwargs), is_statistic)
        if is_array(x)
    ]


def closure_names(fn) -> dict[int, tuple[str, bool]]:
    """`id(array) -> (path, in a buffer)` for the arrays of the pytree `fn` wraps.

    Follows `__wrapped__` (jtile transforms, `jax.jit`, `functools.wraps`), so
    the weights a transformed module closes over keep their names and roles.
    """
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return {
        id(x): ("fn" + jax.tree_util.keystr(path), buffer)
        for path, x, buffer in _flat(fn, lambda path: False)
        if is_array(x)
    }


def const_leaf(i: int, c, names: dict[int, tuple[str, bool]]) -> Leaf:
    """The `Leaf` of the `i`-th closed-over constant: a parameter, named if `names` knows it."""
    path, buffer = names.get(id(c), (f"const[{i}]", False))
    return Leaf(path, tuple(np.shape(c)), np.dtype(c.dtype), True, buffer)
