"""Receptive-field algebra: which input window an output window needs.

One question per primitive: to produce output rows `[start, stop)` along one
spatial axis, which input rows are read, and what padding is left at each
border? For a sliding window (convolution, `reduce_window`):

    in_start = out_start * stride - pad_lo
    in_size  = (out_size - 1) * stride + (window - 1) * dilation + 1

clamped to the input, the overflow becoming that tile's own padding, so a tile
that touches a border keeps the padding on that side only.

!!! warning

    Only sliding windows along one axis are described here; a reduction over
    the tiled axis has no finite window and stops a tiled block.
"""

import dataclasses

import numpy as np

from ._registry import register


@dataclasses.dataclass(frozen=True)
class Window:
    """Rows `[start, stop)` of one axis."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """One spatial axis of a sliding-window op: sizes, stride, padding, dilation."""

    in_size: int
    window: int
    stride: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    dilation: int = 1

    @property
    def span(self) -> int:
        """Input rows one output row reads: the window with its dilation gaps."""
        return (self.window - 1) * self.dilation + 1

    @property
    def out_size(self) -> int:
        return (self.in_size + self.pad_lo + self.pad_hi - self.span) // self.stride + 1

    def same_padding(self, upper: bool = True) -> tuple[int, int]:
        """(lo, hi) padding giving `ceil(in_size / stride)` outputs, the odd row
        at the high end (`upper`, ONNX SAME_UPPER / TF SAME) or the low end."""
        total = max((-(-self.in_size // self.stride) - 1) * self.stride + self.span - self.in_size, 0)
        small, big = total // 2, total - total // 2
        return (small, big) if upper else (big, small)

    def ceil_mode(self) -> "SlidingWindow":
        """This window with `pad_hi` grown to count outputs rounding up (PyTorch's
        ceil_mode): a last, partial window is kept if it starts inside the input
        or the low padding."""
        padded = self.in_size + self.pad_lo + self.pad_hi
        count = -(-(padded - self.span) // self.stride) + 1
        if (count - 1) * self.stride >= self.in_size + self.pad_lo:
            count -= 1
        extra = max((count - 1) * self.stride + self.span - padded, 0)
        return dataclasses.replace(self, pad_hi=self.pad_hi + extra)

    def live_taps(self) -> "tuple[int, int, SlidingWindow] | None":
        """`(first, last, cropped)`: the window taps that read an input row for
        some output (tap `j` reads rows `o * stride - pad_lo + j * dilation`),
        and this window with the taps outside `[first, last]` removed and the
        padding adjusted so every output reads the same rows (a single tap
        left has dilation 1). None when every tap is live. The cropped
        padding is negative where leading or trailing input rows are no longer
        read: its `input_region` of all outputs then slices them off."""
        last_row = (self.out_size - 1) * self.stride - self.pad_lo
        live = [j for j in range(self.window)
                if j * self.dilation - self.pad_lo < self.in_size and last_row + j * self.dilation >= 0]
        if not live or len(live) == self.window:
            return None
        first, last = live[0], live[-1]
        lo, hi = self.pad_lo - first * self.dilation, self.pad_hi - (self.window - 1 - last) * self.dilation
        window = last - first + 1
        dilation = self.dilation if window > 1 else 1
        return first, last, dataclasses.replace(self, window=window, pad_lo=lo, pad_hi=hi, dilation=dilation)

    def tap_bands(self) -> list[tuple[Window, int]]:
        """`[(outputs, live taps)]`: the output rows cut into maximal runs that
        read the input through the same taps, each with its count of live taps.
        A dilated window on a small input (DeepLabV3's 3x3 at dilation 12 on a
        14x14 map) reads mostly padding: rows 0-1 through 2 taps, 2-11 through
        1, 12-13 through 2."""
        def taps(out: int) -> tuple[int, ...]:
            first = out * self.stride - self.pad_lo
            return tuple(j for j in range(self.window) if 0 <= first + j * self.dilation < self.in_size)

        bands, start = [], 0
        for out in range(1, self.out_size + 1):
            if out == self.out_size or taps(out) != taps(start):
                bands.append((Window(start, out), len(taps(start))))
                start = out
        return bands

    def live_reads(self) -> int:
        """Output rows times the taps each reads the input through, summed:
        `out_size * window` where no tap reads padding."""
        return sum(win.size * live for win, live in self.tap_bands())

    def read_through(self, rows: Window, whole: int) -> "SlidingWindow":
        """The same windows over an input of `whole` rows of which this axis's
        input is `rows`: the crop folded into the padding, negative where it
        starts or ends inside (a conv reading its input's crop in place)."""
        return dataclasses.replace(self, in_size=whole, pad_lo=self.pad_lo - rows.start,
                                   pad_hi=self.pad_hi - (whole - rows.stop))

    def input_region(self, out: Window) -> tuple[Window, tuple[int, int]]:
        """The input rows `out` reads, and the (lo, hi) padding left to this tile."""
        start = out.start * self.stride - self.pad_lo
        stop = start + (out.size - 1) * self.stride + self.span
        if stop <= 0:  # the tile reads only low padding
            return Window(0, 0), (stop - start, 0)
        if start >= self.in_size:  # only high padding
            return Window(self.in_size, self.in_size), (0, stop - start)
        lo, hi = max(start, 0), min(stop, self.in_size)
        return Window(lo, hi), (lo - start, stop - hi)


def split(extent: int, tiles: int) -> list[Window]:
    """`tiles` consecutive windows covering `[0, extent)`, sizes differing by at most one."""
    base, extra = divmod(extent, tiles)
    bounds = [0]
    for i in range(tiles):
        bounds.append(bounds[-1] + base + (i < extra))
    return [Window(a, b) for a, b in zip(bounds, bounds[1:])]


def adaptive(extent: int, out: int) -> list[Window]:
    """PyTorch's adaptive-pool windows: window i is `[floor(i*n/out), ceil((i+1)*n/out))`."""
    return [Window(i * extent // out, -(-(i + 1) * extent // out)) for i in range(out)]


def centered(size: int) -> tuple[int, int]:
    """(lo, hi) padding that centres a window of `size` on each element (ONNX LRN's)."""
    return (size - 1) // 2, size // 2


def window_counts(sliding: SlidingWindow, out_size: int, include_pad: bool) -> "np.ndarray":
    """Per output position, how many taps of the window land on the input (or on
    the input and its explicit padding, with `include_pad`): an average pool's
    divisor along one axis."""
    taps = (np.arange(out_size) * sliding.stride - sliding.pad_lo)[:, None]
    taps = taps + np.arange(sliding.window)[None, :] * sliding.dilation
    lo, hi = (-sliding.pad_lo, sliding.in_size + sliding.pad_hi) if include_pad else (0, sliding.in_size)
    return ((taps >= lo) & (taps < hi)).sum(axis=1)


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


# ------------------------------------------------ stripes held one per device (jtile.sharding)


def reduce_window_axis(eqn, axis: int) -> SlidingWindow:
    """The `SlidingWindow` of a `reduce_window_*` along operand axis `axis`."""
    p = eqn.params
    pad_lo, pad_hi = p["padding"][axis]
    return SlidingWindow(
        in_size=eqn.invars[0].aval.shape[axis],
        window=p["window_dimensions"][axis],
        stride=p["window_strides"][axis],
        pad_lo=pad_lo,
        pad_hi=pad_hi,
        dilation=p["window_dilation"][axis],
    )


@dataclasses.dataclass(frozen=True)
class Halo:
    """What device `i` of `devices` reads when each holds one stripe of rows.

    Device `i` holds input rows `[i*in_rows, (i+1)*in_rows)` (the last stripes
    end in padding when the rows do not divide) and computes output rows
    `[i*out_rows, (i+1)*out_rows)`, the layout XLA gives an unevenly sharded
    axis. It reads `lo` rows below its stripe and `hi` above; of those,
    `fetch_lo` / `fetch_hi` are real rows of its neighbours, the rest border
    padding. Its window starts `offset(i)` rows into that extended stripe.
    """

    window: SlidingWindow
    devices: int
    in_rows: int
    out_rows: int
    lo: int
    hi: int
    fetch_lo: int
    fetch_hi: int

    @property
    def window_lo(self) -> int:
        """Rows a window reads below the rows its outputs stride over (its low padding)."""
        return self.window.pad_lo

    @property
    def window_hi(self) -> int:
        """Rows a window reads above the rows its outputs stride over."""
        return self.window.span - self.window.stride - self.window.pad_lo

    @property
    def read_rows(self) -> int:
        """Input rows one device's window reads, padding included."""
        return (self.out_rows - 1) * self.window.stride + self.window.span

    def offset(self, i):
        """Where device `i`'s window starts in its extended stripe (`i` may be traced)."""
        return i * (self.out_rows * self.window.stride - self.in_rows) - self.window.pad_lo + self.lo


def stripe_halo(window: SlidingWindow, devices: int) -> Halo:
    """The `Halo` of `window` over `devices` stripes. `fetch_lo` or `fetch_hi`
    larger than `in_rows` means a window reaches past the neighbouring stripe."""
    sw, n = window, devices
    in_rows, out_rows = -(-sw.in_size // n), -(-sw.out_size // n)
    real = [i for i in range(n) if i * out_rows < sw.out_size]  # devices with output rows
    starts = {i: i * out_rows * sw.stride - sw.pad_lo for i in real}
    stops = {i: starts[i] + (out_rows - 1) * sw.stride + sw.span for i in real}
    return Halo(
        window=sw,
        devices=n,
        in_rows=in_rows,
        out_rows=out_rows,
        lo=max([0] + [i * in_rows - starts[i] for i in real]),
        hi=max([0] + [stops[i] - (i + 1) * in_rows for i in real]),
        fetch_lo=max([0] + [i * in_rows - max(starts[i], 0) for i in real if i > 0]),
        fetch_hi=max([0] + [min(stops[i], sw.in_size) - (i + 1) * in_rows for i in real if i < n - 1]),
    )


# ---------------------------------------------------------------- region rules
#
# The multi-layer question (`tile_spatial`): to produce one tile of an op's
# output, given as a window along each tiled axis, which window of each operand
# is read, and with which params does the op run on that tile? One rule per
# primitive, the `region` facet of its `jtile._registry` entry; a primitive
# without one ends a tiled block (with a warning), and a rule raising `Stop`
# ends it quietly (a reduction or a reshape across space, a product over a
# spatial axis).
#
# A rule is `rule(eqn, axes, windows, clamp) -> Region`. `axes` are the output
# dims being tiled and `windows` one `Window` per axis. With `clamp` (unrolled
# tiles) operand windows are clipped to the operand and the overflow becomes
# the op's own padding for this tile, on the border sides only. Without it
# (looped tiles, all one shape) windows may reach outside the operand, the op
# runs unpadded along the tiled axes, and `Region.fill` says which value the
# reader must put where the operand has no element (the op's padding value).


class Stop(Exception):
    """This op cannot be tiled along these axes: a tiled block ends before it."""


@dataclasses.dataclass(frozen=True)
class Region:
    """What one tile of an op reads and how the op runs on it.

    `operands[j]` is `None` when operand `j` is read whole, else one entry per
    tiled axis: `(dim, Window)` for the operand dim and window read, or `None`
    when the operand is broadcast along that axis (size 1 or absent).
    `fill[j]` is `None` or `fill(invals)`, the value operand `j` takes outside
    its extent (only without `clamp`). `params` are the bind params for the tile.
    """

    operands: tuple
    params: dict
    fill: tuple


def hull(windows) -> Window:
    """The smallest window containing every one of `windows` (empty ones count only if all are)."""
    windows = [w for w in windows if w.size > 0] or list(windows)
    return Window(min(w.start for w in windows), max(w.stop for w in windows))


def _shape(v) -> tuple[int, ...]:
    return tuple(v.aval.shape)


def _tile_shape(eqn, axes, windows) -> tuple[int, ...]:
    shape = list(_shape(eqn.outvars[0]))
    for d, w in zip(axes, windows):
        shape[d] = w.size
    return tuple(shape)


def _const_fill(value):
    return lambda invals: value


def _padded(sliding: SlidingWindow, out: Window, clamp: bool) -> tuple[Window, tuple[int, int]]:
    """The input window of a sliding window: clipped with its pads, or unclipped with none."""
    if out.size == 0:  # a tile made of padding only reads nothing
        start = min(max(out.start * sliding.stride - sliding.pad_lo, 0), sliding.in_size) if clamp else out.start
        return Window(start, start), (0, 0)
    if clamp:
        return sliding.input_region(out)
    start = out.start * sliding.stride - sliding.pad_lo
    return Window(start, start + (out.size - 1) * sliding.stride + sliding.span), (0, 0)


def _same_dims(eqn, axes, windows, operand: int):
    """The operand read at the output's own dims (elementwise), broadcast where it has size 1."""
    v = eqn.invars[operand]
    shape, out = _shape(v), _shape(eqn.outvars[0])
    if not shape:
        return None
    if len(shape) != len(out):
        raise Stop(f"operand {operand} has rank {len(shape)}, the output {len(out)}")
    return tuple((d, w) if shape[d] == out[d] else None for d, w in zip(axes, windows))


def elementwise(eqn, axes, windows, clamp) -> Region:
    """Every operand at the same position (scalars and size-1 dims broadcast)."""
    operands = tuple(_same_dims(eqn, axes, windows, j) for j in range(len(eqn.invars)))
    return Region(operands, eqn.params, (None,) * len(operands))


def _sliding_rule(eqn, axes, windows, clamp, *, geometry, padded: int, fill, with_pads) -> Region:
    """One padded operand read through a `SlidingWindow` per tiled axis (`geometry(d)` gives
    `(operand dim, SlidingWindow)` for output dim `d`); other operands per `elementwise`."""
    reads, pads = [], {}
    for d, w in zip(axes, windows):
        dim, sliding = geometry(d)
        region, pads[dim] = _padded(sliding, w, clamp)
        reads.append((dim, region))
    operands = [None] * len(eqn.invars)
    operands[padded] = tuple(reads)
    fills = [None] * len(eqn.invars)
    fills[padded] = None if clamp else fill
    return Region(tuple(operands), with_pads(dict(eqn.params), pads), tuple(fills))


def _conv_geometry(eqn):
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    lhs, rhs = _shape(eqn.invars[0]), _shape(eqn.invars[1])

    def geometry(d):
        if d not in out_spec[2:]:
            raise Stop(f"dim {d} is not a spatial dim of the convolution")
        k = list(out_spec[2:]).index(d)
        if p["lhs_dilation"][k] != 1:
            raise Stop("a transposed convolution (lhs_dilation) is not tiled")
        lo, hi = p["padding"][k]
        sliding = SlidingWindow(lhs[lhs_spec[2 + k]], rhs[rhs_spec[2 + k]], p["window_strides"][k], lo, hi,
                                p["rhs_dilation"][k])
        return lhs_spec[2 + k], sliding

    def with_pads(params, pads):
        padding = list(params["padding"])
        for dim, pad in pads.items():
            padding[list(lhs_spec[2:]).index(dim)] = pad
        return {**params, "padding": tuple(padding)}

    return geometry, with_pads


def conv(eqn, axes, windows, clamp) -> Region:
    """`conv_general_dilated` (and `conv_bias_act`: bias and residual read elementwise)."""
    geometry, with_pads = _conv_geometry(eqn)
    region = _sliding_rule(eqn, axes, windows, clamp, geometry=geometry, padded=0, fill=_const_fill(0),
                           with_pads=with_pads)
    extra = [_same_dims(eqn, axes, windows, j) for j in range(2, len(eqn.invars))]
    return dataclasses.replace(region, operands=(*region.operands[:2], *extra))


_POOL_FILL = {"reduce_window_max": -float("inf"), "reduce_window_min": float("inf"), "reduce_window_sum": 0}


def reduce_window(eqn, axes, windows, clamp) -> Region:
    """`reduce_window_{max,min,sum}`: a sliding window per dim, padding with the reduction's identity."""
    p = eqn.params
    size = _shape(eqn.invars[0])

    def geometry(d):
        if p["base_dilation"][d] != 1:
            raise Stop("a base-dilated reduce_window is not tiled")
        lo, hi = p["padding"][d]
        return d, SlidingWindow(size[d], p["window_dimensions"][d], p["window_strides"][d], lo, hi,
                                p["window_dilation"][d])

    def with_pads(params, pads):
        padding = list(params["padding"])
        for dim, pad in pads.items():
            padding[dim] = pad
        return {**params, "padding": tuple(padding)}

    return _sliding_rule(eqn, axes, windows, clamp, geometry=geometry, padded=0,
                         fill=_const_fill(_POOL_FILL[eqn.primitive.name]), with_pads=with_pads)


def pad(eqn, axes, windows, clamp) -> Region:
    """`pad` (negative widths crop): a window of 1 shifted by the low padding; the
    padding value comes from operand 1."""
    config = eqn.params["padding_config"]
    size = _shape(eqn.invars[0])

    def geometry(d):
        lo, hi, interior = config[d]
        if interior:
            raise Stop("interior padding along a tiled axis is not tiled")
        return d, SlidingWindow(size[d], 1, 1, lo, hi)

    def with_pads(params, pads):
        new = list(params["padding_config"])
        for dim in axes:
            new[dim] = (*pads[dim], 0)
        return {**params, "padding_config": tuple(new)}

    return _sliding_rule(eqn, axes, windows, clamp, geometry=geometry, padded=0,
                         fill=lambda invals: invals[1], with_pads=with_pads)


def broadcast_in_dim(eqn, axes, windows, clamp) -> Region:
    """`broadcast_in_dim`: the operand dim mapped to a tiled dim is read there, unless it has size 1."""
    dims, shape, out = eqn.params["broadcast_dimensions"], _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    reads = []
    for d, w in zip(axes, windows):
        j = dims.index(d) if d in dims else None
        reads.append(None if j is None or shape[j] != out[d] else (j, w))
    operands = (tuple(reads), *([None] * (len(eqn.invars) - 1)))
    params = {**eqn.params, "shape": _tile_shape(eqn, axes, windows)}
    return Region(operands, params, (None,) * len(eqn.invars))


def _mapped(eqn, axes, windows, dim_of) -> Region:
    """A one-operand op whose output dim `d` is operand dim `dim_of(d)`."""
    reads = tuple((dim_of(d), w) for d, w in zip(axes, windows))
    return Region((reads, *([None] * (len(eqn.invars) - 1))), eqn.params, (None,) * len(eqn.invars))


def transpose(eqn, axes, windows, clamp) -> Region:
    return _mapped(eqn, axes, windows, lambda d: eqn.params["permutation"][d])


def _kept_dims(removed, rank: int):
    kept = [d for d in range(rank) if d not in set(removed)]
    return lambda d: kept[d]


def reduce(eqn, axes, windows, clamp) -> Region:
    """`reduce_*` / `argmax` over untiled dims (over a tiled dim no output dim maps back: a stop)."""
    return _mapped(eqn, axes, windows, _kept_dims(eqn.params["axes"], len(_shape(eqn.invars[0]))))


def squeeze(eqn, axes, windows, clamp) -> Region:
    return _mapped(eqn, axes, windows, _kept_dims(eqn.params["dimensions"], len(_shape(eqn.invars[0]))))


def concatenate(eqn, axes, windows, clamp) -> Region:
    """Along an untiled dim (channels): every operand at the same window."""
    if eqn.params["dimension"] in axes:
        raise Stop("concatenation along a tiled axis")
    return elementwise(eqn, axes, windows, clamp)


def split_op(eqn, axes, windows, clamp) -> Region:
    if eqn.params["axis"] in axes:
        raise Stop("split along a tiled axis")
    return _mapped(eqn, axes, windows, lambda d: d)


def dot_general(eqn, axes, windows, clamp) -> Region:
    """A product whose free or batch dims are tiled (a per-pixel dense layer); a
    contraction over a tiled dim has no output dim mapping back to it: a stop."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    free = [[d for d in range(len(_shape(v))) if d not in set(c) | set(b)]
            for v, c, b in zip(eqn.invars, (lc, rc), (lb, rb))]
    # output dims: batch, lhs free, rhs free
    owners = [(0, d, 1, e) for d, e in zip(lb, rb)] + [(0, d, None, None) for d in free[0]]
    owners += [(1, d, None, None) for d in free[1]]
    reads = [[], []]
    for d, w in zip(axes, windows):
        side, dim, other, other_dim = owners[d]
        reads[side].append((dim, w))
        reads[1 - side].append((other_dim, w) if other is not None else None)
    operands = tuple(tuple(r) if any(r) else None for r in reads)
    return Region(operands, eqn.params, (None, None))


def stop(eqn, axes, windows, clamp) -> Region:
    """An explicit stop: a reshape mixes space with other dims."""
    raise Stop(f"{eqn.primitive.name} is not tiled")


_ELEMENTWISE = (
    "abs add add_any and atan2 cbrt ceil clamp convert_element_type copy copy_p cos cosh div eq erf erf_inv "
    "erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le log log1p logistic lt max min mul ne "
    "neg nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub "
    "tan tanh xor"
).split()

_RULES = {  # registered below as each primitive's `region` facet
    **{name: elementwise for name in _ELEMENTWISE},
    "conv_general_dilated": conv,
    "conv_bias_act": conv,
    "reduce_window_max": reduce_window,
    "reduce_window_min": reduce_window,
    "reduce_window_sum": reduce_window,
    "pad": pad,
    "broadcast_in_dim": broadcast_in_dim,
    "transpose": transpose,
    "squeeze": squeeze,
    "concatenate": concatenate,
    "split": split_op,
    "dot_general": dot_general,
    **{name: reduce for name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin")},
    "reshape": stop,
}

for _name, _rule in _RULES.items():
    register(_name, region=_rule)
