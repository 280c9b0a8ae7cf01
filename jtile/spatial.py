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
- `mode="loop"`: the tiles run in raster order in a `lax.fori_loop` over rows
  of tiles and one over each row, and a tile computes only what the tiles
  before it did not (Alwani et al.'s fused-layer reuse): the rows above its
  window come from a line buffer (the last rows of the row of tiles above,
  full width), the columns on its left from the tile before. The overlap is
  kept on the narrowest value of a pointwise chain (a 1x1 expansion's input,
  not its 6x wider output; the expansion recomputes its one-column halo), since
  a kept part is copied into each tile's window. The first, interior and last
  tiles along an axis differ in shape; each shape is one branch of a
  `lax.switch`, so the program stops growing from a 3x3 grid on, and no tile
  can be hoisted or interleaved by XLA: one tile's intermediates are live at a
  time. Output tiles are uniform (the last overlaps its neighbour) so a row's
  tiles come back stacked, outside the switch. With `mesh=`, tiles are
  independent instead (one shape, windows reaching over the border: a
  zero-filling gather for the inputs, masks where the untiled net had
  padding), and the tile axis is sharded over the mesh with `shard_map`
  (DeepThings' fused tile partitioning): each device computes its tiles
  without communicating, and the tiles are gathered once.

!!! warning

    Only ops with a region rule are tiled; an op without one ends the block
    before it (with a warning), and a reduction or reshape across space ends
    it quietly. Unrolled tiles recompute their overlap (`jtile.summary` counts
    it); looped tiles recompute only the halo of wide pointwise values, but
    `jtile.summary` counts each `lax.switch` at its most expensive branch (the
    first tile of a row), so its MAC count of a looped function is an upper
    bound. XLA's CPU backend runs a top-level convolution channels-last (its
    layout assignment transposes around it) but one in a loop body in the
    layout written, summing in another order: looped tiles of an NCHW net
    differ from the untiled function by a few ulp per conv. Writing the tile's
    convs channels-last (NHWC, HWIO kernels) makes MobileNetV2's looped tiles
    bit-identical, but the transposes cost about 0.1 MB of XLA's temp at 224
    (4x4: 8.2x -> 7.3x lower peak), so it is not done.
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
    """Every tile's windows for a block.

    With `reuse`, tiles run in raster order and each one computes only the part
    of a value that the tiles before it (above, and on its left) did not:
    `windows` are those fresh windows, and a value read with a halo arrives as
    the `cache[v]` rows and columns (per grid axis) kept from earlier tiles in
    front of the fresh part, starting at `origins[v]`. Values of a pointwise
    chain wider than its narrowest value recompute their halo instead.
    """

    block: Block
    grid: tuple[int, ...]
    uniform: bool
    windows: dict  # Value -> per tile: tuple of Window (what the tile computes)
    reads: dict  # (op index, operand) -> _Read
    params: dict  # op index -> per tile params
    out_tiles: dict  # Value -> per tile: tuple of Window (the tile it writes)
    reuse: bool = False
    cache: dict = dataclasses.field(default_factory=dict)  # Value -> per grid axis: rows kept from earlier tiles
    origins: dict = dataclasses.field(default_factory=dict)  # Value -> per tile: starts of the array it arrives as

    @property
    def tiles(self) -> int:
        return math.prod(self.grid)

def _reused_axes(grid: tuple[int, ...]) -> tuple[int, ...]:
    """The grid axes whose overlap a looped tile reuses: rows and columns of a 2-D grid,
    the last axis otherwise."""
    return (0, 1) if len(grid) == 2 else (len(grid) - 1,)


def _previous(tiles: list, grid: tuple[int, ...], k: int, a: int) -> int | None:
    """The tile before tile `k` along grid axis `a` (raster order), or None at the border."""
    return k - math.prod(grid[a + 1 :]) if tiles[k][a] else None


def _fresh(needed: list, tiles: list, grid: tuple[int, ...]) -> list:
    """Per tile, the part of `needed` (per tile: tuple of Window) that the tiles before
    it along each reused axis have not computed."""
    fresh = []
    for k, need in enumerate(needed):
        w = list(need)
        for a in _reused_axes(grid):
            prev = _previous(tiles, grid, k, a)
            if prev is not None:
                start = max(w[a].start, fresh[prev][a].stop)
                w[a] = Window(start, max(start, w[a].stop))
        fresh.append(tuple(w))
    return fresh


def _per_position(v: Value, dims) -> float:
    """Bytes of `v` at one position of its tiled dims."""
    return v.nbytes / math.prod(v.shape[d] for d in dims)


def _pointwise(op: Op, axes: dict) -> bool:
    """Whether `op` reads each tiled operand at its output's own position."""
    dims = axes[op.outs[0]]
    out = tuple(Window(op.outs[0].shape[d] // 2, op.outs[0].shape[d] // 2 + 1) for d in dims)
    region = facet(op.eqn, "region")(op.eqn, dims, out, True)
    return all(r is None or r[1] == w for read in region.operands if read is not None for r, w in zip(read, out))


def _narrowest(v: Value, axes: dict, seen: dict) -> float:
    """The fewest bytes per position on the way up to `v` through pointwise ops of the
    block: where a cache of `v`'s overlap is cheapest to keep."""
    if v not in seen:
        own = _per_position(v, axes[v])
        op = v.producer
        if op is None or v not in axes or not _pointwise(op, axes):
            seen[v] = own
        else:
            tiled = [u for u in op.ins if u in axes and u.role != "literal"]
            seen[v] = min(own, sum(_narrowest(u, axes, seen) for u in tiled)) if tiled else own
    return seen[v]


def _recomputes(op: Op, axes: dict, seen: dict) -> bool:
    """Whether `op` recomputes its outputs' overlap with earlier tiles instead of
    caching it: it is pointwise and a narrower value is upstream of it through
    pointwise ops (a 1x1 expansion's input, not its wide output: a cache is copied
    into each tile's window, so it is kept where that copy is smallest)."""
    if not _pointwise(op, axes):
        return False
    own = sum(_per_position(v, axes[v]) for v in op.outs)
    tiled = [u for u in op.ins if u in axes and u.role != "literal"]
    return bool(tiled) and sum(_narrowest(u, axes, seen) for u in tiled) < own


def _cache_width(v: Value, dim: int, a: int, windows: list, requests: list, tiles: list, grid) -> int:
    """Rows or columns (operand dim `dim`, grid axis `a`) of `v` a tile reads from before
    its fresh window: the cache it keeps from the tile before it along `a`; checked to
    lie in what those earlier tiles computed."""
    width, valid = 0, [0] * len(windows)
    for k, (fresh, asked) in enumerate(zip(windows, requests)):
        w, prev = fresh[a], _previous(tiles, grid, k, a)
        valid[k] = valid[prev] if prev is not None and w.start == windows[prev][a].stop else w.start
        reach = min((x.start for r in asked for d, x in r if d == dim and x.size > 0), default=w.start)
        if reach < valid[k]:
            raise UnsupportedError(f"tile_spatial: tile {k} reads a part of '{v.producer.scope}' that no "
                                   "earlier tile computed; use mode='unroll'")
        width = max(width, w.start - reach)
    return width


def make_plan(block: Block, grid: tuple[int, ...], uniform: bool, reuse: bool = False) -> Plan:
    """Propagate every tile's output windows backwards through the block (see `Plan`)."""
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
        per_axis = [tile_windows(v.shape[d], n, uniform or reuse) for d, n in zip(block.axes[v], grid)]
        out_tiles[v] = [tuple(per_axis[a][i] for a, i in enumerate(t)) for t in tiles]
        for k, w in enumerate(out_tiles[v]):
            requests[v][k].append(tuple(zip(block.axes[v], w)))
    windows, regions, narrowest = {}, {}, {}
    for op in reversed(block.ops):
        per_tile = []
        for k in range(len(tiles)):
            asked = [r for v in op.outs if v in requests for r in requests[v][k]]
            per_tile.append(tuple(_regions.hull([r[a][1] for r in asked]) for a in range(len(grid))))
        if uniform:
            sizes = [max(w[a].size for w in per_tile) for a in range(len(grid))]
            per_tile = [tuple(Window(x.start, x.start + s) for x, s in zip(w, sizes)) for w in per_tile]
        dims = block.axes[op.outs[0]]
        rule = facet(op.eqn, "region")
        regions[op.index] = [rule(op.eqn, dims, w, not uniform) for w in per_tile]
        if reuse and not _recomputes(op, block.axes, narrowest):
            per_tile = _fresh(per_tile, tiles, grid)
            regions[op.index] = [rule(op.eqn, dims, w, not uniform) for w in per_tile]
        for v in op.outs:
            windows[v] = per_tile
        for j, v in enumerate(op.ins):
            if regions[op.index][0].operands[j] is not None and v.role != "literal":
                for k, region in enumerate(regions[op.index]):
                    requests[v][k].append(tuple(r for r in region.operands[j] if r is not None))
    cache, origins = {}, {}
    for v, per_tile in windows.items():
        widths = [0] * len(grid)
        for a in _reused_axes(grid) if reuse else ():
            widths[a] = _cache_width(v, block.axes[v][a], a, per_tile, requests[v], tiles, grid)
        if any(widths):
            cache[v] = tuple(widths)
        origins[v] = [tuple(w.start - n for w, n in zip(ws, widths)) for ws in per_tile]
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
                origin = [[dict(zip(block.axes[v], origins[v][k]))[d] for d in dims] for k in range(len(tiles))]
            else:
                origin = [[0] * len(dims)] * len(tiles)
            outside = v not in windows and any(
                w.start < 0 or w.stop > v.shape[d] for ws in per_tile for d, w in zip(dims, ws))
            starts = np.array([[w.start - o for w, o in zip(ws, org)] for ws, org in zip(per_tile, origin)],
                              dtype=np.int32).reshape(len(tiles), len(dims))
            reads[op.index, j] = _Read(dims, per_tile, starts, regions[op.index][0].fill[j],
                                       tuple(v.shape[d] for d in dims), outside)
    return Plan(block, grid, uniform, windows, reads, params, out_tiles, reuse, cache, origins)


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


def _tile_rules(plan: Plan, tile, rep: int, caches: dict) -> dict:
    """Rules that evaluate the block's ops on tile `tile` (an int, or a traced index),
    with the sizes and params of tile `rep` (a tile of the same shapes). With
    `plan.reuse`, `caches` holds the rows and columns kept from earlier tiles; the
    rules put them in front of what the tile computes and update them (`_reuse`)."""
    ops = {id(op.eqn): op for op in plan.block.ops}
    static = isinstance(tile, int)

    def emit(eqn, *invals):
        op = ops[id(eqn)]
        out = plan.windows[op.outs[0]][rep]
        if any(w.size == 0 for w in out):  # a tile of padding only, or nothing new: nothing to compute
            shape = list(eqn.outvars[0].aval.shape)
            for d, w in zip(plan.block.axes[op.outs[0]], out):
                shape[d] = w.size
            results = [jnp.zeros(shape, v.aval.dtype) for v in eqn.outvars]
        else:
            operands = list(invals)
            for j, x in enumerate(invals):
                read = plan.reads.get((op.index, j))
                if read is None:
                    continue
                sizes = [w.size for w in read.windows[rep]]
                inside = op.ins[j] in plan.windows and not plan.uniform  # at the same place in every such tile
                starts = _at(read.starts, rep if inside else tile)
                if read.outside and not static:
                    x = _gather(x, read.dims, starts, sizes)
                else:
                    x = _slice(x, read.dims, starts, sizes)
                if read.fill is not None:
                    absolute = np.array([[w.start for w in ws] for ws in read.windows], np.int32)
                    x = _masked(x, read.dims, _at(absolute, tile), read.extent, read.fill(invals))
                operands[j] = x
            params = plan.params[op.index][rep]
            results = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(params))
            results = results if eqn.primitive.multiple_results else [results]
        for i, v in enumerate(op.outs):
            if v in plan.cache:
                results[i] = _reuse(plan, v, results[i], tile, caches)
        return results if eqn.primitive.multiple_results else results[0]

    return {op.primitive: emit for op in plan.block.ops}


def _reuse(plan: Plan, v: Value, fresh, tile, caches: dict):
    """`fresh` (the part of `v` this tile computed) with the rows and columns kept from
    earlier tiles in front: above, from the line buffer `caches[v, 0]` (the last rows
    of the row of tiles above, full width); left, from `caches[v, last]` (the last
    columns of the tile before). Both caches are updated for the tiles after."""
    widths, axes, x = plan.cache[v], _reused_axes(plan.grid), fresh
    dims = [plan.block.axes[v][a] for a in axes]
    n = list(plan.cache).index(v)  # caches are keyed (n, axis): a pytree needs sortable keys
    if len(axes) == 2 and widths[0]:
        starts = np.array([[ws[1].start] for ws in plan.windows[v]], np.int32)
        (col,) = _at(starts, tile)
        line = caches[n, 0]
        x = lax.concatenate([lax.dynamic_slice_in_dim(line, col, x.shape[dims[1]], dims[1]), x], dims[0])
        bottom = lax.slice_in_dim(x, x.shape[dims[0]] - widths[0], None, axis=dims[0])
        caches[n, 0] = lax.dynamic_update_slice_in_dim(line, bottom, col, dims[1])
    a, d = axes[-1], dims[-1]
    if widths[a]:
        x = lax.concatenate([caches[n, a], x], d)
        caches[n, a] = lax.slice_in_dim(x, x.shape[d] - widths[a], None, axis=d)
    return x


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # params holding arrays: treat as different
        return False


def _classes(keys: list) -> tuple[list[int], list[int]]:
    """The class of each of `keys` (equal keys, one class) and each class's first index."""
    classes, reps = [], []
    for i, key in enumerate(keys):
        c = next((c for c, r in enumerate(reps) if _same(keys[r], key)), None)
        if c is None:
            c = len(reps)
            reps.append(i)
        classes.append(c)
    return classes, reps


def _switch(classes: list[int], i, branches: list, *args):
    """`branches[classes[i]](*args)` for a traced `i`."""
    if len(branches) == 1:
        return branches[0](*args)
    return lax.switch(jnp.asarray(classes, jnp.int32)[i], branches, *args)


def _shapes(plan: Plan, k: int) -> tuple:
    """What must agree for two tiles to share one loop body: window sizes, params,
    and the positions of reads inside the block's own values."""
    key = [tuple(w.size for w in ws[k]) for ws in plan.windows.values()]
    key += [tuple(plan.params[op.index][k].items()) for op in plan.block.ops]
    ops = {op.index: op for op in plan.block.ops}
    for (i, j), read in plan.reads.items():
        inside = ops[i].ins[j] in plan.windows
        key.append((tuple(w.size for w in read.windows[k]), tuple(read.starts[k]) if inside else None))
    for v, tiles in plan.out_tiles.items():
        key.append(tuple((w.size, w.start - o) for w, o in zip(tiles[k], plan.origins[v][k])))
    return tuple(key)


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
        self.plan = make_plan(block, tuple(grid), uniform=mesh is not None, reuse=mode == "loop" and mesh is None)
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

    def _tile(self, tile, externals, rep: int, caches: dict | None = None) -> list:
        """The output tiles of one tile of the block (see `_tile_rules`)."""
        plan = self.plan
        values = eval_jaxpr(self.body, [], *externals, rules=_tile_rules(plan, tile, rep, caches or {}))
        out = []
        for v, x in zip(plan.block.outputs, values):
            rows = np.array([[w.start - o for w, o in zip(plan.out_tiles[v][k], plan.origins[v][k])]
                             for k in range(plan.tiles)], np.int32)
            out.append(_slice(x, plan.block.axes[v], _at(rows, rep), [w.size for w in plan.out_tiles[v][rep]]))
        return out

    def _unrolled(self, externals) -> list:
        plan = self.plan
        tiles = [self._tile(k, externals, k) for k in range(plan.tiles)]
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

    def _caches(self, axis: int, rep: int) -> dict:
        """Zero caches along grid axis `axis`, shaped for tiles like `rep`: line buffers
        (full width) for the rows, left caches for the columns."""
        plan, out = self.plan, {}
        last = _reused_axes(plan.grid)[-1]
        for n, (v, widths) in enumerate(plan.cache.items()):
            if widths[axis]:
                shape = list(v.shape)
                rows = [w.size + n for w, n in zip(plan.windows[v][rep], widths)]
                for a, d in enumerate(plan.block.axes[v]):
                    shape[d] = widths[a] if a == axis else (rows[a] if axis == last else v.shape[d])
                out[n, axis] = jnp.zeros(shape, v.dtype)
        return out

    def _looped(self, externals) -> list:
        """A `fori_loop` over rows of tiles (all grid axes but the last), and in each row
        one over its tiles left to right; the caches ride in the loops' carries. Tiles
        of one shape (all but the first and last along an axis, typically) share one
        branch of a `lax.switch`, so the program does not grow with the tile count, and
        every tile runs inside the loops, one at a time (XLA cannot hoist or interleave
        tiles)."""
        plan = self.plan
        cols, last = plan.grid[-1], _reused_axes(plan.grid)[-1]
        keys = [_shapes(plan, k) for k in range(plan.tiles)]
        row_class, row_reps = _classes([keys[r * cols : (r + 1) * cols] for r in range(plan.tiles // cols)])

        def row_branch(r0: int):
            col_class, col_reps = _classes(keys[r0 * cols : (r0 + 1) * cols])

            def tile_branch(rep: int):
                def run(r, j, caches):
                    caches = dict(caches)
                    pieces = self._tile(r * cols + j, externals, rep, caches)
                    return pieces, caches

                return run

            branches = [tile_branch(r0 * cols + j0) for j0 in col_reps]

            def body(r, j, carry):
                strips, caches = carry
                pieces, caches = _switch(col_class, j, branches, r, j, caches)
                return [lax.dynamic_update_index_in_dim(s, p, j, 0) for s, p in zip(strips, pieces)], caches

            def run(r, lines):
                carry = (self._strips(), lines | self._caches(last, r0 * cols))
                strips, caches = lax.fori_loop(0, cols, functools.partial(body, r), carry)
                return strips, {key: c for key, c in caches.items() if key in lines}

            return run

        def write(r, j, bufs, strips):
            return self._write(bufs, [s[j] for s in strips], r * cols + j)

        def row(r, carry):
            # The output stays out of the switch (a buffer through a branch is copied):
            # a row's tiles come back stacked (all looped tiles have one output shape).
            bufs, lines = carry
            strips, lines = _switch(row_class, r, branches, r, lines)
            return lax.fori_loop(0, cols, lambda j, b: write(r, j, b, strips), bufs), lines

        branches = [row_branch(r0) for r0 in row_reps]
        lines = self._caches(0, 0) if last else {}
        return lax.fori_loop(0, plan.tiles // cols, row, (self._empty(), lines))[0]

    def _strips(self) -> list:
        """Zeros for one row of looped output tiles, stacked."""
        plan, out = self.plan, []
        for v in plan.block.outputs:
            shape = list(v.shape)
            for d, w in zip(plan.block.axes[v], plan.out_tiles[v][0]):
                shape[d] = w.size
            out.append(jnp.zeros((plan.grid[-1], *shape), v.dtype))
        return out

    def _sharded(self, externals) -> list:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        names = tuple(self.mesh.axis_names)
        per_device = -(-self.plan.tiles // self.mesh.size)

        def local(*ext):
            first = lax.axis_index(names) * per_device
            ids = jnp.minimum(first + jnp.arange(per_device, dtype=jnp.int32), self.plan.tiles - 1)
            return lax.map(lambda k: self._tile(k, list(ext), 0), ids)

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
    - `mode`: `"loop"` (tiles in `fori_loop`s, reusing earlier tiles' overlap) or
        `"unroll"` (one subgraph per tile, each recomputing its overlap).
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
