"""`jtile.jit`: compile a function with its closed-over arrays passed in.

`fold_params` and `swap_backend` turn weights into arrays the function closes
over (folded batch norm, packed GEMM strips). `jax.jit` before jax 0.12
embeds such constants in every executable it compiles, so each new input
shape pays for its own copy of the weights (ResNet-18: 50-80 MB a shape).
`jtile.jit` traces the function once per argument signature, then compiles its
jaxpr with the closed-over arrays as arguments: every shape's executable reads
the same buffers.

Two kinds of constant stay embedded: arrays of at most 1 KB (biases, scales:
one executable argument fewer each), and the weight of a conv or dense op that
XLA runs itself (not a C kernel): XLA lays those out for its own conv at
compile time; passed in, they would be re-laid on every call (ResNet-18 folded
but not swapped: twice as slow). A function on the kernels
(`swap_backend(fold_params(...))`) hoists nearly every weight. From jax 0.12,
`jax.jit` itself passes every closed-over array over 1 KB as an argument
(`jax_embedded_constants_max_bytes`); `jtile.jit` lifts that limit for the
executables it compiles, so XLA's own conv weights stay embedded there too
(ResNet-18 folded, jax 0.12.1 on a Zen 5: 13 ms a call embedded, 28 ms passed).

!!! warning

    Arguments follow jtile's filter semantics: array leaves are traced and
    every other leaf is static (hashable), as in `equinox.filter_jit`.
    Hoisted constants are arguments, so XLA cannot fold work on them into the
    executable; work on weights belongs in `fold_params`, which does it once
    at trace time.
"""

import contextlib
import functools
from collections.abc import Callable

import jax
from jax._src import config as jax_config

from ._errors import ConfigError, reject_unknown
from ._graph import Graph, Value
from ._interpreter import SMALL_CONSTANT_BYTES, Traced, eval_jaxpr
from ._registry import facet


def _embedded(const: Value) -> bool:
    """Whether the constant `const` stays in the executable: the weight of a
    conv or dense op that XLA runs itself (one with a registered geometry, not
    a C kernel), or an array of at most `SMALL_CONSTANT_BYTES` (a bias or
    scale; jax embeds those too), one argument fewer a call."""
    small = const.nbytes <= SMALL_CONSTANT_BYTES
    return small or any(facet(op.eqn, "geometry") is not None for op in const.consumers)


def embedding_any_constant() -> contextlib.AbstractContextManager:
    """A context in which `jax.jit` embeds closed-over arrays of any size
    (jax >= 0.12 passes those over `jax_embedded_constants_max_bytes` as
    arguments; earlier jax embeds them all)."""
    limit = getattr(jax_config, "embedded_constants_max_bytes", None)
    return contextlib.nullcontext() if limit is None else limit(2**62)


def _on_device(const, placed: dict) -> jax.Array:
    """`const` as a device array; a host (numpy) array is copied there once,
    however many shapes read it (passed as it is, it would be copied on every
    call: MobileNetV2 on the kernels took 2.45 ms a call, not 2.27)."""
    if isinstance(const, jax.Array):
        return const
    if id(const) not in placed:
        placed[id(const)] = const, jax.device_put(const)
    return placed[id(const)][1]


def _compile(traced: Traced, placed: dict) -> tuple[Callable, list]:
    """The executable's function and the constants it takes as arguments;
    `placed` holds the device copies of host constants, shared by shapes."""
    closed = traced.jaxpr
    embedded = [_embedded(v) for v in Graph.of(closed).consts]
    kept = [c for c, e in zip(closed.consts, embedded) if e]
    hoisted = [_on_device(c, placed) for c, e in zip(closed.consts, embedded) if not e]

    def run(hoisted: list, dynamic: list) -> list:
        passed, closed_over = iter(hoisted), iter(kept)
        consts = [next(closed_over) if e else next(passed) for e in embedded]
        return eval_jaxpr(closed.jaxpr, consts, *dynamic, rules={})

    return jax.jit(run), hoisted


def jit(fn: Callable | None = None, **unknown) -> Callable:
    """Like `jax.jit(fn)`, but the arrays `fn` closes over are passed to the
    compiled executables as arguments, shared by every input shape.

    Works bare and as a decorator (`@jtile.jit`). The result is differentiable
    and may itself be traced (`jax.vmap`, an outer `jax.jit`).
    """
    reject_unknown("jtile.jit", unknown, ())
    if fn is None:
        return jit
    if not callable(fn):
        raise ConfigError(f"jtile.jit: expected a function to compile, got {fn!r}")
    cache: dict = {}
    placed: dict = {}

    def bound(args: tuple, kwargs: dict) -> tuple[Traced, Callable, tuple]:
        key = Traced.signature("jtile.jit", args, kwargs)
        if key not in cache:
            traced = Traced("jtile.jit", fn, args, kwargs)
            cache[key] = traced, *_compile(traced, placed)
        traced, run, hoisted = cache[key]
        return traced, run, (hoisted, traced.dynamic_leaves(args, kwargs))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        traced, run, operands = bound(args, kwargs)
        with embedding_any_constant():
            outs = run(*operands)
        return jax.tree.unflatten(traced.out_tree, outs)

    def lower(*args, **kwargs) -> jax.stages.Lowered:
        """The executable's `jax.stages.Lowered` for these arguments (its
        arguments are the closed-over arrays, then the array leaves)."""
        _, run, operands = bound(args, kwargs)
        with embedding_any_constant():
            return run.lower(*operands)

    call.lower = lower
    return call


__all__ = ["jit"]
