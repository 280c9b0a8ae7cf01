"""Spatial partitioning of a conv net's activations over a device mesh.

`shard_spatial` puts a sharding constraint (`NamedSharding`) on every
activation of the network's spatial block: the inputs and outputs of its
convolutions and pools, and of the elementwise ops between them (batch norm,
activations, residual adds, channel concatenation), each split along one
spatial axis over one mesh axis (and optionally along the batch over
another). XLA's SPMD partitioner then runs each layer on stripes and swaps
the border rows (halos) neighbours need with `collective-permute`.

Where XLA's partitioner would all-gather a layer's input instead, jtile does
the exchange itself: a `shard_map` per layer receives its stripe, gets the
rows it needs from its neighbours with `lax.ppermute` (sizes from
`jtile._regions.stripe_halo`), pads at the global border only, and runs the
layer. Which layers need it is decided by asking XLA: the block's layers are
compiled alone with their shardings and the HLO inspected (`collectives`).
`halo="ppermute"` takes jtile's exchange everywhere: a conv or sum pool on
evenly split stripes then runs on the stripe itself and adds the halo rows'
contribution to its border rows, so no haloed copy of the stripe is made
(XLA's partitioner makes one per layer).

The block ends where the spatial axis does: a global pool reduces each stripe
and XLA adds the partial results (an all-reduce); a reduction over the axis or
a flattening reshape reads the sharded activation and XLA combines it there.

!!! warning

    Any other op that reads a sharded activation (a transpose, a slice or pad
    along the sharded axis, a transposed convolution, a resize) stops with
    `UnsupportedError` naming it: nothing falls back to replication silently.
    Ops inside `cond`/`scan`/`while` bodies are left unsharded.
"""

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _regions
from ._errors import ConfigError, UnsupportedError, reject_unknown
from ._graph import Graph
from ._interpreter import bind, transform
from ._registry import facet, register

_AXIS_NAMES = {"W": -1, "H": -2, "D": -3}
_HALOS = ("auto", "ppermute", "xla")

# ---------------------------------------------------------------- collectives in HLO

_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<kind>all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter|collective-broadcast)"
    r"(?P<start>-start)?\(",
    re.M,
)
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its HLO kind, result shape(s) and bytes per device."""

    kind: str
    name: str
    shapes: tuple[tuple[int, ...], ...]
    bytes: int
    op_name: str


def _array_bytes(dtype: str, dims: str) -> tuple[tuple[int, ...], int]:
    shape = tuple(int(d) for d in dims.split(",") if d)
    bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
    return shape, int(np.prod(shape, dtype=np.int64)) * max(bits // 8, 1)


def collectives(compiled) -> list[Collective]:
    """The collectives in a compiled program (`jax.jit(f).lower(...).compile()`) or its HLO text.

    `bytes` is the size of the buffer each device receives: for `collective-permute`
    the rows sent to a neighbour, for `all-gather` the whole gathered array.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    found = []
    for m in _COLLECTIVE.finditer(text):
        arrays = [_array_bytes(*a) for a in _ARRAY.findall(m["type"])]
        if m["start"]:  # async: (operand, result, contexts...)
            arrays = arrays[1:2]
        line = text[m.start() : text.find("\n", m.end())]
        op_name = _OP_NAME.search(line)
        found.append(
            Collective(
                kind=m["kind"],
                name=m["name"],
                shapes=tuple(s for s, _ in arrays),
                bytes=sum(b for _, b in arrays),
                op_name=op_name[1] if op_name else "",
            )
        )
    return found


# ---------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class _Config:
    mesh: Mesh
    axis: str
    mesh_axis: str
    batch_axis: str | None
    halo: str

    @property
    def devices(self) -> int:
        return self.mesh.shape[self.mesh_axis]


def _auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with every axis `Auto`, so that sharding constraints may name it."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _config(mesh, axis, mesh_axis, batch_axis, halo) -> _Config:
    where = "shard_spatial"
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"{where}: mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), ('x',))), got {mesh!r}")
    if axis not in _AXIS_NAMES:
        raise ConfigError(f"{where}: axis must be one of {', '.join(_AXIS_NAMES)}, got {axis!r}")
    if halo not in _HALOS:
        raise ConfigError(f"{where}: halo must be one of {', '.join(_HALOS)}, got {halo!r}")
    names = tuple(mesh.axis_names)
    for label, name in (("mesh_axis", mesh_axis), ("batch_axis", batch_axis)):
        if name is not None and name not in names:
            raise ConfigError(f"{where}: {label} {name!r} is not an axis of the mesh; its axes are {names}")
    if mesh_axis is None:
        free = [n for n in names if n != batch_axis]
        if len(free) != 1:
            raise ConfigError(f"{where}: the mesh has axes {names}; say which one splits {axis} with mesh_axis=")
        mesh_axis = free[0]
    if mesh_axis == batch_axis:
        raise ConfigError(f"{where}: mesh_axis and batch_axis are both {mesh_axis!r}; use two different mesh axes")
    return _Config(_auto_mesh(mesh), axis, mesh_axis, batch_axis, halo)


# ---------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Which dims of a value are sharded: the spatial one, and the batch one (or None)."""

    spatial: int
    batch: int | None

    def spec(self, rank: int, config: _Config) -> P:
        dims = [None] * rank
        dims[self.spatial] = config.mesh_axis
        if config.batch_axis is not None and self.batch is not None:
            dims[self.batch] = config.batch_axis
        return P(*dims)


def _op_label(op) -> str:
    scope = f" in '{op.scope}'" if op.scope else ""
    return f"{op.primitive} (op #{op.index}{scope})"


@dataclasses.dataclass(frozen=True)
class _Window:
    """How shard_spatial partitions one sliding-window primitive."""

    layouts: Callable  # (eqn, axis name, input layout or None) -> (in, out) _Layout
    sliding: Callable  # (eqn, in layout) -> SlidingWindow along the sharded axis
    padding: Callable  # (params, in layout, (lo, hi)) -> params with that padding on the sharded axis
    fill: Callable  # (eqn) -> the value border padding holds
    check: Callable  # (eqn, in layout) -> a reason it cannot be partitioned, or None
    reduce: Callable | None = None  # (x, axis) -> x reduced over axis (kept as size 1), for global pooling
    linear: bool = False  # linear in its first operand, border padding zero


def _conv_layouts(eqn, axis, _):
    lhs_spec, _, out_spec = eqn.params["dimension_numbers"]
    spatial = len(lhs_spec) - 2 + _AXIS_NAMES[axis]
    if spatial < 0:
        return None
    return _Layout(lhs_spec[2 + spatial], lhs_spec[0]), _Layout(out_spec[2 + spatial], out_spec[0])


def _conv_spatial(eqn, layout) -> int:
    return eqn.params["dimension_numbers"][0][2:].index(layout.spatial)


def _conv_padding(params, layout, pad, eqn):
    padding = list(params["padding"])
    padding[_conv_spatial(eqn, layout)] = pad
    return {**params, "padding": tuple(padding)}


def _conv_check(eqn, layout):
    p = eqn.params
    if p["lhs_dilation"][_conv_spatial(eqn, layout)] != 1:
        return f"it has lhs_dilation {p['lhs_dilation']} (a transposed convolution)"
    if p["batch_group_count"] != 1 and layout.batch is not None:
        return f"it has batch_group_count {p['batch_group_count']} and the batch is sharded"
    return None


def _pool_layouts(eqn, axis, known):
    """A pool follows its input's layout; one that reads the function's input
    pools its spatial axes (NCHW or NHWC) with the batch first."""
    axes = _regions.pool_axes(eqn)
    if known is None and axes is not None:
        known = _Layout(axes[len(axes) + _AXIS_NAMES[axis]], 0) if len(axes) + _AXIS_NAMES[axis] >= 0 else None
    return known and (known, known)


def _pool_padding(params, layout, pad, eqn):
    padding = list(params["padding"])
    padding[layout.spatial] = pad
    return {**params, "padding": tuple(padding)}


def _pool_check(eqn, layout):
    p = eqn.params
    if p["base_dilation"][layout.spatial] != 1:
        return f"it has base_dilation {p['base_dilation']}"
    if layout.batch is not None and (p["window_dimensions"][layout.batch] != 1 or p["window_strides"][layout.batch] != 1):
        return "its window spans the sharded batch dim"
    return None


def _extreme(sign: int):
    def fill(eqn):
        dtype = np.dtype(eqn.invars[0].aval.dtype)
        info = np.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype)
        return sign * np.inf if jnp.issubdtype(dtype, jnp.floating) else (info.max if sign > 0 else info.min)

    return fill


register("conv_general_dilated", stripes=_Window(
    _conv_layouts, lambda eqn, lay: facet(eqn, "geometry")(eqn).axis(_conv_spatial(eqn, lay)), _conv_padding,
    lambda eqn: 0, _conv_check, linear=True,
))
for _name, _fill, _reduce in (
    ("reduce_window_sum", lambda eqn: 0, jnp.sum),
    ("reduce_window_max", _extreme(-1), jnp.max),
    ("reduce_window_min", _extreme(+1), jnp.min),
):
    register(_name, stripes=_Window(
        _pool_layouts, lambda eqn, lay: _regions.reduce_window_axis(eqn, lay.spatial), _pool_padding,
        _fill, _pool_check, functools.partial(_reduce, keepdims=True), linear=_name == "reduce_window_sum",
    ))


def _is_elementwise(op) -> bool:
    return facet(op.eqn, "region") is _regions.elementwise


def _same_layout_values(op, layouts) -> list:
    """The data values of a layout-keeping op that share one layout: operands shaped
    like the output (or, for a concatenation, of its rank) and the output."""
    out = op.outs[0]
    if op.primitive == "concatenate":
        dim = op.eqn.params["dimension"]
        known = [layouts[v] for v in op.ins if v in layouts]
        if any(lay.spatial == dim or lay.batch == dim for lay in known):
            return []
        return [v for v in op.ins if v.is_data and len(v.shape) == len(out.shape)] + [out]
    if op.primitive == "slice":  # a slice that keeps every sharded dim whole
        p, (lay,) = op.eqn.params, [layouts[v] for v in op.ins if v in layouts] or [None]
        kept = lay and all(
            p["start_indices"][d] == 0 and p["limit_indices"][d] == op.ins[0].shape[d] and (p["strides"] is None or p["strides"][d] == 1)
            for d in (lay.spatial, lay.batch) if d is not None
        )
        return [op.ins[0], out] if kept else []
    if not _is_elementwise(op):
        return []
    return [v for v in op.ins if v.is_data and v.shape == out.shape] + [out]


@dataclasses.dataclass
class _Plan:
    layouts: dict  # Value -> _Layout
    windows: dict  # Op -> Halo | None (None: XLA's partitioner exchanges the halos)
    pools: dict  # Op -> input _Layout, for global pools reduced over the sharded axis first


def _is_global(sw: _regions.SlidingWindow) -> bool:
    """A window that reads the whole axis into one row: a reduction over it."""
    return sw.out_size == 1 and sw.span >= sw.in_size + sw.pad_lo + sw.pad_hi


def _plan_windows(graph, config: _Config, layouts: dict) -> tuple[dict, dict]:
    windows, pools = {}, {}
    for op in graph.ops:
        rule = facet(op.eqn, "stripes")
        if rule is None or not op.ins[0].is_data:
            continue
        found = rule.layouts(op.eqn, config.axis, layouts.get(op.ins[0]))
        if found is None:
            raise UnsupportedError(f"shard_spatial: {_op_label(op)} has no spatial axis {config.axis!r}; "
                                   f"use one of {list(_AXIS_NAMES)[-len(op.ins[0].shape) + 2:]}")
        lay_in, lay_out = found
        sw = rule.sliding(op.eqn, lay_in)
        if _is_global(sw):  # global pooling ends the block
            if rule.reduce is not None and not rule.check(op.eqn, lay_in):
                pools[op] = lay_in
            continue
        reason = rule.check(op.eqn, lay_in)
        if reason:
            raise UnsupportedError(f"shard_spatial: cannot partition {_op_label(op)} along {config.axis}: "
                                   f"{reason}; shard a function that stops before it")
        n = config.devices
        if sw.out_size < n:
            raise ConfigError(
                f"shard_spatial: {_op_label(op)} has {sw.out_size} output rows along {config.axis}, fewer than "
                f"the {n} devices of mesh axis {config.mesh_axis!r}; use a larger input or a mesh axis "
                f"of at most {sw.out_size} devices"
            )
        if config.batch_axis is not None and lay_in.batch is not None:
            batch, split = op.ins[0].shape[lay_in.batch], config.mesh.shape[config.batch_axis]
            if batch % split:
                raise ConfigError(f"shard_spatial: {_op_label(op)} has batch {batch}, which does not split "
                                  f"over the {split} devices of batch_axis {config.batch_axis!r}")
        halo = _regions.stripe_halo(sw, n)
        if max(halo.window_lo, halo.window_hi) > halo.in_rows:
            raise ConfigError(
                f"shard_spatial: the window of {_op_label(op)} reaches {max(halo.window_lo, halo.window_hi)} "
                f"rows past its stripe along {config.axis} (window {sw.window}, dilation {sw.dilation}, "
                f"padding {sw.pad_lo, sw.pad_hi}) but a stripe of its {sw.in_size}-row input over {n} "
                f"devices has only {halo.in_rows}, so the halo would reach past the neighbour; use a mesh "
                f"axis with fewer devices or a larger input"
            )
        for value, lay in ((op.ins[0], lay_in), (op.outs[0], lay_out)):
            if layouts.setdefault(value, lay) != lay:
                raise UnsupportedError(f"shard_spatial: {_op_label(op)} reads {config.axis} as dim "
                                       f"{lay.spatial} of a value other layers shard on dim {layouts[value].spatial}")
        windows[op] = halo
    return windows, pools


def _propagate(graph, layouts: dict) -> None:
    """Spread layouts through elementwise ops, forwards and backwards, to a fixed point."""
    changed = True
    while changed:
        changed = False
        for op in graph.ops:
            values = _same_layout_values(op, layouts)
            known = [layouts[v] for v in values if v in layouts]
            if not known:
                continue
            for v in values:
                if v not in layouts:
                    layouts[v] = known[0]
                    changed = True


def _keeps_dim(op, dim: int) -> bool:
    """Whether a reshape keeps input dim `dim` as one of its output dims."""
    shape, out = op.ins[0].shape, op.outs[0].shape
    before = int(np.prod(shape[:dim]))
    prefixes = {int(np.prod(out[:k])): k for k in range(len(out))}
    return before in prefixes and out[prefixes[before]] == shape[dim]


def _check_exits(graph, plan: _Plan, config: _Config) -> None:
    """Every reader of a sharded value is partitioned, or ends the block."""
    for value, lay in plan.layouts.items():
        for op in value.consumers:
            if op in plan.windows or value in _same_layout_values(op, plan.layouts):
                continue
            if facet(op.eqn, "stripes") is not None or (op.primitive == "reshape" and not _keeps_dim(op, lay.spatial)):
                continue  # global pooling, flattening
            if facet(op.eqn, "region") is _regions.reduce and lay.spatial in op.eqn.params["axes"]:
                continue
            raise UnsupportedError(
                f"shard_spatial: {_op_label(op)} reads an activation sharded along {config.axis} and jtile "
                f"cannot partition it (only convolutions, pools, elementwise ops, channel concatenation and "
                f"reductions over {config.axis} are); shard a function that stops before it"
            )


def _plan(graph, config: _Config) -> _Plan:
    layouts: dict = {}
    known = -1
    while len(layouts) != known:  # a pool follows the layout elementwise ops bring to its input
        known = len(layouts)
        windows, pools = _plan_windows(graph, config, layouts)
        _propagate(graph, layouts)
    if not windows:
        raise UnsupportedError(
            f"shard_spatial: the function has no convolution or pooling along {config.axis} to partition"
        )
    plan = _Plan(layouts, windows, pools)
    _check_exits(graph, plan, config)
    xla = _xla_exchanges_halos(list(windows), plan, config) if config.halo == "auto" else {}
    for op, halo in windows.items():
        if config.halo == "xla" or xla.get(op):
            plan.windows[op] = None
        elif max(halo.fetch_lo, halo.fetch_hi) > halo.in_rows:
            sw, gathers = halo.window, ", and XLA's partitioner would all-gather its input" if op in xla else ""
            raise UnsupportedError(
                f"shard_spatial: {_op_label(op)} cannot swap halos with its neighbours only: with stride "
                f"{sw.stride}, stripes of {halo.in_rows} input rows and {halo.out_rows} output rows over "
                f"{halo.devices} devices drift apart by more than a stripe ({sw.in_size} -> {sw.out_size} "
                f"rows){gathers}; use halo='xla' to let XLA's partitioner move the rows, or a mesh "
                f"axis with fewer devices"
            )
    return plan


# ---------------------------------------------------------------- the rules


def _constrain(x, layout: _Layout, config: _Config):
    return lax.with_sharding_constraint(x, NamedSharding(config.mesh, layout.spec(np.ndim(x), config)))


_PROBED: dict = {}  # probe key -> whether XLA swaps halos for that op


def _probe_key(op, plan: _Plan, config: _Config):
    layouts = (plan.layouts[op.ins[0]], plan.layouts[op.outs[0]])
    return (op.primitive, str(op.eqn.params), tuple((v.shape, v.dtype) for v in op.ins), layouts, config)


def _probe(ops: list, plan: _Plan, config: _Config) -> dict:
    """For each op, whether XLA's partitioner runs it on stripes with halo
    exchanges only (no all-gather, no all-to-all): the ops are compiled in one
    program, each alone on its own inputs in a named scope, and each scope's
    collectives read from the HLO. Collectives no scope claims send every op
    of the program to a compile of its own."""

    def alone(op, x, *rest):  # the output padded to whole stripes, so that returning it gathers nothing
        lay_in, lay_out = plan.layouts[op.ins[0]], plan.layouts[op.outs[0]]
        out = _constrain(bind(op.eqn, _constrain(x, lay_in, config), *rest)[0], lay_out, config)
        return _constrain(_pad_rows(out, lay_out.spatial, config.devices), lay_out, config)

    def program(*args):
        it = iter(args)
        outs = []
        for k, op in enumerate(ops):
            with jax.named_scope(f"jtile_probe_{k}"):
                outs.append(alone(op, *[next(it) for _ in op.ins]))
        return outs

    args = [jax.ShapeDtypeStruct(v.shape, v.dtype) for op in ops for v in op.ins]
    found = collectives(jax.jit(program).lower(*args).compile())
    scopes = [re.search(r"jtile_probe_(\d+)/", c.op_name) for c in found]
    if len(ops) > 1 and not all(scopes):
        return {op: _probe([op], plan, config)[op] for op in ops}
    gathers = {int(m[1]) for c, m in zip(found, scopes) if c.kind != "collective-permute" and m}
    if len(ops) == 1 and any(c.kind != "collective-permute" for c in found):
        gathers = {0}
    return {op: k not in gathers for k, op in enumerate(ops)}


def _xla_exchanges_halos(ops, plan: _Plan, config: _Config) -> dict:
    """`_probe` for the ops not probed before (on the same shapes, layouts and mesh)."""
    unique = {}
    for op in ops:
        unique.setdefault(_probe_key(op, plan, config), op)
    todo = {key: op for key, op in unique.items() if key not in _PROBED}
    if todo:
        verdicts = _probe(list(todo.values()), plan, config)
        _PROBED.update((key, verdicts[op]) for key, op in todo.items())
    return {op: _PROBED[_probe_key(op, plan, config)] for op in ops}


def _pad_rows(x, axis: int, devices: int):
    """`x` with zero rows appended along `axis` up to a multiple of `devices`."""
    extra = -x.shape[axis] % devices
    return lax.pad(x, jnp.zeros((), x.dtype), [(0, extra if d == axis else 0, 0) for d in range(x.ndim)])


def _exchange_halos(op, halo: _regions.Halo, lhs, rest, plan: _Plan, config: _Config):
    """`op` on stripes: a shard_map that swaps `halo` rows with the neighbours by ppermute."""
    rule, name, n = facet(op.eqn, "stripes"), config.mesh_axis, config.devices
    lay_in, lay_out = plan.layouts[op.ins[0]], plan.layouts[op.outs[0]]
    a, sw = lay_in.spatial, halo.window
    params = op.eqn.primitive.get_bind_params(op.eqn.params)
    fill = rule.fill(op.eqn)

    def rows_of(x, axis, start, stop):
        return lax.slice_in_dim(x, start, stop, axis=axis)

    def rows(x, start, stop):
        return rows_of(x, a, start, stop)

    def zeros(x, count):
        shape = list(x.shape)
        shape[a] = count
        return jnp.zeros(shape, x.dtype)

    def apply(x, rest, pad):
        varying = tuple(jax.typeof(x).manual_axis_type.varying)  # replicated operands join the stripe's manual axes
        p = rule.padding(params, lay_in, pad, op.eqn)
        return op.eqn.primitive.bind(x, *(lax.pcast(r, varying, to="varying") for r in rest), **p)

    def exchange(x):
        from_below = lax.ppermute(rows(x, halo.in_rows - halo.fetch_lo, halo.in_rows), name,
                                  [(j, j + 1) for j in range(n - 1)])
        from_above = lax.ppermute(rows(x, 0, halo.fetch_hi), name, [(j + 1, j) for j in range(n - 1)])
        return from_below, from_above

    def local(x, *rest):
        i = lax.axis_index(name)
        from_below, from_above = exchange(x)
        parts = [zeros(x, halo.lo - halo.fetch_lo), from_below, x, from_above, zeros(x, halo.hi - halo.fetch_hi)]
        stripe = lax.concatenate(parts, a)
        row = i * halo.in_rows - halo.lo + lax.broadcasted_iota(jnp.int32, stripe.shape, a)
        stripe = jnp.where((row >= 0) & (row < sw.in_size), stripe, jnp.asarray(fill, stripe.dtype))
        return apply(lax.dynamic_slice_in_dim(stripe, halo.offset(i), halo.read_rows, axis=a), rest, (0, 0))

    def local_linear(x, *rest):
        """For a linear op on aligned stripes: the op on the stripe itself with zero
        padding for the halo, plus the op on the halo rows alone added into the
        border output rows, so no haloed copy of the stripe is made."""
        from_below, from_above = exchange(x)
        out = apply(x, rest, (sw.pad_lo, halo.read_rows - halo.in_rows - sw.pad_lo))
        o, s_, span = lay_out.spatial, sw.stride, sw.span
        if halo.fetch_lo:
            top = -(-halo.fetch_lo // s_)  # output rows that read rows from below
            fix = apply(from_below, rest, (0, (top - 1) * s_ + span - halo.fetch_lo))
            out = lax.dynamic_update_slice_in_dim(out, rows_of(out, o, 0, top) + fix, 0, o)
        if halo.fetch_hi:
            first = max((sw.pad_lo + halo.in_rows - span) // s_ + 1, 0)  # first output row reading from above
            fix = apply(from_above, rest, (sw.pad_lo + halo.in_rows - first * s_, 0))
            out = lax.dynamic_update_slice_in_dim(out, rows_of(out, o, first, halo.out_rows) + fix, first, o)
        return out

    lhs = _constrain(_pad_rows(lhs, a, n), lay_in, config)
    rank = len(op.outs[0].shape)
    linear = rule.linear and halo.lo == halo.fetch_lo == sw.pad_lo and halo.hi == halo.fetch_hi and (
        halo.out_rows * sw.stride == halo.in_rows and n * halo.in_rows == sw.in_size)
    out = jax.shard_map(
        local_linear if linear else local, mesh=config.mesh, in_specs=(lay_in.spec(lhs.ndim, config), *[P()] * len(rest)),
        out_specs=lay_out.spec(rank, config),
    )(lhs, *rest)
    return lax.slice_in_dim(out, 0, sw.out_size, axis=lay_out.spatial)


def _global_pool(op, layout: _Layout, x, *rest):
    """A pool whose window spans the sharded axis: each device reduces its stripe
    and XLA combines the partial results (an all-reduce, not a gather)."""
    a, p = layout.spatial, dict(op.eqn.primitive.get_bind_params(op.eqn.params))
    x = facet(op.eqn, "stripes").reduce(x, a)
    for name, value in (("window_dimensions", 1), ("window_strides", 1), ("window_dilation", 1), ("padding", (0, 0))):
        p[name] = tuple(value if d == a else v for d, v in enumerate(p[name]))
    return op.eqn.primitive.bind(x, *rest, **p)


def _rules(closed, config: _Config) -> dict:
    graph = Graph.of(closed)
    plan = _plan(graph, config)
    actions = {}
    for op in graph.ops:
        ins = [(k, plan.layouts[v]) for k, v in enumerate(op.ins) if v in plan.layouts]
        outs = [(k, plan.layouts[v]) for k, v in enumerate(op.outs) if v in plan.layouts]
        if ins or outs or op in plan.pools:
            actions[id(op.eqn)] = (op, ins, outs)

    def rule(eqn, *invals):
        op, ins, outs = actions.get(id(eqn), (None, [], []))
        invals = list(invals)
        for k, lay in ins:
            invals[k] = _constrain(invals[k], lay, config)
        if op is not None and plan.windows.get(op) is not None:
            out = [_exchange_halos(op, plan.windows[op], invals[0], invals[1:], plan, config)]
        elif op in plan.pools:
            out = [_global_pool(op, plan.pools[op], *invals)]
        else:
            out = bind(eqn, *invals)
        for k, lay in outs:
            out[k] = _constrain(out[k], lay, config)
        return out if eqn.primitive.multiple_results else out[0]

    return {op.primitive: rule for op, _, _ in actions.values()}


def shard_spatial(
    fn: Callable | None = None,
    /,
    *,
    mesh: Mesh,
    axis: str = "H",
    mesh_axis: str | None = None,
    batch_axis: str | None = None,
    halo: str = "auto",
    **unknown,
) -> Callable:
    """Split the activations of `fn`'s convolutions, pools and elementwise ops along
    spatial `axis` over the devices of `mesh_axis`.

    **Arguments:**

    - `fn`: the function to transform. Omit it to use `shard_spatial` as a decorator.
    - `mesh`: a `jax.sharding.Mesh` (its axes are used as `Auto` axes).
    - `axis`: `"H"`, `"W"` or `"D"`, the spatial axis to split (of each layer's
        dimension numbers; pools follow their input).
    - `mesh_axis`: the mesh axis the stripes go over; may be omitted when the
        mesh has one axis besides `batch_axis`.
    - `batch_axis`: optionally, a second mesh axis that splits the batch.
    - `halo`: `"auto"` (XLA's partitioner where its compiled HLO swaps halos,
        jtile's `shard_map` + `ppermute` exchange where it would all-gather),
        `"ppermute"` (jtile's everywhere) or `"xla"` (XLA's everywhere).

    **Returns:** a function with `fn`'s signature and outputs (up to float rounding).
    """
    reject_unknown("shard_spatial", unknown, ("mesh", "axis", "mesh_axis", "batch_axis", "halo"))
    config = _config(mesh, axis, mesh_axis, batch_axis, halo)
    if fn is None:
        return lambda f: shard_spatial(f, mesh=mesh, axis=axis, mesh_axis=mesh_axis, batch_axis=batch_axis, halo=halo)
    order = "shard_spatial partitions lax convolutions and pools; apply it to the function before {}"
    return transform(fn, "shard_spatial", lambda closed: _rules(closed, config), refuse={
        name: order.format(name) for name in ("swap_backend", "conv_bias_act", "tile_conv")})


__all__ = ["Collective", "collectives", "shard_spatial"]
