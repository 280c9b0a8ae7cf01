"""Channel planes gathered by a kernel: `kernels.gather_planes` against
`np.take`, and `swap_backend` on ShuffleNetV2 units (a split, a branch of
convs, a concatenation, a channel shuffle) against plain XLA. How a value is
found to be planes of another: tests/test_views.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from jtile import kernels
from jtile._errors import ConfigError, UnsupportedError
from jtile._interpreter import iter_eqns
from jtile.algorithms import swap_backend


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.lists(st.integers(1, 9), max_size=2), st.data())
def test_gather_planes_matches_take(images, channels, rest, data):
    planes = data.draw(st.lists(st.integers(0, channels - 1), min_size=1, max_size=50))
    x = np.random.default_rng(channels).standard_normal((images, channels, *rest)).astype(np.float32)
    got = jax.jit(lambda x: kernels.gather_planes(x, planes))(x)
    np.testing.assert_array_equal(np.asarray(got), np.take(x, planes, axis=1))


@pytest.mark.parametrize("shape", [(1, 116, 28, 28), (1, 464, 7, 7), (2, 3, 224, 224)])
def test_gather_planes_copies_planes_of_any_size(shape):
    """Planes of many tasks each (224x224) and many planes per task (7x7)."""
    planes = np.random.default_rng(0).permutation(shape[1])[: max(1, shape[1] // 2)]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(kernels.gather_planes(x, planes)), x[:, planes])


def test_gather_planes_gradient_and_vmap():
    planes = [3, 0, 3, 2]
    x = jax.random.normal(jax.random.key(0), (2, 5, 4, 3))
    weights = jax.random.normal(jax.random.key(1), (2, 4, 4, 3))
    grad = jax.grad(lambda x: jnp.sum(kernels.gather_planes(x, planes) * weights))(x)
    want = jax.grad(lambda x: jnp.sum(x[:, np.array(planes)] * weights))(x)
    np.testing.assert_allclose(grad, want, rtol=1e-6)
    batched = jax.vmap(lambda x: kernels.gather_planes(x, planes))(jnp.stack([x, 2 * x]))
    np.testing.assert_array_equal(batched, jnp.stack([x, 2 * x])[:, :, np.array(planes)])


def test_gather_planes_of_no_planes_is_empty():
    assert kernels.gather_planes(jnp.ones((2, 3, 4)), []).shape == (2, 0, 4)


@pytest.mark.parametrize("planes", [[0, 5], [-1], [[0, 1]], [0.5]])
def test_gather_planes_rejects_planes_outside_x(planes):
    with pytest.raises(ConfigError, match="channel indices in \\[0, C\\)"):
        kernels.gather_planes(jnp.ones((1, 5, 2, 2)), planes)


def test_gather_planes_rejects_other_dtypes():
    with pytest.raises(UnsupportedError, match="float32 only"):
        kernels.gather_planes(jnp.ones((1, 5, 2, 2), jnp.int32), [0])


def _shuffle(y, groups=2):
    n, c, h, w = y.shape
    return y.reshape(n, groups, c // groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)


def _conv(x, w, groups=1):
    pad = w.shape[-1] // 2
    return lax.conv_general_dilated(x, w, (1, 1), ((pad, pad), (pad, pad)), feature_group_count=groups,
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _units(params, x, split):
    """ShuffleNetV2's stride-1 units: half the channels pass, half go through
    a 1x1 conv, a depthwise 3x3 and a 1x1 conv; the halves are concatenated
    and shuffled."""
    for w1, wd, w2 in params:
        half = x.shape[1] // 2
        passed, branch = jnp.split(x, 2, axis=1) if split else (x[:, :half], x[:, half:])
        branch = jax.nn.relu(_conv(jax.nn.relu(_conv(_conv(branch, w1), wd, groups=half)), w2))
        x = _shuffle(jnp.concatenate([passed, branch], axis=1))
    return _conv(x, params[0][0].repeat(2, axis=1))  # a 1x1 conv reading the last shuffle whole


@pytest.mark.parametrize("split", [False, True])
def test_shuffle_units_read_their_planes_through_the_kernel(getkey, tree_allclose, split):
    """Every branch reads its half of the shuffled channels, and the last conv
    the whole shuffle, as a `gather_planes` call (3 + 1); the output matches XLA's."""
    half = 16
    shapes = ((half, half, 1, 1), (half, 1, 3, 3), (half, half, 1, 1))
    params = [tuple(0.3 * jax.random.normal(getkey(), shape) for shape in shapes) for _ in range(3)]
    x = jax.random.normal(getkey(), (1, 2 * half, 12, 12))
    swapped = swap_backend(lambda x: _units(params, x, split), algorithms="auto")
    calls = [e.params["target_name"] for e in iter_eqns(jax.make_jaxpr(swapped)(x).jaxpr)
             if e.primitive.name == "ffi_call"]
    assert calls.count("jtile_gather_planes") == 4
    assert tree_allclose(jax.jit(swapped)(x), jax.jit(lambda x: _units(params, x, split))(x), rtol=2e-4, atol=2e-4)


def test_convs_on_xla_read_no_gathers(getkey):
    """With the convs left to XLA nothing reads a gather through a kernel: no call."""
    params = [(jnp.ones((4, 4, 1, 1)), jnp.ones((4, 1, 3, 3)), jnp.ones((4, 4, 1, 1)))] * 2
    swapped = swap_backend(lambda x: _units(params, x, False), algorithms="default")
    assert "ffi_call" not in str(jax.make_jaxpr(swapped)(jnp.ones((1, 8, 6, 6))))
