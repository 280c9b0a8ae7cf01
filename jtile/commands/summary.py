"""`jtile summary`: the torchinfo-style table of a zoo model or an ONNX file."""

import argparse
import os

import jax
import jax.numpy as jnp
import onnx

from .. import models
from .. import onnx as jonnx
from .._errors import ConfigError
from ..analysis import Summary, summary
from ..spatial import tile_spatial

HELP = "Print a model's layers, parameters, MACs, memory and bandwidth (zoo name or .onnx file)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"an .onnx path or a zoo model: {', '.join(models.NAMES)}")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--depth", type=int, default=None,
                        help="cut layer names to this many scope components (default: all)")
    parser.add_argument("--size", type=int, default=None,
                        help="input height and width (default: the model's; fills symbolic ONNX dims)")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch size (default: the model's; fills a symbolic ONNX batch dim)")
    parser.add_argument("--spatial", default=None, metavar="RxC",
                        help="summarise the model with tile_spatial on a RxC grid (loop mode): the MACs "
                             "include the recompute, the peak is one tile's")
    parser.add_argument("--until", default=None,
                        help="with --spatial: the last tiled layer (default: features.4 for mobilenet_v2, "
                             "MCUNetV2's block; else up to the first op that cannot be tiled)")


def _onnx_input(name: str, shape, dtype, batch: int | None, size: int | None) -> jax.ShapeDtypeStruct:
    if shape is None:
        raise ConfigError(f"jtile summary: input {name!r} has no declared shape; cannot analyse it")
    filled = []
    for axis, d in enumerate(shape):
        fill = {0: batch, 1: None}.get(axis, size)
        if d is None and fill is None:
            how = {0: "give it with --batch", 1: "jtile cannot choose it"}.get(axis, "give it with --size")
            raise ConfigError(f"jtile summary: input {name!r} has a symbolic dimension {axis}; {how}")
        filled.append(fill if d is None else d)
    return jax.ShapeDtypeStruct(tuple(filled), dtype)


def _declared_dtypes(model: jonnx.OnnxModel) -> list:
    elem = {v.name: v.type.tensor_type.elem_type for v in model.proto.graph.input}
    return [jax.dtypes.canonicalize_dtype(onnx.helper.tensor_dtype_to_np_dtype(elem[n] or onnx.TensorProto.FLOAT))
            for n in model.input_names]


def _tiled(fn, args: argparse.Namespace, default_until: str | None = None):
    """`fn` with `tile_spatial` applied as `--spatial` and `--until` ask, or `fn`."""
    if args.spatial is None:
        return fn
    try:
        grid = tuple(int(n) for n in args.spatial.lower().split("x"))
    except ValueError:
        raise ConfigError(f"jtile summary: --spatial takes RxC, e.g. 4x4, got {args.spatial!r}") from None
    return tile_spatial(fn, grid=grid, until=args.until or default_until)


def _onnx_summary(path: str, args: argparse.Namespace) -> Summary:
    model = jonnx.load(path)
    inputs = [_onnx_input(n, s, d, args.batch, args.size)
              for n, s, d in zip(model.input_names, model.input_shapes, _declared_dtypes(model))]
    if args.spatial is None:
        return summary(model, *inputs, depth=args.depth)
    return summary(_tiled(model.fn, args), model.params, *inputs, depth=args.depth)


def _zoo_summary(name: str, args: argparse.Namespace) -> Summary:
    if name not in models.NAMES:
        raise ConfigError(f"jtile summary: {name!r} is neither an existing file nor a zoo model; "
                          f"zoo models are {', '.join(models.NAMES)}")
    model = jax.eval_shape(lambda: models.get(name))
    x = jax.ShapeDtypeStruct(models.input_shape(name, batch=args.batch, size=args.size), jnp.float32)
    if args.spatial is None:
        return summary(model, x, depth=args.depth)
    until = "features.4" if name == "mobilenet_v2" else None
    return summary(_tiled(lambda m, x: m(x), args, until), model, x, depth=args.depth)


def run(args: argparse.Namespace) -> int:
    if os.path.exists(args.model) or args.model.endswith(".onnx"):
        result = _onnx_summary(args.model, args)
    else:
        result = _zoo_summary(args.model, args)
    print(result.to_json(indent=1) if args.json else result.table())
    return 0


__all__ = ["HELP", "add_arguments", "run"]
