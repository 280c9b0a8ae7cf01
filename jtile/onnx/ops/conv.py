"""Convolutions and pools: Conv and ConvTranspose lower to `lax.conv_general_dilated`
(NC..., OI... layout), the pools to `lax.reduce_window`, so tile_conv and
swap_backend see them as the layers they are.

MaxPool's Indices output is the flat index into the input (int32 unless
jax_enable_x64 is on).
"""


import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._regions import SlidingWindow, window_counts
from . import jax_dtype, register


def _spatial_attrs(node, x, kernel):
    """(strides, dilations, [(lo, hi)] pads) for the spatial dims of `x`, auto_pad resolved."""
    n = np.ndim(x) - 2
    if n < 1:
        raise node.fail(f"input of rank {np.ndim(x)} has no spatial dims")
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    pads = list(node.attr("pads", [0] * 2 * n))
    if len(kernel) != n or len(strides) != n or len(dilations) != n or len(pads) != 2 * n:
        raise node.fail(f"kernel_shape {kernel}, strides {strides}, dilations {dilations} and pads {pads} "
                        f"do not match the {n} spatial dims of input shape {np.shape(x)}")
    if min(strides + dilations + list(kernel), default=1) < 1 or min(pads, default=0) < 0:
        raise node.fail(f"strides {strides}, dilations {dilations} and kernel {kernel} must be positive "
                        f"and pads {pads} non-negative")
    auto_pad = node.attr("auto_pad", "NOTSET")
    size = np.shape(x)[2:]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pairs = [
            SlidingWindow(i, k, s, dilation=d).same_padding(upper=auto_pad == "SAME_UPPER")
            for i, s, k, d in zip(size, strides, kernel, dilations)
        ]
    elif auto_pad == "VALID":
        pairs = [(0, 0)] * n
    elif auto_pad == "NOTSET":
        pairs = list(zip(pads[:n], pads[n:]))
    else:
        raise node.fail(f"auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, got {auto_pad!r}")
    for i, k, d, (lo, hi) in zip(size, kernel, dilations, pairs):
        if SlidingWindow(i, k, 1, lo, hi, d).out_size < 1:
            raise node.fail(f"window {k} (dilation {d}) is larger than the padded input {i + lo + hi}")
    return strides, dilations, pairs


def _dimension_numbers(rank):
    spec = tuple(range(rank))
    return lax.ConvDimensionNumbers(spec, spec, spec)


@register("Conv", since=1)
def conv(node, x, w, b=None):
    if np.ndim(w) != np.ndim(x):
        raise node.fail(f"weight rank {np.ndim(w)} differs from input rank {np.ndim(x)}")
    kernel = list(node.attr("kernel_shape", np.shape(w)[2:]))
    if kernel != list(np.shape(w)[2:]):
        raise node.fail(f"kernel_shape {kernel} differs from the weight's spatial shape {np.shape(w)[2:]}")
    group = node.attr("group", 1)
    if group < 1 or np.shape(x)[1] != np.shape(w)[1] * group or np.shape(w)[0] % group:
        raise node.fail(f"input channels {np.shape(x)[1]}, weight shape {np.shape(w)} and group {group} disagree")
    strides, dilations, pads = _spatial_attrs(node, x, kernel)
    y = lax.conv_general_dilated(
        x, w, strides, pads, rhs_dilation=dilations,
        dimension_numbers=_dimension_numbers(np.ndim(x)), feature_group_count=group,
    )
    if b is not None:
        y = y + jnp.reshape(b, (-1,) + (1,) * (np.ndim(x) - 2))
    return y


@register("ConvTranspose", since=1)
def conv_transpose(node, x, w, b=None):
    n = np.ndim(x) - 2
    if np.ndim(w) != np.ndim(x):
        raise node.fail(f"weight rank {np.ndim(w)} differs from input rank {np.ndim(x)}")
    group = node.attr("group", 1)
    c_in, c_out_g, *kernel = np.shape(w)
    if group < 1 or np.shape(x)[1] != c_in or c_in % group:
        raise node.fail(f"input channels {np.shape(x)[1]}, weight shape {np.shape(w)} and group {group} disagree")
    kernel = list(node.attr("kernel_shape", kernel))
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    out_pad = list(node.attr("output_padding", [0] * n))
    pads = list(node.attr("pads", [0] * 2 * n))
    if not len(kernel) == len(strides) == len(dilations) == len(out_pad) == n or len(pads) != 2 * n:
        raise node.fail(f"kernel_shape, strides, dilations, output_padding and pads do not match {n} spatial dims")
    size = np.shape(x)[2:]
    full = [s * (i - 1) + op + (k - 1) * d + 1 for i, s, k, d, op in zip(size, strides, kernel, dilations, out_pad)]
    auto_pad = node.attr("auto_pad", "NOTSET")
    out_shape = node.attr("output_shape")
    if out_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out_shape = [i * s for i, s in zip(size, strides)]
    if out_shape is not None:
        out_shape = list(out_shape)[-n:]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            totals = [f - o for f, o in zip(full, out_shape)]
            lower = auto_pad == "SAME_LOWER"
            pads = [t - t // 2 if lower else t // 2 for t in totals] + [t // 2 if lower else t - t // 2 for t in totals]
        else:  # keep the leading pads, crop or extend at the end to reach output_shape
            pads = pads[:n] + [f - lo - o for f, lo, o in zip(full, pads[:n], out_shape)]
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise node.fail(f"auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, got {auto_pad!r}")
    # as a conv: dilate the input by the strides, flip the kernel, swap in/out channels per group
    rhs = jnp.flip(jnp.asarray(w), axis=tuple(range(2, n + 2)))
    rhs = rhs.reshape(group, c_in // group, c_out_g, *kernel)
    rhs = jnp.swapaxes(rhs, 1, 2).reshape(group * c_out_g, c_in // group, *kernel)
    padding = [((k - 1) * d - lo, (k - 1) * d - hi + op)
               for k, d, lo, hi, op in zip(kernel, dilations, pads[:n], pads[n:], out_pad)]
    y = lax.conv_general_dilated(
        x, rhs, [1] * n, padding, lhs_dilation=strides, rhs_dilation=dilations,
        dimension_numbers=_dimension_numbers(np.ndim(x)), feature_group_count=group,
    )
    if b is not None:
        y = y + jnp.reshape(b, (-1,) + (1,) * n)
    return y


def _pool_padding(node, x, kernel, strides, dilations, pads):
    """Pads with the ceil_mode overhang added at the high end (PyTorch semantics)."""
    if not node.attr("ceil_mode", 0):
        return pads
    windows = (SlidingWindow(i, k, s, lo, hi, d).ceil_mode()
               for i, k, s, d, (lo, hi) in zip(np.shape(x)[2:], kernel, strides, dilations, pads))
    return [(w.pad_lo, w.pad_hi) for w in windows]


def _window(node, x):
    kernel = list(node.attr("kernel_shape") or [])
    if not kernel:
        raise node.fail("kernel_shape is required")
    strides, dilations, pads = _spatial_attrs(node, x, kernel)
    if any(lo >= k or hi >= k for k, (lo, hi) in zip(kernel, pads)):
        raise node.fail(f"pads {node.attr('pads')} must be smaller than kernel_shape {kernel} "
                        "(a window entirely in the padding has no input)")
    full_pads = _pool_padding(node, x, kernel, strides, dilations, pads)
    return kernel, strides, dilations, pads, full_pads


def _lowest(dtype):
    return -np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min


def _flat_indices(shape, column_major):
    """Each element's flat index in `shape` (N, C, *spatial); spatial dims column-major if asked."""
    n, c, *spatial = shape
    order = np.arange(int(np.prod(spatial, dtype=np.int64)), dtype=np.int64)
    order = order.reshape(spatial[::-1]).transpose() if column_major else order.reshape(spatial)
    base = np.arange(n * c, dtype=np.int64).reshape(n, c, *([1] * len(spatial))) * order.size
    return jnp.asarray(base + order, dtype=jax_dtype(np.int64))


def _max_with_index(a, b):
    (av, ai), (bv, bi) = a, b
    take_b = (bv > av) | ((bv == av) & (bi < ai))
    return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)


@register("MaxPool", since=1)
def max_pool(node, x):
    order = node.attr("storage_order", 0)
    if order not in (0, 1):
        raise node.fail("storage_order must be 0 or 1")
    kernel, strides, dilations, _, pads = _window(node, x)
    window = dict(window_dimensions=(1, 1, *kernel), window_strides=(1, 1, *strides),
                  padding=((0, 0), (0, 0), *pads), window_dilation=(1, 1, *dilations))
    lowest = np.asarray(_lowest(x.dtype), x.dtype)
    if node.n_outputs == 1:
        return lax.reduce_window(x, lowest, lax.max, **window)
    index = _flat_indices(np.shape(x), column_major=order == 1)
    init = (lowest, np.asarray(np.iinfo(index.dtype).max, index.dtype))
    return lax.reduce_window((x, index), init, _max_with_index, **window)


@register("AveragePool", since=1)
def average_pool(node, x):
    kernel, strides, dilations, pads, full_pads = _window(node, x)
    dims = dict(window_dimensions=(1, 1, *kernel), window_strides=(1, 1, *strides),
                window_dilation=(1, 1, *dilations))
    total = lax.reduce_window(x, np.zeros((), x.dtype), lax.add, padding=((0, 0), (0, 0), *full_pads), **dims)
    # the divisor counts real pixels, plus explicit pads if count_include_pad (never the ceil overhang);
    # a box window's count is the product of per-axis counts
    include = node.attr("count_include_pad", 0)
    count = np.ones((), np.int64)
    for i, k, s, d, (lo, hi), n in zip(np.shape(x)[2:], kernel, strides, dilations, pads, np.shape(total)[2:]):
        count = np.multiply.outer(count, window_counts(SlidingWindow(i, k, s, lo, hi, d), n, include))
    if count.size and np.all(count == count.flat[0]):
        # every window counts alike: a division by the window size, which
        # swap_backend recognises as an average pool (the same bits)
        return total / x.dtype.type(count.flat[0])
    return total / count.astype(x.dtype)


def _global(reduce):
    def handler(node, x):
        if np.ndim(x) < 3:
            raise node.fail(f"input of rank {np.ndim(x)} has no spatial dims")
        return reduce(x, axis=tuple(range(2, np.ndim(x))), keepdims=True)

    return handler


register("GlobalAveragePool", since=1)(_global(jnp.mean))
register("GlobalMaxPool", since=1)(_global(jnp.max))


__all__ = ["conv", "conv_transpose", "max_pool", "average_pool"]
