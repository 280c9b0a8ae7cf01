"""Layer descriptions: what a selector or a `select=` predicate is shown.

`describe(eqn)` turns one jaxpr equation into a `Layer` (kind, shapes, and
for convolutions stride, padding, dilation and groups in NCHW terms), or `None`
when the equation is not a layer jtile knows. Kinds: `conv{1,2,3}d`
(`conv_general_dilated`), `dense` (`dot_general` of x with a 2-D weight, else
`matmul`), `maxpool2d` / `sumpool2d` (4-D `reduce_window_max` / `_sum`), and
the fused ops of `jtile._fused`. Each describer is the `describe` facet of
its primitive's `jtile._registry` entry.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from ._registry import facet, register


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer as jtile sees it. Convolution fields are `None` for other kinds."""

    kind: str
    name: str
    primitive: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    dtype: np.dtype
    index: int = 0
    in_channels: int | None = None
    out_channels: int | None = None
    kernel_size: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    padding: tuple[tuple[int, int], ...] | None = None
    dilation: tuple[int, ...] | None = None
    lhs_dilation: tuple[int, ...] | None = None
    groups: int | None = None
    batch_groups: int | None = None

    @property
    def label(self) -> str:
        """How errors name the layer: `conv2d #3 'layer1.0.conv1'`."""
        name = f" '{self.name}'" if self.name else ""
        return f"{self.kind} #{self.index}{name}"

    @property
    def weight_shape(self) -> tuple[int, ...] | None:
        return self.in_shapes[1] if len(self.in_shapes) > 1 else None


def scope_name(eqn) -> str:
    """The `jax.named_scope` path of `eqn`, or "" outside any scope."""
    return str(eqn.source_info.name_stack)


def _conv(eqn) -> Layer:
    p = eqn.params
    lhs_spec, rhs_spec, _ = p["dimension_numbers"]
    lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars)
    return Layer(
        kind=f"conv{len(lhs_spec) - 2}d",
        **layer_fields(eqn),
        in_channels=lhs[lhs_spec[1]],
        out_channels=rhs[rhs_spec[0]],
        kernel_size=tuple(rhs[d] for d in rhs_spec[2:]),
        stride=tuple(p["window_strides"]),
        padding=tuple(tuple(pad) for pad in p["padding"]),
        dilation=tuple(p["rhs_dilation"]),
        lhs_dilation=tuple(p["lhs_dilation"]),
        groups=p["feature_group_count"],
        batch_groups=p["batch_group_count"],
    )


def layer_fields(eqn) -> dict:
    """The `Layer` fields every kind shares: name, primitive, shapes, dtype."""
    return dict(
        name=scope_name(eqn),
        primitive=eqn.primitive.name,
        in_shapes=tuple(tuple(v.aval.shape) for v in eqn.invars),
        out_shape=tuple(eqn.outvars[0].aval.shape),
        dtype=np.dtype(eqn.outvars[0].aval.dtype),
    )


def dense_weight_axis(eqn) -> int | None:
    """The contracting axis of the weight if `eqn` is `x @ w` with a 2-D weight, else None."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    x, w = (v.aval for v in eqn.invars[:2])
    if lb or rb or w.ndim != 2 or tuple(lc) != (x.ndim - 1,) or len(rc) != 1:
        return None
    return rc[0]


def _describe_dot(eqn) -> Layer:
    w_contract = dense_weight_axis(eqn)
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    if w_contract is None:
        return Layer(kind="matmul", **layer_fields(eqn))
    return Layer(
        kind="dense",
        **layer_fields(eqn),
        in_channels=shapes[1][w_contract],
        out_channels=shapes[1][1 - w_contract],
    )


def pool_axes(eqn) -> tuple[int, int] | None:
    """The two spatial axes of a 4-D `reduce_window`: (2, 3) for NCHW, (1, 2) for NHWC."""
    p = eqn.params
    if eqn.invars[0].aval.ndim != 4:
        return None
    pooled = {
        d
        for d in range(4)
        if p["window_dimensions"][d] != 1 or p["window_strides"][d] != 1 or p["padding"][d] != (0, 0)
    }
    for axes in ((2, 3), (1, 2)):
        if pooled <= set(axes):
            return axes
    return None


def pool_window(eqn) -> dict:
    """Window, stride, padding and dilation of a 2-D pool along its spatial axes."""
    p, axes = eqn.params, pool_axes(eqn)
    return dict(
        kernel_size=tuple(p["window_dimensions"][a] for a in axes),
        stride=tuple(p["window_strides"][a] for a in axes),
        padding=tuple(tuple(p["padding"][a]) for a in axes),
        dilation=tuple(p["window_dilation"][a] for a in axes),
        lhs_dilation=tuple(p["base_dilation"][a] for a in axes),
    )


def _describe_pool(kind: str):
    def describe(eqn) -> Layer:
        axes = pool_axes(eqn)
        if axes is None:
            return Layer(kind=f"reduce_window_{kind}", **layer_fields(eqn))
        channels = eqn.invars[0].aval.shape[1 if axes == (2, 3) else 3]
        return Layer(
            kind=f"{kind}pool2d", **layer_fields(eqn), in_channels=channels, out_channels=channels,
            **pool_window(eqn),
        )

    return describe


register("conv_general_dilated", describe=_conv, weights=(1,), activations=(0,))
register("dot_general", describe=_describe_dot)
register("reduce_window_max", describe=_describe_pool("max"))
register("reduce_window_sum", describe=_describe_pool("sum"))


def describe(eqn, index: int = 0) -> Layer | None:
    """The `Layer` for `eqn`, numbered `index`, or `None` if it is not a layer
    (its registry entry has no `describe` facet)."""
    describer = facet(eqn, "describe")
    if describer is None:
        return None
    return dataclasses.replace(describer(eqn), index=index)
