import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jtile
from jtile._geometry import ConvGeometry
from jtile import fusion, models
from jtile.gemm import split_gemm
from jtile._fused import FusedLayer
from jtile._interpreter import iter_eqns, make_jaxpr
from jtile._layers import describe

_ELEMENTWISE = {"add", "sub", "mul", "div", "max", "min", "clamp", "custom_jvp_call", "jit"}


def _ops(fn, *args) -> collections.Counter:
    return collections.Counter(e.primitive.name for e in iter_eqns(make_jaxpr(fn, *args).jaxpr))


def _activation_ops(fn, *args, shape) -> collections.Counter:
    """Ops producing a value of the activation's `shape`: the path the data takes."""
    return collections.Counter(
        e.primitive.name for e in iter_eqns(make_jaxpr(fn, *args).jaxpr)
        if e.outvars and e.outvars[0].aval.shape == shape and e.primitive.name not in ("jit", "custom_jvp_call")
    )


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _normal(*shape, seed: int = 0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _same(f, g, *args, tree_allclose, **tol) -> bool:
    """`f(*args)` and `g(*args)` agree; both run in one compiled call."""
    out_f, out_g = jax.jit(lambda *a: (f(*a), g(*a)))(*args)
    return tree_allclose(out_f, out_g, **tol)


@pytest.fixture
def conv_params():
    c, rng = 6, np.random.default_rng(42)
    draw = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return dict(
        w=draw(c, 3, 3, 3) * 0.3, b=draw(c), mean=draw(c),
        var=rng.uniform(0.5, 2.0, c).astype(np.float32), gamma=draw(c), beta=draw(c),
    )


def _bn_onnx_style(p, y):
    """As the ONNX importer lowers BatchNormalization."""
    per = lambda v: v.reshape(1, -1, 1, 1)  # noqa: E731
    return (y - per(p["mean"])) / jnp.sqrt(per(p["var"]) + 1e-5) * per(p["gamma"]) + per(p["beta"])


def _bn_zoo_style(p, y):
    """As `models.BatchNorm2d` lowers it: x * scale + shift."""
    scale = p["gamma"] * lax.rsqrt(p["var"] + 1e-5)
    return y * scale.reshape(1, -1, 1, 1) + (p["beta"] - p["mean"] * scale).reshape(1, -1, 1, 1)


@pytest.mark.parametrize("bn", [_bn_onnx_style, _bn_zoo_style])
def test_fold_batchnorm_leaves_conv_and_one_add(conv_params, tree_allclose, bn):
    x = _normal(2, 3, 8, 8)

    def model(p, x):
        return jax.nn.relu(bn(p, _conv(x, p["w"]) + p["b"].reshape(1, -1, 1, 1)))

    shape = (2, 6, 8, 8)
    before = _activation_ops(model, conv_params, x, shape=shape)
    folded = fusion.fold_batchnorm(model)
    after = _activation_ops(folded, conv_params, x, shape=shape)
    assert before["conv_general_dilated"] == 1 and sum(before.values()) >= 5
    assert after == {"conv_general_dilated": 1, "add": 1, "max": 1}
    assert _same(folded, model, conv_params, x, tree_allclose=tree_allclose, rtol=1e-4, atol=1e-4)

    fused = fusion.fuse(model)
    assert _activation_ops(fused, conv_params, x, shape=shape) == {"conv_bias_act": 1}
    assert _same(fused, model, conv_params, x, tree_allclose=tree_allclose, rtol=1e-4, atol=1e-4)


def test_fold_params_folds_weights_into_constants(conv_params, tree_allclose):
    x = _normal(2, 3, 8, 8)

    def model(p, x):
        return jax.nn.relu6(_bn_onnx_style(p, _conv(x, p["w"])))

    g = fusion.fold_params(model, conv_params)
    closed = make_jaxpr(g, x)
    assert [e.primitive.name for e in closed.jaxpr.eqns] == ["conv_bias_act"]
    assert closed.jaxpr.eqns[0].params["activation"] == ("clip", 0.0, 6.0)
    assert _same(g, lambda x: model(conv_params, x), x, tree_allclose=tree_allclose, rtol=1e-4, atol=1e-4)
    # fuse alone keeps the params as arguments, so the folded weight is computed in the graph
    ops = _ops(fusion.fuse(model), conv_params, x)
    assert ops["conv_bias_act"] == 1 and ops["mul"] >= 1


_DENSE_CASES = {
    "x @ W + b": (lambda x, w, b: x @ w + b, (5, 7), (7, 4), (4,)),
    "b + x @ W": (lambda x, w, b: b + x @ w, (5, 7), (7, 4), (4,)),
    "W @ x + b": (lambda x, w, b: w @ x + b[:, None], (7, 5), (4, 7), (4,)),
    "b + W @ x": (lambda x, w, b: b[:, None] + w @ x, (7, 5), (4, 7), (4,)),
    "x @ W.T + b (torch Linear)": (lambda x, w, b: x @ w.T + b, (5, 7), (4, 7), (4,)),
}


@pytest.mark.parametrize("case", sorted(_DENSE_CASES))
def test_dense_fuses_weight_on_either_side(tree_allclose, case):
    fn, xs, ws, bs = _DENSE_CASES[case]
    x, w, b = (_normal(*s, seed=i) for i, s in enumerate((xs, ws, bs)))
    model = lambda x, w, b: jax.nn.relu(fn(x, w, b))  # noqa: E731
    before = _ops(model, x, w, b)
    fused = fusion.dense(model)
    after = _ops(fused, x, w, b)
    assert before["dot_general"] == 1 and before["add"] == 1 and before["max"] == 1
    assert after["dense"] == 1 and not (after.keys() & {"dot_general", "add", "max"})
    eqn = next(e for e in iter_eqns(make_jaxpr(fused, x, w, b).jaxpr) if e.primitive.name == "dense")
    assert eqn.params["activation"] == ("relu",)
    assert _same(fused, model, x, w, b, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def test_dense_refuses_a_bias_along_two_axes(tree_allclose):
    x, w = _normal(2, 5, 7), _normal(7, 4, seed=1)
    plane = _normal(5, 4, seed=2)  # along two of the output's three axes: neither a bias nor a residual
    fn = lambda x, w, r: x @ w + r  # noqa: E731
    assert _ops(fusion.dense(fn), x, w, plane) == _ops(fn, x, w, plane)
    assert _same(fusion.dense(fn), fn, x, w, plane, tree_allclose=tree_allclose)


@pytest.mark.parametrize("order", ["shortcut first", "shortcut last"])
def test_dense_takes_a_transformer_shortcut_as_its_residual(tree_allclose, order):
    """`x + gelu(x @ W1 + b1) @ W2 + b2` (a transformer's MLP block): the second
    product, its bias and the shortcut are one dense op."""
    x, w1, w2 = _normal(2, 5, 8), _normal(8, 16, seed=1), _normal(16, 8, seed=2)
    b1, b2 = _normal(16, seed=3), _normal(8, seed=4)

    def block(x, w1, w2, b1, b2):
        mlp = jax.nn.gelu(x @ w1 + b1) @ w2 + b2
        return x + mlp if order == "shortcut first" else mlp + x

    fused = fusion.dense(block)
    after = _ops(fused, x, w1, w2, b1, b2)
    assert after["dense"] == 2 and "add" not in after
    eqns = [e for e in iter_eqns(make_jaxpr(fused, x, w1, w2, b1, b2).jaxpr) if e.primitive.name == "dense"]
    assert [len(e.invars) for e in eqns] == [3, 4]
    assert _same(fused, block, x, w1, w2, b1, b2, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)
    # exported as MatMul, Add (bias), Add (shortcut)
    from onnx.reference import ReferenceEvaluator

    proto = jtile.onnx.export(lambda x: fused(x, w1, w2, b1, b2), x)
    (got,) = ReferenceEvaluator(proto).run(None, {proto.graph.input[0].name: x})
    np.testing.assert_allclose(got, block(x, w1, w2, b1, b2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("view", ["reshape and unit transpose", "reshape only", "transpose of two axes"])
def test_dense_takes_a_shortcut_added_after_a_reshape(tree_allclose, view):
    """torch's attention output projection: `(L, E) @ W + b`, reshaped to (L,
    1, E), its unit axis moved first, plus the (1, L, E) shortcut. The shortcut
    is the dense op's residual through reshapes and transposes of unit axes,
    not through a transpose that reorders the elements."""
    x, w, b = _normal(6, 8), _normal(8, 8, seed=1), _normal(8, seed=2)
    shortcut = _normal(1, 6, 8, seed=3) if view != "transpose of two axes" else _normal(8, 6, seed=3)

    def block(x, w, b, shortcut):
        y = x @ w + b
        if view == "reshape only":
            y = y.reshape(1, 6, 8)
        elif view == "reshape and unit transpose":
            y = jnp.transpose(y.reshape(6, 1, 8), (1, 0, 2))
        else:
            y = y.T
        return jax.nn.relu(y + shortcut)

    fused = fusion.dense(block)
    after = _ops(fused, x, w, b, shortcut)
    eqns = [e for e in iter_eqns(make_jaxpr(fused, x, w, b, shortcut).jaxpr) if e.primitive.name == "dense"]
    took = view != "transpose of two axes"
    assert len(eqns[0].invars) == (4 if took else 3) and ("add" in after) != took
    assert eqns[0].params["activation"] == (("relu",) if took else ())
    assert _same(fused, block, x, w, b, shortcut, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def test_a_batched_product_plus_a_mask_stays_a_product():
    """Attention's scores plus an additive mask: no dense op, so the matmul kind keeps it."""
    q, k, mask = _normal(2, 5, 8), _normal(2, 8, 5, seed=1), _normal(2, 5, 5, seed=2)
    fn = lambda q, k, mask: q @ k + mask  # noqa: E731
    assert _ops(fusion.dense(fn), q, k, mask) == _ops(fn, q, k, mask)


@pytest.mark.parametrize(
    "act, expected",
    [
        (jax.nn.relu, ("relu",)),
        (jax.nn.relu6, ("clip", 0.0, 6.0)),
        (lambda y: jnp.clip(y, -1.0, 2.5), ("clip", -1.0, 2.5)),
        (lambda y: jnp.maximum(0.0, y), ("relu",)),
        (lambda y: jax.nn.leaky_relu(y, 0.125), ("leaky_relu", 0.125)),
        (lambda y: jnp.where(y >= 0, y, 0.25 * y), ("leaky_relu", 0.25)),  # as the zoo's LeakyReLU
        (lambda y: y, ()),
    ],
)
def test_conv_bias_act_one_op(conv_params, tree_allclose, act, expected):
    x = _normal(2, 3, 8, 8)
    model = lambda p, x: act(p["b"].reshape(1, -1, 1, 1) + _conv(x, p["w"]))  # noqa: E731
    fused = fusion.conv_bias_act(model)
    eqns = [e for e in iter_eqns(make_jaxpr(fused, conv_params, x).jaxpr) if e.primitive.name not in _ELEMENTWISE]
    assert [e.primitive.name for e in eqns if e.outvars[0].aval.shape == (2, 6, 8, 8)] == ["conv_bias_act"]
    conv_eqn = next(e for e in eqns if e.primitive.name == "conv_bias_act")
    assert conv_eqn.params["activation"] == expected
    layer = describe(conv_eqn, index=3)
    assert isinstance(layer, FusedLayer) and layer.kind == "conv2d" and layer.index == 3
    assert layer.activation == expected and layer.out_channels == 6 and layer.bias_shape == (1, 6, 1, 1)
    assert _same(fused, model, conv_params, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def _onnx_hard_sigmoid(y, alpha):
    """As the ONNX importer lowers HardSigmoid (HardSwish is alpha 1/6)."""
    return jnp.clip(y * np.float32(alpha) + np.float32(0.5), 0, 1).astype(y.dtype)


_SIXTH = float(np.float32(1 / 6))


@pytest.mark.parametrize(
    "act, expected",
    [
        (jax.nn.sigmoid, ("sigmoid",)),
        (jax.nn.silu, ("silu",)),
        (lambda y: jax.nn.sigmoid(y) * y, ("silu",)),
        (jax.nn.hard_sigmoid, ("hard_sigmoid", 1 / 6, 0.0)),  # the + 3 joins the bias
        (lambda y: _onnx_hard_sigmoid(y, 0.2), ("hard_sigmoid", float(np.float32(0.2)), 0.5)),
        (jax.nn.hard_swish, ("hard_swish", 1 / 6, 0.5)),
        (lambda y: y * _onnx_hard_sigmoid(y, 1 / 6), ("hard_swish", _SIXTH, 0.5)),
        (lambda y: _onnx_hard_sigmoid(y, 1 / 6) * y, ("hard_swish", _SIXTH, 0.5)),
        (lambda y: jax.nn.hard_swish(y + 1.0), ("hard_swish", 1 / 6, 0.5)),  # 1.0 joins the bias
        (lambda y: y * (jnp.clip((y + 1.0) * 0.25, 0.0, 0.5) * 2.0), ("hard_swish", 0.5, 0.5)),
        (lambda y: jnp.minimum(jnp.maximum(y + 2.0, 0.0), 4.0) * 0.25, ("hard_sigmoid", 0.25, 0.0)),
        (lambda y: jax.nn.gelu(y, approximate=False), ("gelu",)),
        (lambda y: y * (lax.erf(y / np.float32(np.sqrt(2))) + 1.0) * 0.5, ("gelu",)),  # torch's export
        (lambda y: jax.nn.gelu(y, approximate=True), ("gelu_tanh",)),
        (lambda y: y * (1.0 + jnp.tanh((y + y * y * y * np.float32(0.044715)) * np.float32(np.sqrt(2 / np.pi))))
         * 0.5, ("gelu_tanh",)),  # torch's export
    ],
)
@pytest.mark.parametrize("op", ["conv", "dense"])
def test_smooth_and_hard_activations_fuse(op, act, expected, tree_allclose):
    x = _normal(2, 3, 8, 8) if op == "conv" else _normal(5, 12)
    p = dict(w=_normal(6, 3, 3, 3, seed=1) if op == "conv" else _normal(12, 6, seed=1), b=3 * _normal(6, seed=2))
    if op == "conv":
        model = lambda p, x: act(_conv(x, p["w"]) + p["b"].reshape(1, -1, 1, 1))  # noqa: E731
        recipe, name, shape = fusion.conv_bias_act, "conv_bias_act", (2, 6, 8, 8)
    else:
        model = lambda p, x: act(x @ p["w"] + p["b"])  # noqa: E731
        recipe, name, shape = fusion.dense, "dense", (5, 6)
    fused = recipe(model)
    ops = _activation_ops(fused, p, x, shape=shape)
    assert ops - collections.Counter(copy=1) == {name: 1}  # jax.nn.gelu ends in a copy
    (eqn,) = [e for e in iter_eqns(make_jaxpr(fused, p, x).jaxpr) if e.primitive.name == name]
    name, *numbers = eqn.params["activation"]
    assert name == expected[0] and numbers == pytest.approx(list(expected[1:]), rel=1e-7)
    assert _same(fused, model, p, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)
    swapped = jtile.swap_backend(fused, algorithms={"conv2d": "smm", "dense": "gemm"})
    assert _same(swapped, model, p, x, tree_allclose=tree_allclose, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "act",
    [
        lambda y: y * jnp.clip(y / 6 + 0.5, 0.0, 2.0),  # not a hard sigmoid: tops out at 2
        lambda y: y * jax.nn.sigmoid(2.0 * y),  # swish with beta 2
        lambda y: jax.nn.sigmoid(y) * jax.nn.relu(y),
        lambda y: y * jnp.clip(y / 6 + 0.5, 0.0, 1.0) * jax.nn.sigmoid(y),
        lambda y: y * (lax.erf(y / 2.0) + 1.0) * 0.5,  # erf of the wrong scale
        lambda y: jax.nn.relu(y) + jax.nn.sigmoid(y),
        lambda y: y * (lax.erf(y / np.float32(np.sqrt(2))) + 1.0),  # twice GELU
        lambda y: 0.5 * y * (1.0 + jnp.tanh(0.8 * (y + 0.044715 * y**3))),  # tanh GELU's constant off
    ],
)
def test_activations_not_recognised_keep_one_conv_and_the_result(act, conv_params, tree_allclose):
    """Branches of `y` that meet but are no known activation: `y` is computed
    once (one conv op) and the rest stays in jnp, with the same result."""
    x = _normal(2, 3, 8, 8)
    model = lambda p, x: act(_conv(x, p["w"]) + p["b"].reshape(1, -1, 1, 1))  # noqa: E731
    fused = fusion.fuse(model)
    ops = _ops(fused, conv_params, x)
    assert ops["conv_bias_act"] + ops["conv_general_dilated"] == 1
    assert _same(fused, model, conv_params, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def _residual_block(p, x, downsample: bool):
    """A ResNet basic block: conv-bias-relu, conv-bias, + shortcut, relu."""
    bias = lambda name: p[name].reshape(1, -1, 1, 1)  # noqa: E731
    y = jax.nn.relu(_conv(x, p["w1"]) + bias("b1"))
    y = _conv(y, p["w2"]) + bias("b2")
    shortcut = _conv(x, p["wd"]) + bias("bd") if downsample else x
    return jax.nn.relu(y + shortcut)


@pytest.mark.parametrize("downsample", [False, True])
def test_residual_add_joins_the_conv_before_its_activation(tree_allclose, downsample):
    c = 6
    p = {k: _normal(c, c, 3, 3, seed=i) * 0.2 for i, k in enumerate(("w1", "w2", "wd"))}
    p.update({k: _normal(c, seed=9 + i) for i, k in enumerate(("b1", "b2", "bd"))})
    x = _normal(2, c, 8, 8, seed=5)
    block = lambda p, x: _residual_block(p, x, downsample)  # noqa: E731
    fused = fusion.conv_bias_act(block)
    convs = [e for e in iter_eqns(make_jaxpr(fused, p, x).jaxpr) if e.primitive.name == "conv_bias_act"]
    assert len(convs) == (3 if downsample else 2)
    assert [describe(e).residual for e in convs].count(True) == 1
    assert not {"add", "max"} & set(_activation_ops(fused, p, x, shape=(2, c, 8, 8)))
    assert _same(fused, block, p, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)
    swapped = jtile.swap_backend(fused, algorithms="auto")
    assert tree_allclose(jax.jit(swapped)(p, x), jax.jit(block)(p, x), rtol=1e-4, atol=1e-4)
    assert jax.make_jaxpr(swapped)(p, x).pretty_print().count("ffi_call") == len(convs)


def test_residual_is_not_taken_after_the_activation(tree_allclose):
    c = 6
    p = {"w1": _normal(c, c, 3, 3) * 0.2, "b1": _normal(c, seed=1)}
    x = _normal(2, c, 8, 8, seed=2)

    def model(p, x):
        return jax.nn.relu(_conv(x, p["w1"]) + p["b1"].reshape(1, -1, 1, 1)) + x

    fused = fusion.conv_bias_act(model)
    (conv,) = [e for e in iter_eqns(make_jaxpr(fused, p, x).jaxpr) if e.primitive.name == "conv_bias_act"]
    assert not describe(conv).residual and conv.params["activation"] == ("relu",)
    assert _same(fused, model, p, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def test_shared_values_are_not_fused(conv_params, tree_allclose):
    x = _normal(2, 3, 8, 8)

    def model(p, x):
        y = _conv(x, p["w"])
        z = jax.nn.relu(y + p["b"].reshape(1, -1, 1, 1))  # y is used twice: residual below
        return z + y, jax.nn.relu(_conv(x, p["w"]) + 1.0)

    fused = fusion.fuse(model)
    ops = _ops(fused, conv_params, x)
    assert ops["conv_general_dilated"] == 1 and ops["conv_bias_act"] == 1
    assert _same(fused, model, conv_params, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def test_shared_activation_jaxpr_fuses_only_the_chain(conv_params, tree_allclose):
    """Both leaky relus share one inner jaxpr; only the one after the conv fuses."""
    x = _normal(2, 3, 8, 8)

    def model(p, x):
        y = jax.nn.leaky_relu(_conv(x, p["w"]) + p["b"].reshape(1, -1, 1, 1), 0.1)
        z = jax.nn.leaky_relu(jnp.ones_like(y) * x[:, :1].sum(), 0.1)
        return y + z

    fused = fusion.fuse(model)
    ops = _ops(fused, conv_params, x)
    assert ops["conv_bias_act"] == 1 and ops["select_n"] == 1 and ops["ge"] == 1
    assert _same(fused, model, conv_params, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def test_fused_function_outputs_pending_values_only_when_safe(conv_params, tree_allclose):
    """A chain value that is a result of the function must be computed, not left pending."""
    x = _normal(2, 3, 8, 8)
    model = lambda p, x: _conv(x, p["w"]) * 2.0  # noqa: E731
    for recipe in (fusion.fold_batchnorm, fusion.conv_bias_act):
        assert _same(recipe(model), model, conv_params, x, tree_allclose=tree_allclose, rtol=1e-5, atol=1e-5)


def test_fold_constants_and_drop_identity(tree_allclose):
    x = _normal(4, 3)
    table = jnp.arange(3.0)

    def model(x):
        scale = jnp.exp(table) * 2.0 + 1.0  # depends only on a constant
        y = (x * scale).astype(jnp.float32).reshape(4, 3) * 1.0 + 0.0
        return jnp.transpose(y, (0, 1))

    before = _ops(model, x)
    assert before["exp"] == 1 and before["mul"] == 3
    folded = fusion.fold_constants(model)
    assert _ops(folded, x) == {"mul": 2, "add": 1}  # x * scale, * 1.0, + 0.0
    clean = fusion.drop_identity(folded)
    assert _ops(clean, x) == {"mul": 1}
    assert _ops(fusion.fuse(model), x) == {"mul": 1}
    assert _same(clean, model, x, tree_allclose=tree_allclose)
    assert _same(fusion.fuse(model), model, x, tree_allclose=tree_allclose)


def test_folded_data_movement_keeps_every_bit(getkey, monkeypatch):
    """Reshape, broadcast, transpose and squeeze of known arrays (folded in
    numpy) give the bits XLA gives, weak-typed scalars included."""
    from jtile.fusion import _simplify

    on_host, moved_in_numpy = _simplify._on_host, set()

    def spy(eqn, invals):
        out = on_host(eqn, invals)
        if out is not None:
            moved_in_numpy.add(eqn.primitive.name)
        return out

    monkeypatch.setattr(_simplify, "_on_host", spy)
    w = jax.random.normal(getkey(), (3, 1, 5))

    def model(w, x):
        spread = lax.broadcast_in_dim(w[:, 0], (3, 4, 5), (0, 2))  # squeeze, then a middle axis
        moved = jnp.transpose(spread, (2, 0, 1)).reshape(5, 12)
        return x @ moved + lax.broadcast_in_dim(2.0, (12,), ())

    x = jax.random.normal(getkey(), (2, 5))
    folded = fusion.fold_constants(lambda x: model(w, x))
    assert set(_ops(folded, x)) == {"dot_general", "add"}
    assert moved_in_numpy == {"squeeze", "broadcast_in_dim", "transpose", "reshape"}
    assert np.array_equal(np.asarray(jax.jit(folded)(x)), np.asarray(jax.jit(model)(w, x)))


def test_zoo_layers_conv_bn_relu6_fuse(getkey, tree_allclose):
    """A MobileNetV2 stem and depthwise conv built from the zoo's layers."""
    block = (
        models.Conv2d(3, 8, 3, stride=2, padding=1, bias=False, key=getkey(), name="stem"),
        models.BatchNorm2d(8, name="stem_bn"),
        models.ReLU6(name="stem_act"),
        models.Conv2d(8, 8, 3, padding=1, groups=8, bias=False, key=getkey(), name="dw"),
        models.BatchNorm2d(8, name="dw_bn"),
        models.ReLU6(name="dw_act"),
        models.Conv2d(8, 4, 1, key=getkey(), name="project"),
        models.BatchNorm2d(4, name="project_bn"),
    )
    params, static = eqx.partition(block, eqx.is_array)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jnp.asarray(p * rng.uniform(0.5, 1.5, p.shape) + 0.1, jnp.float32), params)
    fn = lambda p, x: models._layers.sequential(eqx.combine(p, static), x)  # noqa: E731
    x = _normal(1, 3, 16, 16)
    before = _ops(fn, params, x)
    fused = fusion.fuse(fn)
    after = _ops(fused, params, x)
    assert before["conv_general_dilated"] == 3 and before["min"] == 2
    assert after["conv_bias_act"] == 3 and not (after.keys() & {"conv_general_dilated", "min", "max"})
    acts = [e.params["activation"] for e in iter_eqns(make_jaxpr(fused, params, x).jaxpr) if e.primitive.name == "conv_bias_act"]
    assert acts == [("clip", 0.0, 6.0), ("clip", 0.0, 6.0), ()]
    assert _same(fused, fn, params, x, tree_allclose=tree_allclose, rtol=1e-4, atol=1e-4)


def test_fuse_composes_and_differentiates(tree_allclose):
    x, w, b = _normal(3, 5), _normal(5, 4, seed=1), _normal(4, seed=2)

    @fusion.fuse(recipes=("dense",))
    def layer(x, w, b):
        """doc"""
        return jax.nn.relu6(x @ w + b)

    ref = lambda x, w, b: jax.nn.relu6(x @ w + b)  # noqa: E731
    assert layer.__name__ == "layer" and layer.__doc__ == "doc"
    assert tree_allclose(eqx.filter_jit(layer)(x, w, b), ref(x, w, b), atol=1e-6)
    assert tree_allclose(split_gemm(layer, max_k=2)(x, w, b), ref(x, w, b), atol=1e-5)
    assert tree_allclose(fusion.fuse(jax.jit(ref))(x, w, b), ref(x, w, b), atol=1e-6)
    assert tree_allclose(jax.grad(lambda w: layer(x, w, b).sum())(w), jax.grad(lambda w: ref(x, w, b).sum())(w), atol=1e-5)
    assert tree_allclose(jax.vmap(layer, in_axes=(0, None, None))(x[None], w, b), ref(x, w, b)[None], atol=1e-6)


def test_bad_arguments_raise():
    with pytest.raises(jtile.ConfigError, match="unknown recipe.*'fold_bn'.*valid recipes"):
        fusion.fuse(jnp.sin, recipes=("fold_bn",))
    with pytest.raises(jtile.ConfigError, match="unknown keyword"):
        fusion.fuse(jnp.sin, recipe="dense")
    with pytest.raises(jtile.ConfigError, match="unknown keyword"):
        fusion.fold_batchnorm(jnp.sin, eps=1e-3)
    with pytest.raises(jtile.ConfigError, match="expected a function"):
        fusion.conv_bias_act(3)


def test_two_products_added_are_not_a_bias(getkey):
    """`x1 @ w1 + x2 @ w2` (split_gemm's K halves): neither product is the
    other's bias, and both survive fusion."""
    x, w = jax.random.normal(getkey(), (1, 8)), jax.random.normal(getkey(), (8, 4))

    def f(x, w):
        return x[:, :4] @ w[:4] + x[:, 4:] @ w[4:]

    np.testing.assert_allclose(jtile.fuse(f)(x, w), x @ w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dilation, size, stride, taps", [(24, 14, 1, 1), (36, 14, 1, 1),
                                                         (6, 5, 1, 1), (7, 6, 1, 1)])
def test_crop_dead_taps_keeps_the_conv_and_drops_taps_that_read_padding(getkey, dilation, size, stride, taps):
    x = jax.random.normal(getkey(), (2, 4, size, size + 1))
    w = jax.random.normal(getkey(), (5, 4, 3, 3))
    pad = ((dilation, dilation), (dilation, dilation))

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (stride, stride), pad, rhs_dilation=(dilation, dilation))

    cropped = jtile.fusion.crop_dead_taps(conv)
    (eqn,) = [e for e in jax.make_jaxpr(cropped)(x, w).eqns if e.primitive.name == "conv_general_dilated"]
    assert eqn.invars[1].aval.shape[2] == taps
    np.testing.assert_allclose(cropped(x, w), conv(x, w), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("dimension_numbers, stride, groups", [
    (("NCHW", "OIHW", "NCHW"), 1, 1),     # DeepLabV3's atrous 3x3 at dilation 12 on a 14x14 map
    (("NHWC", "HWIO", "NHWC"), 2, 1),
    (("NCHW", "OIHW", "NCHW"), 1, 2),
])
def test_crop_dead_taps_splits_a_conv_into_regions_of_live_taps(getkey, dimension_numbers, stride, groups):
    """Each output region reads the input through fewer taps than the whole conv
    (rows 0-1 through 2 of 3, rows 2-11 through 1): one conv a region, each
    cropped, at least halve the MACs and give the conv's result."""
    lhs, rhs, _ = dimension_numbers
    x = jax.random.normal(getkey(), tuple({"N": 16, "C": 96, "H": 14, "W": 15}[a] for a in lhs))
    w = jax.random.normal(getkey(), tuple({"O": 96, "I": 96 // groups, "H": 3, "W": 3}[a] for a in rhs))

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (stride, stride), ((12, 12), (12, 12)), rhs_dilation=(12, 12),
                                        dimension_numbers=dimension_numbers, feature_group_count=groups)

    cropped = jtile.fusion.crop_dead_taps(conv)
    convs = [e for e in jax.make_jaxpr(cropped)(x, w).eqns if e.primitive.name == "conv_general_dilated"]
    macs = sum(ConvGeometry.of(e).macs for e in convs)
    (whole,) = [e for e in jax.make_jaxpr(conv)(x, w).eqns if e.primitive.name == "conv_general_dilated"]
    assert len(convs) > 1 and 2 * macs <= ConvGeometry.of(whole).macs
    np.testing.assert_allclose(cropped(x, w), conv(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size, channels", [(14, 96), (2, 128)])
def test_crop_dead_taps_leaves_a_padded_3x3_whole(getkey, size, channels):
    """Border rows of a 3x3 pad-1 conv drop a tap each: too little to pay for
    regions. On a 2x2 map each output reads 4 of 9 taps, but 4 regions cost
    more ops than the MACs they save."""
    x = jax.random.normal(getkey(), (1, channels, size, size))
    w = jax.random.normal(getkey(), (channels, channels, 3, 3))
    conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)))  # noqa: E731
    jaxpr = jax.make_jaxpr(jtile.fusion.crop_dead_taps(conv))(x, w)
    assert [e.primitive.name for e in jaxpr.eqns] == ["conv_general_dilated"]

def _onnx_conv_then(nodes, opset: int):
    """An ONNX graph: Conv (bias) -> the activation `nodes` (input "y", output "out")."""
    from onnx import TensorProto, helper, numpy_helper

    w, b = numpy_helper.from_array(_normal(4, 3, 3, 3, seed=1), "w"), numpy_helper.from_array(_normal(4, seed=2), "b")
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [conv, *nodes], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 6, 6])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _onnx_const(name, value):
    from onnx import helper, numpy_helper

    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32)))


@pytest.mark.parametrize(
    "nodes, opset, expected",
    [
        ([("Sigmoid", ["y"], ["s"]), ("Mul", ["y", "s"], ["out"])], 17, "silu"),
        ([("HardSwish", ["y"], ["out"])], 17, "hard_swish"),
        ([("Sigmoid", ["y"], ["out"])], 17, "sigmoid"),
        ([("Gelu", ["y"], ["out"])], 20, "gelu"),
        ([("Div", ["y", "sqrt2"], ["d"]), ("Erf", ["d"], ["e"]), ("Add", ["e", "one"], ["a"]),
          ("Mul", ["y", "a"], ["m"]), ("Mul", ["m", "half"], ["out"])], 17, "gelu"),  # torch's GELU at opset 17
        ([("Mul", ["y", "y"], ["y2"]), ("Mul", ["y2", "y"], ["y3"]), ("Mul", ["y3", "c3"], ["t"]),
          ("Add", ["y", "t"], ["u"]), ("Mul", ["u", "k"], ["v"]), ("Tanh", ["v"], ["th"]),
          ("Add", ["th", "one"], ["a"]), ("Mul", ["y", "a"], ["m"]), ("Mul", ["m", "half"], ["out"])], 17,
         "gelu_tanh"),  # torch's GELU(approximate="tanh") at opset 17
    ],
)
def test_onnx_imported_activations_fuse_and_match_onnxruntime(nodes, opset, expected, tree_allclose):
    import onnxruntime as ort
    from onnx import helper

    import jtile.onnx

    consts = [_onnx_const("sqrt2", np.sqrt(2)), _onnx_const("one", 1.0), _onnx_const("half", 0.5),
              _onnx_const("c3", 0.044715), _onnx_const("k", np.sqrt(2 / np.pi))]
    proto = _onnx_conv_then([*consts, *(helper.make_node(op, i, o) for op, i, o in nodes)], opset)
    model = jtile.onnx.load(proto)
    x = _normal(1, 3, 6, 6, seed=3)
    folded = fusion.fold_params(model.fn, model.params)
    (eqn,) = [e for e in iter_eqns(make_jaxpr(folded, x).jaxpr) if e.primitive.name == "conv_bias_act"]
    assert eqn.params["activation"][0] == expected
    assert _activation_ops(folded, x, shape=(1, 4, 6, 6)) == {"conv_bias_act": 1}
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    swapped = jtile.swap_backend(folded, algorithms={"conv2d": "smm"})
    assert tree_allclose(np.asarray(swapped(x)), want, rtol=1e-5, atol=1e-5)
