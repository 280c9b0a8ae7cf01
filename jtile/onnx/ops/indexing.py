"""Indexed reads and writes: ScatterND, ScatterElements, GatherND, GatherElements, Trilu, CumSum.

Negative indices count from the end of their axis. A ScatterND with static
indices into run-time data is a `take` from data and updates stacked (it
exports as a Gather). Writes with `reduction`
(`add`, `mul`, `max`, `min`) combine duplicates; with `none`, duplicate
indices leave one of the updates (ONNX leaves the choice open). Everything
folds to numpy when the inputs are static.
"""

import jax.numpy as jnp
import numpy as np

from . import register, xp

_NUMPY_REDUCTIONS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
_JAX_REDUCTIONS = {"none": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}


def _positive(m, indices, dims):
    return m.where(indices < 0, indices + dims, indices)


def _scatter(node, data, index, updates):
    """`data` with `updates` written at the tuple of index arrays `index`."""
    reduction = node.attr("reduction", "none")
    if reduction not in _JAX_REDUCTIONS:
        raise node.fail(f"reduction must be none, add, mul, max or min, got {reduction!r}")
    if xp(data, updates, *index) is np:
        out = data.copy()
        if reduction == "none":
            out[index] = updates
        else:
            _NUMPY_REDUCTIONS[reduction].at(out, index, updates)
        return out
    return getattr(jnp.asarray(data).at[index], _JAX_REDUCTIONS[reduction])(updates)


@register("ScatterND", since=11)
def scatter_nd(node, data, indices, updates):
    k = np.shape(indices)[-1] if np.ndim(indices) else 0
    want = np.shape(indices)[:-1] + np.shape(data)[k:]
    if np.ndim(indices) < 1 or k > np.ndim(data) or np.shape(updates) != want:
        raise node.fail(f"data {np.shape(data)}, indices {np.shape(indices)} and updates {np.shape(updates)} "
                        f"disagree (updates should have shape {want})")
    m = xp(indices)
    index = tuple(_positive(m, indices[..., i], np.shape(data)[i]) for i in range(k))
    if m is np and xp(data, updates) is not np and node.attr("reduction", "none") == "none":
        return _overwrite(data, index, updates, k)
    return _scatter(node, data, index, updates)


def _overwrite(data, index, updates, k):
    """`data` with `updates` written at static `index`, as one `take` from data and updates
    stacked (a gather, which exports as an ONNX Gather; a scatter does not)."""
    lead, rest = np.shape(data)[:k], np.shape(data)[k:]
    size = int(np.prod(lead, dtype=np.int64))
    written = np.ravel_multi_index(index, lead).reshape(-1) if k else np.zeros(1, np.int64)
    source = np.arange(size)
    source[written] = size + np.arange(written.size)  # the last update of a position wins
    stacked = jnp.concatenate([jnp.reshape(data, (size, *rest)), jnp.reshape(updates, (written.size, *rest))])
    return jnp.take(stacked, source, axis=0).reshape(np.shape(data))


def _element_index(node, data, indices):
    """The full index tuple addressing `data` at `indices` along `axis`, other axes by position."""
    rank = np.ndim(data)
    axis = node.axis(node.attr("axis", 0), rank)
    if np.ndim(indices) != rank:
        raise node.fail(f"indices of rank {np.ndim(indices)} should have the rank {rank} of the data")
    m = xp(indices)
    grid = list(np.indices(np.shape(indices), sparse=True))
    grid[axis] = _positive(m, indices, np.shape(data)[axis])
    return tuple(grid)


@register("ScatterElements", since=11)
def scatter_elements(node, data, indices, updates):
    if np.shape(indices) != np.shape(updates):
        raise node.fail(f"indices {np.shape(indices)} and updates {np.shape(updates)} differ in shape")
    return _scatter(node, data, _element_index(node, data, indices), updates)


@register("GatherElements", since=11)
def gather_elements(node, data, indices):
    return data[_element_index(node, data, indices)]


@register("GatherND", since=11)
def gather_nd(node, data, indices):
    batch = node.attr("batch_dims", 0)
    k = np.shape(indices)[-1]
    if batch + k > np.ndim(data) or np.shape(indices)[:batch] != np.shape(data)[:batch]:
        raise node.fail(f"data {np.shape(data)} and indices {np.shape(indices)} disagree "
                        f"(batch_dims {batch})")
    m = xp(indices)
    lead = np.shape(indices)[:-1]
    grid = [np.arange(n).reshape((-1,) + (1,) * (len(lead) - i - 1)) for i, n in enumerate(lead[:batch])]
    index = tuple(grid) + tuple(_positive(m, indices[..., i], np.shape(data)[batch + i]) for i in range(k))
    return data[index]


@register("Trilu", since=14, static=(1,))
def trilu(node, x, k=None):
    k = 0 if k is None else int(node.static(k, "k").reshape(()))
    m = xp(x)
    return m.triu(x, k) if node.attr("upper", 1) else m.tril(x, k)


@register("CumSum", since=11, static=(1,))
def cumsum(node, x, axis):
    axis = node.axis(int(node.static(axis, "axis").reshape(())), np.ndim(x))
    m = xp(x)
    if node.attr("reverse", 0):
        x = m.flip(x, axis)
    y = m.cumsum(x, axis=axis, dtype=x.dtype)
    if node.attr("exclusive", 0):
        y = y - x
    return m.flip(y, axis) if node.attr("reverse", 0) else y


__all__ = ["scatter_nd", "scatter_elements", "gather_elements", "gather_nd", "trilu", "cumsum"]
