"""The `jtile` command: one subcommand per module in `jtile.commands`."""

import argparse
import importlib
import sys

from ._errors import JtileError

COMMANDS = ("demo", "summary", "onnx_info", "export", "schedule")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jtile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
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


if __name__ == "__main__":
    sys.exit(main())
