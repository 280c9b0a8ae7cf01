"""Subcommands of `jtile`: each module has `HELP`, `add_arguments(parser)` and `run(args) -> int`."""

__all__ = ["demo", "export", "onnx_info", "summary"]
