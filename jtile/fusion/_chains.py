"""The chain recipes: batch-norm folding, dense (dot + bias + act), conv + bias + act.

`Affine` folds the elementwise affine ops that follow a conv or a dot, which is
how batch norm is lowered (`(y - mean) * scale + beta`, or `/ sqrt(var + eps)
* gamma`): a chain of `add`, `sub`, `mul`, `div` whose other operand is a
scalar or varies along one axis becomes `op(x, w * s) + t`. The scale `s` goes
into whichever operand owns that output axis (the conv's output-feature axis,
either free side of a dot), so `x @ W` and `W @ x` both fold. The folded weight
is computed in the graph: with traced params XLA folds nothing; close over the
params (`fold_params`) to get folded constants.

`BiasAct` turns `op -> add(bias) -> activation` into one `conv_bias_act` or
`dense` op. A chain also takes one residual before its activation: an `add`
whose other operand has the output's shape (a ResNet's or a transformer's
shortcut), or another chain (a downsampling shortcut, finished first and
added). The
bias may be on either side of the add; it must be a scalar or vary along one
output axis (for a conv, the feature axis). Activations recognised:

- `max` with a scalar literal (relu when 0), `min` with one, `clamp` with two
  (relu6, Clip), in any combination that is a clip;
- `logistic` (sigmoid);
- hard sigmoid: an affine map with scalar literals, one clip, an affine map,
  that together are `clip(alpha * y + beta, 0, 1)` (ONNX HardSigmoid,
  `jax.nn.hard_sigmoid`'s `relu6(y + 3) / 6`);
- activations whose branches of ops on `y` meet again, which the plan accepts
  together: leaky relu, `select_n(y >= 0, alpha * y, y)` (`jax.nn.leaky_relu`,
  `jnp.where`); SiLU, `y * sigmoid(y)`; hard swish, `y * hard_sigmoid(y)`
  (ONNX HardSwish, `jax.nn.hard_swish`); GELU, `y * Phi(y)` written with
  `erf` or `erfc` and scalar literals (`jax.nn.gelu`, ONNX Gelu, torch's
  opset-17 export `y * (1 + erf(y / sqrt 2)) * 0.5`) and its tanh
  approximation (`jax.nn.gelu(approximate=True)`, torch's `tanh` export).

A value with several uses is a *shared* chain: each op on a branch is held
back (`Deferred`) until the branches meet, and if they form no activation the
value is still computed once.

!!! warning

    Only the exact forms named are recognised (GELU's tanh approximation with
    its constants 0.044715 and sqrt(2 / pi)); anything else stays in XLA after
    the fused op, with `y` computed once.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _fused
from .._interpreter import bind
from .._layers import dense_weight_axis
from .._views import keeps_order
from ._plan import ChainRecipe, Deferred, Pending, finish_pending

_AFFINE = frozenset({"add", "sub", "mul", "div"})


def _axes(shape, ndim: int):
    """Non-unit axes of an operand broadcast against a rank-`ndim` output, or `None`."""
    if len(shape) == 0:
        return ()
    if len(shape) != ndim:
        return None
    return tuple(i for i, n in enumerate(shape) if n != 1)


def _floating(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def _per_axis_operand(eqn, pos: int) -> bool:
    out = eqn.outvars[0].aval
    other = eqn.invars[1 - pos].aval
    axes = _axes(other.shape, out.ndim)
    return _floating(out) and axes is not None and len(axes) <= 1


def _full_operand(eqn, pos: int) -> bool:
    """The other operand of `eqn` has its output's shape and dtype (a residual)."""
    out, other = eqn.outvars[0].aval, eqn.invars[1 - pos].aval
    return _floating(out) and tuple(other.shape) == tuple(out.shape) and other.dtype == out.dtype


def _output_axes(eqn) -> frozenset:
    """Output axes a per-axis scale or bias may vary along."""
    if eqn.primitive.name == "conv_general_dilated":
        return frozenset({eqn.params["dimension_numbers"].out_spec[1]})
    return frozenset(range(eqn.outvars[0].aval.ndim))


def _fits(shape, ndim: int, allowed: frozenset) -> bool:
    axes = _axes(shape, ndim)
    return axes is not None and len(axes) <= 1 and set(axes) <= allowed


def _scale_operand(eqn, x, w, scale):
    """`(x, w)` with the per-axis `scale` of the output multiplied into one of them."""
    shape = np.shape(scale)
    axes = _axes(shape, eqn.outvars[0].aval.ndim)
    vec = jnp.reshape(scale, (-1,)) if axes else jnp.reshape(scale, ())
    if eqn.primitive.name == "conv_general_dilated":
        operand, dim = 1, eqn.params["dimension_numbers"].rhs_spec[0]
    else:
        operand, dim = _dot_owner(eqn, axes[0] if axes else None)
    target = (x, w)[operand]
    if axes:
        bshape = [1] * target.ndim
        bshape[dim] = vec.shape[0]
        vec = jnp.reshape(vec, bshape)
    scaled = (target * vec).astype(target.dtype)
    return (scaled, w) if operand == 0 else (x, scaled)


def _dot_owner(eqn, axis):
    """(operand index, dim) of a dot_general output `axis`; rhs for a scalar."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.ndim for v in eqn.invars)
    lf = [d for d in range(lhs) if d not in lc and d not in lb]
    rf = [d for d in range(rhs) if d not in rc and d not in rb]
    if axis is None:
        return 1, None
    if axis < len(lb):
        return 0, lb[axis]
    if axis < len(lb) + len(lf):
        return 0, lf[axis - len(lb)]
    return 1, rf[axis - len(lb) - len(lf)]


@dataclasses.dataclass(frozen=True)
class _Chain:
    eqn: object
    invals: tuple
    scale: object = None
    shift: object = None
    activation: tuple | None = None
    residual: object = None
    shared: bool = False  # the value branches into an activation's several uses (see `BiasAct.branch`)
    view: tuple | None = None  # the shape a dense chain was reshaped to on its way (see `BiasAct`)


def _as_dtype(value, dtype):
    return lax.convert_element_type(value, dtype)


class Affine(ChainRecipe):
    """fold_batchnorm: conv/dot followed by add/sub/mul/div with per-axis operands."""

    starts = frozenset({"conv_general_dilated", "dot_general"})
    continues = _AFFINE

    def accepts(self, eqn, pos, consts):
        name = eqn.primitive.name
        return name in _AFFINE and not (name == "div" and pos == 1) and _per_axis_operand(eqn, pos)

    def start(self, eqn, invals):
        return _Chain(eqn, tuple(invals))

    def step(self, states, eqn, invals, consts):
        if len(states) != 1:
            return None
        ((pos, chain),) = states.items()
        name, c = eqn.primitive.name, invals[1 - pos]
        s, t = chain.scale, chain.shift
        if name == "add":
            t = c if t is None else t + c
        elif name == "sub" and pos == 0:
            t = -c if t is None else t - c
        elif name == "sub":
            s = -1.0 if s is None else -s
            t = c if t is None else c - t
        elif name == "mul":
            s = c if s is None else s * c
            t = None if t is None else t * c
        else:
            s = 1.0 / c if s is None else s / c
            t = None if t is None else t / c
        ndim = chain.eqn.outvars[0].aval.ndim
        if s is not None and not _fits(np.shape(s), ndim, _output_axes(chain.eqn)):
            return None
        return dataclasses.replace(chain, scale=s, shift=t)

    def finish(self, chain):
        x, w = chain.invals
        if chain.scale is not None:
            x, w = _scale_operand(chain.eqn, x, w, chain.scale)
        y = bind(chain.eqn, x, w)[0]
        return y if chain.shift is None else y + _as_dtype(chain.shift, y.dtype)


def _clip_step(activation: tuple, name: str, pos: int, consts: tuple) -> tuple | None:
    """`activation` followed by a max / min / clamp with constants, as one clip."""
    bounds = {(): (-math.inf, math.inf), ("relu",): (0.0, math.inf)}.get(activation)
    if bounds is None and activation[0] != "clip":
        return None
    lo, hi = bounds or activation[1:]
    if name == "max":
        lo = max(lo, consts[1 - pos])
    elif name == "min":
        hi = min(hi, consts[1 - pos])
    else:
        lo, hi = max(lo, consts[0]), min(hi, consts[2])
    if lo > hi:
        return None
    return ("relu",) if (lo, hi) == (0.0, math.inf) else ("clip", lo, hi)


_BRANCH_OPS = 8  # most ops on one branch of an activation (ONNX HardSwish has 4, leaky relu 1)


def _branches_meet(users: list, consts: dict, all_users: dict, names: frozenset) -> frozenset:
    """The ids of the ops on the branches before they meet, if the uses of a
    chain `y` are the branches of one activation: each runs through ops among
    `names` (each result used once; where an op's other operand is neither a
    scalar literal nor derived from `y`, the activation is not recognised and
    the chain ends there), and all end in one join, a `mul` or `select_n` (`y *
    sigmoid(y)`, `y * clip(y / 6 + 0.5, 0, 1)`, `where(y >= 0, y, alpha *
    y)`); else an empty set."""
    paths = []
    for eqn, _, outs in users:
        path = [eqn]
        while len(outs) == 1 and len(all_users.get(outs[0], ())) == 1 and len(path) <= _BRANCH_OPS:
            ((eqn, _, outs),) = all_users[outs[0]]
            path.append(eqn)
        paths.append(path)
    ids = [[id(e) for e in path] for path in paths]
    join = next((e for e in paths[0] if all(id(e) in i for i in ids)), None)
    if join is None or join.primitive.name not in ("mul", "select_n"):
        return frozenset()
    before = [e for path, i in zip(paths, ids) for e in path[: i.index(id(join))]]
    if all(e.primitive.name in names and None in consts[id(e)] for e in before):
        return frozenset(id(e) for e in before)
    return frozenset()


def _unwind(state):
    """`(chain, [(primitive, pos, consts), ...])`: the chain a run of deferred
    ops starts from, and the ops in order, or None if it is not one run."""
    ops = []
    while isinstance(state, Deferred):
        pending = [(i, x) for i, x in enumerate(state.invals) if isinstance(x, Pending)]
        if len(pending) != 1:
            return None
        ((pos, value),) = pending
        ops.append((state.eqn.primitive.name, pos, state.consts))
        state = value.state
    return (state, ops[::-1]) if isinstance(state, _Chain) else None


def _hard_gate(ops, activation: tuple) -> tuple | None:
    """`(alpha, beta)` if `activation` then `ops` compute `clip(alpha * y + beta,
    0, 1)`: an affine map with scalar literals, one clip, an affine map, in any
    form (`clip(y * alpha + beta, 0, 1)` as ONNX HardSigmoid lowers, `relu6(y +
    3) / 6` as `jax.nn.hard_sigmoid` writes it), else None."""
    if activation not in ((), ("relu",)) and activation[0] != "clip":
        return None
    (a, b), (p, q) = (1.0, 0.0), (1.0, 0.0)  # clip(a y + b, lo, hi) * p + q
    clipped = bool(activation)
    lo, hi = {(): (-math.inf, math.inf), ("relu",): (0.0, math.inf)}.get(activation, activation[1:])
    for name, pos, consts in ops:
        if name not in ("max", "min", "clamp", "mul", "div", "add"):
            return None
        c = consts[1 - pos] if name != "clamp" else None
        if name in ("max", "min", "clamp"):
            if (p, q) != (1.0, 0.0):  # a second clip
                return None
            clipped = True
            if name == "max":
                lo = max(lo, c)
            elif name == "min":
                hi = min(hi, c)
            else:
                lo, hi = max(lo, consts[0]), min(hi, consts[2])
            continue
        if name == "mul":
            scale, shift = c, 0.0
        elif name == "div" and pos == 0:
            scale, shift = 1.0 / c, 0.0
        elif name == "add":
            scale, shift = 1.0, c
        else:  # c / y
            return None
        if clipped:
            p, q = p * scale, q * scale + shift
        else:
            a, b = a * scale, b * scale + shift
    if not (math.isfinite(lo) and math.isfinite(hi)) or p <= 0:
        return None
    if abs(p * lo + q) > 1e-6 or abs(p * hi + q - 1.0) > 1e-6:
        return None
    return p * a, p * b + q


def _hard_sigmoid(deferred):
    """The chain with a hard sigmoid activation that `deferred` computes, or None."""
    unwound = _unwind(deferred)
    if unwound is None or unwound[0].shared:
        return None
    chain, ops = unwound
    gate = _hard_gate(ops, chain.activation)
    return None if gate is None else dataclasses.replace(chain, activation=("hard_sigmoid", *gate))


def _swish(states: dict):
    """`y * gate(y)` over one shared chain `y`: silu when the gate is a
    sigmoid, hard_swish when it is a hard sigmoid."""
    chains = [s for s in states.values() if isinstance(s, _Chain)]
    gates = [_unwind(s) for s in states.values() if isinstance(s, Deferred)]
    if len(chains) != 1 or len(gates) != 1 or gates[0] is None or gates[0][0] is not chains[0]:
        return None
    (y,), ((_, ops),) = chains, gates
    if y.activation:
        return None
    if [name for name, _, _ in ops] == ["logistic"]:
        return dataclasses.replace(y, shared=False, activation=("silu",))
    gate = _hard_gate(ops, ())
    return None if gate is None else dataclasses.replace(y, shared=False, activation=("hard_swish", *gate))


_SQRT_HALF, _TANH_K1 = math.sqrt(0.5), math.sqrt(2 / math.pi)
_TANH_K3 = 0.044715 * _TANH_K1


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * abs(b)


def _gelu_form(state, root):
    """What `state` computes from the shared chain `root`, as far as GELU needs:
    `("lin", a, b)` for `a y + b`, `("square", k)` for `k y^2`, `("poly", k1,
    k3)` for `k1 y + k3 y^3`,
    `("erf", s)` for `erf(s y)`, `("tanh",)` for GELU's `tanh(sqrt(2 / pi) (y
    + 0.044715 y^3))`, `("phi", k)` / `("phi_tanh", k)` for `k` times the
    normal CDF Phi(y) / its tanh approximation, and `("gelu", k)` /
    `("gelu_tanh", k)` for `k y` times those; None for anything else."""
    if state is root:
        return ("lin", 1.0, 0.0)
    if not isinstance(state, Deferred):
        return None
    args = []
    for x, c in zip(state.invals, state.consts):
        form = _gelu_form(x.state, root) if isinstance(x, Pending) else None if c is None else ("lin", 0.0, c)
        if form is None:
            return None
        args.append(form)
    if state.eqn.primitive.name == "integer_pow":
        args.append(("lin", 0.0, float(state.eqn.params["y"])))
    return _combine(state.eqn.primitive.name, args)


def _odd(form) -> tuple | None:
    """`(k1, k3)` if `form` is `k1 y + k3 y^3`."""
    if form[0] == "lin" and form[2] == 0.0:
        return form[1], 0.0
    return form[1:] if form[0] == "poly" else None


def _scaled(form, c: float):
    kind, *v = form
    if kind in ("lin", "poly"):
        return (kind, v[0] * c, v[1] * c)
    return (kind, v[0] * c) if kind in ("square", "phi", "phi_tanh", "gelu", "gelu_tanh") else None


def _combine(name: str, args: list):
    """`_gelu_form` of `name` applied to operands of the forms `args`."""
    const = [a[2] for a in args if a[0] == "lin" and a[1] == 0.0]
    others = [a for a in args if not (a[0] == "lin" and a[1] == 0.0)]
    if name == "neg":
        return _scaled(args[0], -1.0)
    if name in ("erf", "erfc", "tanh") and _odd(args[0]) is not None:
        k1, k3 = _odd(args[0])
        if name == "erf" and k3 == 0.0:
            return ("erf", k1)
        if name == "erfc":  # erfc(-y / sqrt 2) = 2 Phi(y)
            return ("phi", 2.0) if k3 == 0.0 and _near(k1, -_SQRT_HALF) else None
        return ("tanh",) if _near(k1, _TANH_K1) and _near(k3, _TANH_K3) else None
    if name in ("pow", "integer_pow") and const == [3.0] and len(others) == 1 and others[0][0] == "lin":
        return ("poly", 0.0, others[0][1] ** 3) if others[0][2] == 0.0 else None
    if name == "div" and args[1][0] == "lin" and args[1][1] == 0.0 and args[1][2] != 0.0:
        return _scaled(args[0], 1.0 / args[1][2])
    if name == "mul" and const and len(args) == 2:
        return _scaled(others[0], const[0]) if others else ("lin", 0.0, const[0] * const[1])
    if name == "mul" and len(others) == 2:  # a y * b y, k y^2 * a y, a y * k Phi(y)
        ys = [o for o in others if o[0] == "lin" and o[2] == 0.0]
        squares = [o for o in others if o[0] == "square"]
        cdfs = [o for o in others if o[0] in ("phi", "phi_tanh")]
        if len(ys) == 2:
            return ("square", ys[0][1] * ys[1][1])
        if len(ys) == 1 and squares:
            return ("poly", 0.0, ys[0][1] * squares[0][1])
        if len(ys) == 1 and cdfs:
            return ("gelu" if cdfs[0][0] == "phi" else "gelu_tanh", ys[0][1] * cdfs[0][1])
        return None
    if name == "add" and len(others) == 2 and None not in map(_odd, others):
        (a1, a3), (b1, b3) = map(_odd, others)
        return ("poly", a1 + b1, a3 + b3)
    if name == "add" and const == [1.0] and len(others) == 1:  # 1 + erf(y / sqrt 2) = 2 Phi(y)
        (other,) = others
        if other[0] == "erf" and _near(other[1], _SQRT_HALF):
            return ("phi", 2.0)
        return ("phi_tanh", 2.0) if other[0] == "tanh" else None
    return None


def _root(state):
    """The chain a state's ops start from (through the first pending operand)."""
    while isinstance(state, Deferred):
        state = next(x.state for x in state.invals if isinstance(x, Pending))
    return state


def _gelu(deferred):
    """The chain with a GELU activation if `deferred` computes `y Phi(y)` from a
    shared chain `y` (`jax.nn.gelu`'s `erfc` form, torch's `erf` export), else None."""
    root = _root(deferred)
    if not (isinstance(root, _Chain) and root.shared and not root.activation):
        return None
    form = _gelu_form(deferred, root)
    if form is None or form[0] not in ("gelu", "gelu_tanh") or not _near(form[1], 1.0):
        return None
    return dataclasses.replace(root, shared=False, activation=(form[0],))


class BiasAct(ChainRecipe):
    """conv_bias_act / dense: `op -> add(bias) -> activation`, one fused op.

    A dense chain continues through reshapes, and transposes of unit axes, that
    keep its elements in order (`view`), so that a shortcut added after them is
    its residual: torch's attention output projection is reshaped from (L, E)
    to (L, 1, E) and transposed to (1, L, E) before the shortcut. Past a view
    the chain takes a residual and an activation, not a bias."""

    _branch_only = frozenset({"ge", "mul", "div", "neg", "erf", "erfc", "tanh", "pow", "integer_pow"})
    _views = frozenset({"reshape", "transpose"})

    def __init__(self, start: str):
        self.starts = frozenset({start})
        self._residuals = start in ("conv_general_dilated", "dot_general")
        self._branch_ops = self._branch_only | {"add", "max", "min", "clamp", "select_n", "logistic"}
        self.continues = self._branch_ops | (self._views if start == "dot_general" else frozenset())

    def accepts(self, eqn, pos, consts):
        name = eqn.primitive.name
        floating = _floating(eqn.outvars[0].aval)
        if name == "add":
            return _per_axis_operand(eqn, pos) or (self._residuals and _full_operand(eqn, pos))
        if name in self._views:
            return name in self.continues and keeps_order(eqn)
        if name in ("max", "min"):
            return consts[1 - pos] is not None and floating
        if name == "select_n":  # the two halves of a leaky relu
            return pos in (0, 1) and len(eqn.invars) == 3
        if name in ("logistic", "mul", "neg", "erf", "erfc", "tanh", "integer_pow"):  # sigmoid, scales, joins, GELU
            return floating
        if name == "pow":
            return pos == 0 and consts[1] is not None and floating
        if name == "div":
            return pos == 0 and consts[1] is not None and floating
        return name == "clamp" and pos == 1 and None not in (consts[0], consts[2])

    def accepts_users(self, users, consts, all_users):
        return _branches_meet(users, consts, all_users, self._branch_ops)

    def start(self, eqn, invals):
        return _Chain(eqn, tuple(invals), activation=())

    def branch(self, state):
        """A chain with several uses is `shared`: ops on it are deferred until
        its branches meet (`_swish`, `_leaky`), so that if they never form an
        activation, the chain is still computed once."""
        return dataclasses.replace(state, shared=True) if isinstance(state, _Chain) else state

    def step(self, states, eqn, invals, consts):
        name = eqn.primitive.name
        if name == "select_n":
            return self._leaky(states, consts)
        if name in ("mul", "add") and len(states) == 2 and len({id(_root(s)) for s in states.values()}) == 1:
            swish = _swish(states) if name == "mul" else None
            deferred = Deferred(eqn, tuple(invals), consts)  # two branches of one chain meet
            return swish or _gelu(deferred) or deferred
        if name == "add" and len(states) == 2:  # two chains meet: a shortcut, for convs only
            return self._residual(states[0], invals[1], eqn) if self._residuals else None
        if len(states) != 1:
            return None
        ((pos, chain),) = states.items()
        if isinstance(chain, Deferred) or chain.shared or name in self._branch_only:
            # an op on one branch of an activation: held back until the branches meet
            if name not in self._branch_ops - {"select_n"} or None in consts[:pos] + consts[pos + 1:]:
                return None
            deferred = Deferred(eqn, tuple(invals), consts)
            return _hard_sigmoid(deferred) or _gelu(deferred) or deferred
        if name in self._views:
            return dataclasses.replace(chain, view=tuple(eqn.outvars[0].aval.shape))
        if name == "logistic":
            return None if chain.activation else dataclasses.replace(chain, activation=("sigmoid",))
        if name == "add":
            ndim = chain.eqn.outvars[0].aval.ndim
            c = invals[1 - pos]
            shape = np.shape(c) if chain.shift is None else np.broadcast_shapes(np.shape(chain.shift), np.shape(c))
            if not chain.activation and chain.view is None and _fits(shape, ndim, _output_axes(chain.eqn)):
                # a bias first, even where a residual's shape fits too (a 1x1 output)
                return dataclasses.replace(chain, shift=c if chain.shift is None else chain.shift + c)
            if self._residuals and _full_operand(eqn, pos):
                return self._residual(chain, c, eqn)
            return None
        activation = _clip_step(chain.activation, name, pos, consts)
        return None if activation is None else dataclasses.replace(chain, activation=activation)

    def _residual(self, chain, other, eqn):
        """`chain + other` with `other` (a value, or a pending chain finished
        here) as the chain's residual, if the chain (a conv, or a dense `x @ w`)
        has none and no activation yet."""
        if not isinstance(chain, _Chain) or chain.shared or chain.activation or chain.residual is not None:
            return None
        if chain.eqn.primitive.name == "dot_general" and dense_weight_axis(chain.eqn) is None:
            return None  # a batched product plus a full operand (attention's mask) stays a matmul
        if isinstance(other, Pending) and not isinstance(other.state, _Chain):
            return None
        residual = finish_pending(self, other)
        shape = tuple(chain.eqn.outvars[0].aval.shape)
        if tuple(residual.shape) != tuple(eqn.outvars[0].aval.shape) or tuple(residual.shape) != (chain.view or shape):
            return None
        return dataclasses.replace(chain, residual=jnp.reshape(residual, shape))

    @staticmethod
    def _leaky(states, consts):
        """`select_n(y >= 0, alpha * y, y)` over one chain `y`: a leaky relu."""
        ge, mul, chain = (states.get(i) for i in range(3))
        if not (isinstance(ge, Deferred) and isinstance(mul, Deferred) and isinstance(chain, _Chain)):
            return None
        at = lambda d: [i for i, x in enumerate(d.invals) if isinstance(x, Pending) and x.state is chain]  # noqa: E731
        if chain.activation or (ge.eqn.primitive.name, mul.eqn.primitive.name) != ("ge", "mul"):
            return None
        if at(ge) != [0] or ge.consts[1] != 0.0 or len(at(mul)) != 1:
            return None
        alpha = mul.consts[1 - at(mul)[0]]
        return dataclasses.replace(chain, shared=False, activation=("leaky_relu", alpha))

    def finish(self, chain):
        y = self._fused(chain)
        return y if chain.view is None else jnp.reshape(y, chain.view)

    @staticmethod
    def _fused(chain):
        eqn, (x, w) = chain.eqn, chain.invals
        if eqn.primitive.name == "dot_general" and chain.shift is None and not chain.activation and chain.residual is None:
            return bind(eqn, x, w)[0]  # nothing absorbed (a residual refused): the product keeps its kind
        dtype = eqn.outvars[0].aval.dtype
        bias = _as_dtype(0.0 if chain.shift is None else chain.shift, dtype)
        params = dict(eqn.params)
        params.pop("out_sharding", None)
        if eqn.primitive.name == "conv_general_dilated":
            residual = None if chain.residual is None else _as_dtype(chain.residual, dtype)
            return _fused.conv_bias_act(x, w, bias, residual, activation=chain.activation, **params)
        residual = None if chain.residual is None else _as_dtype(chain.residual, dtype)
        return _fused.dense(x, w, bias, residual, activation=chain.activation, **params)
