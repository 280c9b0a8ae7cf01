"""Fuzz `jtile.onnx.load` with broken versions of the shipped light graphs.

Each case mutates one model: flipped bytes, truncated bytes, an attribute
changed or removed through the proto API, a random input or initializer
dimension, a node's op type or input rewired. Loading must either succeed or
raise a `JtileError`; any other exception, or a case running past its time
limit, fails. Seeded; `CASES` cases by default, `SLOW_CASES` more under `slow`.
"""

import copy
import os
import signal

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import jtile
import jtile.onnx
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


def _run(light_models, names, n_cases, seed):
    rng = np.random.default_rng(seed)
    outcomes = {"loaded": 0, "rejected": 0}
    previous = signal.signal(signal.SIGALRM, _raise_time_limit)
    try:
        for case in range(n_cases):
            name = names[rng.integers(len(names))]
            mutate = MUTATIONS[rng.integers(len(MUTATIONS))]
            what, payload = mutate(rng, copy.deepcopy(light_models[name]))
            signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT)
            try:
                jtile.onnx.load(payload)
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


def test_mutated_light_models_load_or_raise_jtile_errors(light_models):
    outcomes = _run(light_models, SMALL, CASES, seed=0)
    assert outcomes["rejected"] > 0 and sum(outcomes.values()) == CASES


@pytest.mark.slow
def test_many_mutated_light_models_load_or_raise_jtile_errors(light_models):
    outcomes = _run(light_models, ALL, SLOW_CASES, seed=1)
    assert outcomes["rejected"] > 0 and sum(outcomes.values()) == SLOW_CASES
