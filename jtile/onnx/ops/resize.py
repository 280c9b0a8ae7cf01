"""Resize and Upsample: nearest, linear and cubic, every coordinate_transformation_mode.

Interpolation is separable: per resized axis, the source indices and weights
are computed statically with numpy (edge-clamped neighbours, as the ONNX
reference does), and the graph only holds a `take` and, for linear/cubic, a
weighted sum. `antialias=1` widens the linear/cubic filters when downsampling.
"""

import math

import jax.numpy as jnp
import numpy as np

from . import register


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


def _resize(node, x, scales, sizes, roi, how, axes):
    rank = np.ndim(x)
    if how["mode"] not in ("nearest", "linear", "cubic"):
        raise node.fail(f"mode must be nearest, linear or cubic, got {how['mode']!r}")
    if how["mode"] == "nearest" and how["nearest_mode"] not in ("round_prefer_floor", "round_prefer_ceil",
                                                                "floor", "ceil"):
        raise node.fail(f"unknown nearest_mode {how['nearest_mode']!r}")
    if _source_coords(how["coords"], 1, 1, 1.0, (0.0, 1.0)) is None:
        raise node.fail(f"unknown coordinate_transformation_mode {how['coords']!r}")
    axes = list(range(rank)) if axes is None else [node.axis(a, rank) for a in axes]
    shape = list(np.shape(x))
    full_scales, out = [1.0] * rank, list(shape)
    if sizes is not None:
        if len(sizes) != len(axes):
            raise node.fail(f"sizes {sizes} should hold one value per resized axis {axes}")
        ratios = {a: s / shape[a] if shape[a] else 1.0 for a, s in zip(axes, sizes)}
        policy = node.attr("keep_aspect_ratio_policy", "stretch")
        if policy in ("not_larger", "not_smaller"):
            pick = (min if policy == "not_larger" else max)(ratios.values())
            ratios = {a: pick for a in axes}
            sizes = [int(pick * shape[a] + 0.5) for a in axes]
        elif policy != "stretch":
            raise node.fail(f"unknown keep_aspect_ratio_policy {policy!r}")
        for a, s in zip(axes, sizes):
            full_scales[a], out[a] = ratios[a], int(s)
    elif scales is not None:
        if len(scales) != len(axes) or min(scales, default=1.0) <= 0:
            raise node.fail(f"scales {list(scales)} should hold one positive value per resized axis {axes}")
        for a, s in zip(axes, scales):
            full_scales[a], out[a] = float(s), int(shape[a] * float(s))
    else:
        raise node.fail("needs scales or sizes")
    if roi is None or len(roi) == 0:
        roi = [0.0] * len(axes) + [1.0] * len(axes)
    if len(roi) != 2 * len(axes):
        raise node.fail(f"roi {list(roi)} should hold 2 values per resized axis")
    for i, a in enumerate(axes):
        if out[a] != shape[a] or full_scales[a] != 1.0 or how["coords"] == "tf_crop_and_resize":
            x = _resize_axis(x, a, out[a], full_scales[a], (roi[i], roi[i + len(axes)]), how)
    return x


@register("Resize", since=10, static=(1, 2, 3))
def resize(node, x, *operands):
    if node.schema < 11:
        roi, scales, sizes = None, operands[0], None
        coords, nearest = "asymmetric", "floor"
    else:
        roi, scales, sizes = (list(operands) + [None] * 3)[:3]
        coords = node.attr("coordinate_transformation_mode", "half_pixel")
        nearest = node.attr("nearest_mode", "round_prefer_floor")
    roi = None if roi is None else node.static(roi, "roi").astype(np.float64).tolist()
    scales = None if scales is None or np.size(scales) == 0 else node.static(scales, "scales").tolist()
    sizes = None if sizes is None or np.size(sizes) == 0 else node.ints(sizes, "sizes")
    how = dict(mode=node.attr("mode", "nearest"), nearest_mode=nearest, coords=coords,
               cubic_a=node.attr("cubic_coeff_a", -0.75), exclude_outside=node.attr("exclude_outside", 0),
               extrapolation=node.attr("extrapolation_value", 0.0), antialias=node.attr("antialias", 0))
    return _resize(node, x, scales, sizes, roi, how, node.attr("axes"))


@register("Upsample", since=7, upto=9, static=(1,))
def upsample(node, x, scales=None):
    scales = node.attr("scales") if node.schema < 9 else node.static(scales, "scales").tolist()
    mode = node.attr("mode", "nearest")
    how = dict(mode="linear" if mode in ("linear", "bilinear") else mode, nearest_mode="floor",
               coords="asymmetric", cubic_a=-0.75, exclude_outside=0, extrapolation=0.0, antialias=0)
    return _resize(node, x, scales, None, None, how, None)


__all__ = ["resize", "upsample"]
