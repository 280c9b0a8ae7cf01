"""The C kernels of `jtile.kernels` against their jnp/lax references.

Tolerances: the kernels accumulate float32 in a different order than XLA, so
values are compared with rtol = atol = 1e-4 on unit-normal data with at most a
few hundred terms per output (observed error ~1e-6 per term); NaN and Inf must
appear exactly where the reference has them.
"""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jtile
from jtile import kernels
from jtile._views import Strided
from jtile._interpreter import iter_eqns

ACTIVATIONS = [None, "relu", "relu6", "clip", "leaky_relu", "sigmoid", "silu", "hard_sigmoid", "hard_swish",
               "gelu", "gelu_tanh"]
EPILOGUE = dict(alpha=0.2, beta=0.5, clip=(-0.5, 0.75))
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def library_built():
    """Fail (not skip) every test here if the kernels library is missing."""
    missing = {t: kernels.kernel_unavailable(t) for t in kernels._TARGETS if kernels.kernel_unavailable(t)}
    if missing:
        pytest.fail(f"jtile kernels unavailable: {missing}")


def _normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _conv_case(draw):
    groups = draw(st.integers(1, 8))  # smm runs a GEMM per task from 2 * workers GEMMs on
    cg, og = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(2))
    span_h, span_w = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
    h = draw(st.integers(max(1, span_h - sum(padding[0])), 13))
    w = draw(st.integers(max(1, span_w - sum(padding[1])), 13))
    n = draw(st.integers(1, 2))
    return dict(
        x_shape=(n, cg * groups, h, w), w_shape=(og * groups, cg, kh, kw),
        config=dict(stride=stride, padding=padding, dilation=dilation, groups=groups),
        activation=draw(st.sampled_from(ACTIVATIONS)), bias=draw(st.booleans()),
        residual=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


conv_cases = st.composite(_conv_case)


@pytest.mark.parametrize("algorithm", ["direct", "smm", "grouped"])
@settings(max_examples=25, deadline=None)
@given(case=conv_cases())
def test_conv2d_matches_reference(algorithm, case):
    rng = np.random.default_rng(case["seed"])
    x, w = _normal(rng, case["x_shape"]), _normal(rng, case["w_shape"])
    b = _normal(rng, case["w_shape"][0]) if case["bias"] else None
    kw = dict(**case["config"], activation=case["activation"], **EPILOGUE)
    if case["residual"]:
        kw["residual"] = _normal(rng, kernels.conv2d_reference(x, w, **case["config"]).shape)
    got = kernels.conv2d(x, w, b, algorithm=algorithm, **kw)
    np.testing.assert_allclose(got, kernels.conv2d_reference(x, w, b, **kw), **TOL)


@pytest.mark.parametrize(
    "x_shape, w_shape, stride, pixel_rows",
    [
        ((2, 240, 7, 9), (256, 240, 3, 3), 1, True),  # few pixels, many channels: 3 K blocks, batch 2
        ((1, 40, 15, 15), (128, 40, 3, 3), 2, True),  # strided, 8x8 out
        ((2, 40, 20, 20), (96, 40, 3, 3), 1, False),  # 400 pixels
        ((1, 96, 8, 8), (160, 96, 1, 1), 1, False),  # 1x1, whole vectors: x itself is the B operand
        ((1, 96, 14, 14), (40, 96, 1, 1), 1, False),  # 1x1, under a strip of output channels
        ((1, 96, 14, 14), (160, 96, 1, 1), 1, True),  # 1x1, 196 of 208 lanes: pixel rows
        ((1, 960, 5, 5), (160, 960, 1, 1), 1, True),  # 1x1, 25 of 32 lanes: pixel rows
        # 1x1 read in place over 2 K blocks; 140 pixels = 2 full strips and a packed partial one
        ((2, 1100, 10, 14), (9, 1100, 1, 1), 1, False),
    ],
)
def test_smm_orientations_fuse_bias_residual_and_activation(x_shape, w_shape, stride, pixel_rows):
    rng = np.random.default_rng(3)
    x, w, b = _normal(rng, x_shape), _normal(rng, w_shape) * 0.1, _normal(rng, w_shape[0])
    pad = w_shape[2] // 2
    config = dict(stride=(stride, stride), padding=((pad, pad), (pad, pad)))
    out = kernels.conv2d_reference(x, w, **config)
    spec = kernels.ConvSpec(x_shape, w_shape, dilation=(1, 1), groups=1, dtype=np.dtype(np.float32),
                            **{k: tuple(v) for k, v in config.items()})
    assert kernels.smm_pixel_rows(spec) == pixel_rows
    residual = _normal(rng, out.shape)
    kw = dict(**config, activation="leaky_relu", alpha=0.1, residual=residual)
    got = kernels.conv2d(x, w, b, algorithm="smm", **kw)
    np.testing.assert_allclose(got, kernels.conv2d_reference(x, w, b, **kw), rtol=1e-4, atol=3e-4)
    # Pixel rows pack the weight as the wide tile's B columns, channel rows as the tall tile's A rows.
    packed = kernels._smm_prepare(spec, w)[0]
    rows = kernels.gemm_tile()[1] if pixel_rows else kernels.gemm_tile("tall")[0]
    assert packed.shape == (1, -(-w_shape[0] // rows), np.prod(w_shape[1:]), rows)


@pytest.mark.parametrize("x_shape, w_shape, padding, dilation, pixel_rows", [
    ((1, 96, 14, 14), (64, 96, 3, 3), ((14, -2), (-2, 14)), (12, 12), True),  # a 2x2 corner of an atrous conv
    ((2, 40, 30, 30), (96, 40, 3, 3), ((-3, 1), (1, -5)), (1, 1), False),  # batch 2, 26x24 out
    ((1, 32, 9, 11), (16, 32, 1, 1), ((-2, -1), (-3, 0)), (1, 1), False),  # a 1x1 on a crop: gathered, not in place
])
def test_smm_reads_a_crop_of_x_through_negative_padding(x_shape, w_shape, padding, dilation, pixel_rows):
    """Negative padding: the conv reads a window of x that starts or ends inside
    it, as lax.conv_general_dilated does; the other kernels refuse it."""
    rng = np.random.default_rng(8)
    x, w, b = _normal(rng, x_shape), _normal(rng, w_shape) * 0.1, _normal(rng, w_shape[0])
    spec = kernels.ConvSpec(x_shape, w_shape, stride=(1, 1), padding=padding, dilation=dilation, groups=1,
                            dtype=np.dtype(np.float32))
    assert kernels.smm_pixel_rows(spec) == pixel_rows
    kw = dict(padding=padding, dilation=dilation, activation="relu")
    want = jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), padding, rhs_dilation=dilation)
                       + b[None, :, None, None])
    np.testing.assert_allclose(jax.jit(lambda x: kernels.conv2d(x, w, b, algorithm="smm", **kw))(x), want,
                               rtol=1e-4, atol=3e-4)
    geometry = dict(x_shape=x_shape, w_shape=w_shape, stride=(1, 1), padding=padding, dilation=dilation, groups=1,
                    dtype=jnp.float32)
    assert kernels.conv2d_support("smm", **geometry) is None
    assert "negative padding" in kernels.conv2d_support("grouped", **geometry)


@pytest.mark.parametrize("x_shape, stride", [
    ((1, 64, 28, 28), (2, 2)),  # ResNet's downsampling conv
    ((2, 24, 9, 7), (2, 2)),  # odd sides: the last row and column are read
    ((1, 16, 10, 11), (3, 2)),
    ((1, 8, 5, 5), (1, 2)),
])
def test_smm_strided_pointwise_conv_subsamples_x_in_its_call(x_shape, stride):
    """A 1x1 unpadded strided conv copies x[:, :, ::sh, ::sw] inside its call
    and runs at stride 1 on it: the same output, gradient and MACs, from one
    call on x itself (no strided slice left for XLA to run)."""
    rng = np.random.default_rng(5)
    x, w, b = _normal(rng, x_shape), _normal(rng, (32, x_shape[1], 1, 1)) * 0.1, _normal(rng, 32)
    expected = kernels.conv2d_reference(x, w, b, stride=stride, activation="relu")
    residual = _normal(rng, expected.shape)
    kw = dict(stride=stride, activation="relu", residual=residual)
    got = kernels.conv2d(x, w, b, algorithm="smm", **kw)
    np.testing.assert_allclose(got, kernels.conv2d_reference(x, w, b, **kw), rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(lambda x: kernels.conv2d(x, w, b, algorithm="smm", stride=stride))(x).jaxpr
    calls = [e for e in iter_eqns(jaxpr) if e.primitive.name == "ffi_call"]
    assert len(calls) == 1 and calls[0].invars[0].aval.shape == x_shape
    assert not [e for e in iter_eqns(jaxpr) if e.primitive.name in ("slice", "gather")]
    macs = jtile.summary(lambda x: kernels.conv2d(x, w, algorithm="smm", stride=stride), x).macs_by_category
    assert macs["conv"] == math.prod(expected.shape) * x_shape[1]
    grad = jax.grad(lambda x: kernels.conv2d(x, w, algorithm="smm", stride=stride).sum())(x)
    expected_grad = jax.grad(lambda x: kernels.conv2d_reference(x, w, stride=stride).sum())(x)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_gemm_tiles_are_named_wide_and_tall():
    (mr, nr), (tall_mr, tall_nr) = kernels.gemm_tile(), kernels.gemm_tile("tall")
    assert nr % kernels.vector_lanes() == 0 and tall_nr % kernels.vector_lanes() == 0
    assert tall_mr >= mr
    with pytest.raises(jtile.ConfigError, match="shape must be 'wide' or 'tall', got 'square'"):
        kernels.gemm_tile("square")


@pytest.mark.parametrize("algorithm", ["direct", "smm", "grouped"])
def test_conv2d_large_blocks_match_reference(algorithm):
    # 120 channels x 3x3 = 1080 taps (two GEMM K blocks), 300 output channels
    # (several M chunks; grouped: 9 pairs of vectors and a ragged single),
    # 45x47 pixels (several N blocks and ragged tiles).
    rng = np.random.default_rng(1)
    x, w, b = _normal(rng, (1, 120, 45, 47)), _normal(rng, (300, 120, 3, 3)), _normal(rng, 300)
    kw = dict(padding=((1, 0), (2, 1)), activation="relu")
    got = kernels.conv2d(x, w, b, algorithm=algorithm, **kw)
    np.testing.assert_allclose(got, kernels.conv2d_reference(x, w, b, **kw), rtol=1e-4, atol=3e-4)


@pytest.mark.parametrize("algorithm", ["direct", "smm", "grouped"])
@pytest.mark.parametrize(
    "x_shape, og, stride",
    [((1, 64, 15, 14), 4, 1),     # ResNeXt-like: 32 groups of 2 -> 4 channels, channel rows; grouped: 4 a vector
     ((1, 64, 15, 14), 3, 1),     # grouped: vectors spanning groups of 3
     ((1, 64, 13, 14), 2, 2),     # grouped: 8 groups a vector, stride 2
     ((2, 64, 9, 9), 16, 2),      # 16 groups of 4 -> 16, batch 2, pixel rows over the batch
     ((1, 96, 7, 7), 24, 1),      # 32 groups of 3 -> 24 at 7x7, pixel rows
     ((3, 48, 12, 10), 8, 2),     # 16 groups: 48 GEMMs, one per (group, image); grouped: 2 a vector
     ((1, 64, 30, 9), 40, 1),     # 32 groups of 40: grouped's ragged second block, bands
     ((1, 64, 9, 8), 32, 2),      # 32 groups of 32: grouped's two blocks a task
     ((2, 64, 11, 9), 48, 1),     # batch 2, 32 groups of 48: grouped's input padded once for two tasks a group
     ((1, 64, 10, 13), 2, 1),     # grouped: 8 groups a vector, rows of 13 as 7 + 6 columns
     ((1, 64, 8, 13), 16, 1)],    # grouped: one block a task, rows of 13 as 7 + 6 columns
)
def test_conv2d_many_groups_match_reference(algorithm, x_shape, og, stride):
    groups = 32 if x_shape[1] != 48 else 16
    rng = np.random.default_rng(5)
    cg = x_shape[1] // groups
    x, w, b = _normal(rng, x_shape), _normal(rng, (og * groups, cg, 3, 3)), _normal(rng, og * groups)
    config = dict(stride=(stride, stride), padding=((1, 1), (0, 2)), groups=groups)
    residual = _normal(rng, kernels.conv2d_reference(x, w, **config).shape)
    kw = dict(**config, activation="leaky_relu", alpha=0.1, residual=residual)
    got = jax.jit(lambda x, w, b: kernels.conv2d(x, w, b, algorithm=algorithm, **kw))(x, w, b)
    np.testing.assert_allclose(got, kernels.conv2d_reference(x, w, b, **kw), rtol=1e-4, atol=3e-4)


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 20), k=st.integers(1, 300), n=st.integers(1, 90),
    activation=st.sampled_from(ACTIVATIONS), bias=st.booleans(), transpose_w=st.booleans(),
    traced=st.booleans(), residual=st.booleans(), seed=st.integers(0, 2**16),
)
def test_dense_matches_reference(m, k, n, activation, bias, transpose_w, traced, residual, seed):
    """In-place paths below 17 rows (traced w), the packed GEMM otherwise; a
    residual added before the activation on each."""
    rng = np.random.default_rng(seed)
    x, w = _normal(rng, (m, k)), _normal(rng, (n, k) if transpose_w else (k, n))
    b = _normal(rng, n) if bias else None
    kw = dict(activation=activation, transpose_w=transpose_w, residual=_normal(rng, (m, n)) if residual else None,
              **EPILOGUE)
    run = jax.jit(lambda x, w: kernels.dense(x, w, b, **kw)) if traced else lambda x, w: kernels.dense(x, w, b, **kw)
    np.testing.assert_allclose(run(x, w), kernels.dense_reference(x, w, b, **kw), rtol=1e-4, atol=3e-4)


# Every kernel path that ends in an epilogue, on odd sizes (vector tails take
# the scalar path) with pre-activations spanning about +-8, so that every
# activation's saturated and linear regions are both reached.
_EPILOGUE_PATHS = {  # name -> (x shape, w shape, conv algorithm or "dense", config)
    "direct": ((2, 5, 9, 11), (13, 5, 3, 3), "direct", dict(padding=((1, 0), (0, 2)))),
    "smm channel rows": ((1, 6, 23, 21), (13, 6, 3, 3), "smm", dict(padding=((1, 1), (1, 1)))),
    "smm pixel rows": ((2, 40, 7, 9), (70, 40, 3, 3), "smm", dict(padding=((1, 1), (1, 1)))),
    "smm pointwise": ((1, 24, 9, 9), (37, 24, 1, 1), "smm", dict()),
    "winograd": ((2, 16, 19, 17), (21, 16, 3, 3), "winograd", dict(padding=((1, 1), (1, 1)))),
    "depthwise": ((1, 19, 15, 13), (19, 1, 5, 5), "depthwise",
                  dict(groups=19, stride=(2, 2), padding=((2, 2), (2, 2)))),
    "dense gemv": ((3, 77), (77, 45), "dense", dict()),
    "dense gemm": ((21, 77), (45, 77), "dense", dict(transpose_w=True)),
}


@pytest.mark.parametrize("activation", ACTIVATIONS[5:])
@pytest.mark.parametrize("path", sorted(_EPILOGUE_PATHS))
def test_every_kernel_path_applies_every_activation(path, activation):
    x_shape, w_shape, algorithm, config = _EPILOGUE_PATHS[path]
    rng = np.random.default_rng(5)
    dense = algorithm == "dense"
    fan_in = min(w_shape) if dense else np.prod(w_shape[1:])
    x, w = _normal(rng, x_shape), _normal(rng, w_shape) * (4 / np.sqrt(fan_in))
    b = _normal(rng, w_shape[0] if config.get("transpose_w", not dense) else w_shape[1])
    kw = dict(activation=activation, alpha=1 / 6, beta=0.5)
    if dense:
        got, plain = kernels.dense(x, w, b, **config, **kw), kernels.dense_reference(x, w, b, **config)
    else:
        got = kernels.conv2d(x, w, b, algorithm=algorithm, **config, **kw)
        plain = kernels.conv2d_reference(x, w, b, **config)
    assert 6 < float(np.abs(plain).max()) < 40  # both regions of every activation are reached
    np.testing.assert_allclose(got, kernels.activation_reference(plain, **kw), rtol=1e-4, atol=2e-4)


def test_activation_reference_is_what_jax_nn_computes():
    """The fused activations mean what jax.nn (and ONNX HardSigmoid) mean."""
    y = jnp.linspace(-9.0, 9.0, 1001)
    expected = {
        "sigmoid": jax.nn.sigmoid(y), "silu": jax.nn.silu(y), "hard_swish": jax.nn.hard_swish(y),
        "hard_sigmoid": jax.nn.hard_sigmoid(y), "gelu": jax.nn.gelu(y, approximate=False),
        "gelu_tanh": jax.nn.gelu(y, approximate=True),
    }
    for activation, want in expected.items():
        got = kernels.activation_reference(y, activation, alpha=1 / 6, beta=0.5)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=activation)
    onnx = kernels.activation_reference(y, "hard_sigmoid", alpha=0.2, beta=0.5)
    np.testing.assert_allclose(onnx, np.clip(0.2 * np.asarray(y) + 0.5, 0, 1), rtol=1e-6, atol=1e-7)


# In-place matrix-vector paths (traced w, few rows), and the packed GEMM over
# several M chunks and K blocks (known w, even for one row, or many rows).
@pytest.mark.parametrize("m, traced", [(1, False), (1, True), (5, True), (16, True), (8, False), (200, True),
                                       (200, False)])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_dense_large_blocks_match_reference(m, traced, transpose_w):
    rng = np.random.default_rng(2)
    k, n = (600, 5000) if m <= 16 else (1100, 530)
    x, w = _normal(rng, (m, k)), _normal(rng, (n, k) if transpose_w else (k, n))
    kw = dict(activation="leaky_relu", alpha=0.1, transpose_w=transpose_w)
    got = jax.jit(lambda x, w: kernels.dense(x, w, **kw))(x, w) if traced else kernels.dense(x, w, **kw)
    np.testing.assert_allclose(got, kernels.dense_reference(x, w, **kw), rtol=1e-4, atol=5e-4)


# The GEMM reads a row-major x in place when C has at most 16 strips of
# columns (1024 with AVX-512) and packs it for more: both sides of that line,
# over two K blocks, with a residual.
@pytest.mark.parametrize("n", [1024, 1088])
def test_dense_reads_or_packs_x_by_the_width_of_its_output(n):
    rng = np.random.default_rng(4)
    x, w, b = _normal(rng, (23, 1100)), _normal(rng, (n, 1100)), _normal(rng, n)
    kw = dict(activation="relu", transpose_w=True, residual=_normal(rng, (23, n)))
    np.testing.assert_allclose(kernels.dense(x, w, b, **kw), kernels.dense_reference(x, w, b, **kw),
                               rtol=1e-4, atol=1e-3)


# Rows of (N, K) weights of 1024 floats and more take the matrix-vector path
# that prefetches along each row; K not a multiple of the vector width, and a
# batch of rows, so the last partial vector and the prefetch's end are covered.
@pytest.mark.parametrize("m, k", [(1, 1100), (3, 2061)])
def test_dense_long_rows_match_reference(m, k):
    rng = np.random.default_rng(3)
    x, w, b = _normal(rng, (m, k)), _normal(rng, (70, k)), _normal(rng, 70)
    kw = dict(activation="relu", transpose_w=True)
    got = jax.jit(lambda x, w: kernels.dense(x, w, b, **kw))(x, w)
    np.testing.assert_allclose(got, kernels.dense_reference(x, w, b, **kw), rtol=1e-4, atol=1e-3)


# One row on a known (packed) weight takes the matrix-vector path that streams
# several strips at once: strips in a partial group (n = 130: 3 strips of the
# AVX-512 tile), and K split into chunks whose partial sums are added at the
# end (few strips, long K), with the bias, a residual and the activation.
@pytest.mark.parametrize("k, n", [(3000, 70), (700, 130), (5, 1)])
def test_dense_one_row_on_packed_weight_matches_reference(k, n):
    rng = np.random.default_rng(4)
    x, w, b, r = _normal(rng, (1, k)), _normal(rng, (n, k)), _normal(rng, n), _normal(rng, (1, n))
    kw = dict(activation="relu", transpose_w=True, residual=r)
    got = jax.jit(lambda x: kernels.dense(x, w, b, **kw))(x)
    np.testing.assert_allclose(got, kernels.dense_reference(x, w, b, **kw), rtol=1e-4, atol=1e-3)


@st.composite
def _matmul_case(draw):
    """Two operands of a random `dot_general`: 0-2 batch, 0-2 contracting and
    0-2 free axes each, odd sizes, every operand's axes in a random order (so
    some are read in place as rows or columns and others are copied first)."""
    sizes = st.integers(1, 9)
    batch = draw(st.lists(sizes, max_size=2))
    contract = draw(st.lists(st.integers(1, 40), max_size=2))
    free = [draw(st.lists(sizes, max_size=2)) for _ in range(2)]
    shapes, dims = [], []
    for own in free:
        axes = [("b", i) for i in range(len(batch))] + [("k", i) for i in range(len(contract))] + [("f", i) for i in range(len(own))]
        order = draw(st.permutations(axes))
        size = {"b": batch, "k": contract, "f": own}
        shapes.append(tuple(size[g][i] for g, i in order))
        dims.append(([order.index(("k", i)) for i in range(len(contract))], [order.index(("b", i)) for i in range(len(batch))]))
    (a_contract, a_batch), (c_contract, c_batch) = dims
    return shapes, ((tuple(a_contract), tuple(c_contract)), (tuple(a_batch), tuple(c_batch)))


@settings(max_examples=40, deadline=None)
@given(case=_matmul_case(), traced=st.booleans(), batch_inner=st.booleans(), seed=st.integers(0, 2**16))
def test_matmul_matches_dot_general(case, traced, batch_inner, seed):
    """Also stored batch-inner: the product's axes come as (a's free axes, the
    batch axes, c's free axes)."""
    (a_shape, c_shape), dn = case
    rng = np.random.default_rng(seed)
    a, c = _normal(rng, a_shape), _normal(rng, c_shape)
    product = lambda a, c: kernels.matmul(a, c, dn, batch_inner=batch_inner)  # noqa: E731
    want = kernels.matmul_reference(a, c, dn)
    if batch_inner:
        batch, rows = len(dn[1][0]), len(a_shape) - len(dn[1][0]) - len(dn[0][0])
        axes = list(range(want.ndim))
        want = want.transpose(axes[batch:batch + rows] + axes[:batch] + axes[batch + rows:])
    np.testing.assert_allclose((jax.jit(product) if traced else product)(a, c), want, **TOL)


# Attention's products in the model's own layout (one copy-free strided read
# each), with K over two GEMM K blocks and ragged register tiles.
@pytest.mark.parametrize("heads, tokens, width", [(12, 197, 64), (1, 33, 1100), (3, 8, 1)])
def test_matmul_attention_products_match_reference(heads, tokens, width):
    rng = np.random.default_rng(3)
    q, k = _normal(rng, (tokens, heads, width)), _normal(rng, (tokens, heads, width))
    p = _normal(rng, (heads, tokens, tokens))
    scores = (((2,), (2,)), ((1,), (1,)))  # q (T, H, D) . k (T, H, D) -> (H, T, T)
    mixed = (((2,), (0,)), ((0,), (1,)))   # p (H, T, T) . v (T, H, D) -> (H, T, D)
    for a, c, dn in ((q, k, scores), (p, k, mixed)):
        np.testing.assert_allclose(jax.jit(lambda a, c: kernels.matmul(a, c, dn))(a, c),
                                   kernels.matmul_reference(a, c, dn), rtol=1e-4, atol=5e-4)


def test_matmul_scales_its_product():
    """Attention's 1 / sqrt(d) applied as the product is stored: the reference's
    product times the scale, and its gradient."""
    rng = np.random.default_rng(6)
    a, c = _normal(rng, (3, 17, 40)), _normal(rng, (3, 21, 40))
    dn = (((2,), (2,)), ((0,), (0,)))
    np.testing.assert_allclose(kernels.matmul(a, c, dn, scale=0.125), kernels.matmul_reference(a, c, dn) * 0.125,
                               **TOL)

    def grad(f):
        return jax.grad(lambda a: jnp.sum(jnp.sin(f(a))))(a)

    np.testing.assert_allclose(grad(lambda a: kernels.matmul(a, c, dn, scale=-3.0)),
                               grad(lambda a: kernels.matmul_reference(a, c, dn) * -3.0), **TOL)


# Row-wise softmax and layer norm over the last axis: rows of any length
# (vector tails), scale and bias per column or one value.
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 300), spread=st.sampled_from([1.0, 30.0]),
       per_column=st.booleans(), bias=st.booleans(), traced=st.booleans(), seed=st.integers(0, 2**16))
def test_softmax_and_layer_norm_match_reference(rows, n, spread, per_column, bias, traced, seed):
    rng = np.random.default_rng(seed)
    x = _normal(rng, (rows, n)) * np.float32(spread) + np.float32(rng.uniform(-50, 50))
    scale = _normal(rng, n if per_column else ())
    shift = (_normal(rng, n if per_column else ()) if bias else None)
    run = jax.jit if traced else (lambda f: f)
    np.testing.assert_allclose(run(kernels.softmax)(x), kernels.softmax_reference(x), rtol=1e-5, atol=1e-6)
    got = run(lambda x: kernels.layer_norm(x, scale, shift, epsilon=1e-3))(x)
    want = kernels.layer_norm_reference(x, scale, 0.0 if shift is None else shift, 1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("call, message", [
    (lambda: kernels.softmax(np.float32(1.0)), "scalar"),
    (lambda: kernels.layer_norm(np.zeros((2, 5), np.float32), np.ones(4, np.float32)), r"scale must hold .* \(5\)"),
    (lambda: kernels.layer_norm(np.zeros((2, 5), np.float32), np.ones(5, np.float32), np.ones((5, 1), np.float32)),
     "bias must hold"),
    (lambda: kernels.softmax(np.zeros(3, np.float16)), "float32 only"),
])
def test_softmax_and_layer_norm_refuse_bad_operands(call, message):
    with pytest.raises((jtile.ConfigError, jtile.UnsupportedError), match=message):
        call()


def test_matmul_batch_elements_do_not_depend_on_the_batch():
    """Whole elements per worker (a batch) or one element over the pool: same bits."""
    rng = np.random.default_rng(4)
    a, c = _normal(rng, (5, 37, 300)), _normal(rng, (5, 300, 70))
    dn = (((2,), (1,)), ((0,), (0,)))
    together = np.asarray(kernels.matmul(a, c, dn))
    alone = np.stack([np.asarray(kernels.matmul(a[i:i + 1], c[i:i + 1], dn))[0] for i in range(5)])
    assert np.array_equal(together, alone)


def test_matmul_gradients_are_the_references():
    rng = np.random.default_rng(5)
    a, c = _normal(rng, (2, 5, 7)), _normal(rng, (2, 9, 7))
    dn = (((2,), (2,)), ((0,), (0,)))

    def loss(f):
        return jax.grad(lambda a, c: jnp.sum(jnp.sin(f(a, c, dn))), argnums=(0, 1))(a, c)

    for got, want in zip(loss(kernels.matmul), loss(kernels.matmul_reference)):
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("tokens, heads, width", [(13, 4, 8), (197, 12, 64)])
def test_matmul_reads_views_of_one_buffer(tokens, heads, width):
    """q and k as views of one QKV projection (tokens, 3 * dim), heads `width`
    apart, read in place; their gradients land in the buffer."""
    rng = np.random.default_rng(6)
    dim = heads * width
    qkv = _normal(rng, (tokens, 3 * dim))
    q = Strided(0, (heads, tokens, width), (width, 3 * dim, 1))
    k_t = Strided(dim, (heads, width, tokens), (width, 1, 3 * dim))  # k transposed: K axis contiguous
    dn = (((2,), (1,)), ((0,), (0,)))
    heads_of = qkv.reshape(tokens, 3, heads, width).transpose(1, 2, 0, 3)
    want = np.einsum("htd,hsd->hts", heads_of[0], heads_of[1])
    got = jax.jit(lambda b: kernels.matmul(b, b, dn, a_view=q, c_view=k_t))(qkv)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-4)
    grad = jax.grad(lambda b: jnp.sum(jnp.sin(kernels.matmul(b, b, dn, a_view=q, c_view=k_t))))(qkv)
    ref = jax.grad(lambda b: jnp.sum(jnp.sin(jnp.einsum("htd,hsd->hts", *b.reshape(tokens, 3, heads, width)
                                                         .transpose(1, 2, 0, 3)[:2]))))(qkv)
    np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=5e-4)


def test_matmul_rejects_views_it_cannot_read():
    dn = (((1,), (0,)), ((), ()))
    buffer = jnp.ones((4, 6))
    with pytest.raises(jtile.ConfigError, match="reaches outside its buffer of shape"):
        kernels.matmul(buffer, jnp.ones((3, 2)), dn, a_view=Strided(20, (2, 3), (6, 1)))
    scattered = Strided(0, (2, 3), (12, 2))  # neither rows nor K contiguous
    assert not kernels.matmul_reads_in_place(scattered, (), (1,))
    with pytest.raises(jtile.ConfigError, match="cannot be read in place"):
        kernels.matmul(buffer, jnp.ones((3, 2)), dn, a_view=scattered)


def test_matmul_rejects_mismatched_and_empty_products():
    dn = (((1,), (0,)), ((), ()))
    with pytest.raises(jtile.ConfigError, match="do not match the dimension numbers"):
        kernels.matmul(jnp.ones((2, 3)), jnp.ones((4, 5)), dn)
    with pytest.raises(jtile.ConfigError, match="is empty"):
        kernels.matmul(jnp.ones((0, 3)), jnp.ones((3, 5)), dn)
    with pytest.raises(jtile.UnsupportedError, match="float32"):
        kernels.matmul(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 5), jnp.int32), dn)


def _pool_case(draw):
    window = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(2))
    h = draw(st.integers(max(1, window[0] - sum(padding[0])), 12))
    w = draw(st.integers(max(1, window[1] - sum(padding[1])), 12))
    return (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w), window, stride, padding


@settings(max_examples=15, deadline=None)
@given(case=st.composite(_pool_case)(), include_pad=st.booleans(), seed=st.integers(0, 2**16))
def test_pools_match_reference(case, include_pad, seed):
    shape, window, stride, padding = case
    x = _normal(np.random.default_rng(seed), shape)
    np.testing.assert_allclose(kernels.max_pool2d(x, window, stride, padding),
                               kernels.max_pool2d_reference(x, window, stride, padding), **TOL)
    np.testing.assert_allclose(kernels.avg_pool2d(x, window, stride, padding, include_pad),
                               kernels.avg_pool2d_reference(x, window, stride, padding, include_pad), **TOL)
    np.testing.assert_allclose(kernels.global_avg_pool2d(x), kernels.global_avg_pool2d_reference(x), **TOL)



def _same_size_pool_case(draw):
    window = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    before = [draw(st.integers(0, k - 1)) for k in window]
    padding = tuple((b, k - 1 - b) for b, k in zip(before, window))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 40)), draw(st.integers(1, 20)), draw(st.integers(1, 20)))
    return shape, window, padding


@settings(max_examples=25, deadline=None)
@given(case=st.composite(_same_size_pool_case)(), seed=st.integers(0, 2**16))
def test_same_size_stride_1_max_pools_match_reference(case, seed):
    """GoogLeNet's 3x3 pools with padding 1, and every other stride-1 window
    padded to keep the plane's size, run over each plane as one flat run:
    taps off a lane's row, padding and partial last vectors, NaN and Inf."""
    shape, window, padding = case
    rng = np.random.default_rng(seed)
    x = _normal(rng, shape)
    x.reshape(-1)[rng.integers(0, x.size, 3)] = [np.nan, np.inf, -np.inf]
    got = kernels.max_pool2d(x, window, (1, 1), padding)
    np.testing.assert_array_equal(got, kernels.max_pool2d_reference(x, window, (1, 1), padding))


@pytest.mark.parametrize("shape, window, stride, padding", [
    ((1, 128, 55, 55), (3, 3), (2, 2), ((0, 0), (0, 0))),  # SqueezeNet's: a row of 27 outputs, two vectors
    ((1, 256, 27, 27), (3, 3), (2, 2), ((0, 0), (0, 0))),  # whole vectors read and stored past each row
    ((3, 40, 13, 13), (3, 3), (2, 2), ((0, 0), (0, 0))),   # rows of 6: stores run into the next planes, not a task's
    ((1, 4, 112, 112), (3, 3), (2, 2), ((0, 1), (0, 1))),  # GoogLeNet's first: whole vectors, the last window in padding
    ((1, 3, 56, 56), (3, 3), (2, 2), ((0, 1), (0, 1))),    # GoogLeNet's ceil mode: the last window ends in padding
    ((2, 3, 9, 70), (2, 3), (3, 2), ((1, 0), (0, 2))),     # window rows in the top padding, 35 outputs a row
    ((1, 2, 7, 3), (4, 3), (1, 2), ((2, 2), (0, 0))),      # one output a row, rows wholly in the padding
    ((1, 2, 6, 32), (3, 3), (2, 2), ((0, 1), (0, 1))),     # whole vectors only, no partial one
    ((1, 8, 14, 14), (2, 2), (2, 2), ((0, 0), (0, 0))),    # GoogLeNet's 2x2: a row shorter than a vector
    ((1, 3, 7, 33), (2, 2), (2, 2), ((0, 1), (0, 1))),     # 2-wide in ceil mode: 17 outputs a row
    ((2, 2, 9, 40), (3, 2), (2, 2), ((1, 1), (0, 0))),     # 2-wide under 3 rows, a row in the top padding
    ((1, 2, 4, 40), (2, 3), (1, 2), ((3, 0), (0, 0))),     # windows wholly in the top padding: -inf rows
    ((1, 2, 4, 40), (3, 2), (2, 2), ((4, 1), (0, 1))),
])
def test_max_pools_2_or_3_wide_at_column_stride_2_match_reference(shape, window, stride, padding):
    """The 2- and 3-wide, column-stride-2 windows without left padding that
    pool.cc computes in registers (2 or 3 window rows unrolled, any other
    count looped): NaN and Inf where they fall, right padding as -inf. Every
    one of several calls: the whole vectors a task stores past a row must
    never reach another task's planes, which a helper may have written first."""
    rng = np.random.default_rng(0)
    x = _normal(rng, shape)
    x.reshape(-1)[rng.integers(0, x.size, 6)] = [np.nan, np.inf, -np.inf, np.nan, np.inf, -np.inf]
    want = kernels.max_pool2d_reference(x, window, stride, padding)
    for _ in range(5):
        np.testing.assert_array_equal(kernels.max_pool2d(x, window, stride, padding), want)


@pytest.mark.parametrize("shape, window, stride, padding", [
    ((1, 5, 37, 45), (3, 3), (2, 2), ((1, 1), (1, 1))),    # rows of several vectors, stride 2
    ((2, 3, 33, 50), (2, 5), (3, 1), ((0, 2), (2, 0))),    # stride 3, padding on one side only
    ((1, 4, 20, 70), (4, 3), (1, 3), ((2, 2), (0, 2))),    # stride-3 columns over a long row
    ((1, 17, 7, 7), (7, 7), (7, 7), ((0, 0), (0, 0))),     # one window over the whole plane
    ((2, 3, 5, 19), (5, 19), (1, 1), ((0, 0), (0, 0))),    # the same, wider than a vector
    ((1, 2, 330, 330), (3, 3), (2, 2), ((1, 1), (1, 1))),  # 165 output rows: 4 groups of rows (64 KB each)
])
def test_pools_over_wide_rows_and_whole_planes(getkey, shape, window, stride, padding):
    x = np.array(jax.random.normal(getkey(), shape, jnp.float32))
    x.reshape(-1)[[2, 50]] = np.nan  # NaN reaches a max and a mean as in jnp
    for include_pad in (True, False):
        np.testing.assert_allclose(kernels.avg_pool2d(x, window, stride, padding, include_pad),
                                   kernels.avg_pool2d_reference(x, window, stride, padding, include_pad), **TOL)
    np.testing.assert_allclose(kernels.max_pool2d(x, window, stride, padding),
                               kernels.max_pool2d_reference(x, window, stride, padding), **TOL)

def _with_nonfinite(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(-1).copy()
    flat[[3, 17]] = np.nan
    flat[[8, 40]] = np.inf
    flat[25] = -np.inf
    return flat.reshape(x.shape)


_NONFINITE_CASES = {
    "conv_direct": (lambda x, w: kernels.conv2d(x, w, algorithm="direct", padding=((1, 1), (1, 1)), activation="relu"),
                    lambda x, w: kernels.conv2d_reference(x, w, padding=((1, 1), (1, 1)), activation="relu")),
    "conv_smm": (lambda x, w: kernels.conv2d(x, w, algorithm="smm", stride=(2, 1), activation="relu6"),
                 lambda x, w: kernels.conv2d_reference(x, w, stride=(2, 1), activation="relu6")),
    "conv_grouped": (lambda x, w: kernels.conv2d(x, w[:, :1], algorithm="grouped", groups=2, padding=((1, 1), (1, 1))),
                     lambda x, w: kernels.conv2d_reference(x, w[:, :1], groups=2, padding=((1, 1), (1, 1)))),
    "dense_gemv": (lambda x, w: kernels.dense(x.reshape(2, 36), w.reshape(36, -1)[:, :5]),
                   lambda x, w: kernels.dense_reference(x.reshape(2, 36), w.reshape(36, -1)[:, :5])),
    "dense_gemm": (lambda x, w: kernels.dense(x.reshape(9, -1), x.reshape(-1, 9)),
                   lambda x, w: kernels.dense_reference(x.reshape(9, -1), x.reshape(-1, 9))),
    "dense_gemv_nk": (lambda x, w: kernels.dense(x.reshape(2, 36), x.reshape(2, 36), transpose_w=True),
                      lambda x, w: kernels.dense_reference(x.reshape(2, 36), x.reshape(2, 36), transpose_w=True)),
    "max_pool": (lambda x, w: kernels.max_pool2d(x, (2, 2), (1, 1), ((1, 0), (0, 1))),
                 lambda x, w: kernels.max_pool2d_reference(x, (2, 2), (1, 1), ((1, 0), (0, 1)))),
    "avg_pool": (lambda x, w: kernels.avg_pool2d(x, (3, 3), (2, 2), ((1, 1), (1, 1)), False),
                 lambda x, w: kernels.avg_pool2d_reference(x, (3, 3), (2, 2), ((1, 1), (1, 1)), False)),
}


@pytest.mark.parametrize("name", sorted(_NONFINITE_CASES))
def test_nan_and_inf_propagate_like_reference(name):
    rng = np.random.default_rng(3)
    x, w = _with_nonfinite(_normal(rng, (1, 2, 6, 6))), _normal(rng, (4, 2, 3, 3))
    kernel, reference = _NONFINITE_CASES[name]
    got, want = np.asarray(kernel(x, w)), np.asarray(reference(x, w))
    assert not np.isfinite(want).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got, want, **TOL)


def _residual(x):
    """A (2, 6, 7, 6) residual computed from x (2, 4, 7, 6)."""
    return jnp.concatenate([x, x[:, :2] * 0.5], axis=1)


_GRAD_CASES = {
    "conv_direct": (lambda x, w, b: kernels.conv2d(x, w, b, algorithm="direct", stride=(2, 2), groups=2, activation="leaky_relu", alpha=0.1),
                    lambda x, w, b: kernels.conv2d_reference(x, w, b, stride=(2, 2), groups=2, activation="leaky_relu", alpha=0.1)),
    "conv_smm": (lambda x, w, b: kernels.conv2d(x, w, b, algorithm="smm", padding=((1, 0), (0, 2)), groups=2, activation="relu"),
                 lambda x, w, b: kernels.conv2d_reference(x, w, b, padding=((1, 0), (0, 2)), groups=2, activation="relu")),
    # The residual is a function of x too, so its gradient path is checked.
    "conv_smm_residual": (lambda x, w, b: kernels.conv2d(x, w, b, algorithm="smm", padding=((1, 1), (1, 1)), groups=2, activation="relu", residual=_residual(x)),
                          lambda x, w, b: kernels.conv2d_reference(x, w, b, padding=((1, 1), (1, 1)), groups=2, activation="relu", residual=_residual(x))),
    "conv_grouped_residual": (lambda x, w, b: kernels.conv2d(x, w, b, algorithm="grouped", padding=((1, 1), (1, 1)), groups=2, activation="relu", residual=_residual(x)),
                              lambda x, w, b: kernels.conv2d_reference(x, w, b, padding=((1, 1), (1, 1)), groups=2, activation="relu", residual=_residual(x))),
    "conv_winograd_residual": (lambda x, w, b: kernels.conv2d(x[:, :2], w, b, algorithm="winograd", padding=((1, 1), (1, 1)), residual=_residual(x)),
                               lambda x, w, b: kernels.conv2d_reference(x[:, :2], w, b, padding=((1, 1), (1, 1)), residual=_residual(x))),
    "dense_gemm": (lambda x, w, b: kernels.dense(x.reshape(28, 12), w.reshape(-1, 6)[:12], b, activation="relu6"),
                   lambda x, w, b: kernels.dense_reference(x.reshape(28, 12), w.reshape(-1, 6)[:12], b, activation="relu6")),
    "dense_gemv": (lambda x, w, b: kernels.dense(x[0, 0, :2], w.reshape(-1, 6)[:6], b, activation="clip", clip=(-1, 1), transpose_w=True),
                   lambda x, w, b: kernels.dense_reference(x[0, 0, :2], w.reshape(-1, 6)[:6], b, activation="clip", clip=(-1, 1), transpose_w=True)),
    "dense_gemm_residual": (lambda x, w, b: kernels.dense(x.reshape(28, 12), w.reshape(-1, 6)[:12], b, activation="silu", residual=x.reshape(28, 12)[:, :6]),
                            lambda x, w, b: kernels.dense_reference(x.reshape(28, 12), w.reshape(-1, 6)[:12], b, activation="silu", residual=x.reshape(28, 12)[:, :6])),
    "softmax": (lambda x, w, b: kernels.softmax(x), lambda x, w, b: kernels.softmax_reference(x)),
    "layer_norm": (lambda x, w, b: kernels.layer_norm(x, b, w[:, 0, 0, 0], epsilon=1e-2),
                   lambda x, w, b: kernels.layer_norm_reference(x, b, w[:, 0, 0, 0], 1e-2)),
    "pools": (lambda x, w, b: kernels.max_pool2d(x, (2, 2), (2, 2)).sum() + kernels.avg_pool2d(x, (3, 3), (1, 1), ((1, 1), (1, 1)), False).sum() + kernels.global_avg_pool2d(x).sum(),
              lambda x, w, b: kernels.max_pool2d_reference(x, (2, 2), (2, 2), ((0, 0), (0, 0))).sum() + kernels.avg_pool2d_reference(x, (3, 3), (1, 1), ((1, 1), (1, 1)), False).sum() + kernels.global_avg_pool2d_reference(x).sum()),
}


@pytest.mark.parametrize("name", sorted(_GRAD_CASES))
def test_grad_matches_reference_grad(name, getkey, tree_allclose):
    x = jax.random.normal(getkey(), (2, 4, 7, 6))
    w = jax.random.normal(getkey(), (6, 2, 3, 3))
    b = jax.random.normal(getkey(), (6,))
    kernel, reference = _GRAD_CASES[name]

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a)))

    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(x, w, b)
    assert tree_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_kernels_work_under_jit_and_vmap(getkey, tree_allclose):
    xs = jax.random.normal(getkey(), (2, 2, 4, 9, 8))
    w = jax.random.normal(getkey(), (5, 4, 3, 3))
    dw = jax.random.normal(getkey(), (4 * 9 * 8, 7))

    def model(conv, dense, pool):
        def f(x):
            y = conv(x, w, padding=((1, 1), (1, 1)), activation="relu")
            y = pool(y, (2, 2), (2, 2), ((0, 0), (0, 0)))
            return dense(x.reshape(x.shape[0], -1), dw), y

        return f

    fast = model(kernels.conv2d, kernels.dense, kernels.max_pool2d)
    slow = model(kernels.conv2d_reference, kernels.dense_reference, kernels.max_pool2d_reference)
    assert tree_allclose(jax.jit(jax.vmap(fast))(xs), jax.vmap(slow)(xs), rtol=1e-4, atol=1e-4)
    assert tree_allclose(jax.vmap(jax.jit(fast))(xs), jax.vmap(slow)(xs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.int32])
def test_non_float32_raises_unsupported(dtype):
    x, w = jnp.ones((1, 2, 5, 5), dtype), jnp.ones((3, 2, 3, 3), dtype)
    with pytest.raises(jtile.UnsupportedError, match="float32"):
        kernels.conv2d(x, w)
    with pytest.raises(jtile.UnsupportedError, match="float32"):
        kernels.dense(x[0, 0], w[0, 0])
    with pytest.raises(jtile.UnsupportedError, match="float32"):
        kernels.max_pool2d(x, (2, 2), (2, 2))
    reason = kernels.conv2d_support("smm", x_shape=x.shape, w_shape=w.shape, stride=(1, 1),
                                    padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1, dtype=dtype)
    assert "float32" in reason


def test_conv2d_support_explains_what_cannot_run():
    geometry = dict(x_shape=(1, 4, 8, 8), w_shape=(6, 2, 3, 3), stride=(1, 1), dilation=(1, 1),
                    dtype=jnp.float32)
    assert kernels.conv2d_support("smm", padding=((1, 1), (1, 1)), groups=2, **geometry) is None
    assert "groups" in kernels.conv2d_support("direct", padding=((0, 0), (0, 0)), groups=3, **geometry)
    assert "negative padding" in kernels.conv2d_support("direct", padding=((-1, 0), (0, 0)), groups=2, **geometry)
    with pytest.raises(jtile.ConfigError, match="unknown algorithm 'fft'"):
        kernels.conv2d_support("fft", padding=((0, 0), (0, 0)), groups=2, **geometry)
    with pytest.raises(jtile.UnsupportedError, match="cannot run this layer"):
        kernels.conv2d(jnp.ones((1, 4, 8, 8)), jnp.ones((6, 2, 3, 3)), groups=3)


def test_bad_arguments_raise_config_error():
    x = jnp.ones((1, 2, 5, 5))
    with pytest.raises(jtile.ConfigError, match="unknown activation 'swish'"):
        kernels.conv2d(x, jnp.ones((3, 2, 3, 3)), activation="swish")
    with pytest.raises(jtile.ConfigError, match=r"residual must have the output's shape \(1, 3, 3, 3\)"):
        kernels.conv2d(x, jnp.ones((3, 2, 3, 3)), algorithm="smm", residual=jnp.ones((1, 3, 5, 5)))
    with pytest.raises(jtile.ConfigError, match="do not chain"):
        kernels.dense(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(jtile.ConfigError, match="does not fit"):
        kernels.max_pool2d(x, (7, 7), (1, 1))


def test_missing_library_imports_and_explains_how_to_build():
    script = (
        "import jax.numpy as jnp, jtile\n"
        "from jtile import kernels\n"
        "try:\n"
        "    kernels.dense(jnp.ones((1, 2)), jnp.ones((2, 2)))\n"
        "except jtile.UnsupportedError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, JTILE_KERNELS_LIB="/nonexistent/libjtile_kernels.so", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                         text=True, check=True).stdout
    assert "not built" in out and "pip install ." in out


# ------------------------------------------------------------------ resize

_RESIZE = dict(nearest_mode="round_prefer_floor", coords="half_pixel", cubic_a=-0.75, exclude_outside=0,
               extrapolation=0.0, antialias=0)


@pytest.mark.parametrize(
    "x_shape, out_hw, how",
    [
        ((1, 21, 28, 28), (224, 224), dict(mode="linear")),            # DeepLabV3's head: x8, rows in two vectors
        ((2, 3, 9, 40), (20, 100), dict(mode="linear")),               # rows wider than two vectors: gathers
        ((1, 4, 17, 23), (9, 11), dict(mode="linear", antialias=1)),   # antialiased downsampling: many taps
        ((1, 2, 6, 7), (13, 15), dict(mode="nearest", nearest_mode="floor", coords="asymmetric")),
        ((1, 3, 8, 5), (19, 12), dict(mode="cubic", exclude_outside=1)),
        ((3, 7, 10), (25, 4), dict(mode="linear", coords="align_corners")),  # rank 3, W shrinks
        ((1, 2, 5, 6), (5, 18), dict(mode="linear", coords="pytorch_half_pixel")),  # H kept
    ],
)
def test_resize_kernel_matches_the_jnp_resize(x_shape, out_hw, how):
    from jtile import _fused
    from jtile.algorithms import swap_backend

    x = _normal(np.random.default_rng(7), x_shape)
    x[..., 1, 2] = np.nan
    x[..., -1, -1] = np.inf
    sizes = (*x_shape[:-2], *out_hw)
    scales = (*(1.0,) * (len(x_shape) - 2), out_hw[0] / x_shape[-2], out_hw[1] / x_shape[-1])
    params = dict(_RESIZE, **how, sizes=sizes, scales=scales, roi=((0.0, 1.0),) * len(x_shape))

    def fn(x):
        return _fused.resize(x, **params)

    swapped = swap_backend(fn, algorithms={"resize": "direct"})
    assert "jtile_resize2d" in str(jax.make_jaxpr(swapped)(x))
    got, want = np.asarray(jax.jit(swapped)(x)), np.asarray(jax.jit(fn)(x))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_resize_kernel_rejects_taps_outside_the_input():
    x = jnp.ones((1, 1, 4, 4))
    taps, weights = np.array([[0], [4]]), np.ones((2, 1))
    with pytest.raises(jtile.ConfigError, match="inside the 4x4 input"):
        kernels.resize2d(x, taps, weights, np.array([[0]]), np.ones((1, 1)))


# Convs writing into a concatenation's buffer (`into=`): each part lands in its
# channels, the others keep what earlier parts wrote.
@pytest.mark.parametrize("algorithm, size, kernel, groups", [
    ("smm", 23, 1, 1),        # channel rows, x read in place
    ("smm", 9, 3, 1),         # pixel rows
    ("winograd", 14, 3, 1),
    ("grouped", 11, 3, 4),    # groups of 8 (two a vector, AVX-512) and of 3 (vectors spanning groups)
    ("grouped", 11, 3, 2),    # 16 channels a group: vectors within one
])
def test_conv_writes_into_a_concatenation(algorithm, size, kernel, groups):
    rng = np.random.default_rng(4)
    x = _normal(rng, (1, 8, size, size))
    pad = ((kernel // 2,) * 2,) * 2
    w1, w2 = _normal(rng, (32, 8 // groups, kernel, kernel)), _normal(rng, (12, 8 // groups, kernel, kernel))
    b1, b2, res = _normal(rng, 32), _normal(rng, 12), _normal(rng, (1, 12, size, size))
    kw = dict(algorithm=algorithm, padding=pad, groups=groups, activation="relu")

    @jax.jit
    def both(x):
        buffer = kernels.conv2d(x, w2, b2, residual=res, into=(50, 36), **kw)
        return kernels.conv2d(x, w1, b1, into=(buffer, 4), **kw)

    got = np.asarray(both(x))
    ref = dict(padding=pad, groups=groups, activation="relu")
    np.testing.assert_allclose(got[:, 4:36], kernels.conv2d_reference(x, w1, b1, **ref), rtol=1e-4, atol=3e-4)
    np.testing.assert_allclose(got[:, 36:48], kernels.conv2d_reference(x, w2, b2, residual=res, **ref),
                               rtol=1e-4, atol=3e-4)


@pytest.mark.parametrize("algorithm, into, message", [
    ("direct", (20, 0), "cannot write into"),
    ("smm", (20, 5), r"channels \[channel0, channel0 \+ 16\)"),
    ("smm", (np.zeros((1, 20, 6, 6), np.float32), 0), r"\(1, C, 7, 7\) buffer"),
])
def test_conv_into_refuses_what_it_cannot_write(algorithm, into, message):
    x, w = np.zeros((1, 4, 7, 7), np.float32), np.zeros((16, 4, 1, 1), np.float32)
    with pytest.raises(jtile.ConfigError, match=message):
        kernels.conv2d(x, w, algorithm=algorithm, into=into)
    with pytest.raises(jtile.ConfigError, match="one image"):
        kernels.conv2d(np.zeros((2, 4, 7, 7), np.float32), w, algorithm="smm", into=(16, 0))


# A conv whose call also max-pools its activated output (`max_pool=`): the
# image stem's conv, ReLU and pool.
@pytest.mark.parametrize("n, c, o, size, kernel, stride, groups, pool, activation", [
    (1, 3, 64, 45, 7, 2, 1, ((3, 3), (2, 2), ((1, 1), (1, 1))), "relu"),      # ResNet's stem, odd size
    (2, 3, 20, 17, 3, 2, 1, ((2, 2), (2, 2), ((0, 0), (0, 0))), "relu6"),     # a ragged block of lanes
    (1, 4, 64, 12, 3, 1, 2, ((3, 2), (1, 2), ((1, 0), (0, 1))), "silu"),      # groups, two blocks a task
    (1, 3, 16, 9, 3, 2, 1, ((5, 5), (3, 3), ((2, 2), (2, 2))), None),         # a window past the whole output
    (1, 3, 32, 23, 3, 2, 1, ((3, 3), (2, 2), ((0, 1), (0, 1))), "relu"),      # SqueezeNet's stem: ceil mode
    (1, 3, 16, 21, 3, 2, 1, ((3, 3), (2, 2), ((1, 1), (1, 1))), "hard_swish"),  # shared columns, act on each tap
    (1, 3, 16, 9, 3, 2, 1, ((2, 2), (2, 2), ((0, 3), (0, 3))), "relu"),       # windows wholly in padding: -inf
])
def test_conv_fuses_its_max_pool(n, c, o, size, kernel, stride, groups, pool, activation):
    rng = np.random.default_rng(5)
    x, w, b = _normal(rng, (n, c, size, size)), _normal(rng, (o, c // groups, kernel, kernel)), _normal(rng, o)
    config = dict(stride=(stride, stride), padding=((kernel // 2,) * 2,) * 2, groups=groups, activation=activation)
    got = np.asarray(kernels.conv2d(x, w, b, algorithm="grouped", max_pool=pool, **config))
    want = kernels.max_pool2d_reference(kernels.conv2d_reference(x, w, b, **config), *pool)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=3e-4)
    # the same bits as the two calls it replaces
    separate = kernels.max_pool2d(kernels.conv2d(x, w, b, algorithm="grouped", **config), *pool)
    np.testing.assert_array_equal(got, np.asarray(separate))


@pytest.mark.parametrize("algorithm, groups, extra, message", [
    ("smm", 1, {}, "'smm' takes no max_pool=; 'grouped' does"),
    ("grouped", 8, {}, "several groups"),  # 2 output channels a group
    ("grouped", 1, {"residual": np.zeros((1, 16, 7, 7), np.float32)}, "residual= or into="),
    ("grouped", 1, {"into": (32, 0)}, "residual= or into="),
    ("grouped", 1, {"max_pool": (3, 2)}, r"must be \(window, stride, padding\)"),
])
def test_conv_max_pool_refuses_what_it_cannot_fuse(algorithm, groups, extra, message):
    x, w = np.zeros((1, 8, 7, 7), np.float32), np.zeros((16, 8 // groups, 3, 3), np.float32)
    kw = {"max_pool": ((2, 2), (2, 2), ((0, 0), (0, 0))), **extra}
    with pytest.raises(jtile.ConfigError, match=message):
        kernels.conv2d(x, w, algorithm=algorithm, groups=groups, padding=((1, 1), (1, 1)), **kw)
    if algorithm == "smm":
        assert kernels.conv2d_max_pool_support("smm", x_shape=x.shape, w_shape=w.shape) is not None


# A 1x1 conv that applies a per-input-channel prologue, act((x - shift) * scale
# + bias), as it packs x (DenseNet's batch norm and ReLU before each 1x1 conv).
@pytest.mark.parametrize("n, c, o, size, activation", [
    (1, 40, 24, 7, "relu"),      # 49 pixels for 24 outputs: pixel rows
    (1, 40, 8, 7, "relu"),       # 49 pixels for 8 outputs: channel rows, a ragged strip of columns
    (2, 1100, 16, 9, None),      # two images, K past one K block
    (1, 24, 40, 12, "relu6"),
    (1, 1152, 200, 5, None),     # pixel rows (a squeeze-excitation's scale before a projection)
    (1, 1100, 130, 5, "relu"),   # pixel rows, K past one K block, ragged strips both ways
])
@pytest.mark.parametrize("sizes", ["CCC", "1-C", "-C-"])  # per channel, one for all, or none (the identity)
def test_pointwise_conv_applies_its_prologue(n, c, o, size, activation, sizes):
    rng = np.random.default_rng(6)
    x, w, b = _normal(rng, (n, c, size, size)), _normal(rng, (o, c, 1, 1)), _normal(rng, o)
    values = [None if k == "-" else _normal(rng, c if k == "C" else 1) for k in sizes]
    conv = lambda x: kernels.conv2d(x, w, b, algorithm="smm", activation="relu",  # noqa: E731
                                    prologue=(*values, activation))
    (call,) = [e for e in iter_eqns(jax.make_jaxpr(conv)(x).jaxpr) if e.primitive.name == "ffi_call"]
    # one image under 4 pixels an output channel: pixel rows, which apply the prologue to one copy of x
    assert int(dict(call.params["attributes"])["pixel_rows"]) == (n == 1 and size * size < 4 * o)
    got = conv(x)
    want = kernels.conv2d_reference(_prologue_reference(x, *values, activation), w, b, activation="relu")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=3e-4)


@pytest.mark.parametrize("n, c, o, size, pixel_rows", [
    (1, 96, 24, 56, False),    # EfficientNet-B0's projection after its squeeze-excitation at 56x56
    (2, 1100, 40, 28, False),  # two images, K past one K block, a ragged strip of 40 rows
    (1, 72, 40, 29, False),    # 841 pixels: a ragged strip of columns, packed
    (1, 480, 112, 14, True),   # MobileNetV3's at 14x14: 196 pixels for 112 outputs
    (2, 480, 112, 14, False),  # the same on two images: pixel rows would take one
    (2, 512, 512, 5, False),   # two images, 25 pixels for 512 outputs: channel rows, packing the scaled x
])
def test_a_scale_only_prologue_scales_the_weights_or_a_copy_of_x(n, c, o, size, pixel_rows):
    """A 1x1 conv whose prologue only scales x (a squeeze-excitation's) runs
    in channel rows from 4 pixels an output channel (or on several images),
    where it scales the weights as the GEMM packs them once and reads x in
    place, and in pixel rows below, where it scales a copy of x."""
    rng = np.random.default_rng(8)
    x, w, b = _normal(rng, (n, c, size, size)), _normal(rng, (o, c, 1, 1)), _normal(rng, o)
    scale = _normal(rng, c)
    conv = lambda x: kernels.conv2d(x, w, b, algorithm="smm", activation="relu6",  # noqa: E731
                                    prologue=(None, scale, None, None))
    (call,) = [e for e in iter_eqns(jax.make_jaxpr(conv)(x).jaxpr) if e.primitive.name == "ffi_call"]
    assert int(dict(call.params["attributes"])["pixel_rows"]) == pixel_rows
    got = conv(x)
    want = kernels.conv2d_reference(x * scale[:, None, None], w, b, activation="relu6")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=3e-4)


@pytest.mark.parametrize("c, o, size, stride, pixel_rows", [
    (40, 24, 28, (2, 2), False),    # channel rows
    (1152, 200, 10, (2, 2), True),  # pixel rows: 25 output pixels
    (24, 16, 9, (3, 2), True),      # 15 pixels for 16 outputs
    (24, 4, 17, (3, 2), False),     # 54 pixels for 4 outputs
])
def test_strided_pointwise_conv_applies_its_prologue_to_the_pixels_it_reads(c, o, size, stride, pixel_rows):
    """A strided 1x1 conv copies the pixels it reads, then packs them with the prologue."""
    rng = np.random.default_rng(7)
    x, w = _normal(rng, (1, c, size, size)), _normal(rng, (o, c, 1, 1))
    values = [_normal(rng, c) for _ in range(3)]
    conv = lambda x: kernels.conv2d(x, w, algorithm="smm", stride=stride, prologue=(*values, "relu"))  # noqa: E731
    (call,) = [e for e in iter_eqns(jax.make_jaxpr(conv)(x).jaxpr) if e.primitive.name == "ffi_call"]
    assert int(dict(call.params["attributes"])["pixel_rows"]) == pixel_rows
    want = kernels.conv2d_reference(_prologue_reference(x, *values, "relu"), w, stride=stride)
    np.testing.assert_allclose(np.asarray(conv(x)), want, rtol=1e-4, atol=3e-4)


# A conv that reads the first channels of a larger x (a concatenation's buffer
# that later parts extend, as in DenseNet's dense blocks).
@pytest.mark.parametrize("c, extra, o, size, window, groups, prologue", [
    (40, 56, 24, 7, 1, 1, True),    # DenseNet's 1x1 conv after its batch norm and ReLU
    (40, 8, 24, 9, 1, 1, False),
    (24, 40, 16, 11, 3, 1, False),  # padded 3x3, im2col gathered from the buffer
    (512, 32, 512, 7, 1, 1, False),  # pixel rows (smm_pixel_rows)
    (16, 16, 8, 6, 3, 2, False),    # two groups
])
def test_conv_reads_the_first_channels_of_a_larger_input(c, extra, o, size, window, groups, prologue):
    rng = np.random.default_rng(8)
    buffer, w, b = _normal(rng, (1, c + extra, size, size)), _normal(rng, (o, c // groups, window, window)), \
        _normal(rng, o)
    kw = dict(padding=((window // 2,) * 2,) * 2, groups=groups, activation="relu")
    if prologue:
        kw["prologue"] = (_normal(rng, c), _normal(rng, c), _normal(rng, c), "relu")
    got = jax.jit(lambda buffer: kernels.conv2d(buffer, w, b, algorithm="smm", reads_prefix=True, **kw))(buffer)
    x = buffer[:, :c]
    if prologue:
        shift, scale, bias, _ = (np.asarray(v)[:, None, None] if i < 3 else v for i, v in enumerate(kw.pop("prologue")))
        x = np.maximum((x - shift) * scale + bias, 0)
    np.testing.assert_allclose(np.asarray(got), kernels.conv2d_reference(x, w, b, **kw), rtol=1e-4, atol=3e-4)


@pytest.mark.parametrize("algorithm, x_shape, message", [
    ("winograd", (1, 12, 7, 7), "'winograd' takes no reads_prefix=True; 'smm' does"),
    ("smm", (2, 12, 7, 7), r"needs one NCHW image with at least the 8 channels .* got x \(2, 12, 7, 7\)"),
    ("smm", (1, 6, 7, 7), r"at least the 8 channels"),
])
def test_conv_reads_prefix_refuses_what_it_cannot_read(algorithm, x_shape, message):
    x, w = np.zeros(x_shape, np.float32), np.zeros((16, 8, 3, 3), np.float32)
    with pytest.raises(jtile.ConfigError, match=message):
        kernels.conv2d(x, w, algorithm=algorithm, padding=((1, 1), (1, 1)), reads_prefix=True)


@pytest.mark.parametrize("algorithm, w_shape, groups, prologue, message", [
    ("grouped", (16, 8, 1, 1), 1, None, "'grouped' takes no prologue=; 'smm' does"),
    ("smm", (16, 8, 3, 3), 1, None, r"a prologue is applied to a 1x1"),
    ("smm", (16, 4, 1, 1), 2, None, r"2 group\(s\)"),
    ("smm", (16, 8, 1, 1), 1, (np.zeros(7, np.float32),) * 3 + ("relu",), r"have shape \(8,\) or \(1,\)"),
    ("smm", (16, 8, 1, 1), 1, (np.zeros(8, np.float32),) * 3 + ("gelu",), "must be None, 'relu' or 'relu6'"),
])
def test_conv_prologue_refuses_what_it_cannot_apply(algorithm, w_shape, groups, prologue, message):
    c = w_shape[1] * groups
    x, w = np.zeros((1, c, 7, 7), np.float32), np.zeros(w_shape, np.float32)
    prologue = prologue or (np.zeros(c, np.float32), np.ones(c, np.float32), np.zeros(c, np.float32), "relu")
    with pytest.raises(jtile.ConfigError, match=message):
        kernels.conv2d(x, w, algorithm=algorithm, groups=groups, prologue=prologue)


# An average pool that applies a per-channel prologue, act((x - shift) * scale
# + bias), as it reads x: DenseNet's transition batch norm and ReLU once its
# pool runs before the 1x1 conv. The padding is the pooled value's (0).
@pytest.mark.parametrize("shape, window, stride, padding, include_pad", [
    ((1, 32, 56, 56), (2, 2), (2, 2), ((0, 0), (0, 0)), True),   # a transition's pool
    ((2, 5, 9, 11), (3, 3), (2, 2), ((1, 1), (1, 1)), False),    # batch 2, odd sizes, padding not counted
    ((1, 3, 37, 45), (3, 2), (1, 3), ((2, 0), (0, 1)), True),    # rows of several vectors, padding counted
])
@pytest.mark.parametrize("activation, sizes", [
    (None, "CCC"), ("relu", "CCC"), ("relu6", "CCC"),
    ("relu", "-1C"),  # no shift (its identity), one scale for every channel
    (None, "-C-"),   # a squeeze-excitation's scale alone
])
def test_average_pool_applies_its_prologue(shape, window, stride, padding, include_pad, activation, sizes):
    rng = np.random.default_rng(sum(shape))
    x = _normal(rng, shape)
    x.reshape(-1)[[1, 40]] = [np.nan, np.inf]
    values = [None if n == "-" else _normal(rng, shape[1] if n == "C" else 1) for n in sizes]
    got = kernels.avg_pool2d(x, window, stride, padding, include_pad, prologue=(*values, activation))
    np.testing.assert_allclose(got, kernels.avg_pool2d_reference(_prologue_reference(x, *values, activation), window,
                                                                 stride, padding, include_pad), **TOL)


def _prologue_reference(x, shift, scale, bias, activation):
    """act((x - shift) * scale + bias) per channel of NCHW x, a None its identity."""
    at = lambda v, identity: identity if v is None else v[:, None, None]  # noqa: E731
    return kernels.activation_reference((x - at(shift, 0.0)) * at(scale, 1.0) + at(bias, 0.0), activation)


@pytest.mark.parametrize("window, prologue, message", [
    ((7, 7), None, "the window is the whole image"),
    ((2, 2), (np.zeros(8, np.float32),) * 3 + ("silu",), "must be None, 'relu' or 'relu6'"),
    ((2, 2), (np.zeros(4, np.float32),) * 3 + ("relu",), r"None or have shape \(8,\) or \(1,\)"),
])
def test_average_pool_prologue_refuses_what_it_cannot_apply(window, prologue, message):
    prologue = prologue or (np.zeros(8, np.float32), np.ones(8, np.float32), np.zeros(8, np.float32), "relu")
    with pytest.raises(jtile.ConfigError, match=message):
        kernels.avg_pool2d(np.zeros((1, 8, 7, 7), np.float32), window, window, prologue=prologue)


def _bias_operands(fn, *args) -> list[tuple[int, ...]]:
    """The shape of every kernel call's bias operand (its third), as traced."""
    return [e.invars[2].aval.shape for e in iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "ffi_call"]


@pytest.mark.parametrize("algorithm, x_shape, w_shape, groups", [
    ("direct", (1, 4, 9, 9), (6, 4, 3, 3), 1),
    ("smm", (2, 8, 9, 9), (24, 8, 3, 3), 1),
    ("grouped", (1, 32, 9, 9), (32, 4, 3, 3), 8),
    ("winograd", (1, 16, 12, 12), (16, 16, 3, 3), 1),
    ("depthwise", (1, 16, 10, 10), (16, 1, 3, 3), 16),
])
@pytest.mark.parametrize("bias", ["none", "constant", "varied"])
def test_a_constant_bias_reaches_the_kernel_as_one_float(algorithm, x_shape, w_shape, groups, bias):
    """A missing bias, or one known to repeat a value, is passed as one float
    (XLA would broadcast a constant of equal floats on every call); the
    result is the reference's either way."""
    rng = np.random.default_rng(7)
    x, w = _normal(rng, x_shape), _normal(rng, w_shape) * 0.2
    b = {"none": None, "constant": np.full(w_shape[0], -0.75, np.float32), "varied": _normal(rng, w_shape[0])}[bias]
    kw = dict(groups=groups, padding=((1, 1), (1, 1)), activation="relu")
    f = jax.jit(lambda x: kernels.conv2d(x, w, b, algorithm=algorithm, **kw))
    assert _bias_operands(f, x) == [(1,) if bias != "varied" else (w_shape[0],)]
    np.testing.assert_allclose(f(x), kernels.conv2d_reference(x, w, b, **kw), **TOL)


@pytest.mark.parametrize("rows", [1, 40])
def test_dense_and_expanded_take_a_constant_bias_as_one_float(rows):
    rng = np.random.default_rng(8)
    x, w, b = _normal(rng, (rows, 24)), _normal(rng, (24, 40)), np.full(40, 0.5, np.float32)
    f = jax.jit(lambda x: kernels.dense(x, w, b, activation="relu"))
    assert _bias_operands(f, x) == [(1,)]
    np.testing.assert_allclose(f(x), kernels.dense_reference(x, w, b, activation="relu"), **TOL)
    xe, we, wd = _normal(rng, (1, 8, 10, 10)), _normal(rng, (32, 8, 1, 1)), _normal(rng, (32, 1, 3, 3))
    g = jax.jit(lambda x: kernels.expanded_depthwise_conv2d(x, we, np.full(32, 0.25, np.float32), wd, None,
                                                            padding=((1, 1), (1, 1)), expand_activation="relu6"))
    call = [e for e in iter_eqns(jax.make_jaxpr(g)(xe).jaxpr) if e.primitive.name == "ffi_call"][0]
    assert [call.invars[i].aval.shape for i in (2, 4)] == [(1,), (1,)]  # b, expand_b
    e = kernels.conv2d_reference(xe, we, np.full(32, 0.25, np.float32), activation="relu6")
    np.testing.assert_allclose(g(xe), kernels.conv2d_reference(e, wd, padding=((1, 1), (1, 1)), groups=32),
                               rtol=2e-4, atol=2e-4)
