"""Fusion recipes: `fuse` and each recipe on its own, all `fn -> fn`.

Recipes, applied in this order whatever order they are named in:

- `drop_identity`: remove ops that return their operand (same-dtype converts,
  same-shape reshapes, `x * 1`, ...).
- `crop_dead_taps`: crop each conv's kernel to the taps that read the input
  (a dilated conv larger than its input reads padding with the others).
- `fold_batchnorm`: fold the affine chain after a conv or dot (batch norm as
  the zoo and the ONNX importer lower it) into the weights and one bias add.
- `dense`: `dot_general -> add(bias) [-> add(residual)] -> activation`
  becomes one `dense` op, whichever operand holds the weight (`x @ W + b`,
  `W @ x + b`); the residual is a transformer's shortcut.
- `conv_bias_act`: `conv -> add(bias) [-> add(residual)] -> relu / relu6 /
  clip / leaky relu` becomes one `conv_bias_act` op (see `jtile._fused`),
  which `swap_backend` maps to one kernel call. The residual is a ResNet
  shortcut: a value of the output's shape, or a second conv chain (a
  downsampling shortcut), added before the activation.
- `fold_constants`: evaluate at trace time what depends only on constants.

Two ways to fold, and they differ:

- `fuse(fn)` rewrites the graph. Params stay arguments, so folding batch norm
  puts `w * scale` into the graph; it is computed on every call (XLA cannot
  fold what is an argument).
- `fold_params(fn, params)` closes over `params`, fuses, and folds constants:
  the returned function takes only the remaining arguments and its jaxpr holds
  the folded weights as constants, computed once at trace time.

`drop_identity` comes first so that a no-op convert or reshape between a conv
and its bias does not hide the pattern.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import ConfigError, reject_positional, reject_unknown
from .._interpreter import applied, refuse_after, transform
from ._chains import Affine, BiasAct
from ._plan import chain_rules
from ._simplify import crop_dead_taps_rules, drop_identity_rules, fold_constants_rules

ORDER = ("drop_identity", "crop_dead_taps", "fold_batchnorm", "dense", "conv_bias_act", "fold_constants")
DEFAULT = ("crop_dead_taps", "fold_batchnorm", "dense", "conv_bias_act", "fold_constants", "drop_identity")


# Orders fusion cannot follow, and the order to use instead.
REFUSE = {
    "swap_backend": "kernel calls cannot be fused; fuse first, swap_backend(fuse(f)) last",
    "tile_conv": "stripes are fused one by one only if fused before tiling; use tile_conv(fuse(f))",
}


def _recipe(name: str, apply: Callable) -> Callable:
    def recipe(fn: Callable | None = None, /, *positional, **unknown) -> Callable:
        reject_positional(name, fn, positional, "")
        reject_unknown(name, unknown, ())
        if fn is None:
            return recipe
        return apply(fn)

    recipe.__name__ = recipe.__qualname__ = name
    return recipe


fold_batchnorm = _recipe(
    "fold_batchnorm", lambda fn: transform(fn, "fold_batchnorm", chain_rules(Affine()), refuse=REFUSE)
)
fold_batchnorm.__doc__ = "Fold batch norm (any per-channel affine chain) into the preceding conv or dot."
dense = _recipe(
    "dense", lambda fn: transform(fn, "dense", chain_rules(BiasAct("dot_general")), refuse=REFUSE)
)
dense.__doc__ = "Fuse `dot_general -> add(bias) -> activation` into one `jtile._fused.dense_p`."
conv_bias_act = _recipe(
    "conv_bias_act",
    lambda fn: transform(fn, "conv_bias_act", chain_rules(BiasAct("conv_general_dilated")), refuse=REFUSE),
)
conv_bias_act.__doc__ = (
    "Fuse `conv -> add(bias) [-> add(residual)] -> activation` into one `jtile._fused.conv_bias_act_p`."
)
fold_constants = _recipe(
    "fold_constants", lambda fn: transform(fn, "fold_constants", fold_constants_rules, refuse=REFUSE)
)
fold_constants.__doc__ = "Evaluate at trace time every op whose operands are all constants."
drop_identity = _recipe(
    "drop_identity", lambda fn: transform(fn, "drop_identity", drop_identity_rules, refuse=REFUSE)
)
drop_identity.__doc__ = "Remove ops that return their operand unchanged."
crop_dead_taps = _recipe(
    "crop_dead_taps", lambda fn: transform(fn, "crop_dead_taps", crop_dead_taps_rules, refuse=REFUSE)
)
crop_dead_taps.__doc__ = "Crop each convolution's kernel to the taps that ever read its input."

RECIPES = {
    "drop_identity": drop_identity,
    "crop_dead_taps": crop_dead_taps,
    "fold_batchnorm": fold_batchnorm,
    "dense": dense,
    "conv_bias_act": conv_bias_act,
    "fold_constants": fold_constants,
}


def _check_recipes(recipes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(recipes, str):
        recipes = (recipes,)
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise ConfigError(
            f"fuse: unknown recipe(s) {', '.join(map(repr, unknown))}; valid recipes are {', '.join(ORDER)}"
        )
    return tuple(r for r in ORDER if r in recipes)


def fuse(fn: Callable | None = None, /, *positional, recipes: Sequence[str] = DEFAULT,
         **unknown) -> Callable:
    """Apply the fusion `recipes` to `fn` (in the module's fixed order)."""
    reject_positional("fuse", fn, positional, "recipes=('dense',)")
    reject_unknown("fuse", unknown, ("recipes",))
    chosen = _check_recipes(recipes)
    if fn is None:
        return functools.partial(fuse, recipes=recipes)
    if not callable(fn):
        raise ConfigError(f"fuse: expected a function to transform, got {fn!r}")
    refuse_after(fn, "fuse", {**REFUSE, **dict.fromkeys(
        ("fuse", "fold_params"), "it is fused already, so fusing again would change nothing",
    )})
    return _mark(_chain(fn, chosen), fn, "fuse")


def _chain(fn: Callable, chosen: tuple[str, ...]) -> Callable:
    for name in chosen:
        fn = RECIPES[name](fn)
    return fn


def _mark(out: Callable, fn: Callable, name: str) -> Callable:
    out.__jtile_transforms__ = (*applied(fn), name)
    return out


_UNSET = object()


def fold_params(fn: Callable | None = None, params: Any = _UNSET, *,
                recipes: Sequence[str] = DEFAULT, **unknown) -> Callable:
    """`fuse(fn)` with `params` (the first argument) closed over and folded.

    Returns `g(*args, **kwargs) == fn(params, *args, **kwargs)` whose jaxpr
    holds the folded weights as constants. `fold_constants` is always applied.
    `params` is data, so it may come positionally: `fold_params(fn, params)`,
    or `@fold_params(params=params)` as a decorator.
    Every trace of `g` (one per input shape) holds the same folded arrays.

    !!! warning

        `jax.jit` embeds those constants in each compiled executable, so
        every input shape pays for its own copy of the weights (ResNet-18:
        ~55-85 MB a shape). `jtile.jit` passes the kernels' weights to the
        executables as arguments instead, shared by all shapes
        (`jtile.jit(swap_backend(fold_params(...)))`: ~9 MB a shape;
        benchmarks/bench_memory.py).
    """
    reject_unknown("fold_params", unknown, ("params", "recipes"))
    chosen = _check_recipes((*_check_recipes(recipes), "fold_constants"))
    if params is _UNSET or (fn is not None and not callable(fn)):
        raise ConfigError(
            "fold_params: give the function and its parameters, fold_params(fn, params), or "
            f"use @fold_params(params=params) as a decorator; got fn={fn!r}"
            + ("" if params is not _UNSET else " and no params")
        )
    if fn is None:
        return functools.partial(fold_params, params=params, recipes=recipes)
    refuse_after(fn, "fold_params", REFUSE)
    bound = functools.wraps(fn)(functools.partial(fn, params))
    return _mark(_chain(bound, chosen), fn, "fold_params")


__all__ = [
    "fuse", "fold_params", "fold_batchnorm", "dense", "conv_bias_act", "fold_constants", "drop_identity",
    "crop_dead_taps",
]
