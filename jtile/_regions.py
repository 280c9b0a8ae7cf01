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
