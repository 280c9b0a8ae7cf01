"""`jtile.Graph`: the one read-only dataflow view of a traced function.

Every read-only question about a traced (inlined) jaxpr is answered here:
who produces a value, who consumes it, which layer an op belongs to, what
it costs, how many bytes a value holds, and whether a leaf is an input, a
parameter or a constant. Analysis, export, fusion and algorithm planning,
the scheduler and spatial tiling read a `Graph`; none walks `jaxpr.eqns`
itself.

- `jtile.graph(fn, *args, **kwargs)` traces `fn` with filter semantics (as
  `jtile.summary` does: zoo modules, `fn(params, *inputs)` functions and
  `OnnxModel`s; `jax.ShapeDtypeStruct` leaves are accepted).
- `Graph.of(closed)` is the graph of an inlined `ClosedJaxpr`, the one a
  transform's `make_rules(closed)` receives; built once per jaxpr object.

Ops are the equations of the inlined jaxpr in program order: op `k` is the
`k`-th equation `eval_jaxpr` hands to a rule. Control flow (`cond`, `scan`,
`while`) is one op, with the graphs of its bodies in `Op.subgraphs`.
`Graph.layers(depth)` groups consecutive ops by `jax.named_scope` into
layers (ONNX node names for imported models), so one object gives both the
op-level and the layer-level view.

Roles. The calling convention of `jtile._roles` comes first: a module's own
leaves and `fn(params, *inputs)`'s first argument are params, the rest
inputs. Where the dataflow contradicts it (a conv weight passed as an
input: `f(x, w)`), the dataflow decides: the leaves that reach an activation
operand (a conv's input) without meeting a weight on the way are inputs,
every other leaf is a param. A leaf nothing reads is no parameter (an unused
initializer, a shape folded at import). `params=` overrides all of this. A closed-over constant
is a *param* when it is a named array of the wrapped module or reaches a
weight operand; other constants (tables a lowering made, such as an
average-pool divisor) are *const*.

!!! warning

    The graph describes the top-level jaxpr; values inside a control-flow
    body belong to that op's subgraph, and a body's ops are not in `ops`.
"""

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util

from ._errors import ConfigError
from ._interpreter import Traced
from ._layers import Layer, describe
from ._macs import eqn_macs
from ._registry import lookup
from ._roles import Leaf, as_call, closure_names, input_leaves

ROLES = ("input", "param", "const", "literal", "activation")


@dataclasses.dataclass(eq=False)
class Value:
    """One array of the program: a jaxpr input, constant, literal or op result."""

    index: int
    var: object
    aval: jax.core.ShapedArray
    role: str
    producer: "Op | None" = None
    consumers: list = dataclasses.field(default_factory=list)
    is_output: bool = False
    sources: int = 0  # bitmask over `Graph.leaves` of the leaves it is computed from
    data: bool = False  # computed from an input (an activation of the data path)
    params: int = 0  # bitmask of the parameter leaves it is computed from (if not data)
    grads: int = 0  # bitmask of the parameter leaves a gradient would reach

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.aval.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.aval.shape) * np.dtype(self.aval.dtype).itemsize

    @property
    def is_data(self) -> bool:
        return self.data

    def __repr__(self) -> str:
        made = f" from op {self.producer.index}" if self.producer else ""
        return f"Value({self.index}, {self.role}, {self.dtype}{list(self.shape)}{made})"


@dataclasses.dataclass(eq=False)
class Op:
    """One equation of the inlined jaxpr."""

    index: int
    eqn: jcore.JaxprEqn
    scope: str
    ins: list[Value]
    outs: list[Value]
    macs: Counter
    uncounted: set[str]
    subgraphs: list["Graph"]
    owned: int = 0  # bitmask of the parameter leaves attributed to this op

    @property
    def primitive(self) -> str:
        return self.eqn.primitive.name

    @property
    def kind(self) -> str:
        layer = self.layer()
        return layer.kind if layer is not None else self.primitive

    def layer(self) -> Layer | None:
        """The `jtile.Layer` describing this op, or None if it is not a known layer."""
        return describe(self.eqn)

    def __repr__(self) -> str:
        return f"Op({self.index}, {self.primitive}, {self.scope!r})"


_KIND_ORDER = ("conv", "dense", "pool", "norm", "activation", "elementwise")
_SHORT = {"conv_general_dilated": "conv"}


@dataclasses.dataclass(eq=False)
class LayerGroup:
    """One layer: a run of ops under one scope, the values it reads from
    outside and the values it hands on."""

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
        """The `jtile.Layer` kind of the layer's known op (`conv2d`, `dense`,
        `maxpool2d`, ...), else its `category`."""
        for op in self.ops:
            if op.layer() is not None:
                return op.kind
        return self.category

    @property
    def category(self) -> str:
        """The layer's main category: conv, dense, pool, norm, activation,
        elementwise, or layout."""
        return next((k for k in _KIND_ORDER if self.macs.get(k)), "layout")

    @property
    def input_bytes(self) -> int:
        return sum(v.nbytes for v in self.inputs)

    def __repr__(self) -> str:
        return f"LayerGroup({self.name!r}, {self.kind}, {len(self.ops)} ops)"

    @property
    def output_bytes(self) -> int:
        return sum(v.nbytes for v in self.outputs)

    def layer(self, index: int) -> Layer:
        """This layer as a `jtile.Layer` (conv fields filled for a conv layer)."""
        for op in self.ops:
            described = op.layer()
            if described is not None:
                return dataclasses.replace(described, name=self.name, index=index)
        first = self.outputs[0] if self.outputs else self.ops[-1].outs[0]
        return Layer(
            kind=self.category,
            name=self.name,
            primitive=max(self.ops, key=lambda op: sum(op.macs.values())).primitive,
            in_shapes=tuple(v.shape for v in self.inputs if v.data),
            out_shape=first.shape,
            dtype=first.dtype,
            index=index,
        )


def _or(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _operand_roles(op: Op) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Operand positions read as weights and as activations (registry facets)."""
    entry = lookup(op.eqn)
    if entry is None:
        return (), ()
    return entry.weights or (), entry.activations or ()


class Graph:
    """The dataflow of one traced call (see the module docstring)."""

    def __init__(self, closed: jcore.ClosedJaxpr, leaves: list[Leaf] | None = None,
                 names: dict | None = None, out_tree=None, stack=None, params=None):
        self.closed, self.out_tree = closed, out_tree
        jaxpr = closed.jaxpr
        n_in = len(jaxpr.invars)
        names = names or {}
        if leaves is None:
            leaves = [Leaf(f"in[{i}]", tuple(v.aval.shape), np.dtype(v.aval.dtype), False)
                      for i, v in enumerate(jaxpr.invars)]
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self._by_var: dict = {}
        self._by_eqn: dict[int, Op] = {}
        for i, v in enumerate([*jaxpr.invars, *jaxpr.constvars]):
            self._by_var[v] = self._new(v, "input" if i < n_in else "const", sources=1 << i)
        stack = source_info_util.new_name_stack() if stack is None else stack
        for eqn in jaxpr.eqns:
            self._add_op(eqn, str(stack + eqn.source_info.name_stack))
        self.outputs = [self._read(v) for v in jaxpr.outvars]
        for v in self.outputs:
            v.is_output = True
        self.inputs = self.values[:n_in]
        self.consts = self.values[n_in : n_in + len(jaxpr.constvars)]
        self.leaves = self._classify(leaves, closed.consts, names, params)
        self._propagate()

    # ------------------------------------------------------------ building

    def _new(self, var, role: str, producer: "Op | None" = None, sources: int = 0) -> Value:
        value = Value(len(self.values), var, var.aval, role, producer, sources=sources)
        self.values.append(value)
        return value

    def _read(self, v) -> Value:
        if isinstance(v, jcore.Literal):
            return self._new(v, "literal")
        return self._by_var[v]

    def _add_op(self, eqn, scope: str) -> None:
        ins = [self._read(v) for v in eqn.invars]
        subs = [Graph.of(s if isinstance(s, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(s, []))
                for s in jcore.jaxprs_in_params(eqn.params)]
        macs, uncounted = eqn_macs(eqn, [
            (sum((op.macs for op in sub.ops), Counter()), set().union(*(op.uncounted for op in sub.ops)))
            for sub in subs
        ])
        op = Op(len(self.ops), eqn, scope, ins, [], macs, uncounted, subs)
        sources = _or(v.sources for v in ins)
        for v in eqn.outvars:
            value = self._new(v, "activation", op, sources)
            op.outs.append(value)
            if not isinstance(v, jcore.DropVar):
                self._by_var[v] = value
        for v in ins:
            v.consumers.append(op)
        self.ops.append(op)
        self._by_eqn[id(eqn)] = op

    def _classify(self, leaves: list[Leaf], consts: list, names: dict, override) -> list[Leaf]:
        """Decide each leaf's role from the dataflow (see the module docstring)."""
        weights = 0
        for op in self.ops:
            weight_at, _ = _operand_roles(op)
            weights |= _or(op.ins[pos].sources for pos in weight_at if pos < len(op.ins))
        n_in = len(self.inputs)
        contradicted = any(weights >> i & 1 and not leaf.is_param for i, leaf in enumerate(leaves[:n_in]))
        data = self._pure_data(weights) if contradicted else 0
        out = []
        for i, value in enumerate([*self.inputs, *self.consts]):
            bit = 1 << i
            if i < n_in:
                leaf = leaves[i]
                if override is not None:
                    is_param = override(leaf.path)
                elif contradicted:  # the calling convention is wrong here: trust the dataflow
                    is_param = not data & bit
                else:
                    is_param = bool(weights & bit) or (leaf.is_param and bool(value.consumers))
                value.role = "param" if is_param else "input"
            else:
                c = consts[i - n_in]
                path, buffer = names.get(id(c), (f"const[{i}]", False))
                is_param = id(c) in names or bool(weights & bit)
                value.role = "param" if is_param else "const"
                leaf = Leaf(path, value.shape, value.dtype, is_param, buffer)
            out.append(dataclasses.replace(leaf, is_param=is_param, is_buffer=leaf.is_buffer and is_param))
        return out

    def _pure_data(self, weights: int) -> int:
        """The leaves that reach an activation operand without meeting a weight
        on the way: the data inputs, when the calling convention got them wrong."""
        pure = {id(v): (1 << i) & ~weights for i, v in enumerate([*self.inputs, *self.consts])}
        data = 0
        for op in self.ops:
            mixed = any(v.sources & weights for v in op.ins)
            _, activation_at = _operand_roles(op)
            data |= _or(pure.get(id(op.ins[pos]), 0) for pos in activation_at if pos < len(op.ins))
            for v in op.outs:
                pure[id(v)] = 0 if mixed else _or(pure.get(id(x), 0) for x in op.ins)
        return data

    def _propagate(self) -> None:
        """Data flags, parameter and gradient masks, and parameter ownership."""
        for i, (value, leaf) in enumerate(zip([*self.inputs, *self.consts], self.leaves)):
            value.data = value.role == "input"
            value.params = value.grads = (1 << i) if leaf.is_param else 0
        for op in self.ops:
            data = any(v.data for v in op.ins)
            params = 0 if data else _or(v.params for v in op.ins)
            blocks = op.primitive == "stop_gradient"
            for v in op.outs:
                floating = jnp.issubdtype(v.aval.dtype, jnp.inexact)
                v.data, v.params = data, params
                v.grads = _or(x.grads for x in op.ins) if floating and not blocks else 0
        taken = 0
        for strict in (True, False):
            # Weight preprocessing outside any scope (a kernel's transpose) is looked
            # through: its parameters go to the op that consumes the result.
            for op in self.ops:
                if strict and not op.scope and not any(v.data for v in op.ins):
                    continue
                mask = _or(v.params for v in op.ins if not v.data) & ~taken
                op.owned |= mask
                taken |= mask

    # ------------------------------------------------------------ queries

    _CACHE: dict = {}

    @classmethod
    def of(cls, closed: jcore.ClosedJaxpr) -> "Graph":
        """The graph of an inlined `ClosedJaxpr`, built once per jaxpr object."""
        hit = cls._CACHE.get(id(closed))
        if hit is None or hit[0] is not closed:
            if len(cls._CACHE) > 64:
                cls._CACHE.clear()
            hit = cls._CACHE[id(closed)] = (closed, cls(closed))
        return hit[1]

    def walk(self):
        """This graph and the graphs of every control-flow body, depth first."""
        yield self
        for op in self.ops:
            for sub in op.subgraphs:
                yield from sub.walk()

    def all_ops(self):
        """Every op of this graph and of its control-flow bodies, depth first,
        in program order (an op comes before the ops of its bodies)."""
        for op in self.ops:
            yield op
            for sub in op.subgraphs:
                yield from sub.all_ops()

    def described(self) -> dict[int, Layer]:
        """`{id(eqn): jtile.Layer}` for every known layer, bodies included; a
        layer's `index` is its position among the layers of its kind in program
        order (`all_ops` order), the numbering every selector sees."""
        counts: Counter = Counter()
        out = {}
        for op in self.all_ops():
            layer = op.layer()
            if layer is not None:
                out[id(op.eqn)] = dataclasses.replace(layer, index=counts[layer.kind])
                counts[layer.kind] += 1
        return out

    def sole_readers(self, kind: str) -> Iterator[tuple[Op, Op]]:
        """`(producer, op)` over the top-level ops of `kind` whose first input is
        another op's output that nothing else reads and the function does not
        return: pairs one kernel call may run together."""
        for op in self.ops:
            value = op.ins[0] if op.kind == kind and op.ins else None
            if value is not None and value.producer is not None and value.consumers == [op] \
                    and not value.is_output:
                yield value.producer, op

    def producers(self) -> dict:
        """`{jaxpr var: the equation that produces it}` over every body too."""
        return {v.var: op.eqn for op in self.all_ops() for v in op.outs}

    def value(self, var) -> Value:
        """The `Value` of a top-level jaxpr `Var`."""
        return self._by_var[var]

    def op(self, eqn) -> Op:
        """The `Op` of a top-level equation."""
        return self._by_eqn[id(eqn)]

    @property
    def trainable(self) -> int:
        """Bitmask over `leaves` of the trainable parameters: those a gradient
        from an activation reaches (or unused ones), floating, not buffers."""
        reached = _or(v.grads for op in self.ops for v in op.outs if v.data)
        values = [*self.inputs, *self.consts]
        unused = _or(1 << i for i, v in enumerate(values) if not v.consumers)
        ok = _or(1 << i for i, leaf in enumerate(self.leaves)
                 if leaf.is_param and not leaf.is_buffer and jnp.issubdtype(leaf.dtype, jnp.inexact))
        return (reached | unused) & ok

    def peak_bytes(self) -> int:
        """The most bytes of activations (op results computed from an input) alive
        at once when the ops run in program order: a result lives from its op to
        its last reader (an output to the end), and is made while the op's operands
        are alive; while a control-flow op runs, its largest body's own peak (its
        results included) counts instead of its results. Inputs, weights and what
        is computed from weights alone are not counted; nothing is updated in place
        (XLA may do better, and adds layout copies of its own)."""
        last = {v: op.index for op in self.ops for v in op.ins}
        last.update({v: len(self.ops) for v in self.outputs})
        live = peak = 0
        for op in self.ops:
            made = sum(v.nbytes for v in op.outs if v.data)
            inner = max((sub.peak_bytes() for sub in op.subgraphs), default=0)
            peak = max(peak, live + max(made, inner))
            dead = {v for v in (*op.ins, *op.outs)
                    if v.producer is not None and v.data and last.get(v, -1) <= op.index}
            live += made - sum(v.nbytes for v in dead)
        return peak

    def leaf_values(self, mask: int) -> list[Value]:
        """The input and constant values whose bits are set in `mask`."""
        values = [*self.inputs, *self.consts]
        return [values[i] for i in bits(mask)]

    def layers(self, depth: int | None = None) -> list[LayerGroup]:
        """The layers: consecutive ops whose scope, cut to `depth` components
        (ending at "/" or "."), is the same. An op outside any scope is a
        layer of its own named `<primitive>_<k>`; repeated names get `#1`, `#2`."""
        runs = _runs(self.ops, depth)
        owner = {op.index: i for i, (_, ops) in enumerate(runs) for op in ops}
        returned = {id(v) for v in self.outputs}
        groups = []
        for i, (name, ops) in enumerate(zip(_unique([n for n, _ in runs]), (o for _, o in runs))):
            made = [v for op in ops for v in op.outs]
            outputs = [v for v in made
                       if id(v) in returned or any(owner[c.index] != i for c in v.consumers)]
            inputs = list({
                id(v): v for op in ops for v in op.ins
                if v.role != "literal" and (v.producer is None or owner[v.producer.index] != i)
            }.values())
            macs = sum((_normalise(o) for _, o in _runs(ops, None)), Counter())
            groups.append(LayerGroup(name, ops, inputs, outputs, +macs))
        return groups

    def __repr__(self) -> str:
        return f"Graph({len(self.ops)} ops, {len(self.layers())} layers, {len(self.values)} values)"


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


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def _placeholder(x):
    """A zero-byte array standing in for a `jax.ShapeDtypeStruct` while tracing."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)
    return x


def trace_graph(where: str, fn, args: tuple, kwargs: dict, params=None) -> Graph:
    """Trace `fn(*args, **kwargs)` with `fn`'s own array leaves as inputs, into a `Graph`.

    `params` overrides which argument leaves are parameters: a predicate on a
    leaf's path (`"args[0]['w']"`) or a collection of such paths.
    """
    fn, args, buffer_keys = as_call(fn, args)
    fn, args, kwargs = jax.tree.map(_placeholder, (fn, args, kwargs))
    traced = Traced(where, _call, (fn, args, kwargs), {})
    leaves = input_leaves(fn, args, kwargs, buffer_keys)
    if params is not None and not callable(params):
        paths = set(params)
        unknown = paths - {leaf.path for leaf in leaves}
        if unknown:
            raise ConfigError(
                f"{where}: params= names {', '.join(sorted(unknown))}, which are not array leaves of "
                f"the arguments; leaves are {', '.join(leaf.path for leaf in leaves)}"
            )
        params = paths.__contains__
    return Graph(traced.jaxpr, leaves, closure_names(fn), traced.out_tree, params=params)


def graph(fn, *args, **kwargs) -> Graph:
    """The `jtile.Graph` of `fn(*args, **kwargs)`; nothing is computed.

    `fn` may be a zoo module (`graph(model, x)`), a function of
    `(params, *inputs)`, or an `OnnxModel`; arguments may be arrays or
    `jax.ShapeDtypeStruct`s.

    ```python
    g = jtile.graph(jtile.models.get("resnet18", key), x)
    for layer in g.layers():
        print(layer.name, layer.kind, sum(layer.macs.values()))
    ```
    """
    return trace_graph("jtile.graph", fn, args, kwargs)
