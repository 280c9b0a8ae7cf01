"""ONNX import: `load(path | bytes | ModelProto) -> OnnxModel`, an `onnx.backend` adapter, and `info`."""

from . import backend as backend
from ._info import info as info
from ._model import OnnxModel as OnnxModel
from ._model import load as load
from .export import export as export

__all__ = [
    "backend", "info", "OnnxModel", "load", "export"
]
