"""Running a schedule node by node (threads over parallel groups) and as a reordered function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtile
from jtile import ConfigError, models
from jtile.schedule import seed_lstm, seed_lstm_params


def lstm_args(key):
    keys = jax.random.split(key, 2)
    return (seed_lstm_params(keys[0]), jax.random.normal(keys[1], (5, 1, 4)), jnp.zeros((1, 8)), jnp.zeros((1, 8)))


@pytest.fixture(scope="module")
def tutorial():
    model = models.get("tutorial", jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, 66, 66))
    return model, x


@pytest.mark.parametrize("policy", ["program", "asap", "alap", "memory", "critical"])
def test_run_returns_what_the_function_returns_exactly(policy):
    args = lstm_args(jax.random.key(0))
    s = jtile.schedule(seed_lstm, *args, policy=policy)
    np.testing.assert_array_equal(np.asarray(s.run(*args)), np.asarray(seed_lstm(*args)))


@pytest.mark.parametrize("workers", [2, 4])
def test_parallel_groups_on_threads_give_identical_results(workers):
    args = lstm_args(jax.random.key(1))
    s = jtile.schedule(seed_lstm, *args, policy="asap")
    assert max(len(g) for g in s.parallel_groups) >= 8
    np.testing.assert_array_equal(np.asarray(s.run(*args, workers=workers)), np.asarray(s.run(*args)))


@pytest.mark.parametrize("granularity", ["layer", "op"])
def test_zoo_model_runs_on_threads(tutorial, granularity, tree_allclose):
    model, x = tutorial
    s = jtile.schedule(model, x, policy="memory", granularity=granularity)
    assert tree_allclose(s.run(x, workers=2), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 4])
def test_googlenet_runs_on_threads(workers, tree_allclose):
    model = models.get("googlenet", jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 3, 64, 64))
    s = jtile.schedule(model, x, policy="memory")
    assert tree_allclose(s.run(x, workers=workers), model(x), rtol=1e-4, atol=1e-4)


def test_apply_jaxpr_follows_the_scheduled_order(tree_allclose):
    args = lstm_args(jax.random.key(2))
    s = jtile.schedule(seed_lstm, *args, policy="memory", granularity="op")
    assert s.order != [n.name for n in s.nodes]  # the memory order differs from program order
    scheduled = s.apply()
    eqns = jax.make_jaxpr(scheduled)(*args).jaxpr.eqns
    # op nodes are named "<scope>/<primitive>_<index>"; the data ops come last, in the scheduled order
    kind = {n.name: n.kind for n in s.nodes}
    data = [n for n in s.order if kind[n] != "input"]
    expected = [n.rsplit("/", 1)[-1].rsplit("_", 1)[0] for n in data]
    assert [e.primitive.name for e in eqns[-len(expected):]] == expected
    assert tree_allclose(jax.jit(scheduled)(*args), seed_lstm(*args), rtol=1e-5, atol=1e-6)


def test_onnx_model_runs(tmp_path, tree_allclose):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
             helper.make_node("Mul", ["r", "s"], ["y"], name="mul")]
    proto = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    om = jtile.onnx.load(str(path))
    data = jnp.asarray(rng.normal(size=(1, 3, 8, 8)).astype(np.float32))
    s = jtile.schedule(om, data)
    assert s.order == ["x", "conv", "relu", "sig", "mul"]
    assert tree_allclose(s.run(data, workers=2), om(data), rtol=1e-5, atol=1e-5)


def test_run_with_other_shapes_raises(tutorial):
    model, x = tutorial
    s = jtile.schedule(model, x)
    with pytest.raises(ConfigError, match=r"args\[0\] has shape \(1, 3, 66, 66\).*traced with \(2, 3, 66, 66\)"):
        s.run(jnp.ones((1, 3, 66, 66)))
    with pytest.raises(ConfigError, match="workers must be a positive int"):
        s.run(x, workers=0)


def test_run_of_a_shape_only_schedule_asks_for_arrays():
    model = jax.eval_shape(lambda: models.get("tutorial"))
    x = jax.ShapeDtypeStruct(models.input_shape("tutorial"), jnp.float32)
    s = jtile.schedule(model, x)
    with pytest.raises(ConfigError, match="built from shapes only"):
        s.run(jnp.ones(x.shape))
