"""`jtile export`: a zoo model or an ONNX file, optionally split and fused, written as ONNX."""

import argparse
import os

import jax.numpy as jnp
import numpy as np

from .. import models
from .. import onnx as jonnx
from .._errors import ConfigError
from ..fusion import fold_params
from ..gemm import split_gemm

HELP = "Write a zoo model or an .onnx file as ONNX, after --split-gemm and/or --fuse."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"an .onnx path or a zoo model: {', '.join(models.NAMES)}")
    parser.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    parser.add_argument("--split-gemm", metavar="M,K,N", default=None,
                        help="split every matrix product into tiles of at most M x K x N")
    parser.add_argument("--fuse", action="store_true",
                        help="apply jtile.fuse's default recipes with the weights folded in (jtile.fold_params): "
                             "batch norms fold into the conv weights")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument("--size", type=int, default=None, help="input height and width (zoo models)")


def _tile_sizes(text: str) -> dict:
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3:
        raise ConfigError(f"jtile export: --split-gemm expects three ints M,K,N (e.g. 64,64,64), got {text!r}")
    return dict(zip(("max_m", "max_k", "max_n"), values))


def _zoo(name: str, args: argparse.Namespace):
    if name not in models.NAMES:
        raise ConfigError(f"jtile export: {name!r} is neither an existing file nor a zoo model; "
                          f"zoo models are {', '.join(models.NAMES)}")
    fn, params = models.as_function(models.get(name))
    x = jnp.zeros(models.input_shape(name, batch=args.batch, size=args.size), jnp.float32)
    return fn, params, (x,)


def _onnx(path: str, args: argparse.Namespace):
    model = jonnx.load(path)
    inputs = []
    for name, shape in zip(model.input_names, model.input_shapes):
        if shape is None or (None in shape[1:]) or (shape[0] is None and args.batch is None):
            raise ConfigError(f"jtile export: input {name!r} of {path} has symbolic dimensions {shape}; "
                              "only a symbolic batch (filled by --batch) is supported")
        inputs.append(np.zeros((args.batch or shape[0], *shape[1:]), np.float32))
    return model.fn, model.params, tuple(inputs)


def run(args: argparse.Namespace) -> int:
    is_file = os.path.exists(args.model) or args.model.endswith(".onnx")
    fn, params, inputs = (_onnx if is_file else _zoo)(args.model, args)
    if args.fuse:  # fold what depends only on the weights; they become the export's initializers
        fn, params = fold_params(fn, params), None
    if args.split_gemm:
        fn = split_gemm(fn, **_tile_sizes(args.split_gemm), emit="unroll")  # ONNX has no loops of ours
    model = jonnx.export(fn, *inputs, params=params, path=args.output)
    print(f"wrote {args.output}: {len(model.graph.node)} nodes, "
          f"{len(model.graph.initializer)} initializers")
    return 0


__all__ = ["HELP", "add_arguments", "run"]
