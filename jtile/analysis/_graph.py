"""A read-only walk of a function's jaxpr into ops, values and parameter roles.

`trace_graph(fn, args, kwargs)` traces `fn` with filter semantics and flattens
its jaxpr into `Op`s in program order, inlining exactly the calls the
interpreter inlines (`jit`, custom derivatives, ...) so that op number `k`
here is the `k`-th equation `eval_jaxpr` hands to a rule. Control flow
(`cond`, `scan`, `while`) stays one op. Each op carries its full
`jax.named_scope` path and MACs; each value knows its producer, consumers and
which parameter leaves it is computed from.

Which leaves are parameters and buffers is `_roles`' business; a parameter
is trainable unless it is a buffer or no gradient from an activation reaches it.
"""

import dataclasses
import math
from collections import Counter

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util

from .._interpreter import Traced
from ._macs import eqn_macs
from ._roles import Leaf, as_call, closure_names, const_leaf, input_leaves


@dataclasses.dataclass(eq=False)
class Value:
    """One array in the flattened program."""

    aval: jax.core.ShapedArray
    producer: "Op | None" = None
    consumers: list = dataclasses.field(default_factory=list)
    data: bool = False  # computed from a non-parameter input
    params: int = 0  # bitmask of the parameter leaves it is computed from (if not data)
    grads: int = 0  # bitmask of the parameter leaves a gradient would reach

    @property
    def nbytes(self) -> int:
        return math.prod(self.aval.shape) * np.dtype(self.aval.dtype).itemsize


@dataclasses.dataclass(eq=False)
class Op:
    """One equation after inlining, with its full scope path."""

    index: int
    eqn: jcore.JaxprEqn
    scope: str
    ins: list[Value]
    outs: list[Value]
    macs: Counter
    uncounted: set[str]
    owned: int = 0  # bitmask of the parameter leaves attributed to this op

    @property
    def primitive(self) -> str:
        return self.eqn.primitive.name


@dataclasses.dataclass
class Graph:
    """The flattened program of one traced call."""

    closed: jcore.ClosedJaxpr
    out_tree: object
    leaves: list[Leaf]  # the jaxpr's invars, then its constvars
    ops: list[Op]
    outputs: list[Value]
    trainable: int  # bitmask over `leaves` of the trainable parameters


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def _placeholder(x):
    """A zero-byte array standing in for a `jax.ShapeDtypeStruct` while tracing."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)
    return x


def _trace(where: str, fn, args: tuple, kwargs: dict) -> tuple[Traced, list[Leaf]]:
    """Trace `fn(*args, **kwargs)` with `fn`'s own array leaves as inputs.

    `jax.ShapeDtypeStruct` leaves are accepted, so a model can be analysed
    from `jax.eval_shape` without allocating its weights.
    """
    fn, args, buffer_keys = as_call(fn, args)
    fn, args, kwargs = jax.tree.map(_placeholder, (fn, args, kwargs))
    traced = Traced(where, _call, (fn, args, kwargs), {})
    return traced, input_leaves(fn, args, kwargs, buffer_keys)


class _Walk:
    def __init__(self, leaves: list[Leaf], names: dict):
        self.ops: list[Op] = []
        self.leaves, self.names = leaves, names

    def leaf_value(self, i: int) -> Value:
        leaf = self.leaves[i]
        aval = jax.core.ShapedArray(leaf.shape, leaf.dtype)
        if leaf.is_param:
            return Value(aval, params=1 << i, grads=1 << i)
        return Value(aval, data=True)

    def op(self, eqn, scope: str, ins: list) -> list[Value]:
        real = [v for v in ins if v is not None]
        data = any(v.data for v in real)
        params = 0 if data else _or(v.params for v in real)
        blocks = eqn.primitive.name == "stop_gradient"
        macs, uncounted = eqn_macs(eqn)
        op = Op(len(self.ops), eqn, scope, real, [], macs, uncounted)
        for v in eqn.outvars:
            floating = jnp.issubdtype(v.aval.dtype, jnp.inexact)
            grads = _or(x.grads for x in real) if floating and not blocks else 0
            op.outs.append(Value(v.aval, op, data=data, params=params, grads=grads))
        for v in real:
            v.consumers.append(op)
        self.ops.append(op)
        return op.outs

    def run(self, jaxpr: jcore.Jaxpr, consts: list, args: list, stack) -> list:
        env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

        def read(v):
            return None if isinstance(v, jcore.Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            full = stack + eqn.source_info.name_stack
            outs = self.op(eqn, str(full), ins)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x if x is not None else Value(v.aval)
        return [read(v) for v in jaxpr.outvars]


def _or(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def _attribute(ops: list[Op]) -> None:
    """Give each parameter leaf to the first op that uses it as a layer would.

    Weight preprocessing outside any scope (a transpose of a kernel, say) is
    looked through; its parameters go to the op that consumes the result.
    """
    taken = 0
    for strict in (True, False):
        for op in ops:
            if strict and not op.scope and not any(v.data for v in op.ins):
                continue
            mask = _or(v.params for v in op.ins if not v.data) & ~taken
            op.owned |= mask
            taken |= mask


def trace_graph(where: str, fn, args: tuple, kwargs: dict) -> Graph:
    """Trace `fn(*args, **kwargs)` and flatten it into a `Graph`."""
    traced, leaves = _trace(where, fn, args, kwargs)
    closed = traced.jaxpr
    names = closure_names(fn)
    leaves = leaves + [const_leaf(len(leaves) + i, c, names) for i, c in enumerate(closed.consts)]
    walk = _Walk(leaves, names)
    values = [walk.leaf_value(i) for i in range(len(leaves))]
    n = len(closed.jaxpr.invars)
    outputs = walk.run(closed.jaxpr, values[n:], values[:n], source_info_util.new_name_stack())
    outputs = [v for v in outputs if v is not None]
    _attribute(walk.ops)
    reached = _or(v.grads for op in walk.ops for v in op.outs if v.data)
    unused = _or(1 << i for i, v in enumerate(values) if not v.consumers)
    floating = _or(1 << i for i, leaf in enumerate(walk.leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact))
    params = _or(1 << i for i, leaf in enumerate(walk.leaves) if leaf.is_param)
    buffers = _or(1 << i for i, leaf in enumerate(walk.leaves) if leaf.is_buffer)
    trainable = (reached | unused) & floating & params & ~buffers
    return Graph(closed, traced.out_tree, walk.leaves, walk.ops, outputs, trainable)

