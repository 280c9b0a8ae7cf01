"""Geometry of a layer's equation, parsed in one place.

`ConvGeometry.of(eqn)` reads a `conv_general_dilated` (or the conv of a fused
`conv_bias_act`) once into canonical NCHW / OIHW terms: shapes, strides,
padding, dilations, groups, and the dimension numbers that map them back.
`DotGeometry.of(eqn)` views a `dot_general` as a batch of `(M, K) @ (K, N)`
products. `PoolGeometry.of(eqn)` reads a 2-D `reduce_window` along its
spatial axes. Layer descriptions, MAC counts, region rules, ONNX emitters and
kernel selection all read these rather than the equation's params.

!!! warning

    These describe shapes and windows only; what the op computes (its
    dtype, its precision, an activation) stays with the equation.
"""

import dataclasses
import math

from ._regions import SlidingWindow, pool_axes
from ._registry import register


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """A convolution in canonical order: `in_shape` (N, C, *spatial),
    `w_shape` (O, I / groups, *window), `out_shape` (N, O, *spatial)."""

    lhs_spec: tuple[int, ...]
    rhs_spec: tuple[int, ...]
    out_spec: tuple[int, ...]
    in_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    batch_groups: int

    @classmethod
    def of(cls, eqn) -> "ConvGeometry":
        p = eqn.params
        lhs_spec, rhs_spec, out_spec = (tuple(s) for s in p["dimension_numbers"])
        lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars[:2])
        out = tuple(eqn.outvars[0].aval.shape)
        return cls(
            lhs_spec, rhs_spec, out_spec,
            in_shape=tuple(lhs[d] for d in lhs_spec),
            w_shape=tuple(rhs[d] for d in rhs_spec),
            out_shape=tuple(out[d] for d in out_spec),
            stride=tuple(p["window_strides"]),
            padding=tuple(tuple(pad) for pad in p["padding"]),
            lhs_dilation=tuple(p["lhs_dilation"]),
            dilation=tuple(p["rhs_dilation"]),
            groups=p["feature_group_count"],
            batch_groups=p["batch_group_count"],
        )

    @property
    def window(self) -> tuple[int, ...]:
        return self.w_shape[2:]

    def axis(self, spatial: int) -> SlidingWindow:
        """The `SlidingWindow` along spatial dim `spatial` (0 is the first)."""
        lo, hi = self.padding[spatial]
        return SlidingWindow(self.in_shape[2 + spatial], self.window[spatial], self.stride[spatial], lo, hi,
                             self.dilation[spatial])

    @property
    def macs(self) -> int:
        """Output elements x input channels per group x window (zeros of `lhs_dilation` included)."""
        return math.prod(self.out_shape) * math.prod(self.w_shape[1:])


@dataclasses.dataclass(frozen=True)
class DotGeometry:
    """A `dot_general` as `batch` products `(M, K) @ (K, N)`: the lhs free dims
    make M, the contracting dims K, the rhs free dims N."""

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]
    batch: int
    m: int
    k: int
    n: int

    @classmethod
    def of(cls, eqn) -> "DotGeometry":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        ls, rs = (tuple(v.aval.shape) for v in eqn.invars[:2])
        lf = tuple(d for d in range(len(ls)) if d not in lc and d not in lb)
        rf = tuple(d for d in range(len(rs)) if d not in rc and d not in rb)
        size = lambda shape, dims: math.prod(shape[d] for d in dims)  # noqa: E731
        return cls(tuple(lc), tuple(rc), tuple(lb), tuple(rb), lf, rf,
                   size(ls, lb), size(ls, lf), size(ls, lc), size(rs, rf))

    @property
    def macs(self) -> int:
        return self.batch * self.m * self.k * self.n


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """A 2-D `reduce_window` along its spatial `axes` ((2, 3) for NCHW, (1, 2) for NHWC)."""

    axes: tuple[int, int]
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[tuple[int, int], tuple[int, int]]
    dilation: tuple[int, int]
    lhs_dilation: tuple[int, int]

    @classmethod
    def of(cls, eqn) -> "PoolGeometry | None":
        """The geometry, or None when the window is not 2-D spatial."""
        p, axes = eqn.params, pool_axes(eqn)
        if axes is None:
            return None
        pick = lambda name: tuple(p[name][a] for a in axes)  # noqa: E731
        return cls(axes, pick("window_dimensions"), pick("window_strides"),
                   tuple(tuple(p["padding"][a]) for a in axes), pick("window_dilation"), pick("base_dilation"))

    def fields(self) -> dict:
        """The `jtile.Layer` fields of this pool."""
        return dict(kernel_size=self.kernel_size, stride=self.stride, padding=self.padding,
                    dilation=self.dilation, lhs_dilation=self.lhs_dilation)


for _name, _geometry in (("conv_general_dilated", ConvGeometry), ("conv_bias_act", ConvGeometry),
                         ("dot_general", DotGeometry), ("dense", DotGeometry),
                         ("reduce_window_max", PoolGeometry), ("reduce_window_sum", PoolGeometry)):
    register(_name, geometry=_geometry.of)
