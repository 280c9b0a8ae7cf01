import json
import os

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from jtile import cli

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
RESNET50 = os.path.join(LIGHT, "light_resnet50.onnx")


@pytest.fixture
def jtile_cmd(capsys):
    """Run `jtile ARGS` through the CLI entry point; returns (exit code, stdout, stderr)."""

    def run(*argv):
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_summary_of_a_zoo_model_prints_the_table(jtile_cmd):
    code, out, _ = jtile_cmd("summary", "tutorial")
    assert code == 0
    assert "conv0" in out and "Total params: 1,024" in out and "Trainable params: 960" in out


def test_summary_json_batch_and_size_change_the_input(jtile_cmd):
    _, one, _ = jtile_cmd("summary", "resnet18", "--json", "--batch", "1", "--size", "64")
    _, two, _ = jtile_cmd("summary", "resnet18", "--json", "--batch", "2", "--size", "64")
    one, two = json.loads(one), json.loads(two)
    assert one["input_bytes"] == 4 * 3 * 64 * 64
    assert two["macs_by_category"]["conv"] == 2 * one["macs_by_category"]["conv"]
    assert one["trainable_params"] == 11_689_512  # torchvision resnet18


def test_summary_depth(jtile_cmd):
    _, out, _ = jtile_cmd("summary", "resnet18", "--json", "--depth", "1")
    names = [layer["name"] for layer in json.loads(out)["layers"]]
    assert "layer1" in names and "layer1.0.conv1" not in names


def test_summary_of_an_onnx_file(jtile_cmd):
    code, out, _ = jtile_cmd("summary", RESNET50, "--json")
    data = json.loads(out)
    assert code == 0
    assert 4.05e9 < data["macs"] < 4.2e9  # ptflops resnet50: 4.12 GMac
    convs = [layer for layer in data["layers"] if layer["kind"] == "conv"]
    assert len(convs) == 53
    assert convs[0]["macs_by_category"]["conv"] == 64 * 112 * 112 * 3 * 7 * 7  # the 7x7/2 stem


def test_summary_of_an_unknown_model_is_an_error(jtile_cmd):
    code, _, err = jtile_cmd("summary", "resnet1000")
    assert code == 2
    assert "resnet1000" in err and "mobilenet_v2" in err


def test_onnx_info_lists_ops_attributes_and_tensors(jtile_cmd):
    code, out, _ = jtile_cmd("onnx-info", RESNET50)
    assert code == 0
    conv = next(line for line in out.splitlines() if line.startswith("Conv "))
    assert conv.split()[1] == "53"
    assert "kernel_shape=1..7" in conv and "strides=1..2" in conv
    assert "gpu_0/data_0" in out and "602,112 B" in out  # the 1x3x224x224 float input


def test_onnx_info_json(jtile_cmd):
    _, out, _ = jtile_cmd("onnx-info", RESNET50, "--json")
    data = json.loads(out)
    assert data["ops"]["BatchNormalization"]["count"] == 53
    assert data["opset"] == 9


def test_summary_fills_symbolic_onnx_dims_from_batch_and_size(jtile_cmd, tmp_path):
    w = onnx.numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], name="conv")], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 2, "H2", "W2"])], [w],
    )
    path = str(tmp_path / "sym.onnx")
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), path)
    code, _, err = jtile_cmd("summary", path)
    assert code == 2 and "--batch" in err
    code, out, _ = jtile_cmd("summary", path, "--json", "--batch", "2", "--size", "8")
    data = json.loads(out)
    assert code == 0 and data["input_bytes"] == 4 * 2 * 3 * 8 * 8
    assert data["macs"] == 2 * 2 * 6 * 6 * 27


def test_summary_spatial_reports_the_tiled_peak_and_recompute(jtile_cmd):
    import jax

    import jtile

    _, plain, _ = jtile_cmd("summary", "mobilenet_v2", "--json", "--size", "64")
    code, tiled, _ = jtile_cmd("summary", "mobilenet_v2", "--json", "--size", "64", "--spatial", "4x4")
    assert code == 0
    plain, tiled = json.loads(plain), json.loads(tiled)
    model = jax.eval_shape(lambda: jtile.models.get("mobilenet_v2"))
    x = jax.ShapeDtypeStruct((1, 3, 64, 64), np.float32)
    fn = jtile.tile_spatial(lambda m, x: m(x), grid=(4, 4), until="features.4")  # MCUNetV2's block
    expected = jtile.summary(fn, model, x)
    assert tiled["peak_bytes"] == expected.peak_bytes == jtile.graph(fn, model, x).peak_bytes()
    assert tiled["peak_bytes"] < plain["peak_bytes"] and tiled["macs_ratio"] > 1.0
    code, _, err = jtile_cmd("summary", "mobilenet_v2", "--spatial", "four")
    assert code == 2 and "--spatial takes RxC" in err
