"""The depthwise conv of a 1x1 expansion in one call
(`kernels.expanded_depthwise_conv2d`), against the two layers in `lax`.

The call computes the expansion band by band inside the depthwise kernel;
it must compute what the two reference convs compute (rtol = atol = 1e-4 as
in test_kernels.py), its zero padding that of the expansion's output, NaN
and Inf where the reference has them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jtile
from jtile import kernels

TOL = dict(rtol=1e-4, atol=1e-4)
HARD = dict(alpha=1 / 6, beta=0.5)  # hard_sigmoid / hard_swish slope and offset


def _normal(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _reference(x, we, be, wd, bd, *, stride, padding, dilation=(1, 1), activation, expand_activation):
    e = kernels.conv2d_reference(x, we, be, activation=expand_activation, **HARD)
    return kernels.conv2d_reference(e, wd, bd, stride=stride, padding=padding, dilation=dilation,
                                    groups=wd.shape[0], activation=activation, **HARD)


def _call(x, we, be, wd, bd, *, activation, expand_activation, **geometry):
    return kernels.expanded_depthwise_conv2d(
        x, we, be, wd, bd, **geometry, activation=activation, expand_activation=expand_activation,
        expand_alpha=HARD["alpha"], expand_beta=HARD["beta"], **HARD)


@pytest.mark.parametrize("n, c, channels, size, window, stride, padding, dilation, acts, y_layout", [
    (1, 16, 96, 30, 3, 2, ((1, 1), (1, 1)), 1, ("relu6", "relu6"), "NCHW"),  # MobileNetV2's stride-2 block
    (1, 24, 144, 28, 3, 1, ((1, 1), (1, 1)), 1, ("relu6", "relu6"), "NCHWc"),  # stride 1, blocked out
    (2, 8, 40, 17, 5, 1, ((2, 2), (2, 2)), 1, ("silu", "silu"), "NCHW"),  # EfficientNet's 5x5, batch 2, 2.5 blocks
    (1, 16, 72, 13, 5, 2, ((2, 2), (2, 2)), 1, ("hard_swish", "relu"), "NCHWc"),  # MobileNetV3, a partial block
    (1, 58, 58, 21, 3, 2, ((1, 1), (1, 1)), 1, (None, "relu"), "NCHW"),  # ShuffleNetV2: no expansion of width
    (1, 5, 20, 11, 3, 1, ((0, 2), (1, 0)), 2, ("relu", None), "NCHW"),  # asymmetric padding, dilation 2
    (1, 3, 16, 40, 7, 1, ((3, 3), (3, 3)), 1, ("gelu", "sigmoid"), "NCHW"),  # 7x7; rows of 40: 16 + 16 + 4 + 4
    (1, 4, 16, 9, 1, 1, ((0, 0), (0, 0)), 1, ("clip", "clip"), "NCHW"),  # a 1x1 "depthwise" conv
])
def test_expanded_depthwise_computes_both_layers(n, c, channels, size, window, stride, padding, dilation, acts,
                                                 y_layout):
    rng = np.random.default_rng(0)
    x, we, be = _normal(rng, (n, c, size, size)), _normal(rng, (channels, c, 1, 1), 0.3), _normal(rng, channels)
    wd, bd = _normal(rng, (channels, 1, window, window), 0.3), _normal(rng, channels)
    geometry = dict(stride=(stride, stride), padding=padding, dilation=(dilation, dilation))
    activation, expand_activation = acts
    got = jax.jit(lambda x: _call(x, we, be, wd, bd, activation=activation, expand_activation=expand_activation,
                                  **geometry, y_layout=y_layout))(x)
    want = _reference(x, we, be, wd, bd, **geometry, activation=activation, expand_activation=expand_activation)
    if y_layout == "NCHWc":
        assert got.shape == kernels.nchwc_shape(want.shape)
        got = kernels.from_nchwc(got, channels)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@given(st.data())
@settings(max_examples=25, deadline=None)
def test_expanded_depthwise_matches_lax_on_any_geometry(data):
    lanes = kernels.vector_lanes()
    c, channels = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 3 * lanes))
    k, stride, dilation = data.draw(st.sampled_from([1, 3, 5])), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    padding = tuple((data.draw(st.integers(0, k - 1)), data.draw(st.integers(0, k - 1))) for _ in range(2))
    span = dilation * (k - 1) + 1
    h, w = data.draw(st.integers(span, 20)), data.draw(st.integers(span, 20))
    n = data.draw(st.integers(1, 2))
    acts = data.draw(st.sampled_from([(None, None), ("relu6", "relu6"), ("hard_swish", "silu"), ("relu", "sigmoid")]))
    y_layout = data.draw(st.sampled_from(["NCHW", "NCHWc"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    x, we, be = _normal(rng, (n, c, h, w)), _normal(rng, (channels, c, 1, 1), 0.5), _normal(rng, channels)
    wd, bd = _normal(rng, (channels, 1, k, k), 0.5), _normal(rng, channels)
    geometry = dict(stride=(stride, stride), padding=padding, dilation=(dilation, dilation))
    got = _call(x, we, be, wd, bd, activation=acts[0], expand_activation=acts[1], **geometry, y_layout=y_layout)
    if y_layout == "NCHWc":
        got = kernels.from_nchwc(got, channels)
    want = _reference(x, we, be, wd, bd, **geometry, activation=acts[0], expand_activation=acts[1])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_expanded_depthwise_propagates_nan_and_inf_as_lax():
    rng = np.random.default_rng(1)
    x, we, be = _normal(rng, (1, 8, 12, 12)), _normal(rng, (32, 8, 1, 1)), _normal(rng, 32)
    wd, bd = _normal(rng, (32, 1, 3, 3)), _normal(rng, 32)
    x[0, 2, 5, 5], x[0, 7, 0, 11] = np.nan, np.inf
    geometry = dict(stride=(1, 1), padding=((1, 1), (1, 1)))
    got = np.asarray(_call(x, we, be, wd, bd, activation=None, expand_activation=None, **geometry))
    want = np.asarray(_reference(x, we, be, wd, bd, **geometry, activation=None, expand_activation=None))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).any()
    np.testing.assert_allclose(got, want, **TOL)


def test_gradients_of_the_expanded_depthwise_are_the_references():
    rng = np.random.default_rng(2)
    x, we, be = _normal(rng, (1, 8, 10, 10)), _normal(rng, (32, 8, 1, 1), 0.3), _normal(rng, 32)
    wd, bd = _normal(rng, (32, 1, 3, 3), 0.3), _normal(rng, 32)
    geometry = dict(stride=(2, 2), padding=((1, 1), (1, 1)))

    def loss(call):
        return lambda *a: jnp.sum(call(*a, activation="relu6", expand_activation="relu6", **geometry) ** 2)

    got = jax.grad(loss(_call), argnums=(0, 1, 2, 3, 4))(x, we, be, wd, bd)
    want = jax.grad(loss(_reference), argnums=(0, 1, 2, 3, 4))(x, we, be, wd, bd)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("x_shape, we_shape, wd_shape, bias, message", [
    ((1, 8, 9, 9), (32, 8, 3, 3), (32, 1, 3, 3), None, r"must be a 1x1 conv of x \(1, 8, 9, 9\)"),
    ((1, 8, 9, 9), (32, 4, 1, 1), (32, 1, 3, 3), None, "must be a 1x1 conv of x"),
    ((1, 8, 9, 9), (32, 8, 1, 1), (64, 1, 3, 3), None, "maps 32 to 64"),
    ((1, 8, 9, 9), (32, 8, 1, 1), (32, 2, 3, 3), None, "do not match groups=32"),
    ((1, 8, 2, 2), (32, 8, 1, 1), (32, 1, 3, 3), None, "is empty"),
    ((1, 8, 9, 9), (32, 8, 1, 1), (32, 1, 3, 3), 16, r"b must have shape \(32,\)"),
])
def test_pairs_the_kernel_cannot_run_are_refused(x_shape, we_shape, wd_shape, bias, message):
    zeros = lambda shape: np.zeros(shape, np.float32)  # noqa: E731
    with pytest.raises((jtile.UnsupportedError, jtile.ConfigError), match=message):
        kernels.expanded_depthwise_conv2d(zeros(x_shape), zeros(we_shape), None, zeros(wd_shape),
                                          None if bias is None else zeros(bias))
