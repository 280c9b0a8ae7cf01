"""`jtile demo`: Aidge's horizontal-tiling tutorial, on any zoo model."""

import argparse
import collections
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import equinox as eqx
import jax
import numpy as np

from .. import models
from .._graph import graph
from ..sharding import collectives, shard_spatial
from ..models._layers import sequential
from ..spatial import tile_spatial
from ..tiling import tile_conv

HELP = "Tile a zoo model's convolutions into stripes and check the outputs are unchanged."
RTOL, ATOL = 1e-5, 1e-6
SPATIAL_ATOL = 1e-5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, choices=models.NAMES,
                        help="zoo model (default: tutorial; mobilenet_v2 with --spatial)")
    parser.add_argument("--tiles", type=int, default=4, help="number of stripes (default: 4)")
    parser.add_argument("--axis", default="H", help="'H', 'W' or an output axis index (default: H)")
    parser.add_argument("--size", type=int, default=None, help="input height and width (default: the model's)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed for weights and input")
    parser.add_argument("--devices", type=int, default=None,
                        help="shard the model over this many host devices with shard_spatial instead of tiling")
    parser.add_argument("--spatial", default=None, metavar="RxC",
                        help="instead, tile_spatial the first stages on a RxC grid and show the peak memory")
    parser.add_argument("--until", default=None,
                        help="with --spatial: last tiled layer (default: features.4 for mobilenet_v2, MCUNetV2's block)")


def _peak(fn, *args) -> int:
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes


def _spatial(args, model, x, apply) -> int:
    try:
        grid = tuple(int(n) for n in args.spatial.lower().split("x"))
    except ValueError:
        print(f"jtile demo: --spatial takes RxC, e.g. 4x4, got {args.spatial!r}", file=sys.stderr)
        return 2
    until = args.until or ("features.4" if args.model == "mobilenet_v2" else None)
    if until and until.startswith("features.") and until[9:].isdigit() and hasattr(model, "features"):
        last = int(until[9:])
        print(f"  the model's first stages: features.0 to {until}")

        def first_stages(model, x):  # where the memory is
            return sequential(model.features[: last + 1], x)

        apply = first_stages

    tiled = tile_spatial(apply, grid=grid, until=until)
    with _step("compiling and running the original"):
        expected = np.asarray(eqx.filter_jit(apply)(model, x))
    with _step("tiling, compiling and running"):
        got = np.asarray(eqx.filter_jit(tiled)(model, x))
    before, after = _peak(apply, model, x), _peak(tiled, model, x)
    print(f"  peak memory (XLA temp + output): {before / 1e6:.2f} MB untiled, {after / 1e6:.2f} MB tiled "
          f"({before / after:.1f}x lower)")
    scale = max(1.0, float(np.max(np.abs(expected))))
    diff = float(np.max(np.abs(got - expected)))
    print(f"  output shape {got.shape}, max abs difference {diff:.3g} ({diff / scale:.2g} of the output scale)")
    # XLA sums a conv inside a loop body in another order (a few ulp per conv): atol 1e-5 x scale.
    if not np.allclose(got, expected, rtol=RTOL, atol=SPATIAL_ATOL * scale):
        print(f"FAIL: tiled outputs differ beyond rtol={RTOL}, atol={SPATIAL_ATOL} x output scale", file=sys.stderr)
        return 1
    print(f"OK: tiled outputs match (rtol={RTOL}, atol={SPATIAL_ATOL} x output scale)")
    return 0


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
    return collections.Counter(op.primitive for op in graph(fn, *args).all_ops())


def _print_op_counts(before: collections.Counter, after: collections.Counter) -> None:
    names = sorted(set(before) | set(after), key=lambda n: (before[n] == after[n], n))
    print(f"  {'op':<24}{'original':>10}{'tiled':>10}")
    for name in names:
        mark = "" if before[name] == after[name] else "  *"
        print(f"  {name:<24}{before[name]:>10}{after[name]:>10}{mark}")
    print(f"  {'total':<24}{sum(before.values()):>10}{sum(after.values()):>10}")


def _rerun_with_devices(args: argparse.Namespace) -> int:
    """Run this demo again in a child python with `args.devices` host devices:
    jax fixes the device count when it starts."""
    argv = ["demo"]
    for name, value in vars(args).items():
        if name not in ("run", "command") and value not in (None, False):
            argv += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-m", "jtile.cli", *argv], capture_output=True, text=True, env=env)
    print(child.stdout, end="")
    print(child.stderr, end="", file=sys.stderr)
    return child.returncode


def _print_sharding(compiled, unsharded) -> None:
    found = collectives(compiled)
    print(f"  {'collective':<24}{'count':>10}{'bytes':>12}")
    for kind in sorted({c.kind for c in found}):
        same = [c for c in found if c.kind == kind]
        print(f"  {kind:<24}{len(same):>10}{sum(c.bytes for c in same):>12}")
    print(f"  {'per-device memory':<24}{'unsharded':>12}{'sharded':>12}")
    mine, theirs = compiled.memory_analysis(), unsharded.memory_analysis()
    for name in ("argument", "output", "temp"):
        field = f"{name}_size_in_bytes"
        print(f"  {name:<24}{getattr(theirs, field):>12}{getattr(mine, field):>12}")


def _run_sharded(args: argparse.Namespace, model, x) -> int:
    fn, params = models.as_function(model)
    mesh = jax.make_mesh((args.devices,), ("x",))
    with _step("compiling and running the original"):
        unsharded = jax.jit(fn).lower(params, x).compile()
        expected = np.asarray(unsharded(params, x))
    with _step(f"sharding over {args.devices} devices, compiling and running"):
        compiled = jax.jit(shard_spatial(fn, mesh=mesh, axis=args.axis)).lower(params, x).compile()
        got = np.asarray(compiled(params, x))
    _print_sharding(compiled, unsharded)
    return _compare(got, expected, "sharded")


def run(args: argparse.Namespace) -> int:
    if args.devices and jax.device_count() != args.devices:
        return _rerun_with_devices(args)
    args.model = args.model or ("mobilenet_v2" if args.spatial else "tutorial")
    axis = int(args.axis) if args.axis.lstrip("-").isdigit() else args.axis
    shape = models.input_shape(args.model, batch=args.batch, size=args.size)
    if args.devices:
        what = f"shard_spatial(axis={axis!r}) on {args.devices} devices"
    elif args.spatial:
        what = f"tile_spatial(grid={args.spatial})"
    else:
        what = f"tile_conv(axis={axis!r}, tiles={args.tiles})"
    print(f"jtile demo: {args.model} on input {shape}, {what}")
    key_model, key_input = jax.random.split(jax.random.key(args.seed))
    with _step(f"building {args.model}"):
        model = models.get(args.model, key_model)
        x = jax.random.normal(key_input, shape)
    if args.devices:
        return _run_sharded(args, model, x)

    def apply(model, x):
        return model(x)

    if args.spatial:
        return _spatial(args, model, x, apply)
    tiled = tile_conv(apply, axis=axis, tiles=args.tiles, strict=True)
    with _step("compiling and running the original"):
        expected = np.asarray(eqx.filter_jit(apply)(model, x))
    with _step("tiling, compiling and running"):
        got = np.asarray(eqx.filter_jit(tiled)(model, x))
    _print_op_counts(_op_counts(apply, model, x), _op_counts(tiled, model, x))
    return _compare(got, expected, "tiled")


def _compare(got, expected, label: str) -> int:
    scale = max(1.0, float(np.max(np.abs(expected))))
    diff = float(np.max(np.abs(got - expected)))
    identical = bool(np.array_equal(got, expected))
    print(f"  output shape {got.shape}, max abs difference {diff:.3g} "
          f"({diff / scale:.2g} of the output scale), bit-identical: {'yes' if identical else 'no'}")
    # Deep nets accumulate float32 reassociation error: atol scales with the output.
    if not np.allclose(got, expected, rtol=RTOL, atol=ATOL * scale):
        print(f"FAIL: {label} outputs differ beyond rtol={RTOL}, atol={ATOL} x output scale", file=sys.stderr)
        return 1
    print(f"OK: {label} outputs match (rtol={RTOL}, atol={ATOL} x output scale)")
    return 0


__all__ = ["HELP", "add_arguments", "run"]
