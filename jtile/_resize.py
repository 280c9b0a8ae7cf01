"""The interpolation behind jtile's fused `resize` op: ONNX Resize semantics in jnp.

Nearest, linear and cubic, every coordinate_transformation_mode. Interpolation is
separable: per resized axis, the source indices and weights are computed
statically with numpy (edge-clamped neighbours, as the ONNX reference does),
and the graph only holds a `take` and, for linear/cubic, a weighted sum.
`antialias=1` widens the linear/cubic filters when downsampling.

!!! warning

    `align_corners` and `pytorch_half_pixel` use the unrounded output length
    `scale * in`, as the ONNX reference does; ONNX Runtime uses the rounded
    one. They differ only when `scale * in` is not an integer.
"""

import math

import jax.numpy as jnp
import numpy as np

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


def _resize_axis(x, axis, out_size, scale, roi, how):
    """Resize `x` along `axis` to `out_size` (`how`: the interpolation parameters)."""
    in_size = np.shape(x)[axis]
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
    index = np.clip(neighbours, 0, in_size - 1)
    if np.all((coeffs == 0) | (coeffs == 1)) and np.all(coeffs.sum(axis=1) == 1):
        y = jnp.take(x, index[np.arange(out_size), coeffs.argmax(axis=1)], axis=axis)
    else:
        gathered = jnp.take(x, index, axis=axis)  # (..., out, n, ...)
        w = coeffs.reshape((1,) * axis + coeffs.shape + (1,) * (np.ndim(x) - axis - 1))
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
    how = dict(mode=mode, nearest_mode=nearest_mode, coords=coords, cubic_a=cubic_a,
               exclude_outside=exclude_outside, extrapolation=extrapolation, antialias=antialias)
    for axis, (out, scale, window) in enumerate(zip(sizes, scales, roi)):
        if out != np.shape(x)[axis] or scale != 1.0 or coords == "tf_crop_and_resize":
            x = _resize_axis(x, axis, out, scale, window, how)
    return x
