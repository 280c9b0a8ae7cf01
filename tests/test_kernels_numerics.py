"""Numerics of every C kernel against XLA: non-finite inputs, error against a
float64 reference, and the same bits for any thread count.

- Non-finite: NaN, +Inf and -Inf at random positions of the input must come
  out where XLA's own op (`lax.conv_general_dilated`, `jnp.dot`,
  `lax.reduce_window`, `jnp.mean`) puts them, with the same signs, and the
  finite values must agree.
- Accuracy: each kernel's error on representative layers stays within the
  bound `jtile.kernels.TOLERANCE` documents.
- Determinism: the kernels run in subprocesses pinned to one CPU and to two
  (XLA sizes its intra-op pool by the CPU affinity, and the kernels take as
  many threads as it has); the outputs must be bit-identical.
"""

import json
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

from jtile import kernels


def _normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


# XLA's own activations, for the kernels' fused ones (hard ones as ONNX writes
# them, with alpha 1/6 and beta 0.5: HardSwish).
XLA_ACTIVATIONS = {
    None: lambda y: y, "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "silu": jax.nn.silu,
    "hard_sigmoid": lambda y: jnp.clip(y * np.float32(1 / 6) + np.float32(0.5), 0.0, 1.0),
    "hard_swish": lambda y: y * jnp.clip(y * np.float32(1 / 6) + np.float32(0.5), 0.0, 1.0),
    "gelu": lambda y: jax.nn.gelu(y, approximate=False), "gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True),
}
HARD = dict(alpha=1 / 6, beta=0.5)


def _conv_case(x_shape, w_shape, algorithm, **config):
    def make(rng):
        return _normal(rng, x_shape), _normal(rng, w_shape), _normal(rng, w_shape[0])

    def kernel(x, w, b):
        return kernels.conv2d(x, w, b, algorithm=algorithm, **config, **HARD)

    def reference(x, w, b):
        y = lax.conv_general_dilated(
            x, w, config.get("stride", (1, 1)), config.get("padding", ((0, 0), (0, 0))),
            rhs_dilation=config.get("dilation", (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"),
            feature_group_count=config.get("groups", 1))
        y = XLA_ACTIVATIONS[config.get("activation")](y + b[None, :, None, None])
        if "max_pool" in config:
            window, stride, padding = config["max_pool"]
            y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, *window), (1, 1, *stride), ((0, 0), (0, 0), *padding))
        return y

    return make, kernel, reference


def _dense_case(m, k, n, transpose_w=False, traced=False, activation=None):
    def make(rng):
        w_shape = (n, k) if transpose_w else (k, n)
        return _normal(rng, (m, k)), _normal(rng, w_shape), _normal(rng, n)

    def kernel(x, w, b):
        call = lambda x, w, b: kernels.dense(x, w, b, transpose_w=transpose_w, activation=activation, **HARD)  # noqa: E731
        return jax.jit(call)(x, w, b) if traced else call(x, w, b)

    def reference(x, w, b):
        return XLA_ACTIVATIONS[activation](jnp.dot(x, w.T if transpose_w else w) + b)

    return make, kernel, reference


def _pool_case(x_shape, kernel, reference):
    return lambda rng: (_normal(rng, x_shape),), kernel, reference


_POOL = dict(window=(3, 3), stride=(2, 2), padding=((1, 1), (0, 1)))

def _prologue_case(x_shape, o, scale_only=False):
    """A 1x1 smm conv applying a batch norm and ReLU to x as it packs it, or
    (`scale_only`) a squeeze-excitation's scale, which it applies to the weights."""
    c = x_shape[1]

    def make(rng):
        return _normal(rng, x_shape), _normal(rng, (o, c, 1, 1)), _normal(rng, (3, c))

    def kernel(x, w, p):
        prologue = (None, p[1], None, None) if scale_only else (*p, "relu")
        return kernels.conv2d(x, w, algorithm="smm", prologue=prologue)

    def reference(x, w, p):
        shift, scale, bias = (v[None, :, None, None] for v in p)
        y = x * scale if scale_only else jax.nn.relu((x - shift) * scale + bias)
        return lax.conv_general_dilated(y, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))

    return make, kernel, reference


# name -> (make inputs from a numpy Generator, kernel, XLA's op). The first
# input is the activation that gets the non-finite values. Shapes are large
# enough that every kernel splits its work into several tasks.
CASES = {
    "conv_direct": _conv_case((2, 5, 17, 16), (6, 5, 3, 2), "direct", stride=(2, 1),
                              padding=((1, 0), (2, 1)), dilation=(1, 2)),
    "conv_direct_grouped": _conv_case((1, 6, 12, 12), (4, 3, 3, 3), "direct", groups=2,
                                      padding=((1, 1), (1, 1)), activation="relu"),
    "conv_smm_channel_rows": _conv_case((1, 6, 20, 20), (16, 6, 3, 3), "smm", padding=((1, 1), (1, 1))),
    "conv_smm_pointwise": _conv_case((2, 8, 9, 9), (16, 8, 1, 1), "smm"),
    "conv_smm_pixel_rows": _conv_case((2, 40, 7, 7), (64, 40, 3, 3), "smm", padding=((1, 1), (1, 1)),
                                      activation="relu"),
    # Many groups: smm runs one group's GEMM per task (channel and pixel rows).
    "conv_smm_many_groups": _conv_case((2, 32, 16, 15), (64, 2, 3, 3), "smm", groups=16,
                                       padding=((1, 1), (1, 1)), activation="relu"),
    "conv_smm_many_groups_pixel_rows": _conv_case((1, 64, 7, 7), (128, 8, 3, 3), "smm", groups=8,
                                                  stride=(1, 1), padding=((1, 1), (1, 1))),
    "conv_direct_many_groups": _conv_case((1, 64, 14, 14), (64, 2, 3, 3), "direct", groups=32,
                                          stride=(2, 2), padding=((1, 1), (1, 1))),
    # Blocks of output channels of one group, in bands whose split depends on the thread count.
    "conv_grouped": _conv_case((2, 64, 23, 19), (96, 4, 3, 3), "grouped", groups=16, stride=(1, 2),
                               padding=((1, 2), (0, 1)), activation="relu"),
    # Groups of 32 output channels: two blocks of W a task.
    "conv_grouped_two_blocks": _conv_case((1, 32, 11, 9), (128, 8, 3, 3), "grouped", groups=4,
                                          padding=((1, 1), (1, 1))),
    # Groups of 3 output channels at stride 1: vectors span five groups and a part.
    "conv_grouped_span_groups": _conv_case((2, 32, 15, 13), (48, 2, 3, 3), "grouped", groups=16,
                                           padding=((1, 1), (2, 0)), activation="relu"),
    # RegNet's groups of 8 output channels, two a vector (AVX-512), 13 groups: a ragged last vector.
    "conv_grouped_groups_per_vector": _conv_case((2, 104, 15, 13), (104, 8, 3, 3), "grouped", groups=13,
                                                 stride=(2, 1), padding=((1, 1), (2, 0)), activation="relu"),
    # The image stem: conv, activation and max pool in one call, in bands of pooled rows.
    "conv_grouped_max_pool": _conv_case((2, 3, 29, 26), (32, 3, 5, 5), "grouped", stride=(2, 2),
                                        padding=((2, 2), (2, 2)), activation="relu", max_pool=tuple(_POOL.values())),
    "conv_grouped_dilated": _conv_case((1, 12, 17, 15), (36, 4, 3, 2), "grouped", groups=3,
                                       dilation=(2, 1), padding=((2, 2), (1, 1))),
    "conv_smm_prologue": _prologue_case((2, 20, 9, 11), 24),
    # 99 pixels for 24 outputs: the scale goes to the weights, x is read in place
    "conv_smm_scale_prologue": _prologue_case((2, 20, 9, 11), 24, scale_only=True),
    "conv_winograd": _conv_case((2, 6, 13, 18), (5, 6, 3, 3), "winograd", padding=((1, 2), (0, 1))),
    "conv_winograd_panels": _conv_case((1, 16, 56, 56), (16, 16, 3, 3), "winograd",
                                       padding=((1, 1), (1, 1)), activation="relu"),
    "conv_winograd_blocks": _conv_case((2, 4, 78, 78), (4, 4, 3, 3), "winograd", padding=((1, 1), (1, 1))),
    "conv_depthwise": _conv_case((1, 6, 25, 26), (12, 1, 3, 3), "depthwise", groups=6, stride=(2, 2),
                                 padding=((1, 1), (1, 1))),
    # the transcendental and hard epilogues, each on two kernel paths at least
    "conv_direct_silu": _conv_case((2, 5, 17, 16), (6, 5, 3, 2), "direct", stride=(2, 1),
                                   padding=((1, 0), (2, 1)), activation="silu"),
    "conv_smm_channel_rows_hard_swish": _conv_case((1, 6, 20, 20), (16, 6, 3, 3), "smm",
                                                   padding=((1, 1), (1, 1)), activation="hard_swish"),
    "conv_smm_pixel_rows_sigmoid": _conv_case((2, 40, 7, 7), (64, 40, 3, 3), "smm", padding=((1, 1), (1, 1)),
                                              activation="sigmoid"),
    "conv_smm_pointwise_gelu": _conv_case((2, 8, 9, 9), (16, 8, 1, 1), "smm", activation="gelu"),
    "conv_winograd_silu": _conv_case((2, 6, 13, 18), (5, 6, 3, 3), "winograd", padding=((1, 2), (0, 1)),
                                     activation="silu"),
    "conv_winograd_panels_hard_sigmoid": _conv_case((1, 16, 56, 56), (16, 16, 3, 3), "winograd",
                                                    padding=((1, 1), (1, 1)), activation="hard_sigmoid"),
    "conv_depthwise_hard_swish": _conv_case((1, 6, 25, 26), (12, 1, 3, 3), "depthwise", groups=6, stride=(2, 2),
                                            padding=((1, 1), (1, 1)), activation="hard_swish"),
    "conv_depthwise_gelu_tanh": _conv_case((1, 6, 25, 26), (6, 1, 5, 5), "depthwise", groups=6,
                                           padding=((2, 2), (2, 2)), activation="gelu_tanh"),
    "dense_gemv_sigmoid": _dense_case(1, 600, 70, activation="sigmoid"),
    "dense_gemv_nk_gelu": _dense_case(2, 600, 70, transpose_w=True, activation="gelu"),
    "dense_gemm_silu": _dense_case(9, 300, 70, activation="silu"),
    "dense_gemm_traced_hard_sigmoid": _dense_case(20, 300, 40, transpose_w=True, traced=True,
                                                  activation="hard_sigmoid"),
    # Channel blocks in bands whose split depends on the thread count.
    "conv_depthwise_blocks": _conv_case((2, 20, 30, 30), (20, 1, 5, 5), "depthwise", groups=20,
                                        padding=((2, 2), (2, 2)), activation="relu"),
    "conv_depthwise_planes": _conv_case((1, 6, 20, 34), (6, 1, 3, 3), "depthwise", groups=6,
                                        padding=((1, 1), (1, 1))),
    "dense_gemv": _dense_case(1, 600, 70),
    "dense_gemv_rows": _dense_case(3, 300, 40),
    "dense_gemv_nk": _dense_case(2, 600, 70, transpose_w=True),
    "dense_gemm": _dense_case(9, 300, 70),
    "dense_gemm_traced": _dense_case(20, 300, 40, transpose_w=True, traced=True),
    "max_pool": _pool_case((2, 3, 11, 12), lambda x: kernels.max_pool2d(x, **_POOL),
                           lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2),
                                                       ((0, 0), (0, 0), (1, 1), (0, 1)))),
    "avg_pool": _pool_case((2, 3, 11, 12), lambda x: kernels.avg_pool2d(x, **_POOL),
                           lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 1, 3, 3), (1, 1, 2, 2),
                                                       ((0, 0), (0, 0), (1, 1), (0, 1))) / 9),
    # DenseNet's transition: batch norm and ReLU applied as the pool reads x.
    "avg_pool_prologue": (lambda rng: (_normal(rng, (2, 3, 11, 12)), _normal(rng, (3, 3))),
                          lambda x, p: kernels.avg_pool2d(x, **_POOL, prologue=(*p, "relu")),
                          lambda x, p: lax.reduce_window(jax.nn.relu((x - p[0, :, None, None]) * p[1, :, None, None]
                                                                     + p[2, :, None, None]),
                                                         0.0, lax.add, (1, 1, 3, 3), (1, 1, 2, 2),
                                                         ((0, 0), (0, 0), (1, 1), (0, 1))) / 9),
    "global_avg_pool": _pool_case((2, 5, 9, 7), kernels.global_avg_pool2d,
                                  lambda x: jnp.mean(x, axis=(2, 3), keepdims=True)),
    # rows of 37: two vectors and a partial one (AVX-512), in tasks of whole rows
    "softmax": _pool_case((3, 7, 37), kernels.softmax, kernels.softmax_reference),
    "layer_norm": (lambda rng: (_normal(rng, (5, 9, 37)), _normal(rng, 37), _normal(rng, 37)),
                   lambda x, g, b: kernels.layer_norm(x, g, b, epsilon=1e-3),
                   lambda x, g, b: kernels.layer_norm_reference(x, g, b, 1e-3)),
}


def _assert_same_numerics(got, want, rtol=1e-4):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg="+Inf positions differ")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg="-Inf positions differ")
    finite = np.isfinite(want)
    scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), counts=st.tuples(*[st.integers(0, 3)] * 3).filter(any))
def test_non_finite_inputs_come_out_where_xla_puts_them(name, seed, counts):
    make, kernel, reference = CASES[name]
    rng = np.random.default_rng(seed)
    x, *rest = make(rng)
    flat = x.reshape(-1)
    spots = rng.choice(flat.size, size=sum(counts), replace=False)
    flat[spots] = np.repeat([np.nan, np.inf, -np.inf], counts)
    _assert_same_numerics(kernel(x, *rest), reference(x, *rest))


@pytest.mark.parametrize("where", [(0, 0, 0, 0), (3, 2, 1, 1)])
def test_winograd_non_finite_weight_matches_xla(where):
    """An Inf weight meets the zero padding (0 * Inf = NaN in XLA) and the input."""
    make, kernel, reference = CASES["conv_winograd"]
    x, w, b = make(np.random.default_rng(1))
    w[where] = np.inf
    _assert_same_numerics(kernel(x, w, b), reference(x, w, b))


# ----------------------------------------------------------------- accuracy


def _conv_f64(x, w, stride, padding, groups):
    """The convolution in numpy float64, tap by tap."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), *padding))
    w = w.astype(np.float64)
    (n, _, h, width), (o, cg, kh, kw) = x.shape, w.shape
    og, oh, ow = o // groups, (h - kh) // stride[0] + 1, (width - kw) // stride[1] + 1
    y = np.zeros((n, o, oh, ow))
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = x[:, g * cg:(g + 1) * cg, i:i + stride[0] * (oh - 1) + 1:stride[0],
                          j:j + stride[1] * (ow - 1) + 1:stride[1]]
                y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w[g * og:(g + 1) * og, :, i, j])
    return y


# (algorithm, x shape, w shape, stride, padding, groups): ResNet-18 and
# MobileNetV2 layers, and the 1000 -> 1001 channel layer of issue 15.
ACCURACY_LAYERS = {
    "resnet 3x3 64->64 @56": ((1, 64, 56, 56), (64, 64, 3, 3), (1, 1), ((1, 1), (1, 1)), 1),
    "resnet 3x3 256->256 @14": ((1, 256, 14, 14), (256, 256, 3, 3), (1, 1), ((1, 1), (1, 1)), 1),
    "resnet 3x3 s2 128->256 @28": ((1, 128, 28, 28), (256, 128, 3, 3), (2, 2), ((1, 1), (1, 1)), 1),
    "mobilenet 1x1 144->24 @56": ((1, 144, 56, 56), (24, 144, 1, 1), (1, 1), ((0, 0), (0, 0)), 1),
    "mobilenet dw 3x3 144 @56": ((1, 144, 56, 56), (144, 1, 3, 3), (1, 1), ((1, 1), (1, 1)), 144),
    "efficientnet dw 5x5 672 @14": ((1, 672, 14, 14), (672, 1, 5, 5), (1, 1), ((2, 2), (2, 2)), 672),
    "resnext 3x3 g32 512 @14": ((1, 512, 14, 14), (512, 16, 3, 3), (1, 1), ((1, 1), (1, 1)), 32),
    "3x3 1000->1001 @14": ((1, 1000, 14, 14), (1001, 1000, 3, 3), (1, 1), ((1, 1), (1, 1)), 1),
}


def measure_conv_errors() -> dict[str, dict[str, float]]:
    """Max |y - y64| / max |y64| per layer and algorithm (XLA as "default")."""
    rng = np.random.default_rng(0)
    errors = {}
    for layer, (x_shape, w_shape, stride, padding, groups) in ACCURACY_LAYERS.items():
        x, w = _normal(rng, x_shape), _normal(rng, w_shape) / np.sqrt(np.prod(w_shape[1:]))
        want = _conv_f64(x, w, stride, padding, groups)
        scale = np.abs(want).max()
        found = {"default": np.asarray(lax.conv_general_dilated(
            x, w, stride, padding, dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups))}
        for algorithm in ("direct", "smm", "winograd", "depthwise", "grouped"):
            config = dict(stride=stride, padding=padding, groups=groups)
            if kernels.conv2d_support(algorithm, x_shape=x_shape, w_shape=w_shape, dilation=(1, 1),
                                      dtype=np.float32, **config) is None:
                found[algorithm] = np.asarray(kernels.conv2d(x, w, algorithm=algorithm, **config))
        errors[layer] = {a: float(np.abs(y - want).max() / scale) for a, y in found.items()}
    return errors


def measure_other_errors() -> dict[str, dict[str, float]]:
    """The same for dense (GEMV and GEMM) and the pools."""
    rng = np.random.default_rng(1)
    errors = {}
    for label, m, transpose_w in [("dense 512->1000, batch 1", 1, False),
                                  ("dense 4096->1000 (N, K), batch 1", 1, True),
                                  ("dense 512->1000, batch 32", 32, False)]:
        k = 4096 if transpose_w else 512
        x, w = _normal(rng, (m, k)), _normal(rng, (1000, k) if transpose_w else (k, 1000)) / np.sqrt(k)
        want = x.astype(np.float64) @ (w.T if transpose_w else w).astype(np.float64)
        got = {"default": np.asarray(jnp.dot(x, w.T if transpose_w else w)),
               "kernel": np.asarray(kernels.dense(x, w, transpose_w=transpose_w))}
        errors[label] = {a: float(np.abs(y - want).max() / np.abs(want).max()) for a, y in got.items()}
    x = _normal(rng, (1, 64, 112, 112))
    pool = dict(window=(3, 3), stride=(2, 2), padding=((1, 1), (1, 1)))
    x64 = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    avg64 = sum(x64[:, :, i:i + 111:2, j:j + 111:2] for i in range(3) for j in range(3)) / 9
    for label, kernel, xla, want in [
        ("avg pool 3x3 s2 @112", kernels.avg_pool2d(x, **pool),
         lax.reduce_window(x, 0.0, lax.add, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1))) / 9,
         avg64),
        ("global avg pool @112", kernels.global_avg_pool2d(x), jnp.mean(x, axis=(2, 3), keepdims=True),
         x.astype(np.float64).mean(axis=(2, 3), keepdims=True)),
    ]:
        scale = np.abs(want).max()
        errors[label] = {a: float(np.abs(np.asarray(y) - want).max() / scale)
                         for a, y in (("default", xla), ("kernel", kernel))}
    return errors


def _activations_f64(y: np.ndarray) -> dict[str, np.ndarray]:
    from math import erf

    sigmoid = 1 / (1 + np.exp(-y))
    hard = np.clip(y / 6 + 0.5, 0, 1)
    tanh = np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3))
    return {"sigmoid": sigmoid, "silu": y * sigmoid, "hard_sigmoid": hard, "hard_swish": y * hard,
            "gelu": y * (1 + np.vectorize(erf)(y / np.sqrt(2))) / 2, "gelu_tanh": y * (1 + tanh) / 2}


def measure_activation_errors() -> dict[str, dict[str, float]]:
    """The same for each fused activation after a 1x1 conv (smm) and a depthwise
    3x3 (MobileNetV2's 144 channels at 56x56), against XLA's conv and jax.nn's activation."""
    errors = {}
    for layer, algorithm in (("mobilenet 1x1 144->24 @56", "smm"), ("mobilenet dw 3x3 144 @56", "depthwise")):
        x_shape, w_shape, stride, padding, groups = ACCURACY_LAYERS[layer]
        rng = np.random.default_rng(2)
        x, w = _normal(rng, x_shape), 3 * _normal(rng, w_shape) / np.sqrt(np.prod(w_shape[1:]))
        conv64 = _conv_f64(x, w, stride, padding, groups)
        conv = lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                        feature_group_count=groups)
        for activation, want in _activations_f64(conv64).items():
            got = kernels.conv2d(x, w, algorithm=algorithm, stride=stride, padding=padding, groups=groups,
                                 activation=activation, **HARD)
            scale = np.abs(want).max()
            errors[f"{layer} + {activation}"] = {
                a: float(np.abs(np.asarray(y) - want).max() / scale)
                for a, y in (("default", XLA_ACTIVATIONS[activation](conv)), (algorithm, got))}
    return errors


@pytest.mark.slow
def test_kernel_errors_stay_within_the_documented_tolerance():
    errors = {**measure_conv_errors(), **measure_other_errors(), **measure_activation_errors()}
    print(json.dumps(errors, indent=1))
    for layer, found in errors.items():
        for algorithm, error in found.items():
            kind = algorithm if algorithm in kernels.TOLERANCE else ("dense" if "dense" in layer else "pool")
            if algorithm != "default":
                assert error <= kernels.TOLERANCE[kind], (layer, algorithm, error)


# -------------------------------------------------------------- determinism

_RUN_PINNED = """
import os, sys
os.sched_setaffinity(0, {cpus})
sys.path.insert(0, {tests!r})
import numpy as np, jax
from test_kernels_numerics import run_for_determinism
out = run_for_determinism({which!r})
threads = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
out["pool_threads"] = np.array(threads.count("tf_XLAEigen"))
np.savez({path!r}, **out)
"""


def run_for_determinism(which: str) -> dict[str, np.ndarray]:
    """Every case of `CASES` on finite inputs, or the swapped ResNet-18."""
    if which == "kernels":
        out = {}
        for name, (make, kernel, _) in CASES.items():
            out[name] = np.asarray(kernel(*make(np.random.default_rng(7))))
        return out
    import equinox as eqx

    import jtile
    from jtile.fusion import fold_params

    model = jtile.models.get("resnet18", jax.random.key(0))
    fast = jax.jit(jtile.swap_backend(fold_params(lambda m, x: m(x), model), algorithms="auto"))
    x = jax.random.normal(jax.random.key(1), (1, 3, 224, 224))
    assert eqx.is_array(x)
    return {"resnet18": np.asarray(fast(x))}


def _pinned_runs(which: str, tmp_path) -> list[dict[str, np.ndarray]]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"compares a 1-thread pool with a 2-thread one, so needs two CPUs in this process's "
                    f"affinity mask; it has {len(cpus)}")
    runs = []
    for pinned in ({cpus[0]}, set(cpus[:2])):
        path = str(tmp_path / f"{which}_{len(pinned)}.npz")
        script = _RUN_PINNED.format(cpus=pinned, tests=os.path.dirname(__file__), which=which, path=path)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        with np.load(path) as data:
            runs.append(dict(data))
        assert runs[-1].pop("pool_threads") == len(pinned), "XLA's pool did not follow the CPU affinity"
    return runs


def test_kernels_give_the_same_bits_on_one_and_two_threads(tmp_path):
    one, two = _pinned_runs("kernels", tmp_path)
    assert one.keys() == two.keys() == CASES.keys()
    differ = {name: int((one[name] != two[name]).sum()) for name in one
              if one[name].tobytes() != two[name].tobytes()}
    assert not differ, f"outputs differing between 1 and 2 threads: {differ}"


@pytest.mark.slow
def test_swapped_resnet18_gives_the_same_bits_on_one_and_two_threads(tmp_path):
    one, two = _pinned_runs("resnet18", tmp_path)
    assert one["resnet18"].tobytes() == two["resnet18"].tobytes(), \
        f"{int((one['resnet18'] != two['resnet18']).sum())} of 1000 outputs differ"
