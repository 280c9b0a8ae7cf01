"""The `jtile` command line: one subcommand per module in `jtile.commands`."""

import argparse
import importlib
import sys

from . import __version__
from ._errors import JtileError

COMMANDS = ("demo", "summary", "onnx_info", "export", "schedule")


DESCRIPTION = """\
jtile rewrites JAX inference functions before XLA compiles them: convolution
tiling, GEMM splitting, fusion, C kernels and analysis. These commands run it
on the model zoo (tutorial, resnet18, ...) or on an ONNX file."""

EPILOG = """\
examples:
  jtile demo                               tile the tutorial net, check the outputs
  jtile summary resnet18                   layers, parameters, MACs and memory
  jtile onnx-info model.onnx               what jtile supports in an ONNX file
  jtile export resnet18 --fuse -o r.onnx   write a fused model as ONNX

Run `jtile COMMAND --help` for a command's options."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jtile", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"jtile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"jtile.commands.{name}")
        cmd = sub.add_parser(name.replace("_", "-"), help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `jtile` command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except JtileError as e:
        print(f"jtile: error: {e}", file=sys.stderr)
        return 2


__all__ = ["main"]


if __name__ == "__main__":
    sys.exit(main())
