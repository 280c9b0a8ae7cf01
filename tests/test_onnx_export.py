import os

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from jax import lax

import jtile
import jtile.onnx
from jtile import fusion
from jtile.gemm import split_gemm

LIGHT = os.path.join(onnx.__path__[0], "backend", "test", "data", "light")


def _run(model: onnx.ModelProto, *inputs) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(x) for i, x in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)


def _random_params(params, seed: int = 0):
    """The light models hold only some biases as params (their weights are constant
    0.02); positive biases keep the ReLUs from zeroing everything."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.uniform(0.0, 0.2, p.shape), p.dtype), params)


def _cut_model(name: str, tensor: str):
    """A light zoo model whose output is `tensor`. Their weights are all 0.02, so
    activations grow ~10x a layer; cut early enough, values stay where float32
    results of XLA and onnxruntime can be compared."""
    proto = onnx.shape_inference.infer_shapes(onnx.load(os.path.join(LIGHT, f"{name}.onnx")))
    info = next(v for v in [*proto.graph.value_info, *proto.graph.output] if v.name == tensor)
    last = next(i for i, n in enumerate(proto.graph.node) if tensor in n.output)
    for node in list(proto.graph.node)[last + 1:]:
        proto.graph.node.remove(node)
    del proto.graph.output[:]
    proto.graph.output.append(info)
    return jtile.onnx.load(proto)


def _normal(*shape, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


@pytest.fixture
def cnn():
    params = dict(
        conv=_normal(8, 3, 3, 3, scale=0.3, seed=1),
        conv_b=_normal(8, scale=0.1, seed=2),
        hwio=_normal(3, 3, 8, 8, scale=0.2, seed=3),
        fc=_normal(10, 8 * 4 * 4 + 8, scale=0.1, seed=4),
        fc_b=_normal(10, seed=5),
    )

    def model(p, x):
        with jax.named_scope("conv1"):
            y = lax.conv_general_dilated(x, p["conv"], (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
            y = jax.nn.leaky_relu(y + p["conv_b"].reshape(1, -1, 1, 1), 0.125)
        with jax.named_scope("conv2_nhwc"):
            z = jnp.transpose(y, (0, 2, 3, 1))
            z = lax.conv_general_dilated(z, p["hwio"], (2, 2), ((1, 0), (0, 1)), rhs_dilation=(1, 1),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            z = jnp.transpose(jnp.tanh(z), (0, 3, 1, 2))
        with jax.named_scope("pool"):
            m = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
            a = lax.reduce_window(jnp.pad(m, ((0, 0), (0, 0), (1, 1), (1, 1))), 0.0, lax.add,
                                  (1, 1, 3, 3), (1, 1, 1, 1), "VALID") / 9.0
            a = a + z
            g = jnp.max(a, axis=(2, 3)) + jnp.mean(a, axis=(2, 3))
        with jax.named_scope("head"):
            h = jnp.concatenate([a.reshape(a.shape[0], -1), g], axis=1)
            h = jax.nn.gelu(h, approximate=False) + jax.nn.sigmoid(h) * lax.rsqrt(h * h + 1.0)
            h = jnp.where(h > 0.1, h ** 3, -jnp.sqrt(jnp.abs(h)))
            logits = h @ p["fc"].T + p["fc_b"]
            probs = jax.nn.softmax(logits[:, 1:9], axis=-1)
            return probs, jnp.argmax(logits, axis=-1), jnp.log(probs + 1.0).astype(jnp.float16)

    return model, params


def test_cnn_round_trip_matches_jax(cnn):
    model, params = cnn
    x = _normal(2, 3, 8, 8)
    exported = jtile.onnx.export(model, x, params=params)
    got = _run(exported, x)
    want = jax.jit(model)(params, x)
    assert [g.shape for g in got] == [w.shape for w in want]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2].dtype == np.float16
    np.testing.assert_allclose(got[2].astype(np.float32), want[2].astype(np.float32), rtol=2e-3, atol=2e-3)
    names = [n.name for n in exported.graph.node]
    assert any(n.startswith("conv1/Conv") for n in names) and any(n.startswith("pool/MaxPool") for n in names)


def test_rewritten_functions_export(cnn):
    model, params = cnn
    x = _normal(2, 3, 8, 8)
    want = jax.jit(model)(params, x)
    rewritten = split_gemm(fusion.fuse(model), max_m=2, max_k=64, max_n=4)
    exported = jtile.onnx.export(rewritten, x, params=params)
    got = _run(exported, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got[1], want[1])
    names = [n.name for n in exported.graph.node]
    tiles = {n.split("/MatMul")[0] for n in names if "/MatMul" in n}
    assert tiles == {f"head/gemm_tile_m0_k{k}_n{n}" for k in range(3) for n in range(3)}
    ops = [n.op_type for n in exported.graph.node]
    assert ops.count("MatMul") == 9 and ops.count("Conv") == 2 and "LeakyRelu" in ops


def test_params_are_initializers_and_args_are_inputs(cnn, tmp_path):
    model, params = cnn
    x = _normal(1, 3, 8, 8)
    path = tmp_path / "cnn.onnx"
    exported = jtile.onnx.export(model, x, params=params, path=path)
    assert [i.name for i in exported.graph.input] == ["input.0"]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    np.testing.assert_array_equal(inits["params.fc"], params["fc"])
    assert onnx.load(path) == exported
    as_inputs = jtile.onnx.export(model, params, x)
    assert [i.name for i in as_inputs.graph.input] == [
        "input.0.conv", "input.0.conv_b", "input.0.fc", "input.0.fc_b", "input.0.hwio", "input.1"
    ]
    leaves = [params[k] for k in ("conv", "conv_b", "fc", "fc_b", "hwio")]
    np.testing.assert_allclose(_run(as_inputs, *leaves, x)[0], _run(exported, x)[0], rtol=1e-4, atol=1e-6)


def test_unsupported_primitive_names_it_and_its_layer(tmp_path):
    def model(x):
        with jax.named_scope("block3"):
            return lax.cumsum(x, axis=0) * 2.0

    path = tmp_path / "never.onnx"
    with pytest.raises(jtile.OnnxError, match=r"primitive 'cumsum' in layer 'block3' has no ONNX mapping"):
        jtile.onnx.export(model, jnp.ones((4,)), path=path)
    assert not path.exists() and not list(tmp_path.iterdir())
    with pytest.raises(jtile.OnnxError, match="primitive 'while' in layer '<top level>'"):
        jtile.onnx.export(lambda x: lax.while_loop(lambda c: c.sum() < 9.0, lambda c: c * 2.0, x), jnp.ones((2,)))


def test_nested_jit_is_inlined_and_constants_fold():
    inner = jax.jit(lambda x: x * jnp.arange(4.0) + jnp.ones((4,)))
    fn = jax.jit(lambda x: inner(inner(x)))
    x = _normal(3, 4)
    exported = jtile.onnx.export(fn, x)
    assert sorted(n.op_type for n in exported.graph.node) == ["Add", "Add", "Identity", "Mul", "Mul"]
    np.testing.assert_allclose(_run(exported, x)[0], fn(x), rtol=1e-6)


def test_imported_squeezenet_fused_round_trip():
    model = _cut_model("light_squeezenet", "r39")
    params = _random_params(model.params)
    x = _normal(*model.input_shapes[0])
    fused = fusion.fuse(model.fn)
    exported = jtile.onnx.export(fused, x, params=params)
    ops = [n.op_type for n in exported.graph.node]
    assert ops.count("Conv") == 16 and ops.count("Relu") == 16 and "Add" not in ops
    got = _run(exported, x)[0]
    want = jax.jit(model.fn)(params, x)
    assert np.abs(want).min() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


@pytest.mark.slow
def test_imported_alexnet_split_and_fused_round_trip():
    model = _cut_model("light_bvlc_alexnet", "r24")  # the logits, before the softmax
    params = _random_params(model.params)
    x = _normal(*model.input_shapes[0])
    rewritten = split_gemm(fusion.fuse(model.fn), max_m=64, max_k=4096, max_n=1024)
    exported = jtile.onnx.export(rewritten, x, params=params)
    assert [n.op_type for n in exported.graph.node].count("MatMul") == 12 + 4 + 1
    want = jax.jit(model.fn)(params, x)
    assert np.abs(want).min() > 1.0
    np.testing.assert_allclose(_run(exported, x)[0], want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


def test_fused_resnet18_with_residuals_round_trips_through_onnxruntime():
    """`fold_params` fuses every shortcut into its conv; the export is plain Conv, Add, Relu."""
    from jtile import models

    fn, params = models.as_function(models.get("resnet18", jax.random.key(0)))
    x = np.asarray(jax.random.normal(jax.random.key(1), (1, 3, 64, 64)))
    folded = fusion.fold_params(fn, params)
    fused = [e for e in jax.make_jaxpr(folded)(x).jaxpr.eqns if e.primitive.name == "conv_bias_act"]
    assert sum(len(e.invars) == 4 for e in fused) == 8  # the eight basic blocks' shortcuts
    exported = jtile.onnx.export(folded, x)
    (got,) = _run(exported, x)
    want = np.asarray(jax.jit(fn)(params, x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(want))))
    ops = [n.op_type for n in exported.graph.node]
    assert ops.count("Conv") == 20 and ops.count("Add") == 8 + 1  # shortcuts, classifier bias


@pytest.mark.parametrize("mode,coords,sizes", [
    ("linear", "half_pixel", [1, 2, 10, 14]), ("nearest", "asymmetric", [1, 2, 3, 9]),
    ("cubic", "align_corners", [1, 2, 7, 7]), ("linear", "pytorch_half_pixel", [1, 2, 1, 12]),
])
def test_resize_exports_as_one_resize_node(mode, coords, sizes):
    node = onnx.helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="up", mode=mode,
                                 coordinate_transformation_mode=coords)
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 5, 7])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, sizes)],
        [onnx.numpy_helper.from_array(np.asarray(sizes, np.int64), "sizes")])
    source = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=9)
    x = _normal(1, 2, 5, 7, seed=7)
    model = jtile.onnx.load(source)
    exported = jtile.onnx.export(model.fn, x, params=model.params)
    ops = [n.op_type for n in exported.graph.node]
    assert ops.count("Resize") == 1 and "Gather" not in ops
    np.testing.assert_allclose(_run(exported, x)[0], _run(source, x)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model(x)), _run(source, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_fused_cli_export_folds_batch_norm_into_the_convs(tmp_path, capsys, name):
    from jtile.cli import main

    small = ["--size", "32"]
    plain, fused = tmp_path / "plain.onnx", tmp_path / "fused.onnx"
    assert main(["export", name, *small, "-o", str(plain)]) == 0
    assert main(["export", name, *small, "--fuse", "-o", str(fused)]) == 0
    capsys.readouterr()
    plain_model, fused_model = onnx.load(plain), onnx.load(fused)
    ops = [n.op_type for n in fused_model.graph.node]
    assert len(ops) <= len(plain_model.graph.node)
    assert not {"Sqrt", "Reciprocal", "Sub", "BatchNormalization"} & set(ops)  # no batch-norm arithmetic left
    assert ops.count("Conv") == [n.op_type for n in plain_model.graph.node].count("Conv")
    x = _normal(1, 3, 32, 32, seed=3)
    np.testing.assert_allclose(_run(fused_model, x)[0], _run(plain_model, x)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "activation, op_types",
    [
        (("sigmoid",), {"Sigmoid"}),
        (("silu",), {"Sigmoid", "Mul"}),
        (("hard_sigmoid", 0.2, 0.5), {"HardSigmoid"}),
        (("hard_swish", float(np.float32(1 / 6)), 0.5), {"HardSwish"}),
        (("hard_swish", 0.25, 0.375), {"HardSigmoid", "Mul"}),
        (("gelu",), {"Erf"}),
        (("gelu_tanh",), {"Tanh"}),
    ],
)
def test_fused_activations_export_and_run_in_onnxruntime(activation, op_types):
    """A conv and a dense op with each fused activation: written as ONNX
    activation nodes, ORT computes what the fused ops compute in jax."""
    from jtile import _fused

    x, w, b = _normal(2, 3, 7, 7), _normal(5, 3, 3, 3, scale=1.5, seed=1), _normal(5, scale=2.0, seed=2)
    fc, fc_b = _normal(5 * 49, 4, scale=0.2, seed=3), _normal(4, seed=4)
    conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))  # noqa: E731
    conv_params = {k: v for k, v in jax.make_jaxpr(conv)(x, w).eqns[0].params.items() if k != "out_sharding"}

    def model(x):
        y = _fused.conv_bias_act(x, w, b.reshape(1, -1, 1, 1), activation=activation, **conv_params)
        return _fused.dense(y.reshape(2, -1), fc, fc_b.reshape(1, -1), activation=activation,
                            dimension_numbers=(((1,), (0,)), ((), ())))

    exported = jtile.onnx.export(model, x)
    assert op_types <= {n.op_type for n in exported.graph.node}
    (got,) = _run(exported, x)
    np.testing.assert_allclose(got, jax.jit(model)(x), rtol=1e-5, atol=1e-5)


def test_fused_swish_models_round_trip_through_onnxruntime():
    """`fuse` turns x * sigmoid(x) and ONNX HardSwish into fused ops; the export
    writes them back as Sigmoid + Mul and HardSwish, and ORT agrees."""
    x, w1, w2 = _normal(1, 3, 9, 9), _normal(6, 3, 3, 3, seed=1), _normal(4, 6, 1, 1, seed=2)
    conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))  # noqa: E731

    def model(x):
        y = jax.nn.silu(conv(x, w1))
        z = conv(y, w2)
        return z * jnp.clip(z * np.float32(1 / 6) + np.float32(0.5), 0, 1)

    fused = fusion.fuse(model)
    exported = jtile.onnx.export(fused, x)
    ops = [n.op_type for n in exported.graph.node]
    assert ops.count("Conv") == 2 and "HardSwish" in ops and "Sigmoid" in ops
    (got,) = _run(exported, x)
    np.testing.assert_allclose(got, jax.jit(model)(x), rtol=1e-5, atol=1e-5)
