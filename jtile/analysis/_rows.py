"""Group a flattened program into layers, one per `jax.named_scope`.

Consecutive ops whose scope path, cut to `depth` components, is the same form
one layer named by that path. Components end at "/" or ".", so both
`jax.named_scope` nesting and torchvision's dotted names ("layer1.0.conv1")
count as depth. An op outside any scope is a layer of its own, named by its
primitive and a counter (`add_3`). A name met again after other layers gets a
`#1`, `#2` suffix, so every name is unique.
"""

import dataclasses
from collections import Counter

import numpy as np

from .._layers import Layer, describe
from ._graph import Graph, Op, Value

_KIND_ORDER = ("conv", "dense", "pool", "norm", "activation", "elementwise")
_SHORT = {"conv_general_dilated": "conv"}


@dataclasses.dataclass(eq=False)
class Row:
    """One layer: its ops, the values it reads from outside and the values it hands on."""

    name: str
    ops: list[Op]
    inputs: list[Value]
    outputs: list[Value]
    macs: Counter

    @property
    def params(self) -> int:
        mask = 0
        for op in self.ops:
            mask |= op.owned
        return mask

    @property
    def op_names(self) -> list[str]:
        names = [_SHORT.get(op.primitive, op.primitive) for op in self.ops if op.macs]
        names = names or [_SHORT.get(op.primitive, op.primitive) for op in self.ops]
        return list(dict.fromkeys(names))

    @property
    def kind(self) -> str:
        return next((k for k in _KIND_ORDER if self.macs.get(k)), "layout")

    @property
    def input_bytes(self) -> int:
        return sum(v.nbytes for v in self.inputs)

    @property
    def output_bytes(self) -> int:
        return sum(v.nbytes for v in self.outputs)

    def layer(self, index: int) -> Layer:
        """This row as a `jtile.Layer` (conv fields filled for a conv layer)."""
        for op in self.ops:
            described = describe(op.eqn)
            if described is not None:
                return dataclasses.replace(described, name=self.name, index=index)
        first = self.outputs[0] if self.outputs else self.ops[-1].outs[0]
        return Layer(
            kind=self.kind,
            name=self.name,
            primitive=max(self.ops, key=lambda op: sum(op.macs.values())).primitive,
            in_shapes=tuple(tuple(v.aval.shape) for v in self.inputs if v.data),
            out_shape=tuple(first.aval.shape),
            dtype=np.dtype(first.aval.dtype),
            index=index,
        )


def _key(scope: str, depth: int | None) -> str:
    """`scope` cut after its `depth`-th component; components end at "/" or "."."""
    if depth is None:
        return scope
    ends = [i for i, c in enumerate(scope) if c in "/." and i > 0 and scope[i - 1] not in "/."]
    return scope[: ends[depth - 1]] if len(ends) >= depth else scope


def _runs(ops: list[Op], depth: int | None) -> list[tuple[str, list[Op]]]:
    runs: list[tuple[str, list[Op]]] = []
    unscoped: Counter = Counter()
    for op in ops:
        if not op.scope:
            runs.append((f"{op.primitive}_{unscoped[op.primitive]}", [op]))
            unscoped[op.primitive] += 1
        elif runs and runs[-1][1][-1].scope and runs[-1][0] == _key(op.scope, depth):
            runs[-1][1].append(op)
        else:
            runs.append((_key(op.scope, depth), [op]))
    return runs


def _unique(names: list[str]) -> list[str]:
    seen: Counter = Counter()
    out = []
    for name in names:
        out.append(name if not seen[name] else f"{name}#{seen[name]}")
        seen[name] += 1
    return out


def _normalise(ops: list[Op]) -> Counter:
    """Arithmetic of a layer that takes a square root (and no conv/dot) is a norm."""
    macs = sum((op.macs for op in ops), Counter())
    has_root = any(op.primitive in ("rsqrt", "sqrt") for op in ops)
    if has_root and not (macs["conv"] or macs["dense"]):
        macs["norm"] += macs.pop("elementwise", 0) + macs.pop("activation", 0)
    return macs


def group(graph: Graph, depth: int | None = None) -> list[Row]:
    """The layers of `graph`, with scope paths cut to `depth` components."""
    runs = _runs(graph.ops, depth)
    owner = {}
    for i, (_, ops) in enumerate(runs):
        for op in ops:
            owner[op.index] = i
    returned = {id(v) for v in graph.outputs}
    rows = []
    for i, (name, ops) in enumerate(zip(_unique([n for n, _ in runs]), (o for _, o in runs))):
        made = [v for op in ops for v in op.outs]
        outputs = [
            v for v in made
            if id(v) in returned or any(owner[c.index] != i for c in v.consumers)
        ]
        inputs = list({
            id(v): v for op in ops for v in op.ins
            if v.producer is None or owner[v.producer.index] != i
        }.values())
        leaf_scopes = _runs(ops, None)
        macs = sum((_normalise(o) for _, o in leaf_scopes), Counter())
        rows.append(Row(name, ops, inputs, outputs, +macs))
    return rows

