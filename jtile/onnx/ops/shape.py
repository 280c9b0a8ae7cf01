"""Shape and data-movement ops: Shape, Reshape, Flatten, Transpose, Concat, Split, Slice,
Pad, Squeeze, Unsqueeze, Gather, Expand, Tile, Range, Constant, ConstantOfShape,
Identity, Cast, CastLike.

These are where shape subgraphs fold: `Shape` always returns a numpy array
(shapes are static in JAX), and the rest compute in numpy while their inputs
are static. Shape-like operands (reshape targets, slice bounds, pads, axes)
must be static; the registry marks them.
"""

import math

import jax.numpy as jnp
from jax import lax
import numpy as np

from .._proto import np_dtype, require_x64
from . import jax_dtype, register, xp

FOLD_LIMIT = 1 << 16  # ConstantOfShape results larger than this are built in the graph, not stored


def _cast(x, dtype):
    if isinstance(x, np.ndarray):
        return x.astype(dtype)
    return jnp.asarray(x).astype(jax_dtype(dtype))


@register("Shape", since=1, shape_only=True)
def shape(node, x):
    dims = np.asarray(np.shape(x), np.int64)
    start, end, _ = slice(node.attr("start", 0), node.attr("end", len(dims))).indices(len(dims))
    return dims[start:end]


@register("Size", since=1, shape_only=True)
def size(node, x):
    return np.asarray(math.prod(np.shape(x)), np.int64)


@register("Identity", since=1)
def identity(node, x):
    return x


@register("Constant", since=1)
def constant(node):
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in node.attrs:
            return np.asarray(node.attrs[key], dtype)
    if "value" in node.attrs:
        return node.attrs["value"]
    raise node.unsupported(f"Constant with attribute(s) {sorted(node.attrs)} is not supported; use 'value'")


@register("ConstantOfShape", since=9, static=(0,))
def constant_of_shape(node, dims):
    dims = node.ints(dims, "the shape")
    if min(dims, default=0) < 0:
        raise node.fail(f"shape {dims} has a negative dimension")
    value = node.attr("value", np.zeros(1, np.float32)).reshape(-1)
    if value.size != 1:
        raise node.fail(f"value must hold one element, got {value.size}")
    if math.prod(dims) <= FOLD_LIMIT:
        return np.full(dims, value[0], value.dtype)
    return jnp.full(dims, value[0], jax_dtype(value.dtype))


@register("Cast", since=6)
def cast(node, x):
    dtype = np_dtype(node.attr("to", 0), str(node))
    if not isinstance(x, np.ndarray):  # a static cast is exact in numpy
        require_x64(dtype, f"{node}: the cast target")
    return _cast(x, dtype)


@register("CastLike", since=15)
def cast_like(node, x, like):
    return _cast(x, np.dtype(like.dtype))


@register("Reshape", since=5, static=(1,))
def reshape(node, x, target):
    dims = node.ints(target, "the target shape")
    in_shape = np.shape(x)
    if not node.attr("allowzero", 0):
        dims = [in_shape[i] if d == 0 and i < len(in_shape) else d for i, d in enumerate(dims)]
    known = math.prod(d for d in dims if d != -1)
    if dims.count(-1) > 1 or min(dims, default=0) < -1:
        raise node.fail(f"target shape {dims} has more than one -1 or a negative dimension")
    if -1 in dims:
        if known == 0 or math.prod(in_shape) % known:
            raise node.fail(f"cannot reshape {in_shape} to {dims}")
        dims[dims.index(-1)] = math.prod(in_shape) // known
    if math.prod(dims) != math.prod(in_shape):
        raise node.fail(f"cannot reshape {in_shape} ({math.prod(in_shape)} elements) to {dims}")
    return xp(x).reshape(x, dims)


@register("Flatten", since=1)
def flatten(node, x):
    rank = np.ndim(x)
    axis = node.attr("axis", 1)
    if not -rank <= axis <= rank:
        raise node.fail(f"axis {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    s = np.shape(x)
    return xp(x).reshape(x, (math.prod(s[:axis]), math.prod(s[axis:])))


@register("Transpose", since=1)
def transpose(node, x):
    perm = node.attr("perm", list(range(np.ndim(x)))[::-1])
    if sorted(perm) != list(range(np.ndim(x))):
        raise node.fail(f"perm {perm} is not a permutation of the {np.ndim(x)} axes")
    return xp(x).transpose(x, perm)


@register("Concat", since=4)
def concat(node, *xs):
    ranks = {np.ndim(x) for x in xs}
    if len(ranks) != 1:
        raise node.fail(f"inputs have different ranks {sorted(ranks)}")
    axis = node.axis(node.attr("axis", 0), ranks.pop())
    return xp(*xs).concatenate(xs, axis=axis)


@register("Split", since=2, static=(1,))
def split(node, x, sizes=None):
    axis = node.axis(node.attr("axis", 0), np.ndim(x))
    dim = np.shape(x)[axis]
    n = node.n_outputs
    if node.schema < 13:
        sizes = node.attr("split")
    elif sizes is not None:
        sizes = node.ints(sizes, "split")
    if sizes is None or len(sizes) == 0:
        if node.attr("num_outputs") is not None:
            n = node.attr("num_outputs")
            chunk = -(-dim // n) if n > 0 else 0
            sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
        elif n and dim % n == 0:
            sizes = [dim // n] * n
        else:
            raise node.fail(f"cannot split dimension {dim} into {n} equal parts")
    sizes = list(sizes)
    if sum(sizes) != dim or min(sizes, default=0) < 0 or len(sizes) != n:
        raise node.fail(f"split sizes {sizes} do not add up to dimension {dim} or do not match {n} outputs")
    cuts = np.cumsum(sizes)[:-1].tolist()
    return tuple(xp(x).split(x, cuts, axis=axis))


def _slice(dim, start, end, step):
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


@register("Slice", since=1, static=(1, 2, 3, 4))
def slice_(node, x, starts=None, ends=None, axes=None, steps=None):
    rank = np.ndim(x)
    if node.schema < 10:
        starts, ends, axes = node.attr("starts"), node.attr("ends"), node.attr("axes")
        steps = None
    else:
        starts, ends = node.ints(starts, "starts"), node.ints(ends, "ends")
        axes = None if axes is None else node.ints(axes, "axes")
        steps = None if steps is None else node.ints(steps, "steps")
    axes = list(range(len(starts))) if axes is None else [node.axis(a, rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps) or 0 in steps or len(set(axes)) != len(axes):
        raise node.fail(f"starts {starts}, ends {ends}, axes {axes}, steps {steps} are inconsistent")
    index = [slice(None)] * rank
    for a, s, e, st in zip(axes, starts, ends, steps):
        index[a] = _slice(np.shape(x)[a], s, e, st)
    return x[tuple(index)]


@register("Pad", since=2, static=(1, 3))
def pad(node, x, pads=None, value=None, axes=None):
    rank = np.ndim(x)
    if node.schema < 11:
        pads, value = list(node.attr("pads", [])), np.asarray(node.attr("value", 0.0), x.dtype)
    else:
        pads = node.ints(pads, "pads")
    axes = list(range(rank)) if axes is None else [node.axis(a, rank) for a in node.ints(axes, "axes")]
    if len(pads) != 2 * len(axes):
        raise node.fail(f"pads {pads} should hold 2 values per padded axis ({len(axes)} axes)")
    widths = [[0, 0] for _ in range(rank)]
    for i, a in enumerate(axes):
        widths[a] = [pads[i], pads[i + len(axes)]]
    # negative pads crop
    x = x[tuple(slice(max(-lo, 0), hi if hi < 0 else None) for lo, hi in widths)]
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    mode = node.attr("mode", "constant")
    if mode == "constant":
        fill = np.zeros((), x.dtype) if value is None else value
        return xp(x, fill).pad(x, widths, constant_values=xp(fill).asarray(fill).reshape(()).astype(x.dtype))
    if mode not in ("reflect", "edge", "wrap"):
        raise node.fail(f"mode must be constant, reflect, edge or wrap, got {mode!r}")
    if mode == "reflect" and any(w > max(d - 1, 0) for d, p in zip(np.shape(x), widths) for w in p if w):
        raise node.fail("reflect padding wider than the input minus one is undefined")
    return xp(x).pad(x, widths, mode=mode)


def _axes(node, x, axes, attr_until):
    if node.schema < attr_until:
        axes = node.attr("axes")
    elif axes is not None:
        axes = node.ints(axes, "axes")
    return axes


@register("Squeeze", since=1, static=(1,))
def squeeze(node, x, axes=None):
    axes = _axes(node, x, axes, 13)
    shape = np.shape(x)
    if axes is None:
        axes = [i for i, d in enumerate(shape) if d == 1]
    axes = sorted({node.axis(a, len(shape)) for a in axes})
    if any(shape[a] != 1 for a in axes):
        raise node.fail(f"cannot squeeze axes {axes} of shape {shape}: not all have size 1")
    return xp(x).reshape(x, [d for i, d in enumerate(shape) if i not in axes])


@register("Unsqueeze", since=1, static=(1,))
def unsqueeze(node, x, axes=None):
    axes = _axes(node, x, axes, 13)
    if axes is None:
        raise node.fail("axes is required")
    rank = np.ndim(x) + len(axes)
    axes = sorted(node.axis(a, rank) for a in axes)
    if len(set(axes)) != len(axes):
        raise node.fail(f"axes {axes} repeat")
    dims = list(np.shape(x))
    for a in axes:
        dims.insert(a, 1)
    return xp(x).reshape(x, dims)


@register("Gather", since=1)
def gather(node, x, indices):
    axis = node.axis(node.attr("axis", 0), np.ndim(x))
    dim = np.shape(x)[axis]
    if isinstance(indices, np.ndarray):
        if indices.size and (indices.min() < -dim or indices.max() >= dim):
            raise node.fail(f"indices out of range [{-dim}, {dim}) on axis {axis}")
        indices = np.where(indices < 0, indices + dim, indices)
        if indices.ndim == 0 and not isinstance(x, np.ndarray):  # a static slice, not a gather
            return lax.index_in_dim(x, int(indices), axis, keepdims=False)
    else:
        indices = jnp.where(indices < 0, indices + dim, indices)
    return xp(x, indices).take(x, indices, axis=axis)


@register("Expand", since=8, static=(1,))
def expand(node, x, dims):
    dims = node.ints(dims, "the shape")
    try:
        out = np.broadcast_shapes(np.shape(x), tuple(dims))
    except ValueError as e:
        raise node.fail(f"cannot expand {np.shape(x)} to {dims}") from e
    return xp(x).broadcast_to(x, out)


@register("Tile", since=6, static=(1,))
def tile(node, x, repeats):
    repeats = node.ints(repeats, "repeats")
    if len(repeats) != np.ndim(x) or min(repeats, default=0) < 0:
        raise node.fail(f"repeats {repeats} should hold one non-negative value per axis of {np.shape(x)}")
    return xp(x).tile(x, repeats)


@register("Range", since=11, static=(0, 1, 2))
def range_(node, start, limit, delta):
    start, limit, delta = (node.static(v, name).reshape(()) for v, name in
                           ((start, "start"), (limit, "limit"), (delta, "delta")))
    if delta == 0:
        raise node.fail("delta must not be 0")
    n = max(math.ceil((limit - start) / delta), 0)
    return (start + np.arange(n) * delta).astype(start.dtype)


__all__ = [
    "FOLD_LIMIT", "shape", "size", "identity", "constant", "constant_of_shape", "cast",
    "cast_like", "reshape", "flatten", "transpose", "concat", "split", "slice_", "pad",
    "squeeze", "unsqueeze", "gather", "expand", "tile", "range_"
]
