"""Horizontal tiling of convolutions.

`tile_conv` replaces every `conv_general_dilated` by `tiles` convolutions over
stripes of its input along one output spatial axis, followed by one
`concatenate`: the Slice -> Conv x N -> Concat graph of Aidge's horizontal
tiling. Stripe windows come from `jtile._regions`; padding stays with the
stripe that touches that border, on that side only. Fused convolutions
(`conv_bias_act`, from `fuse` or `fold_params`) are tiled the same way, their
residual sliced with the output, so `tile_conv(fuse(f))` tiles every layer.

!!! warning

    Convolutions with `lhs_dilation` (transposed convolutions) or a
    `batch_group_count` are left unchanged; selecting one explicitly with
    `select=` raises `UnsupportedError`.
"""

import warnings
from collections.abc import Callable

from jax import lax

from . import _regions
from ._errors import ConfigError, UnsupportedError, reject_positional, reject_unknown, require_positive_int
from ._geometry import ConvGeometry
from ._graph import Graph
from ._interpreter import bind, transform
from ._layers import Layer

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


def _tile_one_conv(eqn, lhs, rhs, *epilogue, spatial: int, tiles: int):
    """Stripes of one conv (or fused `conv_bias_act`: its bias is per channel,
    its residual is sliced like the output), concatenated."""
    lhs_spec, _, out_spec = eqn.params["dimension_numbers"]
    in_axis, out_axis = lhs_spec[2 + spatial], out_spec[2 + spatial]
    sliding = ConvGeometry.of(eqn).axis(spatial)
    params = eqn.primitive.get_bind_params(eqn.params)
    stripes = []
    for window in _regions.split(sliding.out_size, tiles):
        region, pad = sliding.input_region(window)
        stripe = lax.slice_in_dim(lhs, region.start, region.stop, axis=in_axis)
        padding = list(params["padding"])
        padding[spatial] = pad
        rest = [*epilogue[:1], *(lax.slice_in_dim(r, window.start, window.stop, axis=out_axis) for r in epilogue[1:])]
        stripes.append(eqn.primitive.bind(stripe, rhs, *rest, **{**params, "padding": tuple(padding)}))
    return lax.concatenate(stripes, out_axis)


def _stripes(layer: Layer, eqn, axis, tiles: int, chosen: bool, strict: bool) -> tuple[int, int] | None:
    """`(spatial index, stripe count)` for one conv, or None to leave it whole."""
    if any(d != 1 for d in layer.lhs_dilation) or layer.batch_groups != 1:
        if not chosen:
            return None
        raise UnsupportedError(
            f"tile_conv: {layer.label} has lhs_dilation {layer.lhs_dilation} and "
            f"batch_group_count {layer.batch_groups}; only lhs_dilation 1 and "
            "batch_group_count 1 can be tiled. Leave it out of select="
        )
    out_spec = eqn.params["dimension_numbers"][2]
    spatial = _spatial_index(axis, layer, out_spec)
    extent = layer.out_shape[out_spec[2 + spatial]]
    if tiles > extent and (chosen or strict):
        raise ConfigError(
            f"tile_conv: {layer.label} has {extent} output rows along axis {out_spec[2 + spatial]}, "
            f"cannot make {tiles} tiles; use tiles <= {extent} or exclude it with select="
        )
    return spatial, min(tiles, extent)


def _plan(closed, axis, tiles: int, select, strict: bool) -> dict:
    """`{id(eqn): (spatial index, stripes)}` for every conv to tile; warns once
    about the layers with fewer output rows than `tiles`."""
    plan, clipped = {}, []
    graph = Graph.of(closed)
    layers = graph.described()
    for op in graph.all_ops():
        if op.primitive not in _TILED:
            continue
        layer = layers[id(op.eqn)]
        if select is not None and not select(layer):
            continue
        stripes = _stripes(layer, op.eqn, axis, tiles, select is not None, strict)
        if stripes is None:
            continue
        if stripes[1] > 1:
            plan[id(op.eqn)] = stripes
        if stripes[1] < tiles:
            clipped.append(f"{layer.label} ({stripes[1]})")
    if clipped:
        warnings.warn(
            f"tile_conv: {len(clipped)} layer(s) have fewer than {tiles} output rows and get "
            f"fewer stripes (in brackets): {', '.join(clipped)}. Pass strict=True to raise instead, "
            "or select= to choose the layers to tile",
            TilingWarning, stacklevel=4,
        )
    return plan


_TILED = ("conv_general_dilated", "conv_bias_act")


class TilingWarning(UserWarning):
    """A transform tiled a layer less than asked (see the message)."""


def tile_conv(
    fn: Callable | None = None,
    /,
    *positional,
    axis: str | int | None = None,
    tiles: int | None = None,
    select: Callable[[Layer], bool] | None = None,
    strict: bool = False,
    **unknown,
) -> Callable:
    """Split every convolution of `fn` into `tiles` stripes along output axis `axis`.

    **Arguments:**

    - `fn`: the function to transform. Omit it to use `tile_conv` as a decorator.
    - `axis`: `"H"`, `"W"` (`"D"` for 3-D convs), or an int index of a spatial
        dimension of the conv's output under its dimension numbers.
    - `tiles`: number of stripes; they differ in size by at most one row.
    - `select`: optional predicate on a `jtile.Layer`; only convs it accepts are tiled,
        and each must have at least `tiles` output rows.
    - `strict`: without `select`, a conv with fewer output rows than `tiles` gets one
        stripe per row (a 1-row conv stays whole) and one `TilingWarning` lists them;
        `strict=True` raises instead.

    **Returns:** a function with `fn`'s signature and outputs.
    """
    reject_positional("tile_conv", fn, positional, "axis='H', tiles=4")
    reject_unknown("tile_conv", unknown, ("axis", "tiles", "select", "strict"))
    if axis is None or tiles is None:
        raise ConfigError("tile_conv: both axis= and tiles= are required, e.g. axis='H', tiles=4")
    require_positive_int("tile_conv", "tiles", tiles)
    _check_axis(axis)
    if select is not None and not callable(select):
        raise ConfigError(f"tile_conv: select must be a predicate on jtile.Layer, got {select!r}")
    if fn is None:
        return lambda f: tile_conv(f, axis=axis, tiles=tiles, select=select, strict=strict)
    plans: dict = {}

    def make_rules(closed):
        if id(closed) not in plans or plans[id(closed)][0] is not closed:
            plans[id(closed)] = (closed, _plan(closed, axis, tiles, select, strict))
        plan = plans[id(closed)][1]

        def conv(eqn, *invals):
            if id(eqn) not in plan:
                return bind(eqn, *invals)[0]
            spatial, stripes = plan[id(eqn)]
            return _tile_one_conv(eqn, *invals, spatial=spatial, tiles=stripes)

        return dict.fromkeys(_TILED, conv)

    return transform(fn, "tile_conv", make_rules, refuse={
        "swap_backend": "kernel calls cannot be tiled; apply tile_conv first, swap_backend(tile_conv(f)) last",
    })


__all__ = ["TilingWarning", "tile_conv"]
