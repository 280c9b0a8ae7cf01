"""The layer kinds `swap_backend` knows: how to spot them, run them, and pick for them.

For each kind (the `jtile.Layer` kind its primitive's registry entry
describes): per-algorithm `support(eqn, layer)` (why a kernel cannot
serve a layer, or `None`) and `run(eqn, *invals)` (the kernel call,
transposing to the kernels' NCHW / OIHW / (K, N) layout only when the equation
uses another), and the `"auto"` cost model.

`"auto"` is a calibrated rule set, not a timing run: it swaps only where a
kernel was measured to beat XLA on that class of layer on a 2-core AVX-512
machine, and keeps XLA everywhere else, including every non-float32 layer.

!!! warning

    Average pooling is recognised only as a `reduce_window_sum` whose one use is
    a division by the window size (`x_sum / 9`, as `lax.reduce_window` users
    write it); other forms stay with XLA.
"""

import math

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from ._cpu import cpu_field
from ._errors import ConfigError
from ._fused import activate
from ._geometry import ConvGeometry, DotGeometry, PoolGeometry
from ._graph import Graph
from ._interpreter import on_host, to_device
from ._layers import Layer, dense_weight_axis, layer_fields, scope_name
from ._regions import Window, pool_axes
from ._registry import facet
from ._views import strided_source

_F32 = np.dtype(np.float32)


def _kernels():
    from . import kernels

    return kernels


def _dtype_reason(eqn) -> str | None:
    dtypes = {np.dtype(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)}
    if dtypes != {_F32}:
        names = ", ".join(sorted(str(d) for d in dtypes))
        return f"the kernels compute in float32 only, this layer uses {names}"
    return None


def _reorder(x, spec):
    """`x` with its axes in the order `spec` lists them, transposing only if needed."""
    return x if tuple(spec) == tuple(range(len(spec))) else jnp.transpose(x, spec)


def _restore(y, spec):
    """Inverse of `_reorder`."""
    return y if tuple(spec) == tuple(range(len(spec))) else jnp.transpose(y, np.argsort(spec))


# ---------------------------------------------------------------- conv2d


def _conv_geometry(eqn) -> dict:
    g = ConvGeometry.of(eqn)
    return dict(x_shape=g.in_shape, w_shape=g.w_shape, stride=g.stride, padding=g.padding,
                dilation=g.dilation, groups=g.groups)


def _conv_support(name: str):
    def support(eqn, layer: Layer) -> str | None:
        if any(d != 1 for d in layer.lhs_dilation) or layer.batch_groups != 1:
            return (
                f"lhs_dilation {layer.lhs_dilation} and batch_group_count {layer.batch_groups} "
                "(transposed or batch-grouped convolution) have no kernel"
            )
        try:
            return _dtype_reason(eqn) or _kernels().conv2d_support(
                name, **_conv_geometry(eqn), dtype=layer.dtype
            )
        except ConfigError:
            return f"this build of jtile has no {name!r} conv kernel"

    return support


def _conv_run(name: str):
    def run(eqn, x, w, *epilogue_operands, producers, into=None, max_pool=None, prologue=None,
            reads_prefix=False, x_layout="NCHW", y_layout="NCHW"):
        """`into=(buffer or channels, channel0)`: write into a concatenation's
        buffer (`jtile.kernels.conv2d`), for an NCHW output whose epilogue the
        kernel fuses (`writes_into`); `max_pool=` the equation of a max pool to
        compute in the same call (`pools`), returning its output; `prologue=`
        `(shift, scale, bias, activation)` applied to x first (`takes_prologue`);
        `reads_prefix=True`: x is a concatenation's buffer whose first channels
        are the conv's input (`reads_prefix`); `x_layout` / `y_layout`
        "NCHWc": x comes, y goes, channel-blocked (`blocks`)."""
        lhs_spec, rhs_spec, out_spec = eqn.params["dimension_numbers"]
        geometry = _conv_geometry(eqn)
        del geometry["x_shape"], geometry["w_shape"]

        def conv(b, epilogue):
            if "residual" in epilogue:
                epilogue = dict(epilogue, residual=_reorder(epilogue["residual"], out_spec))
            y = _kernels().conv2d(
                _reorder(x, lhs_spec), _reorder(w, rhs_spec), b, algorithm=name, **geometry, **epilogue,
                **({"into": into} if into is not None else {}),
                **({"max_pool": _pool_window(max_pool)} if max_pool is not None else {}),
                **({"prologue": prologue} if prologue is not None else {}),
                **({"reads_prefix": True} if reads_prefix else {}),
                **({"x_layout": x_layout, "y_layout": y_layout} if "NCHWc" in (x_layout, y_layout) else {}),
            )
            return _restore(y, out_spec)

        return _with_epilogue(eqn, conv, epilogue_operands, out_axis=out_spec[1])

    return run


def expands(expansion, conv, algorithm: str) -> bool:
    """Whether the conv equation `conv`, run by `algorithm`, should compute the
    1x1 conv equation `expansion` that gives its input in the same call
    (`jtile._expanded_depthwise`): NCHW dimension numbers, epilogues the kernel
    fuses and no residuals, a 1x1 stride-1 unpadded conv of one group, then a
    depthwise conv with one output channel per input channel, over at least
    28x28 pixels.

    Measured in one process against the two calls (best of 40 rounds): every
    such pair fused from 28x28 up, MobileNetV2 1.10-1.11x, MobileNetV3-Large
    1.03-1.07x, EfficientNet-B0 1.04x, ShuffleNetV2 1.02-1.04x, DeepLabV3
    1.02-1.03x; every pair fused, EfficientNet-B0 0.93x: at 14x14 and 7x7 the
    expansion's output stays in cache, the two calls pass it channel-blocked,
    and the fused call's expansion (one vector of channels by up to 16 pixels
    of a row) computes 112->672 at 14x14 slower than the GEMM. Alone, 16->96 at
    112x112 then a stride-2 3x3 depthwise conv took 283 against 480 us, 24->144
    at 56x56 then stride 1 221 against 254."""
    if algorithm != "depthwise" or math.prod(expansion.outvars[0].aval.shape[2:]) < 28 * 28:
        return False
    e, g = ConvGeometry.of(expansion), ConvGeometry.of(conv)
    if not _pointwise(expansion) or e.groups != 1 or g.lhs_spec != (0, 1, 2, 3) or g.out_spec != (0, 1, 2, 3) \
            or any(d != 1 for d in g.lhs_dilation):
        return False
    if not all(_fused_epilogue(eqn, out_axis=1) and len(eqn.invars) <= 3 for eqn in (expansion, conv)):
        return False  # (a fourth operand is a residual)
    return _kernels().expanded_depthwise_support(e.in_shape, e.w_shape, g.w_shape, g.stride, g.padding,
                                                 g.dilation) is None


def run_expanded(conv, expansion, expansion_operands, x, w, *epilogue_operands, y_layout: str = "NCHW"):
    """The depthwise conv equation `conv` of the 1x1 conv equation `expansion`'s
    output, in one kernel call (`expands`): `expansion_operands` are the 1x1
    conv's `(x, w[, bias])`, and `x` is its x."""
    _, expand_w, *expand_bias = expansion_operands
    expand_b, expand_epilogue = _kernel_epilogue(expansion, expand_bias, out_axis=1)
    geometry = _conv_geometry(conv)
    expand_w = _reorder(expand_w, expansion.params["dimension_numbers"][1])

    def kernel(b, epilogue):
        return _kernels().expanded_depthwise_conv2d(
            x, expand_w, expand_b, _reorder(w, conv.params["dimension_numbers"][1]), b,
            stride=geometry["stride"], padding=geometry["padding"], dilation=geometry["dilation"], **epilogue,
            **{f"expand_{name}": value for name, value in expand_epilogue.items()}, y_layout=y_layout)

    return _with_epilogue(conv, kernel, epilogue_operands, out_axis=1)


def writes_into(eqn, algorithm: str) -> bool:
    """Whether the conv `eqn`, run by `algorithm`, can write its output straight
    into a concatenation's buffer: a kernel that takes one, an NCHW output of
    one image, and an epilogue the kernel fuses."""
    out_spec = eqn.params["dimension_numbers"][2]
    out_shape = eqn.outvars[0].aval.shape
    return (_kernels().conv2d_writes_into(algorithm) and tuple(out_spec) == (0, 1, 2, 3)
            and out_shape[0] == 1 and _fused_epilogue(eqn, out_axis=1))


def pools(conv, pool, algorithm: str) -> bool:
    """Whether the conv equation `conv`, run by `algorithm`, can compute the max
    pool equation `pool` over its output in the same call: an NCHW output, an
    epilogue the kernel fuses, and a kernel that pools this layer."""
    out_spec = conv.params["dimension_numbers"][2]
    if tuple(out_spec) != (0, 1, 2, 3) or not _fused_epilogue(conv, out_axis=1):
        return False
    return _kernels().conv2d_max_pool_support(algorithm, **_conv_geometry(conv)) is None


def cropped_read(conv, algorithm: str, producers):
    """The conv equation `conv`, run by `algorithm`, as one that reads the
    input of the slice making its x, the slice folded into its padding
    (negative where the crop starts or ends inside that input), or None: a
    kernel that takes negative padding, NCHW x, and a slice of unit strides
    over H and W only. That is a region of `crop_dead_taps` (DeepLabV3's
    dilated convs), whose slices XLA would copy."""
    if not _kernels().conv2d_crops(algorithm) or tuple(conv.params["dimension_numbers"][0]) != (0, 1, 2, 3):
        return None
    g = ConvGeometry.of(conv)
    x, axes = conv.invars[0], [g.axis(i) for i in range(2)]
    while (sliced := producers.get(x)) is not None and sliced.primitive.name == "slice":  # (regions slice H, then W)
        start, limit, strides = (sliced.params[k] for k in ("start_indices", "limit_indices", "strides"))
        whole = sliced.invars[0].aval.shape
        if any(k != 1 for k in strides or ()) or tuple(start[:2]) != (0, 0) or tuple(limit[:2]) != tuple(whole[:2]):
            break
        axes = [s.read_through(Window(start[2 + i], limit[2 + i]), whole[2 + i]) for i, s in enumerate(axes)]
        x = sliced.invars[0]
    if x is conv.invars[0]:
        return None
    padding = tuple((s.pad_lo, s.pad_hi) for s in axes)
    return conv.replace(invars=[x, *conv.invars[1:]], params={**conv.params, "padding": padding})


def reads_prefix(conv, algorithm: str) -> bool:
    """Whether the conv equation `conv`, run by `algorithm`, can read its NCHW
    input of one image as the first channels of a larger buffer."""
    lhs_spec = conv.params["dimension_numbers"][0]
    return (_kernels().conv2d_reads_prefix(algorithm) and tuple(lhs_spec) == (0, 1, 2, 3)
            and conv.invars[0].aval.shape[0] == 1)


def blocks(conv, algorithm: str, side: str) -> bool:
    """Whether the conv equation `conv`, run by `algorithm`, can take its x
    (`side` "x") or give its y ("y") channel-blocked (NCHWc): NCHW dimension
    numbers, an epilogue the kernel fuses, no residual with a blocked y, and a
    kernel that blocks this layer."""
    g = ConvGeometry.of(conv)
    if (g.lhs_spec, g.out_spec) != ((0, 1, 2, 3),) * 2 or not _fused_epilogue(conv, out_axis=1):
        return False
    if side == "y" and len(conv.invars) > 3:
        return False
    layouts = {"x_layout": "NCHWc"} if side == "x" else {"y_layout": "NCHWc"}
    return _kernels().conv2d_nchwc_support(algorithm, **layouts, **_conv_geometry(conv)) is None


def blocking_pays(shape, readers) -> bool:
    """Whether keeping an activation of NCHW `shape` channel-blocked (NCHWc)
    pays, read by the conv equations `readers` (`jtile._nchwc`).

    Measured per call inside MobileNetV2 and ShuffleNetV2 against the same
    layers in NCHW: at 14x14 and 7x7 blocked depthwise convs take 0.55-0.85x
    the time and the 1x1 convs around them 0.8-1.0x. From 28x28 up a stride-1
    depthwise conv runs faster on NCHW planes (116@28: 15 against 20 us;
    144@56: 98 against 119) and a 1x1 conv to few channels in channel rows
    (58->58 at 28x28: 33 against 42 us; 144->24 at 56x56: 113 against 154),
    but a stride-2 depthwise conv reads a blocked input faster (144@56: 55
    against 80 us, 96@112: 158 against 190)."""
    if shape[2] * shape[3] <= 16 * 16:
        return True
    geometries = [ConvGeometry.of(conv) for conv in readers]
    return all(g.groups == g.in_shape[1] and min(g.stride) >= 2 for g in geometries)


def takes_prologue(conv, algorithm: str) -> bool:
    """Whether the conv equation `conv`, run by `algorithm`, can apply a
    per-channel prologue to its NCHW input."""
    lhs_spec = conv.params["dimension_numbers"][0]
    return (tuple(lhs_spec) == (0, 1, 2, 3)
            and _kernels().conv2d_prologue_support(algorithm, **_conv_geometry(conv)) is None)


def linear_pointwise(conv) -> bool:
    """Whether the conv equation `conv` is a 1x1, stride-1, unpadded NCHW conv
    whose output is linear in its input per pixel (a per-channel bias at most,
    no activation or residual), so that it commutes with an average pool."""
    if not _pointwise(conv):
        return False
    return conv.primitive.name == "conv_general_dilated" or (
        conv.params["activation"] == () and len(conv.invars) == 3 and _fused_epilogue(conv, out_axis=1))


def _pool_window(eqn) -> tuple:
    window = PoolGeometry.of(eqn).fields()
    return window["kernel_size"], window["stride"], window["padding"]


def _single_pixel_support(eqn, layer: Layer) -> str | None:
    """The dense kernel on a conv that is a matrix product: 1x1 window over a
    1x1 image, groups 1, no residual (a squeeze-excitation block's convs)."""
    g = ConvGeometry.of(eqn)
    image = list(g.in_shape[2:])  # NCHW order
    padded = any(p for pair in g.padding for p in pair)
    if image != [1, 1] or layer.kernel_size != (1, 1) or padded or g.groups != 1 or len(eqn.invars) > 3:
        return ("'dense' runs 1x1 convs over a 1x1 image without padding, groups or residual; this layer "
                f"has a {layer.kernel_size} window over {tuple(image)}, padding {g.padding}, groups "
                f"{g.groups}{', a residual' if len(eqn.invars) > 3 else ''}; use 'smm'")
    return _conv_support("direct")(eqn, layer) or _kernels().kernel_unavailable("jtile_dense")


def _single_pixel_run(eqn, x, w, *epilogue_operands, producers):
    lhs_spec, rhs_spec, out_spec = eqn.params["dimension_numbers"]
    rows = _reorder(x, lhs_spec).reshape(x.shape[lhs_spec[0]], -1)
    host = on_host(w)  # a known weight is rearranged in numpy, once, at trace time
    if isinstance(host, np.ndarray):
        weight = to_device(host.transpose(rhs_spec).reshape(host.shape[rhs_spec[0]], -1))
    else:
        weight = _reorder(w, rhs_spec).reshape(w.shape[rhs_spec[0]], -1)

    def dense(b, epilogue):
        y = _kernels().dense(rows, weight, b, transpose_w=True, **epilogue)
        return _restore(y.reshape(*y.shape, 1, 1), out_spec)

    return _with_epilogue(eqn, dense, epilogue_operands, out_axis=out_spec[1])


def _pointwise(conv) -> bool:
    """Whether the conv equation `conv` is a 1x1, stride-1, unpadded, undilated NCHW conv."""
    g = ConvGeometry.of(conv)
    return ((g.lhs_spec, g.out_spec) == ((0, 1, 2, 3),) * 2 and g.window == (1, 1) and g.stride == (1, 1)
            and not any(lo or hi for lo, hi in g.padding) and all(d == 1 for d in (*g.dilation, *g.lhs_dilation)))


def _with_epilogue(eqn, kernel, operands, out_axis: int):
    """`kernel(b, epilogue)` with a fused equation's bias, residual and activation
    folded in when the bias is per output channel, else applied after the
    kernel in jnp. `operands` are the fused equation's `(bias[, residual])`."""
    if not operands:
        return kernel(None, {})
    bias, *residual = operands
    if _fused_epilogue(eqn, out_axis):
        b, epilogue = _kernel_epilogue(eqn, [bias], out_axis)
        return kernel(b, dict(epilogue, residual=residual[0]) if residual else epilogue)
    y = kernel(None, {}) + bias
    activation = eqn.params["activation"]
    return activate(y + residual[0] if residual else y, activation)


def _kernel_epilogue(eqn, bias: list, out_axis: int) -> tuple:
    """`(bias vector or None, activation arguments)` of a kernel running the
    equation `eqn`, whose epilogue it fuses, with its `[bias]` or `[]`."""
    if not bias:
        return None, {}
    activation = eqn.params["activation"]
    channels = eqn.outvars[0].aval.shape[out_axis]
    flat = on_host(bias[0]).reshape(-1)
    b = to_device(np.broadcast_to(flat, (channels,)) if isinstance(flat, np.ndarray)
                  else jnp.broadcast_to(flat, (channels,)))
    return b, _ACTIVATIONS[activation[:1]](*activation[1:])


def _fused_epilogue(eqn, out_axis: int) -> bool:
    """Whether a kernel fuses `eqn`'s epilogue: none, or a per-channel bias."""
    if eqn.primitive.name not in ("conv_bias_act", "dense"):
        return True
    bias, out_shape = eqn.invars[2].aval, eqn.outvars[0].aval.shape
    return bias.ndim == 0 or (bias.ndim == len(out_shape) and _per_channel(bias, out_axis, out_shape[out_axis]))


def _per_channel(bias, axis: int, channels: int) -> bool:
    others = [n for d, n in enumerate(bias.shape) if d != axis]
    return all(n == 1 for n in others) and bias.shape[axis] in (1, channels)


_ACTIVATIONS = {
    (): lambda: {},
    ("clip",): lambda lo, hi: {"activation": "clip", "clip": (lo, hi)},
    ("leaky_relu",): lambda alpha: {"activation": "leaky_relu", "alpha": alpha},
    **{(kind,): lambda kind=kind: {"activation": kind} for kind in ("relu", "sigmoid", "silu", "gelu", "gelu_tanh")},
    **{(kind,): lambda alpha, beta, kind=kind: {"activation": kind, "alpha": alpha, "beta": beta}
       for kind in ("hard_sigmoid", "hard_swish")},
}


def _is_depthwise(layer: Layer) -> bool:
    return layer.groups > 1 and layer.groups == layer.in_channels


def _conv_preference(eqn, layer: Layer) -> tuple[str, ...]:
    """Kernels measured faster than XLA for this class of conv, best first.

    Measured at batch 1 on the zoo's layers (ResNet-18, MobileNetV2) against
    XLA with weights folded into constants: depthwise ~20-100x (XLA runs
    grouped convs channel by channel); Winograd on 3x3 stride 1 with at least
    12x12 outputs ~2-3x, and 0.68-0.88x the time of im2col + GEMM at 12x12 and
    13x13 (SqueezeNet's 64->256 at 13x13: 0.25 against 0.33 ms), level at
    11x11, 1.6-2.4x slower at 8x8 and 7x7, where its 4x4 tiles are mostly
    padding; im2col +
    GEMM on packed weights on every other conv: stems 1.4-7x, strided 3x3
    1.2-2x, 3x3 at 7x7 1.8x, 1x1 1.1-5x; but 1x1 convs over a 1x1 image
    (squeeze-excitation) on the dense kernel, whose GEMM computes only the
    rows a tile keeps (240->960: 23 against 120 us by im2col, XLA 23; on the
    weight packed at trace time, 6 us alone).
    Grouped convs (not depthwise): `grouped` on every 3x3 layer of
    RegNetY-400MF (groups of 8 channels) and ResNeXt-50 32x4d (groups of 4 to
    32), 1.1-2.8x the faster of `smm` (one group's GEMM per task) and
    `direct`, 4-40x XLA (which ran them at 4-25 GFLOP/s). Dilated convs go to
    im2col + GEMM only where the dilated window spans the whole input
    (DeepLabV3's atrous pyramid): 960->256 3x3 at 14x14 dilation 12 took 1.9
    ms against XLA's 4.9, at 28x28 dilation 36 16 ms against 77; with smaller
    dilations XLA was as fast or up to 15% faster, except on small outputs
    (at most 16x16): the corner and edge regions `crop_dead_taps` cuts from
    DeepLabV3's 3x3 at dilation 12 on 14x14 (2x2 taps over 2x2 outputs).
    """
    if _is_depthwise(layer):
        return ("depthwise", "direct")
    if _is_image_stem(layer):
        return ("grouped", "smm")
    if _single_pixel_support(eqn, layer) is None:
        return ("dense",)
    if any(d != 1 for d in layer.dilation):
        g = ConvGeometry.of(eqn)
        spans_input = any(g.axis(i).span >= g.in_shape[2 + i] for i in range(len(g.window)))
        return ("smm",) if spans_input or math.prod(g.out_shape[2:]) <= 256 else ()
    if layer.groups > 1:
        return ("grouped", "smm")
    out_spec = eqn.params["dimension_numbers"][2]
    out_side = min(layer.out_shape[d] for d in out_spec[2:])
    direct = ("grouped",) if _direct_beats_gemm(layer) else ()
    intel_winograd = _winograd_first_on_intel(layer, out_side)
    winograd = (
        layer.kernel_size == (3, 3)
        and layer.stride == (1, 1)
        and min(layer.in_channels, layer.out_channels) >= 16
        and out_side >= 12
        # with AVX-512, under 28x28 outputs, at most 2 MB of weights as 4x4 tiles: inside ResNet-50, its
        # 256->256 at 14x14 (4 MB so) took 692-715 us against grouped's 569-575 (on a Zen 5)
        and (out_side >= 28 or 64 * layer.in_channels * layer.out_channels <= 2 * 2**20 or not _wide_vectors()
             or intel_winograd)
    )
    if not winograd:
        return (*direct, "smm")
    direct_first = ((layer.out_channels <= 32 and out_side <= 28) or out_side <= 16) and not intel_winograd
    return (*direct, "winograd", "smm") if direct_first else ("winograd", *direct, "smm")


def _direct_beats_gemm(layer: Layer) -> bool:
    """A conv of one group with a window over at least 16 input channels,
    where `grouped` (vectors of output channels, each tap a broadcast input,
    no im2col) beats `smm`. Measured on a Zen 5 at batch 1, alone: 1.05-1.5x
    on 3x3 stride 2 (64 and 128 channels at 112x112 and 56x56, 192 and 256 at
    28x28), 5x5 (AlexNet's 64->192 at 27x27: 0.91 against 1.14 ms) and
    DenseNet's 128->32 3x3 (16 against 23 us at 7x7); ahead of Winograd with
    32 outputs at 28x28 and below (128->32: 151 against 188 us at 28x28, 44
    against 79 at 14x14), where Winograd's transforms outweigh its few output
    channels, and ahead of it at 16x16 and below, where a 4x4 output tile is
    mostly edge (inside models, both rule sets in one process: SqueezeNet's
    48->192 at 13x13 84 against 132 us, 64->256 140 against 193; GoogLeNet's
    14x14 layers, 112->224 247 against 271, 128->256 291 against 368, 96->208
    205 against 228), but behind it at 27x27 (SqueezeNet's 32->128: 137
    against 132) and above and with more outputs. With the input padded once
    per call for every task (small inputs), `grouped` also overtook `smm` on
    the layers with many weights it lost before, inside models: AlexNet's
    384->256 at 13x13 (3.4 MB) 705 against 966 us, ResNet-18's 512->512 at
    7x7 (9 MB) 600-609 against 622-654 and its stride-2 256->512 306 against
    348, ResNet-50's stride-2 512->512 627 against 698, GoogLeNet's 160->320
    and 192->384 at 7x7 120 and 168 against 128 and 181; stride 1 over the
    image's 3 channels stays on `smm` (0.88x). With AVX2's 8 lanes `grouped`
    lost to `smm` (0.75-0.84x on the 128->128 stride-2, 5x5 and 256->256
    layers above) and Winograd kept its lead at 14x14 (256->256: 0.98 against
    1.48 ms), so these rules hold for AVX-512 builds only."""
    return _wide_vectors() and layer.kernel_size != (1, 1) and layer.in_channels >= 16


def _winograd_first_on_intel(layer: Layer, out_side: int) -> bool:
    """A 3x3 stride-1 conv to 13x13 or 14x14 outputs, of at least 128
    channels in and out, on an Intel CPU, where Winograd beats `grouped`, as
    it does with AVX2 (the rules above were measured on AMD Zen 4 and 5). On
    a 2-core Xeon (family 6 model 207, AVX-512, 2 FMA units), alone: 256->256
    at 14x14 1.30 ms against `grouped`'s 1.77 (ONNX Runtime 1.32). Inside
    models, ONNX Runtime's time over jtile's (the median of 25-30 interleaved
    rounds' ratios) with Winograd and without: ResNet-50 0.948 against 0.893,
    ResNet-18 1.120 against 1.057, AlexNet 1.120 against 1.037, DeepLabV3
    0.907 against 0.848; GoogLeNet (96 to 160 channels in) level, 1.034 and
    1.009 with 128 and 96 as the least against 1.003; but SqueezeNet's 64->256
    at 13x13 lost (0.802 against 0.858; one thread 0.853 against 0.886)."""
    return (
        13 <= out_side <= 14
        and min(layer.in_channels, layer.out_channels) >= 128
        and cpu_field("vendor_id") == "GenuineIntel"
    )


def _wide_vectors() -> bool:
    """Whether the kernels are built, for AVX-512 (16 lanes), where the rules above were measured."""
    kernels = _kernels()
    return kernels.kernel_unavailable("jtile_conv_grouped") is None and kernels.vector_lanes() >= 16


def _is_image_stem(layer: Layer) -> bool:
    """A strided conv over the image's few channels whose outputs fill whole
    vectors, where `grouped` (here: vectors of output channels, each tap one
    broadcast input, no im2col) beats `smm`: measured 1.16-1.29x on 3->16 3x3
    stride 2 (MobileNetV3), 3->64 7x7 stride 2 (ResNet, GoogLeNet, DenseNet),
    3->64 11x11 stride 4 (AlexNet) and 3->768 16x16 stride 16 (ViT's patches),
    1.03-1.06x on 3->32 3x3 stride 2 (1.4x on a Zen 5); on 3->64 3x3 stride 2
    (SqueezeNet) 0.96x on a Zen 4 but faster on a Zen 5, where it also pools
    its output in the same call (conv and max pool: 173 us in one call, 223
    in two, against 242 on `smm`); but 0.88-0.92x at stride 1. With AVX2 (8
    lanes) only stems of up to 32 outputs or 49 taps or more (SqueezeNet's
    0.90x there)."""
    kernels = _kernels()
    if layer.groups != 1 or layer.in_channels > 4 or min(layer.stride) < 2:
        return False
    if kernels.kernel_unavailable("jtile_conv_grouped") is not None:
        return False
    few = layer.out_channels <= 32 or math.prod(layer.kernel_size) >= 49
    return layer.out_channels % kernels.vector_lanes() == 0 and (few or _wide_vectors())


def _auto_conv(eqn, layer: Layer, producers) -> str:
    for name in _conv_preference(eqn, layer):
        if _CONV_SUPPORT[name](eqn, layer) is None:
            return name
    return "default"


# ---------------------------------------------------------------- dense


def _dense_support(eqn, layer: Layer) -> str | None:
    if dense_weight_axis(eqn) is None:
        return (
            "the kernel computes x @ w with a 2-D weight contracted against the last axis of x; "
            f"this product has dimension numbers {eqn.params['dimension_numbers']}"
        )
    preferred = eqn.params.get("preferred_element_type")
    if preferred is not None and np.dtype(preferred) != _F32:
        return f"preferred_element_type {preferred} is not float32"
    return _dtype_reason(eqn) or _kernels().kernel_unavailable("jtile_dense")


def _dense_run(eqn, x, w, *bias, producers):
    transpose_w = dense_weight_axis(eqn) == 1
    if not transpose_w and _is_matrix_transpose(producers.get(eqn.invars[1]) if isinstance(eqn.invars[1], jcore.Var) else None):
        # x @ w.T: hand the kernel w itself; XLA cancels the two transposes.
        w, transpose_w = w.T, True
    rows = x.reshape(-1, x.shape[-1])
    n = w.shape[0] if transpose_w else w.shape[1]

    def dense(b, epilogue):
        if "residual" in epilogue:
            epilogue = dict(epilogue, residual=epilogue["residual"].reshape(-1, n))
        y = _kernels().dense(rows, w, b, transpose_w=transpose_w, **epilogue)
        return y.reshape(*x.shape[:-1], n)

    return _with_epilogue(eqn, dense, bias, out_axis=x.ndim - 1)


def _is_matrix_transpose(eqn) -> bool:
    return eqn is not None and eqn.primitive.name == "transpose" and eqn.params["permutation"] == (1, 0)


def _auto_dense(eqn, layer: Layer, producers) -> str:
    """The kernel for inference-sized batches, where XLA's matrix-vector and
    small GEMM products are slow (and slower still when the weight reaches them
    through a transpose, `x @ w.T`)."""
    rows = math.prod(layer.in_shapes[0][:-1])
    if rows <= _GEMM_MAX_ROWS and _dense_support(eqn, layer) is None:
        return "gemm"
    return "default"


# Measured here, fc 9216->4096: at 1 row the kernel streams the weight in place
# (20x XLA with a traced weight, which XLA transposes first); at 8 rows and more
# with a folded weight it runs the GEMM on the weight packed at trace time (8
# rows: 6.3 against 14.2 ms; 64 rows: 19 against 27 ms). At 8 rows VGG-16's
# classifier took 2.1 s a batch under XLA with traced weights against 0.52 s
# with the kernel. With jax 0.10's XLA (its dots on YNNPACK), looped: 100 rows
# of 4096->4096 1.13x, ViT-B/16's 197 tokens 768->2304 1.04x, 256 rows of
# 768->3072 1.04x and of 3072->768 1.00x; past that XLA wins (384 rows 0.97x,
# 512 0.98x, 1024^3 0.95x, 2048 rows of 512->512 0.92x). ViT-B/16 with its 49
# dense layers on the kernel, interleaved: 1.026-1.028x (medians of 20 and 40
# rounds).
_GEMM_MAX_ROWS = 256


# ---------------------------------------------------------------- matmul


def _matmul_support(eqn, layer: Layer) -> str | None:
    preferred = eqn.params.get("preferred_element_type")
    if preferred is not None and np.dtype(preferred) != _F32:
        return f"preferred_element_type {preferred} is not float32"
    if 0 in (*layer.in_shapes[0], *layer.in_shapes[1]):
        return f"the product of {layer.in_shapes[0]} and {layer.in_shapes[1]} is empty"
    return _dtype_reason(eqn) or _kernels().kernel_unavailable("jtile_matmul")


def _matmul_run(eqn, a, c, *, producers, reads=(None, None), batch_inner=False):
    """The product on the kernel; `reads` holds, per operand, None or `(buffer,
    view, scales)` from `matmul_sources`: the operand is `view` of `buffer`
    times the `scales`, which multiply the product instead: in the kernel
    where they are known (attention's 1 / sqrt(d)), else after it."""
    operands, views, scale = [a, c], [None, None], None
    for i, read in enumerate(reads):
        if read is not None:
            operands[i], views[i], scales = read
            for s in scales:
                s = on_host(s)
                s = s.reshape(()).astype(_F32) if isinstance(s, np.ndarray) else jnp.reshape(s, ()).astype(_F32)
                scale = s if scale is None else scale * s
    known = isinstance(scale, (np.ndarray, np.generic))
    y = _kernels().matmul(*operands, eqn.params["dimension_numbers"], a_view=views[0], c_view=views[1],
                          scale=float(scale) if known else 1.0, batch_inner=batch_inner)
    return y if scale is None or known else y * scale


def matmul_sources(eqn, algorithm: str, producers) -> tuple:
    """Per operand of a matmul run by `algorithm`, the `StridedSource` the
    kernel reads in place through the layout ops that made it (a head split's
    reshapes, transposes and slices, a scale by one number), or None; `()` if
    the algorithm reads its operands as given."""
    if algorithm != "gemm":
        return ()
    (a_contract, c_contract), (a_batch, c_batch) = eqn.params["dimension_numbers"]

    def source(var, contract, batch):
        found = strided_source(producers, var)
        return found if found is not None and _kernels().matmul_reads_in_place(found.view, batch, contract) else None

    return source(eqn.invars[0], a_contract, a_batch), source(eqn.invars[1], c_contract, c_batch)


def head_merge(op, algorithm: str) -> tuple | None:
    """The layout steps (equations) after the matmul `op` (a `jtile.Graph` op)
    run by `algorithm` that merge its batch into its rows, or None: nothing
    else reads them, one after another, and the last lays the product out in
    (rows, batch, columns) order. That is attention's head merge after `P @ V`,
    a transpose XLA copies (118 us a layer in ViT-B/16), which the product
    stored batch-inner (`kernels.matmul(batch_inner=True)`) needs no longer."""
    if algorithm != "gemm":
        return None
    value, steps = op.outs[0], []
    index = np.arange(math.prod(value.shape)).reshape(value.shape)  # each element's offset in the product
    while len(value.consumers) == 1 and not value.is_output and len(value.consumers[0].outs) == 1:
        step = value.consumers[0]
        make = facet(step.eqn, "view")
        if make is None or (view := make(step.eqn, 0)) is None or view.scale is not None or view.source != 0:
            break
        with jax.ensure_compile_time_eval():  # (the plan runs while the function is traced)
            index = np.asarray(step.eqn.primitive.bind(jnp.asarray(index, jnp.int32), **step.eqn.params))
        value = step.outs[0]
        steps.append(step.eqn)
    product = op.outs[0].shape
    if not steps or index.size != math.prod(product):
        return None
    stored = _kernels().matmul_stored_axes(len(op.ins[0].shape), len(product), op.eqn.params["dimension_numbers"],
                                           batch_inner=True)
    merged = np.arange(index.size).reshape(product).transpose(stored)  # the offsets batch-inner storage holds
    return tuple(steps) if np.array_equal(np.ravel(index), np.ravel(merged)) else None


_MATMUL_MAX_MACS = 1 << 22  # per batch element; see _auto_matmul


def _auto_matmul(eqn, layer: Layer, producers) -> str:
    """The kernel for products of at most `_MATMUL_MAX_MACS` multiply-adds per
    batch element (attention's), else XLA. Measured alone on the Zen 5 with the
    kernels' polling helpers, best of 200 interleaved: ViT-B/16's `Q @ K^T`
    (12 heads, 197x64 by 64x197, in the head-split layout) 246 against XLA's
    357 us, `P @ V` 212 against 278; 8 x 128x64x128 60 against 84, 4 x
    49x32x49 9 against 18. Past the limit XLA wins: 12 x 256^3 922 against
    893, 2 x 512^3 1173 against 1063, 1024^3 4571 against 4218."""
    g = DotGeometry.of(eqn)
    return "gemm" if g.m * g.k * g.n <= _MATMUL_MAX_MACS and _matmul_support(eqn, layer) is None else "default"


# ---------------------------------------------------------------- pooling


def _pool_support(kernel: str):
    def support(eqn, layer: Layer) -> str | None:
        if eqn.primitive.name == "reduce_sum":  # a global average pool's sum (find_avg_pools)
            return _dtype_reason(eqn) or _kernels().kernel_unavailable("jtile_global_avg_pool2d")
        if any(d != 1 for d in eqn.params["base_dilation"]):
            return f"base_dilation {eqn.params['base_dilation']} has no kernel"
        if any(d != 1 for d in layer.dilation):
            return f"window dilation {layer.dilation} has no kernel"
        return _dtype_reason(eqn) or _kernels().kernel_unavailable(f"jtile_{kernel}")

    return support


def _pool_spec(eqn) -> tuple[int, ...]:
    return (0, 1, 2, 3) if pool_axes(eqn) == (2, 3) else (0, 3, 1, 2)


def _pool_run(kernel: str):
    def run(eqn, x, *, producers, **prologue):  # (prologue=: see pool_takes_prologue)
        if eqn.primitive.name == "reduce_sum":  # the average, shaped as the sum it replaces
            return _kernels().global_avg_pool2d(x).reshape(eqn.outvars[0].aval.shape)
        spec = _pool_spec(eqn)
        y = getattr(_kernels(), kernel)(_reorder(x, spec), *_pool_window(eqn), **prologue)
        return _restore(y, spec)

    return run


def pool_takes_prologue(pool) -> bool:
    """Whether the swapped average pool whose sum is the equation `pool` can
    apply a per-channel prologue to its input (`kernels.avg_pool2d(prologue=)`):
    an NCHW window smaller than the image."""
    return (pool.primitive.name == "reduce_window_sum" and pool_axes(pool) == (2, 3)
            and tuple(pool.params["window_dimensions"][2:]) != tuple(pool.invars[0].aval.shape[2:]))


def find_avg_pools(graph: Graph) -> dict[int, int]:
    """`{id(sum eqn): id(div eqn)}` for every sum pool (`reduce_window_sum`)
    whose one use divides it by its window size, and every global average pool:
    a `reduce_sum` over an NCHW tensor's H and W whose one use divides it by
    H * W, directly or after broadcasting it back to (N, C, 1, 1) (ONNX's
    GlobalAveragePool as imported, `jnp.mean`); in `graph` and its
    control-flow bodies."""
    pairs = {}
    for op in graph.all_ops():
        if op.primitive == "reduce_window_sum" and pool_axes(op.eqn) is not None:
            window = math.prod(op.eqn.params["window_dimensions"])
        elif op.primitive == "reduce_sum" and op.ins[0].aval.ndim == 4 and tuple(op.eqn.params["axes"]) == (2, 3):
            window = math.prod(op.ins[0].shape[2:])
        else:
            continue
        (out,) = op.outs
        if out.is_output or len(out.consumers) != 1:
            continue
        use = out.consumers[0]
        if use.primitive == "broadcast_in_dim" and op.primitive == "reduce_sum" and not use.outs[0].is_output \
                and use.outs[0].shape == (*out.shape, 1, 1) and len(use.outs[0].consumers) == 1:
            out, use = use.outs[0], use.outs[0].consumers[0]
        if _divides_by(use, out, window):
            pairs[id(op.eqn)] = id(use.eqn)
    return pairs


def global_pool_layer(eqn) -> Layer:
    """A global average pool's `reduce_sum` (`find_avg_pools`) as the
    `avgpool2d` layer it is: one window over the whole image."""
    n, c, h, w = eqn.invars[0].aval.shape
    return Layer(kind="avgpool2d", **layer_fields(eqn), in_channels=c, out_channels=c, kernel_size=(h, w),
                 stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), lhs_dilation=(1, 1))


def _divides_by(op, numerator, value: int) -> bool:
    if op.primitive != "div" or op.ins[0] is not numerator:
        return False
    divisor = op.ins[1]
    return divisor.role == "literal" and np.ndim(divisor.var.val) == 0 and divisor.var.val == value


def _auto_pool(kernel: str):
    def auto(eqn, layer: Layer, producers) -> str:
        """The kernel wherever it supports the window: measured 1.1-6x XLA on
        strided windows (3x3 stride 2 on ResNet's and GoogLeNet's stems, 2x2
        stride 2 on VGG-16's 224x224 planes) and 2.4-4.5x on stride-1 windows
        (GoogLeNet's inception pools from 28x28 down to 7x7 at 832 channels:
        0.062 against 0.151 ms). Global pools: one call instead of XLA's
        reduce and divide, RegNetY-400MF's squeeze-excitation blocks
        1.03-1.05x, EfficientNet-B0's 1.02x in whole models."""
        return "direct" if _pool_support(kernel)(eqn, layer) is None else "default"

    return auto


# ---------------------------------------------------------------- tables


# ---------------------------------------------------------------- resize


def _resized_axes(eqn) -> list[int]:
    from . import _resize

    p = eqn.params
    return _resize.resized_axes(eqn.invars[0].aval.shape, p["sizes"], p["scales"], p["coords"])


def _resize_support(eqn, layer: Layer) -> str | None:
    if eqn.params["coords"] == "tf_crop_and_resize":
        return "tf_crop_and_resize has no kernel"
    if eqn.invars[0].aval.ndim < 2 or any(a < eqn.invars[0].aval.ndim - 2 for a in _resized_axes(eqn)):
        return "the kernel resizes the last two axes only"
    return _dtype_reason(eqn) or _kernels().kernel_unavailable("jtile_resize2d")


def _resize_taps(eqn, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """`(index, weights)` of one axis for the kernel, as `_resize._resize_axis` reads it."""
    from . import _resize

    p, size = eqn.params, eqn.invars[0].aval.shape[axis]
    if axis not in _resized_axes(eqn):
        return np.arange(size)[:, None], np.ones((size, 1))
    neighbours, coeffs, _ = _resize.axis_taps(size, p["sizes"][axis], p["scales"][axis], p["roi"][axis],
                                              _resize.interpolation(p))
    return _resize.read_taps(neighbours, coeffs, size)


def _resize_run(eqn, x, *, producers):
    rank = eqn.invars[0].aval.ndim
    return _kernels().resize2d(x, *_resize_taps(eqn, rank - 2), *_resize_taps(eqn, rank - 1))


# ------------------------------------------------ softmax and layer norm


def _trailing(eqn) -> int | None:
    """The row length the kernel normalises: the product of the trailing `axes`,
    or None when the axes are not the trailing ones."""
    shape, axes = eqn.invars[0].aval.shape, tuple(eqn.params["axes"])
    return math.prod(shape[len(shape) - len(axes):]) if axes == tuple(range(len(shape) - len(axes), len(shape))) \
        else None


def _row_norm_support(target: str):
    def support(eqn, layer: Layer) -> str | None:
        if _trailing(eqn) is None:
            return f"the kernel normalises the trailing axes only, not axes {tuple(eqn.params['axes'])}"
        n, axes = _trailing(eqn), len(eqn.params["axes"])
        if any(math.prod(v.aval.shape) not in (1, n) or v.aval.ndim > axes for v in eqn.invars[1:]):
            return "the kernel takes one scale and bias value per normalised element, or one in all"
        return _dtype_reason(eqn) or _kernels().kernel_unavailable(target)

    return support


def _softmax_run(eqn, x, *, producers):
    return _kernels().softmax(x.reshape(-1, _trailing(eqn))).reshape(x.shape)


def _layer_norm_run(eqn, x, scale, bias, *, producers):
    n = _trailing(eqn)
    return _kernels().layer_norm(x.reshape(-1, n), scale.reshape(-1), bias.reshape(-1),
                                 epsilon=eqn.params["epsilon"]).reshape(x.shape)


def _auto_where_supported(support):
    """The kernel wherever it supports the layer. Resize: DeepLabV3's bilinear
    28x28 -> 224x224 over 21 classes, looped, 0.16 against XLA's 1.32 ms.
    Softmax and layer norm, inside ViT-B/16 (profiled, per call): its softmax
    over 12 x 197 x 197 102-115 us against XLA's four fusions' 485, its layer
    norms over 197 x 768 about 34 against 155."""
    return lambda eqn, layer, producers: "direct" if support(eqn, layer) is None else "default"


CONV_ALGORITHMS = ("direct", "smm", "winograd", "depthwise", "grouped")
_CONV_SUPPORT = {**{name: _conv_support(name) for name in CONV_ALGORITHMS}, "dense": _single_pixel_support}

# (kind, name, support, run) for every kernel algorithm.
ALGORITHMS = (
    *(("conv2d", name, _CONV_SUPPORT[name], _conv_run(name)) for name in CONV_ALGORITHMS),
    ("conv2d", "dense", _single_pixel_support, _single_pixel_run),
    ("dense", "gemm", _dense_support, _dense_run),
    ("matmul", "gemm", _matmul_support, _matmul_run),
    *((f"{kind}pool2d", "direct", _pool_support(f"{kind}_pool2d"), _pool_run(f"{kind}_pool2d"))
      for kind in ("max", "avg")),
    ("resize", "direct", _resize_support, _resize_run),
    ("softmax", "direct", _row_norm_support("jtile_softmax"), _softmax_run),
    ("layer_norm", "direct", _row_norm_support("jtile_layer_norm"), _layer_norm_run),
)

AUTO = {
    "conv2d": _auto_conv,
    "dense": _auto_dense,
    "matmul": _auto_matmul,
    "maxpool2d": _auto_pool("max_pool2d"),
    "avgpool2d": _auto_pool("avg_pool2d"),
    "resize": _auto_where_supported(_resize_support),
    "softmax": _auto_where_supported(_row_norm_support("jtile_softmax")),
    "layer_norm": _auto_where_supported(_row_norm_support("jtile_layer_norm")),
}

# The primitives whose equations a swap may replace (or drop: the avg-pool divide).
PRIMITIVES = (
    "conv_general_dilated", "conv_bias_act", "dot_general", "dense",
    "reduce_window_max", "reduce_window_sum", "reduce_sum", "div", "resize", "softmax", "layer_norm",
)

