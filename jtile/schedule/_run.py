"""Executing a schedule: node by node (`run`, optionally on threads) or as one reordered jaxpr (`apply`).

Both evaluate the graph's own equations with `jtile._interpreter.eval_jaxpr`
and no rules: `run` evaluates each node's equations eagerly, in the
scheduled order (or one parallel group at a time on a thread pool, like
Aidge's ParallelScheduler), so it returns what calling the function eagerly
returns; `apply` returns a function whose jaxpr holds the same equations in
the scheduled order, to be jitted by the caller.

!!! warning

    XLA reorders a jitted program as it likes; `apply` fixes the order of
    the jaxpr, not the order of the compiled code.
"""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.extend.core as jcore
import numpy as np

from .._errors import ConfigError
from .._graph import Graph, Op
from .._interpreter import eval_jaxpr, is_array
from .._roles import as_call


def _jaxpr(constvars: list, invars: list, outvars: list, eqns: list, effects) -> jcore.Jaxpr:
    info = jcore.DebugInfo("jtile.schedule", None, ("",) * len(invars), ("",) * len(outvars))
    return jcore.Jaxpr(constvars, invars, outvars, eqns, effects, info)


def flat_arguments(where: str, graph: Graph, fn, args: tuple) -> list:
    """The graph's input leaves from `fn` and `args`, checked against the traced shapes."""
    fn, args, _ = as_call(fn, args)
    leaves = [x for x in jax.tree.leaves((fn, args, {})) if is_array(x) or isinstance(x, jax.ShapeDtypeStruct)]
    if len(leaves) != len(graph.inputs):
        raise ConfigError(f"{where}: expected {len(graph.inputs)} array leaves (parameters and inputs) "
                          f"as when scheduled, got {len(leaves)}; call it with arguments of the traced structure")
    for value, leaf, x in zip(graph.inputs, graph.leaves, leaves):
        if isinstance(x, jax.ShapeDtypeStruct):
            raise ConfigError(f"{where}: {leaf.path} is a jax.ShapeDtypeStruct; the schedule was built from "
                              "shapes only, so pass real arrays (and a model with real weights) to run it")
        if tuple(x.shape) != value.shape or np.dtype(x.dtype) != value.dtype:
            raise ConfigError(f"{where}: {leaf.path} has shape {tuple(x.shape)} and dtype {np.dtype(x.dtype)}, "
                              f"but the schedule was traced with {value.shape} {value.dtype}; schedule again "
                              "for these shapes")
    return leaves


class Runner:
    """Each node's equations as a small jaxpr over the values it reads from other nodes."""

    def __init__(self, graph: Graph, node_ops: list[list[Op]], prologue: list[Op]):
        self.graph = graph
        self.steps = [self._part(ops) for ops in [prologue, *node_ops]]

    def _part(self, ops: list[Op]):
        mine = {id(v) for op in ops for v in op.outs}
        reads = list({id(v): v for op in ops for v in op.ins
                      if v.role != "literal" and id(v) not in mine}.values())
        outs = [v for op in ops for v in op.outs if v.consumers or v.is_output]
        jaxpr = _jaxpr([], [v.var for v in reads], [v.var for v in outs], [op.eqn for op in ops],
                       self.graph.closed.jaxpr.effects)
        return jaxpr, [v.index for v in reads], [v.index for v in outs]

    def _step(self, k: int, env: dict) -> None:
        jaxpr, reads, outs = self.steps[k]
        results = eval_jaxpr(jaxpr, [], *(env[i] for i in reads), rules={})
        env.update(zip(outs, results))

    def run(self, leaves: list, groups: list[list[int]], workers: int) -> list:
        """Evaluate the prologue, then each group of nodes (indices into `node_ops`) in turn."""
        env = {v.index: x for v, x in zip(self.graph.inputs, leaves)}
        env.update({v.index: c for v, c in zip(self.graph.consts, self.graph.closed.consts)})
        self._step(0, env)
        if workers == 1:
            for group in groups:
                for node in group:
                    self._step(node + 1, env)
        else:
            with ThreadPoolExecutor(workers) as pool:
                for group in groups:
                    list(pool.map(lambda node: self._step(node + 1, env), group))
        return [v.var.val if v.role == "literal" else env[v.index] for v in self.graph.outputs]


def reordered(graph: Graph, eqn_order: list) -> Callable:
    """`f(*leaves)` evaluating `graph`'s equations in `eqn_order` under the caller's trace."""
    jaxpr = graph.closed.jaxpr
    body = _jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqn_order, jaxpr.effects)
    return lambda *leaves: eval_jaxpr(body, graph.closed.consts, *leaves, rules={})
