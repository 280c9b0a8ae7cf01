"""The one jaxpr interpreter every jtile transform is built on.

A transform is a rule table `{primitive name: rule}`. `eval_jaxpr` walks a
jaxpr equation by equation under the caller's trace; an equation whose
primitive has a rule calls `rule(eqn, *invals)`, any other is re-bound
unchanged. `jit`, `closed_call`, `remat` and the custom-derivative calls are
inlined, and the bodies of `cond`, `scan` and `while` are interpreted through
the public `lax` functions, so a conv inside `jax.nn.relu`, a `lax.scan` body
or a nested `jax.jit` is still seen by the rules.

Three layers, as in equinox: `eval_jaxpr` (evaluate with rules),
`rewrite` (jaxpr -> jaxpr), and `transform` (fn -> fn, filter semantics).

!!! warning

    Custom derivatives are inlined: a transformed function differentiates
    through the primal computation, not through the original custom rule.
"""

import contextlib
import functools
import gc
import hashlib
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
from jax import lax
from jax._src import source_info_util

from ._errors import ConfigError

Rule = Callable[..., Any]
Rules = Mapping[str, Rule]

_INLINED = {
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def _split_closed(jaxpr) -> tuple[jcore.Jaxpr, list]:
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def _closed_fn(closed: jcore.ClosedJaxpr, rules: Rules) -> Callable:
    return lambda *args: eval_jaxpr(closed.jaxpr, closed.consts, *args, rules=rules)


def _eval_cond(eqn, invals, rules):
    index, *operands = invals
    branches = [_closed_fn(b, rules) for b in eqn.params["branches"]]
    return lax.switch(index, branches, *operands)


def scan_layout(params: Mapping[str, Any]) -> tuple[int, int]:
    """`(number of consts, number of carries)` among a `scan` equation's inputs.

    jax 0.10 gives them as `num_consts` / `num_carry`; jax 0.11 and later as
    the flat tree `ft_in`, whose three parts are consts, carries and xs.
    """
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


def _eval_scan(eqn, invals, rules):
    p = eqn.params
    nc, ncarry = scan_layout(p)
    consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    body = _closed_fn(p["jaxpr"], rules)

    def step(c, x):
        out = body(*consts, *c, *x)
        return out[:ncarry], out[ncarry:]

    carry, ys = lax.scan(
        step, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


def _eval_while(eqn, invals, rules):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    cond = _closed_fn(p["cond_jaxpr"], rules)
    body = _closed_fn(p["body_jaxpr"], rules)
    return lax.while_loop(
        lambda c: cond(*cconsts, *c)[0], lambda c: body(*bconsts, *c), list(init)
    )


CONTROL_FLOW = {"cond": _eval_cond, "scan": _eval_scan, "while": _eval_while}


def bind(eqn: jcore.JaxprEqn, *invals) -> list:
    """Re-bind `eqn`'s primitive on `invals`; always returns a list."""
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def eval_jaxpr(jaxpr: jcore.Jaxpr, consts, *args, rules: Rules, default: Rule | None = None) -> list:
    """Evaluate `jaxpr` on `args` under the current trace, applying `rules`.

    A rule is called as `rule(eqn, *invals)` and returns the output value, or a
    list of them when the primitive has multiple results. `default`, if given,
    is the rule of every equation without one, in place of re-binding,
    inlining or interpreting control flow (an observer's hook).
    """
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
            rule = rules.get(name, default)
            if rule is not None:
                out = rule(eqn, *invals)
                out = list(out) if eqn.primitive.multiple_results else [out]
            elif name in _INLINED:
                inner, inner_consts = _split_closed(eqn.params[_INLINED[name]])
                out = eval_jaxpr(inner, inner_consts, *invals, rules=rules)
            elif name in CONTROL_FLOW:
                out = CONTROL_FLOW[name](eqn, invals, rules)
            else:
                out = bind(eqn, *invals)
        for v, x in zip(eqn.outvars, out):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def rewrite(closed: jcore.ClosedJaxpr, rules: Rules) -> jcore.ClosedJaxpr:
    """Return the jaxpr that `eval_jaxpr` with `rules` produces from `closed`."""
    avals = [v.aval for v in closed.jaxpr.invars]
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return jax.make_jaxpr(_closed_fn(closed, rules))(*args)


def inline(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """`closed` with every call the interpreter inlines flattened into it, so
    that only `cond`, `scan` and `while` keep sub-jaxprs."""
    return rewrite(closed, {})


@contextlib.contextmanager
def gc_paused():
    """Tracing makes many small objects; the collector's full passes over a large
    heap (jax, a loaded ONNX model) cost as much as the tracing itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def is_known(x) -> bool:
    """Whether `x` has a value now (a constant, a folded param), not a tracer."""
    return not isinstance(x, jax.core.Tracer)


def eager_if_known(*values):
    """A context that evaluates jnp ops now when every one of `values` is known
    (`is_known`), so that work on weights happens once at trace time instead of
    on every call."""
    return jax.ensure_compile_time_eval() if all(map(is_known, values)) else contextlib.nullcontext()


def on_host(x):
    """A known `x` as a numpy array, a traced one as is: numpy rearranges weights
    without compiling anything, where each shape's jnp op is an XLA compilation
    (2 s of ResNet-50's first `swap_backend`)."""
    return np.asarray(x) if is_known(x) else x


def to_device(x):
    """A numpy array made from `on_host` values as a known jax array, even under
    `jit` (where a bare `device_put` is traced, and the kernels would take the
    value as unknown: a constant bias passed in full, a weight left unpacked);
    `jnp.asarray` would compile a copy per shape. Anything else as is."""
    if not isinstance(x, np.ndarray):
        return x
    with jax.ensure_compile_time_eval():
        return jax.device_put(np.ascontiguousarray(x))


_SHARED: "weakref.WeakValueDictionary[tuple, jax.Array]" = weakref.WeakValueDictionary()

SMALL_CONSTANT_BYTES = 1024  # `jtile.jit` embeds closed-over arrays this small, as jax does


def shared(x):
    """`x`, or an equal known array made earlier and still alive.

    Folded and packed weights are computed again on every trace (one per input
    shape); through `shared` every trace hands jax the same array objects, so
    with hoisted constants (`jtile.jit`) all the
    executables of a function share one copy of the weights. Arrays of at most
    `SMALL_CONSTANT_BYTES` stay embedded in each executable, so they are not
    looked up.
    """
    if not isinstance(x, jax.Array) or not is_known(x) or x.nbytes <= SMALL_CONSTANT_BYTES:
        return x
    data = np.asarray(x)
    key = (data.shape, data.dtype.str, hashlib.blake2b(np.ascontiguousarray(data), digest_size=16).digest())
    return _SHARED.setdefault(key, x)


# ---------------------------------------------------------------- fn -> fn


def is_array(x) -> bool:
    """Array leaves are traced; every other leaf is static (as `equinox.is_array`)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _static_key(where: str, leaf):
    try:
        hash(leaf)
    except TypeError:
        raise ConfigError(
            f"{where}: non-array argument {leaf!r} of type {type(leaf).__name__} is "
            "unhashable; static arguments must be hashable (wrap arrays as jnp arrays)"
        ) from None
    return (type(leaf), leaf)


def _check_outputs(where: str, out) -> None:
    for leaf in jax.tree.leaves(out):
        if not isinstance(leaf, jax.Array):
            raise ConfigError(
                f"{where}: the function must return arrays or pytrees of arrays, but one "
                f"output is {type(leaf).__name__} {leaf!r}; return jnp arrays instead"
            )


class Traced:
    """A function traced once per argument signature: its jaxpr and trees."""

    def __init__(self, where: str, fn: Callable, args: tuple, kwargs: dict):
        leaves, self.in_tree = jax.tree.flatten((args, kwargs))
        self.mask = [is_array(x) for x in leaves]
        self.static = [None if m else x for x, m in zip(leaves, self.mask)]
        dynamic = [x for x, m in zip(leaves, self.mask) if m]
        out_tree = []

        def flat_fn(*dyn):
            a, kw = self._rebuild(dyn)
            out = fn(*a, **kw)
            _check_outputs(where, out)
            flat, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return flat

        try:
            with gc_paused():
                self.jaxpr = inline(jax.make_jaxpr(flat_fn)(*dynamic))
        except TypeError as e:
            if "is not a valid JAX type" in str(e):
                raise ConfigError(
                    f"{where}: the function must return arrays or pytrees of arrays ({e})"
                ) from None
            raise
        self.out_tree = out_tree[0]

    def _rebuild(self, dynamic):
        it = iter(dynamic)
        leaves = [next(it) if m else s for m, s in zip(self.mask, self.static)]
        return jax.tree.unflatten(self.in_tree, leaves)

    @staticmethod
    def signature(where: str, args: tuple, kwargs: dict):
        leaves, tree = jax.tree.flatten((args, kwargs))
        sig = tuple(
            (tuple(x.shape), np.dtype(x.dtype), getattr(jax.typeof(x), "weak_type", False))
            if is_array(x)
            else _static_key(where, x)
            for x in leaves
        )
        return tree, sig

    def dynamic_leaves(self, args: tuple, kwargs: dict) -> list:
        return [x for x in jax.tree.leaves((args, kwargs)) if is_array(x)]


def trace(where: str, fn: Callable, args: tuple, kwargs: dict, cache: dict) -> Traced:
    """Trace `fn` on the arguments' signature, reusing `cache`."""
    key = Traced.signature(where, args, kwargs)
    if key not in cache:
        cache[key] = Traced(where, fn, args, kwargs)
    return cache[key]


def applied(fn: Callable) -> tuple[str, ...]:
    """The jtile transforms `fn` is the result of, innermost first."""
    return getattr(fn, "__jtile_transforms__", ())


def refuse_after(fn: Callable, where: str, refuse: Mapping[str, str]) -> None:
    """Raise if `fn` already went through a transform that `where` cannot follow.

    `refuse` maps a transform name to the reason and the order to use instead,
    so that a composition is never a silent no-op.
    """
    for inner in applied(fn):
        if inner in refuse:
            raise ConfigError(f"{where}: the function was already transformed by {inner}: {refuse[inner]}")


def transform(
    fn: Callable, where: str, make_rules: Callable[[jcore.ClosedJaxpr], Rules],
    refuse: Mapping[str, str] = {},
) -> Callable:
    """Wrap `fn` so that calls evaluate its jaxpr with a fresh `make_rules(jaxpr)` table.

    `make_rules` receives the (inlined) jaxpr about to be evaluated, so rules may
    plan on the whole graph first, and it is called once per evaluation, so rules
    may keep per-call state (a layer counter, say). `refuse` lists the transforms
    `where` cannot follow (see `refuse_after`).
    """
    if not callable(fn):
        raise ConfigError(f"{where}: expected a function to transform, got {fn!r}")
    refuse_after(fn, where, refuse)
    cache: dict = {}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        traced = trace(where, fn, args, kwargs, cache)
        closed = traced.jaxpr
        out = eval_jaxpr(
            closed.jaxpr, closed.consts, *traced.dynamic_leaves(args, kwargs), rules=make_rules(closed)
        )
        return jax.tree.unflatten(traced.out_tree, out)

    wrapped.__jtile_cache__ = cache
    wrapped.__jtile_transforms__ = (*applied(fn), where)
    return wrapped


def make_jaxpr(fn: Callable, *args, **kwargs) -> jcore.ClosedJaxpr:
    """The inlined jaxpr of `fn` with filter semantics, for analysis and scheduling."""
    return Traced("jtile", fn, args, kwargs).jaxpr


def iter_eqns(jaxpr: jcore.Jaxpr):
    """Every equation of `jaxpr` and of its sub-jaxprs, depth first, in program order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from iter_eqns(sub)
