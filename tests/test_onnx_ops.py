"""The op handlers added for the torchvision zoo, each against the ONNX reference
evaluator (`onnx.reference`) on random shapes: one single-node graph per case,
inputs as graph inputs, static operands (axes, k) as initializers."""

import numpy as np
import pytest
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import jax

import jtile.onnx


def _node_model(op, inputs, static=None, opset=18, n_out=1, **attrs):
    """A graph running one `op` on `inputs` (graph inputs) and `static` (initializers)."""
    static = static or {}
    names = list(inputs) + list(static)
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, [n if n is not None else "" for n in names], outs, name="n0", **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in inputs.items()],
        [onnx.ValueInfoProto(name=o) for o in outs],
        [numpy_helper.from_array(v, k) for k, v in static.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _typed(model, expected):
    """`model` with its output types and shapes taken from the reference's results."""
    del model.graph.output[:]
    model.graph.output.extend(
        helper.make_tensor_value_info(f"y{i}", helper.np_dtype_to_tensor_dtype(e.dtype), e.shape)
        for i, e in enumerate(expected))
    return model


def _check(model, inputs, rtol=1e-5, atol=1e-5):
    expected = ReferenceEvaluator(model).run(None, inputs)
    model = _typed(model, expected)
    got = jtile.onnx.load(model)(*inputs.values())
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert np.shape(g) == np.shape(e)
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol)


def _shape(rng, rank, lo=1, hi=6):
    return tuple(int(d) for d in rng.integers(lo, hi, size=rank))


def _normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("seed", range(4))
def test_layer_normalization_matches_reference(seed):
    rng = np.random.default_rng(seed)
    shape = _shape(rng, int(rng.integers(2, 5)))
    axis = int(rng.integers(-len(shape), len(shape)))
    norm_shape = shape[axis:] if axis >= 0 else shape[len(shape) + axis:]
    inputs = {"x": _normal(rng, shape), "s": _normal(rng, norm_shape), "b": _normal(rng, norm_shape)}
    _check(_node_model("LayerNormalization", inputs, opset=17, n_out=3, axis=axis, epsilon=1e-3), inputs)


@pytest.mark.parametrize("seed", range(3))
def test_group_normalization_matches_reference(seed):
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 4))
    shape = (2, groups * int(rng.integers(1, 4)), *_shape(rng, 2))
    inputs = {"x": _normal(rng, shape), "s": _normal(rng, shape[1:2]), "b": _normal(rng, shape[1:2])}
    _check(_node_model("GroupNormalization", inputs, opset=21, num_groups=groups, epsilon=1e-4), inputs)


def test_instance_normalization_matches_reference():
    rng = np.random.default_rng(0)
    inputs = {"x": _normal(rng, (2, 3, 4, 5)), "s": _normal(rng, (3,)), "b": _normal(rng, (3,))}
    _check(_node_model("InstanceNormalization", inputs, opset=17), inputs)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_reference(approximate):
    rng = np.random.default_rng(0)
    inputs = {"x": _normal(rng, _shape(rng, 3)) * 3}
    _check(_node_model("Gelu", inputs, opset=20, approximate=approximate), inputs)


@pytest.mark.parametrize("op,attrs", [
    ("Elu", {"alpha": 0.7}), ("Selu", {}), ("Celu", {"alpha": 1.3}), ("Softplus", {}), ("Softsign", {}),
    ("Mish", {}), ("ThresholdedRelu", {"alpha": 0.2}), ("Sin", {}), ("Cos", {}), ("Atan", {}), ("Round", {}),
    ("IsNaN", {}), ("IsInf", {"detect_negative": 0}),
])
def test_unary_ops_match_reference(op, attrs):
    rng = np.random.default_rng(1)
    x = _normal(rng, _shape(rng, 3)) * 3
    x.reshape(-1)[:3] = [np.nan, np.inf, -np.inf] if op in ("IsNaN", "IsInf") else x.reshape(-1)[:3]
    if op == "Round":
        x.reshape(-1)[:4] = [0.5, 1.5, -2.5, 2.5]
    _check(_node_model(op, {"x": x}, **attrs), {"x": x})


@pytest.mark.parametrize("dtype,fmod", [(np.int64, 0), (np.int32, 1), (np.float32, 1), (np.float32, 0)])
def test_mod_matches_reference(dtype, fmod):
    rng = np.random.default_rng(2)
    shape = _shape(rng, 2)
    a = (rng.standard_normal(shape) * 20).astype(dtype)
    b = (rng.integers(1, 7, size=shape[-1:]) * rng.choice([-1, 1], size=shape[-1:])).astype(dtype)
    _check(_node_model("Mod", {"a": a, "b": b}, fmod=fmod), {"a": a, "b": b})


@pytest.mark.parametrize("reduction,seed", [("none", 0), ("add", 1), ("mul", 2), ("max", 3), ("min", 4)])
def test_scatter_nd_matches_reference(reduction, seed):
    rng = np.random.default_rng(seed)
    data = _normal(rng, _shape(rng, 3, 2))
    k = int(rng.integers(1, 4))
    n = int(rng.integers(1, 4))
    rows = rng.permutation(np.array(np.meshgrid(*[np.arange(d) for d in data.shape[:k]])).reshape(k, -1).T)
    indices = rows[:n].reshape(n, k) - np.asarray(data.shape[:k]) * (rng.integers(0, 2, size=(n, k)))
    updates = _normal(rng, (n, *data.shape[k:]))
    inputs = {"data": data, "indices": indices.astype(np.int64), "updates": updates}
    _check(_node_model("ScatterND", inputs, reduction=reduction), inputs)


@pytest.mark.parametrize("k", [1, 2])
def test_scatter_nd_with_static_indices_into_runtime_data_matches_reference(k):
    rng = np.random.default_rng(12)
    data = _normal(rng, (4, 3, 5))
    indices = np.array([[3, 1], [-4, 0], [2, 2]], np.int64)[:, :k]
    updates = _normal(rng, (3, *data.shape[k:]))
    static = {"indices": indices, "updates": updates}
    _check(_node_model("ScatterND", {"data": data}, static=static), {"data": data})


def test_scatter_nd_folds_static_operands():
    data = np.zeros((3, 4), np.float32)
    static = {"indices": np.array([[1], [-1]], np.int64), "updates": np.ones((2, 4), np.float32)}
    model = _node_model("ScatterND", {}, static={"data": data, **static})
    expected = ReferenceEvaluator(model).run(None, {})
    np.testing.assert_array_equal(np.asarray(jtile.onnx.load(_typed(model, expected))()), expected[0])


@pytest.mark.parametrize("axis,reduction", [(0, "none"), (1, "add"), (-1, "max")])
def test_scatter_elements_matches_reference(axis, reduction):
    rng = np.random.default_rng(3)
    data = _normal(rng, (4, 5, 3))
    shape = (2, 3, 3)
    indices = rng.integers(-data.shape[axis], data.shape[axis], size=shape).astype(np.int64)
    if reduction == "none":  # distinct targets along the axis, so the result is defined
        indices = np.broadcast_to(np.arange(shape[axis]).reshape([-1 if i == axis % 3 else 1 for i in range(3)]),
                                  shape).astype(np.int64)
    inputs = {"data": data, "indices": indices, "updates": _normal(rng, shape)}
    _check(_node_model("ScatterElements", inputs, axis=axis, reduction=reduction), inputs)


@pytest.mark.parametrize("axis", [0, 1, 2])  # the reference's own check mishandles a negative axis
def test_gather_elements_matches_reference(axis):
    rng = np.random.default_rng(4)
    data = _normal(rng, (4, 5, 3))
    shape = [2 if i == axis % data.ndim else n for i, n in enumerate(data.shape)]
    indices = rng.integers(-data.shape[axis], data.shape[axis], size=shape).astype(np.int64)
    _check(_node_model("GatherElements", {"data": data, "indices": indices}, axis=axis),
           {"data": data, "indices": indices})


@pytest.mark.parametrize("batch_dims,k", [(0, 1), (0, 2), (1, 1), (1, 2)])
def test_gather_nd_matches_reference(batch_dims, k):
    rng = np.random.default_rng(5)
    data = _normal(rng, (3, 4, 5))
    lead = (3, 2) if batch_dims else (2, 2)
    indices = np.stack([rng.integers(0, data.shape[batch_dims + i], size=lead) for i in range(k)], -1)
    inputs = {"data": data, "indices": indices.astype(np.int64)}
    _check(_node_model("GatherND", inputs, batch_dims=batch_dims), inputs)


@pytest.mark.parametrize("upper,k", [(1, 0), (0, 0), (1, -1), (0, 2)])
def test_trilu_matches_reference(upper, k):
    rng = np.random.default_rng(6)
    inputs = {"x": _normal(rng, (2, *_shape(rng, 2, 2)))}
    _check(_node_model("Trilu", inputs, static={"k": np.asarray(k, np.int64)}, upper=upper), inputs)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_matches_reference(exclusive, reverse):
    rng = np.random.default_rng(7)
    inputs = {"x": _normal(rng, (3, 4, 5))}
    model = _node_model("CumSum", inputs, static={"axis": np.asarray(-2, np.int64)},
                        exclusive=exclusive, reverse=reverse)
    _check(model, inputs)


@pytest.mark.parametrize("equation,shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    ("ij->ji", [(3, 4)]),
    ("...ij,jk", [(2, 3, 4), (4, 5)]),
    ("i,i", [(6,), (6,)]),
])
def test_einsum_matches_reference(equation, shapes):
    rng = np.random.default_rng(8)
    inputs = {f"x{i}": _normal(rng, s) for i, s in enumerate(shapes)}
    _check(_node_model("Einsum", inputs, opset=17, equation=equation), inputs, rtol=1e-4)


@pytest.mark.parametrize("op", ["ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMean"])
def test_reductions_with_axes_input_match_reference(op):
    rng = np.random.default_rng(9)
    x = np.abs(_normal(rng, (3, 4, 5))) + 0.1
    _check(_node_model(op, {"x": x}, static={"axes": np.asarray([0, -1], np.int64)}, keepdims=0), {"x": x})


@pytest.mark.parametrize("op,select_last", [("ArgMax", 0), ("ArgMin", 1), ("ArgMax", 1)])
def test_arg_reductions_match_reference(op, select_last):
    rng = np.random.default_rng(10)
    x = rng.integers(0, 3, size=(4, 5)).astype(np.float32)  # ties
    _check(_node_model(op, {"x": x}, axis=1, keepdims=1, select_last_index=select_last), {"x": x})


def test_resize_imports_as_one_fused_op_with_a_layer_and_macs():
    from jtile._interpreter import iter_eqns, make_jaxpr
    from jtile._layers import describe
    from jtile._macs import eqn_macs

    x = np.random.default_rng(11).standard_normal((1, 3, 4, 5)).astype(np.float32)
    sizes = np.asarray([1, 3, 8, 10], np.int64)
    model = _node_model("Resize", {"x": x}, static={"roi": np.zeros(0, np.float32),
                                                    "scales": np.zeros(0, np.float32), "sizes": sizes},
                        mode="linear")
    expected = ReferenceEvaluator(model).run(None, {"x": x})
    imported = jtile.onnx.load(_typed(model, expected))
    np.testing.assert_allclose(np.asarray(imported(x)), expected[0], rtol=1e-5, atol=1e-6)
    (eqn,) = [e for e in iter_eqns(make_jaxpr(imported.fn, imported.params, x).jaxpr) if e.primitive.name == "resize"]
    layer = describe(eqn)
    assert layer.kind == "resize" and layer.name == "n0" and layer.out_shape == (1, 3, 8, 10)
    macs, uncounted = eqn_macs(eqn)
    assert macs == {"elementwise": 1 * 3 * 8 * 10 * 2 * 2} and not uncounted


@pytest.mark.parametrize("index", [0, 2, -1])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_of_one_constant_index_is_a_static_slice(index, axis):
    """A scalar constant index (torch's `qkv[1]`) lowers to a slice, which
    kernels can read through in place; a gather could not be."""
    rng = np.random.default_rng(6)
    data = _normal(rng, (3, 4, 5))
    model = _node_model("Gather", {"data": data}, static={"i": np.array(index, np.int64)}, axis=axis)
    _check(model, {"data": data})
    loaded = jtile.onnx.load(_typed(model, ReferenceEvaluator(model).run(None, {"data": data})))
    prims = {e.primitive.name for e in jax.make_jaxpr(loaded.fn)(loaded.params, data).jaxpr.eqns}
    assert "gather" not in prims and "slice" in prims
