"""`jtile._views`: a value read as a strided view of the buffer its layout ops
read, checked against the value itself (numpy's `as_strided` of that buffer),
and as whole channel planes of a value (`plane_gather`), checked against both
values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from jtile._graph import Graph
from jtile._interpreter import bind, eval_jaxpr
from jtile._views import Strided, plane_gather, strided_source


def _values(closed, x) -> dict:
    """Every variable of the jaxpr, evaluated by the interpreter with an
    observing default rule."""
    env = {closed.jaxpr.invars[0]: np.asarray(x), **dict(zip(closed.jaxpr.constvars, closed.consts))}

    def observe(eqn, *invals):
        out = bind(eqn, *invals)
        env.update((var, np.asarray(value)) for var, value in zip(eqn.outvars, out))
        return out if eqn.primitive.multiple_results else out[0]

    eval_jaxpr(closed.jaxpr, closed.consts, x, rules={}, default=observe)
    return env


def _read(buffer: np.ndarray, view: Strided) -> np.ndarray:
    flat = np.ascontiguousarray(buffer).ravel()
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[view.offset:], view.shape, [s * item for s in view.strides])


def _check(fn, x):
    """The source of fn's output, checked; returns it."""
    closed = jax.make_jaxpr(fn)(x)
    source = strided_source(Graph.of(closed).producers(), closed.jaxpr.outvars[0])
    env = _values(closed, x)
    if source is not None:
        scale = math.prod(float(np.ravel(s.val if hasattr(s, "val") else env[s])[0]) for s in source.scales)
        assert source.view.span() <= env[source.base].size
        np.testing.assert_allclose(_read(env[source.base], source.view) * scale, env[closed.jaxpr.outvars[0]],
                                   rtol=1e-6)
    return closed, source


def test_attention_head_split_reads_the_projection_in_place():
    """ViT's exported head split: reshapes, a transpose, a static index, the
    per-head transpose and a scale by one number, down to the (197, 1, 2304)
    QKV output."""
    def k_heads(qkv):
        t = qkv.reshape(197, 1, 3, 768).reshape(1, 197, 1, 3, 768).transpose(3, 1, 2, 0, 4).reshape(3, 197, 1, 768)
        k = lax.index_in_dim(t, 1, 0, keepdims=False).reshape(197, 12, 64).transpose(1, 0, 2)
        return (k.reshape(1, 12, 197, 64).transpose(0, 1, 3, 2) * jnp.float32(0.35))[0]

    closed, source = _check(k_heads, np.random.default_rng(0).standard_normal((197, 1, 2304), np.float32))
    assert source.base is closed.jaxpr.invars[0]
    assert source.view == Strided(768, (12, 64, 197), (64, 1, 2304))
    assert len(source.scales) == 1


def test_a_reshape_that_needs_a_copy_starts_the_view_at_its_output():
    def merged(x):
        return x.transpose(1, 0).reshape(-1)[2:40:3]  # rows of the transpose are not a run in memory

    closed, source = _check(merged, np.arange(48, dtype=np.float32).reshape(6, 8))
    assert source.base is not closed.jaxpr.invars[0]
    assert source.view == Strided(2, (13,), (3,))


def test_a_value_its_producer_computes_has_no_source():
    closed, source = _check(lambda x: jnp.exp(x).reshape(-1), np.ones((2, 3), np.float32))
    assert source is not None and source.base is not closed.jaxpr.invars[0]  # exp's output, reshaped
    closed, source = _check(lambda x: jnp.exp(x), np.ones((2, 3), np.float32))
    assert source is None
    closed, source = _check(lambda x: x * x, np.ones((2, 3), np.float32))  # not a scale by one number
    assert source is None
    closed, source = _check(lambda x: x * x[0, 0], np.full((2, 3), 3.0, np.float32))  # one number: a scale
    assert source.base is closed.jaxpr.invars[0] and len(source.scales) == 1


@st.composite
def _chains(draw):
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    ops = []
    current = list(shape)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["transpose", "split_axis", "merge", "slice", "unit", "scale", "split"]))
        rank = len(current)
        if kind == "transpose":
            perm = draw(st.permutations(range(rank)))
            ops.append(("transpose", tuple(perm)))
            current = [current[p] for p in perm]
        elif kind == "split_axis":
            ax = draw(st.integers(0, rank - 1))
            n = current[ax]
            f = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
            current = current[:ax] + [f, n // f] + current[ax + 1:]
            ops.append(("reshape", tuple(current)))
        elif kind == "merge" and rank > 1:
            ax = draw(st.integers(0, rank - 2))
            current = current[:ax] + [current[ax] * current[ax + 1]] + current[ax + 2:]
            ops.append(("reshape", tuple(current)))
        elif kind == "slice":
            ax = draw(st.integers(0, rank - 1))
            lo = draw(st.integers(0, current[ax] - 1))
            hi = draw(st.integers(lo + 1, current[ax]))
            step = draw(st.integers(1, 3))
            ops.append(("slice", ax, lo, hi, step))
            current[ax] = -(-(hi - lo) // step)
        elif kind == "unit":
            ax = draw(st.integers(0, rank))
            ops.append(("expand", ax))
            current.insert(ax, 1)
        elif kind == "scale":
            ops.append(("scale", draw(st.floats(0.5, 2.0))))
        elif kind == "split" and current[0] > 1:
            at = draw(st.integers(1, current[0] - 1))
            part = draw(st.integers(0, 1))
            ops.append(("split", at, part))
            current[0] = at if part == 0 else current[0] - at
    return tuple(shape), ops


def _apply(ops, x):
    for op in ops:
        if op[0] == "transpose":
            x = jnp.transpose(x, op[1])
        elif op[0] == "reshape":
            x = x.reshape(op[1])
        elif op[0] == "slice":
            _, ax, lo, hi, step = op
            x = lax.slice_in_dim(x, lo, hi, step, axis=ax)
        elif op[0] == "expand":
            x = jnp.expand_dims(x, op[1])
        elif op[0] == "scale":
            x = x * jnp.float32(op[1])
        else:
            x = jnp.split(x, [op[1]], axis=0)[op[2]]
    return x


@settings(max_examples=150, deadline=None)
@given(_chains())
def test_random_layout_chains_read_the_right_elements(chain):
    shape, ops = chain
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    _check(lambda x: _apply(ops, x), x)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(1, 6), st.data())
def test_plane_gather_reads_shuffles_and_splits_as_planes(groups, per_group, data):
    """A channel shuffle of `groups`, a slice of its channels, and a split
    after it: each value is `base[:, planes]` of the value its steps read."""
    channels = groups * per_group
    start = data.draw(st.integers(0, channels - 1))
    stop = data.draw(st.integers(start + 1, channels))

    def fn(x):
        n, c, h, w = x.shape
        shuffled = (x * 2).reshape(n, groups, c // groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)
        return shuffled, shuffled[:, start:stop], jnp.split(shuffled, [start], axis=1)[1]

    x = np.random.default_rng(0).standard_normal((2, channels, 3, 4)).astype(np.float32)
    closed = jax.make_jaxpr(fn)(x)
    env, producers = _values(closed, x), Graph.of(closed).producers()
    for var in closed.jaxpr.outvars:
        gather = plane_gather(producers, var)
        if gather is None:  # every plane in place: a shuffle of one channel per group, or the whole
            assert env[var].shape[1] == channels and np.array_equal(env[var], x * 2)
            continue
        assert producers[gather.base].primitive.name == "mul"  # the scaling copies: the gather starts after it
        np.testing.assert_array_equal(env[var], env[gather.base][:, np.array(gather.planes)])


@pytest.mark.parametrize("fn", [
    lambda x: jnp.transpose(x, (0, 1, 3, 2)),  # the planes themselves move
    lambda x: x[:, :, 1:],  # part of each plane
    lambda x: x.reshape(2, 4, 3, 2, 2)[:, :, 0],  # a plane split
    lambda x: x.reshape(2, 3, 8, 2)[:, :1],  # planes of another shape
    lambda x: x.reshape(2, 2, 3, 4, 2).reshape(2, 6, 4, 2),  # every plane in its place
    lambda x: (x * 2)[:, 2:],  # a scaled value is computed, not read
    lambda x: x[:0, 2:],  # no image: nothing to copy
])
def test_plane_gather_is_none_for_other_reads(fn):
    x = np.zeros((2, 6, 4, 2), np.float32)
    closed = jax.make_jaxpr(fn)(x)
    gather = plane_gather(Graph.of(closed).producers(), closed.jaxpr.outvars[0])
    assert gather is None or gather.base is not closed.jaxpr.invars[0]
