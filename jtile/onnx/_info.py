"""`info(model)`: what an ONNX model contains, as plain data for `jtile onnx-info`.

Reads the protobuf only (no JAX tracing): op types with counts and whether
jtile supports them at the model's opset, each attribute's value range per op
type, and the size of every initializer and declared value.
"""

import math
from typing import Any

import numpy as np
import onnx

from .._errors import JtileError
from . import _proto
from ._model import _spec, default_opset


def _attr_summary(values: list[Any]) -> dict[str, Any]:
    flat = []
    for v in values:
        flat.extend(np.asarray(v).reshape(-1).tolist() if isinstance(v, (list, tuple, np.ndarray)) else [v])
    numbers = [v for v in flat if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if numbers and len(numbers) == len(flat):
        return {"min": min(numbers), "max": max(numbers), "count": len(values)}
    distinct = sorted({str(v) for v in flat})
    return {"values": distinct[:20], "count": len(values)}


def _tensor_entry(name: str, elem_type: int, dims: list[int | str | None]) -> dict[str, Any]:
    try:
        itemsize = _proto.np_dtype(elem_type, name).itemsize
        dtype = str(_proto.np_dtype(elem_type, name))
    except JtileError:
        itemsize, dtype = None, _proto.dtype_name(elem_type)
    known = all(isinstance(d, int) for d in dims)
    elements = math.prod(dims) if known else None
    return {"name": name, "dtype": dtype, "shape": dims, "elements": elements,
            "bytes": elements * itemsize if known and itemsize else None}


def _value_dims(v: onnx.ValueInfoProto) -> list[int | str | None]:
    shape = v.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]


def _values(value_infos) -> list[dict[str, Any]]:
    return [_tensor_entry(v.name, v.type.tensor_type.elem_type, _value_dims(v)) for v in value_infos]


def info(model: Any) -> dict[str, Any]:
    """Summarise an ONNX model (path, bytes or `ModelProto`).

    Returns `{"opset", "ir_version", "producer", "ops": {op: {"count", "supported",
    "reason", "attributes": {name: {"min","max"} or {"values"}}}}, "initializers":
    [...], "values": [...], "inputs": [...], "outputs": [...], "total_parameters",
    "total_parameter_bytes"}`; each tensor entry has name, dtype, shape,
    elements and bytes (`None` where a dimension is symbolic).
    """
    proto = _proto.read_model(model)
    opset = default_opset(proto)
    graph = proto.graph
    ops: dict[str, dict[str, Any]] = {}
    attr_values: dict[str, dict[str, list]] = {}
    for i, node in enumerate(graph.node):
        entry = ops.setdefault(node.op_type, {"count": 0, "supported": True, "reason": None})
        entry["count"] += 1
        try:
            _spec(node, i, opset)
        except JtileError as e:
            entry["supported"], entry["reason"] = False, str(e)
        for attr in node.attribute:
            try:
                value = onnx.helper.get_attribute_value(attr)
            except Exception:  # an unreadable attribute is reported by name only
                value = "<invalid>"
            if isinstance(value, onnx.TensorProto):
                value = list(value.dims)
            elif isinstance(value, bytes):
                value = value.decode(errors="replace")
            attr_values.setdefault(node.op_type, {}).setdefault(attr.name, []).append(value)
    for op, attrs in attr_values.items():
        ops[op]["attributes"] = {k: _attr_summary(v) for k, v in sorted(attrs.items())}
    for entry in ops.values():
        entry.setdefault("attributes", {})
    initializers = [_tensor_entry(t.name, t.data_type, list(t.dims)) for t in graph.initializer]
    init_names = {t.name for t in graph.initializer}
    values = _values(graph.value_info)
    return {
        "opset": opset,
        "ir_version": proto.ir_version,
        "producer": f"{proto.producer_name} {proto.producer_version}".strip(),
        "ops": dict(sorted(ops.items())),
        "inputs": _values([v for v in graph.input if v.name not in init_names]),
        "outputs": _values(graph.output),
        "initializers": initializers,
        "values": values,
        "total_parameters": sum(e["elements"] or 0 for e in initializers),
        "total_parameter_bytes": sum(e["bytes"] or 0 for e in initializers),
    }
