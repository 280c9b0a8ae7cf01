import collections
import functools
import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jtile
import jtile.onnx
from jtile import fusion, models
from jtile._interpreter import iter_eqns, make_jaxpr
from jtile._layers import scope_name
from jtile.gemm import bounded_dense, split_gemm, tile_count, tiles_per_layer

LIGHT = os.path.join(onnx.__path__[0], "backend", "test", "data", "light")


def _normal(*shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _dots(fn, *args) -> list:
    return [e for e in iter_eqns(make_jaxpr(fn, *args).jaxpr) if e.primitive.name == "dot_general"]


def test_seed_example_two_tiles(tree_allclose):
    a = _normal(32, 64)
    b = _normal(64, 128, seed=1)
    f = split_gemm(jnp.matmul, max_m=64, max_k=64, max_n=64)
    dots = _dots(f, a, b)
    assert len(dots) == 2
    assert all(d.outvars[0].aval.shape == (32, 64) for d in dots)
    assert tree_allclose(jax.jit(f)(a, b), a @ b, rtol=1e-5, atol=1e-4)


def test_edge_tiles_and_k_sum_order(tree_allclose):
    a, b = jnp.asarray(_normal(10, 23)), jnp.asarray(_normal(23, 7, seed=1))
    f = split_gemm(jnp.matmul, max_m=4, max_k=8, max_n=3)
    dots = _dots(f, a, b)
    assert len(dots) == tile_count(10, 23, 7, max_m=4, max_k=8, max_n=3) == 3 * 3 * 3
    shapes = collections.Counter(d.outvars[0].aval.shape for d in dots)
    assert shapes == {(4, 3): 12, (4, 1): 6, (2, 3): 6, (2, 1): 3}
    # fixed order: k0 + k1 + k2, accumulated in program order
    tile = lambda k: a[:4, k:k + 8] @ b[k:k + 8, :3]  # noqa: E731
    expected = (tile(0) + tile(8)) + tile(16)
    got = f(a, b)
    assert np.array_equal(np.asarray(got)[:4, :3], np.asarray(expected))
    assert tree_allclose(got, a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("trans_a, trans_b", [(0, 1), (1, 0), (1, 1)])
def test_onnx_gemm_transposes(tree_allclose, trans_a, trans_b):
    m, k, n = 12, 20, 9
    a = _normal(*((k, m) if trans_a else (m, k)))
    w = _normal(*((n, k) if trans_b else (k, n)), seed=1)
    fn = lambda a, w: (a.T if trans_a else a) @ (w.T if trans_b else w)  # noqa: E731
    g = split_gemm(fn, max_m=5, max_k=6, max_n=4)
    assert len(_dots(g, a, w)) == 3 * 4 * 3
    assert tree_allclose(g(a, w), fn(a, w), rtol=1e-5, atol=1e-4)


def _dot_problem(integer, permutation):
    """Random shapes and dimension numbers: batch, several free and contracting dims,
    any layout. `integer(lo, hi)` and `permutation(n)` draw the choices."""
    nb, nlf, nc, nrf = (integer(lo, hi) for lo, hi in ((0, 1), (0, 2), (1, 2), (0, 2)))
    b, lf, c, rf = ([integer(1, 7) for _ in range(n)] for n in (nb, nlf, nc, nrf))
    lhs_logical, rhs_logical = b + lf + c, b + c + rf
    lperm, rperm = permutation(len(lhs_logical)), permutation(len(rhs_logical))
    lpos = {axis: i for i, axis in enumerate(lperm)}  # logical axis -> position in the layout
    rpos = {axis: i for i, axis in enumerate(rperm)}
    dims = (
        (tuple(lpos[nb + nlf + i] for i in range(nc)), tuple(rpos[nb + i] for i in range(nc))),
        (tuple(lpos[i] for i in range(nb)), tuple(rpos[i] for i in range(nb))),
    )
    limits = [integer(1, 12) if integer(0, 2) else None for _ in range(3)]
    m, k, n = (math.prod(s) for s in (lf, c, rf))
    limits = [max(v, -(-size // 16)) if v else v for v, size in zip(limits, (m, k, n))]  # <= 16 tiles a side
    return [lhs_logical[i] for i in lperm], [rhs_logical[i] for i in rperm], dims, limits


@st.composite
def _hypothesis_problem(draw):
    integer = lambda lo, hi: draw(st.integers(lo, hi))  # noqa: E731
    return _dot_problem(integer, lambda n: draw(st.permutations(range(n)))), draw(st.integers(0, 2**31))


def _check_equivalence(problem, seed):
    lshape, rshape, dims, (max_m, max_k, max_n) = problem
    rng = np.random.default_rng(seed)
    lhs, rhs = rng.normal(size=lshape).astype(np.float32), rng.normal(size=rshape).astype(np.float32)
    fn = lambda x, y: lax.dot_general(x, y, dims)  # noqa: E731
    if (max_m, max_k, max_n) == (None, None, None):
        max_k = 2
    split = split_gemm(fn, max_m=max_m, max_k=max_k, max_n=max_n)
    got, want = jax.jit(lambda x, y: (split(x, y), fn(x, y)))(lhs, rhs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_random_dot_generals_match():
    rng = np.random.default_rng(1234)
    integer = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    for seed in range(10):
        _check_equivalence(_dot_problem(integer, lambda n: list(rng.permutation(n))), seed)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(_hypothesis_problem())
def test_random_dot_generals_match_many(case):
    _check_equivalence(*case)


def test_tiles_run_under_named_scopes():
    a, b = _normal(8, 8), _normal(8, 8, seed=1)

    def layer(a, b):
        with jax.named_scope("fc1"):
            return a @ b

    f = split_gemm(layer, max_m=4, max_k=4, max_n=8)
    scopes = sorted(scope_name(d) for d in _dots(f, a, b))
    assert scopes == [f"fc1/gemm_tile_m{m}_k{k}_n0" for m in (0, 1) for k in (0, 1)]
    assert tiles_per_layer(make_jaxpr(f, a, b)) == {"fc1": 4}
    assert tiles_per_layer(make_jaxpr(split_gemm(jnp.matmul, max_k=3), a, b)) == {"": 3}


def test_alexnet_zoo_fc_layers_split():
    shapes = jax.eval_shape(lambda: models.get("alexnet"))
    params, static = eqx.partition(shapes, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
    fn = lambda params, x: eqx.combine(params, static)(x)  # noqa: E731
    x = jax.ShapeDtypeStruct((1, 3, 224, 224), jnp.float32)
    f = split_gemm(fn, max_m=64, max_k=4096, max_n=512)
    jaxpr = jax.make_jaxpr(f)(params, x)
    dots = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    per_layer = collections.Counter(scope_name(e).split("/gemm_tile_")[0] for e in dots)
    assert dict(per_layer) == {"classifier.1": 3 * 8, "classifier.4": 1 * 8, "classifier.6": 1 * 2}
    assert len(dots) == 34
    assert tiles_per_layer(jaxpr) == dict(per_layer)


def test_light_onnx_alexnet_fc_layers_split(tree_allclose):
    model = jtile.onnx.load(os.path.join(LIGHT, "light_bvlc_alexnet.onnx"))
    x = jax.ShapeDtypeStruct((1, 3, 224, 224), jnp.float32)
    f = split_gemm(model.fn, max_m=64, max_k=4096, max_n=512)
    jaxpr = jax.make_jaxpr(f)(model.params, x)
    dots = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    per_layer = collections.Counter(scope_name(e).split("/gemm_tile_")[0] for e in dots)
    assert dict(per_layer) == {"n16": 24, "n19": 8, "n22": 2}


def test_transposed_classifier_matches(tree_allclose):
    """An AlexNet-sized fc layer (x @ W.T with W (out, in), K = 9216), in one compiled call."""
    x = _normal(2, 9216)
    w = _normal(1024, 9216, seed=1) / 96
    fn = lambda x, w: jax.nn.relu(x @ w.T)  # noqa: E731
    split = split_gemm(fn, max_m=64, max_k=4096, max_n=512)
    got, want = jax.jit(lambda x, w: (split(x, w), fn(x, w)))(x, w)
    assert tree_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_composes_with_jit_filter_jit_and_grad(tree_allclose):
    a, b = _normal(6, 10), _normal(10, 5, seed=1)
    ref = lambda a, b: jnp.tanh(a @ b)  # noqa: E731

    @split_gemm(max_m=4, max_k=3, max_n=2)
    def f(a, b):
        """doc"""
        return jnp.tanh(a @ b)

    assert f.__name__ == "f" and f.__doc__ == "doc"
    twice = split_gemm(split_gemm(jnp.matmul, max_m=3), max_n=2)
    assert len(_dots(twice, a, b)) == 2 * 3
    inner_jit = split_gemm(jax.jit(ref), max_k=4)
    grad = lambda g: jax.grad(lambda a: g(a, b).sum())  # noqa: E731

    def everything(a, b):
        return (f(a, b), inner_jit(a, b), twice(a, b), grad(f)(a)), (ref(a, b), ref(a, b), a @ b, grad(ref)(a))

    got, want = jax.jit(everything)(a, b)
    assert tree_allclose(got, want, atol=1e-5)
    assert tree_allclose(eqx.filter_jit(f)(a, b), want[0], atol=1e-5)


def test_splits_fused_dense(tree_allclose):
    x, w, b = _normal(4, 12), _normal(12, 6, seed=1), _normal(6, seed=2)
    fn = lambda x, w, b: jax.nn.relu(x @ w + b)  # noqa: E731
    fused = fusion.dense(fn)
    names = [e.primitive.name for e in make_jaxpr(fused, x, w, b).jaxpr.eqns]
    assert "dense" in names and not {"dot_general", "add", "max"} & set(names)
    f = split_gemm(fused, max_k=5)
    assert len(_dots(f, x, w, b)) == 3
    assert tree_allclose(f(x, w, b), fn(x, w, b), atol=1e-5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True, np.float32(8)])
def test_bad_tile_sizes_raise(bad):
    with pytest.raises(jtile.ConfigError, match="max_k must be a positive int"):
        split_gemm(jnp.matmul, max_m=8, max_k=bad, max_n=8)


def test_bad_configuration_raises():
    with pytest.raises(jtile.ConfigError, match="at least one of"):
        split_gemm(jnp.matmul)
    with pytest.raises(jtile.ConfigError, match="unknown keyword"):
        split_gemm(jnp.matmul, max_m=8, tile=3)
    with pytest.raises(jtile.ConfigError, match="kernel must be"):
        split_gemm(jnp.matmul, max_m=8, kernel="cuda")
    with pytest.raises(jtile.ConfigError, match="give all of"):
        split_gemm(jnp.matmul, max_m=8, kernel="ffi")
    with pytest.raises(jtile.ConfigError, match="expected a function"):
        split_gemm(3, max_m=8)
    assert split_gemm(max_m=np.int64(4))(jnp.matmul)(jnp.ones((5, 2)), jnp.ones((2, 3))).shape == (5, 3)


def test_bounded_dense_refuses_large_tiles():
    with pytest.raises(jtile.UnsupportedError, match=r"\(5, 4, 4\) exceeds the kernel limits \(4, 4, 4\)"):
        bounded_dense(jnp.ones((5, 4)), jnp.ones((4, 4)), max_m=4, max_k=4, max_n=4)


def test_ffi_kernel_runs_every_tile(tree_allclose):
    a, b = _normal(10, 23), _normal(23, 7, seed=1)
    f = split_gemm(jnp.matmul, max_m=4, max_k=8, max_n=3, kernel="ffi")
    names = collections.Counter(e.primitive.name for e in iter_eqns(make_jaxpr(f, a, b).jaxpr))
    assert names["ffi_call"] == 27 and names["dot_general"] == 0
    assert tiles_per_layer(make_jaxpr(f, a, b)) == {"": 27}
    assert tree_allclose(f(a, b), a @ b, rtol=1e-5, atol=1e-4)
    x, w = _normal(2, 5, 9, seed=2), _normal(2, 9, 6, seed=3)
    batched = split_gemm(jnp.matmul, max_m=4, max_k=4, max_n=4, kernel="ffi")
    assert tree_allclose(jax.jit(batched)(x, w), x @ w, rtol=1e-5, atol=1e-4)


def test_summary_shows_tile_count_per_layer(getkey):
    w1, w2 = jax.random.normal(getkey(), (100, 70)), jax.random.normal(getkey(), (70, 10))

    def mlp(x):
        with jax.named_scope("fc1"):
            h = jax.nn.relu(x @ w1)
        with jax.named_scope("fc2"):
            return h @ w2

    x = jax.ShapeDtypeStruct((5, 100), jnp.float32)
    report = jtile.summary(jtile.split_gemm(mlp, max_m=4, max_k=32, max_n=32), x)
    # ceil(5/4) * ceil(100/32) * ceil(70/32) and ceil(5/4) * ceil(70/32) * ceil(10/32)
    assert report.gemm_tiles == {"fc1": 2 * 4 * 3, "fc2": 2 * 3 * 1}
    assert "GEMM tiles per layer (split_gemm): fc1 24, fc2 6" in report.table()


@pytest.mark.parametrize("lshape,rshape,dims,limits", [
    ((10, 23), (23, 7), (((1,), (0,)), ((), ())), (4, 8, 3)),  # ragged on every axis
    ((3, 10, 9), (3, 9, 6), (((2,), (1,)), ((0,), (0,))), (4, 4, 4)),  # batched, attention-like
    ((6, 20), (8, 20), (((1,), (1,)), ((), ())), (None, 6, 3)),  # x @ W.T, one limit open
    ((2, 5, 16), (16, 12), (((2,), (0,)), ((), ())), (3, 16, 5)),  # (B, T, K) rows flattened
])
def test_looped_emission_matches_the_dot(lshape, rshape, dims, limits, tree_allclose):
    lhs, rhs = _normal(*lshape), _normal(*rshape, seed=1)
    fn = lambda x, y: lax.dot_general(x, y, dims)  # noqa: E731
    max_m, max_k, max_n = limits
    looped = split_gemm(fn, max_m=max_m, max_k=max_k, max_n=max_n, emit="loop")
    unrolled = split_gemm(fn, max_m=max_m, max_k=max_k, max_n=max_n, emit="unroll")
    assert len(_dots(looped, lhs, rhs)) == 1 < len(_dots(unrolled, lhs, rhs))
    names = {e.primitive.name for e in iter_eqns(make_jaxpr(looped, lhs, rhs).jaxpr)}
    assert "scan" in names  # lax.map, and fori_loop with a static trip count
    got, tiles, want = jax.jit(lambda x, y: (looped(x, y), unrolled(x, y), fn(x, y)))(lhs, rhs)
    assert tree_allclose(got, want, rtol=1e-5, atol=1e-4) and tree_allclose(got, tiles, rtol=1e-5, atol=1e-5)
    assert tiles_per_layer(make_jaxpr(looped, lhs, rhs)) == tiles_per_layer(make_jaxpr(unrolled, lhs, rhs))


def test_auto_emission_loops_above_the_tile_limit():
    a, b = _normal(10, 64), _normal(64, 9, seed=1)
    few = split_gemm(jnp.matmul, max_m=5, max_k=32, max_n=9)  # 4 tiles: unrolled
    many = split_gemm(jnp.matmul, max_m=1, max_k=8, max_n=9)  # 80 tiles > LOOP_ABOVE: looped
    assert jtile.gemm.LOOP_ABOVE < 80
    assert len(_dots(few, a, b)) == 4 and len(_dots(many, a, b)) == 1
    assert tiles_per_layer(make_jaxpr(many, a, b)) == {"": 80}
    np.testing.assert_allclose(np.asarray(many(a, b)), a @ b, rtol=1e-5, atol=1e-4)


def test_looped_emission_of_a_30000_tile_layer_has_one_tile_body():
    """VGG's first FC layer (25088 -> 4096) at 64-tiles: 392 x 64 = 25088 tiles, plus a ragged row."""
    x = jax.ShapeDtypeStruct((65, 25088), jnp.float32)
    w = jax.ShapeDtypeStruct((25088, 4096), jnp.float32)
    f = split_gemm(jnp.matmul, max_m=64, max_k=64, max_n=64)
    jaxpr = jax.make_jaxpr(f)(x, w)
    dots = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and dots[0].outvars[0].aval.shape == (64, 64)
    assert tiles_per_layer(jaxpr) == {"": 2 * 392 * 64}


def test_looped_emission_runs_fused_dense_and_the_ffi_kernel(tree_allclose):
    x, w, b = _normal(9, 40), _normal(40, 11, seed=1), _normal(11, seed=2)
    fn = lambda x, w, b: jax.nn.relu(x @ w + b)  # noqa: E731
    f = split_gemm(fusion.dense(fn), max_m=4, max_k=8, max_n=4, emit="loop")
    assert tree_allclose(jax.jit(f)(x, w, b), fn(x, w, b), atol=1e-5)
    g = split_gemm(jnp.matmul, max_m=4, max_k=8, max_n=4, kernel="ffi", emit="loop")
    names = collections.Counter(e.primitive.name for e in iter_eqns(make_jaxpr(g, x, w).jaxpr))
    assert names["ffi_call"] == 1 and names["dot_general"] == 0
    assert tree_allclose(jax.jit(g)(x, w), x @ w, rtol=1e-5, atol=1e-4)


def test_bad_emission_raises():
    with pytest.raises(jtile.ConfigError, match="emit must be one of"):
        split_gemm(jnp.matmul, max_m=8, emit="scan")


@pytest.mark.parametrize("order", ["fuse first", "split first"])
def test_split_gemm_and_a_dense_shortcut_compose(order):
    """A fused dense that adds a transformer's shortcut splits like any dense,
    shortcut included, in either order of the two transforms."""
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((6, 8), (8, 16), (16, 8)))

    def block(x):
        return x + jax.nn.relu(x @ w1) @ w2

    split = functools.partial(jtile.split_gemm, max_m=4, max_k=8, max_n=8)
    both = split(fusion.fuse(block)) if order == "fuse first" else fusion.fuse(split(block))
    np.testing.assert_allclose(jax.jit(both)(x), block(x), rtol=1e-5, atol=1e-5)
