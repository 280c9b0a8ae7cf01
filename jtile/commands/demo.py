"""`jtile demo`: Aidge's horizontal-tiling tutorial, on any zoo model."""

import argparse
import collections
import sys
import time
from contextlib import contextmanager

import equinox as eqx
import jax
import numpy as np

from .. import models
from .._interpreter import iter_eqns, make_jaxpr
from ..tiling import tile_conv

HELP = "Tile a zoo model's convolutions into stripes and check the outputs are unchanged."
RTOL, ATOL = 1e-5, 1e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tutorial", choices=models.NAMES, help="zoo model (default: tutorial)")
    parser.add_argument("--tiles", type=int, default=4, help="number of stripes (default: 4)")
    parser.add_argument("--axis", default="H", help="'H', 'W' or an output axis index (default: H)")
    parser.add_argument("--size", type=int, default=None, help="input height and width (default: the model's)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed for weights and input")


@contextmanager
def _step(label: str):
    print(f"  {label} ...", end="", flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", flush=True)
        raise
    print(f" {time.perf_counter() - start:.1f} s", flush=True)


def _op_counts(fn, *args) -> collections.Counter:
    return collections.Counter(e.primitive.name for e in iter_eqns(make_jaxpr(fn, *args).jaxpr))


def _print_op_counts(before: collections.Counter, after: collections.Counter) -> None:
    names = sorted(set(before) | set(after), key=lambda n: (before[n] == after[n], n))
    print(f"  {'op':<24}{'original':>10}{'tiled':>10}")
    for name in names:
        mark = "" if before[name] == after[name] else "  *"
        print(f"  {name:<24}{before[name]:>10}{after[name]:>10}{mark}")
    print(f"  {'total':<24}{sum(before.values()):>10}{sum(after.values()):>10}")


def run(args: argparse.Namespace) -> int:
    axis = int(args.axis) if args.axis.lstrip("-").isdigit() else args.axis
    shape = models.input_shape(args.model, batch=args.batch, size=args.size)
    print(f"jtile demo: {args.model} on input {shape}, tile_conv(axis={axis!r}, tiles={args.tiles})")
    key_model, key_input = jax.random.split(jax.random.key(args.seed))
    with _step(f"building {args.model}"):
        model = models.get(args.model, key_model)
        x = jax.random.normal(key_input, shape)

    def apply(model, x):
        return model(x)

    tiled = tile_conv(apply, axis=axis, tiles=args.tiles)
    with _step("compiling and running the original"):
        expected = np.asarray(eqx.filter_jit(apply)(model, x))
    with _step("tiling, compiling and running"):
        got = np.asarray(eqx.filter_jit(tiled)(model, x))
    _print_op_counts(_op_counts(apply, model, x), _op_counts(tiled, model, x))
    scale = max(1.0, float(np.max(np.abs(expected))))
    diff = float(np.max(np.abs(got - expected)))
    identical = bool(np.array_equal(got, expected))
    print(f"  output shape {got.shape}, max abs difference {diff:.3g} "
          f"({diff / scale:.2g} of the output scale), bit-identical: {'yes' if identical else 'no'}")
    # Deep nets accumulate float32 reassociation error: atol scales with the output.
    if not np.allclose(got, expected, rtol=RTOL, atol=ATOL * scale):
        print(f"FAIL: tiled outputs differ beyond rtol={RTOL}, atol={ATOL} x output scale", file=sys.stderr)
        return 1
    print(f"OK: tiled outputs match (rtol={RTOL}, atol={ATOL} x output scale)")
    return 0


__all__ = ["HELP", "add_arguments", "run"]
