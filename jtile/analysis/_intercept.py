"""`intercept`: the intermediate activations of a call, keyed by layer name.

The forward-hook of jtile. The function's jaxpr is evaluated once by the one
interpreter, `eval_jaxpr`, with a rule for every primitive it meets that
binds the equation unchanged and keeps the outputs a layer hands on. The
layers are those of `summary` (same names, same `depth`).

!!! warning

    `cond`, `scan` and `while` are recorded as one op each: what happens
    inside a loop body is not captured. A layer handing on several arrays
    gives one entry per array, `name[0]`, `name[1]`, ...
"""

from collections.abc import Callable, Collection

import jax

from .._errors import ConfigError, JtileError, require_positive_int
from .._interpreter import bind, eval_jaxpr, is_array
from .._layers import Layer
from .._graph import Op, trace_graph
from .._roles import as_call

Select = Callable[[Layer], bool] | Collection[str] | None


def _wanted(rows, select: Select) -> dict[tuple[int, int], str]:
    """(op index, output position) -> capture key, for the selected layers."""
    names = [row.name for row in rows]
    if isinstance(select, str):
        select = {select}
    if select is not None and not callable(select):
        unknown = set(select) - set(names)
        if unknown:
            shown = ", ".join(names[:30]) + (", ..." if len(names) > 30 else "")
            raise ConfigError(
                f"jtile.intercept: no layer named {', '.join(sorted(unknown))}; "
                f"layers are {shown} (see jtile.summary)"
            )
    wanted = {}
    for index, row in enumerate(rows):
        chosen = select is None or (
            select(row.layer(index)) if callable(select) else row.name in select
        )
        if not chosen:
            continue
        outputs = row.outputs or row.ops[-1].outs
        for k, value in enumerate(outputs):
            key = row.name if len(outputs) == 1 else f"{row.name}[{k}]"
            wanted[(value.producer.index, value.producer.outs.index(value))] = key
    return wanted


class _Recorder:
    """The default rule: bind unchanged, keep the wanted outputs."""

    def __init__(self, ops: list[Op], wanted: dict[tuple[int, int], str]):
        self.ops, self.wanted, self.next = ops, wanted, 0
        self.captured: dict[str, jax.Array] = {}

    def __call__(self, eqn, *invals):
        op = self.ops[self.next]
        if op.eqn is not eqn:
            raise JtileError(
                f"jtile.intercept: walk and interpreter disagree at op {self.next} "
                f"({op.primitive} vs {eqn.primitive.name}); please report this bug"
            )
        self.next += 1
        outs = bind(eqn, *invals)
        for k, x in enumerate(outs):
            if (op.index, k) in self.wanted:
                self.captured[self.wanted[(op.index, k)]] = x
        return outs if eqn.primitive.multiple_results else outs[0]


def intercept(
    fn: Callable, *args, select: Select = None, depth: int | None = None, **kwargs
) -> tuple[object, dict[str, jax.Array]]:
    """Run `fn(*args, **kwargs)` and return `(outputs, {layer name: activation})`.

    `select` limits what is kept: a predicate on the `jtile.Layer` of each
    layer (its `.name` is the layer name), or a collection of layer names.
    The outputs are those of `jax.jit(fn)(*args, **kwargs)`.
    """
    if depth is not None:
        require_positive_int("jtile.intercept", "depth", depth)
    fn, args, _ = as_call(fn, args)
    leaves = jax.tree.leaves((fn, args, kwargs))
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        raise ConfigError(
            "jtile.intercept: got a jax.ShapeDtypeStruct; intercept runs the function, "
            "so pass arrays (jtile.summary accepts shapes)"
        )
    graph = trace_graph("jtile.intercept", fn, args, kwargs)
    wanted = _wanted(graph.layers(depth), select)
    closed = graph.closed

    def run(*leaves):
        recorder = _Recorder(graph.ops, wanted)
        outs = eval_jaxpr(closed.jaxpr, closed.consts, *leaves, rules={}, default=recorder)
        return outs, recorder.captured

    outs, captured = jax.jit(run)(*[x for x in leaves if is_array(x)])
    in_order = {key: captured[key] for key in wanted.values() if key in captured}
    return jax.tree.unflatten(graph.out_tree, outs), in_order
