import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jtile
from jtile.fusion import fold_params


def _net(params, x):
    y = lax.conv_general_dilated(x, params["w"], (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    y = jax.nn.relu(y * params["scale"][None, :, None, None])
    return y.mean(axis=(2, 3)) @ params["fc"]


@pytest.fixture
def params(getkey):
    return {
        "w": jax.random.normal(getkey(), (16, 3, 3, 3)),
        "scale": jax.random.uniform(getkey(), (16,)) + 0.5,
        "fc": jax.random.normal(getkey(), (16, 10)),
    }


def test_matches_jax_jit_on_every_shape(params, getkey, tree_allclose):
    compiled = jtile.jit(fold_params(_net, params))
    for batch in (3, 1, 2):
        x = jax.random.normal(getkey(), (batch, 3, 9, 7))
        assert tree_allclose(compiled(x), jax.jit(_net)(params, x))


def _argument_bytes(compile, fn, x) -> int:
    return compile(fn).lower(x).compile().memory_analysis().argument_size_in_bytes


def test_kernel_weights_are_executable_arguments(params, getkey):
    swapped = jtile.swap_backend(fold_params(_net, params), algorithms="auto")
    x = jax.random.normal(getkey(), (2, 3, 8, 8))
    weight_bytes = params["w"].nbytes + params["fc"].nbytes
    assert _argument_bytes(jtile.jit, swapped, x) >= x.nbytes + weight_bytes


def test_weights_xla_lays_out_stay_embedded(params, getkey):
    folded = fold_params(_net, params)
    x = jax.random.normal(getkey(), (2, 3, 8, 8))
    assert _argument_bytes(jtile.jit, folded, x) == x.nbytes
    mask, shift = jax.random.uniform(getkey(), (3, 8, 8)), jax.random.uniform(getkey(), (3, 8, 8))
    assert mask.nbytes + shift.nbytes > 1024 >= mask.nbytes
    both = {**params, "mask": mask, "shift": shift}
    masked = fold_params(lambda p, x: _net(p, x * p["mask"] + jnp.stack([p["shift"]] * 2)), both)
    assert _argument_bytes(jtile.jit, masked, x) == x.nbytes + 2 * shift.nbytes


def test_shapes_share_one_copy_of_each_weight(params, getkey):
    compiled = jtile.jit(jtile.swap_backend(fold_params(_net, params), algorithms="auto"))

    def weights(batch):
        x = jax.random.normal(getkey(), (batch, 3, 8, 8))
        return {id(c): c for c in jax.make_jaxpr(compiled)(x).consts if c.nbytes >= 1024}

    one, two = weights(1), weights(2)
    assert len(one) >= 1 and one.keys() == two.keys()


def test_static_arguments_and_kwargs(getkey, tree_allclose):
    @jtile.jit
    def f(x, *, power, scale=1.0):
        return scale * x**power

    x = jax.random.normal(getkey(), (4,))
    assert tree_allclose(f(x, power=3), x**3)
    assert tree_allclose(f(x, power=2, scale=jnp.float32(2.0)), 2 * x**2)
    with pytest.raises(jtile.ConfigError, match="unhashable"):
        f(x, power={2})


def test_grad_and_vmap_through_it(params, getkey, tree_allclose):
    compiled = jtile.jit(_net)
    x = jax.random.normal(getkey(), (2, 3, 6, 6))
    grads = jax.grad(lambda p: compiled(p, x).sum())(params)
    assert tree_allclose(grads, jax.grad(lambda p: _net(p, x).sum())(params), rtol=1e-4, atol=1e-5)
    xs = jax.random.normal(getkey(), (3, 2, 3, 6, 6))
    assert tree_allclose(jax.vmap(lambda x: compiled(params, x))(xs), jax.vmap(lambda x: _net(params, x))(xs))


def test_bad_input():
    with pytest.raises(jtile.ConfigError, match="expected a function"):
        jtile.jit(3)
    with pytest.raises(jtile.ConfigError, match="donate_argnums"):
        jtile.jit(_net, donate_argnums=0)


def test_outputs_keep_their_tree(getkey):
    out = jtile.jit(lambda x: {"a": x, "b": (x + 1, x * 2)})(jnp.ones(3))
    assert set(out) == {"a", "b"} and np.allclose(out["b"][1], 2.0)


def test_summary_sees_through_it(params, getkey):
    folded = jtile.swap_backend(fold_params(_net, params), algorithms="auto")
    x = jax.random.normal(getkey(), (2, 3, 8, 8))
    plain, compiled = (jtile.summary(f, x).to_dict() for f in (folded, jtile.jit(folded)))
    assert compiled["total_params"] == plain["total_params"] > 0
    assert compiled["macs"] == plain["macs"]


def test_host_constants_are_copied_to_the_device_once(getkey, tree_allclose):
    mask = np.asarray(jax.random.uniform(getkey(), (32, 32)))
    compiled = jtile.jit(lambda x: jnp.tanh(x * mask))
    xs = [jax.random.normal(getkey(), (batch, 32, 32)) for batch in (1, 2)]
    for x in xs:
        compiled(x)
    with jax.transfer_guard_host_to_device("disallow"):
        outs = [compiled(x) for x in xs]
    assert all(tree_allclose(out, jnp.tanh(x * mask)) for out, x in zip(outs, xs))
