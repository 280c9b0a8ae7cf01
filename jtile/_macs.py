"""Multiply-accumulate counts per primitive, registered as each entry's `macs` facet.

Each primitive maps to a category (grouped as ptflops groups its modules:
conv, dense, pool, norm, activation, elementwise) and a rule giving the MACs
of one equation:

| primitive                         | category    | MACs                                            |
|-----------------------------------|-------------|-------------------------------------------------|
| `conv_general_dilated`            | conv        | out elements * (Cin / groups) * prod(kernel)    |
| `dot_general`                     | dense       | out elements * prod(contracting dims) = B*M*N*K |
| `reduce_window_*`, `reduce_window`| pool        | out elements * prod(window)                     |
| `reduce_*`, `argmax`, `argmin`    | pool        | in elements (global pooling, softmax sums)      |
| `logistic`, `tanh`, `erf`, ...    | activation  | out elements                                    |
| `max`/`min` with a scalar operand | activation  | out elements (relu, relu6)                      |
| other arithmetic (`add`, `mul`..) | elementwise | out elements                                    |
| layout (`reshape`, `pad`, ...)    | layout      | 0                                               |
| `scan`                            | its body's  | length * body                                   |
| `cond`                            | its body's  | the most expensive branch                       |
| `while`                           | its body's  | body + cond, counted once (trip count unknown)  |
| `conv_bias_act`, `dense` (fusion) | conv, dense | as conv / dot, plus bias and activation         |
| `ffi_call` to a `jtile.kernels`   | conv, dense,| as the layer it runs (registered by             |
|   target                          | pool        | `jtile.kernels` beside the target), plus its    |
|                                   |             | bias, residual and activation epilogue          |

The norm category is given by `summary` to the arithmetic of a layer that
computes `rsqrt`/`sqrt` without a conv or dot (batch, layer, group norm).

!!! warning

    A convolution counts the zeros inserted by `lhs_dilation` (transposed
    convolutions) as XLA computes them; ptflops counts input elements instead.
    A primitive missing from this table (an FFI kernel, say) counts 0 MACs and
    is listed by `Summary.uncounted`, never guessed.
"""

import math
from collections import Counter
from collections.abc import Callable

import jax.extend.core as jcore
import numpy as np

from ._geometry import ConvGeometry, DotGeometry
from ._registry import facet, key, register

CATEGORIES = ("conv", "dense", "pool", "norm", "activation", "elementwise")


def out_elements(eqn) -> int:
    return sum(math.prod(v.aval.shape) for v in eqn.outvars)


def _in_elements(eqn) -> int:
    return sum(math.prod(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape"))


def _conv(eqn) -> int:
    return ConvGeometry.of(eqn).macs


def _dot(eqn) -> int:
    return DotGeometry.of(eqn).macs


def _window(eqn) -> int:
    return out_elements(eqn) * math.prod(eqn.params["window_dimensions"])


def _is_scalar(v) -> bool:
    return isinstance(v, jcore.Literal) or math.prod(v.aval.shape) == 1


def _max_min(eqn) -> Counter:
    kind = "activation" if any(_is_scalar(v) for v in eqn.invars) else "elementwise"
    return Counter({kind: out_elements(eqn)})


_RULES: dict[str, tuple[str, Callable]] = {  # registered below, one entry each
    "conv_general_dilated": ("conv", _conv),
    "dot_general": ("dense", _dot),
    **{p: ("pool", _window) for p in (
        "reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window"
    )},
    **{p: ("pool", _in_elements) for p in (
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
        "reduce_or", "argmax", "argmin", "cumsum", "cummax", "cumlogsumexp",
    )},
    **{p: ("activation", out_elements) for p in (
        "logistic", "tanh", "erf", "erfc", "clamp",
    )},
    **{p: ("elementwise", out_elements) for p in (
        "add", "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign", "pow",
        "integer_pow", "square", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1",
        "log", "log1p", "sin", "cos", "tan", "atan2", "asin", "acos", "atan", "sinh",
        "cosh", "asinh", "acosh", "atanh", "floor", "ceil", "round", "nextafter",
        "is_finite", "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
        "not", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic",
        "erf_inv", "lgamma", "digamma", "population_count", "clz",
    )},
    **{p: ("layout", lambda eqn: 0) for p in (
        "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
        "convert_element_type", "copy", "slice", "dynamic_slice",
        "dynamic_update_slice", "concatenate", "pad", "gather", "rev", "iota",
        "stop_gradient", "reduce_precision", "bitcast_convert_type", "device_put",
        "split", "sharding_constraint", "optimization_barrier", "select_and_gather_add",
        "sort", "random_bits", "random_seed", "random_wrap", "random_unwrap",
        "threefry2x32", "mesh_cast", "reshard",
    )},
}


def _scaled(counter: Counter, factor: int) -> Counter:
    return Counter({k: v * factor for k, v in counter.items()})


def _control_flow(eqn, bodies: list[tuple[Counter, set]]) -> tuple[Counter, set]:
    """MACs of control flow from those of its bodies (in `jaxprs_in_params` order)."""
    uncounted = set().union(*(m for _, m in bodies))
    if eqn.primitive.name == "scan":
        return _scaled(bodies[0][0], eqn.params["length"]), uncounted
    if eqn.primitive.name == "cond":
        return max((c for c, _ in bodies), key=lambda c: sum(c.values())), uncounted
    return sum((c for c, _ in bodies), Counter()), uncounted  # while: body + cond, once


def epilogue(eqn, adds: int, activation, out: int | None = None) -> Counter:
    """The bias and residual adds and the activation a fused op or kernel applies
    to its output (`out` elements, by default all the equation's)."""
    out = out_elements(eqn) if out is None else out
    return Counter({"elementwise": out * adds, "activation": out if activation else 0})


def _fused(eqn) -> Counter:
    kind, rule = _RULES["conv_general_dilated" if eqn.primitive.name == "conv_bias_act" else "dot_general"]
    return Counter({kind: rule(eqn)}) + epilogue(eqn, len(eqn.invars) - 2, eqn.params["activation"])


def _counted(kind: str, rule: Callable) -> Callable:
    def macs(eqn) -> Counter:
        n = rule(eqn)
        return Counter({kind: n}) if n else Counter()

    return macs


for _name, (_kind, _rule) in _RULES.items():
    register(_name, macs=_counted(_kind, _rule))
for _name in ("max", "min"):
    register(_name, macs=_max_min)
for _name in ("conv_bias_act", "dense"):
    register(_name, macs=_fused)


def eqn_macs(eqn, bodies: list[tuple[Counter, set]] = ()) -> tuple[Counter, set[str]]:
    """MACs of `eqn` by category, and the ops that had no rule; a
    control-flow equation needs the `(MACs, uncounted)` of its `bodies`."""
    if bodies:
        return _control_flow(eqn, list(bodies))
    rule = facet(eqn, "macs")
    return (Counter(), {key(eqn)}) if rule is None else (rule(eqn), set())
