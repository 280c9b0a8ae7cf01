import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jtile
from jtile._interpreter import eval_jaxpr, is_known, iter_eqns, make_jaxpr, rewrite, scan_layout, to_device, transform

SIN_TO_COS = {"sin": lambda eqn, x: jnp.cos(x)}


def _nested(x):
    y = jax.jit(jnp.sin)(x)
    y = jax.checkpoint(jnp.sin)(y)
    y = lax.cond(x.sum() > 0, jnp.sin, jnp.exp, y)
    y, _ = lax.scan(lambda c, a: (jnp.sin(c) + a, None), y, jnp.ones((2,) + x.shape))
    return lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.sin(c[0]), c[1] + 1), (y, 0))[0]


def _nested_reference(x):
    y = jnp.cos(jnp.cos(x))
    y = jnp.cos(y) if x.sum() > 0 else jnp.exp(y)
    for _ in range(2):
        y = jnp.cos(y) + 1
    return jnp.cos(jnp.cos(y))


def test_rules_reach_every_nested_jaxpr():
    x = jnp.linspace(-1.0, 1.0, 6)
    f = transform(_nested, "test", lambda closed: SIN_TO_COS)
    np.testing.assert_allclose(jax.jit(f)(x), _nested_reference(x), rtol=1e-6)
    np.testing.assert_allclose(f(-x), _nested_reference(-x), rtol=1e-6)


def _scan_with_consts(x, w, xs):
    def step(carry, a):
        h, n = carry
        return (jnp.sin(h * w) + a, n + 1), jnp.sin(h).sum() * x[0]

    return lax.scan(step, (x, 0), xs)


def test_scan_with_consts_carries_and_outputs_is_interpreted():
    # jax 0.10 lays scan's inputs out with num_consts / num_carry, jax 0.11+ with
    # a flat tree ft_in: scan_layout reads both (CI runs the other jax too).
    x, w, xs = jnp.linspace(-1.0, 1.0, 3), jnp.float32(0.5), jnp.ones((4, 3))
    (eqn,) = [e for e in iter_eqns(make_jaxpr(_scan_with_consts, x, w, xs).jaxpr) if e.primitive.name == "scan"]
    consts, carries = scan_layout(eqn.params)
    assert carries == 2 and len(eqn.invars) == consts + carries + 1
    f = transform(_scan_with_consts, "test", lambda closed: SIN_TO_COS)
    (h, n), ys = jax.jit(f)(x, w, xs)
    h_ref, ys_ref = x, []
    for a in xs:
        ys_ref.append(jnp.cos(h_ref).sum() * x[0])
        h_ref = jnp.cos(h_ref * w) + a
    np.testing.assert_allclose(h, h_ref, rtol=1e-6)
    np.testing.assert_allclose(ys, jnp.stack(ys_ref), rtol=1e-6)
    assert n == 4


def test_primitive_without_rule_is_rebound_unchanged():
    x = jnp.arange(5.0)
    f = transform(lambda x: jnp.tanh(x) * 2 + 1, "test", lambda closed: {})
    assert np.array_equal(f(x), jnp.tanh(x) * 2 + 1)


def test_custom_jvp_is_inlined_and_grad_works():
    f = transform(lambda x: jnp.sum(jax.nn.relu(jnp.sin(x))), "test", lambda closed: SIN_TO_COS)
    x = jnp.array([0.3, 2.0, 4.0])
    np.testing.assert_allclose(jax.grad(f)(x), -jnp.sin(x) * (jnp.cos(x) > 0), rtol=1e-6)


def test_rewrite_returns_rewritten_jaxpr():
    closed = make_jaxpr(_nested, jnp.ones(3))
    new = rewrite(closed, SIN_TO_COS)
    names = {e.primitive.name for e in iter_eqns(new.jaxpr)}
    assert "sin" not in names and "cos" in names
    out = eval_jaxpr(new.jaxpr, new.consts, jnp.ones(3), rules={})
    np.testing.assert_allclose(out[0], _nested_reference(jnp.ones(3)), rtol=1e-6)


def test_trace_is_cached_per_shape_dtype_and_static_leaves():
    f = transform(lambda x, n: x * n, "test", lambda closed: {})
    f(jnp.ones(3), 2)
    f(jnp.zeros(3), 2)
    f(jnp.ones(3), 3)
    f(jnp.ones(4), 2)
    f(jnp.ones(3, jnp.int32), 2)
    assert len(f.__jtile_cache__) == 4


def test_named_scopes_survive_the_interpreter():
    def f(x):
        with jax.named_scope("block"):
            return jnp.sin(x)

    jaxpr = jax.make_jaxpr(transform(f, "test", lambda closed: {}))(jnp.ones(2))
    assert str(jaxpr.jaxpr.eqns[0].source_info.name_stack) == "block"


def test_non_callable_is_rejected():
    with pytest.raises(jtile.ConfigError, match="expected a function"):
        transform(3, "test", lambda closed: {})


def test_to_device_stays_known_under_jit():
    """A weight or bias rearranged in numpy at trace time is a known array, even
    inside `jit` (a bare `device_put` there is traced, and the kernels would
    treat the value as unknown)."""
    seen = []

    @jax.jit
    def f(x):
        w = to_device(np.arange(3, dtype=np.float32))
        seen.append(is_known(w))
        return x + w

    np.testing.assert_array_equal(f(np.ones(3, np.float32)), [1, 2, 3])
    assert seen == [True]
