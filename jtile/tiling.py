"""Horizontal tiling of convolutions.

`tile_conv` replaces every `conv_general_dilated` by `tiles` convolutions over
stripes of its input along one output spatial axis, followed by one
`concatenate`: the Slice -> Conv x N -> Concat graph of Aidge's horizontal
tiling. Stripe windows come from `jtile._regions`; padding stays with the
stripe that touches that border, on that side only.

!!! warning

    Convolutions with `lhs_dilation` (transposed convolutions) or a
    `batch_group_count` are left unchanged; selecting one explicitly with
    `select=` raises `UnsupportedError`.
"""

import itertools
from collections.abc import Callable

from jax import lax

from . import _regions
from ._errors import ConfigError, UnsupportedError, reject_positional, reject_unknown, require_positive_int
from ._interpreter import bind, transform
from ._layers import Layer, describe

_AXIS_NAMES = {"W": -1, "H": -2, "D": -3}


def _check_axis(axis) -> None:
    if isinstance(axis, bool) or not isinstance(axis, (str, int)) or (
        isinstance(axis, str) and axis not in _AXIS_NAMES
    ):
        raise ConfigError(
            f"tile_conv: axis must be 'H', 'W', 'D' or an int index of a spatial output "
            f"dimension, got {axis!r}"
        )


def _spatial_index(axis, layer: Layer, out_spec: tuple[int, ...]) -> int:
    """Position of `axis` among the conv's spatial dims, or a ConfigError."""
    spatial_dims = tuple(out_spec[2:])
    if isinstance(axis, str):
        position = _AXIS_NAMES[axis] + len(spatial_dims)
        if position < 0:
            raise ConfigError(
                f"tile_conv: {layer.label} has {len(spatial_dims)} spatial dim(s), so it "
                f"has no axis {axis!r}; use one of {list(_AXIS_NAMES)[: len(spatial_dims)]}"
            )
        return position
    rank = len(out_spec)
    index = axis + rank if -rank <= axis < 0 else axis
    if index not in spatial_dims:
        raise ConfigError(
            f"tile_conv: axis {axis} is not a spatial dimension of {layer.label} (output "
            f"shape {layer.out_shape}); its spatial output axes are {spatial_dims}"
        )
    return spatial_dims.index(index)


def _tile_one_conv(eqn, lhs, rhs, *, spatial: int, tiles: int, layer: Layer):
    lhs_spec, _, out_spec = eqn.params["dimension_numbers"]
    in_axis, out_axis = lhs_spec[2 + spatial], out_spec[2 + spatial]
    extent = layer.out_shape[out_axis]
    if tiles > extent:
        raise ConfigError(
            f"tile_conv: {layer.label} has {extent} output rows along axis {out_axis}, "
            f"cannot make {tiles} tiles; use tiles <= {extent} or exclude it with select="
        )
    sliding = _regions.conv_axis(eqn, spatial)
    params = eqn.primitive.get_bind_params(eqn.params)
    stripes = []
    for window in _regions.split(extent, tiles):
        region, pad = sliding.input_region(window)
        stripe = lax.slice_in_dim(lhs, region.start, region.stop, axis=in_axis)
        padding = list(params["padding"])
        padding[spatial] = pad
        stripes.append(eqn.primitive.bind(stripe, rhs, **{**params, "padding": tuple(padding)}))
    return lax.concatenate(stripes, out_axis)


def _conv_rules(axis, tiles: int, select: Callable[[Layer], bool] | None):
    counter = itertools.count()

    def conv(eqn, lhs, rhs):
        layer = describe(eqn, next(counter))
        if select is not None and not select(layer):
            return bind(eqn, lhs, rhs)[0]
        if any(d != 1 for d in layer.lhs_dilation) or layer.batch_groups != 1:
            if select is None:
                return bind(eqn, lhs, rhs)[0]
            raise UnsupportedError(
                f"tile_conv: {layer.label} has lhs_dilation {layer.lhs_dilation} and "
                f"batch_group_count {layer.batch_groups}; only lhs_dilation 1 and "
                "batch_group_count 1 can be tiled. Leave it out of select="
            )
        spatial = _spatial_index(axis, layer, eqn.params["dimension_numbers"][2])
        return _tile_one_conv(eqn, lhs, rhs, spatial=spatial, tiles=tiles, layer=layer)

    return {"conv_general_dilated": conv}


def tile_conv(
    fn: Callable | None = None,
    /,
    *positional,
    axis: str | int | None = None,
    tiles: int | None = None,
    select: Callable[[Layer], bool] | None = None,
    **unknown,
) -> Callable:
    """Split every convolution of `fn` into `tiles` stripes along output axis `axis`.

    **Arguments:**

    - `fn`: the function to transform. Omit it to use `tile_conv` as a decorator.
    - `axis`: `"H"`, `"W"` (`"D"` for 3-D convs), or an int index of a spatial
        dimension of the conv's output under its dimension numbers.
    - `tiles`: number of stripes; they differ in size by at most one row.
    - `select`: optional predicate on a `jtile.Layer`; only convs it accepts are tiled.

    **Returns:** a function with `fn`'s signature and outputs.
    """
    reject_positional("tile_conv", fn, positional, "axis='H', tiles=4")
    reject_unknown("tile_conv", unknown, ("axis", "tiles", "select"))
    if axis is None or tiles is None:
        raise ConfigError("tile_conv: both axis= and tiles= are required, e.g. axis='H', tiles=4")
    require_positive_int("tile_conv", "tiles", tiles)
    _check_axis(axis)
    if select is not None and not callable(select):
        raise ConfigError(f"tile_conv: select must be a predicate on jtile.Layer, got {select!r}")
    if fn is None:
        return lambda f: tile_conv(f, axis=axis, tiles=tiles, select=select)
    return transform(fn, "tile_conv", lambda closed: _conv_rules(axis, tiles, select))


__all__ = ["tile_conv"]
