"""`jtile onnx-info`: the op types, attribute ranges and tensor sizes of an ONNX file."""

import argparse
import json

from .. import onnx as jonnx

HELP = "List an ONNX model's op types (with support status), attribute ranges and tensor sizes."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="path to an .onnx file")
    parser.add_argument("--json", action="store_true", help="print everything as JSON")
    parser.add_argument("--tensors", type=int, default=10,
                        help="how many of the largest initializers to list (0: all; default: 10)")


def _range(summary: dict) -> str:
    if "min" in summary:
        lo, hi = summary["min"], summary["max"]
        return f"{lo}" if lo == hi else f"{lo}..{hi}"
    return "{" + ", ".join(summary["values"]) + "}"


def _tensor(entry: dict) -> str:
    shape = "x".join("?" if d is None else str(d) for d in entry["shape"]) or "scalar"
    size = "?" if entry["bytes"] is None else f"{entry['bytes']:,} B"
    return f"  {entry['name']:<40} {entry['dtype']:<8} {shape:<20} {size:>14}"


def _print(info: dict, tensors: int) -> None:
    print(f"opset {info['opset']}, IR version {info['ir_version']}, producer {info['producer'] or '?'}")
    print(f"\n{'op type':<24}{'count':>6}  supported  attributes")
    for op, entry in info["ops"].items():
        attrs = ", ".join(f"{k}={_range(v)}" for k, v in entry["attributes"].items())
        print(f"{op:<24}{entry['count']:>6}  {'yes' if entry['supported'] else 'NO ':<9}  {attrs or '--'}")
        if not entry["supported"]:
            print(f"{'':<32}{entry['reason']}")
    for title, key in (("inputs", "inputs"), ("outputs", "outputs")):
        print(f"\n{title}:")
        for entry in info[key]:
            print(_tensor(entry))
    inits = sorted(info["initializers"], key=lambda e: -(e["bytes"] or 0))
    shown = inits if tensors == 0 else inits[:tensors]
    print(f"\ninitializers: {len(inits)}, {info['total_parameters']:,} elements, "
          f"{info['total_parameter_bytes']:,} bytes" + (f"; the {len(shown)} largest:" if shown else ""))
    for entry in shown:
        print(_tensor(entry))
    print(f"\nintermediate values with a declared shape: {len(info['values'])}")


def run(args: argparse.Namespace) -> int:
    info = jonnx.info(args.model)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        _print(info, args.tensors)
    return 0


__all__ = ["HELP", "add_arguments", "run"]
