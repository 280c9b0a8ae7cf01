"""Chain fusion on the one interpreter: plan on the dataflow, fuse while evaluating.

A chain starts at a producer (a conv, a dot) and continues through consumers
that accept it (a bias add, a batch-norm scale, a `max` with 0). Planning reads
the uses of every value from `jtile.Graph` (the inlined jaxpr, so that
`jax.nn.relu` does not hide its `max`, and the bodies of control flow), and
marks an equation *absorbed* when, at every place its jaxpr is used, its one
output has exactly one consumer and that consumer accepts a chain at that
operand (or its consumers are a group the recipe accepts together: the
branches of an activation, as the three uses of `y` in a leaky relu, whose
ops up to the one where they meet are absorbed with it), and the output is
neither a result of the function nor an operand of control flow. Accepting
depends only on the consumers' own operand shapes and on which operands are
scalar literals, so it is decided once per equation. Where branches meet
before their final join, the op is held back (`Deferred`) without asking the
recipe, so that only the whole activation is recognised.

While evaluating (`eval_jaxpr` with a rule per primitive involved), an absorbed
equation binds nothing and hands its consumer a `Pending` chain; the consumer
extends it, or finishes it into the fused op. A chain that a consumer cannot
extend after all (say, a scale along the wrong axis) is finished as it stands,
so the worst case is the unfused computation, never a wrong one.

!!! warning

    Only chains fuse: a value with other uses is never absorbed, so a conv
    whose output also feeds a residual branch keeps its own op.
"""

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax.extend.core as jcore
import numpy as np
from jax._src import source_info_util

from .._graph import Graph
from .._interpreter import bind


class _Const:
    """A literal operand (or a dtype conversion of one) seen while planning."""

    def __init__(self, value):
        value = np.asarray(value)
        self.value = float(value.reshape(())) if value.size == 1 else None


@dataclasses.dataclass
class _Uses:
    """The uses of every value of a graph and of its control-flow bodies."""

    users: dict = dataclasses.field(default_factory=lambda: defaultdict(list))
    escaped: set = dataclasses.field(default_factory=set)
    occurrences: list = dataclasses.field(default_factory=list)

    def add(self, graph: Graph) -> None:
        alias: dict = {}  # a dtype conversion of a literal is that literal

        def key(v):
            return _Const(v.var.val) if v.role == "literal" else alias.get(v, v)

        self.escaped.update(key(v) for v in graph.outputs)
        for op in graph.ops:
            ins = [key(v) for v in op.ins]
            if op.primitive == "convert_element_type" and isinstance(ins[0], _Const):
                alias[op.outs[0]] = ins[0]
            outs = [key(v) for v in op.outs]
            for sub in op.subgraphs:
                self.add(sub)
            if op.subgraphs:
                self.escaped.update(ins)
            else:
                for i, k in enumerate(ins):
                    self.users[k].append((op.eqn, i, outs))
            self.occurrences.append((op.eqn, ins, outs))


@dataclasses.dataclass(frozen=True)
class Plan:
    """`absorbed`: ids of equations that return a `Pending`; `branched`: those
    among them whose result has several uses (accepted together);
    `on_branches`: the ops on those uses' branches before they meet; `consts`: per
    equation id, the scalar literal value of each operand (`None` where it is
    not one), or `None` when call sites disagree."""

    absorbed: frozenset
    branched: frozenset
    on_branches: frozenset
    consts: dict
    primitives: frozenset


def make_plan(closed: jcore.ClosedJaxpr, recipe: "ChainRecipe") -> Plan:
    """Plan `recipe`'s chains on `closed`."""
    walk = _Uses()
    walk.add(Graph.of(closed))
    consts: dict = {}
    for eqn, ins, _ in walk.occurrences:
        c = tuple(k.value if isinstance(k, _Const) else None for k in ins)
        if consts.setdefault(id(eqn), c) != c:
            consts[id(eqn)] = None
    absorbed: dict = {}
    branched: set = set()
    on_branches: set = set()  # ops between a branch point and the join: absorbed whatever their (one) consumer
    for eqn, _, outs in walk.occurrences:
        users = walk.users[outs[0]] if len(outs) == 1 and outs[0] not in walk.escaped else []
        if any(consts[id(user)] is None for user, _, _ in users):
            ok = False
        elif len(users) == 1:
            user, pos, _ = users[0]
            ok = id(eqn) in on_branches or recipe.accepts(user, pos, consts[id(user)])
        else:
            branches = recipe.accepts_users(users, consts, walk.users) if users else ()
            ok = bool(branches)
            branched.add(id(eqn))
            on_branches.update(branches)
        absorbed[id(eqn)] = absorbed.get(id(eqn), True) and ok
    names = frozenset(eqn.primitive.name for eqn, _, _ in walk.occurrences)
    kept = frozenset(i for i, a in absorbed.items() if a)
    return Plan(kept, kept & branched, frozenset(on_branches), consts, names)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A chain not yet bound: the recipe's state and where its head was.
    Finished once: a value whose several uses all stop the chain (the branches
    of an activation that is not recognised after all) is bound once."""

    state: Any
    traceback: Any
    name_stack: Any
    finished: list = dataclasses.field(default_factory=list, init=False, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A recipe state for an op held back until its consumer decides: bound as
    `eqn` on `invals` (pending chains finished first) if the chain stops.
    `consts` are the op's scalar literal operands, as in `Plan.consts`."""

    eqn: Any
    invals: tuple
    consts: tuple


class ChainRecipe:
    """A chain fusion: subclasses define `starts`, `accepts`, `start`, `step`, `finish`."""

    starts: frozenset = frozenset()
    continues: frozenset = frozenset()

    def accepts(self, eqn, pos: int, consts: tuple) -> bool:
        """Whether `eqn`, the only consumer of a chain, continues it at operand `pos`."""
        raise NotImplementedError

    def accepts_users(self, users: list, consts: dict, all_users: dict) -> frozenset:
        """Whether several consumers `(eqn, pos, out_keys)` continue a chain
        together: the ids of the ops on those branches before they meet (all
        absorbed), empty if they do not."""
        return frozenset()

    def start(self, eqn, invals):
        raise NotImplementedError

    def branch(self, state):
        """The state handed to each of several consumers accepted together."""
        return state

    def step(self, states: dict, eqn, invals, consts: tuple):
        """The state after `eqn`, given the states of its pending operands
        `{pos: state}`, or `None` when `eqn` cannot continue them."""
        raise NotImplementedError

    def finish(self, state):
        raise NotImplementedError


def finish_pending(recipe: ChainRecipe, value):
    """`value`, or the op its pending chain stands for, bound where the chain began."""
    if not isinstance(value, Pending):
        return value
    if not value.finished:
        with source_info_util.user_context(value.traceback, name_stack=value.name_stack):
            if isinstance(value.state, Deferred):
                out = bind(value.state.eqn, *(finish_pending(recipe, x) for x in value.state.invals))[0]
            else:
                out = recipe.finish(value.state)
        value.finished.append(out)
    return value.finished[0]


def _chain_rule(recipe: ChainRecipe, plan: Plan, eqn, *invals):
    pending = {i: x for i, x in enumerate(invals) if isinstance(x, Pending)}
    absorbed = id(eqn) in plan.absorbed
    branch = recipe.branch if id(eqn) in plan.branched else lambda state: state
    if pending:
        states = {i: x.state for i, x in pending.items()}
        if len(pending) > 1 and id(eqn) in plan.on_branches:  # branches meet before their join: wait for it
            state = Deferred(eqn, tuple(invals), plan.consts.get(id(eqn)))
        else:
            state = recipe.step(states, eqn, invals, plan.consts.get(id(eqn)))
        if state is not None:
            new = dataclasses.replace(next(iter(pending.values())), state=branch(state))
            return new if absorbed else finish_pending(recipe, new)
    invals = [finish_pending(recipe, x) for x in invals]
    if not pending and absorbed and eqn.primitive.name in recipe.starts:
        stack = source_info_util.current_name_stack()
        return Pending(branch(recipe.start(eqn, invals)), eqn.source_info.traceback, stack)
    return bind(eqn, *invals)[0]


def chain_rules(recipe: ChainRecipe) -> Callable:
    """`make_rules(closed)` for `transform`, planning once per jaxpr."""
    plans: dict = {}
    names = recipe.starts | recipe.continues

    def make_rules(closed):
        if id(closed) not in plans or plans[id(closed)][0] is not closed:
            plans[id(closed)] = (closed, make_plan(closed, recipe))
        rule = functools.partial(_chain_rule, recipe, plans[id(closed)][1])
        return {name: rule for name in names}

    return make_rules
