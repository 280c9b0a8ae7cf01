"""`jtile.onnx.info`: op inventory, attribute ranges and tensor sizes of an ONNX model."""

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import jtile
import jtile.onnx

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def test_info_of_a_light_model_counts_ops_and_parameters():
    path = os.path.join(LIGHT, "light_bvlc_alexnet.onnx")
    proto = onnx.load(path)
    summary = jtile.onnx.info(path)
    assert summary["opset"] == 9
    assert {op: entry["count"] for op, entry in summary["ops"].items()} == {
        op: sum(n.op_type == op for n in proto.graph.node) for op in {n.op_type for n in proto.graph.node}
    }
    assert all(entry["supported"] for entry in summary["ops"].values())
    conv = summary["ops"]["Conv"]["attributes"]
    assert conv["kernel_shape"]["min"] == 3 and conv["kernel_shape"]["max"] == 11
    assert conv["strides"] == {"min": 1, "max": 4, "count": 5}
    expected = sum(numpy_helper.to_array(t).size for t in proto.graph.initializer)
    assert summary["total_parameters"] == expected
    assert summary["inputs"] == [{"name": "data_0", "dtype": "float32", "shape": [1, 3, 224, 224],
                                  "elements": 150528, "bytes": 602112}]


def test_info_reports_unsupported_ops_and_symbolic_sizes():
    nodes = [helper.make_node("Hardmax", ["x"], ["y"], name="mix", axis=-1),
             helper.make_node("Relu", ["y"], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(np.zeros((4, 4), np.float16), "unused")],
        value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    summary = jtile.onnx.info(model.SerializeToString())
    assert summary["ops"]["Relu"]["supported"] and not summary["ops"]["Hardmax"]["supported"]
    assert "Hardmax is not supported" in summary["ops"]["Hardmax"]["reason"]
    assert summary["ops"]["Hardmax"]["attributes"]["axis"] == {"min": -1, "max": -1, "count": 1}
    assert summary["values"] == [{"name": "y", "dtype": "float32", "shape": ["n", 4], "elements": None, "bytes": None}]
    assert summary["initializers"][0]["bytes"] == 32 and summary["total_parameter_bytes"] == 32


def test_info_of_a_broken_model_raises_onnx_error():
    with pytest.raises(jtile.OnnxError):
        jtile.onnx.info(b"\x08\x07\x12")
