import functools

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax

import jtile

RTOL, ATOL = 1e-5, 1e-6


def _conv(x, w, *, stride=(1, 1), padding=((1, 1), (1, 1)), dn=("NCHW", "OIHW", "NCHW"), **kw):
    return lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=dn, **kw)


def _tutorial(params, x):
    """Aidge's horizontal-tiling tutorial: LeakyReLU, Conv 3->32 3x3, BatchNorm, ReLU."""
    y = _conv(jax.nn.leaky_relu(x), params["w"])
    y = (y - params["mean"][:, None, None]) * lax.rsqrt(params["var"][:, None, None] + 1e-5)
    return jax.nn.relu(y * params["gamma"][:, None, None] + params["beta"][:, None, None])


@pytest.fixture
def tutorial(getkey):
    params = {
        "w": jax.random.normal(getkey(), (32, 3, 3, 3)) * 0.2,
        "mean": jax.random.normal(getkey(), (32,)),
        "var": jax.random.uniform(getkey(), (32,), minval=0.5, maxval=2.0),
        "gamma": jax.random.normal(getkey(), (32,)),
        "beta": jax.random.normal(getkey(), (32,)),
    }
    return params, jax.random.normal(getkey(), (4, 3, 66, 66))


def _count(jaxpr, name):
    return sum(e.primitive.name == name for e in jaxpr.jaxpr.eqns)


def test_tutorial_has_aidge_structure_and_same_outputs(tutorial):
    params, x = tutorial
    tiled = jtile.tile_conv(_tutorial, axis="H", tiles=4)
    jaxpr = jax.make_jaxpr(tiled)(params, x)
    assert _count(jaxpr, "slice") == 4
    assert _count(jaxpr, "conv_general_dilated") == 4
    assert _count(jaxpr, "concatenate") == 1
    expected, got = jax.jit(_tutorial)(params, x), jax.jit(tiled)(params, x)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_tutorial_tiled_output_is_bit_identical(tutorial):
    # Each stripe reduces every output element over the same window in the same
    # order, so XLA:CPU gives bit-identical results on this net.
    params, x = tutorial
    tiled = jax.jit(jtile.tile_conv(_tutorial, axis="H", tiles=4))
    assert np.array_equal(np.asarray(tiled(params, x)), np.asarray(jax.jit(_tutorial)(params, x)))


def test_border_padding_stays_with_border_stripes(tutorial):
    params, x = tutorial
    jaxpr = jax.make_jaxpr(jtile.tile_conv(_tutorial, axis="H", tiles=4))(params, x)
    pads = [e.params["padding"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert [p[0] for p in pads] == [(1, 0), (0, 0), (0, 0), (0, 1)]
    assert all(p[1] == (1, 1) for p in pads)


@st.composite
def conv_configs(draw):
    spatial = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.integers(1, 3))
    cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(spatial))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(spatial))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(spatial))
    padding = tuple((draw(st.integers(0, 3)), draw(st.integers(0, 3))) for _ in range(spatial))
    sizes = tuple(
        draw(st.integers((k - 1) * d + 1, (k - 1) * d + 12)) for k, d in zip(kernel, dilation)
    )
    letters = "DHW"[-spatial:]
    lhs = draw(st.sampled_from(["NC" + letters, "N" + letters + "C", letters + "NC"]))
    rhs = draw(st.sampled_from(["OI" + letters, letters + "IO"]))
    out = draw(st.sampled_from(["NC" + letters, "N" + letters + "C"]))
    return dict(
        batch=draw(st.integers(1, 2)), cin=cin, cout=cout, groups=groups, kernel=kernel,
        dilation=dilation, stride=stride, padding=padding, sizes=sizes, dn=(lhs, rhs, out),
        spatial_choice=draw(st.integers(0, spatial - 1)), tiles_seed=draw(st.integers(1, 10**6)),
        use_int_axis=draw(st.booleans()),
    )


def _operand(spec: str, dims: dict, key):
    return jax.random.normal(key, tuple(dims[c] for c in spec))


@settings(max_examples=25, deadline=None)
@given(cfg=conv_configs())
def test_tiling_matches_untiled_on_random_convs(cfg):
    lhs_spec, rhs_spec, out_spec = cfg["dn"]
    letters = "DHW"[-len(cfg["sizes"]):]
    lhs_dims = {"N": cfg["batch"], "C": cfg["cin"], **dict(zip(letters, cfg["sizes"]))}
    rhs_dims = {"O": cfg["cout"], "I": cfg["cin"] // cfg["groups"], **dict(zip(letters, cfg["kernel"]))}
    k1, k2 = jax.random.split(jax.random.key(cfg["tiles_seed"]))
    x, w = _operand(lhs_spec, lhs_dims, k1), _operand(rhs_spec, rhs_dims, k2)
    f = functools.partial(
        _conv, stride=cfg["stride"], padding=cfg["padding"], dn=cfg["dn"],
        rhs_dilation=cfg["dilation"], feature_group_count=cfg["groups"],
    )
    expected = jax.jit(f)(x, w)
    letter = letters[cfg["spatial_choice"]]
    out_axis = out_spec.index(letter)
    tiles = 1 + cfg["tiles_seed"] % expected.shape[out_axis]
    axis = out_axis if cfg["use_int_axis"] else letter
    got = jax.jit(jtile.tile_conv(f, axis=axis, tiles=tiles))(x, w)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_uneven_stripes_differ_by_at_most_one_row(getkey):
    x, w = jax.random.normal(getkey(), (1, 2, 10, 7)), jax.random.normal(getkey(), (3, 2, 3, 3))
    tiled = jtile.tile_conv(_conv, axis="H", tiles=4)
    jaxpr = jax.make_jaxpr(tiled)(x, w)
    rows = [e.outvars[0].aval.shape[2] for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert sorted(rows) == [2, 2, 3, 3]
    np.testing.assert_allclose(tiled(x, w), _conv(x, w), rtol=RTOL, atol=ATOL)


def test_select_limits_tiled_layers(getkey):
    x = jax.random.normal(getkey(), (1, 3, 16, 16))
    w1, w2 = jax.random.normal(getkey(), (8, 3, 3, 3)), jax.random.normal(getkey(), (4, 8, 1, 1))

    def two(x, w1, w2):
        return _conv(jax.nn.relu(_conv(x, w1)), w2, padding=((0, 0), (0, 0)))

    seen = []

    def only_3x3(layer):
        seen.append(layer)
        return layer.kernel_size == (3, 3)

    tiled = jtile.tile_conv(two, axis="W", tiles=2, select=only_3x3)
    jaxpr = jax.make_jaxpr(tiled)(x, w1, w2)
    assert _count(jaxpr, "conv_general_dilated") == 3
    assert [layer.index for layer in seen] == [0, 1]
    assert seen[0].in_channels == 3 and seen[0].out_channels == 8
    np.testing.assert_allclose(tiled(x, w1, w2), two(x, w1, w2), rtol=RTOL, atol=ATOL)


def test_conv_found_inside_nested_jit_scan_and_cond(getkey):
    x, w = jax.random.normal(getkey(), (1, 2, 9, 9)), jax.random.normal(getkey(), (2, 2, 3, 3))

    @jax.jit
    def inner(x, w):
        return jax.nn.relu(_conv(x, w))

    def f(x, w):
        def body(carry, _):
            return inner(carry, w), None

        y, _ = lax.scan(body, x, None, length=2)
        return lax.cond(y.sum() > 0, lambda y: inner(y, w), lambda y: -y, y)

    tiled = jtile.tile_conv(f, axis="H", tiles=3)
    jaxpr = jax.make_jaxpr(tiled)(x, w)
    convs = [e for e in jtile._interpreter.iter_eqns(jaxpr.jaxpr) if e.primitive.name == "conv_general_dilated"]
    assert len(convs) == 6
    np.testing.assert_allclose(jax.jit(tiled)(x, w), f(x, w), rtol=RTOL, atol=1e-5)


def test_decorator_bare_and_composition(getkey, tree_allclose):
    x, w = jax.random.normal(getkey(), (1, 2, 12, 12)), jax.random.normal(getkey(), (2, 2, 3, 3))

    @jtile.tile_conv(axis="H", tiles=2)
    def decorated(x, w):
        """Docstring kept."""
        return _conv(x, w)

    assert decorated.__name__ == "decorated" and decorated.__doc__ == "Docstring kept."
    twice = jtile.tile_conv(jtile.tile_conv(_conv, axis="H", tiles=2), axis="W", tiles=3)
    jaxpr = jax.make_jaxpr(twice)(x, w)
    assert _count(jaxpr, "conv_general_dilated") == 6
    assert tree_allclose(jax.jit(twice)(x, w), _conv(x, w))
    assert tree_allclose(eqx.filter_jit(decorated)(x, w), _conv(x, w))


def test_equinox_module_arguments_and_static_leaves(getkey, tree_allclose):
    class Block(eqx.Module):
        conv: eqx.nn.Conv2d
        scale: float = eqx.field(static=True)

        def __call__(self, x):
            return self.conv(x) * self.scale

    block = Block(eqx.nn.Conv2d(3, 4, 3, padding=1, key=getkey()), 2.0)
    x = jax.random.normal(getkey(), (3, 10, 10))

    def apply(block, x, mode="sum"):
        out = block(x)
        return {"out": out, "total": out.sum() if mode == "sum" else out.max()}

    tiled = jtile.tile_conv(apply, axis="H", tiles=2)
    assert tree_allclose(tiled(block, x), apply(block, x), atol=1e-5)
    assert tree_allclose(tiled(block, x, mode="max"), apply(block, x, mode="max"))
    assert len(tiled.__jtile_cache__) == 2


def test_grad_through_tiled_function(getkey, tree_allclose):
    x, w = jax.random.normal(getkey(), (2, 3, 11, 9)), jax.random.normal(getkey(), (4, 3, 3, 3))

    def loss(w, x):
        return jnp.sum(jnp.tanh(_conv(x, w, stride=(2, 1))))

    tiled = jtile.tile_conv(loss, axis="H", tiles=3)
    assert tree_allclose(jax.grad(tiled)(w, x), jax.grad(loss)(w, x), rtol=1e-4, atol=1e-5)


def test_untileable_convs_are_left_alone_unless_selected(getkey):
    x, w = jax.random.normal(getkey(), (1, 2, 6, 6)), jax.random.normal(getkey(), (2, 2, 3, 3))

    def transposed(x, w):
        return _conv(x, w, lhs_dilation=(2, 2))

    jaxpr = jax.make_jaxpr(jtile.tile_conv(transposed, axis="H", tiles=2))(x, w)
    assert _count(jaxpr, "conv_general_dilated") == 1 and _count(jaxpr, "concatenate") == 0
    explicit = jtile.tile_conv(transposed, axis="H", tiles=2, select=lambda layer: True)
    with pytest.raises(jtile.UnsupportedError, match="lhs_dilation"):
        explicit(x, w)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(axis="H", tiles=0), "tiles must be a positive int"),
        (dict(axis="H", tiles=2.0), "tiles must be a positive int"),
        (dict(axis="X", tiles=2), "axis must be"),
        (dict(axis="H"), "required"),
        (dict(axis="H", tiles=2, tile=3), "unknown keyword.*tile.*valid keywords are axis, tiles, select"),
        (dict(axis="H", tiles=2, select=3), "select must be a predicate"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, match):
    with pytest.raises(jtile.ConfigError, match=match):
        jtile.tile_conv(_conv, **kwargs)


def test_bad_calls_are_rejected(getkey):
    x, w = jax.random.normal(getkey(), (1, 2, 3, 8)), jax.random.normal(getkey(), (2, 2, 3, 3))
    with pytest.raises(jtile.ConfigError, match="has 3 output rows along axis 2, cannot make 4 tiles; use tiles <= 3"):
        jtile.tile_conv(_conv, axis="H", tiles=4, strict=True)(x, w)
    with pytest.raises(jtile.ConfigError, match="has 3 output rows along axis 2, cannot make 4 tiles"):
        jtile.tile_conv(_conv, axis="H", tiles=4, select=lambda layer: True)(x, w)
    with pytest.raises(jtile.ConfigError, match="axis 1 is not a spatial dimension"):
        jtile.tile_conv(_conv, axis=1, tiles=2)(x, w)
    with pytest.raises(jtile.ConfigError, match="must return arrays"):
        jtile.tile_conv(lambda x, w: "nope", axis="H", tiles=2)(x, w)
    with pytest.raises(jtile.ConfigError, match="must return arrays"):
        jtile.tile_conv(lambda x, w: (_conv(x, w), 3.0), axis="H", tiles=2)(x, w)
    with pytest.raises(jtile.ConfigError, match="unhashable"):
        jtile.tile_conv(lambda x, w, opts: _conv(x, w), axis="H", tiles=2)(x, w, {1})


def test_small_unselected_layers_get_fewer_stripes_and_one_warning(getkey):
    """A squeeze-excitation 1x1 conv on a 1x1 map stays whole, a 3-row conv gets
    3 stripes, and one warning names both."""
    x = jax.random.normal(getkey(), (1, 4, 3, 8))
    w, w_se = jax.random.normal(getkey(), (4, 4, 3, 3)), jax.random.normal(getkey(), (4, 4, 1, 1))

    def f(x, w, w_se):
        y = _conv(x, w)
        s = _conv(jnp.mean(y, axis=(2, 3), keepdims=True), w_se, padding=((0, 0), (0, 0)))
        return y * jax.nn.sigmoid(s)

    tiled = jtile.tile_conv(f, axis="H", tiles=4)
    with pytest.warns(jtile.tiling.TilingWarning, match=r"2 layer\(s\).*conv2d #0 \(3\), conv2d #1 \(1\)"):
        jaxpr = jax.make_jaxpr(tiled)(x, w, w_se)
    assert _count(jaxpr, "conv_general_dilated") == 3 + 1
    np.testing.assert_allclose(jax.jit(tiled)(x, w, w_se), f(x, w, w_se), rtol=RTOL, atol=ATOL)
