"""Channel-blocked (NCHWc) activations in the conv kernels, against `lax`.

`smm` and `depthwise` take x and give y as `(N, ceil(C / W), H, W_img, W)`
(`kernels.to_nchwc`, the last block's lanes past C zero); each must compute
what the NCHW reference computes (rtol = atol = 1e-4 as in test_kernels.py,
NaN and Inf where the reference has them), and the same bits as the kernel
in NCHW.
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


@pytest.fixture(scope="module")
def lanes():
    return kernels.vector_lanes()


def _normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _blocked_if(flag, x):
    return kernels.to_nchwc(x) if flag else x


def _nchw_if(flag, y, channels):
    return kernels.from_nchwc(y, channels) if flag else y


def test_blocking_round_trips_and_puts_a_positions_channels_together(lanes):
    c = 2 * lanes - 3
    x = np.arange(2 * c * 3 * 5, dtype=np.float32).reshape(2, c, 3, 5) + 1
    blocked = kernels.to_nchwc(x)
    assert blocked.shape == (2, 2, 3, 5, lanes)
    np.testing.assert_array_equal(np.asarray(blocked[1, 1, 2, 4, :lanes - 3]), x[1, lanes:, 2, 4])
    np.testing.assert_array_equal(np.asarray(blocked[:, 1, :, :, lanes - 3:]), 0)  # padding lanes
    np.testing.assert_array_equal(np.asarray(kernels.from_nchwc(blocked, c)), x)
    assert kernels.from_nchwc(blocked).shape == (2, 2 * lanes, 3, 5)
    with pytest.raises(jtile.ConfigError, match=f"2 blocks of {lanes} do not hold {lanes} channels"):
        kernels.from_nchwc(blocked, lanes)


# smm in pixel rows: the 1x1 expansion writes y blocked, the projection reads
# x blocked (two K blocks at 1152 channels), both at once with a blocked residual.
# Channels in W lanes: 4.5 is a half-filled last block (72 of 80 with AVX-512).
@pytest.mark.parametrize("blocks_in, o_blocks, size, window, activation, residual", [
    (0, 9, 20, 1, "relu6", False),       # expansion 24 -> 144, output blocked
    (9, None, 20, 1, None, True),        # projection 144 -> 24 with the block's residual
    (72, None, 7, 1, None, False),       # 1152 -> 24: K over two blocks of 576
    (2, 3, 9, 1, "hard_swish", True),    # both blocked, residual blocked
    (0, 4, 11, 3, "relu", False),        # a padded 3x3 (im2col) writing a blocked y
    (1, None, 13, 1, "sigmoid", False),  # ragged strips: 169 pixels
    (0, 4.5, 10, 1, "sigmoid", False),   # a partial last output block: its padding lanes zero
    (4.5, 2.5, 9, 1, "relu", True),      # partial blocks in and out, residual blocked
    (64.5, None, 5, 1, None, False),     # 1032 channels: K over two blocks, the second partial
])
def test_smm_takes_and_gives_blocked_activations(lanes, blocks_in, o_blocks, size, window, activation, residual):
    rng = np.random.default_rng(1)
    c = int(blocks_in * lanes) if blocks_in else 24
    o = int(o_blocks * lanes) if o_blocks else 24
    x, w, b = _normal(rng, (1, c, size, size)), _normal(rng, (o, c, window, window)), _normal(rng, o)
    kw = dict(padding=((window // 2,) * 2,) * 2, activation=activation, alpha=1 / 6, beta=0.5)
    res = _normal(rng, (1, o, size, size)) if residual else None
    layouts = dict(x_layout="NCHWc" if blocks_in else "NCHW", y_layout="NCHWc" if o_blocks else "NCHW")
    got = jax.jit(lambda x, res: kernels.conv2d(x, w, b, algorithm="smm", residual=res, **kw, **layouts))(
        _blocked_if(blocks_in, x), None if res is None else _blocked_if(o_blocks, res))
    assert got.shape == ((1, -(-o // lanes), size, size, lanes) if o_blocks else (1, o, size, size))
    want = kernels.conv2d_reference(x, w, b, residual=res, **kw)
    np.testing.assert_allclose(np.asarray(_nchw_if(o_blocks, got, o)), want, rtol=1e-4, atol=3e-4)
    if o_blocks and o % lanes:
        np.testing.assert_array_equal(np.asarray(got[:, -1, :, :, o % lanes:]), 0)
    # The same products in the same order as the kernel in NCHW (pixel rows there too).
    if window == 1 and blocks_in:
        nchw = kernels.conv2d(x, w, b, algorithm="smm", residual=res, **kw)
        if kernels.smm_pixel_rows(kernels.ConvSpec((1, c, size, size), w.shape, (1, 1), ((0, 0), (0, 0)),
                                                   (1, 1), 1, np.dtype(np.float32))):
            np.testing.assert_array_equal(np.asarray(_nchw_if(o_blocks, got, o)), np.asarray(nchw))


def test_smm_applies_a_prologue_and_gives_a_blocked_output(lanes):
    """A squeeze-excitation's scale packed into A (pixel rows, 1152 -> 192 at
    5x5), the output written channel-blocked for the next 1x1 conv; a blocked
    x takes no prologue (it is read in place, not packed)."""
    rng = np.random.default_rng(3)
    x, w, b, scale = _normal(rng, (1, 1152, 5, 5)), _normal(rng, (192, 1152, 1, 1)), _normal(rng, 192), _normal(rng, 1152)
    got = kernels.conv2d(x, w, b, algorithm="smm", prologue=(None, scale, None, None), y_layout="NCHWc")
    want = kernels.conv2d_reference(x * scale[:, None, None], w, b)
    np.testing.assert_allclose(np.asarray(kernels.from_nchwc(got, 192)), want, rtol=1e-4, atol=3e-4)
    with pytest.raises(jtile.ConfigError, match="nor an NCHWc x with prologue="):
        kernels.conv2d(kernels.to_nchwc(x), w, b, algorithm="smm", prologue=(None, scale, None, None),
                       x_layout="NCHWc")


@pytest.mark.parametrize("blocks, size, window, stride, padding, n, x_blocked, y_blocked", [
    (6, 28, 3, 2, ((1, 1), (1, 1)), 1, True, True),    # MobileNetV2's stride-2 depthwise
    (2, 14, 3, 1, ((1, 1), (1, 1)), 2, True, True),    # batch 2
    (3, 9, 5, 1, ((2, 2), (2, 2)), 1, True, False),    # 5x5 into NCHW
    (2, 7, 3, 1, ((1, 1), (1, 1)), 1, False, True),    # NCHW into blocked
    (1, 10, 3, 2, ((0, 1), (0, 1)), 1, True, True),    # asymmetric padding
    (2, 17, 7, 1, ((3, 3), (3, 3)), 1, True, True),    # 7x7, ragged register blocks
    (4.5, 12, 5, 2, ((2, 2), (2, 2)), 2, True, True),  # MobileNetV3's 72 channels: a partial block, batch 2
    (1.5, 6, 3, 1, ((1, 1), (1, 1)), 1, False, True),  # a partial block from NCHW
])
def test_depthwise_takes_and_gives_blocked_activations(lanes, blocks, size, window, stride, padding, n,
                                                        x_blocked, y_blocked):
    rng = np.random.default_rng(2)
    c = int(blocks * lanes)
    x, w, b = _normal(rng, (n, c, size, size)), _normal(rng, (c, 1, window, window)), _normal(rng, c)
    kw = dict(stride=(stride,) * 2, padding=padding, groups=c, activation="relu6")
    layouts = dict(x_layout="NCHWc" if x_blocked else "NCHW", y_layout="NCHWc" if y_blocked else "NCHW")
    got = kernels.conv2d(_blocked_if(x_blocked, x), w, b, algorithm="depthwise", **kw, **layouts)
    want = kernels.conv2d_reference(x, w, b, **kw)
    np.testing.assert_allclose(np.asarray(_nchw_if(y_blocked, got, c)), want, **TOL)
    if y_blocked and c % lanes:  # relu6(0): the padding lanes stay zero
        np.testing.assert_array_equal(np.asarray(got[:, -1, :, :, c % lanes:]), 0)


@pytest.mark.parametrize("activation, clip", [(None, (0, 6)), ("relu", (0, 6)), ("relu6", (0, 6)),
                                              ("clip", (0.25, 0.5)), ("hard_swish", (0, 6)), ("silu", (0, 6))])
@pytest.mark.parametrize("size", [14, 13])  # whole register blocks a row, and not
def test_blocked_depthwise_output_has_the_bits_of_the_nchw_output(lanes, activation, clip, size):
    """A blocked y is written from the registers under a clamp (or no)
    activation over whole register blocks, else through a band and a pass:
    the same bits as an NCHW y either way."""
    rng = np.random.default_rng(5)
    c = 2 * lanes + 3
    x, w, b = _normal(rng, (1, c, size, size)), _normal(rng, (c, 1, 3, 3)), _normal(rng, c)
    kw = dict(padding=((1, 1), (1, 1)), groups=c, activation=activation, clip=clip, alpha=1 / 6, beta=0.5)
    blocked = kernels.conv2d(kernels.to_nchwc(x), w, b, algorithm="depthwise", x_layout="NCHWc", y_layout="NCHWc",
                             **kw)
    nchw = kernels.conv2d(kernels.to_nchwc(x), w, b, algorithm="depthwise", x_layout="NCHWc", **kw)
    np.testing.assert_array_equal(np.asarray(kernels.from_nchwc(blocked, c)), np.asarray(nchw))
    np.testing.assert_allclose(np.asarray(nchw), kernels.conv2d_reference(x, w, b, **kw), **TOL)


@pytest.mark.parametrize("expanded", [6, 4.5])
def test_a_blocked_chain_gives_the_bits_of_the_nchw_chain(lanes, expanded):
    """An inverted residual (expand, depthwise, project with its residual) at
    14x14, blocked between its convs, against the same three kernels in NCHW."""
    rng = np.random.default_rng(3)
    c, e = 24, int(expanded * lanes)
    x = _normal(rng, (1, c, 14, 14))
    we, be, wd, bd, wp, bp = (_normal(rng, s) for s in ((e, c, 1, 1), (e,), (e, 1, 3, 3), (e,), (c, e, 1, 1), (c,)))

    def block(x, layout):
        t = kernels.conv2d(x, we, be, algorithm="smm", activation="relu6", y_layout=layout)
        t = kernels.conv2d(t, wd, bd, algorithm="depthwise", padding=((1, 1), (1, 1)), groups=e,
                           activation="relu6", x_layout=layout, y_layout=layout)
        return kernels.conv2d(t, wp, bp, algorithm="smm", residual=x, x_layout=layout)

    blocked, nchw = jax.jit(lambda x: block(x, "NCHWc"))(x), jax.jit(lambda x: block(x, "NCHW"))(x)
    np.testing.assert_array_equal(np.asarray(blocked), np.asarray(nchw))


@given(st.data())
@settings(max_examples=20, deadline=None)
def test_blocked_depthwise_matches_lax_on_any_geometry(data):
    lanes = kernels.vector_lanes()
    c, k = data.draw(st.integers(1, 3 * lanes)), data.draw(st.sampled_from([1, 2, 3, 5]))
    stride = data.draw(st.integers(1, 3))
    padding = tuple((data.draw(st.integers(0, k - 1)), data.draw(st.integers(0, k - 1))) for _ in range(2))
    h, w = data.draw(st.integers(k, 12)), data.draw(st.integers(k, 12))
    n = data.draw(st.integers(1, 2))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    x, wt, b = _normal(rng, (n, c, h, w)), _normal(rng, (c, 1, k, k)), _normal(rng, c)
    kw = dict(stride=(stride, stride), padding=padding, groups=c, activation="relu")
    got = kernels.conv2d(kernels.to_nchwc(x), wt, b, algorithm="depthwise", x_layout="NCHWc", y_layout="NCHWc", **kw)
    np.testing.assert_allclose(np.asarray(kernels.from_nchwc(got, c)), kernels.conv2d_reference(x, wt, b, **kw),
                               **TOL)


@pytest.mark.parametrize("algorithm", ["smm", "depthwise"])
def test_blocked_inputs_propagate_nan_and_inf_as_lax(lanes, algorithm):
    rng = np.random.default_rng(4)
    c = 2 * lanes
    x = _normal(rng, (1, c, 9, 9))
    x[0, 3, 4, 4], x[0, lanes + 1, 0, 0] = np.nan, np.inf
    w = _normal(rng, (c, 1, 3, 3)) if algorithm == "depthwise" else _normal(rng, (c, c, 1, 1))
    kw = dict(padding=((1, 1), (1, 1)), groups=c) if algorithm == "depthwise" else {}
    got = kernels.from_nchwc(kernels.conv2d(kernels.to_nchwc(x), w, algorithm=algorithm, x_layout="NCHWc",
                                            y_layout="NCHWc", **kw))
    want = kernels.conv2d_reference(x, w, **kw)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_gradients_flow_through_blocked_layouts(lanes):
    rng = np.random.default_rng(5)
    c = 2 * lanes
    x, wd, wp = _normal(rng, (1, c, 8, 8)), _normal(rng, (c, 1, 3, 3)), _normal(rng, (16, c, 1, 1))

    def chain(x, wd, wp, layout):
        t = kernels.conv2d(_blocked_if(layout == "NCHWc", x), wd, algorithm="depthwise", padding=((1, 1), (1, 1)),
                           groups=c, activation="relu", x_layout=layout, y_layout=layout)
        return jnp.sum(kernels.conv2d(t, wp, algorithm="smm", x_layout=layout) ** 2)

    blocked = jax.grad(chain, argnums=(0, 1, 2))(x, wd, wp, "NCHWc")
    reference = jax.grad(lambda x, wd, wp: jnp.sum(kernels.conv2d_reference(
        kernels.conv2d_reference(x, wd, padding=((1, 1), (1, 1)), groups=c, activation="relu"), wp) ** 2),
        argnums=(0, 1, 2))(x, wd, wp)
    for got, want in zip(blocked, reference):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("algorithm, x_shape, w_shape, groups, layouts, message", [
    ("smm", (1, 32, 8, 8), (16, 32, 3, 3), 1, ("NCHWc", "NCHW"), r"an NCHWc x needs a 1x1, stride-1, unpadded conv"),
    ("smm", (2, 32, 8, 8), (32, 32, 1, 1), 1, ("NCHW", "NCHWc"), "one image of one group"),
    ("smm", (1, 32, 8, 8), (32, 16, 1, 1), 2, ("NCHWc", "NCHW"), "one image of one group"),
    ("depthwise", (1, 32, 8, 8), (64, 1, 3, 3), 32, ("NCHWc", "NCHWc"), "maps 32 to 64"),
    ("depthwise", (1, 32, 8, 8), (64, 1, 3, 3), 32, ("NCHW", "NCHWc"), "one output channel per input channel"),
    ("winograd", (1, 32, 8, 8), (32, 32, 3, 3), 1, ("NCHW", "NCHWc"), "'winograd' takes no nchwc="),
])
def test_layers_a_kernel_cannot_block_are_refused(algorithm, x_shape, w_shape, groups, layouts, message):
    x = np.zeros(x_shape, np.float32)
    if layouts[0] == "NCHWc":
        x = kernels.to_nchwc(x)
    with pytest.raises(jtile.UnsupportedError, match=message):
        kernels.conv2d(x, np.zeros(w_shape, np.float32), algorithm=algorithm, groups=groups,
                       padding=((1, 1), (1, 1)) if w_shape[2] == 3 else ((0, 0), (0, 0)),
                       x_layout=layouts[0], y_layout=layouts[1])


def test_blocked_layouts_refuse_bad_arguments(lanes):
    x, w = np.zeros((1, 2 * lanes, 6, 6), np.float32), np.zeros((2 * lanes, 2 * lanes, 1, 1), np.float32)
    with pytest.raises(jtile.ConfigError, match="x_layout must be 'NCHW' or 'NCHWc', got 'NHWC'"):
        kernels.conv2d(x, w, algorithm="smm", x_layout="NHWC")
    with pytest.raises(jtile.ConfigError, match=r"an NCHWc x holding the \d+ channels .* is \(N, 2, H, W, \d+\)"):
        kernels.conv2d(x, w, algorithm="smm", x_layout="NCHWc")
    with pytest.raises(jtile.ConfigError, match=r"is \(N, 2, H, W, \d+\), got \(1, 3, 6, 6, \d+\)"):
        kernels.conv2d(kernels.to_nchwc(np.zeros((1, 3 * lanes, 6, 6), np.float32)), w, algorithm="smm",
                       x_layout="NCHWc")
    with pytest.raises(jtile.ConfigError, match="do not combine with into="):
        kernels.conv2d(x, w, algorithm="smm", y_layout="NCHWc", into=(4 * lanes, 0))
    with pytest.raises(jtile.ConfigError, match=r"residual must have the output's shape \(1, 2, 6, 6"):
        kernels.conv2d(kernels.to_nchwc(x), w, algorithm="smm", x_layout="NCHWc", y_layout="NCHWc",
                       residual=np.zeros((1, 2 * lanes, 6, 6), np.float32))
