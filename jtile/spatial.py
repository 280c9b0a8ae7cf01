"""Multi-layer spatial tiling: run a block of layers tile by tile.

`tile_spatial` picks a block (from the input of the first convolution to the
first op that cannot be tiled, or to the layer `until` names), fixes a grid of
tiles on the block's output, propagates each tile's window backwards through
the region rules of `jtile._regions` (a receptive field growing layer by
layer), and evaluates the block once per tile on those windows: seed 001's
multi-layer tiling, MCUNetV2's patch-based inference. Ops before the block,
and ops inside its range that do not read its activations (a batch norm's
scale, computed from weights), run once, untiled; ops after it read the
stitched outputs.

- `mode="unroll"`: one explicit subgraph per tile: slices of the input,
  per-tile ops whose padding stays on the border sides of border tiles only,
  then concatenation. Readable, as Aidge draws it.
- `mode="loop"`: every tile has one shape. A tile reads the block's inputs
  through a zero-filling gather (a padded copy's values, without the copy);
  an op reads its operand through a mask that puts the op's padding value
  wherever the untiled net had padding and runs unpadded; the tiles run in a
  `lax.fori_loop` writing with `dynamic_update_slice`, so the program and its
  live memory do not grow with the tile count. With `mesh=`, the tile axis is sharded over the mesh
  with `shard_map` (DeepThings' fused tile partitioning): each device
  computes its tiles without communicating, and the tiles are gathered once.

!!! warning

    Only ops with a region rule are tiled; an op without one ends the block
    before it (with a warning), and a reduction or reshape across space ends
    it quietly. Tiles overlap by their halo, so the tiled block recomputes
    that overlap (`jtile.summary` of the unrolled form counts it).
"""

import dataclasses
import difflib
import functools
import itertools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jax_core

from . import _regions
from ._errors import ConfigError, UnsupportedError, reject_unknown, require_positive_int
from ._graph import Graph, Op, Value
from ._interpreter import eval_jaxpr, trace
from ._layers import Layer
from ._regions import Window
from ._registry import facet

_CONVS = ("conv_general_dilated", "conv_bias_act")
_MODES = ("loop", "unroll")


class SpatialWarning(UserWarning):
    """`tile_spatial` ended a block early at an op it has no region rule for."""


# ---------------------------------------------------------------- the block


@dataclasses.dataclass
class Block:
    """The ops tiled together, the dims each of their values is tiled along,
    and the ops run before (`head`) and after (`tail`) it."""

    ops: list[Op]
    axes: dict  # Value -> output dims tiled, one per grid axis
    outputs: list[Value]
    head: list[Op]
    tail: list[Op]

    @property
    def externals(self) -> list[Value]:
        """Values the block reads but does not make (inputs, weights, hoisted values)."""
        made = {v for op in self.ops for v in op.outs}
        seen = {}
        for op in self.ops:
            for v in op.ins:
                if v not in made and v.role != "literal":
                    seen.setdefault(v, None)
        return list(seen)


def _scope_names(scope: str) -> list[str]:
    """`scope` and its prefixes ending at a "/" or "." boundary."""
    return [scope[:i] for i, c in enumerate(scope) if c in "/."] + [scope]


def _matches(scope: str, name: str) -> bool:
    return scope == name or (scope.startswith(name) and scope[len(name)] in "/.")


def _until_end(g: Graph, until, start: int) -> int | None:
    """One past the last op of the layer `until` names or accepts, or None."""
    if until is None:
        return None
    if isinstance(until, str):
        hits = [op.index for op in g.ops if _matches(op.scope, until)]
        hits += [op.index for layer in g.layers() if layer.name == until for op in layer.ops]
        hits.sort()
        if not hits:
            names = sorted({n for op in g.ops for n in _scope_names(op.scope) if n} | {l.name for l in g.layers()})
            near = difflib.get_close_matches(until, names, n=5, cutoff=0.5)
            hint = f"nearest names: {', '.join(near)}" if near else f"layer names look like {', '.join(names[:5])}"
            raise ConfigError(f"tile_spatial: until={until!r} names no layer of this function; {hint}")
        if hits[-1] < start:
            raise ConfigError(
                f"tile_spatial: until={until!r} ends before the first convolution "
                f"('{g.ops[start].scope}'), where the block starts; name a later layer"
            )
        return hits[-1] + 1
    count = itertools.count()
    for op in g.ops[start:]:
        layer = op.layer()
        if layer is not None and until(dataclasses.replace(layer, index=next(count))):
            end = op.index + 1
            while op.scope and end < len(g.ops) and g.ops[end].scope == op.scope:
                end += 1
            return end
    raise ConfigError("tile_spatial: the until= predicate accepted no layer at or after the first convolution")


def _read_axes(region: _regions.Region, j: int):
    read = region.operands[j]
    return None if read is None else tuple(r[0] if r is not None else None for r in read)


def _infer_axes(op: Op, known: dict, rank: int) -> tuple[tuple[int, ...] | None, str]:
    """The output dims of `op` whose windows read the tiled dims `known[j]` of its
    operands, or (None, why) when the op cannot be tiled along them."""
    rule, shape = facet(op.eqn, "region"), op.outs[0].shape
    why = "no output dims map to the tiled input dims"
    for dims in itertools.permutations(range(len(shape)), rank):
        windows = tuple(Window(0, shape[d]) for d in dims)
        try:
            region = rule(op.eqn, dims, windows, True)
        except _regions.Stop as e:
            why = str(e)
            continue
        if all(_read_axes(region, j) == axes for j, axes in known.items()):
            return dims, ""
    return None, why


def _where(op: Op) -> str:
    return f"{op.primitive} in layer '{op.scope}'" if op.scope else f"{op.primitive} (op {op.index}, no named scope)"


def select_block(g: Graph, rank: int, until=None) -> Block:
    """The block `tile_spatial` tiles (see the module docstring)."""
    first = next((op for op in g.ops if op.primitive in _CONVS), None)
    if first is None:
        raise ConfigError("tile_spatial: the function has no convolution to start a tiled block from")
    limit = _until_end(g, until, first.index)
    spatial = list(first.eqn.params["dimension_numbers"][2][2:])
    if rank > len(spatial):
        raise ConfigError(
            f"tile_spatial: grid has {rank} axes but the first convolution ('{first.scope}') has "
            f"{len(spatial)} spatial dim(s); give a grid of at most {len(spatial)} numbers"
        )
    axes: dict = {}
    ops: list[Op] = []
    end = len(g.ops) if limit is None else limit
    for op in g.ops[first.index : end]:
        known = {j: axes[v] for j, v in enumerate(op.ins) if v in axes}
        if op is first:
            dims, why = tuple(spatial[-rank:]), ""
            try:
                facet(op.eqn, "region")(op.eqn, dims, tuple(Window(0, 1) for _ in dims), True)
            except _regions.Stop as e:
                raise UnsupportedError(f"tile_spatial: the first convolution ('{op.scope}') cannot be tiled: {e}") from None
        elif not known:
            continue
        elif facet(op.eqn, "region") is None:
            if limit is not None:
                raise ConfigError(
                    f"tile_spatial: {_where(op)} has no region rule, so the block cannot reach until={until!r}; "
                    "end it earlier"
                )
            warnings.warn(
                f"tile_spatial: {_where(op)} has no region rule; the tiled block ends before it", SpatialWarning,
                stacklevel=4,
            )
            end = op.index
            break
        else:
            dims, why = _infer_axes(op, known, rank)
            if dims is None:
                if limit is not None:
                    raise ConfigError(
                        f"tile_spatial: {_where(op)} cannot be tiled ({why}), so the block cannot reach "
                        f"until={until!r}; end it earlier"
                    )
                end = op.index
                break
        ops.append(op)
        for v in op.outs:
            axes[v] = dims
    in_block = set(ops)
    outputs = [v for op in ops for v in op.outs
               if v.is_output or any(c not in in_block for c in v.consumers)]
    # Keep only the ops the outputs need.
    needed, kept = set(outputs), []
    for op in reversed(ops):
        if any(v in needed for v in op.outs):
            kept.append(op)
            needed.update(op.ins)
    kept.reverse()
    hoisted = [op for op in g.ops[first.index : end] if op not in in_block]
    return Block(kept, axes, outputs, g.ops[: first.index] + hoisted, g.ops[end:])


# ---------------------------------------------------------------- the plan


def tile_windows(extent: int, tiles: int, uniform: bool) -> list[Window]:
    """`tiles` windows covering `[0, extent)`: sizes differing by at most one, or
    (`uniform`) all of size `ceil(extent / tiles)`, spread evenly and overlapping."""
    if not uniform or tiles == 1:
        return _regions.split(extent, tiles)
    size = -(-extent // tiles)
    return [Window(s, s + size) for s in ((i * (extent - size)) // (tiles - 1) for i in range(tiles))]


@dataclasses.dataclass
class _Read:
    """How one operand of one op is read, per tile: absolute windows, and starts
    relative to the array the operand arrives as."""

    dims: tuple  # operand dim per read axis
    windows: list  # per tile: tuple of Window per read axis (absolute)
    starts: np.ndarray  # (tiles, read axes) starts inside the arriving array
    fill: Callable | None
    extent: tuple  # the operand's size along each read dim
    outside: bool  # an external operand read (partly) outside its extent


@dataclasses.dataclass
class Plan:
    """Every tile's windows for a block."""

    block: Block
    grid: tuple[int, ...]
    uniform: bool
    windows: dict  # Value -> per tile: tuple of Window (hull of what its consumers read)
    reads: dict  # (op index, operand) -> _Read
    params: dict  # op index -> per tile params
    out_tiles: dict  # Value -> per tile: tuple of Window (the tile it writes)

    @property
    def tiles(self) -> int:
        return math.prod(self.grid)


def make_plan(block: Block, grid: tuple[int, ...], uniform: bool) -> Plan:
    """Propagate every tile's output windows backwards through the block."""
    for v in block.outputs:
        for a, d in enumerate(block.axes[v]):
            if grid[a] > v.shape[d]:
                largest = tuple(min(o.shape[block.axes[o][b]] for o in block.outputs) for b in range(len(grid)))
                raise ConfigError(
                    f"tile_spatial: grid {grid} is too large for layer '{v.producer.scope}': its output has "
                    f"{v.shape[d]} rows along dim {d}; the largest grid for this block is {largest}, or end "
                    "the block earlier with until="
                )
    tiles = list(itertools.product(*(range(n) for n in grid)))
    requests: dict = defaultdict(lambda: [[] for _ in tiles])
    out_tiles = {}
    for v in block.outputs:
        per_axis = [tile_windows(v.shape[d], n, uniform) for d, n in zip(block.axes[v], grid)]
        out_tiles[v] = [tuple(per_axis[a][i] for a, i in enumerate(t)) for t in tiles]
        for k, w in enumerate(out_tiles[v]):
            requests[v][k].append(tuple(zip(block.axes[v], w)))
    windows, regions = {}, {}
    for op in reversed(block.ops):
        per_tile = []
        for k in range(len(tiles)):
            asked = [r for v in op.outs if v in requests for r in requests[v][k]]
            per_tile.append(tuple(_regions.hull([r[a][1] for r in asked]) for a in range(len(grid))))
        if uniform:
            sizes = [max(w[a].size for w in per_tile) for a in range(len(grid))]
            per_tile = [tuple(Window(x.start, x.start + s) for x, s in zip(w, sizes)) for w in per_tile]
        for v in op.outs:
            windows[v] = per_tile
        dims = block.axes[op.outs[0]]
        rule = facet(op.eqn, "region")
        regions[op.index] = [rule(op.eqn, dims, w, not uniform) for w in per_tile]
        for j, v in enumerate(op.ins):
            if regions[op.index][0].operands[j] is not None and v.role != "literal":
                for k, region in enumerate(regions[op.index]):
                    requests[v][k].append(tuple(r for r in region.operands[j] if r is not None))
    reads, params = {}, {}
    for op in block.ops:
        params[op.index] = [r.params for r in regions[op.index]]
        for j, v in enumerate(op.ins):
            first = regions[op.index][0].operands[j]
            if first is None or v.role == "literal":
                continue
            dims = tuple(r[0] for r in first if r is not None)
            per_tile = [tuple(r[1] for r in region.operands[j] if r is not None) for region in regions[op.index]]
            if v in windows:
                origin = [[dict(zip(block.axes[v], windows[v][k]))[d].start for d in dims] for k in range(len(tiles))]
            else:
                origin = [[0] * len(dims)] * len(tiles)
            outside = v not in windows and any(
                w.start < 0 or w.stop > v.shape[d] for ws in per_tile for d, w in zip(dims, ws))
            starts = np.array([[w.start - o for w, o in zip(ws, org)] for ws, org in zip(per_tile, origin)],
                              dtype=np.int32).reshape(len(tiles), len(dims))
            reads[op.index, j] = _Read(dims, per_tile, starts, regions[op.index][0].fill[j],
                                       tuple(v.shape[d] for d in dims), outside)
    return Plan(block, grid, uniform, windows, reads, params, out_tiles)


# ---------------------------------------------------------------- emission


def _slice(x, dims, starts, sizes):
    """`x` cut to `sizes` from `starts` along `dims` (static when the starts are ints)."""
    if all(isinstance(s, (int, np.integer)) for s in starts):
        lo, hi = [0] * x.ndim, list(x.shape)
        for d, s, n in zip(dims, starts, sizes):
            lo[d], hi[d] = int(s), int(s) + n
        return lax.slice(x, lo, hi)
    index, shape = [jnp.int32(0)] * x.ndim, list(x.shape)
    for d, s, n in zip(dims, starts, sizes):
        index[d], shape[d] = s, n
    return lax.dynamic_slice(x, index, shape)


def _gather(x, dims, starts, sizes):
    """`x` cut to `sizes` from `starts` along `dims`, zero where that reaches outside `x`
    (what slicing a zero-padded copy would give, without the copy)."""
    for d, s, n in zip(dims, starts, sizes):
        x = jnp.take(x, s + jnp.arange(n, dtype=jnp.int32), axis=d, mode="fill", fill_value=0)
    return x


def _masked(x, dims, starts, extents, fill):
    """`x` (read from `starts` of an operand of size `extents`) with `fill` where it has no element."""
    inside = None
    for d, s, n in zip(dims, starts, extents):
        pos = s + lax.broadcasted_iota(jnp.int32, x.shape, d)
        ok = (pos >= 0) & (pos < n)
        inside = ok if inside is None else inside & ok
    return jnp.where(inside, x, jnp.asarray(fill, x.dtype))


def _at(table: np.ndarray, tile):
    """Row `tile` of a per-tile table: ints for a static tile, traced scalars otherwise."""
    if isinstance(tile, int):
        return [int(s) for s in table[tile]]
    row = jnp.asarray(table)[tile]
    return [row[i] for i in range(table.shape[1])]


def _tile_rules(plan: Plan, tile) -> dict:
    """Rules that evaluate the block's ops on tile `tile` (an int, or a traced index for uniform tiles)."""
    ops = {id(op.eqn): op for op in plan.block.ops}
    static = isinstance(tile, int)
    row = tile if static else 0  # uniform tiles share sizes and params

    def emit(eqn, *invals):
        op = ops[id(eqn)]
        out = plan.windows[op.outs[0]][row]
        if any(w.size == 0 for w in out):  # a tile of padding only: nothing to compute
            shape = list(eqn.outvars[0].aval.shape)
            for d, w in zip(plan.block.axes[op.outs[0]], out):
                shape[d] = w.size
            zeros = [jnp.zeros(shape, v.aval.dtype) for v in eqn.outvars]
            return zeros if eqn.primitive.multiple_results else zeros[0]
        operands = list(invals)
        for j, x in enumerate(invals):
            read = plan.reads.get((op.index, j))
            if read is None:
                continue
            sizes = [w.size for w in read.windows[row]]
            if read.outside and not static:
                x = _gather(x, read.dims, _at(read.starts, tile), sizes)
            else:
                x = _slice(x, read.dims, _at(read.starts, tile), sizes)
            if read.fill is not None:
                absolute = np.array([[w.start for w in ws] for ws in read.windows], np.int32)
                x = _masked(x, read.dims, _at(absolute, tile), read.extent, read.fill(invals))
            operands[j] = x
        params = plan.params[op.index][row]
        return eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(params))

    return {op.primitive: emit for op in plan.block.ops}


def _piece(eqns: list, outvars: list | None = None, invars: list | None = None) -> jcore.Jaxpr:
    """A jaxpr of `eqns` whose inputs are `invars`, by default the variables they
    read but do not make."""
    made, free = set(), dict.fromkeys(invars or [])
    for e in eqns:
        for v in e.invars:
            if isinstance(v, jcore.Var) and v not in made:
                free.setdefault(v, None)
        made.update(e.outvars)
    if outvars is None:
        outvars = [v for e in eqns for v in e.outvars if not isinstance(v, jcore.DropVar)]
    for v in outvars:
        if isinstance(v, jcore.Var) and v not in made:
            free.setdefault(v, None)
    effects = jax_core.join_effects(*(e.effects for e in eqns))
    debug = jax_core.DebugInfo("tile_spatial", "<block>", None, None)
    return jcore.Jaxpr([], list(free), outvars, eqns, effects, debug)


def _run_piece(jaxpr: jcore.Jaxpr, env: dict, rules=None) -> None:
    out = eval_jaxpr(jaxpr, [], *[env[v] for v in jaxpr.invars], rules=rules or {})
    env.update(zip(jaxpr.outvars, out))


class _Tiled:
    """A traced function with its block tiled: head, tiled block, tail."""

    def __init__(self, closed: jcore.ClosedJaxpr, grid, until, mode: str, mesh):
        self.closed, self.mesh = closed, mesh
        g = Graph.of(closed)
        block = select_block(g, len(grid), until)
        self.plan = make_plan(block, tuple(grid), uniform=mode == "loop")
        self.mode = mode
        self.head = _piece([op.eqn for op in block.head])
        self.body = _piece([op.eqn for op in block.ops], [v.var for v in block.outputs],
                           [v.var for v in block.externals])
        self.tail = _piece([op.eqn for op in block.tail], list(closed.jaxpr.outvars))

    def __call__(self, consts, args) -> list:
        jaxpr = self.closed.jaxpr
        env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
        _run_piece(self.head, env)
        externals = [env[v] for v in self.body.invars]
        run = {"unroll": self._unrolled, "loop": self._looped if self.mesh is None else self._sharded}[self.mode]
        env.update(zip(self.body.outvars, run(externals)))
        _run_piece(self.tail, env)
        return [v.val if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]

    def _tile(self, tile, externals) -> list:
        """The output tiles of one tile of the block."""
        plan = self.plan
        values = eval_jaxpr(self.body, [], *externals, rules=_tile_rules(plan, tile))
        out = []
        for v, x in zip(plan.block.outputs, values):
            rows = np.array([[w.start - h.start for w, h in zip(plan.out_tiles[v][k], plan.windows[v][k])]
                             for k in range(plan.tiles)], np.int32)
            k = tile if isinstance(tile, int) else 0
            out.append(_slice(x, plan.block.axes[v], _at(rows, tile), [w.size for w in plan.out_tiles[v][k]]))
        return out

    def _unrolled(self, externals) -> list:
        plan = self.plan
        tiles = [self._tile(k, externals) for k in range(plan.tiles)]
        outs = []
        for i, v in enumerate(plan.block.outputs):
            pieces = [t[i] for t in tiles]
            for a in reversed(range(len(plan.grid))):
                n = plan.grid[a]
                pieces = [lax.concatenate(pieces[s : s + n], plan.block.axes[v][a]) for s in range(0, len(pieces), n)]
            outs.append(pieces[0])
        return outs

    def _write(self, buffers, pieces, tile) -> list:
        plan, out = self.plan, []
        for v, buf, piece in zip(plan.block.outputs, buffers, pieces):
            starts = np.array([[w.start for w in ws] for ws in plan.out_tiles[v]], np.int32)
            index = [jnp.int32(0)] * buf.ndim
            for d, s in zip(plan.block.axes[v], _at(starts, tile)):
                index[d] = s
            out.append(lax.dynamic_update_slice(buf, piece, index))
        return out

    def _empty(self) -> list:
        return [jnp.zeros(v.shape, v.dtype) for v in self.plan.block.outputs]

    def _looped(self, externals) -> list:
        return lax.fori_loop(
            0, self.plan.tiles, lambda k, bufs: self._write(bufs, self._tile(k, externals), k), self._empty()
        )

    def _sharded(self, externals) -> list:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        names = tuple(self.mesh.axis_names)
        per_device = -(-self.plan.tiles // self.mesh.size)

        def local(*ext):
            first = lax.axis_index(names) * per_device
            ids = jnp.minimum(first + jnp.arange(per_device, dtype=jnp.int32), self.plan.tiles - 1)
            return lax.map(lambda k: self._tile(k, list(ext)), ids)

        # check_vma=False: a tile mixes its device-varying window with replicated weights
        stacked = jax.shard_map(local, mesh=self.mesh, in_specs=(P(),) * len(externals), out_specs=P(names),
                                check_vma=False)(
            *externals
        )
        replicated = NamedSharding(self.mesh, P())
        gathered = [lax.with_sharding_constraint(s, replicated) for s in stacked]  # the one gather
        return lax.fori_loop(
            0, self.plan.tiles, lambda k, bufs: self._write(bufs, [lax.dynamic_index_in_dim(s, k, keepdims=False) for s in gathered], k), self._empty()
        )


def _check_grid(grid) -> tuple[int, ...]:
    if isinstance(grid, int) or not isinstance(grid, (tuple, list)) or not 1 <= len(grid) <= 3:
        raise ConfigError(f"tile_spatial: grid must be a tuple (rows, cols) of positive ints, got {grid!r}")
    for n in grid:
        require_positive_int("tile_spatial", "each grid entry", n)
    return tuple(grid)


def tile_spatial(
    fn: Callable | None = None,
    /,
    *,
    grid: tuple[int, ...] | None = None,
    until: str | Callable[[Layer], bool] | None = None,
    mode: str = "loop",
    mesh: jax.sharding.Mesh | None = None,
    **unknown,
) -> Callable:
    """Run a block of `fn`'s layers tile by tile (see the module docstring).

    **Arguments:**

    - `fn`: the function to transform. Omit it to use `tile_spatial` as a decorator.
    - `grid`: tiles along the last spatial dims of the block's output, `(rows, cols)`
        (`(n,)` tiles only the last one). Uneven grids are allowed.
    - `until`: end the block after this layer: a layer name (a named scope, or its
        prefix, such as `"features.6"`), or a predicate on `jtile.Layer`.
    - `mode`: `"loop"` (uniform tiles in a `fori_loop`) or `"unroll"` (one subgraph per tile).
    - `mesh`: a `jax.sharding.Mesh`; with `mode="loop"`, the tiles are spread over its devices.

    **Returns:** a function with `fn`'s signature and outputs.
    """
    reject_unknown("tile_spatial", unknown, ("grid", "until", "mode", "mesh"))
    if grid is None:
        raise ConfigError("tile_spatial: grid= is required, e.g. grid=(4, 4)")
    grid = _check_grid(grid)
    if mode not in _MODES:
        raise ConfigError(f"tile_spatial: mode must be one of {_MODES}, got {mode!r}")
    if until is not None and not isinstance(until, str) and not callable(until):
        raise ConfigError(f"tile_spatial: until must be a layer name or a predicate on jtile.Layer, got {until!r}")
    if mesh is not None and (not isinstance(mesh, jax.sharding.Mesh) or mode != "loop"):
        raise ConfigError(f"tile_spatial: mesh= takes a jax.sharding.Mesh with mode='loop', got {mesh!r}, mode={mode!r}")
    if mesh is not None and any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
        raise UnsupportedError(
            f"tile_spatial: mesh= needs Auto axes (XLA places the stitching), got axis types {mesh.axis_types}; "
            "build it with jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))"
        )
    if fn is None:
        return lambda f: tile_spatial(f, grid=grid, until=until, mode=mode, mesh=mesh)
    if not callable(fn):
        raise ConfigError(f"tile_spatial: expected a function to transform, got {fn!r}")
    cache: dict = {}
    tiled: dict = {}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        traced = trace("tile_spatial", fn, args, kwargs, cache)
        if id(traced) not in tiled:
            tiled[id(traced)] = _Tiled(traced.jaxpr, grid, until, mode, mesh)
        out = tiled[id(traced)](traced.jaxpr.consts, traced.dynamic_leaves(args, kwargs))
        return jax.tree.unflatten(traced.out_tree, out)

    wrapped.__jtile_cache__ = cache
    return wrapped


__all__ = ["Block", "Plan", "SpatialWarning", "make_plan", "select_block", "tile_spatial", "tile_windows"]
