"""`onnx.backend.base.Backend` for jtile, so `onnx.backend.test.BackendTest(jtile.onnx.backend)` runs.

Models are prepared and run with `jax_enable_x64` on, so int64 and float64
tensors keep their ONNX dtypes. CPU only.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from .._errors import OnnxError
from ._model import OnnxModel, load


class JtileRep(BackendRep):
    """A prepared model; `run(inputs)` returns a tuple of numpy arrays."""

    def __init__(self, model: OnnxModel):
        self.model = model

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, Mapping):
            inputs = [inputs[name] for name in self.model.input_names]
        elif not isinstance(inputs, Sequence) or isinstance(inputs, np.ndarray):
            inputs = [inputs]
        with jax.enable_x64(True):
            outs = self.model(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return tuple(np.asarray(o) for o in outs)


class JtileBackend(Backend):
    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> JtileRep:
        with jax.enable_x64(True):
            return JtileRep(load(model))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[np.dtype, tuple]] | None = None, **kwargs: Any):
        names = [n for n in node.input if n]
        values = [inputs[n] for n in names] if isinstance(inputs, Mapping) else inputs
        arrays = [np.asarray(x) for x in values]
        typed = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                 for n, a in zip(names, arrays)]
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        try:  # graph outputs need a type: infer it from the node's schema
            schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
            types = onnx.shape_inference.infer_node_outputs(schema, node, {v.name: v.type for v in typed})
        except Exception as e:
            raise OnnxError(f"run_node: cannot infer the outputs of {node.op_type}: {e}") from e
        outputs = [onnx.helper.make_value_info(n, types[n]) for n in node.output if n]
        graph = onnx.helper.make_graph([node], "run_node", typed, outputs)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        return cls.run_model(model, arrays, device)


prepare = JtileBackend.prepare
run_model = JtileBackend.run_model
run_node = JtileBackend.run_node
supports_device = JtileBackend.supports_device


__all__ = ["JtileRep", "JtileBackend", "prepare", "run_model", "run_node", "supports_device"]
