"""Per-equation simplifications: constant folding, identity removal, dead taps.

`fold_constants` evaluates, at trace time, every equation whose operands are
all known (literals, closed-over arrays, earlier folded results), so the
rewritten jaxpr holds the result as a constant. Parameters passed as function
arguments are traced, not known: close over them (`fold_params`) to fold
them. An equation whose result is larger than `max_growth` times its operands
together and than 4096 elements (a `broadcast_in_dim` of a scalar, an `iota`)
is left to run, so folding never bloats the constants.

`drop_identity` removes ops that return their operand: conversions to the same
dtype, reshapes to the same shape, identity transposes and broadcasts,
squeezes of nothing, `copy`, a `select_n` whose cases are all the same value
(a LeakyReLU of slope 1), and `x * 1`, `x / 1`, `x + 0`, `x - 0` with a
scalar literal. Dropout at inference is already the identity in the zoo and in
the ONNX importer, so it leaves nothing here to remove.

`crop_dead_taps` removes the kernel rows and columns of a convolution that
only ever read padding (`SlidingWindow.live_taps`): a dilated conv whose
dilation exceeds its input, as in DeepLabV3's atrous pyramid on a 14x14 map
(dilation 24 and 36 leave only the centre tap, a 1x1 conv). Where taps are
dead for part of the output only and cutting the output into regions of
uniform live taps (`SlidingWindow.tap_bands`) at least halves the MACs, the
conv becomes one cropped conv per region on its own input window,
concatenated: DeepLabV3's 3x3 at dilation 12 on 14x14 reads rows 2-11
through the centre tap alone, so its 9 regions do 0.18x the MACs (960->256:
4.3 ms -> 1.4 ms on the kernels). Each region holds its own cropped copy of
the kernel (25 taps in all there, against 9).

!!! warning

    A dropped tap multiplied zeros only; with a non-finite weight there
    (Inf * 0 = NaN) the uncropped conv may give NaN where the cropped one
    does not.
"""

import dataclasses
import functools
import math

import jax
import numpy as np
from jax import lax
from jax.extend.core import Literal

from .._geometry import ConvGeometry
from .._regions import Window
from .._graph import Graph
from .._interpreter import CONTROL_FLOW, bind, is_known, on_host, shared, to_device


def _broadcast(x: np.ndarray, params) -> np.ndarray:
    shape, dims = params["shape"], params["broadcast_dimensions"]
    kept = dict(zip(dims, x.shape))
    return np.broadcast_to(x.reshape([kept.get(d, 1) for d in range(len(shape))]), shape)


# Data movement on a known array, done in numpy (`on_host`): the same values,
# and no XLA compilation per shape (on ResNet-50 those were half of
# fold_params' first trace).
_ON_HOST = {
    "reshape": lambda x, p: None if p["dimensions"] else x.reshape(p["new_sizes"]),
    "broadcast_in_dim": _broadcast,
    "transpose": lambda x, p: x.transpose(p["permutation"]),
    "squeeze": lambda x, p: x.squeeze(tuple(p["dimensions"])),
}


def _on_host(eqn, invals) -> list | None:
    """`eqn` evaluated in numpy, when it only moves the data of one known array."""
    host = _ON_HOST.get(eqn.primitive.name)
    out = eqn.outvars[0].aval
    if host is None or len(invals) != 1 or out.weak_type or eqn.params.get("sharding") is not None:
        return None
    y = host(on_host(invals[0]), eqn.params)
    return None if y is None else [to_device(y)]


def _fold_rule(max_growth: float, eqn, *invals):
    out_size = sum(math.prod(v.aval.shape) for v in eqn.outvars)
    in_size = sum(np.size(x) for x in invals)
    small = out_size <= max(4096, max_growth * in_size)
    if small and all(map(is_known, invals)) and not eqn.effects:
        with jax.ensure_compile_time_eval():
            out = [shared(x) for x in _on_host(eqn, invals) or bind(eqn, *invals)]
    else:
        out = bind(eqn, *invals)
    return out if eqn.primitive.multiple_results else out[0]


def fold_constants_rules(closed, max_growth: float = 1.0) -> dict:
    """Rules folding every primitive of `closed` (but calls and control flow)."""
    names = {op.primitive for op in Graph.of(closed).all_ops()} - set(CONTROL_FLOW)
    return {name: functools.partial(_fold_rule, max_growth) for name in names}


def _same(eqn, x) -> bool:
    out = eqn.outvars[0].aval
    return tuple(np.shape(x)) == tuple(out.shape) and np.dtype(x.dtype) == np.dtype(out.dtype)


def _scalar_literal(eqn, pos: int, value: float) -> bool:
    v = eqn.invars[pos]
    return isinstance(v, Literal) and np.size(v.val) == 1 and float(np.asarray(v.val).reshape(())) == value


def _passthrough(eqn, *invals):
    return invals[0] if _same(eqn, invals[0]) else bind(eqn, *invals)[0]


def _neutral(values: dict):
    """Rule for a binary op with a neutral scalar literal `values[pos]` at `pos`."""

    def rule(eqn, *invals):
        for pos, value in values.items():
            other = invals[1 - pos]
            if _scalar_literal(eqn, pos, value) and _same(eqn, other):
                return other
        return bind(eqn, *invals)[0]

    return rule


def drop_identity_rules(closed) -> dict:
    """Rules returning the operand of every op that would not change it."""
    return {
        "convert_element_type": _passthrough,
        "reshape": lambda eqn, x, *dyn: bind(eqn, x, *dyn)[0] if dyn or eqn.params["dimensions"] else _passthrough(eqn, x),
        "squeeze": _passthrough,
        "copy": _passthrough,
        "copy_p": _passthrough,
        "transpose": lambda eqn, x: x if tuple(eqn.params["permutation"]) == tuple(range(x.ndim)) else bind(eqn, x)[0],
        "broadcast_in_dim": lambda eqn, x, *dyn: x if not dyn and _same(eqn, x) else bind(eqn, x, *dyn)[0],
        "select_n": lambda eqn, pred, *cases: cases[0] if all(c is cases[0] for c in cases) else bind(eqn, pred, *cases)[0],
        "mul": _neutral({0: 1.0, 1: 1.0}),
        "div": _neutral({1: 1.0}),
        "add": _neutral({0: 0.0, 1: 0.0}),
        "sub": _neutral({1: 0.0}),
    }


def _crop_dead_taps(eqn, x, w):
    g = ConvGeometry.of(eqn)
    if any(d != 1 for d in g.lhs_dilation):
        return bind(eqn, x, w)[0]
    axes = [g.axis(i) for i in range(len(g.window))]
    bands = [s.tap_bands() for s in axes]
    if all(n > 0 for axis in bands for _, n in axis) and _regions_pay(g, bands):
        return _by_region(eqn, g, x, w, bands)
    return _bind_cropped(eqn, g, x, w, axes)


# A region's conv, slice and concatenation, and the bias, residual and activation
# the split conv no longer fuses, cost some 20-40 us: the kernels' time for ~4M MACs.
_MACS_PER_OP = 4_000_000


def _regions_pay(g: ConvGeometry, bands) -> bool:
    """Whether one conv per region of uniform live taps at least halves the MACs
    and saves more than the extra ops cost (a 3x3 on a 2x2 map does not)."""
    full = math.prod(g.out_shape[2:]) * math.prod(g.window)
    live = math.prod(g.axis(i).live_reads() for i in range(len(bands)))
    saved = g.macs * (full - live) // full
    return 2 * live <= full and saved >= _MACS_PER_OP * math.prod(len(axis) for axis in bands)


def _by_region(eqn, g: ConvGeometry, x, w, bands):
    """The conv as one conv per output region of uniform live taps (each on
    its input window, with its own padding and cropped kernel), concatenated."""

    def region(prefix, x):
        i = len(prefix)
        if i == len(bands):
            return _bind_cropped(eqn, g, x, w, prefix)
        s = g.axis(i)
        parts = []
        for window, _ in bands[i]:
            rows, (lo, hi) = s.input_region(window)
            tile = dataclasses.replace(s, in_size=rows.size, pad_lo=lo, pad_hi=hi)
            parts.append(region([*prefix, tile], lax.slice_in_dim(x, rows.start, rows.stop, axis=g.lhs_spec[2 + i])))
        return parts[0] if len(parts) == 1 else lax.concatenate(parts, g.out_spec[2 + i])

    return region([], x)


def _bind_cropped(eqn, g: ConvGeometry, x, w, axes):
    """`eqn`'s conv over `x` whose spatial axes are `axes` (their padding), its
    kernel cropped to the taps that read `x`."""
    padding, dilation = [(s.pad_lo, s.pad_hi) for s in axes], list(g.dilation)
    crops = []
    for i, s in enumerate(axes):
        live = s.live_taps()
        if live is not None:
            first, last, cropped = live
            rows, padding[i] = cropped.input_region(Window(0, s.out_size))
            if rows.size < s.in_size:  # rows only the dropped taps read
                x = lax.slice_in_dim(x, rows.start, rows.stop, axis=g.lhs_spec[2 + i])
            dilation[i] = cropped.dilation
            crops.append((g.rhs_spec[2 + i], first, last + 1))
    if not crops and tuple(padding) == g.padding:
        return bind(eqn, x, w)[0]
    w = on_host(w)
    for axis, start, stop in crops:
        w = w[(slice(None),) * axis + (slice(start, stop),)] if isinstance(w, np.ndarray) \
            else lax.slice_in_dim(w, start, stop, axis=axis)
    w = to_device(w)
    params = eqn.primitive.get_bind_params({**eqn.params, "padding": tuple(padding), "rhs_dilation": tuple(dilation)})
    return eqn.primitive.bind(x, w, **params)


def crop_dead_taps_rules(closed) -> dict:
    """Rules cropping every convolution's kernel to the taps that read its input."""
    return {"conv_general_dilated": _crop_dead_taps}
