import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jtile
import jtile.onnx
from jtile import _algorithm_kinds
from jtile.algorithms import algorithm_names, layer_kinds, swap_backend, swap_conv2d
from jtile.fusion import fuse

RTOL, ATOL = 2e-4, 2e-4
NCHW = ("NCHW", "OIHW", "NCHW")


def _conv(x, w, stride=1, padding=1, groups=1, dn=NCHW):
    pads = ((padding, padding), (padding, padding))
    return lax.conv_general_dilated(
        x, w, (stride, stride), pads, dimension_numbers=dn, feature_group_count=groups
    )


def _convnet(p, x):
    """conv 3x3 -> relu -> depthwise 3x3 -> conv 1x1 (stride 2) -> max pool -> avg pool -> fc."""
    with jax.named_scope("stem"):
        y = jax.nn.relu(_conv(x, p["w1"]) + p["b1"][:, None, None])
    with jax.named_scope("dw"):
        y = jax.nn.relu(_conv(y, p["w2"], groups=16))
    with jax.named_scope("pw"):
        y = _conv(y, p["w3"], stride=2, padding=0)
    y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
    y = lax.reduce_window(y, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4
    return y.reshape(y.shape[0], -1) @ p["fc"]


@pytest.fixture
def convnet(getkey):
    def normal(shape, scale=0.3):
        return scale * jax.random.normal(getkey(), shape)

    params = {
        "w1": normal((16, 3, 3, 3)),
        "b1": normal((16,)),
        "w2": normal((16, 1, 3, 3)),
        "w3": normal((24, 16, 1, 1)),
        "fc": normal((24 * 2 * 2, 10)),
    }
    return params, normal((2, 3, 16, 16), 1.0)


def _ffi_calls(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return str(jaxpr).count("ffi_call")


def _kinds_all(name):
    return {kind: name for kind in ("conv2d", "maxpool2d", "avgpool2d")}


@pytest.mark.parametrize("conv", ["direct", "smm"])
def test_string_selector_swaps_every_layer_and_matches_xla(convnet, tree_allclose, conv):
    params, x = convnet
    swapped = swap_backend(_convnet, algorithms={**_kinds_all("direct"), "conv2d": conv, "dense": "gemm"})
    assert _ffi_calls(swapped, params, x) == 6
    assert tree_allclose(jax.jit(swapped)(params, x), _convnet(params, x), rtol=RTOL, atol=ATOL)


def test_list_selector_is_one_name_per_layer_in_program_order(convnet, tree_allclose):
    params, x = convnet
    swapped = swap_backend(_convnet, algorithms={"conv2d": ["default", "depthwise", "default"]})
    jaxpr = jax.make_jaxpr(swapped)(params, x)
    assert str(jaxpr).count("ffi_call") == 1
    assert str(jaxpr).count("conv_general_dilated") == 2
    assert tree_allclose(swapped(params, x), _convnet(params, x), rtol=RTOL, atol=ATOL)


def test_callable_selector_sees_each_layer(convnet, tree_allclose):
    params, x = convnet
    seen = []

    def pick(layer: jtile.Layer) -> str:
        seen.append((layer.index, layer.name, layer.groups, layer.stride, layer.kernel_size))
        return "depthwise" if layer.groups > 1 else "direct"

    swapped = swap_conv2d(_convnet, selector=pick)
    assert tree_allclose(swapped(params, x), _convnet(params, x), rtol=RTOL, atol=ATOL)
    assert seen == [
        (0, "stem", 1, (1, 1), (3, 3)),
        (1, "dw", 16, (1, 1), (3, 3)),
        (2, "pw", 1, (2, 2), (1, 1)),
    ]


def test_list_of_wrong_length_names_the_expected_count(convnet):
    params, x = convnet
    with pytest.raises(jtile.ConfigError, match="lists 2 algorithm.*has 3 conv2d layer.*exactly 3"):
        swap_backend(_convnet, algorithms={"conv2d": ["direct", "direct"]})(params, x)


def test_explicit_unsupported_algorithm_names_layer_and_reason(convnet):
    params, x = convnet
    with pytest.raises(jtile.UnsupportedError, match=r"'winograd'.*conv2d #2 'pw'.*stride \(2, 2\)"):
        swap_backend(_convnet, algorithms={"conv2d": ["default", "default", "winograd"]})(params, x)


def test_unknown_names_list_the_valid_ones(convnet):
    params, x = convnet
    with pytest.raises(jtile.ConfigError, match="unknown layer kind 'conv9d'; valid kinds are avgpool2d, conv2d"):
        swap_backend(_convnet, algorithms={"conv9d": "direct"})
    with pytest.raises(jtile.ConfigError, match="unknown conv2d algorithm 'fft'.*winograd"):
        swap_conv2d(_convnet, selector="fft")
    with pytest.raises(jtile.ConfigError, match="'bogus' returned by the selector for conv2d #0 'stem'"):
        swap_conv2d(_convnet, selector=lambda layer: "bogus")(params, x)
    with pytest.raises(jtile.ConfigError, match="unknown keyword.*algorithm"):
        swap_backend(_convnet, algorithm="direct")
    assert set(layer_kinds()) == {"conv2d", "dense", "matmul", "maxpool2d", "avgpool2d", "resize", "softmax",
                                  "layer_norm"}
    assert algorithm_names("dense") == algorithm_names("matmul") == ("default", "auto", "measured", "gemm")


def test_auto_swaps_where_a_kernel_wins_and_keeps_xla_elsewhere(getkey, tree_allclose):
    x = jax.random.normal(getkey(), (1, 64, 24, 24))
    shapes = [(64, 64, 3, 3), (64, 1, 3, 3), (64, 64, 3, 3), (64, 64, 3, 3)]
    weights = [jax.random.normal(getkey(), s) * 0.1 for s in shapes]

    def dilated(y, w):
        return lax.conv_general_dilated(y, w, (1, 1), ((2, 2), (2, 2)), rhs_dilation=(2, 2), dimension_numbers=NCHW)

    def net(x, w):
        y = _conv(x, w[0])  # 3x3 stride 1, 24x24 out: winograd
        y = _conv(y, w[1], groups=64)  # depthwise
        small = _conv(y, w[2], stride=2)  # strided 3x3: vectors of output channels (AVX2: im2col + GEMM)
        # dilated: XLA over 24x24 outputs (as fast as the kernels there), im2col + GEMM over 12x12
        return dilated(y, w[3]), dilated(small, w[3])

    chosen = []
    swapped = swap_backend(net, algorithms="auto")
    assert tree_allclose(swapped(x, weights), net(x, weights), rtol=RTOL, atol=ATOL)
    jaxpr = str(jax.make_jaxpr(swapped)(x, weights))
    assert jaxpr.count("ffi_call") == 4 and jaxpr.count("conv_general_dilated") == 1
    for kernel in ("winograd", "depthwise", "grouped" if jtile.kernels.vector_lanes() == 16 else "smm", "smm"):
        assert f"jtile_conv_{kernel}" in jaxpr
    swap_conv2d(net, selector=lambda layer: chosen.append(layer.index) or "auto")(x, weights)
    assert chosen == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("channels, groups", [(64, 16), (128, 32), (128, 8), (96, 3)])
def test_auto_takes_the_grouped_kernel_for_grouped_convs(getkey, tree_allclose, channels, groups):
    """RegNet's and ResNeXt's grouped 3x3 convs, groups of 4 to 32 channels."""
    x = jax.random.normal(getkey(), (1, channels, 14, 14))
    w = jax.random.normal(getkey(), (channels, channels // groups, 3, 3)) * 0.1

    def grouped(x, w):
        return jax.nn.relu(_conv(x, w, stride=2, groups=groups))

    swapped = swap_backend(grouped, algorithms="auto")
    jaxpr = str(jax.make_jaxpr(swapped)(x, w))
    assert "jtile_conv_grouped" in jaxpr and "conv_general_dilated" not in jaxpr
    assert tree_allclose(jax.jit(swapped)(x, w), grouped(x, w), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("out, kernel, stride, target", [
    (16, 3, 2, "grouped"),  # MobileNetV3's stem
    (64, 7, 2, "grouped"),  # ResNet's
    (64, 11, 4, "grouped"),  # AlexNet's
    (64, 3, 2, "grouped"),  # SqueezeNet's
    (24, 3, 2, "smm"),  # ShuffleNetV2's: not whole vectors
    (16, 3, 1, "smm"),  # not strided
])
def test_auto_runs_image_stems_on_vectors_of_output_channels(getkey, tree_allclose, out, kernel, stride, target):
    x = jax.random.normal(getkey(), (1, 3, 45, 45))
    w = jax.random.normal(getkey(), (out, 3, kernel, kernel)) * 0.1

    def stem(x, w):
        return jax.nn.relu(_conv(x, w, stride=stride, padding=kernel // 2))

    swapped = swap_backend(stem, algorithms="auto")
    lanes = jtile.kernels.vector_lanes()  # the targets are for AVX-512's 16; AVX2's 8 makes 24 whole vectors
    whole = out % lanes == 0 and stride >= 2 and (out <= 32 or kernel * kernel >= 49)
    expected = target if lanes == 16 else ("grouped" if whole else "smm")
    assert f"jtile_conv_{expected}" in str(jax.make_jaxpr(swapped)(x, w))
    assert tree_allclose(jax.jit(swapped)(x, w), stem(x, w), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("channels, out, kernel, stride, side, target, avx2_target", [
    (128, 128, 3, 2, 28, "grouped", "smm"),  # ResNet's strided 3x3
    # 2.4 MB of weights, 4 MB as Winograd's: from memory in a model
    (256, 256, 3, 1, 14, "grouped", "winograd"),
    (256, 256, 3, 2, 14, "grouped", "smm"),  # 2.4 MB of weights over 7x7 outputs
    (512, 512, 3, 1, 7, "grouped", "smm"),  # 9 MB
    (192, 384, 3, 1, 28, "winograd", "winograd"),  # 4.5 MB of weights as Winograd's, but 28x28 outputs
    (384, 256, 3, 1, 13, "grouped", "winograd"),  # AlexNet's: 3.4 MB of weights
    (64, 192, 5, 1, 27, "grouped", "smm"),  # AlexNet's 5x5
    # DenseNet's 3x3: few outputs, Winograd's transforms outweigh them
    (128, 32, 3, 1, 14, "grouped", "winograd"),
    (128, 32, 3, 1, 56, "winograd", "winograd"),  # ... but not at 56x56
    # at 16x16 and below a 4x4 Winograd tile is mostly edge (SqueezeNet's, GoogLeNet's)
    (48, 192, 3, 1, 13, "grouped", "winograd"),
    (96, 208, 3, 1, 14, "grouped", "winograd"),  # 13 vectors of outputs: pairs and a single
    (128, 256, 3, 1, 14, "grouped", "winograd"),
    (64, 256, 3, 1, 13, "grouped", "winograd"),  # SqueezeNet's
    (32, 128, 3, 1, 27, "winograd", "winograd"),  # ... but not at 27x27
    (64, 64, 3, 1, 28, "winograd", "winograd"),
    (3, 64, 3, 1, 28, "smm", "smm"),  # the image's 3 channels at stride 1
    (64, 64, 1, 1, 28, "smm", "smm"),  # 1x1
])
@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_auto_takes_vectors_of_output_channels_for_convs_with_few_weights(getkey, tree_allclose, monkeypatch,
                                                                           channels, out, kernel, stride, side,
                                                                           target, avx2_target, vendor):
    """Measured with AVX-512 on AMD; with AVX2's 8 lanes im2col + GEMM and Winograd keep these layers, and
    on Intel Winograd takes the 3x3s of 128 channels or more at 13x13 and 14x14."""
    monkeypatch.setattr(_algorithm_kinds, "cpu_field", lambda field: vendor if field == "vendor_id" else "")
    x = jax.random.normal(getkey(), (1, channels, side, side))
    w = jax.random.normal(getkey(), (out, channels, kernel, kernel)) * 0.1

    def layer(x, w):
        return jax.nn.relu(_conv(x, w, stride=stride, padding=kernel // 2))

    swapped = swap_backend(layer, algorithms="auto")
    intel_winograd = (vendor == "GenuineIntel" and kernel == 3 and stride == 1 and side in (13, 14)
                      and min(channels, out) >= 128)
    expected = avx2_target if jtile.kernels.vector_lanes() != 16 else "winograd" if intel_winograd else target
    assert f"jtile_conv_{expected}" in str(jax.make_jaxpr(swapped)(x, w))
    assert tree_allclose(jax.jit(swapped)(x, w), layer(x, w), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("rows, swapped", [(1, True), (8, True), (256, True), (257, False)])
def test_auto_dense_takes_the_kernel_for_inference_batches(getkey, tree_allclose, rows, swapped):
    x, w = jax.random.normal(getkey(), (rows, 48)), jax.random.normal(getkey(), (24, 48))

    def fc(x, w):
        return x @ w.T  # torch's weight layout

    assert _ffi_calls(swap_backend(fc, algorithms="auto"), x, w) == int(swapped)
    assert tree_allclose(swap_backend(fc, algorithms="auto")(x, w), fc(x, w), rtol=RTOL, atol=ATOL)


def test_non_float32_falls_back_with_auto_and_raises_when_explicit(getkey):
    x = jax.random.normal(getkey(), (1, 32, 16, 16), jnp.bfloat16)
    w = jax.random.normal(getkey(), (32, 32, 3, 3), jnp.bfloat16)
    swapped = swap_backend(_conv, algorithms="auto")
    assert _ffi_calls(swapped, x, w) == 0
    assert np.array_equal(np.asarray(swapped(x, w)), np.asarray(_conv(x, w)))
    with pytest.raises(jtile.UnsupportedError, match="conv2d #0.*float32 only"):
        swap_conv2d(_conv, selector="direct")(x, w)


def test_transposed_conv_falls_back_with_auto(getkey):
    x, w = jax.random.normal(getkey(), (1, 16, 6, 6)), jax.random.normal(getkey(), (16, 16, 3, 3))

    def transposed(x, w):
        return lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))

    assert _ffi_calls(swap_backend(transposed, algorithms="auto"), x, w) == 0
    with pytest.raises(jtile.UnsupportedError, match="lhs_dilation"):
        swap_conv2d(transposed, selector="direct")(x, w)


@pytest.mark.parametrize("dn", [("NHWC", "HWIO", "NHWC"), ("NCHW", "HWIO", "NHWC"), ("NHWC", "OIHW", "NCHW")])
def test_any_dimension_numbers(getkey, tree_allclose, dn):
    x = jax.random.normal(getkey(), (2, 16, 10, 10))
    w = jax.random.normal(getkey(), (24, 16, 3, 3)) * 0.1
    x = x if dn[0] == "NCHW" else x.transpose(0, 2, 3, 1)
    w = w if dn[1] == "OIHW" else w.transpose(2, 3, 1, 0)

    def f(x, w):
        return _conv(x, w, dn=dn)

    swapped = swap_conv2d(f, selector="winograd")
    assert _ffi_calls(swapped, x, w) == 1
    assert tree_allclose(swapped(x, w), f(x, w), rtol=RTOL, atol=ATOL)


def test_channels_last_pools_from_equinox(getkey, tree_allclose):
    x = jax.random.normal(getkey(), (8, 9, 9))
    maxpool, avgpool = eqx.nn.MaxPool2d(3, 2, padding=1), eqx.nn.AvgPool2d(2, 2)

    def f(x):
        return maxpool(x), avgpool(x)

    swapped = swap_backend(f, algorithms={"maxpool2d": "direct", "avgpool2d": "default"})
    assert _ffi_calls(swapped, x) == 1
    assert tree_allclose(swapped(x), f(x), rtol=RTOL, atol=ATOL)


def test_dense_weight_layouts_and_batched_rows(getkey, tree_allclose):
    x = jax.random.normal(getkey(), (2, 3, 40))
    w = jax.random.normal(getkey(), (40, 7))
    for f, weight in [(lambda x, w: x @ w, w), (lambda x, w: x @ w.T, w.T)]:
        swapped = swap_backend(f, algorithms={"dense": "gemm"})
        assert _ffi_calls(swapped, x, weight) == 1
        assert tree_allclose(swapped(x, weight), f(x, weight), rtol=RTOL, atol=ATOL)
    batched = swap_backend(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), algorithms={"dense": "gemm"})
    assert _ffi_calls(batched, x, x.transpose(0, 2, 1)) == 0  # a matmul, not a dense layer


def test_sum_pool_without_the_divide_is_not_an_avg_pool(getkey, tree_allclose):
    x = jax.random.normal(getkey(), (1, 4, 8, 8))

    def sum_pool(x):
        return lax.reduce_window(x, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 3

    assert _ffi_calls(swap_backend(sum_pool, algorithms={"avgpool2d": "direct"}), x) == 0
    with pytest.raises(jtile.ConfigError, match="lists 1 algorithm.*has 0 avgpool2d"):
        swap_backend(sum_pool, algorithms={"avgpool2d": ["direct"]})(x)


def test_fused_conv_bias_act_is_one_kernel_call(convnet, tree_allclose):
    params, x = convnet
    fused = fuse(_convnet)
    swapped = swap_backend(fused, algorithms={"conv2d": "direct"})
    jaxpr = jax.make_jaxpr(swapped)(params, x)
    assert str(jax.make_jaxpr(fused)(params, x)).count("conv_bias_act") >= 1
    assert "conv_bias_act" not in str(jaxpr) and "max(" not in str(jaxpr)
    assert str(jaxpr).count("ffi_call") == 3
    assert tree_allclose(jax.jit(swapped)(params, x), _convnet(params, x), rtol=RTOL, atol=ATOL)


def test_grad_through_swapped_function(convnet, tree_allclose):
    params, x = convnet
    swapped = swap_backend(_convnet, algorithms={**_kinds_all("direct"), "dense": "gemm"})

    def loss(fn):
        return lambda p: jnp.sum(fn(p, x) ** 2)

    assert tree_allclose(jax.grad(loss(swapped))(params), jax.grad(loss(_convnet))(params), rtol=1e-3, atol=1e-4)


def test_decorator_forms_and_composition_with_jit_and_tiling(convnet, tree_allclose):
    params, x = convnet
    expected = _convnet(params, x)

    @swap_backend(algorithms={"conv2d": "direct"})
    def decorated(p, x):
        return _convnet(p, x)

    @swap_conv2d(selector="direct")
    def decorated_conv(p, x):
        return _convnet(p, x)

    tiled = swap_backend(jtile.tile_conv(_convnet, axis="H", tiles=2), algorithms={"conv2d": "direct"})
    assert _ffi_calls(tiled, params, x) == 6
    for fn in (jax.jit(decorated), eqx.filter_jit(decorated_conv), jax.jit(tiled)):
        assert tree_allclose(fn(params, x), expected, rtol=RTOL, atol=ATOL)
    assert decorated.__name__ == "decorated"


def test_ai3_readme_convnet_with_its_selector_list(tree_allclose):
    fn, params = jtile.models.as_function(jtile.models.get("ai3_convnet", jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (2, 3, 32, 32))
    swapped = swap_conv2d(fn, selector=["direct", "smm"])
    assert _ffi_calls(swapped, params, x) == 2
    assert tree_allclose(jax.jit(swapped)(params, x), jax.jit(fn)(params, x), rtol=RTOL, atol=ATOL)


def test_onnx_imported_model_is_swapped(tree_allclose):
    fn, params = jtile.models.as_function(jtile.models.get("ai3_convnet", jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (1, 3, 32, 32))
    imported = jtile.onnx.load(jtile.onnx.export(fn, x, params=params))
    swapped = swap_backend(imported.fn, algorithms={"conv2d": ["smm", "winograd"], "maxpool2d": "direct"})
    assert _ffi_calls(swapped, imported.params, x) == 3
    assert tree_allclose(swapped(imported.params, x), fn(params, x), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_zoo_model_swapped_with_auto(tree_allclose):
    model = jtile.models.get("mobilenet_v2", jax.random.key(0))
    fn, params = jtile.models.as_function(model)
    x = jax.random.normal(jax.random.key(1), (1, 3, 32, 32))
    swapped = swap_backend(fuse(fn), algorithms="auto")
    assert _ffi_calls(swapped, params, x) >= 17  # at least every depthwise conv
    assert tree_allclose(jax.jit(swapped)(params, x), jax.jit(fn)(params, x), rtol=1e-3, atol=1e-4)


def test_fused_dense_with_per_row_bias_adds_it_after_the_kernel(getkey, tree_allclose):
    w, x, b = (jax.random.normal(getkey(), s) for s in [(8, 40), (40, 3), (8, 1)])

    def f(w, x, b):
        return jax.nn.relu(w @ x + b)

    fused = fuse(f)
    assert "dense[" in str(jax.make_jaxpr(fused)(w, x, b))
    swapped = swap_backend(fused, algorithms={"dense": "gemm"})
    assert _ffi_calls(swapped, w, x, b) == 1
    assert tree_allclose(swapped(w, x, b), f(w, x, b), rtol=RTOL, atol=ATOL)


def test_folded_weights_are_packed_once_at_trace_time(getkey, tree_allclose):
    """With params folded, the GEMM packing of the weight leaves no op in the graph:
    the packed weight is a constant. With params traced, packing runs in the graph."""
    from jtile import kernels
    from jtile._interpreter import iter_eqns
    from jtile.fusion import fold_params

    w = jax.random.normal(getkey(), (40, 16, 3, 3)) * 0.1
    x = jax.random.normal(getkey(), (1, 16, 9, 9))
    net = lambda w, x: jax.nn.relu(_conv(x, w, stride=2))  # noqa: E731
    folded = swap_backend(fold_params(net, w), algorithms={"conv2d": "smm"})
    closed = jax.make_jaxpr(folded)(x)
    assert {e.primitive.name for e in iter_eqns(closed.jaxpr)} == {"custom_vjp_call", "ffi_call"}
    mr, nr = kernels.gemm_tile()
    # 5x5 outputs: pixels are the GEMM rows, channels packed nr a strip (the raw
    # weight stays a constant too, for the backward pass's reference)
    assert (1, -(-40 // nr), 16 * 9, nr) in [c.shape for c in closed.consts]
    traced = {e.primitive.name
              for e in iter_eqns(jax.make_jaxpr(swap_backend(net, algorithms={"conv2d": "smm"}))(w, x).jaxpr)}
    assert {"pad", "transpose"} <= traced
    assert tree_allclose(jax.jit(folded)(x), net(w, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("size, window, stride", [(28, 3, 1), (7, 3, 1), (14, 3, 2), (16, 2, 2)])
def test_auto_pools_take_the_kernel(getkey, tree_allclose, size, window, stride):
    x = jax.random.normal(getkey(), (1, 8, size, size))
    pads = ((0, 0), (0, 0), (window // 2, window // 2), (window // 2, window // 2))

    def pools(x):
        dims, strides = (1, 1, window, window), (1, 1, stride, stride)
        peak = lax.reduce_window(x, -jnp.inf, lax.max, dims, strides, pads)
        mean = lax.reduce_window(x, 0.0, lax.add, dims, strides, pads) / (window * window)
        return peak, mean

    auto = swap_backend(pools, algorithms="auto")
    assert _ffi_calls(auto, x) == 2
    assert tree_allclose(jax.jit(auto)(x), pools(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "attrs, include_pad",
    [(dict(kernel_shape=[2, 2], strides=[2, 2]), 0),  # DenseNet's transition pool
     (dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]), 1)],  # Inception's, counting the pads
)
def test_auto_swaps_an_imported_average_pool(attrs, include_pad):
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    node = helper.make_node("AveragePool", ["x"], ["y"], count_include_pad=include_pad, **attrs)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, None, None])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).standard_normal((1, 8, 16, 16)).astype(np.float32)
    model = jtile.onnx.load(proto)
    auto = swap_backend(model.fn, algorithms="auto")
    jaxpr = str(jax.make_jaxpr(auto)(model.params, x))
    assert "jtile_avg_pool2d" in jaxpr and "reduce_window_sum" not in jaxpr
    (want,) = ReferenceEvaluator(proto).run(None, {"x": x})
    np.testing.assert_allclose(jax.jit(auto)(model.params, x), want, rtol=1e-5, atol=1e-6)


def _squeeze_excite(p, x, dn=NCHW):
    """MobileNetV3's squeeze-excitation: global mean, 1x1 conv, relu, 1x1 conv, hard sigmoid, scale."""
    spatial = (1, 2) if dn[0] == "NHWC" else (2, 3)
    bias = lambda b: b if dn[2] == "NHWC" else b[:, None, None]  # noqa: E731
    s = jnp.mean(x, axis=spatial, keepdims=True)
    s = jax.nn.relu(_conv(s, p["w1"], padding=0, dn=dn) + bias(p["b1"]))
    s = jax.nn.hard_sigmoid(_conv(s, p["w2"], padding=0, dn=dn) + bias(p["b2"]))
    return x * s


@pytest.mark.parametrize("dn", [NCHW, ("NHWC", "HWIO", "NHWC")])
def test_auto_runs_single_pixel_convs_on_the_dense_kernel(getkey, tree_allclose, dn):
    """1x1 convs over a 1x1 image (squeeze-excitation) go to the dense kernel,
    bias and activation fused, in any layout and at batch 2."""
    x = jax.random.normal(getkey(), (2, 40, 5, 5))
    p = dict(w1=jax.random.normal(getkey(), (10, 40, 1, 1)) * 0.3, b1=jax.random.normal(getkey(), (10,)),
             w2=jax.random.normal(getkey(), (40, 10, 1, 1)) * 0.3, b2=jax.random.normal(getkey(), (40,)))
    if dn[0] == "NHWC":
        x = x.transpose(0, 2, 3, 1)
        p = dict(p, w1=p["w1"].transpose(2, 3, 1, 0), w2=p["w2"].transpose(2, 3, 1, 0))
    block = lambda p, x: _squeeze_excite(p, x, dn)  # noqa: E731
    swapped = swap_backend(fuse(block), algorithms="auto")
    text = str(jax.make_jaxpr(swapped)(p, x))
    assert text.count("jtile_dense") == 2 and "jtile_conv" not in text
    assert tree_allclose(swapped(p, x), block(p, x), rtol=RTOL, atol=ATOL)


def test_dense_conv_algorithm_explains_the_layers_it_cannot_run(convnet):
    params, x = convnet
    with pytest.raises(jtile.UnsupportedError, match=r"'dense'.*conv2d #0 'stem'.*\(3, 3\) window over \(16, 16\)"):
        swap_conv2d(_convnet, selector="dense")(params, x)


# ---------------------------------------------------------------- attention

HEADS, WIDTH = 4, 8


def _attention(p, x):
    """A transformer block's attention as torch exports it: x (tokens, 1, dim)
    projected to q, k, v (3-D activations times 2-D weights), heads split by
    reshape and transpose, batched Q @ K^T and P @ V, heads merged, projected."""
    tokens, _, dim = x.shape
    with jax.named_scope("qkv"):
        q, k, v = jnp.split(x @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)

    def heads(t):
        return t.reshape(tokens, HEADS, WIDTH).transpose(1, 0, 2)

    with jax.named_scope("scores"):
        scores = heads(q) @ heads(k).transpose(0, 2, 1) / np.sqrt(WIDTH)
    with jax.named_scope("mix"):
        mixed = jax.nn.softmax(scores, axis=-1) @ heads(v)
    with jax.named_scope("out"):
        return mixed.transpose(1, 0, 2).reshape(tokens, 1, dim) @ p["w_out"].T


@pytest.fixture
def attention(getkey):
    dim = HEADS * WIDTH
    params = {"w_qkv": jax.random.normal(getkey(), (dim, 3 * dim)) / np.sqrt(dim),
              "b_qkv": jax.random.normal(getkey(), (3 * dim,)),
              "w_out": jax.random.normal(getkey(), (dim, dim)) / np.sqrt(dim)}
    return params, jax.random.normal(getkey(), (13, 1, dim))


def _targets(fn, *args) -> list[str]:
    return [e.params["target_name"] for e in _iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "ffi_call"]


def _iter_eqns(jaxpr):
    from jtile._interpreter import iter_eqns

    return iter_eqns(jaxpr)


def test_attention_block_runs_on_the_kernels(attention, tree_allclose):
    params, x = attention
    swapped = swap_backend(_attention, algorithms={"dense": "gemm", "matmul": "gemm"})
    assert sorted(_targets(swapped, params, x)) == ["jtile_dense"] * 2 + ["jtile_matmul"] * 2
    assert tree_allclose(jax.jit(swapped)(params, x), _attention(params, x), rtol=RTOL, atol=ATOL)
    # The split and the head split's reshapes and transposes are seen through:
    # both products read q, k and v where the QKV projection wrote them, heads
    # WIDTH floats apart, tokens 3 * dim apart, at offsets 0, dim and 2 * dim.
    calls = [e for e in _iter_eqns(jax.make_jaxpr(swapped)(params, x).jaxpr)
             if e.primitive.name == "ffi_call" and e.params["target_name"] == "jtile_matmul"]
    views = [[list(np.asarray(dict(e.params["attributes"])[n].val)) for n in ("a_view", "c_view")] for e in calls]
    dim = HEADS * WIDTH
    assert [e.invars[0].aval.shape for e in calls[:1]] + [e.invars[1].aval.shape for e in calls] == [(13, 1, 3 * dim)] * 3
    assert views[0] == [[0, WIDTH, 3 * dim, 1], [dim, WIDTH, 3 * dim, 1]]
    assert views[1][1] == [2 * dim, WIDTH, 1, 3 * dim]
    # P @ V stores its heads side by side per token, as the head merge lays
    # them out, so XLA copies nothing between it and the projection.
    assert [int(dict(e.params["attributes"])["batch_inner"]) for e in calls] == [0, 1]
    compiled = jax.jit(swapped).lower(params, x).compile().as_text()
    assert not re.search(r"= \S+ transpose\(", compiled)


def _atrous(x, w):
    """DeepLabV3's atrous 3x3 at dilation 12 on a 14x14 map."""
    return lax.conv_general_dilated(x, w, (1, 1), ((12, 12), (12, 12)), rhs_dilation=(12, 12))


def test_region_convs_read_their_crops_of_x_in_place(getkey):
    """`crop_dead_taps` cuts the atrous conv into regions, each on a slice of x;
    on `smm` each region reads x where it lies (the slice folded into negative
    padding), so no slice is left to copy x."""
    x, w = jax.random.normal(getkey(), (1, 480, 14, 14)), np.asarray(jax.random.normal(getkey(), (256, 480, 3, 3)))
    cropped = jtile.fusion.crop_dead_taps(lambda x: _atrous(x, w * 0.05))
    assert "slice" in {e.primitive.name for e in _iter_eqns(jax.make_jaxpr(cropped)(x).jaxpr)}
    swapped = swap_backend(cropped, algorithms={"conv2d": "smm"})
    calls = [e for e in _iter_eqns(jax.make_jaxpr(swapped)(x).jaxpr) if e.primitive.name == "ffi_call"]
    assert len(calls) > 1 and {e.invars[0].aval.shape for e in calls} == {x.shape}
    assert min(np.asarray(dict(e.params["attributes"])["conv"].val)[2:6].min() for e in calls) < 0
    assert "slice" not in jax.jit(swapped).lower(x).compile().as_text().split("ENTRY")[1]
    np.testing.assert_allclose(jax.jit(swapped)(x), _atrous(x, w * 0.05), rtol=1e-4, atol=1e-4)


def test_a_conv_keeps_a_slice_it_cannot_read_in_place(getkey):
    """A strided slice, or one over channels, stays: negative padding crops H and W only."""
    x, w = jax.random.normal(getkey(), (1, 8, 12, 12)), jax.random.normal(getkey(), (4, 4, 3, 3))
    for sliced in (lambda x: x[:, :4, 1:], lambda x: x[:, 4:, ::2, 1:]):
        def conv(x, w):
            return lax.conv_general_dilated(sliced(x), w, (1, 1), ((1, 1), (1, 1)))

        swapped = swap_backend(conv, algorithms={"conv2d": "smm"})
        names = [e.primitive.name for e in _iter_eqns(jax.make_jaxpr(swapped)(x, w).jaxpr)]
        assert "slice" in names and "ffi_call" in names
        np.testing.assert_allclose(jax.jit(swapped)(x, w), conv(x, w), rtol=1e-4, atol=1e-4)


def _merged_otherwise(p, x):
    """`_attention` with its heads merged token-minor, (dim, tokens): no
    batch-inner store lays that out."""
    tokens, _, dim = x.shape
    q, k, v = jnp.split(x @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(tokens, HEADS, WIDTH).transpose(1, 0, 2)  # noqa: E731
    mixed = jax.nn.softmax(heads(q) @ heads(k).transpose(0, 2, 1), axis=-1) @ heads(v)
    return p["w_out"] @ mixed.transpose(0, 2, 1).reshape(dim, tokens)


def test_a_head_merge_in_another_order_keeps_the_product_in_order(attention, tree_allclose):
    params, x = attention
    swapped = swap_backend(_merged_otherwise, algorithms={"dense": "gemm", "matmul": "gemm"})
    calls = [e for e in _iter_eqns(jax.make_jaxpr(swapped)(params, x).jaxpr)
             if e.primitive.name == "ffi_call" and e.params["target_name"] == "jtile_matmul"]
    assert [int(dict(e.params["attributes"])["batch_inner"]) for e in calls] == [0, 0]
    assert tree_allclose(jax.jit(swapped)(params, x), _merged_otherwise(params, x), rtol=RTOL, atol=ATOL)


def test_attention_known_operand_scales_multiply_inside_the_kernel(attention, tree_allclose):
    """q and k each scaled by d^-1/4 (torch's export of scaled dot-product
    attention): the matmul reads them in place and stores its product times
    d^-1/2: no multiplication's result is used."""
    params, x = attention
    quarter = np.float32(WIDTH ** -0.25)

    def scaled(p, x):
        tokens, _, dim = x.shape
        q, k, v = jnp.split(x @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)

        def heads(t):
            return t.reshape(tokens, HEADS, WIDTH).transpose(1, 0, 2)

        scores = (heads(q) * quarter) @ (heads(k).transpose(0, 2, 1) * quarter)
        return jax.nn.softmax(scores, axis=-1) @ heads(v)

    swapped = swap_backend(scaled, algorithms={"dense": "gemm", "matmul": "gemm"})
    jaxpr = jax.make_jaxpr(swapped)(params, x).jaxpr
    eqns = list(_iter_eqns(jaxpr))
    scales = [float(dict(e.params["attributes"])["scale"]) for e in eqns
              if e.primitive.name == "ffi_call" and e.params["target_name"] == "jtile_matmul"]
    assert scales == [float(quarter * quarter), 1.0]
    read = {id(v) for e in eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    assert not [e for e in eqns if e.primitive.name == "mul" and id(e.outvars[0]) in read]  # XLA drops the rest
    assert tree_allclose(jax.jit(swapped)(params, x), scaled(params, x), rtol=RTOL, atol=ATOL)


def test_attention_gradients_through_the_kernels(attention, tree_allclose):
    params, x = attention
    swapped = swap_backend(_attention, algorithms={"dense": "gemm", "matmul": "gemm"})

    def loss(fn):
        return lambda p, x: jnp.sum(jnp.tanh(fn(p, x)))

    got = jax.grad(loss(swapped), argnums=(0, 1))(params, x)
    assert tree_allclose(got, jax.grad(loss(_attention), argnums=(0, 1))(params, x), rtol=1e-3, atol=1e-4)


def test_auto_takes_the_kernel_for_attention_sized_products_only(attention, getkey):
    params, x = attention
    assert sorted(_targets(swap_backend(_attention, algorithms="auto"), params, x)) == (
        ["jtile_dense"] * 2 + ["jtile_matmul"] * 2)
    long = jax.random.normal(getkey(), (1, 257, HEADS * WIDTH))  # 257 rows: past the GEMM row limit
    assert _targets(swap_backend(_attention, algorithms="auto"), params, long.transpose(1, 0, 2)) == [
        "jtile_matmul"] * 2

    def product(a, c):
        return lax.dot_general(a, c, (((2,), (1,)), ((0,), (0,))))

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    auto = swap_backend(product, algorithms="auto")
    assert _targets(auto, spec(12, 256, 64), spec(12, 64, 256)) == ["jtile_matmul"]  # 2^22 per head
    assert _targets(auto, spec(12, 256, 64), spec(12, 64, 257)) == []  # one column more
    assert _targets(auto, spec(2, 512, 512), spec(2, 512, 512)) == []


def test_explicit_matmul_on_an_unsupported_product_names_the_layer(getkey):
    a = jax.random.randint(getkey(), (3, 4, 5), 0, 9)

    def scores(a):
        with jax.named_scope("scores"):
            return a @ a.transpose(0, 2, 1)

    assert _targets(swap_backend(scores, algorithms="auto"), a) == []
    with pytest.raises(jtile.UnsupportedError, match=r"'gemm' cannot compute matmul #0 'scores'.*float32"):
        swap_backend(scores, algorithms={"matmul": "gemm"})(a)
    with pytest.raises(jtile.UnsupportedError, match=r"matmul #0 'scores'.*preferred_element_type"):
        swap_backend(_preferred_f16, algorithms={"matmul": "gemm"})(a.astype(jnp.float32))


def _preferred_f16(a):
    with jax.named_scope("scores"):
        return lax.dot_general(a, a, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float16)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matmul_swap_matches_dot_general_on_transposed_operands(data):
    """Random batch, contracting and free axes, each operand made by a random
    transpose (seen through when the free axes keep their order)."""
    batch = data.draw(st.lists(st.integers(1, 4), max_size=2))
    k = data.draw(st.integers(1, 30))
    m, n = data.draw(st.integers(1, 11)), data.draw(st.integers(1, 11))
    logical = [(*batch, m, k), (*batch, k, n)]
    perms = [data.draw(st.permutations(range(len(shape)))) for shape in logical]
    nb = len(batch)
    dn = (((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    stored = [rng.standard_normal([shape[i] for i in np.argsort(p)]).astype(np.float32)
              for shape, p in zip(logical, perms)]

    def product(a, c):
        return lax.dot_general(a.transpose(perms[0]), c.transpose(perms[1]), dn)

    swapped = swap_backend(product, algorithms={"dense": "gemm", "matmul": "gemm"})
    # x @ w with a 2-D w contracted last is a dense layer, every other form a matmul
    dense = not batch
    assert _targets(swapped, *stored) == ["jtile_dense" if dense else "jtile_matmul"]
    np.testing.assert_allclose(jax.jit(swapped)(*stored), product(*stored), rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(lead=st.lists(st.integers(1, 7), max_size=3), k=st.integers(1, 70), n=st.integers(1, 40),
       torch_layout=st.booleans(), folded=st.booleans(), seed=st.integers(0, 2**16))
def test_dense_swap_matches_on_activations_of_any_rank(lead, k, n, torch_layout, folded, seed):
    """x (..., K) times a 2-D weight: the leading axes are the GEMM's rows."""
    from jtile.fusion import fold_params

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if torch_layout else (k, n)).astype(np.float32)

    def layer(w, x):
        return x @ (w.T if torch_layout else w)

    swapped = swap_backend(fold_params(layer, w) if folded else layer, algorithms={"dense": "gemm"})
    args = (x,) if folded else (w, x)
    assert _targets(swapped, *args) == ["jtile_dense"]
    np.testing.assert_allclose(jax.jit(swapped)(*args), layer(w, x), rtol=1e-4, atol=1e-4)


# ------------------------------------------------ concatenations written in place


def _fire(p, x, other=None):
    """A fire module: squeeze 1x1 -> relu, then expand 1x1 and expand 3x3 (-> relu),
    concatenated on channels, with `other` (a non-conv part) appended if given."""
    s = jax.nn.relu(_conv(x, p["squeeze"], padding=0) + p["bs"][:, None, None])
    parts = [jax.nn.relu(_conv(s, p["e1"], padding=0) + p["b1"][:, None, None]),
             jax.nn.relu(_conv(s, p["e3"]) + p["b3"][:, None, None])]
    return jnp.concatenate(parts + ([other(x)] if other else []), axis=1)


@pytest.fixture
def fire(getkey):
    def normal(shape, scale=0.3):
        return scale * jax.random.normal(getkey(), shape)

    return {"squeeze": normal((8, 12, 1, 1)), "bs": normal((8,)), "e1": normal((16, 8, 1, 1)),
            "b1": normal((16,)), "e3": normal((24, 8, 3, 3)), "b3": normal((24,))}


def _compiled(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("conv3", ["winograd", "smm"])
def test_concatenated_branches_write_in_place(fire, getkey, tree_allclose, conv3):
    x = jax.random.normal(getkey(), (1, 12, 13, 13))
    ref = lambda x: _fire(fire, x)  # noqa: E731
    f = swap_backend(fuse(ref), algorithms={"conv2d": ["smm", "smm", conv3]})
    assert tree_allclose(jax.jit(f)(x), ref(x), rtol=RTOL, atol=ATOL)
    hlo = _compiled(f, x)
    assert "concatenate(" not in hlo and " copy(" not in hlo
    assert hlo.count("output_to_operand_aliasing") == 1  # the second branch writes into the first's buffer


def test_concatenation_in_place_copies_its_other_parts(fire, getkey, tree_allclose):
    """A part that is not a conv kernel's (here a max pool on XLA) is copied in."""
    x = jax.random.normal(getkey(), (1, 12, 13, 13))
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 1, 1), "SAME")  # noqa: E731
    ref = lambda x: _fire(fire, x, other=pool)  # noqa: E731
    f = swap_backend(fuse(ref), algorithms={"conv2d": "smm"})
    assert tree_allclose(jax.jit(f)(x), ref(x), rtol=RTOL, atol=ATOL)
    hlo = _compiled(f, x)
    assert "concatenate(" not in hlo and "dynamic-update-slice" in hlo


def _fire_branches_read_twice(p, x):
    s = jax.nn.relu(_conv(x, p["squeeze"], padding=0) + p["bs"][:, None, None])
    a, b = _conv(s, p["e1"], padding=0), _conv(s, p["e3"])
    return jnp.concatenate([a, b], axis=1), a, b


def _narrow_conv_after_wide_input(p, x):
    """DenseNet's pattern: the wide part is no conv's, the conv adds few channels."""
    return jnp.concatenate([x, x, x, _conv(x, p["squeeze"], padding=0)], axis=1)


@pytest.mark.parametrize("case", ["batch 2", "branches read twice", "few channels in place", "direct"])
def test_concatenation_stays_with_xla_where_it_cannot_be_written_in_place(fire, getkey, tree_allclose, case):
    x = jax.random.normal(getkey(), (2 if case == "batch 2" else 1, 12, 13, 13))
    model = {"branches read twice": _fire_branches_read_twice,
             "few channels in place": _narrow_conv_after_wide_input}.get(case, _fire)
    ref = lambda x: model(fire, x)  # noqa: E731
    f = swap_backend(fuse(ref), algorithms={"conv2d": "direct" if case == "direct" else "smm"})
    assert tree_allclose(jax.jit(f)(x), ref(x), rtol=RTOL, atol=ATOL)
    assert "concatenate(" in _compiled(f, x)


def test_gradients_through_a_concatenation_written_in_place(fire, getkey, tree_allclose):
    x = jax.random.normal(getkey(), (1, 12, 9, 9))
    loss = lambda p, x: jnp.sum(_fire(p, x) ** 2)  # noqa: E731
    got = jax.grad(swap_backend(loss, algorithms={"conv2d": "smm"}), argnums=(0, 1))(fire, x)
    assert tree_allclose(got, jax.grad(loss, argnums=(0, 1))(fire, x), rtol=1e-3, atol=1e-3)


def test_analysis_counts_each_part_written_in_place_once(fire, getkey):
    x = jax.random.normal(getkey(), (1, 12, 13, 13))
    ref = lambda x: _fire(fire, x)  # noqa: E731
    swapped = swap_backend(fuse(ref), algorithms={"conv2d": "smm"})
    got, want = jtile.summary(swapped, x), jtile.summary(fuse(ref), x)
    assert got.macs_by_category["conv"] == want.macs_by_category["conv"] > 0
    layers = jtile.graph(swapped, x).described().values()
    assert [layer.out_channels for layer in layers if layer.kind == "conv2d"] == [8, 16, 24]


# ------------------------------------------------ max pools computed inside the conv


def _swapped_and_checked(ref, x, algorithms, tree_allclose):
    """`swap_backend(fuse(ref), algorithms=algorithms)`, its output on `x` checked against `ref`'s."""
    f = swap_backend(fuse(ref), algorithms=algorithms)
    assert tree_allclose(jax.jit(f)(x), ref(x), rtol=RTOL, atol=ATOL)
    return f


def _stem(p, x, also_conv=False):
    """An image stem, conv 7x7 stride 2 -> relu -> max pool 3x3 stride 2, then a 1x1
    conv; `also_conv` returns the stem conv's output too."""
    y = jax.nn.relu(_conv(x, p["stem"], stride=2, padding=3) + p["bs"][:, None, None])
    pooled = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = _conv(pooled, p["pw"], padding=0)
    return (out, y) if also_conv else out


@pytest.fixture
def stem(getkey):
    return {"stem": 0.2 * jax.random.normal(getkey(), (32, 3, 7, 7)), "bs": jax.random.normal(getkey(), (32,)),
            "pw": 0.2 * jax.random.normal(getkey(), (16, 32, 1, 1))}


@pytest.mark.parametrize("algorithms", ["auto", {"conv2d": "grouped", "maxpool2d": "direct"}])
def test_stem_max_pool_runs_inside_the_conv(stem, getkey, tree_allclose, algorithms):
    x = jax.random.normal(getkey(), (2, 3, 37, 37))
    ref = lambda x: _stem(stem, x)  # noqa: E731
    f = _swapped_and_checked(ref, x, algorithms, tree_allclose)
    targets = _targets(f, x)
    assert "jtile_max_pool2d" not in targets and targets[0] == "jtile_conv_grouped"
    assert "reduce-window" not in _compiled(f, x)


@pytest.mark.parametrize("case, algorithms", [
    ("conv read twice", {"conv2d": "grouped", "maxpool2d": "direct"}),
    ("pool on XLA", {"conv2d": "grouped", "maxpool2d": "default"}),
    ("conv on smm", {"conv2d": "smm", "maxpool2d": "direct"}),
])
def test_stem_max_pool_stays_a_call_of_its_own_where_it_cannot_fuse(stem, getkey, tree_allclose, case, algorithms):
    x = jax.random.normal(getkey(), (1, 3, 30, 30))
    ref = lambda x: _stem(stem, x, also_conv=case == "conv read twice")  # noqa: E731
    f = _swapped_and_checked(ref, x, algorithms, tree_allclose)
    if case == "pool on XLA":
        assert "reduce-window" in _compiled(f, x)
    else:
        assert "jtile_max_pool2d" in _targets(f, x)


def test_analysis_counts_the_conv_and_the_pool_of_a_fused_stem(stem, getkey):
    x = jax.random.normal(getkey(), (1, 3, 37, 37))
    ref = lambda x: _stem(stem, x)  # noqa: E731
    swapped = swap_backend(fuse(ref), algorithms={"conv2d": "grouped", "maxpool2d": "direct"})
    got, want = jtile.summary(swapped, x).macs_by_category, jtile.summary(fuse(ref), x).macs_by_category
    for category in ("conv", "pool", "activation"):  # a bias-less conv's kernel adds zeros: elementwise differs
        assert got[category] == want[category] > 0


# ------------------------------------------------ a batch norm and ReLU applied by the 1x1 conv


def _dense_layer(p, x, share=False, per_pixel=False):
    """DenseNet's layer: batch norm (sub, mul, add) -> relu -> 1x1 conv -> relu ->
    3x3 conv, concatenated to x; `share` also returns the normalised input,
    `per_pixel` normalises with a (1, 1, H, W) scale."""
    scale = jnp.ones((1, 1, *x.shape[2:])) * 0.7 if per_pixel else p["scale"]
    normed = jax.nn.relu((x - p["mean"]) * scale + p["beta"])
    y = jax.nn.relu(_conv(normed, p["w1"], padding=0) + p["b1"][:, None, None])
    out = jnp.concatenate([x, _conv(y, p["w3"])], axis=1)
    return (out, normed) if share else out


@pytest.fixture
def dense_layer(getkey):
    def normal(shape, scale=0.3):
        return scale * jax.random.normal(getkey(), shape)

    return {"mean": normal((1, 24, 1, 1)), "scale": 1 + normal((1, 24, 1, 1)), "beta": normal((1, 24, 1, 1)),
            "w1": normal((32, 24, 1, 1)), "b1": normal((32,)), "w3": normal((8, 32, 3, 3))}


def _primitives(fn, *args) -> list[str]:
    return [e.primitive.name for e in _iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


@pytest.mark.parametrize("algorithms", ["auto", {"conv2d": "smm"}])
def test_batch_norm_and_relu_run_inside_the_pointwise_conv(dense_layer, getkey, tree_allclose, algorithms):
    x = jax.random.normal(getkey(), (1, 24, 13, 13))
    ref = lambda x: _dense_layer(dense_layer, x)  # noqa: E731
    f = _swapped_and_checked(ref, x, algorithms, tree_allclose)
    primitives = _primitives(f, x)
    assert not {"sub", "mul", "add", "max"} & set(primitives), primitives


@pytest.mark.parametrize("case", ["normalised input read twice", "per-pixel scale", "conv on XLA"])
def test_batch_norm_stays_with_xla_where_the_conv_cannot_take_it(dense_layer, getkey, tree_allclose, case):
    x = jax.random.normal(getkey(), (1, 24, 11, 11))
    ref = lambda x: _dense_layer(dense_layer, x, share=case == "normalised input read twice",  # noqa: E731
                                 per_pixel=case == "per-pixel scale")
    f = _swapped_and_checked(ref, x, {"conv2d": ["default", "smm"] if case == "conv on XLA" else "smm"}, tree_allclose)
    # a per-pixel scale ends the chain: the add and ReLU after it still go into the conv
    assert ("mul" if case == "per-pixel scale" else "max") in _primitives(f, x)


def test_analysis_counts_the_convs_of_a_layer_with_a_prologue(dense_layer, getkey):
    x = jax.random.normal(getkey(), (1, 24, 13, 13))
    ref = lambda x: _dense_layer(dense_layer, x)  # noqa: E731
    swapped = swap_backend(fuse(ref), algorithms={"conv2d": "smm"})
    got, want = jtile.summary(swapped, x).macs_by_category, jtile.summary(fuse(ref), x).macs_by_category
    assert got["conv"] == want["conv"] > 0
    assert got["activation"] == want["activation"]  # the prologue's ReLU, the conv's ReLU
    assert got["elementwise"] >= want["elementwise"]  # the batch norm's sub, mul, add (and bias adds)


@pytest.mark.parametrize("batch, channels, size", [(1, 24, 10), (2, 24, 10), (1, 1152, 7)])
def test_squeeze_excitation_scale_runs_inside_the_next_pointwise_conv(getkey, tree_allclose, batch, channels, size):
    """x * sigmoid(mean(x)) -> 1x1 conv: one image's scales are one per channel,
    so the conv applies them, in channel rows and in pixel rows (EfficientNet's
    1152 -> 192 at 7x7), the missing shift and bias passed as none; with two
    images the scales differ per image and stay."""
    x = jax.random.normal(getkey(), (batch, channels, size, size))
    w = jax.random.normal(getkey(), (192 if channels > 1000 else 16, channels, 1, 1)) / channels ** 0.5

    def block(x):
        scale = jax.nn.sigmoid(jnp.mean(x, axis=(2, 3), keepdims=True))
        return _conv(x * scale, w, padding=0)

    f = _swapped_and_checked(block, x, {"conv2d": "smm"}, tree_allclose)
    assert ("mul" in _primitives(f, x)) == (batch == 2)
    (conv,) = [e for e in _iter_eqns(jax.make_jaxpr(f)(x).jaxpr)
               if e.primitive.name == "ffi_call" and e.params["target_name"] == "jtile_conv_smm"]
    prologue = [v.aval.shape for v in conv.invars[5:8]]
    assert prologue == ([(0,)] * 3 if batch == 2 else [(0,), (channels,), (0,)])


# ------------------------------------------------ concatenations that grow in one buffer


def _dense_block(p, x, read_first=False):
    """DenseNet's block: each layer (batch norm -> relu -> 1x1 conv -> relu -> 3x3
    conv) reads the concatenation of the block's input and every earlier layer's
    output; `read_first` also returns the first concatenation."""
    features, first = [x], None
    for layer in p:
        joined = jnp.concatenate(features, axis=1) if len(features) > 1 else x
        first = joined if first is None and len(features) > 1 else first
        normed = jax.nn.relu((joined - layer["mean"]) * layer["scale"] + layer["beta"])
        y = jax.nn.relu(_conv(normed, layer["w1"], padding=0) + layer["b1"][:, None, None])
        features.append(_conv(y, layer["w3"]))
    out = jnp.concatenate(features, axis=1)
    return (out, first) if read_first else out


@pytest.fixture
def dense_block(getkey):
    def normal(shape, scale=0.3):
        return scale * jax.random.normal(getkey(), shape)

    return [{"mean": normal((1, c, 1, 1)), "scale": 1 + normal((1, c, 1, 1)), "beta": normal((1, c, 1, 1)),
             "w1": normal((16, c, 1, 1)), "b1": normal((16,)), "w3": normal((8, 16, 3, 3))}
            for c in (24, 32, 40, 48)]


def _prefix_reads(fn, *args) -> int:
    """Kernel calls that read fewer channels than their x holds."""
    return sum(1 for e in _iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "ffi_call"
               and "x_channels" in dict(e.params["attributes"] or ())
               and int(np.asarray(dict(e.params["attributes"])["x_channels"])) < e.invars[0].aval.shape[1])


@pytest.mark.parametrize("algorithms", ["auto", {"conv2d": "smm"}])
def test_growing_concatenations_share_one_buffer(dense_block, getkey, tree_allclose, algorithms):
    """Every layer's output is written once into the block's buffer, and layers
    2-4 read their concatenation as the buffer's first channels: no copy left."""
    x = jax.random.normal(getkey(), (1, 24, 11, 11))
    ref = lambda x: _dense_block(dense_block, x)  # noqa: E731
    f = _swapped_and_checked(ref, x, algorithms, tree_allclose)
    hlo = _compiled(f, x)
    assert "concatenate(" not in hlo and " copy(" not in hlo
    assert _prefix_reads(f, x) == 3
    swapped = _swapped_and_checked(ref, x, {"conv2d": "smm"}, tree_allclose)
    assert jtile.summary(swapped, x).macs_by_category["conv"] == jtile.summary(fuse(ref), x).macs_by_category["conv"]


def test_a_growing_concatenation_read_elsewhere_is_copied_out(dense_block, getkey, tree_allclose):
    """The first concatenation is also returned: it is copied out of the buffer,
    and its own layer reads the copy; the later layers still read prefixes."""
    x = jax.random.normal(getkey(), (1, 24, 9, 9))
    ref = lambda x: _dense_block(dense_block, x, read_first=True)  # noqa: E731
    f = _swapped_and_checked(ref, x, {"conv2d": "smm"}, tree_allclose)
    assert "concatenate(" not in _compiled(f, x)
    assert _prefix_reads(f, x) == 2


def test_growing_concatenations_of_parts_on_xla_are_copied_in_once(dense_block, getkey, tree_allclose):
    """The 3x3 convs stay on XLA: no part is written in place, each is copied
    into the buffer once, and the 1x1 convs still read prefixes."""
    x = jax.random.normal(getkey(), (1, 24, 9, 9))
    ref = lambda x: _dense_block(dense_block, x)  # noqa: E731
    f = _swapped_and_checked(ref, x, {"conv2d": ["smm", "default"] * 4}, tree_allclose)
    hlo = _compiled(f, x)
    assert "concatenate(" not in hlo and hlo.count("dynamic-update-slice(") >= 1
    assert _prefix_reads(f, x) == 3


def test_gradients_through_growing_concatenations(dense_block, getkey, tree_allclose):
    x = jax.random.normal(getkey(), (1, 24, 7, 7))
    loss = lambda p, x: jnp.sum(_dense_block(p, x) ** 2)  # noqa: E731
    got = jax.grad(swap_backend(loss, algorithms={"conv2d": "smm"}), argnums=(0, 1))(dense_block, x)
    assert tree_allclose(got, jax.grad(loss, argnums=(0, 1))(dense_block, x), rtol=1e-3, atol=1e-3)


# ------------------------------------------------ an average pool run before the linear 1x1 conv


def _transition(p, x, relu_after=False, padding=0, share=False):
    """DenseNet's transition: batch norm -> relu -> 1x1 conv (+ bias) -> 2x2 average pool."""
    y = _conv(jax.nn.relu((x - p["mean"]) * p["scale"] + p["beta"]), p["w1"], padding=0) + p["b1"][:, None, None]
    y = jax.nn.relu(y) if relu_after else y
    pads = ((0, 0), (0, 0), (padding, padding), (padding, padding))
    pooled = lax.reduce_window(y, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), pads) / 4
    return (pooled, y) if share else pooled


def _conv_inputs(fn, *args) -> list[tuple[int, ...]]:
    return [e.invars[0].aval.shape for e in _iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "ffi_call" and e.params["target_name"].startswith("jtile_conv")]


@pytest.mark.parametrize("algorithms", ["auto", {"conv2d": "smm", "avgpool2d": "default"}])
def test_average_pool_runs_before_the_linear_pointwise_conv(dense_layer, getkey, tree_allclose, algorithms):
    x = jax.random.normal(getkey(), (1, 24, 14, 12))
    ref = lambda x: _transition(dense_layer, x)  # noqa: E731
    f = _swapped_and_checked(ref, x, algorithms, tree_allclose)
    assert _conv_inputs(f, x) == [(1, 24, 7, 6)]  # the conv reads the pooled image
    got, want = jtile.summary(f, x).macs_by_category, jtile.summary(fuse(ref), x).macs_by_category
    assert 4 * got["conv"] == want["conv"]
    # The pool's kernel applies the batch norm and ReLU as it reads x (XLA's pool: they stay before it).
    assert ("sub" in _primitives(f, x)) == (algorithms != "auto")
    assert got["norm"] == want["norm"] and got["activation"] == want["activation"]


@pytest.mark.parametrize("case", ["relu after the conv", "padded pool", "conv output read twice", "conv on XLA"])
def test_average_pool_stays_after_a_conv_it_does_not_commute_with(dense_layer, getkey, tree_allclose, case):
    x = jax.random.normal(getkey(), (1, 24, 10, 10))
    ref = lambda x: _transition(dense_layer, x, relu_after=case == "relu after the conv",  # noqa: E731
                                padding=1 if case == "padded pool" else 0, share=case == "conv output read twice")
    f = _swapped_and_checked(ref, x, {"conv2d": "default" if case == "conv on XLA" else "smm"}, tree_allclose)
    assert all(shape == (1, 24, 10, 10) for shape in _conv_inputs(f, x))


# ------------------------------------------------ gradients through the rewrites


@pytest.mark.parametrize("case", ["max pool in the stem's conv", "batch norm in the 1x1 conv",
                                  "average pool before the 1x1 conv", "batch norm in the average pool"])
def test_gradients_through_the_rewritten_layers(case, request, getkey, tree_allclose):
    model, fixture, algorithms, shape, rewritten = {
        "max pool in the stem's conv": (_stem, "stem", {"conv2d": "grouped", "maxpool2d": "direct"}, (1, 3, 21, 21),
                                        lambda f, *a: "jtile_max_pool2d" not in _targets(f, *a)),
        "batch norm in the 1x1 conv": (_dense_layer, "dense_layer", {"conv2d": "smm"}, (1, 24, 9, 9),
                                       lambda f, *a: "sub" not in _primitives(f, *a)),
        "average pool before the 1x1 conv": (_transition, "dense_layer", {"conv2d": "smm"}, (1, 24, 8, 8),
                                             lambda f, *a: _conv_inputs(f, *a) == [(1, 24, 4, 4)]),
        "batch norm in the average pool": (_transition, "dense_layer", {"conv2d": "smm", "avgpool2d": "auto"},
                                           (1, 24, 8, 8), lambda f, *a: "sub" not in _primitives(f, *a)),
    }[case]
    params, x = request.getfixturevalue(fixture), jax.random.normal(getkey(), shape)
    loss = lambda p, x: jnp.sum(model(p, x) ** 2)  # noqa: E731
    swapped = swap_backend(fuse(loss), algorithms=algorithms)
    assert rewritten(swapped, params, x)
    got = jax.grad(swapped, argnums=(0, 1))(params, x)
    assert tree_allclose(got, jax.grad(loss, argnums=(0, 1))(params, x), rtol=1e-3, atol=1e-3)


# ------------------------------------------------ activations kept channel-blocked (NCHWc)


def _inverted_residual(p, x, stride=1, returns_expansion=False):
    """MobileNetV2's block: 1x1 expansion -> relu6 -> 3x3 depthwise -> relu6 ->
    1x1 projection, plus x at stride 1 where the channels match."""
    expanded = jnp.clip(_conv(x, p["we"], padding=0) + p["be"][:, None, None], 0, 6)
    dw = jnp.clip(_conv(expanded, p["wd"], stride=stride, groups=p["wd"].shape[0]) + p["bd"][:, None, None], 0, 6)
    y = _conv(dw, p["wp"], padding=0) + p["bp"][:, None, None]
    y = y + x if stride == 1 and y.shape == x.shape else y
    return (y, expanded) if returns_expansion else y


def _residual_params(getkey, c, e, o):
    def normal(shape, scale=0.3):
        return scale * jax.random.normal(getkey(), shape)

    return {"we": normal((e, c, 1, 1)), "be": normal((e,)), "wd": normal((e, 1, 3, 3)), "bd": normal((e,)),
            "wp": normal((o, e, 1, 1)), "bp": normal((o,))}


def _blocked_values(fn, *args) -> int:
    """Kernel calls returning a channel-blocked (5-D) value."""
    return sum(1 for e in _iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
               if e.primitive.name == "ffi_call" and e.outvars[0].aval.ndim == 5)


@pytest.mark.parametrize("expanded", [6, 4.5])  # vectors of channels: 4.5 leaves the last block half full
def test_inverted_residuals_pass_channel_blocked_activations(getkey, tree_allclose, monkeypatch, expanded):
    """Two blocks at 14x14 (stride 1, then stride 2): each expansion's and each
    depthwise conv's output stays NCHWc, and the result has the bits of the
    same kernels passing NCHW activations."""
    e = int(expanded * jtile.kernels.vector_lanes())
    first, second = _residual_params(getkey, 24, e, 24), _residual_params(getkey, 24, e, 32)
    x = jax.random.normal(getkey(), (1, 24, 14, 14))
    ref = lambda x: _inverted_residual(second, _inverted_residual(first, x), stride=2)  # noqa: E731
    f = _swapped_and_checked(ref, x, "auto", tree_allclose)
    assert _blocked_values(f, x) == 4
    monkeypatch.setattr(jtile.algorithms, "find_blocked", lambda *args: jtile._nchwc.Blocked(frozenset(), frozenset()))
    nchw = swap_backend(fuse(ref), algorithms="auto")
    assert _blocked_values(nchw, x) == 0
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(jax.jit(nchw)(x)))


@pytest.mark.parametrize("case", ["wide stride 1", "expansion returned", "two images", "depthwise on XLA"])
def test_activations_stay_nchw_where_blocking_cannot_run_or_does_not_pay(getkey, tree_allclose, case):
    p = _residual_params(getkey, 16, 4 * jtile.kernels.vector_lanes(), 16)
    size = 56 if case == "wide stride 1" else 14  # at 56x56 the depthwise conv runs faster on NCHW planes
    x = jax.random.normal(getkey(), (2 if case == "two images" else 1, 16, size, size))
    ref = lambda x: _inverted_residual(p, x, returns_expansion=case == "expansion returned")  # noqa: E731
    algorithms = {"conv2d": ["smm", "default", "smm"]} if case == "depthwise on XLA" else "auto"
    f = _swapped_and_checked(ref, x, algorithms, tree_allclose)
    # the returned expansion stays NCHW; the depthwise conv's output, read by the projection alone, is blocked
    assert _blocked_values(f, x) == (1 if case == "expansion returned" else 0)


def test_analysis_reads_blocked_calls_as_their_nchw_layers(getkey):
    p = _residual_params(getkey, 24, 6 * jtile.kernels.vector_lanes(), 24)
    x = jax.random.normal(getkey(), (1, 24, 14, 14))
    swapped = swap_backend(fuse(lambda x: _inverted_residual(p, x)), algorithms="auto")
    assert _blocked_values(swapped, x) == 2
    got, want = jtile.summary(swapped, x), jtile.summary(fuse(lambda x: _inverted_residual(p, x)), x)
    assert got.macs_by_category["conv"] == want.macs_by_category["conv"] > 0
    assert [layer.out_shape for layer in got.layers if layer.kind == "conv2d"] == \
        [layer.out_shape for layer in want.layers if layer.kind == "conv2d"]


def test_gradients_flow_through_blocked_activations(getkey):
    p = _residual_params(getkey, 24, 6 * jtile.kernels.vector_lanes(), 24)
    x = jax.random.normal(getkey(), (1, 24, 14, 14))
    swapped = swap_backend(fuse(lambda x: _inverted_residual(p, x)), algorithms="auto")
    assert _blocked_values(swapped, x) == 2
    got = jax.grad(lambda x: jnp.sum(swapped(x) ** 2))(x)
    want = jax.grad(lambda x: jnp.sum(_inverted_residual(p, x) ** 2))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-3)


# ------------------------------------------------ expansions computed by their depthwise conv


@pytest.mark.parametrize("stride, blocked_out", [(1, 0), (2, 1)])
def test_depthwise_convs_compute_the_expansion_that_feeds_them(getkey, tree_allclose, stride, blocked_out):
    """An inverted residual at 28x28: the 1x1 expansion's call is gone, the
    depthwise conv's call computes it from the block's input (MACs as the
    layers'); at stride 2 its 14x14 output, read by the projection alone, goes
    channel-blocked."""
    p = _residual_params(getkey, 24, 6 * jtile.kernels.vector_lanes(), 32)
    x = jax.random.normal(getkey(), (1, 24, 28, 28))
    ref = lambda x: _inverted_residual(p, x, stride=stride)  # noqa: E731
    f = _swapped_and_checked(ref, x, "auto", tree_allclose)
    assert _targets(f, x) == ["jtile_conv_expanded_depthwise", "jtile_conv_smm"]
    assert _blocked_values(f, x) == blocked_out
    got, want = jtile.summary(f, x), jtile.summary(fuse(ref), x)
    assert got.macs_by_category["conv"] == want.macs_by_category["conv"] > 0
    grad = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(lambda x: jnp.sum(ref(x) ** 2))(x)),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", ["expansion returned", "14x14", "expansion on XLA", "expansion padded",
                                  "two per input channel"])
def test_expansions_stay_separate_calls_where_fusing_cannot_run_or_does_not_pay(getkey, tree_allclose, case):
    e = 4 * jtile.kernels.vector_lanes()
    p = _residual_params(getkey, 16, e, 16)
    x = jax.random.normal(getkey(), (1, 16, 14 if case == "14x14" else 28, 28 if case != "14x14" else 14))

    def ref(x):
        if case == "expansion padded":  # a 1x1 conv with padding is no expansion of the depthwise conv's input
            t = jnp.clip(_conv(x, p["we"], padding=1) + p["be"][:, None, None], 0, 6)
            return _conv(t, p["wd"], groups=e) + p["bd"][:, None, None]
        if case == "two per input channel":  # groups = e / 2: two output channels per input channel
            t = jnp.clip(_conv(x, p["we"][: e // 2], padding=0) + p["be"][: e // 2, None, None], 0, 6)
            return _conv(t, p["wd"], groups=e // 2) + p["bd"][:, None, None]
        return _inverted_residual(p, x, returns_expansion=case == "expansion returned")

    algorithms = {"conv2d": ["default", "depthwise", "smm"]} if case == "expansion on XLA" else "auto"
    f = _swapped_and_checked(ref, x, algorithms, tree_allclose)
    assert "jtile_conv_expanded_depthwise" not in _targets(f, x)
    assert "jtile_conv_depthwise" in _targets(f, x)


# ------------------------------------------------ global average pools


@pytest.mark.parametrize("keepdims", [True, False])
def test_global_average_pools_run_on_the_pool_kernel(getkey, tree_allclose, keepdims):
    """`jnp.mean` over H and W (ONNX's GlobalAveragePool as imported: a sum,
    broadcast back to (N, C, 1, 1), divided by H * W) is an `avgpool2d`
    layer: `auto` runs it on the global pool kernel, its sum and division gone."""
    x = jax.random.normal(getkey(), (2, 24, 9, 11))
    w = jax.random.normal(getkey(), (16, 24, 1, 1)) * 0.2

    def squeeze(x):
        pooled = jnp.mean(x, axis=(2, 3), keepdims=keepdims)
        return _conv(jax.nn.sigmoid(pooled if keepdims else pooled[:, :, None, None]), w, padding=0)

    f = _swapped_and_checked(squeeze, x, "auto", tree_allclose)
    jaxpr = jax.make_jaxpr(f)(x).jaxpr
    targets = [e.params["target_name"] for e in _iter_eqns(jaxpr) if e.primitive.name == "ffi_call"]
    assert "jtile_global_avg_pool2d" in targets
    assert not {"reduce_sum", "div"} & set(_primitives(f, x))
    (pool,) = [layer for layer in jtile.graph(f, x).described().values() if layer.kind == "avgpool2d"]
    assert pool.kernel_size == (9, 11) and pool.in_shapes[0] == x.shape


@pytest.mark.parametrize("case", ["sum only", "divided by the wrong count", "over H alone", "sum read twice"])
def test_sums_that_are_not_global_average_pools_stay_on_xla(getkey, tree_allclose, case):
    x = jax.random.normal(getkey(), (1, 8, 5, 6))

    def reduce(x):
        if case == "over H alone":
            return jnp.mean(x, axis=2)
        total = jnp.sum(x, axis=(2, 3))
        if case == "sum only":
            return total
        if case == "sum read twice":
            return total / 30.0 + total
        return total / 31.0

    f = _swapped_and_checked(reduce, x, {"avgpool2d": "auto"}, tree_allclose)
    assert "reduce_sum" in _primitives(f, x)
