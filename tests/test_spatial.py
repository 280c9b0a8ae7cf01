import collections
import difflib
import os
import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from jax import lax

import jtile
from jtile import ConfigError
from jtile._fused import conv_bias_act
from jtile._graph import Graph
from jtile._interpreter import iter_eqns, make_jaxpr
from jtile.models._layers import sequential
from jtile.spatial import SpatialWarning, make_plan, select_block, tile_windows

_NCHW = ("NCHW", "OIHW", "NCHW")


def _conv(x, w, stride=1, pad=0, dilation=1, groups=1):
    pads = pad if isinstance(pad, (list, tuple)) else [(pad, pad)] * 2
    return lax.conv_general_dilated(x, w, (stride, stride), pads, rhs_dilation=(dilation, dilation),
                                    dimension_numbers=_NCHW, feature_group_count=groups)


def _assert_tiled_close(got, expected, atol=1e-6):
    """`tile_conv`'s tolerance: rtol 1e-5, atol 1e-6 x the output scale."""
    expected = np.asarray(expected)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=atol * scale)


# ---------------------------------------------------------------- seed 001's example


def _seed_net(params, x):
    """Conv 3x3 -> ReLU -> Conv 1x1 -> ReLU -> Pad 1 -> Conv 3x3 -> ReLU, on 50x50."""
    w1, w2, w3 = params
    y = jax.nn.relu(_conv(x, w1))
    y = jax.nn.relu(_conv(y, w2))
    return jax.nn.relu(_conv(_pad1(y), w3))


def _pad1(y):
    return jnp.pad(y, ((0, 0), (0, 0), (1, 1), (1, 1)))


def _seed_params(getkey):
    shapes = [(4, 3, 3, 3), (4, 4, 1, 1), (4, 4, 3, 3)]
    return [jax.random.normal(getkey(), s) for s in shapes], jax.random.normal(getkey(), (1, 3, 50, 50))


def _support(fn, x, window):
    """Rows and cols of `x` that output `window` (rows, cols) depends on: a vjp's sparsity."""
    def tile_sum(x):
        out = fn(x)[:, :, window[0][0] : window[0][1], window[1][0] : window[1][1]]
        return jnp.sum(out * jax.random.uniform(jax.random.key(7), out.shape, minval=0.5, maxval=1.5))

    grad = np.asarray(jax.grad(tile_sum)(x)) != 0
    rows, cols = np.flatnonzero(grad.any(axis=(0, 1, 3))), np.flatnonzero(grad.any(axis=(0, 1, 2)))
    return rows, cols


def test_seed_example_unrolled_tiles_read_brute_force_windows_and_keep_border_pads_only(getkey):
    params, x = _seed_params(getkey)
    tiled = jtile.tile_spatial(_seed_net, grid=(3, 3), mode="unroll")
    _assert_tiled_close(tiled(params, x), _seed_net(params, x))
    closed = jax.make_jaxpr(tiled)(params, x)
    x_var = closed.jaxpr.invars[-1]
    slices = [e for e in closed.jaxpr.eqns if e.primitive.name == "slice" and e.invars[0] is x_var]
    pads = [e for e in closed.jaxpr.eqns if e.primitive.name == "pad"]
    assert len(slices) == 9 and len(pads) == 9
    # The brute force runs the untiled net with linear activations (so no gradient
    # dies in a ReLU): the receptive field is the same.
    w1, w2, w3 = params
    linear_front = lambda x: _conv(_conv(x, w1), w2)  # noqa: E731
    bounds = [(0, 16), (16, 32), (32, 48)]
    bordered = 0
    for k, (rows, cols) in enumerate((r, c) for r in bounds for c in bounds):
        r, c = _support(lambda x: _conv(_pad1(linear_front(x)), w3), x, (rows, cols))
        starts, limits = slices[k].params["start_indices"], slices[k].params["limit_indices"]
        assert (starts[2], limits[2]) == (r.min(), r.max() + 1)
        assert (starts[3], limits[3]) == (c.min(), c.max() + 1)
        # The inner Pad: a tile keeps a border's padding iff its receptive field reaches
        # that border row/col of the padded 50x50 activation.
        y = linear_front(x)
        pr, pc = _support(lambda p: _conv(p, w3), _pad1(y), (rows, cols))
        expected = ((int(pr.min() == 0), int(pr.max() == 49)), (int(pc.min() == 0), int(pc.max() == 49)))
        config = pads[k].params["padding_config"]
        assert ((config[2][0], config[2][1]), (config[3][0], config[3][1])) == expected
        bordered += expected != ((0, 0), (0, 0))
    assert bordered == 8  # every tile but the centre keeps padding, on its border sides only


def test_seed_example_looped_equals_untiled_on_even_and_uneven_grids(getkey):
    params, x = _seed_params(getkey)
    expected = _seed_net(params, x)
    for grid in [(3, 3), (2, 5), (7, 4), (1, 1), (48, 48)]:
        _assert_tiled_close(jax.jit(jtile.tile_spatial(_seed_net, grid=grid))(params, x), expected)


def test_loop_mode_program_size_does_not_grow_with_the_tile_count(getkey):
    params, x = _seed_params(getkey)

    def counts(grid):
        closed = make_jaxpr(jtile.tile_spatial(_seed_net, grid=grid), params, x)
        return collections.Counter(e.primitive.name for e in iter_eqns(closed.jaxpr))

    # First, interior and last tiles along an axis differ in shape (the first computes
    # the overlap the others reuse), so each is one branch: from 3x3 on, no new branch.
    assert counts((3, 3)) == counts((8, 8)) == counts((16, 16))
    assert counts((2, 2)) <= counts((8, 8))
    unrolled = make_jaxpr(jtile.tile_spatial(_seed_net, grid=(4, 4), mode="unroll"), params, x)
    assert sum(e.primitive.name == "conv_general_dilated" for e in unrolled.jaxpr.eqns) == 3 * 16


def test_looped_tiles_compute_every_output_element_of_every_layer_once(getkey):
    params, x = _seed_params(getkey)
    closed = make_jaxpr(_seed_net, params, x)
    for grid in [(3, 3), (5, 2), (7, 4)]:
        plan = make_plan(select_block(Graph.of(closed), 2), grid, uniform=False, reuse=True)
        for op in plan.block.ops:
            if op.primitive != "conv_general_dilated":
                continue
            v = op.outs[0]
            counts = np.zeros([v.shape[d] for d in plan.block.axes[v]], int)
            for rows, cols in plan.windows[v]:
                counts[rows.start : rows.stop, cols.start : cols.stop] += 1
            assert (counts == 1).all(), (grid, op.scope)  # brute force: no overlap, no hole
        _assert_tiled_close(jax.jit(jtile.tile_spatial(_seed_net, grid=grid))(params, x), _seed_net(params, x))


def test_looped_mobilenet_keeps_the_overlap_on_the_narrow_side_of_each_expansion(getkey):
    model = jtile.models.get("mobilenet_v2", getkey())
    x = jax.random.normal(getkey(), (1, 3, 64, 64))
    fn = lambda features, x: sequential(features[:5], x)  # noqa: E731
    closed = make_jaxpr(fn, model.features, x)
    plan = make_plan(select_block(Graph.of(closed), 2, until="features.4"), (4, 4), uniform=False, reuse=True)
    kept = {v.shape[1] for v in plan.cache}
    assert kept and max(kept) <= 32  # 16-, 24- and 32-channel values; never a 96- or 144-channel expansion
    # The looped tiles compute fewer MACs than the unrolled ones (which recompute
    # every overlap); the summary's count of the loop is an upper bound of that.
    unrolled = jtile.summary(jtile.tile_spatial(fn, grid=(4, 4), until="features.4", mode="unroll"), model.features, x)
    looped = jtile.summary(jtile.tile_spatial(fn, grid=(4, 4), until="features.4"), model.features, x)
    assert looped.untransformed_macs < looped.macs < unrolled.macs


def test_uneven_grid_tiles_differ_by_at_most_one_row():
    for extent, tiles in [(48, 5), (7, 3), (10, 4)]:
        sizes = [w.size for w in tile_windows(extent, tiles, uniform=False)]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == extent
        uniform = tile_windows(extent, tiles, uniform=True)
        assert len({w.size for w in uniform}) == 1
        assert uniform[0].start == 0 and uniform[-1].stop == extent
        assert all(a.stop >= b.start for a, b in zip(uniform, uniform[1:]))


# ---------------------------------------------------------------- random chains


@st.composite
def _chains(draw):
    size = draw(st.integers(12, 22))
    layers, channels = [], 3
    for i in range(draw(st.integers(1, 5))):
        kind = "conv" if i == 0 else draw(st.sampled_from(
            ["conv", "fused", "relu", "pad", "maxpool", "avgpool", "residual", "concat", "bias", "convert"]))
        if kind in ("conv", "fused"):
            k, stride, dil = draw(st.sampled_from([1, 3])), draw(st.integers(1, 2)), draw(st.integers(1, 2))
            groups = draw(st.sampled_from([1, channels]))
            cout = channels if groups > 1 else draw(st.integers(2, 4))
            layers.append((kind, dict(k=k, stride=stride, dilation=dil, pad=draw(st.integers(0, 2)), groups=groups,
                                      cin=channels, cout=cout)))
            channels = cout
        elif kind == "pad":
            layers.append((kind, dict(pads=[(draw(st.integers(-1, 2)), draw(st.integers(-1, 2))) for _ in range(2)])))
        elif kind in ("residual", "concat", "bias"):
            layers.append((kind, dict(c=channels)))
            channels *= 2 if kind == "concat" else 1
        else:
            layers.append((kind, {}))
    return size, layers, draw(st.integers(1, 4)), draw(st.integers(1, 4))


def _chain_fn(layers, linear=False):
    """The chain as `fn(params, x)`; `linear` swaps ReLU and max pooling for linear
    ops with the same windows (for a brute-force receptive field)."""
    def fn(params, x):
        for (kind, cfg), p in zip(layers, params):
            if kind == "conv":
                x = _conv(x, p[0], cfg["stride"], cfg["pad"], cfg["dilation"], cfg["groups"])
            elif kind == "fused":
                x = conv_bias_act(x, p[0], p[1], activation=() if linear else ("clip", 0.0, 6.0),
                                  window_strides=(cfg["stride"],) * 2, padding=((cfg["pad"],) * 2,) * 2,
                                  lhs_dilation=(1, 1), rhs_dilation=(cfg["dilation"],) * 2,
                                  dimension_numbers=lax.conv_dimension_numbers(x.shape, p[0].shape, _NCHW),
                                  feature_group_count=cfg["groups"], batch_group_count=1, precision=None,
                                  preferred_element_type=None)
            elif kind == "relu":
                x = x if linear else jax.nn.relu(x)
            elif kind == "pad":
                x = lax.pad(x, jnp.float32(0.5), ((0, 0, 0), (0, 0, 0), *[(lo, hi, 0) for lo, hi in cfg["pads"]]))
            elif kind == "maxpool":
                init, op = (0.0, lax.add) if linear else (-jnp.inf, lax.max)
                x = lax.reduce_window(x, init, op, (1, 1, 3, 3), (1, 1, 1, 1), ((0, 0), (0, 0), (1, 1), (1, 1)))
            elif kind == "avgpool":
                x = lax.reduce_window(x, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4.0
            elif kind == "residual":
                x = x + _conv(x, p[0], pad=1)
            elif kind == "concat":
                x = jnp.concatenate([x, _conv(x, p[0])], axis=1)
            elif kind == "bias":
                x = x * p[0].reshape(1, -1, 1, 1) + p[1].reshape(1, -1, 1, 1)
            elif kind == "convert":
                x = x.astype(jnp.bfloat16).astype(jnp.float32)
        return x

    return fn


def _chain_params(layers, key):
    params = []
    for i, (kind, cfg) in enumerate(layers):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        if kind in ("conv", "fused"):
            w = jax.random.normal(k1, (cfg["cout"], cfg["cin"] // cfg["groups"], cfg["k"], cfg["k"]))
            params.append((w, jax.random.normal(k2, (1, cfg["cout"], 1, 1))))
        elif kind in ("residual", "concat"):
            k = 3 if kind == "residual" else 1
            params.append((jax.random.normal(k1, (cfg["c"], cfg["c"], k, k)) / 3,))
        elif kind == "bias":
            params.append((jax.random.normal(k1, (cfg["c"],)), jax.random.normal(k2, (cfg["c"],))))
        else:
            params.append(())
    return params


@settings(max_examples=4, deadline=None)
@given(chain=_chains())
def test_random_chains_tile_exactly_and_read_their_brute_force_receptive_field(chain):
    size, layers, rows, cols = chain
    fn = _chain_fn(layers)
    params = _chain_params(layers, jax.random.key(size))
    x = jax.random.normal(jax.random.key(1), (1, 3, size, size))
    try:
        expected = jax.jit(fn)(params, x)
    except (TypeError, ValueError):  # the chain shrank the image to nothing
        assume(False)
    assume(expected.size > 0 and min(expected.shape[2:]) >= max(rows, cols))
    for mode in ("loop", "unroll"):
        _assert_tiled_close(jax.jit(jtile.tile_spatial(fn, grid=(rows, cols), mode=mode))(params, x), expected)
    # Each unrolled tile reads the rows and cols of x its output depends on.
    closed = make_jaxpr(fn, params, x)
    graph = Graph.of(closed)
    plan = make_plan(select_block(graph, 2), (rows, cols), uniform=False)
    (out,) = plan.block.outputs
    x_value = graph.inputs[-1]
    linear = _chain_fn(layers, linear=True)
    for k, tile in enumerate(plan.out_tiles[out]):
        reads = [r.windows[k] for (op, j), r in plan.reads.items() if graph.ops[op].ins[j] is x_value]
        r, c = _support(lambda x: linear(params, x), x, [(w.start, w.stop) for w in tile])
        for axis, support in enumerate((r, c)):
            lo, hi = min(w[axis].start for w in reads), max(w[axis].stop for w in reads)
            assert support.size == 0 or lo <= support.min() and support.max() < hi


# ---------------------------------------------------------------- the block


def test_a_net_without_a_stop_is_tiled_whole(getkey):
    model = jtile.models.get("tutorial", getkey())
    x = jax.random.normal(getkey(), jtile.models.input_shape("tutorial"))
    closed = make_jaxpr(lambda m, x: m(x), model, x)
    block = select_block(Graph.of(closed), 2)
    assert not block.tail and [v.is_output for v in block.outputs] == [True]
    _assert_tiled_close(eqx.filter_jit(jtile.tile_spatial(lambda m, x: m(x), grid=(2, 2)))(model, x), model(x))


@pytest.mark.parametrize("name, last", [
    pytest.param("resnet18", "layer4", marks=pytest.mark.slow), ("mobilenet_v2", "features.18")])
def test_zoo_models_tile_exactly_up_to_their_flatten(getkey, name, last):
    model = jtile.models.get(name, getkey())
    x = jax.random.normal(getkey(), (1, 3, 64, 64))
    block = select_block(Graph.of(make_jaxpr(lambda m, x: m(x), model, x)), 2)
    stopper = next(op for op in block.tail if any(v in block.outputs for v in op.ins))
    assert stopper.primitive == "reshape" and block.ops[-1].scope == "avgpool"
    with pytest.raises(ConfigError, match=r"layer 'avgpool'.*largest grid for this block is \(1, 1\)"):
        jtile.tile_spatial(lambda m, x: m(x), grid=(2, 2))(model, x)
    expected = eqx.filter_jit(lambda m, x: m(x))(model, x)
    for grid, mode in [((2, 2), "unroll"), ((2, 1), "loop")]:  # the last stage is 2x2
        tiled = jtile.tile_spatial(lambda m, x: m(x), grid=grid, until=last, mode=mode)
        # XLA's CPU backend sums a conv inside a loop body in another order than at
        # top level: a few ulp per conv, up to 1e-5 of the scale after 50 convs.
        _assert_tiled_close(eqx.filter_jit(tiled)(model, x), expected, atol=1e-6 if mode == "unroll" else 1e-5)


def test_until_a_layer_name_ends_the_block_after_that_layer(getkey):
    model = jtile.models.get("mobilenet_v2", getkey())
    x = jax.random.normal(getkey(), (1, 3, 64, 64))
    closed = make_jaxpr(lambda m, x: m(x), model, x)
    block = select_block(Graph.of(closed), 2, until="features.3")
    assert block.ops[-1].scope == "features.3"  # the residual add
    assert all(op.scope.startswith(("features.0", "features.1", "features.2", "features.3")) for op in block.ops)
    assert block.tail[0].scope.startswith("features.4")
    first_stages = lambda features, x: sequential(features[:6], x)  # noqa: E731
    tiled = jtile.tile_spatial(first_stages, grid=(4, 4), until="features.3")
    _assert_tiled_close(eqx.filter_jit(tiled)(model.features, x), eqx.filter_jit(first_stages)(model.features, x))


def test_until_a_predicate_ends_the_block_after_the_first_layer_it_accepts(getkey):
    params, x = _seed_params(getkey)
    closed = make_jaxpr(_seed_net, params, x)
    block = select_block(Graph.of(closed), 2, until=lambda layer: layer.kernel_size == (1, 1))
    assert [op.primitive for op in block.ops if op.primitive.startswith("conv")] == ["conv_general_dilated"] * 2
    tiled = jtile.tile_spatial(_seed_net, grid=(3, 3), until=lambda layer: layer.kernel_size == (1, 1))
    _assert_tiled_close(tiled(params, x), _seed_net(params, x))


def test_until_an_unknown_layer_lists_the_nearest_names(getkey):
    model = jtile.models.get("mobilenet_v2", getkey())
    x = jax.random.normal(getkey(), (1, 3, 32, 32))
    with pytest.raises(ConfigError, match=r"features\.3") as info:
        jtile.tile_spatial(lambda m, x: m(x), grid=(2, 2), until="feature.3")(model, x)
    assert "nearest names" in str(info.value)
    assert difflib.get_close_matches("feature.3", ["features.3"])  # the hint is difflib's


def test_grid_larger_than_the_block_output_names_the_layer_and_the_largest_grid(getkey):
    params, x = _seed_params(getkey)
    with pytest.raises(ConfigError, match=r"grid \(49, 2\).*the largest grid for this block is \(48, 48\)"):
        jtile.tile_spatial(_seed_net, grid=(49, 2))(params, x)


def test_an_op_without_a_region_rule_ends_the_block_with_a_warning(getkey):
    params, x = _seed_params(getkey)

    def net(params, x):
        y = _seed_net(params, x)
        with jax.named_scope("odd"):
            y = lax.cumsum(y, axis=1)
        return jax.nn.relu(_conv(y, params[2], pad=1))

    with pytest.warns(SpatialWarning, match=r"cumsum in layer 'odd' has no region rule"):
        out = jtile.tile_spatial(net, grid=(2, 2))(params, x)
    _assert_tiled_close(out, net(params, x))


@pytest.mark.parametrize("kwargs, match", [
    (dict(grid=(0, 2)), "positive int"),
    (dict(grid=4), "tuple"),
    (dict(grid=(2, 2), mode="tiles"), "mode"),
    (dict(grid=(2, 2), until=3), "until"),
    (dict(), "grid= is required"),
    (dict(grid=(2, 2), tiles=3), "unknown keyword"),
])
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        jtile.tile_spatial(_seed_net, **kwargs)


def test_a_function_without_a_convolution_is_refused():
    with pytest.raises(ConfigError, match="no convolution"):
        jtile.tile_spatial(lambda x: x * 2, grid=(2, 2))(jnp.ones((1, 3, 8, 8)))


# ---------------------------------------------------------------- composition


def test_composes_with_fuse_and_swap_backend_so_tiles_run_on_the_kernels(getkey):
    model = jtile.models.get("tutorial", getkey())
    x = jax.random.normal(getkey(), jtile.models.input_shape("tutorial"))
    fn = lambda m, x: m(x)  # noqa: E731
    tiled = jtile.swap_backend(jtile.tile_spatial(jtile.fuse(fn), grid=(2, 2)), algorithms={"conv2d": "smm"})
    closed = make_jaxpr(tiled, model, x)
    loops = [e for e in closed.jaxpr.eqns if e.primitive.name in ("scan", "while")]
    assert loops and any(e.primitive.name == "ffi_call" for loop in loops for e in iter_eqns(
        loop.params["jaxpr"].jaxpr if "jaxpr" in loop.params else loop.params["body_jaxpr"].jaxpr))
    _assert_tiled_close(eqx.filter_jit(tiled)(model, x), eqx.filter_jit(fn)(model, x))


def _onnx_check(model, x, until, grid):
    expected = jax.jit(model.fn)(model.params, x)
    for mode, atol in (("unroll", 1e-6), ("loop", 1e-5)):  # loop: a few ulp per layer (see the zoo test)
        tiled = jtile.tile_spatial(model.fn, grid=grid, until=until, mode=mode)
        _assert_tiled_close(jax.jit(tiled)(model.params, x), expected, atol=atol)


@pytest.mark.slow
def test_onnx_light_resnet50_first_stage_tiles_exactly():
    import onnx

    path = os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light/light_resnet50.onnx")
    model = jtile.onnx.load(path)
    x = jax.random.normal(jax.random.key(0), (1, 3, 224, 224))
    graph = Graph.of(make_jaxpr(model.fn, model.params, x))
    block = select_block(graph, 2, until="n35")  # conv1 .. the first bottleneck stage (56x56)
    assert block.ops[0].scope == "n0" and block.ops[-1].scope == "n35"
    _onnx_check(model, x, "n35", (4, 4))


@pytest.mark.slow
def test_torchvision_mobilenet_v3_exported_to_onnx_tiles_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    net = torchvision.models.mobilenet_v3_small().eval()
    path = tmp_path / "mobilenet_v3.onnx"
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated, and needs no onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(net, torch.randn(1, 3, 96, 96), str(path), dynamo=False)
    model = jtile.onnx.load(str(path))
    x = jax.random.normal(jax.random.key(0), (1, 3, 96, 96))
    graph = Graph.of(make_jaxpr(model.fn, model.params, x))
    block = select_block(graph, 2)  # the stem and the first depthwise conv, up to its squeeze-excitation pool
    stopper = next(op for op in block.tail if any(v in block.outputs for v in op.ins))
    assert stopper.primitive == "reduce_sum" and stopper.scope.endswith("avgpool/GlobalAveragePool")
    assert sum(op.primitive == "conv_general_dilated" for op in block.ops) == 2
    _onnx_check(model, x, None, (3, 3))


# ---------------------------------------------------------------- tiles on devices


_MESH_SCRIPT = textwrap.dedent("""
    import re, jax, jax.numpy as jnp, numpy as np
    from jax import lax
    import jtile
    assert jax.device_count() == 4, jax.devices()

    def net(w, x):
        for k in range(3):
            x = jax.nn.relu(lax.conv_general_dilated(x, w[k], (1, 1), [(1, 1), (1, 1)],
                                                     dimension_numbers=("NCHW", "OIHW", "NCHW")))
        return x

    w = jax.random.normal(jax.random.key(0), (3, 4, 4, 3, 3)) / 4
    x = jax.random.normal(jax.random.key(1), (1, 4, 64, 64))
    mesh = jax.make_mesh((4,), ("tiles",), axis_types=(jax.sharding.AxisType.Auto,))
    tiled = jax.jit(jtile.tile_spatial(net, grid=(4, 2), mesh=mesh))
    out, expected = tiled(w, x), jax.jit(net)(w, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
    hlo = tiled.lower(w, x).compile().as_text()
    names = re.findall(r"= \\S+ (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
                       r"(?:-start)?\\(", hlo)
    print("COLLECTIVES", sorted(names))
""")


def test_tiles_on_a_mesh_compute_without_communication_and_gather_once():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("COLLECTIVES"))
    assert line == "COLLECTIVES ['all-gather']"


def test_demo_spatial_shows_the_memory_cut_on_mobilenet_v2(capsys):
    from jtile.cli import main

    assert main(["demo", "--spatial", "2x2", "--size", "64"]) == 0
    out = capsys.readouterr().out
    assert "mobilenet_v2 on input (1, 3, 64, 64), tile_spatial(grid=2x2)" in out
    assert "features.0 to features.4" in out and "x lower)" in out and "OK: tiled outputs match" in out
    assert main(["demo", "--spatial", "four"]) == 2
