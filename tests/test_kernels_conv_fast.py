"""The winograd and depthwise conv kernels of `jtile.kernels` against `lax`.

Tolerances: depthwise sums the same few terms as the direct definition, so it
is held to rtol = atol = 1e-5. Winograd F(4x4, 3x3) computes in a transformed
domain whose matrices have entries up to 8 (outputs) and 5 (inputs) and whose
weight transform divides by 6 and 24, so float32 rounding grows with the
output's overall magnitude, whatever the size of the element itself (observed:
up to 2e-5 of max|output| at 512 input channels): it is held to
atol = 1e-4 * max|conv output|. NaN and Inf inputs are covered for every
kernel in tests/test_kernels_numerics.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtile import kernels
from jtile._errors import UnsupportedError

ACTIVATIONS = [None, "relu", "relu6", "clip", "leaky_relu", "sigmoid", "silu", "hard_sigmoid", "hard_swish",
               "gelu", "gelu_tanh"]
EPILOGUE = dict(alpha=0.2, beta=0.5, clip=(-0.5, 0.75))
TARGETS = ("jtile_conv_winograd", "jtile_conv_depthwise")


@pytest.fixture(scope="module", autouse=True)
def library_built():
    """Fail (not skip) every test here if the kernels are missing from the library."""
    missing = {t: kernels.kernel_unavailable(t) for t in TARGETS if kernels.kernel_unavailable(t)}
    if missing:
        pytest.fail(f"jtile kernels unavailable: {missing}")


def _normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _assert_close(algorithm, got, x, w, b, *, activation=None, residual=None, **config):
    """Winograd within 1e-4 of the conv output's magnitude, depthwise within 1e-5."""
    want = kernels.conv2d_reference(x, w, b, activation=activation, residual=residual, **config, **EPILOGUE)
    if algorithm == "depthwise":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        scale = float(np.max(np.abs(kernels.conv2d_reference(x, w, b, **config))))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale + 1e-6)


@st.composite
def conv_cases(draw, algorithm):
    """Layers `algorithm` can run: winograd any 3x3 stride-1 conv, depthwise any depthwise conv."""
    depthwise = algorithm == "depthwise"
    sizes = st.integers(1, 7) if depthwise else st.just(3)
    kernel = (draw(sizes), draw(sizes))
    stride = tuple(draw(st.integers(1, 3) if depthwise else st.just(1)) for _ in range(2))
    dilation = tuple(draw(st.integers(1, 2) if depthwise else st.just(1)) for _ in range(2))
    padding = tuple((draw(st.integers(0, 3)), draw(st.integers(0, 3))) for _ in range(2))
    h, w = (
        draw(st.integers(max(1, (k - 1) * d + 1 - sum(pad)), 40 if depthwise else 19))
        for k, d, pad in zip(kernel, dilation, padding)
    )
    channels = draw(st.integers(1, 40 if depthwise else 9))  # depthwise: ragged blocks of 16 or 8 channels
    out_channels = channels * draw(st.integers(1, 3)) if depthwise else draw(st.integers(1, 19))
    groups = channels if depthwise else 1
    return dict(
        x_shape=(draw(st.integers(1, 2)), channels, h, w),
        w_shape=(out_channels, channels // groups, *kernel),
        config=dict(stride=stride, padding=padding, dilation=dilation, groups=groups),
        activation=draw(st.sampled_from(ACTIVATIONS)), bias=draw(st.booleans()),
        residual=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("algorithm", ["winograd", "depthwise"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_conv_fast_matches_reference(algorithm, data):
    case = data.draw(conv_cases(algorithm))
    rng = np.random.default_rng(case["seed"])
    x, w = _normal(rng, case["x_shape"]), _normal(rng, case["w_shape"])
    b = _normal(rng, case["w_shape"][0]) if case["bias"] else None
    kw = dict(**case["config"], activation=case["activation"])
    if case["residual"]:  # fused by winograd, added after the kernel for depthwise
        kw["residual"] = _normal(rng, kernels.conv2d_reference(x, w, **case["config"]).shape)
    got = kernels.conv2d(x, w, b, algorithm=algorithm, **kw, **EPILOGUE)
    _assert_close(algorithm, got, x, w, b, **kw)


@pytest.mark.parametrize(
    "x_shape, out_channels",
    [((2, 16, 60, 50), 20),   # many tile blocks: each task transforms its own block
     ((1, 67, 14, 14), 72),   # one block: tasks own output channels, 64 + 3 input channels
     ((3, 40, 9, 30), 33),    # blocks spanning images and tile rows
     ((1, 70, 56, 56), 32),   # few blocks, so one of all 196 tiles; 4 panels: tasks of 2 panels each
     ((1, 8, 3, 800), 16),    # one block of 200 tiles in one tile row (wider than a block of 48)
     ((1, 20, 28, 28), 40),   # few blocks, 5 panels: groups of 3 and 2
     ((1, 96, 28, 28), 128),  # few blocks, 16 panels: 8 groups of 2, 64 + 32 input channels
     ((1, 0, 5, 6), 4)],      # no input channels: the bias alone
)
def test_winograd_large_layers_match_reference(x_shape, out_channels):
    rng = np.random.default_rng(2)
    x, w = _normal(rng, x_shape), _normal(rng, (out_channels, x_shape[1], 3, 3))
    b = _normal(rng, out_channels)
    config = dict(padding=((1, 1), (2, 0)), activation="relu")
    r = _normal(rng, kernels.conv2d_reference(x, w, padding=config["padding"]).shape)
    run = jax.jit(lambda x, w, b, r: kernels.conv2d(x, w, b, algorithm="winograd", residual=r, **config))
    _assert_close("winograd", run(x, w, b, r), x, w, b, residual=r, **config)


def _with_non_finite(rng, shape):
    x = _normal(rng, shape)
    flat = x.reshape(-1)
    spots = rng.choice(flat.size, size=4, replace=False)
    flat[spots] = [np.nan, np.inf, -np.inf, np.nan]
    return x


# Layers that take each arrangement of the depthwise kernel (kernels/depthwise.cc):
# planes for 3x3 stride 1 with rows of >= 16 outputs and 5x5 with rows of >= 28
# (with AVX-512), channel blocks with the unrolled 3x3 / 5x5 / 7x7 loops at
# stride 1 and 2, or the general loop.
DEPTHWISE_LAYERS = {
    "planes 3x3": ((2, 5, 37, 40), 10, 3, dict(padding=((1, 1), (1, 1)))),
    "planes 3x3 asymmetric padding": ((1, 3, 33, 35), 3, 3, dict(padding=((0, 2), (2, 1)))),
    "planes 3x3 one vector": ((1, 7, 9, 17), 7, 3, dict(padding=((1, 1), (1, 1)))),
    "planes 5x5 multiplier 2": ((2, 6, 20, 30), 12, 5, dict(padding=((2, 1), (3, 2)))),
    "blocks 3x3 s2": ((2, 19, 29, 31), 19, 3, dict(stride=(2, 2), padding=((1, 1), (1, 1)))),
    "blocks 5x5": ((1, 33, 14, 14), 33, 5, dict(padding=((2, 2), (2, 2)))),
    "blocks 5x5 s2 multiplier 2": ((2, 9, 15, 16), 18, 5, dict(stride=(2, 2), padding=((2, 1), (1, 2)))),
    "blocks 7x7 many bands": ((1, 17, 70, 23), 17, 7, dict(padding=((3, 3), (3, 3)))),
    "blocks 7x7 s2": ((1, 16, 21, 22), 16, 7, dict(stride=(2, 2), padding=((3, 3), (3, 3)))),
    "blocks 3x3 narrow": ((3, 40, 7, 7), 40, 3, dict(padding=((1, 1), (1, 1)))),
    "blocks general s3 dilation 2": ((1, 20, 30, 27), 40, 4, dict(stride=(3, 1), padding=((2, 0), (1, 3)),
                                                                  dilation=(2, 2))),
    "blocks general 5x5 dilation (1, 2)": ((1, 18, 19, 24), 18, 5, dict(padding=((2, 2), (4, 4)),
                                                                       dilation=(1, 2))),
    "blocks 1x1 wide": ((1, 17, 5, 50), 17, 1, dict()),
}


@pytest.mark.parametrize("name", sorted(DEPTHWISE_LAYERS))
def test_depthwise_arrangements_match_reference(name):
    x_shape, out_channels, k, config = DEPTHWISE_LAYERS[name]
    rng = np.random.default_rng(4)
    x, w, b = _normal(rng, x_shape), _normal(rng, (out_channels, 1, k, k)), _normal(rng, out_channels)
    config = dict(config, groups=x_shape[1], activation="clip")
    got = jax.jit(lambda x, w, b: kernels.conv2d(x, w, b, algorithm="depthwise", **config, **EPILOGUE))(x, w, b)
    _assert_close("depthwise", got, x, w, b, **config)


@pytest.mark.parametrize("name", ["planes 3x3", "planes 5x5 multiplier 2", "blocks 5x5", "blocks 5x5 s2 multiplier 2",
                                  "blocks general s3 dilation 2"])
def test_depthwise_propagates_nan_and_inf_like_reference(name):
    x_shape, out_channels, k, config = DEPTHWISE_LAYERS[name]
    rng = np.random.default_rng(3)
    x, w, b = _with_non_finite(rng, x_shape), _normal(rng, (out_channels, 1, k, k)), _normal(rng, out_channels)
    w[out_channels // 2, 0, k // 2, k // 2] = np.inf
    w[out_channels - 1, 0, 0, 0] = -np.inf  # meets the zero padding: NaN there, as in XLA
    config = dict(config, groups=x_shape[1])
    got = np.asarray(kernels.conv2d(x, w, b, algorithm="depthwise", **config))
    want = np.asarray(kernels.conv2d_reference(x, w, b, **config))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "algorithm, w_shape, groups",
    [("winograd", (6, 3, 3, 3), 1), ("depthwise", (6, 1, 3, 3), 3)],
)
def test_conv_fast_gradients_are_the_reference_gradients(algorithm, w_shape, groups, getkey):
    x = jax.random.normal(getkey(), (2, 3, 9, 10))
    w = jax.random.normal(getkey(), w_shape)
    b = jax.random.normal(getkey(), (w_shape[0],))
    config = dict(padding=((1, 0), (1, 2)), groups=groups, activation="leaky_relu", alpha=0.1)

    def loss(conv):
        return lambda x, w, b: jnp.sum(jnp.sin(conv(x, w, b, **config)))

    ours = lambda *a, **k: kernels.conv2d(*a, algorithm=algorithm, **k)  # noqa: E731
    got = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(x, w, b)
    want = jax.jit(jax.grad(loss(kernels.conv2d_reference), (0, 1, 2)))(x, w, b)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "w_shape, config, words",
    [((4, 3, 5, 5), dict(), ["kernel (5, 5)"]),
     ((4, 3, 3, 3), dict(stride=(2, 1)), ["stride (2, 1)"]),
     ((4, 3, 3, 3), dict(dilation=(1, 2)), ["dilation (1, 2)"]),
     ((6, 1, 3, 3), dict(groups=3), ["groups 3"]),
     ((6, 1, 1, 3), dict(stride=(2, 2), groups=3), ["kernel (1, 3)", "stride (2, 2)", "groups 3"])],
)
def test_winograd_support_names_what_it_cannot_serve(w_shape, config, words):
    full = dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=1) | config
    reason = kernels.conv2d_support("winograd", x_shape=(1, 3, 12, 12), w_shape=w_shape,
                                    dtype=np.float32, **full)
    assert reason is not None and all(word in reason for word in words)
    x, w = np.ones((1, 3, 12, 12), np.float32), np.ones(w_shape, np.float32)
    with pytest.raises(UnsupportedError, match="winograd"):
        kernels.conv2d(x, w, algorithm="winograd", **full)


def test_depthwise_support_needs_one_group_per_channel():
    config = dict(x_shape=(1, 6, 8, 8), stride=(1, 1), padding=((0, 0), (0, 0)),
                  dilation=(1, 1), dtype=np.float32)
    reason = kernels.conv2d_support("depthwise", w_shape=(6, 2, 3, 3), groups=3, **config)
    assert reason is not None and "groups == input channels (6)" in reason and "groups 3" in reason
    assert kernels.conv2d_support("depthwise", w_shape=(12, 1, 3, 3), groups=6, **config) is None
    assert kernels.conv2d_support("winograd", w_shape=(4, 6, 3, 3), groups=1, **config) is None
    with pytest.raises(UnsupportedError, match="depthwise"):
        kernels.conv2d(np.ones((1, 6, 8, 8), np.float32), np.ones((6, 2, 3, 3), np.float32),
                       algorithm="depthwise", groups=3)
