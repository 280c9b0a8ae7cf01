"""Per-layer algorithm swapping, as ai3 does it.

`swap_backend(fn, algorithms={"conv2d": selector, "dense": ...})` replaces the
layers of `fn` by jtile's C kernels (`jtile.kernels`), one algorithm per layer.
A selector is a name for every layer of that kind, a list with one name per
layer in program order, or a callable receiving a `jtile.Layer` and returning a
name. `"default"` keeps XLA's own op; `"auto"` asks a cost model (see
`jtile._algorithm_kinds`) and keeps XLA wherever no kernel is known to win or
no kernel can serve the layer; `"measured"` times every algorithm that can
serve the layer, XLA included, once per machine and layer signature
(`jtile._measured`), and runs the fastest.

The registry maps each layer kind to its algorithms: `algorithm_names(kind)`
lists them, `register_algorithm` adds one.

Conv branches of a channel concatenation write their parts straight into its
buffer where their kernels can (`jtile._concat_in_place`), and a max pool over
a conv's output is computed in the conv's call where its kernel can
(`jtile._pool_in_conv`), as is a per-channel affine chain and ReLU before a
1x1 conv (`jtile._conv_prologue`), and a 1x1 conv whose only reader is a
depthwise conv, in the depthwise conv's call (`jtile._expanded_depthwise`); an
average pool after a linear 1x1 conv runs before it, on the conv's input
(`jtile._pool_before_conv`). Activations
that pass only between kernel convs that can take them channel-blocked stay
so (`jtile._nchwc`). A conv whose x is whole channel planes of another value,
read through layout steps (ShuffleNetV2's channel shuffle and split), gets
them copied by `kernels.gather_planes` (`jtile._views.plane_gather`), not by
XLA's loop.

!!! warning

    The choice is made once per traced signature, from shapes alone. Swapped
    layers become `jax.ffi` calls that later transforms do not recognise as
    convolutions: apply `tile_conv` and `fuse` first, `swap_backend` last.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _algorithm_kinds as kinds
from . import _measured
from ._concat_in_place import Assembly, Part, find_parts
from ._conv_prologue import Prologue, find_prologues
from ._expanded_depthwise import find_expansions
from ._errors import ConfigError, UnsupportedError, reject_positional, reject_unknown
from ._graph import Graph
from ._interpreter import bind, on_host, transform
from ._layers import Layer
from ._nchwc import Blocked, find_blocked
from ._pool_before_conv import find_pools_first
from ._pool_in_conv import find_pooled_convs
from ._views import plane_gather
from .kernels import gather_planes, warn_if_unavailable

Selector = str | Sequence[str] | Callable[[Layer], str]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One way to compute one kind of layer.

    `support(eqn, layer)` returns why the algorithm cannot serve the layer, or
    `None`; `run(eqn, *invals, producers=)` computes the layer's output from the
    inputs of its jaxpr equation (`producers` maps each variable of the traced
    jaxpr to the equation that made it).
    """

    kind: str
    name: str
    support: Callable[..., str | None]
    run: Callable


_REGISTRY: dict[str, dict[str, Algorithm]] = {}
_AUTO: dict[str, Callable[..., str]] = {}


def register_algorithm(algorithm: Algorithm) -> None:
    """Add `algorithm` to the registry of its layer kind (replacing one of the same name)."""
    _REGISTRY.setdefault(algorithm.kind, {})[algorithm.name] = algorithm


def register_auto(kind: str, choose: Callable[..., str]) -> None:
    """Set the cost model `"auto"` uses for `kind`: `choose(eqn, layer, producers)`
    returns an algorithm name; `producers` maps each jaxpr variable to its equation."""
    _AUTO[kind] = choose


def layer_kinds() -> tuple[str, ...]:
    """The layer kinds `swap_backend` can swap."""
    return tuple(sorted(_REGISTRY))


def algorithm_names(kind: str) -> tuple[str, ...]:
    """Every name a selector for `kind` may return, `"default"` and `"auto"` included."""
    return ("default", "auto", "measured", *sorted(_REGISTRY[kind]))


for _algorithm in kinds.ALGORITHMS:
    register_algorithm(Algorithm(*_algorithm))
for _kind, _choose in kinds.AUTO.items():
    register_auto(_kind, _choose)


# ------------------------------------------------------------ selectors -> plan


def _check_selectors(algorithms) -> dict[str, Selector]:
    if isinstance(algorithms, str):
        algorithms = {kind: algorithms for kind in layer_kinds()}
    if not isinstance(algorithms, Mapping):
        raise ConfigError(
            "swap_backend: algorithms must be a mapping {layer kind: selector} or a name for "
            f"every kind ('auto', 'default'), got {algorithms!r}"
        )
    for kind, selector in algorithms.items():
        if kind not in _REGISTRY:
            raise ConfigError(
                f"swap_backend: unknown layer kind {kind!r}; valid kinds are "
                f"{', '.join(layer_kinds())}"
            )
        names = [selector] if isinstance(selector, str) else selector
        if not callable(selector) and not (
            isinstance(names, Sequence) and all(isinstance(n, str) for n in names)
        ):
            raise ConfigError(
                f"swap_backend: the selector for {kind!r} must be a name, a list of names or a "
                f"callable on jtile.Layer, got {selector!r}"
            )
        if not callable(selector):
            for name in names:
                _check_name(kind, name, where="")
    return dict(algorithms)


def _check_name(kind: str, name, where: str) -> None:
    if not isinstance(name, str) or name not in algorithm_names(kind):
        raise ConfigError(
            f"swap_backend: unknown {kind} algorithm {name!r}{where}; valid names are "
            f"{', '.join(algorithm_names(kind))}"
        )


def _select(selector: Selector, layer: Layer) -> str:
    if isinstance(selector, str):
        return selector
    if callable(selector):
        name = selector(layer)
        _check_name(layer.kind, name, where=f" returned by the selector for {layer.label}")
        return name
    return selector[layer.index]


def _check_lengths(selectors: dict[str, Selector], counts: dict[str, int]) -> None:
    for kind, selector in selectors.items():
        count = counts.get(kind, 0)
        if not isinstance(selector, str) and not callable(selector) and len(selector) != count:
            raise ConfigError(
                f"swap_backend: the {kind} selector lists {len(selector)} algorithm(s) but the "
                f"function has {count} {kind} layer(s); give exactly {count} names, one per "
                f"{kind} layer in program order"
            )


def _measure(eqn, layer: Layer, producers: dict, known: list) -> str:
    if warn_if_unavailable("swap_backend"):
        return "default"
    candidates = {name: algorithm.run for name, algorithm in _REGISTRY[layer.kind].items()
                  if algorithm.support(eqn, layer) is None}
    return _measured.choose(eqn, known, layer, candidates, producers) if candidates else "default"


def _resolve(name: str, eqn, layer: Layer, producers: dict, known: list) -> Algorithm | None:
    """The algorithm to run for `layer`, `None` for XLA's own op; explicit misfits
    raise. `known` holds the operands known at trace time (None where not)."""
    if name == "auto":
        warn_if_unavailable("swap_backend")
        name = _AUTO[layer.kind](eqn, layer, producers)
    elif name == "measured":
        name = _measure(eqn, layer, producers, known)
    if name == "default":
        return None
    algorithm = _REGISTRY[layer.kind][name]
    reason = algorithm.support(eqn, layer)
    if reason is not None:
        raise UnsupportedError(
            f"swap_backend: algorithm {name!r} cannot compute {layer.label} (input "
            f"{layer.in_shapes[0]}, output {layer.out_shape}): {reason}. Choose another "
            "algorithm for this layer, or 'auto' / 'default'"
        )
    return algorithm


@dataclasses.dataclass
class _Plan:
    """What to do with each equation of one traced function, keyed by `id(eqn)`."""

    swaps: dict[int, Algorithm]
    dropped: set[int]
    producers: dict
    parts: dict[int, Part] = dataclasses.field(default_factory=dict)  # convs writing into a concatenation
    assemblies: dict[int, Assembly] = dataclasses.field(default_factory=dict)  # concatenations in a buffer
    prefix_readers: set[int] = dataclasses.field(default_factory=set)  # convs reading a buffer's first channels
    pooled: dict = dataclasses.field(default_factory=dict)  # id(conv eqn) -> the max pool it computes
    prologues: dict[int, Prologue] = dataclasses.field(default_factory=dict)  # id(conv eqn) -> its chain
    pools_first: dict = dataclasses.field(default_factory=dict)  # id(conv eqn) -> the sum pool run before it
    blocked: Blocked = Blocked(frozenset(), frozenset())  # convs writing / reading NCHWc
    expansions: dict = dataclasses.field(default_factory=dict)  # id(depthwise conv eqn) -> the 1x1 conv it runs
    sources: dict = dataclasses.field(default_factory=dict)  # id(matmul eqn) -> its operands' StridedSource or None
    merges: dict = dataclasses.field(default_factory=dict)  # id(matmul eqn) -> the head merge's steps
    crops: dict = dataclasses.field(default_factory=dict)  # id(conv eqn) -> it reading its slice's input
    gathers: dict = dataclasses.field(default_factory=dict)  # id(layout eqn) -> {output index: PlaneGather}


def _find_layers(graph: Graph, kinds_wanted):
    """Every layer of a wanted kind in program order, the count per kind, the avg pools."""
    avg_pools = kinds.find_avg_pools(graph)
    counts: dict[str, int] = {}
    found = []
    for op in graph.all_ops():
        eqn, layer = op.eqn, op.layer()
        if id(eqn) in avg_pools:
            layer = kinds.global_pool_layer(eqn) if layer is None else dataclasses.replace(layer, kind="avgpool2d")
        if layer is None or layer.kind not in kinds_wanted:
            continue
        index = counts.get(layer.kind, 0)
        counts[layer.kind] = index + 1
        found.append((eqn, dataclasses.replace(layer, index=index)))
    return found, counts, avg_pools


def _plan(closed: jcore.ClosedJaxpr, selectors: dict[str, Selector]) -> _Plan:
    graph = Graph.of(closed)
    found, counts, avg_pools = _find_layers(graph, selectors)
    _check_lengths(selectors, counts)
    plan = _Plan({}, set(), graph.producers())
    ops = {id(op.eqn): op for op in graph.all_ops()}
    consts = dict(zip(closed.jaxpr.constvars, closed.consts))
    for eqn, layer in found:
        known = [v.val if isinstance(v, jcore.Literal) else consts.get(v) for v in eqn.invars]
        algorithm = _resolve(_select(selectors[layer.kind], layer), eqn, layer, plan.producers, known)
        if algorithm is not None:
            plan.swaps[id(eqn)] = algorithm
            if layer.kind == "avgpool2d":
                plan.dropped.add(avg_pools[id(eqn)])
            if layer.kind == "matmul" and any(sources := kinds.matmul_sources(eqn, algorithm.name, plan.producers)):
                plan.sources[id(eqn)] = sources
            if layer.kind == "matmul" and (steps := kinds.head_merge(ops[id(eqn)], algorithm.name)):
                plan.merges[id(eqn)] = steps

    def writes_into(eqn) -> bool:
        algorithm = plan.swaps.get(id(eqn))
        return algorithm is not None and algorithm.kind == "conv2d" and kinds.writes_into(eqn, algorithm.name)

    def pools(conv, pool) -> bool:
        algorithm = plan.swaps.get(id(conv))
        return (algorithm is not None and algorithm.kind == "conv2d" and id(pool) in plan.swaps
                and kinds.pools(conv, pool, algorithm.name))

    def swapped_conv(eqn) -> bool:
        algorithm = plan.swaps.get(id(eqn))
        return algorithm is not None and algorithm.kind == "conv2d"

    plan.pools_first = find_pools_first(graph, avg_pools,
                                        lambda conv: swapped_conv(conv) and kinds.linear_pointwise(conv))
    for pool in plan.pools_first.values():
        plan.dropped |= {id(pool), avg_pools[id(pool)]}

    def takes_prologue(conv) -> bool:  # (an input pooled first: the pool's kernel applies it)
        if not swapped_conv(conv):
            return False
        if id(conv) in plan.pools_first:
            return id(plan.pools_first[id(conv)]) in plan.swaps and kinds.pool_takes_prologue(plan.pools_first[id(conv)])
        return kinds.takes_prologue(conv, plan.swaps[id(conv)].name)

    plan.prologues = find_prologues(graph, takes_prologue)
    chain_convs = {step: op for op in graph.ops if id(op.eqn) in plan.prologues
                   for step in plan.prologues[id(op.eqn)].ops}

    def prefix_reader(op, value):
        conv, data = chain_convs.get(id(op.eqn)), 0
        if conv is not None:  # a prologue's step passes its data operand on to the conv
            data = 1 - plan.prologues[id(conv.eqn)].ops[id(op.eqn)][1]
        conv = conv or op
        reads = (op.ins[data] is value and swapped_conv(conv.eqn) and id(conv.eqn) not in plan.pools_first
                 and kinds.reads_prefix(conv.eqn, plan.swaps[id(conv.eqn)].name))
        return conv.eqn if reads else None

    plan.parts, plan.assemblies, plan.prefix_readers = find_parts(graph, writes_into, prefix_reader)
    plan.pooled = find_pooled_convs(graph, pools)
    plan.dropped |= {id(pool) for pool in plan.pooled.values()}

    fused = {*plan.parts, *plan.pooled, *plan.prologues, *plan.prefix_readers, *plan.pools_first}

    def expands(expansion, conv) -> bool:
        return (swapped_conv(expansion) and swapped_conv(conv) and not {id(expansion), id(conv)} & fused
                and kinds.expands(expansion, conv, plan.swaps[id(conv)].name))

    plan.expansions = find_expansions(graph, expands)
    expanded = {id(expansion) for expansion in plan.expansions.values()}

    def blocks(side: str):  # (a conv running its expansion reads the expansion's NCHW x; a prologue packs x)
        unblocked = fused | expanded if side == "x" else (fused - set(plan.prologues)) | expanded
        return lambda conv: (swapped_conv(conv) and id(conv) not in unblocked
                             and not (side == "x" and id(conv) in plan.expansions)
                             and kinds.blocks(conv, plan.swaps[id(conv)].name, side))

    plan.blocked = find_blocked(graph, blocks("y"), blocks("x"), kinds.blocking_pays)
    plain = fused | expanded | set(plan.expansions) | plan.blocked.readers
    for eqn, _ in found:
        if swapped_conv(eqn) and id(eqn) not in plain and (
                cropped := kinds.cropped_read(eqn, plan.swaps[id(eqn)].name, plan.producers)):
            plan.crops[id(eqn)] = cropped
    reads_otherwise = set(plan.crops) | plan.prefix_readers | set(plan.pools_first)
    for eqn, _ in found:
        if swapped_conv(eqn) and id(eqn) not in reads_otherwise and eqn.invars[0].aval.dtype == np.float32 and (
                gather := plane_gather(plan.producers, x := eqn.invars[0])) is not None:
            plan.gathers.setdefault(id(plan.producers[x]), {})[plan.producers[x].outvars.index(x)] = gather
    return plan


def _rules(plan: _Plan) -> dict:
    buffers = {}  # id(last concatenate eqn) -> the buffer its parts have written so far
    filled = {}  # id(last concatenate eqn) -> the channels its concatenations have assembled so far
    chain = {op: (conv, *step) for conv, p in plan.prologues.items() for op, step in p.ops.items()}
    operands = {}  # id(conv eqn) -> {role: per-channel operand} of its prologue, as the chain runs
    expanding = {id(e): conv for conv, e in plan.expansions.items()}  # id(1x1 conv eqn) -> id(its depthwise conv)
    expansion_operands = {}  # id(depthwise conv eqn) -> its expansion's operands
    read_through = {id(step): step for sources in plan.sources.values() for source in sources if source
                    for step in source.steps}
    values = {}  # jaxpr variable -> its value, for the steps a matmul reads through
    merging = {id(step) for steps in plan.merges.values() for step in steps}
    gathering = {id(step): step for gathers in plan.gathers.values() for gather in gathers.values()
                 for step in gather.steps}

    def swap(eqn, *invals):
        if id(eqn) in read_through or id(eqn) in gathering or eqn.primitive.name == "slice":
            values.update((var, x) for var, x in zip(eqn.invars, invals) if isinstance(var, jcore.Var))
        if id(eqn) in plan.gathers:  # whole planes of a base, copied by a kernel (XLA drops unread steps)
            outs = bind(eqn, *invals) if eqn.primitive.multiple_results else [None]
            for index, gather in plan.gathers[id(eqn)].items():
                outs[index] = gather_planes(values[gather.base], gather.planes)
            return outs if eqn.primitive.multiple_results else outs[0]
        if id(eqn) in merging:
            return jnp.reshape(invals[0], eqn.outvars[0].aval.shape)
        if id(eqn) in plan.dropped:
            return invals[0]
        if id(eqn) in expanding:  # run by its depthwise conv, to which it passes its x on
            expansion_operands[expanding[id(eqn)]] = invals
            return invals[0]
        if id(eqn) in chain:  # a prologue's step: pass its data operand on, keep its constant
            conv, role, pos = chain[id(eqn)]
            operands.setdefault(conv, {})[role] = invals[pos]
            return invals[1 - pos]
        if id(eqn) in plan.assemblies:
            return _assemble(eqn, invals, plan.assemblies[id(eqn)], buffers, filled, plan)
        if id(eqn) not in plan.swaps:
            out = bind(eqn, *invals)
            return out if eqn.primitive.multiple_results else out[0]
        if id(eqn) in plan.expansions:  # (no other fusion takes it: see _plan's `expands`)
            layout = {"y_layout": "NCHWc"} if id(eqn) in plan.blocked.writers else {}
            return kinds.run_expanded(eqn, plan.expansions[id(eqn)], expansion_operands.pop(id(eqn)), *invals,
                                      **layout)
        run = plan.swaps[id(eqn)].run
        prologue = _prologue(eqn, plan.prologues[id(eqn)], operands.pop(id(eqn))) if id(eqn) in plan.prologues else None
        if id(eqn) in plan.pools_first:  # the pool's sum and division, dropped, pass this output on
            pooled = _average(plan, plan.pools_first[id(eqn)], invals[0], prologue)
            return run(eqn, pooled, *invals[1:], producers=plan.producers)
        if prologue is not None:
            run = functools.partial(run, prologue=prologue)
        if id(eqn) in plan.prefix_readers:
            run = functools.partial(run, reads_prefix=True)
        if id(eqn) in plan.blocked.readers:
            run = functools.partial(run, x_layout="NCHWc")
        if id(eqn) in plan.blocked.writers:
            run = functools.partial(run, y_layout="NCHWc")
        if id(eqn) in plan.sources:
            run = functools.partial(run, reads=tuple(_read(source, values) for source in plan.sources[id(eqn)]))
        if id(eqn) in plan.merges:  # stored merged: its steps pass it on, the last one reshaped
            run = functools.partial(run, batch_inner=True)
        if id(eqn) in plan.crops:  # reads the slice's input (XLA drops the slice if nothing else reads it)
            cropped = plan.crops[id(eqn)]
            return run(cropped, values[cropped.invars[0]], *invals[1:], producers=plan.producers)
        if id(eqn) in plan.pooled:  # the pool's equation, dropped, passes this output on
            return run(eqn, *invals, producers=plan.producers, max_pool=plan.pooled[id(eqn)])
        if id(eqn) not in plan.parts:
            return run(eqn, *invals, producers=plan.producers)
        part = plan.parts[id(eqn)]
        into = (buffers.get(part.concat, part.channels), part.channel0)
        whole = buffers[part.concat] = run(eqn, *invals, producers=plan.producers, into=into)
        # Its own channels, for the record: only the concatenation reads the
        # part, and it returns the buffer, so XLA drops this slice.
        return lax.slice_in_dim(whole, part.channel0, part.channel0 + eqn.outvars[0].aval.shape[1], axis=1)

    steps = ("sub", "mul", "add", "max") if chain else ()
    viewed = {step.primitive.name for step in (*read_through.values(), *gathering.values())} | {
        step.primitive.name for steps in plan.merges.values() for step in steps} | ({"slice"} if plan.crops else set())
    return {name: swap for name in (*kinds.PRIMITIVES, *(("concatenate",) if plan.assemblies else ()), *steps, *viewed)}


def _read(source, values: dict):
    """`(buffer, view, scales)` of a matmul operand read through layout ops, or None."""
    if source is None:
        return None
    scales = tuple(values[s] if isinstance(s, jcore.Var) else s.val for s in source.scales)
    return values[source.base], source.view, scales


def _average(plan: _Plan, pool, x, prologue=None):
    """The average pool whose sum is the equation `pool`, of `x`: by the pool's
    own algorithm (its kernel, if swapped, which applies a conv's `prologue`)."""
    if id(pool) in plan.swaps:
        return plan.swaps[id(pool)].run(pool, x, producers=plan.producers,
                                        **({} if prologue is None else {"prologue": prologue}))
    return bind(pool, x)[0] / math.prod(pool.params["window_dimensions"])


def _prologue(eqn, prologue: Prologue, operands: dict) -> tuple:
    """`(shift, scale, bias, activation)` of `kernels.conv2d(prologue=)`, each
    `(C,)`, from the chain's per-channel operands: None for a missing step or
    a known identity, one float for a known value equal on every channel (XLA
    would store C equal floats as a broadcast that runs at every call)."""
    channels = eqn.invars[0].aval.shape[1]

    def per_channel(role: str, identity: float):
        value = on_host(operands.get(role, np.float32(identity)))
        if not isinstance(value, np.ndarray | np.generic):
            return jnp.broadcast_to(jnp.asarray(value, np.float32), (1, channels, 1, 1)).reshape(channels)
        value = np.asarray(value, np.float32).reshape(-1)
        if np.all(value == value[0]):
            return None if value[0] == identity else value[:1]
        return np.broadcast_to(value.reshape(1, -1, 1, 1), (1, channels, 1, 1)).reshape(channels)

    return per_channel("sub", 0.0), per_channel("mul", 1.0), per_channel("add", 0.0), prologue.activation


def _assemble(eqn, invals, assembly: Assembly, buffers: dict, filled: dict, plan: _Plan):
    """The concatenation's value from its buffer, once the parts that are not
    written in place, and not copied in by an earlier concatenation of its
    chain, are copied in: the buffer itself (`assembly.whole`), or its first
    channels."""
    whole = buffers.get(assembly.buffer)
    if whole is None:  # no part has been written in place yet
        shape = eqn.outvars[0].aval.shape
        whole = jnp.zeros((1, plan.assemblies[assembly.buffer].channels, *shape[2:]), eqn.outvars[0].aval.dtype)
    channel0 = 0
    for var, value in zip(eqn.invars, invals):
        if channel0 >= filled.get(assembly.buffer, 0) and id(plan.producers.get(var)) not in plan.parts:
            whole = lax.dynamic_update_slice_in_dim(whole, value, channel0, axis=1)
        channel0 += value.shape[1]
    filled[assembly.buffer] = channel0
    if assembly.buffer == id(eqn):  # the chain's last: the buffer is complete
        buffers.pop(assembly.buffer, None)
        del filled[assembly.buffer]
        return whole
    buffers[assembly.buffer] = whole
    return whole if assembly.whole else lax.slice_in_dim(whole, 0, assembly.channels, axis=1)


# ------------------------------------------------------------------ fn -> fn


def swap_backend(
    fn: Callable | None = None,
    /,
    *positional,
    algorithms: Mapping[str, Selector] | str = "auto",
    **unknown,
) -> Callable:
    """Run the layers of `fn` with the algorithms `algorithms` selects.

    **Arguments:**

    - `fn`: the function to transform. Omit it to use `swap_backend` as a
        decorator, `@swap_backend(algorithms=...)`.
    - `algorithms` (keyword-only): `{layer kind: selector}` for the kinds
        `layer_kinds()` lists (`"conv2d"`, `"dense"`, `"matmul"`,
        `"maxpool2d"`, `"avgpool2d"`, `"resize"`, `"softmax"`, `"layer_norm"`);
        kinds left out keep XLA.
        `"dense"` is a product with a 2-D weight contracted against the last
        axis of x (any leading axes are rows); `"matmul"` is every other
        `dot_general`, such as attention's batched `Q @ K^T` and `P @ V`;
        `"resize"` is jtile's fused interpolation (an imported ONNX Resize)
        over the last two axes; `"softmax"` and `"layer_norm"` are jtile's
        fused row normalisations (an imported ONNX Softmax or
        LayerNormalization), which the kernels run over trailing axes. A single name (`"auto"`,
        `"default"`) applies to every kind; the default is `"auto"`.

    **Returns:** a function with `fn`'s signature and outputs.

    **Raises:** `ConfigError` for an unknown kind or algorithm name, a list of
    the wrong length, or configuration given positionally; `UnsupportedError`
    when a layer is explicitly given an algorithm that cannot compute it
    (non-float32 dtypes included). `"auto"` never raises for a layer: it keeps
    XLA, and warns once (`jtile.KernelsUnavailableWarning`) if the kernels are
    not built.
    """
    reject_positional("swap_backend", fn, positional, "algorithms='auto'")
    reject_unknown("swap_backend", unknown, ("algorithms",))
    selectors = _check_selectors(algorithms)
    if fn is None:
        return lambda f: swap_backend(f, algorithms=selectors)
    plans: dict[int, tuple[jcore.ClosedJaxpr, _Plan]] = {}

    def make_rules(closed: jcore.ClosedJaxpr) -> dict:
        if id(closed) not in plans or plans[id(closed)][0] is not closed:
            plans[id(closed)] = (closed, _plan(closed, selectors))
        return _rules(plans[id(closed)][1])

    return transform(fn, "swap_backend", make_rules)


def swap_conv2d(fn: Callable | None = None, /, *positional, selector: Selector | None = None,
                **unknown) -> Callable:
    """`swap_backend(fn, algorithms={"conv2d": selector})`; as a decorator,
    `@swap_conv2d(selector=...)`."""
    reject_positional("swap_conv2d", fn, positional, "selector='direct'")
    reject_unknown("swap_conv2d", unknown, ("selector",))
    if selector is None:
        raise ConfigError("swap_conv2d: selector= is required, e.g. swap_conv2d(fn, selector='winograd')")
    return swap_backend(fn, algorithms={"conv2d": selector})


__all__ = ["Algorithm", "Selector", "algorithm_names", "layer_kinds", "register_algorithm",
           "register_auto", "swap_backend", "swap_conv2d"]
