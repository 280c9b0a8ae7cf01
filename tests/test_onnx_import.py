"""`jtile.onnx.load` on small graphs built with `onnx.helper`, compared with onnxruntime,
plus the importer's contract: static shape folding, named scopes, the lowering
jtile's transforms rely on, and the errors for bad models."""

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import jtile
import jtile.onnx
from jtile._interpreter import bind, iter_eqns, make_jaxpr, transform

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _out(rank, name="y"):
    return helper.make_tensor_value_info(name, F32, [f"d{i}" for i in range(rank)])


def _onnxruntime(model, *inputs):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, inputs)))


def _random(getkey, shape):
    return np.asarray(jax.random.normal(getkey(), shape), np.float32)


def _conv_bn_relu(getkey, group, auto_pad):
    w = _random(getkey, (8, 8 // group, 3, 3))
    inits = {"w": w, "b": _random(getkey, (8,)), "scale": _random(getkey, (8,)), "bias": _random(getkey, (8,)),
             "mean": _random(getkey, (8,)), "var": np.abs(_random(getkey, (8,))) + 0.5}
    pads = {"pads": [1, 0, 2, 1]} if auto_pad == "NOTSET" else {}
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv1", group=group, strides=[2, 1],
                         dilations=[1, 1] if auto_pad.startswith("SAME") else [1, 2], auto_pad=auto_pad, **pads),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["n"], name="bn1", epsilon=1e-3),
        helper.make_node("Relu", ["n"], ["y"], name="relu1"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F32, [2, 8, 11, 12])],
                  [_out(4)], inits.items())


@pytest.mark.parametrize("group,auto_pad", [(1, "NOTSET"), (2, "SAME_UPPER"), (8, "SAME_LOWER"), (4, "VALID")])
def test_conv_bn_relu_matches_onnxruntime(getkey, group, auto_pad):
    proto = _conv_bn_relu(getkey, group, auto_pad)
    x = _random(getkey, (2, 8, 11, 12))
    model = jtile.onnx.load(proto)
    (expected,) = _onnxruntime(proto, x)
    np.testing.assert_allclose(np.asarray(model(x)), expected, rtol=1e-4, atol=1e-4)
    assert model.output_shapes == [expected.shape]


@pytest.mark.parametrize("trans_a,trans_b,alpha,beta,c_shape", [
    (0, 0, 1.0, 1.0, (5,)), (1, 0, 0.5, 2.0, (3, 5)), (0, 1, 1.0, 0.0, (1, 5)),
    (1, 1, -1.5, 0.5, (3, 1)), (0, 0, 1.0, 1.0, None),
])
def test_gemm_variants_match_onnxruntime(getkey, trans_a, trans_b, alpha, beta, c_shape):
    a = _random(getkey, (4, 3) if trans_a else (3, 4))
    b = _random(getkey, (5, 4) if trans_b else (4, 5))
    inits = {"b": b} | ({"c": _random(getkey, c_shape)} if c_shape else {})
    node = helper.make_node("Gemm", ["a", "b"] + (["c"] if c_shape else []), ["y"], transA=trans_a, transB=trans_b,
                            alpha=alpha, beta=beta)
    proto = _model([node], [helper.make_tensor_value_info("a", F32, a.shape)], [_out(2)], inits.items())
    (expected,) = _onnxruntime(proto, a)
    np.testing.assert_allclose(np.asarray(jtile.onnx.load(proto)(a)), expected, rtol=1e-5, atol=1e-5)


def _flatten_by_shape():
    """y = Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])) * 2, as exporters write Flatten."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("ConstantOfShape", ["target_len"], ["twos"],
                         value=numpy_helper.from_array(np.array([2.0], np.float32))),
        helper.make_node("Mul", ["flat", "twos"], ["y"]),
    ]
    inits = {"zero": np.array(0, np.int64), "axes": np.array([0], np.int64), "minus_one": np.array([-1], np.int64),
             "target_len": np.array([1], np.int64)}
    return _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", 3, 4])], [_out(2)], inits.items())


def test_shape_subgraph_folds_statically(getkey):
    proto = _flatten_by_shape()
    model = jtile.onnx.load(proto)
    assert model.params == {}  # every initializer feeds a shape operand
    assert model.input_shapes == [(None, 3, 4)] and model.output_shapes == [None]
    for batch in (2, 5):
        x = _random(getkey, (batch, 3, 4))
        (expected,) = _onnxruntime(proto, x)
        np.testing.assert_allclose(np.asarray(model(x)), expected)
    jaxpr = make_jaxpr(model.fn, model.params, x)
    assert {e.primitive.name for e in iter_eqns(jaxpr.jaxpr)} <= {"reshape", "broadcast_in_dim", "mul"}


def test_graph_input_feeding_a_shape_operand_is_baked_in(getkey):
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    proto = _model([node], [helper.make_tensor_value_info("x", F32, [2, 3, 4]),
                            helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                   [_out(2)])
    model = jtile.onnx.load(proto)
    x = _random(getkey, (2, 3, 4))
    assert model.static_inputs == [1]
    for axes in ([1], [-1]):
        np.testing.assert_allclose(np.asarray(model(x, np.array(axes))), x.sum(axis=axes[0]), rtol=1e-5)
    with pytest.raises(jtile.UnsupportedError, match="'axes' feeds a shape operand"):
        jax.jit(model.fn)(model.params, x, np.array([1]))


@pytest.mark.parametrize("mode,coords,scales", [
    ("nearest", "asymmetric", [1, 1, 2, 3]), ("nearest", "half_pixel", [1, 1, 0.6, 1.7]),
    ("linear", "half_pixel", [1, 1, 2, 0.5]), ("linear", "align_corners", [1, 1, 2, 1.5]),
    ("nearest", "pytorch_half_pixel", [1, 1, 1.6, 0.5]),
    ("linear", "pytorch_half_pixel", [1, 1, 0.5, 3]), ("cubic", "half_pixel", [1, 1, 2, 2]),
])
def test_resize_matches_onnxruntime(getkey, mode, coords, scales):
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode, coordinate_transformation_mode=coords)
    proto = _model([node], [helper.make_tensor_value_info("x", F32, [1, 2, 5, 6])], [_out(4)],
                   [("scales", np.array(scales, np.float32))])
    x = _random(getkey, (1, 2, 5, 6))
    (expected,) = _onnxruntime(proto, x)
    got = np.asarray(jtile.onnx.load(proto)(x))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_pure_function_jits_and_runs_under_the_interpreter(getkey):
    proto = _conv_bn_relu(getkey, 1, "NOTSET")
    model = jtile.onnx.load(proto)
    x = _random(getkey, (2, 8, 11, 12))
    expected = np.asarray(model(x))
    np.testing.assert_allclose(np.asarray(jax.jit(model.fn)(model.params, x)), expected, rtol=1e-5, atol=1e-5)
    seen = []

    def conv_rule(eqn, *invals):
        seen.append(eqn.params["feature_group_count"])
        (out,) = bind(eqn, *invals)
        return out

    counted = transform(model.fn, "test", lambda closed: {"conv_general_dilated": conv_rule})
    np.testing.assert_allclose(np.asarray(counted(model.params, x)), expected, rtol=1e-5, atol=1e-5)
    assert seen == [1]
    assert set(model.params) == {"w", "b", "scale", "bias", "mean", "var"}


def test_layers_lower_to_the_primitives_transforms_rewrite(getkey):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="features.0", pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["c"], ["p"], name="features.1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc"], ["y"], name="classifier", transB=1),
    ]
    proto = _model(nodes, [helper.make_tensor_value_info("x", F32, [1, 3, 8, 8])], [_out(2)],
                   [("w", _random(getkey, (4, 3, 3, 3))), ("fc", _random(getkey, (10, 64)))])
    model = jtile.onnx.load(proto)
    jaxpr = make_jaxpr(model.fn, model.params, np.zeros((1, 3, 8, 8), np.float32))
    scopes = {e.primitive.name: str(e.source_info.name_stack) for e in iter_eqns(jaxpr.jaxpr)}
    assert scopes["conv_general_dilated"] == "features.0"
    assert scopes["reduce_window_max"] == "features.1"
    assert scopes["dot_general"] == "classifier"
    conv = next(e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "conv_general_dilated")
    dims = conv.params["dimension_numbers"]
    assert (dims.lhs_spec, dims.rhs_spec, dims.out_spec) == ((0, 1, 2, 3),) * 3


def test_unsupported_op_names_op_node_and_opset():
    node = helper.make_node("Hardmax", ["x"], ["y"], name="mix", axis=-1)
    proto = _model([node], [helper.make_tensor_value_info("x", F32, [2, 2])], [_out(2)])
    with pytest.raises(jtile.UnsupportedError, match=r"node 'mix' \(Hardmax, opset 17\).*Hardmax is not supported"):
        jtile.onnx.load(proto)


def test_unsupported_op_version_names_the_nearest_supported_opset():
    node = helper.make_node("LeakyRelu", ["x"], ["y"], name="act")
    proto = _model([node], [helper.make_tensor_value_info("x", F32, [2, 2])], [_out(2)], opset=5)
    with pytest.raises(jtile.UnsupportedError, match=r"node 'act' \(LeakyRelu, opset 5\): LeakyRelu-1 is not "
                                                     r"supported.*versions 6 to 28; re-export the model at opset 6"):
        jtile.onnx.load(proto)


def test_malformed_model_raises_onnx_error():
    node = helper.make_node("Relu", ["missing"], ["y"])
    proto = _model([node], [helper.make_tensor_value_info("x", F32, [2])], [_out(1)])
    with pytest.raises(jtile.OnnxError, match="malformed"):
        jtile.onnx.load(proto)


def test_truncated_bytes_raise_onnx_error(getkey):
    data = _conv_bn_relu(getkey, 1, "NOTSET").SerializeToString()
    for cut in (7, len(data) // 2, len(data) - 3):
        with pytest.raises(jtile.OnnxError, match="onnx.load"):
            jtile.onnx.load(data[:cut])


def test_bad_sources_raise_onnx_error(tmp_path):
    with pytest.raises(jtile.OnnxError, match="no such file"):
        jtile.onnx.load(tmp_path / "absent.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\xff" * 64)
    with pytest.raises(jtile.OnnxError):
        jtile.onnx.load(tmp_path / "junk.onnx")
    with pytest.raises(jtile.OnnxError, match="expected a path, bytes or onnx.ModelProto"):
        jtile.onnx.load(3)


def test_bad_call_raises_config_error(getkey):
    model = jtile.onnx.load(_conv_bn_relu(getkey, 1, "NOTSET"))
    with pytest.raises(jtile.ConfigError, match="expected 1 input"):
        model()
    with pytest.raises(jtile.ConfigError, match=r"has shape \(2, 8, 11, 11\), the model declares \(2, 8, 11, 12\)"):
        model(jnp.zeros((2, 8, 11, 11)))


def test_handler_failure_names_the_node():
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")
    proto = _model([node], [helper.make_tensor_value_info("x", F32, [2, 3])], [_out(2)],
                   [("shape", np.array([4, 2], np.int64))])
    with pytest.raises(jtile.OnnxError, match=r"node 'bad_reshape' \(Reshape, opset 17\): cannot reshape \(2, 3\)"):
        jtile.onnx.load(proto)
