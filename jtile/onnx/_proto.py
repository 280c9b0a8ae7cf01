"""Decode and validate ONNX protobufs: models, tensors, attributes and dtypes.

Everything here turns protobuf problems into `OnnxError`; nothing below this
module sees a `DecodeError` or a `ValidationError`.
"""

import os
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .._errors import OnnxError, UnsupportedError

FULL_CHECK_LIMIT = 64 << 20  # bytes; above this only the structural checker runs


def read_model(source: Any) -> onnx.ModelProto:
    """Return a checked `ModelProto` from a path, raw bytes or a `ModelProto`."""
    if isinstance(source, onnx.ModelProto):
        model = source
    elif isinstance(source, (bytes, bytearray, memoryview)):
        model = _decode(bytes(source), "the given bytes")
    elif isinstance(source, (str, os.PathLike)):
        try:
            model = onnx.load(os.fspath(source))
        except FileNotFoundError as e:
            raise OnnxError(f"onnx.load: no such file {os.fspath(source)!r}") from e
        except Exception as e:  # protobuf and external-data errors have no common base
            raise OnnxError(f"onnx.load: {os.fspath(source)!r} is not a readable ONNX model: {e}") from e
    else:
        raise OnnxError(
            f"onnx.load: expected a path, bytes or onnx.ModelProto, got {type(source).__name__}"
        )
    check(model)
    return model


def _decode(data: bytes, what: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as e:
        raise OnnxError(f"onnx.load: {what} do not decode as an ONNX ModelProto ({e}); "
                        "the file is truncated or not an ONNX model") from e
    if not model.HasField("graph"):
        raise OnnxError(f"onnx.load: {what} decode to a model without a graph; "
                        "the data is truncated or not an ONNX model")
    return model


def check(model: onnx.ModelProto) -> None:
    """Run `onnx.checker.check_model` (with shape inference if the model is small)."""
    try:
        size = model.ByteSize()
        onnx.checker.check_model(model, full_check=size < FULL_CHECK_LIMIT)
    except Exception as e:  # ValidationError, InferenceError, protobuf errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxError(f"onnx.load: the model is malformed: {first}") from e


def dtype_name(elem_type: int) -> str:
    """`TensorProto.DataType` name of `elem_type` (the number itself if unknown)."""
    known = elem_type in onnx.TensorProto.DataType.values()
    return onnx.TensorProto.DataType.Name(elem_type) if known else str(elem_type)


def np_dtype(elem_type: int, where: str) -> np.dtype:
    """The numpy dtype of an ONNX `TensorProto.DataType`, or `UnsupportedError`."""
    name = dtype_name(elem_type)
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception as e:
        raise UnsupportedError(f"{where}: ONNX tensor type {name} is not supported") from e
    narrow = name.startswith(("FLOAT8", "FLOAT4", "INT4", "UINT4", "INT2", "UINT2"))
    if name != "BFLOAT16" and (dtype.kind not in "biuf" or narrow):
        raise UnsupportedError(f"{where}: ONNX tensor type {name} is not supported by jtile; "
                               "use float16/32/64, bfloat16, bool or an integer type")
    return dtype


def to_array(tensor: onnx.TensorProto, where: str) -> np.ndarray:
    """A numpy copy of a `TensorProto` (raises `OnnxError` on bad data)."""
    np_dtype(tensor.data_type, f"{where} tensor {tensor.name!r}")
    try:
        return np.array(numpy_helper.to_array(tensor))
    except Exception as e:
        raise OnnxError(f"{where}: tensor {tensor.name!r} holds invalid data: {e}") from e


def attributes(node: onnx.NodeProto, where: str) -> dict[str, Any]:
    """The attributes of a node as Python values (tensors as numpy arrays)."""
    out = {}
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR:
            out[attr.name] = to_array(attr.t, where)
        elif attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            raise UnsupportedError(f"{where}: attribute {attr.name!r} holds a subgraph; "
                                   "control flow is not supported")
        else:
            try:
                value = onnx.helper.get_attribute_value(attr)
            except Exception as e:
                raise OnnxError(f"{where}: attribute {attr.name!r} is invalid: {e}") from e
            out[attr.name] = value.decode() if isinstance(value, bytes) else value
    return out


def static_shape(value_info: onnx.ValueInfoProto) -> tuple[int | None, ...] | None:
    """The declared shape of a graph input/output; `None` for unknown dims or rank."""
    t = value_info.type.tensor_type
    if not t.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
