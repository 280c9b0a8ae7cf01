"""The interpolation behind jtile's fused `resize` op: ONNX Resize semantics in jnp.

Nearest, linear and cubic, every coordinate_transformation_mode. Interpolation is
separable: per resized axis, the source indices and weights are computed
statically with numpy (edge-clamped neighbours, as the ONNX reference does),
and the graph only holds a `take` and, for linear/cubic, a weighted sum.
`antialias=1` widens the linear/cubic filters when downsampling.

An upsampling by an integer factor `r` whose neighbours and weights repeat
every `r` outputs (every coordinate mode but `align_corners` and
`tf_crop_and_resize`, in practice) skips the gather: each of the `r` output
phases is a weighted sum of edge-padded, shifted slices of the input, and the
phases are interleaved. XLA:CPU runs a gather along a middle axis element by
element (DeepLabV3's 14x14 -> 224x224 bilinear took 20 ms); slices fuse into
one loop. The products and sums are the same, so are the results.

!!! warning

    `align_corners` and `pytorch_half_pixel` use the unrounded output length
    `scale * in`, as the ONNX reference does; ONNX Runtime uses the rounded
    one. They differ only when `scale * in` is not an integer.
"""

import functools
import math
import operator

import jax.numpy as jnp
import numpy as np
from jax import lax

MODES = ("nearest", "linear", "cubic")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_crop_and_resize")


def _source_coords(mode, out_size, in_size, scale, roi):
    y = np.arange(out_size, dtype=np.float64)
    out_width = scale * in_size
    # align_corners and pytorch_half_pixel use the unrounded output length `scale * in`, as the
    # ONNX reference and its conformance cases do (onnxruntime uses the rounded one; they differ
    # only when `scale * in` is not an integer)
    if mode == "align_corners":
        return np.zeros(out_size) if out_width == 1 else y * (in_size - 1) / (out_width - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "pytorch_half_pixel":
        return np.full(out_size, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_size / out_width)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "tf_crop_and_resize":
        lo, hi = roi
        if out_width == 1:
            return np.full(out_size, (hi - lo) * (in_size - 1) / 2 + lo * (in_size - 1))
        return y * (hi - lo) * (in_size - 1) / (out_width - 1) + lo * (in_size - 1)
    return None


def _keys_cubic(x, a):
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _antialiased(mode, cubic_a, ratio, scale):
    """Downsampling filters widened by 1/scale (linear: triangle, cubic: Keys), rows summing to 1."""
    scale = min(scale, 1.0)
    reach = 1 if mode == "linear" else 2
    start = math.floor(-reach / scale) + 1
    taps = (np.arange(start, 2 - start)[None, :] - ratio[:, None]) * scale
    weights = np.clip(1 - np.abs(taps), 0, 1) if mode == "linear" else _keys_cubic(taps, cubic_a)
    return weights / weights.sum(axis=1, keepdims=True)


def _coefficients(mode, nearest_mode, cubic_a, ratio, antialias, scale):
    """Weights of the neighbours around each source coordinate, shape (out, n)."""
    if antialias and mode != "nearest":
        return _antialiased(mode, cubic_a, ratio, scale)
    if mode == "nearest":
        lower = {"round_prefer_floor": ratio <= 0.5, "round_prefer_ceil": ratio < 0.5,
                 "floor": np.ones_like(ratio, bool), "ceil": np.zeros_like(ratio, bool)}[nearest_mode]
        lower = np.where(ratio == 1.0, False, lower)  # an exact source pixel
        return np.stack([lower, ~lower], axis=1).astype(np.float64)
    if mode == "linear":
        return np.stack([1 - ratio, ratio], axis=1)
    a, r = cubic_a, ratio
    return np.stack([
        ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
        ((a + 2) * r - (a + 3)) * r * r + 1,
        ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
        ((a * (2 - r) - 5 * a) * (2 - r) + 8 * a) * (2 - r) - 4 * a,
    ], axis=1)


def _periodic(neighbours, coeffs, in_size: int, out_size: int):
    """`(offsets, weights)`, each `(r, n)`, when output `q * r + p` reads input
    rows `clip(q + offsets[p], 0, in - 1)` with `weights[p]` for every `q`
    (an integer upsampling factor `r`); else None."""
    r, rest = divmod(out_size, in_size)
    if rest or r < 1:
        return None
    q = np.arange(out_size) // r
    offsets, weights = neighbours[:r] - q[:r, None], coeffs[:r]
    phase = np.arange(out_size) % r
    same = (np.array_equal(neighbours, q[:, None] + offsets[phase])
            and np.array_equal(coeffs, weights[phase]))
    return (offsets, weights) if same else None


def _interleave(x, axis: int, offsets, weights, select: bool):
    """The periodic resize of `_periodic`: for each input shift, the shifted
    edge-padded input times each phase's weight for that shift (zero where a
    phase does not read it), written phase-minor so a reshape interleaves.
    `select`: the weights pick one neighbour (nearest), so a zero-weight
    neighbour is not read at all, as the gather path's `take` does not."""
    shape, (r, _) = np.shape(x), offsets.shape
    in_size, reach = shape[axis], int(np.abs(offsets).max())
    pads = [(0, 0)] * len(shape)
    pads[axis] = (reach, reach)
    padded = jnp.pad(x, pads, mode="edge")
    per_phase = (1,) * (axis + 1) + (r,) + (1,) * (len(shape) - axis - 1)
    terms = []
    for offset in np.unique(offsets):
        rows = lax.slice_in_dim(padded, reach + offset, reach + offset + in_size, axis=axis)
        weight = np.where(offsets == offset, weights, 0.0).sum(axis=1).astype(x.dtype)
        used = ((offsets == offset) & ((weights != 0) | (not select))).any(axis=1)
        term = jnp.expand_dims(rows, axis + 1) * weight.reshape(per_phase)
        terms.append(jnp.where(used.reshape(per_phase), term, jnp.zeros((), x.dtype)))
    y = functools.reduce(operator.add, terms)
    return y.reshape(*shape[:axis], in_size * r, *shape[axis + 1:])


def axis_taps(in_size: int, out_size: int, scale: float, roi, how: dict):
    """`(neighbours, coeffs, src)` of one resized axis: output `i` reads input
    `neighbours[i, t]` (unclamped, `(out, n)`) with weight `coeffs[i, t]`; `src`
    is the unrounded source coordinate (`how`: the interpolation parameters)."""
    src = _source_coords(how["coords"], out_size, in_size, scale, roi)
    base = np.floor(src)
    ratio = np.where(src == base, 1.0, src - base)
    coeffs = _coefficients(how["mode"], how["nearest_mode"], how["cubic_a"], ratio, how["antialias"], scale)
    n = coeffs.shape[1]
    # the n neighbours nearest to src (ties to the left), as in the ONNX reference
    pad = math.ceil(n / 2)
    padded = src + pad
    p = np.floor(padded)
    frac = padded - p
    if n % 2 == 0:
        start = p + np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        start = p + np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    neighbours = (start[:, None] + np.arange(n)[None, :] - pad).astype(np.int64)
    if how["exclude_outside"]:
        coeffs = np.where((neighbours < 0) | (neighbours >= in_size), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    return neighbours, coeffs, src


def selects(coeffs) -> bool:
    """Whether the weights pick one neighbour each (nearest), so that only it is read."""
    return bool(np.all((coeffs == 0) | (coeffs == 1)) and np.all(coeffs.sum(axis=1) == 1))


def read_taps(neighbours, coeffs, in_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(index, weights)`, each `(out, n)`, the input is read with: the
    neighbours clamped to the input, and for a selecting (nearest) resize only
    the chosen one, with weight 1."""
    index = np.clip(neighbours, 0, in_size - 1)
    if selects(coeffs):
        return index[np.arange(len(index)), coeffs.argmax(axis=1)][:, None], np.ones((len(index), 1))
    return index, coeffs


def resized_axes(shape, sizes, scales, coords: str) -> list[int]:
    """The axes a resize changes (every axis for `tf_crop_and_resize`)."""
    return [axis for axis, (size, out, scale) in enumerate(zip(shape, sizes, scales))
            if out != size or scale != 1.0 or coords == "tf_crop_and_resize"]


def interpolation(params: dict) -> dict:
    """The interpolation parameters of a resize's params (`how` above)."""
    return {k: params[k] for k in ("mode", "nearest_mode", "coords", "cubic_a", "exclude_outside",
                                   "extrapolation", "antialias")}


def _resize_axis(x, axis, out_size, scale, roi, how):
    """Resize `x` along `axis` to `out_size` (`how`: the interpolation parameters)."""
    in_size = np.shape(x)[axis]
    neighbours, coeffs, src = axis_taps(in_size, out_size, scale, roi, how)
    select = selects(coeffs)
    periodic = _periodic(neighbours, coeffs, in_size, out_size)
    if periodic is not None and how["coords"] != "tf_crop_and_resize":
        return _interleave(x, axis, *periodic, select).astype(x.dtype)
    index, weights = read_taps(neighbours, coeffs, in_size)
    if select:
        y = jnp.take(x, index[:, 0], axis=axis)
    else:
        gathered = jnp.take(x, index, axis=axis)  # (..., out, n, ...)
        w = weights.reshape((1,) * axis + weights.shape + (1,) * (np.ndim(x) - axis - 1))
        y = jnp.sum(gathered * w.astype(gathered.dtype), axis=axis + 1)
    if how["coords"] == "tf_crop_and_resize":
        outside = (src < 0) | (src > in_size - 1)
        mask = outside.reshape((1,) * axis + (out_size,) + (1,) * (np.ndim(x) - axis - 1))
        y = jnp.where(mask, np.asarray(how["extrapolation"], y.dtype), y)
    return y.astype(x.dtype)


def resize(x, *, sizes: tuple[int, ...], scales: tuple[float, ...], roi: tuple[tuple[float, float], ...],
           mode: str, nearest_mode: str, coords: str, cubic_a: float, exclude_outside: int,
           extrapolation: float, antialias: int):
    """`x` resized to `sizes`, one entry per axis (`scales`, `roi` likewise), as ONNX Resize."""
    how = interpolation(locals())
    for axis in resized_axes(np.shape(x), sizes, scales, coords):
        x = _resize_axis(x, axis, sizes[axis], scales[axis], roi[axis], how)
    return x
