"""`split_gemm`: run every matrix product as a grid of bounded GEMM tiles.

Each `dot_general` (any dimension numbers, batch dimensions included, so the
transposed operands of an ONNX `Gemm` with `transA`/`transB` too) is viewed as
a batch of 2-D products `(M, K) @ (K, N)`:

- M is the product of the lhs free dimensions (the flattened-row view: an
  lhs of shape `(B, T, K)` contracted on its last axis has M = B*T rows);
- K is the product of the contracting dimensions;
- N is the product of the rhs free dimensions;
- batch dimensions stay batch dimensions of every tile (they are not split:
  a tile is "the same block of every batch element").

The rows are cut into tiles of at most `max_m`, K into chunks of at most
`max_k`, the columns into tiles of at most `max_n`; a size that does not
divide gives a smaller last tile. The K partial products of one output tile
are summed left to right (k0 + k1 + ...), always in that order; the output
tiles are concatenated back and reshaped to the original output layout.

Two emissions, chosen per product by `emit=`:

- `"unroll"`: every tile is its own slices and dot, under
  `jax.named_scope(f"gemm_tile_m{i}_k{k}_n{j}")` inside the layer's own scope,
  so an analysis table, a schedule or an ONNX export shows
  `<layer>/gemm_tile_m0_k1_n0`. Trace and compile time grow with the tile count.
- `"loop"`: the operands are zero-padded once to whole tiles (ragged edges),
  `lax.map` runs over the output tiles and `lax.fori_loop` over the K chunks
  (same left-to-right sum), each step one uniform `dynamic_slice` tile; the
  padding is cropped off the result. One loop body whatever the tile count,
  under `gemm_tile_loop_m{M tiles}_k{K tiles}_n{N tiles}`.
- `"auto"` (default): `"loop"` above `LOOP_ABOVE` tiles in one product.

`tiles_per_layer(graph)` counts the tiles of both.

With `kernel="ffi"` every tile is computed by the C kernel
`jtile.kernels.dense` through `bounded_dense`, which refuses a tile larger
than the limits: this emulates a fixed-size GEMM accelerator.

!!! warning

    Only `dot_general` (and jtile's fused `dense` op) is split. Convolutions
    are not lowered to GEMMs here; see `jtile.tiling` for those. The looped
    emission pads a ragged operand (a copy of it per call, weights included)
    and is not exportable to ONNX (control flow); export with `emit="unroll"`.
"""

import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _fused
from ._errors import ConfigError, UnsupportedError, reject_positional, reject_unknown, require_positive_int
from ._graph import Graph
from ._interpreter import bind, transform
from ._layers import scope_name

_KERNELS = (None, "ffi")
_EMITS = ("auto", "unroll", "loop")
LOOP_ABOVE = 64  # tiles in one product above which emit="auto" loops


def _ranges(size: int, step: int | None) -> list[tuple[int, int]]:
    step = size if step is None else step
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]


def _canonical(x, order: list[int], shape: list[int]):
    """Transpose `x` to `order` and reshape to `shape`, skipping no-op steps."""
    if order != list(range(x.ndim)):
        x = lax.transpose(x, order)
    return x if list(x.shape) == shape else lax.reshape(x, shape)


def _block(x, start: int, bounds: tuple[tuple[int, int], ...]):
    """The block `bounds` of the two axes of `x` from `start` on, or `x` if whole."""
    if all((lo, hi) == (0, x.shape[start + i]) for i, (lo, hi) in enumerate(bounds)):
        return x
    starts = [0] * x.ndim
    limits = list(x.shape)
    for i, (lo, hi) in enumerate(bounds):
        starts[start + i], limits[start + i] = lo, hi
    return lax.slice(x, starts, limits)


def _pad_to(x, start: int, sizes: tuple[int, int]):
    """`x` zero-padded at the high end of its two axes from `start` on to `sizes`."""
    extra = [size - x.shape[start + i] for i, size in enumerate(sizes)]
    if not any(extra):
        return x
    widths = [(0, 0, 0)] * start + [(0, e, 0) for e in extra] + [(0, 0, 0)] * (x.ndim - start - 2)
    return lax.pad(x, np.zeros((), x.dtype), widths)


def bounded_dense(x, w, *, max_m: int, max_k: int, max_n: int):
    """`x @ w` on the C GEMM kernel, refusing operands larger than the limits.

    `x` is `(M, K)` and `w` is `(K, N)`; `M <= max_m`, `K <= max_k` and
    `N <= max_n` are required, as on a fixed-size accelerator.
    """
    (m, k), (_, n) = x.shape, w.shape
    if m > max_m or k > max_k or n > max_n:
        raise UnsupportedError(
            f"bounded_dense: tile (M, K, N) = ({m}, {k}, {n}) exceeds the kernel limits "
            f"({max_m}, {max_k}, {max_n}); split the GEMM first (jtile.split_gemm)"
        )
    try:
        from .kernels import dense
    except ImportError as e:
        raise UnsupportedError(
            f"split_gemm(kernel='ffi'): the C kernels are not available ({e}); "
            "install jtile with `pip install .` or use kernel=None"
        ) from None
    return dense(x, w)


class _Splitter:
    """Splits one canonical batched product `(B.., M, K) @ (B.., K, N)`."""

    def __init__(self, limits: tuple, kernel: str | None, emit: str):
        self.max_m, self.max_k, self.max_n = limits
        self.kernel = kernel
        self.emit = emit

    def tile(self, x, w, nbatch: int, precision, preferred):
        if self.kernel is None:
            batch = tuple(range(nbatch))
            dims = (((nbatch + 1,), (nbatch,)), (batch, batch))
            return lax.dot_general(
                x, w, dims, precision=precision, preferred_element_type=preferred
            )
        limits = dict(max_m=self.max_m, max_k=self.max_k, max_n=self.max_n)
        if nbatch == 0:
            return bounded_dense(x, w, **limits)
        flat_x = x.reshape(-1, *x.shape[nbatch:])
        flat_w = w.reshape(-1, *w.shape[nbatch:])
        out = jnp.stack([bounded_dense(a, b, **limits) for a, b in zip(flat_x, flat_w)])
        return out.reshape(*x.shape[:-1], w.shape[-1])

    def __call__(self, x, w, nbatch: int, precision, preferred):
        (m, k), n = x.shape[nbatch:], w.shape[-1]
        tiles = tile_count(m, k, n, max_m=self.max_m, max_k=self.max_k, max_n=self.max_n)
        if self.emit == "loop" or (self.emit == "auto" and tiles > LOOP_ABOVE):
            return self.looped(x, w, nbatch, precision, preferred)
        return self.unrolled(x, w, nbatch, precision, preferred)

    def looped(self, x, w, nbatch: int, precision, preferred):
        """One loop body: `lax.map` over output tiles, `lax.fori_loop` over K chunks."""
        (m, k), n = x.shape[nbatch:], w.shape[-1]
        tm, tk, tn = (min(size, limit or size) for size, limit in ((m, self.max_m), (k, self.max_k), (n, self.max_n)))
        nm, nk, nn = -(-m // tm), -(-k // tk), -(-n // tn)
        batch = x.shape[:nbatch]
        x = _pad_to(x, nbatch, (nm * tm, nk * tk))
        w = _pad_to(w, nbatch, (nk * tk, nn * tn))

        def chunk(i, j, kk):
            a = lax.dynamic_slice_in_dim(lax.dynamic_slice_in_dim(x, i * tm, tm, nbatch), kk * tk, tk, nbatch + 1)
            b = lax.dynamic_slice_in_dim(lax.dynamic_slice_in_dim(w, kk * tk, tk, nbatch), j * tn, tn, nbatch + 1)
            return self.tile(a, b, nbatch, precision, preferred)

        dtype = jnp.result_type(x.dtype, w.dtype) if preferred is None else preferred

        def output_tile(t):
            i, j = t // nn, t % nn
            zero = jnp.zeros((*batch, tm, tn), dtype)
            return lax.fori_loop(0, nk, lambda kk, acc: acc + chunk(i, j, kk), zero)

        with jax.named_scope(f"gemm_tile_loop_m{nm}_k{nk}_n{nn}"):
            out = lax.map(output_tile, jnp.arange(nm * nn))  # (nm * nn, *batch, tm, tn)
        out = out.reshape(nm, nn, *batch, tm, tn)
        order = [*range(2, 2 + nbatch), 0, 2 + nbatch, 1, 3 + nbatch]
        out = lax.transpose(out, order).reshape(*batch, nm * tm, nn * tn)
        return _block(out, nbatch, ((0, m), (0, n)))

    def unrolled(self, x, w, nbatch: int, precision, preferred):
        """One slice-and-dot per tile, each under its own `gemm_tile_m{i}_k{k}_n{j}` scope."""
        m_axis, n_axis = nbatch, nbatch + 1
        (m, k), n = x.shape[nbatch:], w.shape[-1]
        rows = []
        for i, (m0, m1) in enumerate(_ranges(m, self.max_m)):
            cols = []
            for j, (n0, n1) in enumerate(_ranges(n, self.max_n)):
                acc = None
                for kk, (k0, k1) in enumerate(_ranges(k, self.max_k)):
                    with jax.named_scope(f"gemm_tile_m{i}_k{kk}_n{j}"):
                        a = _block(x, nbatch, ((m0, m1), (k0, k1)))
                        b = _block(w, nbatch, ((k0, k1), (n0, n1)))
                        part = self.tile(a, b, nbatch, precision, preferred)
                    acc = part if acc is None else acc + part
                cols.append(acc)
            rows.append(cols[0] if len(cols) == 1 else lax.concatenate(cols, n_axis))
        return rows[0] if len(rows) == 1 else lax.concatenate(rows, m_axis)


def _split_dot(splitter: _Splitter, lhs, rhs, dimension_numbers, precision, preferred, out_dtype):
    """`lax.dot_general(lhs, rhs, dimension_numbers)` computed tile by tile."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    batch = [lhs.shape[d] for d in lb]
    m = math.prod(lhs.shape[d] for d in lf)
    k = math.prod(lhs.shape[d] for d in lc)
    n = math.prod(rhs.shape[d] for d in rf)
    out_shape = [*batch, *(lhs.shape[d] for d in lf), *(rhs.shape[d] for d in rf)]
    if m * k * n == 0:
        return None
    x = _canonical(lhs, [*lb, *lf, *lc], [*batch, m, k])
    w = _canonical(rhs, [*rb, *rc, *rf], [*batch, k, n])
    out = splitter(x, w, len(batch), precision, preferred)
    out = out if list(out.shape) == out_shape else lax.reshape(out, out_shape)
    return out.astype(out_dtype) if out.dtype != out_dtype else out


def _dot_rule(splitter: _Splitter, eqn, lhs, rhs):
    p = eqn.params
    out = _split_dot(
        splitter, lhs, rhs, p["dimension_numbers"], p["precision"],
        p["preferred_element_type"], eqn.outvars[0].aval.dtype,
    )
    return bind(eqn, lhs, rhs)[0] if out is None else out


def _dense_rule(splitter: _Splitter, eqn, lhs, rhs, bias, *residual):
    p = eqn.params
    y = _split_dot(
        splitter, lhs, rhs, p["dimension_numbers"], p["precision"],
        p["preferred_element_type"], eqn.outvars[0].aval.dtype,
    )
    if y is None:
        return bind(eqn, lhs, rhs, bias, *residual)[0]
    y = y + bias
    return _fused.activate(y + residual[0] if residual else y, p["activation"])


def _check_limit(name: str, value) -> int | None:
    if isinstance(value, np.integer):
        value = int(value)
    return None if value is None else require_positive_int("split_gemm", name, value)


def split_gemm(
    fn: Callable | None = None,
    /,
    *positional,
    max_m: int | None = None,
    max_k: int | None = None,
    max_n: int | None = None,
    kernel: str | None = None,
    emit: str = "auto",
    **unknown,
) -> Callable:
    """Split every `dot_general` of `fn` into tiles of at most `max_m x max_k x max_n`.

    A limit left as `None` does not split that dimension; at least one limit is
    required, and all three with `kernel="ffi"` (every tile then runs on the C
    GEMM kernel, which rejects larger tiles). `emit` is `"unroll"`, `"loop"` or
    `"auto"` (loop above `LOOP_ABOVE` tiles in one product; see the module
    docstring). Usable bare, `split_gemm(f, max_m=64, max_k=64, max_n=64)`, or
    as a decorator.
    """
    reject_positional("split_gemm", fn, positional, "max_m=64, max_k=64, max_n=64")
    reject_unknown("split_gemm", unknown, ("max_m", "max_k", "max_n", "kernel", "emit"))
    limits = tuple(_check_limit(n, v) for n, v in zip(("max_m", "max_k", "max_n"), (max_m, max_k, max_n)))
    if all(v is None for v in limits):
        raise ConfigError("split_gemm: give at least one of max_m, max_k, max_n (positive ints)")
    if kernel not in _KERNELS:
        raise ConfigError(f"split_gemm: kernel must be None (XLA) or 'ffi' (C GEMM), got {kernel!r}")
    if kernel == "ffi" and None in limits:
        raise ConfigError(
            "split_gemm: kernel='ffi' emulates a fixed-size GEMM unit; give all of max_m, max_k, max_n"
        )
    if emit not in _EMITS:
        raise ConfigError(f"split_gemm: emit must be one of {', '.join(map(repr, _EMITS))}, got {emit!r}")
    if fn is None:
        return functools.partial(split_gemm, max_m=max_m, max_k=max_k, max_n=max_n, kernel=kernel, emit=emit)
    splitter = _Splitter(limits, kernel, emit)

    def make_rules(closed):
        return {
            "dot_general": functools.partial(_dot_rule, splitter),
            "dense": functools.partial(_dense_rule, splitter),
        }

    return transform(fn, "split_gemm", make_rules, refuse={
        "swap_backend": "kernel calls cannot be split; use swap_backend(split_gemm(f))",
    })


_TILE = re.compile(r"^(.*?)/?gemm_tile_m\d+_k\d+_n\d+(/|$)")
_LOOP = re.compile(r"^(.*?)/?gemm_tile_loop_m(\d+)_k(\d+)_n(\d+)(/|$)")


def tiles_per_layer(graph) -> dict[str, int]:
    """`{layer scope: number of GEMM tiles}` in the `jtile.Graph` (or inlined
    `ClosedJaxpr`) of a function made by `split_gemm`.

    Tiles are counted by their scope names (a loop's name carries its tile
    grid), so two products in one scope share a count.
    """
    graph = graph if isinstance(graph, Graph) else Graph.of(graph)
    tiles: dict[str, set] = {}
    loops: dict[str, dict[str, int]] = {}
    for op in graph.all_ops():
        scope = scope_name(op.eqn)
        match = _TILE.match(scope)
        if match:
            tiles.setdefault(match.group(1), set()).add(match.group(0).rstrip("/"))
        elif match := _LOOP.match(scope):
            grid = math.prod(int(g) for g in match.group(2, 3, 4))
            loops.setdefault(match.group(1), {})[match.group(0).rstrip("/")] = grid
    counts = {layer: len(names) for layer, names in tiles.items()}
    for layer, grids in loops.items():
        counts[layer] = counts.get(layer, 0) + sum(grids.values())
    return counts


def tile_count(m: int, k: int, n: int, *, max_m=None, max_k=None, max_n=None) -> int:
    """How many tiles `split_gemm` makes of an `(m, k) @ (k, n)` product."""
    return math.prod(len(_ranges(size, step)) for size, step in ((m, max_m), (k, max_k), (n, max_n)))


__all__ = ["bounded_dense", "split_gemm", "tiles_per_layer", "tile_count"]
