import os
import stat

import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import jtile
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
    assert ops.count("Conv") == 26 and ops.count("Softmax") == 1  # the imported Softmax stays one op


def test_export_bad_arguments_exit_2(tmp_path, capsys):
    out = tmp_path / "x.onnx"
    assert main(["export", "tutorial", "--split-gemm", "64,x", "-o", str(out)]) == 2
    assert "--split-gemm expects three ints" in capsys.readouterr().err
    assert main(["export", "tutorial", "--split-gemm", "64,0,64", "-o", str(out)]) == 2
    assert "max_k must be a positive int" in capsys.readouterr().err
    assert main(["export", "no_such_model", "-o", str(out)]) == 2
    assert "neither an existing file nor a zoo model" in capsys.readouterr().err
    assert not out.exists()


def test_export_to_a_bad_path_is_a_jtile_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "missing" / "dir" / "r.onnx"
    assert main(["export", "tutorial", "--size", "8", "-o", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jtile: error: export: cannot write") and f"{tmp_path / 'missing' / 'dir'} does not exist" in err
    assert main(["export", "tutorial", "--size", "8", "-o", str(tmp_path)]) == 2
    assert f"{tmp_path} is a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["export", "tutorial", "--size", "8", "-o", str(tmp_path / "file" / "r.onnx")]) == 2
    assert f"{tmp_path / 'file'} is not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_export_to_an_unwritable_directory_is_a_jtile_error():
    # /proc refuses new files even to root, so this holds whoever runs the tests.
    with pytest.raises(jtile.OnnxError, match=r"cannot write /proc/jtile\.onnx: "):
        jtile.onnx.export(jnp.sin, jnp.ones(3), path="/proc/jtile.onnx")


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_exported_files_get_the_users_umask(tmp_path, umask):
    out = tmp_path / "sin.onnx"
    previous = os.umask(umask)
    try:
        jtile.onnx.export(jnp.sin, jnp.ones(3), path=out)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["sin.onnx"]
    session = _session(out)
    (x,) = session.get_inputs()
    assert np.allclose(session.run(None, {x.name: np.ones(3, np.float32)})[0], np.sin(1.0))
