"""Strided views: which layout ops a kernel can read through in place.

A `Strided` is an array read out of a row-major buffer without copying it:
element `idx` of the view is `buffer.ravel()[offset + sum(idx * strides)]`.
Each layout op's registry entry has a `view` facet, `view(eqn, out) -> ViewStep
| None`: which operand its output `out` reads in place and how it maps that operand's
view to its own (a transpose permutes strides, a reshape regroups them when it
can, a slice moves the offset), or, for a multiplication by one number, that
the number scales the data. `strided_source` walks a value's producers back
through such steps to the buffer they all read, so that a kernel (attention's
`Q @ K^T` on the head split of a QKV projection) reads that buffer where it
lies and XLA drops the copies the steps would have made.
"""

import dataclasses
import math
from collections.abc import Callable

import jax.extend.core as jcore
import numpy as np

from ._registry import facet, lookup, register


@dataclasses.dataclass(frozen=True)
class Strided:
    """`shape` read from a flat buffer at `offset + sum(index * strides)`."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def contiguous(shape) -> "Strided":
        shape = tuple(int(n) for n in shape)
        return Strided(0, shape, tuple(math.prod(shape[ax + 1:]) for ax in range(len(shape))))

    def span(self) -> int:
        """One past the last element read (the buffer must hold at least that many)."""
        return self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))


@dataclasses.dataclass(frozen=True)
class ViewStep:
    """What one layout op does to the view of operand `source`: `apply(view)` is
    its output's view (None if the output cannot be read in place), and
    `scale`, if set, is the operand (of one element) the data is multiplied by."""

    source: int
    apply: Callable[[Strided], Strided | None]
    scale: int | None = None


@dataclasses.dataclass(frozen=True)
class StridedSource:
    """A value as a view of `base` (a variable of the same jaxpr) times the
    product of the `scales` operands (variables or literals of one element);
    `steps` are the equations read through."""

    base: jcore.Var
    view: Strided
    scales: tuple
    steps: tuple


def keeps_order(eqn) -> bool:
    """Whether the layout op `eqn` leaves its one operand's elements in order
    (its view of a contiguous input is contiguous, unit axes aside)."""
    make = facet(eqn, "view")
    step = make(eqn, 0) if make is not None else None
    if step is None or step.scale is not None:
        return False
    view = step.apply(Strided.contiguous(eqn.invars[step.source].aval.shape))
    if view is None or view.offset:
        return False
    want = Strided.contiguous(view.shape)
    return all(n == 1 or a == b for n, a, b in zip(view.shape, view.strides, want.strides))


def _steps_back(producers: dict, var) -> list:
    """`(eqn, out, step)` for the layout steps that make `var` from the value
    they read in place, nearest first (see the `view` facet)."""
    chain = []
    while isinstance(var, jcore.Var) and (eqn := producers.get(var)) is not None:
        entry = lookup(eqn)
        step = entry.view(eqn, eqn.outvars.index(var)) if entry is not None and entry.view is not None else None
        if step is None or not isinstance(eqn.invars[step.source], jcore.Var):
            break
        chain.append((eqn, var, step))
        var = eqn.invars[step.source]
    return chain


def strided_source(producers: dict, var) -> StridedSource | None:
    """`var` as a view of the furthest buffer its producers read in place, or
    None if its own producer is not such a step."""
    chain = _steps_back(producers, var)
    var = chain[-1][0].invars[chain[-1][2].source] if chain else var
    view, scales, steps = Strided.contiguous(var.aval.shape), [], []
    for eqn, out, step in reversed(chain):
        moved = step.apply(view)
        if moved is None:  # this step copies: start again from its output
            var, view, scales, steps = out, Strided.contiguous(out.aval.shape), [], []
            continue
        view = moved
        steps.append(eqn)
        if step.scale is not None:
            scales.append(eqn.invars[step.scale])
    return StridedSource(var, view, tuple(scales), tuple(steps)) if steps else None


@dataclasses.dataclass(frozen=True)
class PlaneGather:
    """A value of shape (N, C, *rest) that is `base[:, planes]`: whole planes
    of `base`, of shape (N, C', *rest), in a new order; `steps` are the
    equations read through."""

    base: jcore.Var
    planes: tuple[int, ...]
    steps: tuple


def _elements(view: Strided, flat: np.ndarray) -> np.ndarray:
    """The elements of the row-major buffer `flat` that `view` reads, in its shape."""
    return np.lib.stride_tricks.as_strided(flat[view.offset:], view.shape,
                                           tuple(s * flat.itemsize for s in view.strides))


def _planes_of(index: np.ndarray, base_shape) -> tuple[int, ...] | None:
    """The planes of `base_shape` whose elements, in order, the flat indices
    `index` name, or None if `index` is empty or not whole planes of it."""
    shape = index.shape
    if (len(shape) != len(base_shape) or len(shape) < 2 or shape[0] != base_shape[0] or shape[2:] != base_shape[2:]
            or index.size == 0):
        return None
    plane = math.prod(shape[2:])
    planes = index.reshape(shape[0], shape[1], plane)[0, :, 0] // max(plane, 1)
    per_image = base_shape[1] * plane
    expect = (np.arange(shape[0])[:, None, None] * per_image + planes[None, :, None] * plane
              + np.arange(plane)[None, None, :])
    return tuple(int(p) for p in planes) if np.array_equal(index.reshape(expect.shape), expect) else None


def plane_gather(producers: dict, var) -> PlaneGather | None:
    """`var` as whole planes of the furthest value that the layout steps making
    it read in place, or None: not made by such steps, not whole planes of any
    value they read, or every plane in its own place."""
    chain = _steps_back(producers, var)
    scaled = [i for i, (_, _, step) in enumerate(chain) if step.scale is not None]  # (a scaling computes)
    chain = [(eqn, step) for eqn, _, step in reversed(chain[:scaled[0]] if scaled else chain)]
    for first in range(len(chain)):
        base = chain[first][0].invars[chain[first][1].source]
        index = np.arange(math.prod(base.aval.shape)).reshape(base.aval.shape)
        for eqn, step in chain[first:]:
            view = step.apply(Strided.contiguous(index.shape))
            if view is None:
                break
            index = _elements(view, index.ravel())
        else:
            planes = _planes_of(index, base.aval.shape)
            if planes is not None and planes != tuple(range(base.aval.shape[1])):
                return PlaneGather(base, planes, tuple(eqn for eqn, _ in chain[first:]))
    return None


def _reshaped(view: Strided, new_shape) -> Strided | None:
    """`view` read in `new_shape` (row-major order) without a copy, or None:
    every group of old axes merged or split must be one run in memory."""
    old = [(n, s) for n, s in zip(view.shape, view.strides) if n != 1]
    new = [int(n) for n in new_shape]
    kept = [ax for ax, n in enumerate(new) if n != 1]
    strides = [0] * len(new)
    i = j = 0
    while i < len(old) and j < len(kept):
        oi, nj = i + 1, j + 1
        old_size, new_size = old[i][0], new[kept[j]]
        while old_size != new_size:
            if old_size < new_size:
                old_size *= old[oi][0]
                oi += 1
            else:
                new_size *= new[kept[nj]]
                nj += 1
        if any(old[q][1] != old[q + 1][0] * old[q + 1][1] for q in range(i, oi - 1)):
            return None
        stride = old[oi - 1][1]
        for q in range(nj - 1, j - 1, -1):
            strides[kept[q]] = stride
            stride *= new[kept[q]]
        i, j = oi, nj
    return Strided(view.offset, tuple(new), tuple(strides))


def _transpose(eqn, out: int) -> ViewStep:
    perm = eqn.params["permutation"]
    return ViewStep(0, lambda v: Strided(v.offset, tuple(v.shape[p] for p in perm), tuple(v.strides[p] for p in perm)))


def _regroup(eqn, out: int) -> ViewStep | None:
    """reshape, squeeze, and a broadcast_in_dim that only adds axes of size 1."""
    shape = eqn.outvars[0].aval.shape
    if math.prod(shape) != math.prod(eqn.invars[0].aval.shape) or math.prod(shape) == 0:
        return None
    if eqn.primitive.name == "broadcast_in_dim" and list(eqn.params["broadcast_dimensions"]) != sorted(
            eqn.params["broadcast_dimensions"]):
        return None
    return ViewStep(0, lambda v: _reshaped(v, shape))


def _sliced(start, limit, step) -> Callable[[Strided], Strided]:
    def apply(v: Strided) -> Strided:
        offset = v.offset + sum(a * s for a, s in zip(start, v.strides))
        shape = tuple(-(-(hi - lo) // k) for lo, hi, k in zip(start, limit, step))
        return Strided(offset, shape, tuple(s * k for s, k in zip(v.strides, step)))

    return apply


def _slice(eqn, out: int) -> ViewStep:
    start = eqn.params["start_indices"]
    return ViewStep(0, _sliced(start, eqn.params["limit_indices"], eqn.params["strides"] or (1,) * len(start)))


def _split(eqn, out: int) -> ViewStep:
    """Output `out` of a split: a slice along its axis."""
    shape, axis, sizes = eqn.invars[0].aval.shape, eqn.params["axis"], eqn.params["sizes"]
    start = [0] * len(shape)
    start[axis] = sum(sizes[:out])
    limit = list(shape)
    limit[axis] = start[axis] + sizes[out]
    return ViewStep(0, _sliced(start, limit, (1,) * len(shape)))


def _scaled(eqn, out: int) -> ViewStep | None:
    """`x * s` with `s` of one element and `x` of the output's shape and dtype."""
    out = eqn.outvars[0].aval
    for data, scale in ((0, 1), (1, 0)):
        x, s = eqn.invars[data].aval, eqn.invars[scale].aval
        if x.shape == out.shape and x.dtype == out.dtype == s.dtype and math.prod(np.shape(s)) == 1:
            return ViewStep(data, lambda v: v, scale=scale)
    return None


register("transpose", view=_transpose)
register("slice", view=_slice)
register("split", view=_split)
register("mul", view=_scaled)
for _name in ("reshape", "squeeze", "broadcast_in_dim"):
    register(_name, view=_regroup)
