"""Layer descriptions: what a selector or a `select=` predicate is shown.

`describe(eqn)` turns one jaxpr equation into a `Layer` (kind, shapes, and for
convolutions stride, padding, dilation and groups in NCHW terms), or `None`
when the equation is not a layer jtile knows.
"""

import dataclasses
from collections.abc import Callable

import numpy as np


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
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars)
    spatial = len(lhs_spec) - 2
    return Layer(
        kind=f"conv{spatial}d",
        name=scope_name(eqn),
        primitive=eqn.primitive.name,
        in_shapes=(lhs, rhs),
        out_shape=tuple(eqn.outvars[0].aval.shape),
        dtype=np.dtype(eqn.outvars[0].aval.dtype),
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


_DESCRIBERS: dict[str, Callable] = {"conv_general_dilated": _conv}


def register_describer(primitive: str, describer: Callable) -> None:
    """Teach `describe` a new primitive (used by kernel and analysis modules)."""
    _DESCRIBERS[primitive] = describer


def describe(eqn, index: int = 0) -> Layer | None:
    """The `Layer` for `eqn`, numbered `index`, or `None` if it is not a layer."""
    describer = _DESCRIBERS.get(eqn.primitive.name)
    if describer is None:
        return None
    return dataclasses.replace(describer(eqn), index=index)
