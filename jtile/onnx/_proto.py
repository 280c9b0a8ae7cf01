"""Decode and validate ONNX protobufs: models, tensors, attributes and dtypes.

Everything here turns protobuf problems into `OnnxError`; nothing below this
module sees a `DecodeError` or a `ValidationError`. Every model gets the full
check (types and shapes inferred, strict): a model over `FULL_CHECK_LIMIT`
bytes is checked as its skeleton, its large initializers replaced by graph
inputs of the same type and shape, so the check costs the same as a small one.
"""

import os
from typing import Any

import jax
import numpy as np
import onnx
from onnx import numpy_helper

from .._errors import OnnxError, UnsupportedError

FULL_CHECK_LIMIT = 64 << 20  # bytes; above this the full check runs on the skeleton
SKELETON_KEEP = 1 << 10  # initializers of at most this many elements keep their values in the skeleton


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


def initializer_bytes(model: onnx.ModelProto) -> int:
    """The size of the initializers' data from their shapes (`ByteSize` serializes the model: seconds)."""
    total = 0
    for t in model.graph.initializer:
        known = t.data_type in onnx.TensorProto.DataType.values() and t.data_type != onnx.TensorProto.STRING
        size = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if known and t.data_type else 1
        total += int(np.prod(t.dims, dtype=np.int64)) * size
    return total


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without the data of its large initializers: they become graph inputs."""
    graph = model.graph
    listed = {v.name for v in graph.input}
    keep, inputs = [], list(graph.input)
    for t in graph.initializer:
        if np.prod(t.dims, dtype=np.int64) <= SKELETON_KEEP or t.data_location == onnx.TensorProto.EXTERNAL:
            keep.append(t)
        elif t.name not in listed:
            inputs.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    bare = onnx.helper.make_graph(graph.node, graph.name, inputs, graph.output, keep,
                                  value_info=graph.value_info, sparse_initializer=graph.sparse_initializer)
    out = onnx.ModelProto(ir_version=model.ir_version, producer_name=model.producer_name, graph=bare)
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    return out


def check(model: onnx.ModelProto) -> None:
    """Run `onnx.checker.check_model` with strict type and shape inference, on the
    skeleton of a model over `FULL_CHECK_LIMIT` bytes; reject a graph without outputs."""
    try:
        checked = skeleton(model) if initializer_bytes(model) >= FULL_CHECK_LIMIT else model
        onnx.checker.check_model(checked, full_check=True)
    except Exception as e:  # ValidationError, InferenceError, protobuf errors
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
        context = [line for line in lines[1:] if line.startswith("==> Context")]
        where = f" ({context[0].removeprefix('==> Context:').strip()})" if context else ""
        raise OnnxError(f"onnx.load: the model is malformed: {lines[0]}{where}") from e
    if not model.graph.output:
        raise OnnxError("onnx.load: the graph declares no outputs; a model must name at least one graph output")


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


def is_integral(elem_type: int) -> bool:
    """Whether an ONNX `TensorProto.DataType` is an integer or bool type."""
    return dtype_name(elem_type) in ("BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")


def require_x64(dtype: np.dtype, where: str) -> None:
    """Raise if `dtype` is float64 and JAX would silently compute it in float32."""
    if np.dtype(dtype) == np.float64 and not jax.config.jax_enable_x64:
        raise UnsupportedError(
            f"{where} is DOUBLE (float64), which JAX computes in float32 unless jax_enable_x64 is on "
            "(ONNX Runtime computes it in float64); call jax.config.update('jax_enable_x64', True) "
            "before loading, or export the model in float32")


def to_array(tensor: onnx.TensorProto, where: str, copy: bool = True) -> np.ndarray:
    """The numpy value of a `TensorProto`, a writable copy unless `copy=False`
    (then possibly a read-only view); raises `OnnxError` on bad data."""
    require_x64(np_dtype(tensor.data_type, f"{where} tensor {tensor.name!r}"), f"{where} tensor {tensor.name!r}")
    try:
        value = numpy_helper.to_array(tensor)
        return np.array(value) if copy else np.asarray(value)
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
