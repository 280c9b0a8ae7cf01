import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtile
from jtile._interpreter import make_jaxpr


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)),
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"))


def test_values_know_their_producer_and_consumers(getkey):
    def f(x, w):
        y = _conv(x, w)
        return jax.nn.relu(y) + y

    x = jax.random.normal(getkey(), (1, 3, 8, 8))
    w = jax.random.normal(getkey(), (4, 3, 3, 3))
    g = jtile.graph(f, x, w)
    conv = next(op for op in g.ops if op.primitive == "conv_general_dilated")
    (y,) = conv.outs
    assert y.producer is conv
    assert {op.primitive for op in y.consumers} == {"max", "add"}
    for op in g.ops:
        for v in op.ins:
            assert op in v.consumers
        for v in op.outs:
            assert v.producer is op
    assert g.outputs[0].is_output and g.outputs[0].shape == (1, 4, 8, 8)
    assert g.outputs[0].nbytes == 4 * 4 * 8 * 8


def test_conv_weight_is_a_param_whatever_the_argument_order(getkey):
    x = jax.random.normal(getkey(), (2, 8, 10, 20))
    w = jax.random.normal(getkey(), (16, 8, 3, 3))
    for f, args in ((lambda x, w: _conv(x, w), (x, w)), (lambda w, x: _conv(x, w), (w, x))):
        g = jtile.graph(f, *args)
        roles = {v.shape: v.role for v in g.inputs}
        assert roles == {x.shape: "input", w.shape: "param"}
        assert jtile.summary(f, *args).total_params == w.size


def test_lowering_constants_are_not_params(getkey):
    table = np.full((1, 1, 4, 4), 9.0, np.float32)  # an avg-pool divisor table

    def f(params, x):
        y = _conv(x, params["w"]) + params["b"]
        s = lax.reduce_window(y, 0.0, lax.add, (1, 1, 3, 3), (1, 1, 1, 1), "VALID")
        return s / table

    params = {"w": jnp.ones((2, 3, 3, 3)), "b": jnp.ones((1, 2, 1, 1))}
    x = jnp.ones((1, 3, 6, 6))
    g = jtile.graph(f, params, x)
    assert [v.role for v in g.consts] == ["const"]
    assert jtile.summary(f, params, x).total_params == 54 + 2


def test_layers_group_ops_by_scope():
    model = jtile.models.get("resnet18", jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, 3, 64, 64), jnp.float32)
    g = jtile.graph(model, x)
    layers = g.layers()
    names = [layer.name for layer in layers]
    assert len(names) == len(set(names))
    assert sum(len(layer.ops) for layer in layers) == len(g.ops)
    convs = [layer for layer in layers if layer.category == "conv"]
    assert len(convs) == 20
    assert convs[0].layer(0).kernel_size == (7, 7)
    assert sum(sum(op.macs.values()) for op in g.ops) == sum(sum(l.macs.values()) for l in layers)
    assert [op.kind for op in g.ops].count("conv2d") == 20


def test_graph_of_a_jaxpr_is_built_once():
    closed = jtile._interpreter.make_jaxpr(lambda x: jnp.sin(x) * 2, jnp.ones(3))
    assert jtile.Graph.of(closed) is jtile.Graph.of(closed)
    assert [op.primitive for op in jtile.Graph.of(closed).ops] == ["sin", "mul"]


def test_control_flow_is_one_op_with_subgraphs():
    def f(x):
        return lax.scan(lambda c, y: (c + jnp.sin(y), c), 0.0, x)[0]

    g = jtile.graph(f, jnp.ones(5))
    (scan,) = [op for op in g.ops if op.primitive == "scan"]
    body = [op.primitive for op in scan.subgraphs[0].ops]
    assert "sin" in body and "add" in body and "scan" not in [op.primitive for op in g.ops[1:]]


def test_a_swapped_layer_is_still_a_conv2d(getkey):
    params = {"w": jax.random.normal(getkey(), (8, 3, 3, 3))}
    x = jax.random.normal(getkey(), (1, 3, 16, 16))

    def f(p, x):
        with jax.named_scope("conv1"):
            return jax.nn.relu(_conv(x, p["w"]))

    swapped = jtile.swap_backend(f, algorithms={"conv2d": "smm"})
    (op,) = [op for op in jtile.graph(swapped, params, x).ops if op.primitive == "ffi_call"]
    layer = op.layer()
    assert (layer.kind, layer.kernel_size, layer.stride, layer.padding) == ("conv2d", (3, 3), (1, 1), ((1, 1), (1, 1)))
    assert op.macs["conv"] == 16 * 16 * 8 * 3 * 9
    _, acts = jtile.intercept(swapped, params, x, select=lambda layer: layer.kind == "conv2d")
    assert list(acts) == ["conv1"]


def _brute_force_peak(f, *args) -> int:
    """The most bytes of activations alive at once, straight from a flat jaxpr: at
    each equation, every result made so far that some later (or this) equation still
    reads, or the function returns. An activation is a result reached from `args[-1]`."""
    jaxpr = make_jaxpr(f, *args).jaxpr  # jit and custom_jvp calls inlined
    assert not any(list(jax.extend.core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)  # straight-line only
    data, made = {jaxpr.invars[-1]}, []
    for i, e in enumerate(jaxpr.eqns):
        if any(v in data for v in e.invars if not isinstance(v, jax.extend.core.Literal)):
            data.update(e.outvars)
            made += [(i, v) for v in e.outvars]
    outs = set(v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal))
    peak = 0
    for i in range(len(jaxpr.eqns)):
        alive = 0
        for j, v in made:
            readers = [k for k, e in enumerate(jaxpr.eqns) if v in e.invars]
            if j <= i and (v in outs or max(readers, default=j) >= i):
                alive += v.aval.size * v.aval.dtype.itemsize
        peak = max(peak, alive)
    return peak


def _step(c):
    t = jnp.sin(jnp.outer(c, c[:48]))  # two (64, 48) temporaries
    return jnp.tanh(t).sum(1) + c * 2.0  # c read last: a control-flow operand lives through it


def test_peak_bytes_of_straight_line_code_matches_a_brute_force_count(getkey):
    def f(w, x):
        y = jax.nn.relu(_conv(x, w))
        return (y * 2 + jnp.exp(y)).sum(axis=1) + x.mean()

    x, w = jax.random.normal(getkey(), (1, 3, 8, 8)), jax.random.normal(getkey(), (4, 3, 3, 3))
    assert jtile.graph(f, w, x).peak_bytes() == _brute_force_peak(f, w, x) > 0


def test_peak_bytes_counts_a_loop_body_once_and_the_largest_branch(getkey):
    c = jax.random.normal(getkey(), (64,))

    def looped(c):
        c = lax.scan(lambda c, _: (_step(c), None), c, None, length=5)[0]
        return lax.cond(c.sum() > 0, _step, lambda c: c + 1.0, c)

    def straight(c):  # the same program unrolled, the larger branch taken
        for _ in range(5):
            c = _step(c)
        _ = c.sum() > 0
        return _step(c)

    index = 4  # the cond's int32 branch index is alive while the branch runs
    assert jtile.graph(looped, c).peak_bytes() == _brute_force_peak(straight, c) + index
