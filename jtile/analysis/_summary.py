"""`summary`: what a model costs, as torchinfo and ptflops report it.

One read-only walk of the jaxpr (no forward pass): a table with one row per
`jax.named_scope` layer (ops, output shape, parameters, MACs) and totals
(parameters, trainable parameters, weight bytes, MACs per category,
activation memory, bandwidth). Works on any function jtile can trace: zoo
models, ONNX imports, nested `jax.jit`, and the output of jtile transforms,
whose extra work (tile halos, recompute) shows up in the MACs next to the
untransformed count.

!!! warning

    Totals are computed on the finest layers whatever `depth` is, so they do
    not change with the table. Bandwidth counts the layers that compute on
    the inputs (weights read included); layers that only reshape weights are
    left out, as XLA folds them into constants. Activation memory is the sum of every layer's
    output bytes (what torchinfo calls the forward pass size); `peak_bytes` is
    the most bytes alive at once in program order (`jtile.Graph.peak_bytes`,
    control-flow bodies included, so a `tile_spatial` loop counts one tile's
    intermediates), not XLA's own buffer assignment (`memory_analysis()`).
"""

import dataclasses
import json
from collections import Counter
from collections.abc import Callable

import jax
import numpy as np

from .._errors import require_positive_int
from .._layers import Layer
from .._graph import Graph, LayerGroup, bits, trace_graph
from .._macs import CATEGORIES
from ..gemm import tiles_per_layer


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One row of a `Summary`."""

    name: str
    kind: str
    type: str
    ops: tuple[str, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    params: int
    trainable_params: int
    macs: int
    macs_by_category: dict[str, int]
    input_bytes: int
    output_bytes: int
    layer: Layer


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One parameter leaf: where it lives in the arguments and which layer reads it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    layer: str | None


@dataclasses.dataclass(frozen=True)
class Summary:
    """The cost of one call of a function; `str()` gives the torchinfo-style table."""

    layers: tuple[LayerCost, ...]
    parameters: tuple[Parameter, ...]
    total_params: int
    trainable_params: int
    weight_bytes: int
    input_bytes: int
    macs_by_category: dict[str, int]
    activation_bytes: int
    peak_bytes: int
    peak_bandwidth_bytes: int
    peak_bandwidth_layer: str
    bandwidth_bytes: int
    uncounted: tuple[str, ...]
    untransformed_macs: int | None = None
    gemm_tiles: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def non_trainable_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def macs(self) -> int:
        return sum(self.macs_by_category.values())

    @property
    def macs_ratio(self) -> float | None:
        """MACs over those of the untransformed function, for a jtile transform."""
        if not self.untransformed_macs:
            return None
        return self.macs / self.untransformed_macs

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for row in out["layers"]:
            row["layer"] = {k: _plain(v) for k, v in row["layer"].items()}
        out.update(non_trainable_params=self.non_trainable_params, macs=self.macs,
                   macs_ratio=self.macs_ratio)
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def table(self) -> str:
        return _render(self)

    def __str__(self) -> str:
        return self.table()


def _plain(v):
    return str(v) if isinstance(v, np.dtype) else v


def _popcount_size(mask: int, graph: Graph) -> int:
    return sum(graph.leaves[i].size for i in bits(mask))


def _cost(row: LayerGroup, index: int, graph: Graph, types: dict[str, str]) -> LayerCost:
    owned = row.params
    return LayerCost(
        name=row.name,
        kind=row.category,
        type=types.get(row.name, ",".join(row.op_names)),
        ops=tuple(row.op_names),
        output_shapes=tuple(tuple(v.aval.shape) for v in row.outputs),
        params=_popcount_size(owned, graph),
        trainable_params=_popcount_size(owned & graph.trainable, graph),
        macs=sum(row.macs.values()),
        macs_by_category=dict(row.macs),
        input_bytes=row.input_bytes,
        output_bytes=row.output_bytes,
        layer=row.layer(index),
    )


def _parameters(graph: Graph, rows: list[LayerGroup]) -> tuple[Parameter, ...]:
    owner = {i: row.name for row in rows for i in bits(row.params)}
    return tuple(
        Parameter(leaf.path, leaf.shape, str(leaf.dtype), bool(graph.trainable >> i & 1),
                  owner.get(i))
        for i, leaf in enumerate(graph.leaves)
        if leaf.is_param
    )


def layer_types(fn) -> dict[str, str]:
    """`{layer name: its type}` where the model says it: an ONNX node's op type,
    a zoo module's class (`Conv2d`, `BatchNorm2d`, `ReLU`). Other layers show
    their primitives."""
    import equinox as eqx

    from ..onnx import OnnxModel

    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    fn = getattr(fn, "__self__", fn)
    if isinstance(fn, OnnxModel):
        nodes = fn.proto.graph.node  # unnamed nodes are scoped as the importer names them
        return {node.name or f"{node.op_type}_{i}": node.op_type for i, node in enumerate(nodes)}
    named = lambda x: isinstance(x, eqx.Module) and isinstance(getattr(x, "name", None), str)  # noqa: E731
    types = {}

    def visit(tree):
        for m in jax.tree.leaves(tree, is_leaf=lambda x: named(x) and x is not tree):
            if named(m):
                types.setdefault(m.name, type(m).__name__)
                visit(m)

    visit(fn)
    return types


def _untransformed(fn: Callable) -> Callable | None:
    """The function a stack of jtile transforms wraps, or None if `fn` is not one."""
    if not hasattr(fn, "__jtile_cache__"):
        return None
    while hasattr(fn, "__jtile_cache__"):
        fn = fn.__wrapped__
    return fn


def summary(fn: Callable, *args, depth: int | None = None, params=None, **kwargs) -> Summary:
    """The parameters, MACs, memory and bandwidth of `fn(*args, **kwargs)`.

    Arguments may be arrays or `jax.ShapeDtypeStruct`s (from `jax.eval_shape`);
    nothing is computed. A function closing over its weights (a jtile transform
    of a module, say) needs them as arrays, since its closure is called.
    `depth` cuts layer names to that many scope components, as torchinfo's
    depth does. Which leaves count as parameters is decided by `jtile.Graph`
    (the calling convention, corrected by the dataflow: a conv weight is a
    parameter whatever its argument position; constants a lowering made are
    not parameters); `params=` overrides it with a predicate on a leaf's path
    (`"args[1]['w']"`) or a collection of paths.
    """
    if depth is not None:
        require_positive_int("jtile.summary", "depth", depth)
    graph = trace_graph("jtile.summary", fn, args, kwargs, params=params)
    leaf_rows = graph.layers()
    rows = leaf_rows if depth is None else graph.layers(depth)
    macs = sum((r.macs for r in leaf_rows), Counter())
    computing = [r for r in leaf_rows if any(v.data for v in r.outputs)]
    traffic = [(r.input_bytes + r.output_bytes, r.name) for r in computing] or [(0, "")]
    base = _untransformed(fn)
    return Summary(
        layers=tuple(_cost(r, i, graph, layer_types(fn)) for i, r in enumerate(rows)),
        parameters=_parameters(graph, leaf_rows),
        total_params=sum(leaf.size for leaf in graph.leaves if leaf.is_param),
        trainable_params=_popcount_size(graph.trainable, graph),
        weight_bytes=sum(leaf.nbytes for leaf in graph.leaves if leaf.is_param),
        input_bytes=sum(v.nbytes for v in graph.inputs if v.role == "input" and v.consumers),
        macs_by_category={k: macs.get(k, 0) for k in CATEGORIES},
        activation_bytes=sum(v.nbytes for r in computing for v in r.outputs if v.data),
        peak_bytes=graph.peak_bytes(),
        peak_bandwidth_bytes=max(traffic)[0],
        peak_bandwidth_layer=max(traffic)[1],
        bandwidth_bytes=sum(t for t, _ in traffic),
        uncounted=tuple(sorted({p for op in graph.ops for p in op.uncounted})),
        untransformed_macs=None if base is None else _total_macs(base, args, kwargs),
        gemm_tiles=tiles_per_layer(graph),
    )


def _total_macs(fn: Callable, args: tuple, kwargs: dict) -> int:
    graph = trace_graph("jtile.summary", fn, args, kwargs)
    return sum(sum(r.macs.values()) for r in graph.layers())


# ---------------------------------------------------------------- rendering


def _si(n: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def _shape(shapes: tuple[tuple[int, ...], ...]) -> str:
    if not shapes:
        return "--"
    text = str(list(shapes[0]))
    return text if len(shapes) == 1 else f"{text} +{len(shapes) - 1}"


def _fit(text: str, width: int, keep_end: bool = False) -> str:
    if len(text) <= width:
        return text
    return "…" + text[-(width - 1):] if keep_end else text[: width - 1] + "…"


def _render(s: Summary) -> str:
    name_w = min(max([len(r.name) for r in s.layers] + [5]), 56)
    head = f"{'Layer':<{name_w}}  {'Type':<22}  {'Output shape':<22}  {'Params':>12}  {'MACs':>16}"
    rule = "=" * len(head)
    lines = [rule, head, rule]
    for r in s.layers:
        params = f"{r.params:,}" if r.params else "--"
        lines.append(
            f"{_fit(r.name, name_w, keep_end=True):<{name_w}}  {_fit(r.type, 22):<22}  "
            f"{_fit(_shape(r.output_shapes), 22):<22}  {params:>12}  {r.macs:>16,}"
        )
    by_cat = ", ".join(f"{k} {_si(v)}" for k, v in s.macs_by_category.items() if v)
    ratio = "" if s.macs_ratio is None else (
        f" ({s.macs_ratio:.3f}x the untransformed {_si(s.untransformed_macs, 'MACs')})"
    )
    lines += [
        rule,
        f"Total params: {s.total_params:,}",
        f"Trainable params: {s.trainable_params:,}",
        f"Non-trainable params: {s.non_trainable_params:,}",
        f"Total MACs: {_si(s.macs, 'MACs')}{ratio}",
        f"MACs by category: {by_cat or '--'}",
        rule,
        f"Input size (MB): {_mb(s.input_bytes)}",
        f"Params size (MB): {_mb(s.weight_bytes)}",
        f"Activation memory, sum of outputs (MB): {_mb(s.activation_bytes)}",
        f"Peak live activations, program order (MB): {_mb(s.peak_bytes)}",
        f"Total activation bandwidth (MB): {_mb(s.bandwidth_bytes)}",
        f"Peak layer bandwidth (MB): {_mb(s.peak_bandwidth_bytes)} ({s.peak_bandwidth_layer})",
    ]
    if s.gemm_tiles:
        tiles = ", ".join(f"{layer or '<top level>'} {n}" for layer, n in s.gemm_tiles.items())
        lines.append(f"GEMM tiles per layer (split_gemm): {tiles}")
    if s.uncounted:
        lines.append(f"Not counted (no MAC rule): {', '.join(s.uncounted)}")
    lines.append(rule)
    return "\n".join(lines)
