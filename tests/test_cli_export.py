import os

import numpy as np
import onnx
import onnxruntime as ort

from jtile.cli import main

LIGHT = os.path.join(onnx.__path__[0], "backend", "test", "data", "light")


def _session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_export_zoo_model_split_and_fused(tmp_path, capsys):
    out = tmp_path / "mobilenet.onnx"
    small = ["--size", "32", "--batch", "2"]
    assert main(["export", "mobilenet_v2", *small, "--split-gemm", "1,640,500", "--fuse", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    model = onnx.load(out)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 2 * 2 * 2 and ops.count("Conv") == 52 and "BatchNormalization" not in ops
    assert {n.name.split("/MatMul")[0] for n in model.graph.node if n.op_type == "MatMul"} == {
        f"classifier.1/gemm_tile_m{m}_k{k}_n{n}" for m in range(2) for k in range(2) for n in range(2)
    }
    (x,) = _session(out).get_inputs()
    assert x.shape == [2, 3, 32, 32]
    plain = tmp_path / "plain.onnx"
    assert main(["export", "mobilenet_v2", *small, "-o", str(plain)]) == 0
    data = np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32)
    got = _session(out).run(None, {x.name: data})[0]
    want = _session(plain).run(None, {x.name: data})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_export_onnx_file_fused(tmp_path):
    out = tmp_path / "squeezenet.onnx"
    assert main(["export", os.path.join(LIGHT, "light_squeezenet.onnx"), "--fuse", "-o", str(out)]) == 0
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count("Conv") == 26 and "Softmax" not in ops  # softmax is written as its primitives


def test_export_bad_arguments_exit_2(tmp_path, capsys):
    out = tmp_path / "x.onnx"
    assert main(["export", "tutorial", "--split-gemm", "64,x", "-o", str(out)]) == 2
    assert "--split-gemm expects three ints" in capsys.readouterr().err
    assert main(["export", "tutorial", "--split-gemm", "64,0,64", "-o", str(out)]) == 2
    assert "max_k must be a positive int" in capsys.readouterr().err
    assert main(["export", "no_such_model", "-o", str(out)]) == 2
    assert "neither an existing file nor a zoo model" in capsys.readouterr().err
    assert not out.exists()
