"""Softmax and layer norm as whole ops: an imported ONNX Softmax or
LayerNormalization becomes one `softmax` / `layer_norm` primitive, which runs
as the old jnp composition, swaps onto the row kernels, and exports back to
one ONNX node. References: the ONNX reference evaluator and jnp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import jtile
import jtile.onnx
from jtile import _fused
from jtile._interpreter import iter_eqns
from jtile.algorithms import layer_kinds, swap_backend


def _primitives(fn, *args) -> list[str]:
    return [e.params.get("target_name", e.primitive.name) for e in iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


def _block(shape, softmax_axis: int, norm_axis: int):
    """x -> LayerNormalization -> Softmax, the ViT block's two row ops."""
    rng = np.random.default_rng(0)
    normalised = shape[norm_axis:]
    scale = helper.make_tensor("scale", TensorProto.FLOAT, normalised, rng.standard_normal(normalised).ravel())
    bias = helper.make_tensor("bias", TensorProto.FLOAT, normalised, rng.standard_normal(normalised).ravel())
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=norm_axis, epsilon=1e-3),
             helper.make_node("Softmax", ["n"], ["y"], axis=softmax_axis)]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], [scale, bias])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    (want,) = ReferenceEvaluator(proto).run(None, {"x": x})
    return jtile.onnx.load(proto), x, want


@pytest.mark.parametrize("shape, softmax_axis, norm_axis", [
    ((2, 197, 33), -1, -1),  # the ViT block's rows, with a vector tail
    ((3, 5, 7), -1, 1),      # a norm over two trailing axes
])
def test_imported_row_ops_run_on_the_kernels(shape, softmax_axis, norm_axis):
    model, x, want = _block(shape, softmax_axis, norm_axis)
    assert [p for p in _primitives(model.fn, model.params, x) if p in ("softmax", "layer_norm")] == [
        "layer_norm", "softmax"]
    np.testing.assert_allclose(jax.jit(model.fn)(model.params, x), want, rtol=1e-5, atol=1e-6)
    swapped = swap_backend(model.fn, algorithms="auto")
    targets = _primitives(swapped, model.params, x)
    assert "jtile_softmax" in targets and "jtile_layer_norm" in targets
    assert "softmax" not in targets and "layer_norm" not in targets
    np.testing.assert_allclose(jax.jit(swapped)(model.params, x), want, rtol=1e-5, atol=1e-5)


def test_a_softmax_over_a_middle_axis_stays_on_xla():
    model, x, want = _block((2, 6, 9), 1, -1)
    auto = swap_backend(model.fn, algorithms="auto")
    targets = _primitives(auto, model.params, x)
    assert "softmax" in targets and "jtile_softmax" not in targets and "jtile_layer_norm" in targets
    np.testing.assert_allclose(jax.jit(auto)(model.params, x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(jtile.UnsupportedError, match="trailing axes only, not axes \\(1,\\)"):
        swap_backend(model.fn, algorithms={"softmax": "direct"})(model.params, x)


def test_opset_12_softmax_normalises_every_axis_from_its_own():
    """Softmax-1 to -12 coerce to 2-D at `axis`: one row per leading index.
    The reference evaluator normalises over `axis` alone here, so ONNX Runtime
    is the reference."""
    import onnxruntime

    rng = np.random.default_rng(1)
    node = helper.make_node("Softmax", ["x"], ["y"], axis=1)
    graph = helper.make_graph([node], "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 5])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    x = rng.standard_normal((2, 4, 5)).astype(np.float32)
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    model = jtile.onnx.load(proto)
    swapped = swap_backend(model.fn, algorithms="auto")
    assert "jtile_softmax" in _primitives(swapped, model.params, x)
    np.testing.assert_allclose(jax.jit(swapped)(model.params, x), want, rtol=1e-5, atol=1e-6)


def test_row_ops_are_layer_kinds_with_descriptions():
    assert {"softmax", "layer_norm"} <= set(layer_kinds())
    from jtile._layers import describe

    jaxpr = jax.make_jaxpr(lambda x: _fused.layer_norm(_fused.softmax(x, axes=(1,)), jnp.ones(6), jnp.zeros(6),
                                                        axes=(1,), epsilon=1e-5))(jnp.ones((4, 6)))
    layers = [describe(e) for e in iter_eqns(jaxpr.jaxpr)]
    assert [(layer.kind, layer.out_shape) for layer in layers if layer] == [("softmax", (4, 6)), ("layer_norm", (4, 6))]


@pytest.mark.parametrize("axes", [(2,), (1, 2)])
def test_row_ops_export_to_one_onnx_node_each(axes):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    scale, bias = rng.standard_normal(x.shape[axes[0]:]).astype(np.float32), rng.standard_normal(5).astype(np.float32)

    def fn(x):
        y = _fused.layer_norm(x, scale, bias, axes=axes, epsilon=1e-4)
        return _fused.softmax(y, axes=axes)

    proto = jtile.onnx.export(fn, x)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("LayerNormalization") == 1 and ops.count("Softmax") == 1
    (got,) = ReferenceEvaluator(proto).run(None, {proto.graph.input[0].name: x})
    np.testing.assert_allclose(got, fn(x), rtol=1e-5, atol=1e-6)


def test_export_refuses_a_norm_over_leading_axes():
    with pytest.raises(jtile.OnnxError, match="normalises trailing axes"):
        jtile.onnx.export(lambda x: _fused.softmax(x, axes=(0,)), np.ones((2, 3), np.float32))
