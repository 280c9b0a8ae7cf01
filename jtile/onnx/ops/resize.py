"""Resize and Upsample, as jtile's fused `resize` op (`jtile._fused.resize_p`).

The handlers validate the attributes and resolve scales, sizes, roi and axes
into one entry per axis; the interpolation itself (nearest, linear, cubic,
every coordinate_transformation_mode, antialias) is `jtile._resize`. Keeping
the op whole lets the exporter write it back as one ONNX Resize.
"""

import numpy as np

from ... import _fused
from ..._resize import COORDINATE_MODES, MODES, NEAREST_MODES
from . import register


def _resize(node, x, scales, sizes, roi, how, axes):
    rank = np.ndim(x)
    if how["mode"] not in MODES:
        raise node.fail(f"mode must be nearest, linear or cubic, got {how['mode']!r}")
    if how["mode"] == "nearest" and how["nearest_mode"] not in NEAREST_MODES:
        raise node.fail(f"unknown nearest_mode {how['nearest_mode']!r}")
    if how["coords"] not in COORDINATE_MODES:
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
    windows = [(0.0, 1.0)] * rank
    for i, a in enumerate(axes):
        windows[a] = (float(roi[i]), float(roi[i + len(axes)]))
    if out == shape and all(s == 1.0 for s in full_scales) and how["coords"] != "tf_crop_and_resize":
        return x
    how = {**how, "cubic_a": float(how["cubic_a"]), "extrapolation": float(how["extrapolation"])}
    return _fused.resize(x, sizes=tuple(out), scales=tuple(full_scales), roi=tuple(windows), **how)


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
