"""Models as data: the pure-function form, parameter counts, named weights.

`as_function(model)` splits a model into `fn(params, x)` and its array pytree.
Parameters are every array leaf except those inside a `Buffer` (batch-norm
running statistics), so `count_params` reproduces torchvision's published
parameter counts. `state_dict` / `load_state_dict` name leaves with torch's
dotted paths (`"layer1.0.conv1.weight"`, `"bn1.running_mean"`), so weights move
between a torchvision model and a jtile model by name.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr

from .._errors import ConfigError
from ._layers import Buffer

PyTree = Any


def _is_buffer(x) -> bool:
    return isinstance(x, Buffer)


def as_function(model: eqx.Module) -> tuple[Callable, PyTree]:
    """Split `model` into a pure `fn(params, x)` and `params`, its array leaves.

    `fn(params, x) == model(x)`; `params` keeps the model's tree structure (with
    `None` where the model holds no array), so `jax.grad`, `jax.jit` and the jtile
    transforms all see an ordinary pytree argument.
    """
    params, static = eqx.partition(model, eqx.is_array)

    def apply(params, x):
        return eqx.combine(params, static)(x)

    apply.__name__ = apply.__qualname__ = type(model).__name__
    return apply, params


def trainable_mask(tree: PyTree) -> PyTree:
    """A filter spec for `eqx.partition`: `True` for parameters, `False` for buffers."""
    return jax.tree.map(lambda x: not _is_buffer(x), tree, is_leaf=_is_buffer)


class ParamCount(NamedTuple):
    """Element counts. `params` is torch's "total params" (all of them trainable);
    `buffers` counts the non-trainable state (batch-norm running mean and variance)."""

    params: int
    buffers: int


def _size(tree: PyTree) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def count_params(tree: PyTree) -> ParamCount:
    """Count the parameters and buffers of a model or its `params` pytree.

    Leaves may be arrays or `jax.ShapeDtypeStruct`s, so
    `count_params(jax.eval_shape(jtile.models.VGG16, key))` costs no memory.
    """
    params, buffers = eqx.partition(tree, trainable_mask(tree))
    return ParamCount(_size(params), _size(buffers))


def _named_leaves(tree: PyTree):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_buffer)
    return [(keystr(path, simple=True, separator="."), leaf) for path, leaf in flat], treedef


def state_dict(tree: PyTree) -> dict[str, jax.Array]:
    """Every array of `tree` by torch-style dotted name, buffers included."""
    return {name: leaf.value if _is_buffer(leaf) else leaf for name, leaf in _named_leaves(tree)[0]}


_IGNORED_SUFFIX = "num_batches_tracked"  # torch's batch-norm step counter; no role at inference


def load_state_dict(tree: PyTree, weights: Mapping[str, Any]) -> PyTree:
    """`tree` with every array replaced by `weights[name]` (numpy, jax, or torch CPU arrays).

    Raises `ConfigError` on a missing name, an unknown name or a shape mismatch;
    torch's `*.num_batches_tracked` counters are accepted and ignored.
    """
    named, treedef = _named_leaves(tree)
    names = {name for name, _ in named}
    missing = sorted(names - set(weights))
    unknown = sorted(k for k in set(weights) - names if not k.endswith(_IGNORED_SUFFIX))
    if missing or unknown:
        raise ConfigError(
            f"load_state_dict: missing weights {missing or 'none'}, unknown weights "
            f"{unknown or 'none'}; names must match jtile.models.state_dict(model)"
        )
    leaves = []
    for name, leaf in named:
        old = leaf.value if _is_buffer(leaf) else leaf
        new = jnp.asarray(np.asarray(weights[name]), old.dtype)
        if new.shape != old.shape:
            raise ConfigError(
                f"load_state_dict: {name} has shape {new.shape}, the model expects {old.shape}"
            )
        leaves.append(Buffer(new) if _is_buffer(leaf) else new)
    return jax.tree.unflatten(treedef, leaves)
