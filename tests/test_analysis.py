import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from jax import lax
from onnx import TensorProto, helper, numpy_helper

import jtile
import jtile.kernels as kernels
import jtile.models as models
from jtile.algorithms import swap_backend
from jtile.fusion import fold_params, fuse
from jtile._interpreter import bind, transform
from jtile.analysis import intercept, summary

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def _shape(name, batch=None):
    return jax.ShapeDtypeStruct(models.input_shape(name, batch=batch), jnp.float32)


def _zoo(name):
    return jax.eval_shape(lambda: models.get(name))


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


# ------------------------------------------------------------------ MAC rules


def test_conv_macs_match_hand_count_for_grouped_strided_dilated_conv():
    def conv(w, x):
        return lax.conv_general_dilated(
            x, w, (2, 3), [(1, 0), (2, 1)], rhs_dilation=(2, 1), feature_group_count=2
        )

    s = summary(conv, _sds(4, 3, 3, 2), _sds(2, 6, 17, 15))
    # Ho = (17 + 1 + 0 - (2*(3-1) + 1)) // 2 + 1 = 7;  Wo = (15 + 2 + 1 - 2) // 3 + 1 = 6
    # MACs = N * Cout * Ho * Wo * (Cin / groups) * kh * kw = 2 * 4 * 7 * 6 * 3 * 3 * 2
    assert s.layers[0].output_shapes == ((2, 4, 7, 6),)
    assert s.macs_by_category["conv"] == 6048
    assert s.total_params == 4 * 3 * 3 * 2


def test_dot_general_macs_are_batch_m_n_k():
    s = summary(lambda w, x: jnp.einsum("bmk,bkn->bmn", x, w), _sds(3, 5, 6), _sds(3, 4, 5))
    assert s.macs_by_category["dense"] == 3 * 4 * 6 * 5


def test_pool_macs_are_output_elements_times_window():
    def pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "VALID")

    s = summary(pool, _sds(1, 2, 9, 9))
    assert s.macs_by_category["pool"] == 1 * 2 * 4 * 4 * 9


def test_scan_macs_scale_with_trip_count():
    def loop(w, x):
        return lax.fori_loop(0, 5, lambda i, h: h @ w, x)

    s = summary(loop, _sds(8, 8), _sds(2, 8))
    assert s.macs_by_category["dense"] == 5 * 2 * 8 * 8


def test_relu_is_an_activation_and_residual_add_elementwise():
    def block(x):
        return jax.nn.relu(x) + x

    s = summary(block, _sds(2, 10))
    assert s.macs_by_category["activation"] == 20
    assert s.macs_by_category["elementwise"] == 20


def test_primitive_without_rule_is_listed_not_guessed():
    def host(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2

    s = summary(host, _sds(4))
    assert s.uncounted == ("pure_callback",)
    assert s.macs == 4


def test_fused_and_kernel_ops_count_as_the_ops_they_replace():
    model, x = models.get("tutorial"), _shape("tutorial")
    plain = summary(model, x)
    for transformed in (fuse(model), swap_backend(model, algorithms={"conv2d": "direct"})):
        s = summary(transformed, x)
        assert s.macs_by_category["conv"] == plain.macs_by_category["conv"] == 4 * 32 * 64 * 64 * 27
        assert s.uncounted == ()

    def pool_dense(x, w):
        return kernels.max_pool2d(x, (3, 3), (2, 2)), kernels.dense(x.reshape(4, -1), w)

    s = summary(pool_dense, _sds(1, 4, 9, 9), _sds(81, 5))
    assert s.macs_by_category["pool"] == 4 * 4 * 4 * 9
    assert s.macs_by_category["dense"] == 4 * 5 * 81


@pytest.mark.parametrize("model_name", ["tutorial", "resnet18"])
def test_kernels_on_packed_weights_count_as_the_layers_they_run(model_name):
    """After `fold_params` the smm conv and dense kernels take packed weights;
    MACs still come from the layer's own geometry."""
    fn, params = models.as_function(models.get(model_name, jax.random.key(0)))
    x = _shape(model_name)
    plain = summary(fn, params, x)
    swapped = summary(swap_backend(fold_params(fn, params), algorithms="auto"), x)
    for category in ("conv", "dense"):
        assert swapped.macs_by_category[category] == plain.macs_by_category[category]
    assert swapped.uncounted == ()


def test_dense_kernel_counts_rows_times_k_in_every_weight_layout(getkey):
    x = jax.random.normal(getkey(), (24, 81))
    for w, transpose_w in ((jax.random.normal(getkey(), (81, 5)), False), (jax.random.normal(getkey(), (5, 81)), True)):
        s = summary(lambda x: kernels.dense(x, w, transpose_w=transpose_w), x)  # w known: packed
        assert s.macs_by_category["dense"] == 24 * 5 * 81


# ------------------------------------------------- published model numbers


def test_googlenet_matches_torchvision_params_and_ptflops_macs():
    s = summary(_zoo("googlenet"), _shape("googlenet"))
    assert s.trainable_params == 6_624_904  # torchvision googlenet (aux_logits=False)
    assert s.non_trainable_params == 2 * 7_280  # batch-norm running mean and var
    assert 1.45e9 < s.macs < 1.56e9  # ptflops: 1.5 GMac


def test_mobilenet_v2_matches_published_params_and_macs():
    s = summary(_zoo("mobilenet_v2"), _shape("mobilenet_v2"))
    assert s.trainable_params == 3_504_872  # torchvision mobilenet_v2
    dense = s.macs_by_category["conv"] + s.macs_by_category["dense"]
    assert 0.29e9 < dense < 0.31e9  # Sandler et al. 2018: 300 M multiply-adds
    assert 0.3e9 < s.macs < 0.34e9  # ptflops: 0.32 GMac (with batch norm and ReLU6)


def test_light_resnet50_onnx_macs():
    model = jtile.onnx.load(os.path.join(LIGHT, "light_resnet50.onnx"))
    s = summary(model, _sds(*model.input_shapes[0]))
    assert 4.05e9 < s.macs < 4.2e9  # ptflops resnet50: 4.12 GMac
    assert s.macs_by_category["conv"] > 0.98 * s.macs


def test_onnx_batchnorm_statistics_are_non_trainable():
    inits = {
        "w": np.ones((4, 3, 3, 3), np.float32), "scale": np.ones(4, np.float32),
        "bias": np.zeros(4, np.float32), "mean": np.zeros(4, np.float32),
        "var": np.ones(4, np.float32),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"],
                             ["y"], name="bn"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = jtile.onnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    for s in (summary(model, _sds(1, 3, 8, 8)), summary(model.fn, model.params, _sds(1, 3, 8, 8))):
        assert s.total_params == 108 + 16
        assert s.non_trainable_params == 8
        assert [(layer.name, layer.params) for layer in s.layers] == [("conv", 108), ("bn", 16)]
        assert s.macs_by_category["conv"] == 4 * 8 * 8 * 27


# ------------------------------------------------------- layers and totals


def _block(p, x):
    with jax.named_scope("stem"):
        with jax.named_scope("conv"):
            y = lax.conv_general_dilated(x, p["w"], (1, 1), [(1, 1), (1, 1)])
        with jax.named_scope("bn"):
            y = (y - lax.stop_gradient(p["mean"])[:, None, None]) * p["gamma"][:, None, None]
        y = jax.nn.relu(y)
    y = jnp.mean(y, axis=(2, 3))
    with jax.named_scope("fc"):
        return y @ p["fc"]


def _block_params(getkey):
    return {
        "w": jax.random.normal(getkey(), (4, 3, 3, 3)),
        "mean": jax.random.normal(getkey(), (4,)),
        "gamma": jax.random.normal(getkey(), (4,)),
        "fc": jax.random.normal(getkey(), (4, 5)),
    }


def test_layers_follow_named_scopes_and_own_their_parameters(getkey):
    s = summary(_block, _block_params(getkey), _sds(2, 3, 6, 6))
    names = [layer.name for layer in s.layers]
    assert names == ["stem/conv", "stem/bn", "stem", "reduce_sum_0", "div_0", "fc"]
    params = {layer.name: layer.params for layer in s.layers}
    assert params == {"stem/conv": 108, "stem/bn": 8, "stem": 0, "reduce_sum_0": 0,
                      "div_0": 0, "fc": 20}
    assert (s.total_params, s.trainable_params) == (136, 132)  # mean read via stop_gradient
    assert {p.path: p.layer for p in s.parameters}["args[0]['fc']"] == "fc"


def test_bandwidth_and_activation_memory_hand_count(getkey):
    s = summary(_block, _block_params(getkey), _sds(2, 3, 6, 6))
    conv = s.layers[0]
    assert conv.input_bytes == 4 * (2 * 3 * 6 * 6 + 4 * 3 * 3 * 3)
    assert conv.output_bytes == 4 * 2 * 4 * 6 * 6
    outputs = [2 * 4 * 36] * 3 + [2 * 4, 2 * 4, 2 * 5]
    assert s.activation_bytes == 4 * sum(outputs)
    assert s.peak_bandwidth_layer == "stem/conv"
    assert s.peak_bandwidth_bytes == conv.input_bytes + conv.output_bytes
    assert s.bandwidth_bytes == sum(r.input_bytes + r.output_bytes for r in s.layers)


def test_nested_jit_is_looked_into(getkey):
    params = _block_params(getkey)
    flat = summary(_block, params, _sds(2, 3, 6, 6))
    nested = summary(jax.jit(lambda p, x: jax.jit(_block)(p, x)), params, _sds(2, 3, 6, 6))
    assert nested.to_dict() == flat.to_dict()


def test_depth_cuts_names_but_not_totals():
    model, x = _zoo("resnet18"), _shape("resnet18")
    full, shallow = summary(model, x), summary(model, x, depth=1)
    assert [layer.name for layer in shallow.layers][:5] == ["conv1", "bn1", "relu", "maxpool", "layer1"]
    assert summary(model, x, depth=2).layers[4].name == "layer1.0"
    assert sum(layer.params for layer in shallow.layers) == full.total_params
    assert sum(layer.macs for layer in shallow.layers) == full.macs
    assert shallow.macs_by_category == full.macs_by_category
    assert shallow.non_trainable_params == 9_600


def test_bad_depth_raises():
    with pytest.raises(jtile.ConfigError, match="depth"):
        summary(jnp.sin, _sds(3), depth=0)


def test_transformed_model_reports_its_own_macs_and_ratio():
    model, x = models.get("tutorial"), _shape("tutorial")

    def twice(eqn, lhs, rhs):  # a transform that recomputes every conv
        return bind(eqn, lhs, rhs)[0] * 0.5 + bind(eqn, lhs, rhs)[0] * 0.5

    plain = summary(model, x)
    doubled = summary(transform(model, "twice", lambda closed: {"conv_general_dilated": twice}), x)
    assert doubled.macs_by_category["conv"] == 2 * plain.macs_by_category["conv"]
    assert doubled.untransformed_macs == plain.macs
    assert doubled.macs_ratio == pytest.approx(doubled.macs / plain.macs)
    assert (doubled.total_params, doubled.trainable_params) == (plain.total_params, plain.trainable_params)
    tiled = summary(jtile.tile_conv(model, axis="H", tiles=4), x)
    assert [layer.name for layer in tiled.layers] == [layer.name for layer in plain.layers]
    assert tiled.macs_by_category == plain.macs_by_category  # stripes compute each output once
    assert tiled.macs_ratio == 1.0


def test_table_and_json(getkey):
    s = summary(_block, _block_params(getkey), _sds(2, 3, 6, 6))
    text = str(s)
    assert "stem/conv" in text and "Total params: 136" in text and "Non-trainable params: 4" in text
    assert f"{s.layers[0].macs:,}" in text
    data = json.loads(s.to_json())
    assert data["macs"] == s.macs and data["total_params"] == 136
    assert data["layers"][0]["layer"]["kind"] == "conv2d"


# ------------------------------------------------------------------ intercept


def test_intercept_leaves_outputs_bit_identical():
    model = models.get("tutorial")
    x = jax.random.normal(jax.random.key(1), models.input_shape("tutorial"))
    out, captured = intercept(model, x)
    assert np.array_equal(out, eqx.filter_jit(lambda m, x: m(x))(model, x))
    assert list(captured) == [layer.name for layer in summary(model, x).layers]
    assert np.array_equal(captured["relu0"], out)


def test_intercept_values_match_the_layer_computed_by_hand(getkey, tree_allclose):
    params, x = _block_params(getkey), jax.random.normal(getkey(), (2, 3, 6, 6))
    _, captured = intercept(_block, params, x)
    conv = lax.conv_general_dilated(x, params["w"], (1, 1), [(1, 1), (1, 1)])
    bn = (conv - params["mean"][:, None, None]) * params["gamma"][:, None, None]
    assert tree_allclose(captured["stem/conv"], conv)
    assert tree_allclose(captured["stem/bn"], bn)
    assert tree_allclose(captured["stem"], jnp.maximum(bn, 0))
    assert tree_allclose(captured["fc"], jnp.mean(jnp.maximum(bn, 0), (2, 3)) @ params["fc"])


def test_intercept_select_by_predicate_or_names(getkey):
    params, x = _block_params(getkey), jax.random.normal(getkey(), (2, 3, 6, 6))
    _, convs = intercept(_block, params, x, select=lambda layer: layer.kind == "conv2d")
    _, named = intercept(_block, params, x, select={"fc", "stem/bn"})
    assert list(convs) == ["stem/conv"]
    assert list(named) == ["stem/bn", "fc"]
    with pytest.raises(jtile.ConfigError, match="no layer named nope"):
        intercept(_block, params, x, select={"nope"})
    with pytest.raises(jtile.ConfigError, match="ShapeDtypeStruct"):
        intercept(_block, params, _sds(2, 3, 6, 6))


def _light_with_initializers(name: str):
    """A light model-zoo graph with its ConstantOfShape weights turned into
    initializers, and the element count of the initializers its nodes read as
    data (the reference: every initializer but a Reshape's target shape)."""
    model = onnx.load(os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light", name))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes, weights, shapes = [], [], set()
    for node in model.graph.node:
        if node.op_type != "ConstantOfShape":
            nodes.append(node)
            continue
        value = numpy_helper.to_array(node.attribute[0].t).reshape(())
        shapes.add(node.input[0])
        weights.append(numpy_helper.from_array(np.full(inits.pop(node.input[0]), value), node.output[0]))
    kept = [t for t in model.graph.initializer if t.name in inits]
    inputs = [i for i in model.graph.input if i.name not in shapes | {w.name for w in weights}]
    for field, items in ((model.graph.node, nodes), (model.graph.initializer, kept + weights),
                         (model.graph.input, inputs)):
        del field[:]
        field.extend(items)
    model.ir_version = max(model.ir_version, 4)  # initializers need not be graph inputs
    read = {name for node in nodes for i, name in enumerate(node.input) if (node.op_type, i) != ("Reshape", 1)}
    return jtile.onnx.load(model), sum(int(np.prod(w.dims)) for w in weights + kept if w.name in read)


@pytest.mark.parametrize("name, expected", [("light_resnet50.onnx", 25_610_152), ("light_densenet121.onnx", None)])
def test_onnx_params_are_exactly_the_initializers(name, expected):
    """No lowering constant (an average-pool divisor table) counts as a parameter."""
    model, count = _light_with_initializers(name)
    s = summary(model, jax.ShapeDtypeStruct((1, 3, 224, 224), jnp.float32))
    assert s.total_params == count == (expected or count)


def test_conv_weight_is_a_param_in_any_argument_position(getkey):
    x, w, b = jnp.ones((2, 8, 10, 20)), jnp.ones((16, 8, 3, 3)), jnp.ones((1, 16, 1, 1))

    def f(x, w, b):
        return jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), "SAME") + b)

    s = summary(f, x, w, b)
    assert (s.total_params, s.input_bytes) == (w.size + b.size, x.nbytes)
    s = summary(f, x, w, b, params={"args[1]"})
    assert (s.total_params, s.input_bytes) == (w.size, x.nbytes + b.nbytes)
    with pytest.raises(jtile.ConfigError, match="params= names args\\[7\\]"):
        summary(f, x, w, b, params={"args[7]"})


def test_type_column_shows_what_the_model_calls_each_layer():
    model = jtile.models.get("resnet18", jax.random.key(0))
    s = summary(model, jax.ShapeDtypeStruct((1, 3, 64, 64), jnp.float32))
    types = {layer.name: layer.type for layer in s.layers}
    assert (types["conv1"], types["bn1"], types["relu"], types["maxpool"], types["fc"]) == (
        "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Linear")
    assert "BatchNorm2d" in str(s).splitlines()[4]
    s = summary(jtile.onnx.load(os.path.join(LIGHT, "light_resnet50.onnx")), jax.ShapeDtypeStruct((1, 3, 224, 224), jnp.float32))
    assert {layer.type for layer in s.layers} >= {"Conv", "BatchNormalization", "Relu", "Gemm"}
