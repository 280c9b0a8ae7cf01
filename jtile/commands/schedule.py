"""`jtile schedule`: a zoo model's or an ONNX file's static schedule, its peak memory per policy and its arena."""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from .. import models
from .. import onnx as jonnx
from .._errors import ConfigError
from ..schedule import schedule
from ..schedule._build import GRANULARITIES
from ..schedule._order import POLICIES
from .summary import _declared_dtypes, _onnx_input

HELP = "Schedule a model (zoo name or .onnx file): peak live bytes under every policy, arena, gantt."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"an .onnx path or a zoo model: {', '.join(models.NAMES)}")
    parser.add_argument("--policy", default="memory", choices=list(POLICIES),
                        help="the order to keep, draw and plan the arena for (default: memory)")
    parser.add_argument("--granularity", default="layer", choices=list(GRANULARITIES),
                        help="one node per layer or per op (default: layer)")
    parser.add_argument("--mermaid", metavar="OUT.mmd", help="write Aidge's gantt of the schedule there")
    parser.add_argument("--png", metavar="OUT.png", help="write a PNG timeline there (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--size", type=int, default=None, help="input height and width (default: the model's)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")


def _model(args: argparse.Namespace):
    """`(model, input shapes)`, weights as shapes only: scheduling computes nothing."""
    if os.path.exists(args.model) or args.model.endswith(".onnx"):
        model = jonnx.load(args.model)
        inputs = [_onnx_input(n, s, d, args.batch, args.size)
                  for n, s, d in zip(model.input_names, model.input_shapes, _declared_dtypes(model))]
        return model, inputs
    if args.model not in models.NAMES:
        raise ConfigError(f"jtile schedule: {args.model!r} is neither an existing file nor a zoo model; "
                          f"zoo models are {', '.join(models.NAMES)}")
    model = jax.eval_shape(lambda: models.get(args.model))
    shape = models.input_shape(args.model, batch=args.batch, size=args.size)
    return model, [jax.ShapeDtypeStruct(shape, jnp.float32)]


def run(args: argparse.Namespace) -> int:
    model, inputs = _model(args)
    rows, kept = [], None
    for policy in POLICIES:
        start = time.perf_counter()
        s = schedule(model, *inputs, policy=policy, granularity=args.granularity)
        rows.append((policy, s.peak_bytes, s.exact, time.perf_counter() - start))
        if policy == args.policy:
            kept = s
    plan = kept.memory_plan()
    program = rows[0][1]
    if args.mermaid:
        with open(args.mermaid, "w") as f:
            f.write(kept.to_mermaid("gantt"))
    if args.png:
        kept.plot(args.png)
    if args.json:
        out = kept.to_json() | {
            "peaks": {p: {"peak_bytes": b, "exact": e, "seconds": t} for p, b, e, t in rows},
            "arena_bytes": plan.arena_bytes, "naive_bytes": plan.naive_bytes,
        }
        print(json.dumps(out, indent=1))
        return 0
    widest = max(len(g) for g in kept.parallel_groups)
    print(f"{args.model}: {len(kept.nodes)} nodes ({args.granularity}), {len(kept.parallel_groups)} steps, "
          f"critical path {len(kept.critical_path)} nodes, widest step {widest}")
    print(f"\n{'policy':<10}{'peak live bytes':>18}{'program/peak':>14}  search     seconds (incl. tracing)")
    for policy, peak, exact, seconds in rows:
        print(f"{policy:<10}{peak:>18,}{program / peak if peak else 1:>13.2f}x  "
              f"{'exact' if exact else 'heuristic':<10} {seconds:.3f}")
    print(f"\narena for {args.policy!r} (greedy by size): {plan.arena_bytes:,} B; peak live "
          f"{plan.peak_bytes:,} B; all buffers apart {plan.naive_bytes:,} B")
    for path in (args.mermaid, args.png):
        if path:
            print(f"wrote {path}")
    return 0


__all__ = ["HELP", "add_arguments", "run"]
