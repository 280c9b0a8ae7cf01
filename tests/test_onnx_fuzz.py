"""Fuzz `jtile.onnx.load` with broken versions of the shipped light graphs,
differentially against ONNX Runtime.

Each case mutates one model: flipped bytes, truncated bytes, an attribute
changed or removed through the proto API, a random input or initializer
dimension, a node's op type or input rewired. Loading must either succeed or
raise a `JtileError`; any other exception, a case running past its time
limit, or a model ONNX Runtime refuses to load but jtile accepts, fails.
(jtile may refuse more than ORT: shapes are static in JAX.) Both loading
paths run: the default one and the large-model one (over
`_proto.FULL_CHECK_LIMIT` bytes, checked on the model's skeleton). Seeded;
`CASES` cases by default, `SLOW_CASES` more under `slow`.

The spec's prohibitions that fuzzing rarely hits are built directly
(`FORBIDDEN`): each is refused by ORT and must be refused by jtile on both
paths, naming the faulty node where there is one.
"""

import copy
import os
import signal

import jax
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import jtile
import jtile.onnx
from jtile.onnx import _proto
from jtile.onnx.ops import REGISTRY

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
SMALL = ["bvlc_alexnet", "squeezenet", "zfnet512"]
ALL = SMALL + ["densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "vgg19"]
CASES, SLOW_CASES, TIME_LIMIT = 60, 400, 20.0


class _TimeLimit(Exception):
    pass


def _flip_bytes(rng, model):
    data = bytearray(model.SerializeToString())
    for _ in range(rng.integers(1, 9)):
        data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
    return "flip bytes", bytes(data)


def _truncate(rng, model):
    data = model.SerializeToString()
    cut = int(rng.integers(1, len(data)))
    return f"truncate at {cut}/{len(data)}", data[:cut]


def _mutate_attribute(rng, model):
    nodes = [n for n in model.graph.node if n.attribute]
    node = nodes[rng.integers(len(nodes))]
    attr = node.attribute[rng.integers(len(node.attribute))]
    choice = rng.integers(4)
    if choice == 0:
        node.attribute.remove(attr)
        return f"remove {node.op_type}.{attr.name}", model
    if attr.type == onnx.AttributeProto.INTS:
        values = rng.choice([-3, -1, 0, 1, 2, 3, 7, 2**31], size=rng.integers(0, 6)).tolist()
        attr.ClearField("ints")
        attr.ints.extend(values)
    elif attr.type == onnx.AttributeProto.INT:
        attr.i = int(rng.choice([-5, -1, 0, 1, 2, 3, 2**31]))
    elif attr.type == onnx.AttributeProto.FLOAT:
        attr.f = float(rng.choice([np.nan, np.inf, -1.0, 0.0, 1e30]))
    elif attr.type == onnx.AttributeProto.STRING:
        attr.s = bytes(rng.choice([b"", b"SAME_UPPER", b"VALID", b"bogus", b"\xff\xfe"]))
    elif attr.type == onnx.AttributeProto.TENSOR:
        attr.t.dims[:] = rng.integers(0, 4, size=rng.integers(0, 3)).tolist()
    return f"set {node.op_type}.{attr.name}", model


def _random_dim(rng, model):
    value = int(rng.choice([0, 1, 2, 5, 2**20, 2**40]))
    tensors = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT64]
    if rng.integers(2) and tensors:
        tensor = tensors[rng.integers(len(tensors))]
        array = numpy_helper.to_array(tensor).copy()
        if array.size:
            array.reshape(-1)[rng.integers(array.size)] = int(rng.choice([-2, -1, 0, 3, 2**20, 2**40]))
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
        return f"initializer {tensor.name} -> {array.tolist()}", model
    inputs = [v for v in model.graph.input if v.type.tensor_type.shape.dim]
    dims = inputs[rng.integers(len(inputs))].type.tensor_type.shape.dim
    dims[rng.integers(len(dims))].dim_value = value
    return f"input dim -> {value}", model


def _rewire(rng, model):
    node = model.graph.node[rng.integers(len(model.graph.node))]
    if rng.integers(2):
        node.op_type = str(rng.choice(sorted(REGISTRY) + ["Bogus", "LSTM"]))
        return f"op type -> {node.op_type}", model
    names = [o for n in model.graph.node for o in n.output] + [""]
    if node.input:
        node.input[rng.integers(len(node.input))] = str(rng.choice(names))
    return f"rewire {node.op_type}", model


MUTATIONS = [_flip_bytes, _truncate, _mutate_attribute, _random_dim, _rewire]


@pytest.fixture(scope="module")
def light_models():
    return {name: onnx.load(os.path.join(LIGHT, f"light_{name}.onnx")) for name in ALL}


def _raise_time_limit(signum, frame):
    raise _TimeLimit


@pytest.fixture(params=["default", "large"])
def loading_path(request, monkeypatch):
    """Load through the default path, or through the large-model one (every model counts as large)."""
    if request.param == "large":
        monkeypatch.setattr(_proto, "FULL_CHECK_LIMIT", 0)
    return request.param


def _onnxruntime_error(payload) -> str | None:
    data = payload if isinstance(payload, bytes) else payload.SerializeToString()
    try:
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types, or RuntimeError
        return str(e)
    return None


def _run(light_models, names, n_cases, seed):
    rng = np.random.default_rng(seed)
    outcomes = {"loaded": 0, "rejected": 0}
    previous = signal.signal(signal.SIGALRM, _raise_time_limit)
    try:
        for case in range(n_cases):
            name = names[rng.integers(len(names))]
            mutate = MUTATIONS[rng.integers(len(MUTATIONS))]
            what, payload = mutate(rng, copy.deepcopy(light_models[name]))
            refused = _onnxruntime_error(payload)
            signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT)
            try:
                jtile.onnx.load(payload)
                if refused:
                    pytest.fail(f"case {case} ({name}: {what}) loaded, but ONNX Runtime refuses it: {refused}")
                outcomes["loaded"] += 1
            except jtile.JtileError:
                outcomes["rejected"] += 1
            except _TimeLimit:
                pytest.fail(f"case {case} ({name}: {what}) ran past {TIME_LIMIT} s")
            except Exception as e:  # anything else is a bug in the importer
                pytest.fail(f"case {case} ({name}: {what}) raised {type(e).__name__}: {e}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return outcomes


def test_mutated_light_models_load_or_raise_jtile_errors(light_models, loading_path):
    outcomes = _run(light_models, SMALL, CASES, seed=0)
    assert outcomes["rejected"] > 0 and sum(outcomes.values()) == CASES


@pytest.mark.slow
def test_many_mutated_light_models_load_or_raise_jtile_errors(light_models, loading_path):
    outcomes = _run(light_models, ALL, SLOW_CASES, seed=1)
    assert outcomes["rejected"] > 0 and sum(outcomes.values()) == SLOW_CASES


def _one_node(node, x_type=TensorProto.FLOAT, initializers=(), opset=17, outputs=True):
    x = helper.make_tensor_value_info("x", x_type, [1, 2, 5, 5])
    y = [helper.make_tensor_value_info("y", x_type, ["n", "c", "h", "w"])] if outputs else []
    graph = helper.make_graph([node], "g", [x], y, [numpy_helper.from_array(v, k) for k, v in initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


_WEIGHT = [("w", np.ones((2, 2, 3, 3), np.float32))]
# name -> (model, what jtile's error must say)
FORBIDDEN = {
    "opset newer than known": (_one_node(helper.make_node("Relu", ["x"], ["y"]), opset=99), "opset 99"),
    "MaxPool pads at the kernel size": (
        _one_node(helper.make_node("MaxPool", ["x"], ["y"], name="pool", kernel_shape=[2, 2], pads=[0, 2, 0, 0])),
        "node 'pool'"),
    "AveragePool pads over the kernel size": (
        _one_node(helper.make_node("AveragePool", ["x"], ["y"], name="avg", kernel_shape=[2, 2], pads=[3, 0, 0, 0])),
        "node 'avg'"),
    "DOUBLE input into a float Conv": (
        _one_node(helper.make_node("Conv", ["x", "w"], ["y"], name="conv"), TensorProto.DOUBLE, _WEIGHT),
        "Conv"),
    "DOUBLE input added to a float weight": (
        _one_node(helper.make_node("Add", ["x", "w"], ["y"], name="add"), TensorProto.DOUBLE, _WEIGHT),
        "Add"),
    "Gelu before opset 20": (_one_node(helper.make_node("Gelu", ["x"], ["y"], name="gelu")), "Gelu"),
}


@pytest.mark.parametrize("case", sorted(FORBIDDEN))
def test_models_the_spec_forbids_are_refused_like_onnxruntime(case, loading_path):
    model, named = FORBIDDEN[case]
    assert _onnxruntime_error(model) is not None
    with pytest.raises(jtile.JtileError, match=named):
        jtile.onnx.load(model)


def test_a_graph_without_outputs_is_refused(loading_path):
    with pytest.raises(jtile.OnnxError, match="no outputs"):
        jtile.onnx.load(_one_node(helper.make_node("Relu", ["x"], ["y"]), outputs=False))


def test_double_inputs_need_x64_and_then_compute_in_float64(loading_path):
    model = _one_node(helper.make_node("Relu", ["x"], ["y"]), TensorProto.DOUBLE)
    with pytest.raises(jtile.UnsupportedError, match="jax_enable_x64"):
        jtile.onnx.load(model)
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 5)) * 1e-9 + 1.0
    (expected,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with jax.enable_x64(True):
        y = jtile.onnx.load(model)(x)
        assert y.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(y), expected)
