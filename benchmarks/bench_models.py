"""Model suite: the zoo's CNNs at 224x224, batch 1 and 8, each timed four ways.

jtile runs `jax.jit(swap_backend(fold_params(fn, params), algorithms="auto"))(x)`: weights
fused and folded once at trace time (as ORT does at session creation), then
per-layer kernels where the cost model expects a win. jax runs
`jax.jit(fn)(params, x)`, weights as arguments. ONNX Runtime and torch run the graph `jtile.onnx.export` writes for the same
function and weights (torch op by op in eager mode, after folding what depends
only on weights, as ORT's own optimiser does). VGG-16, AlexNet and every batch
8 case are `slow` (run them with `-m ""` or `-m slow`).
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from onnx import numpy_helper

from jtile import models
from jtile.algorithms import swap_backend
from jtile.fusion import fold_params
from jtile.onnx import export


@dataclasses.dataclass(frozen=True)
class ModelCase:
    model: str
    batch: int
    rtol: float = 1e-3

    @property
    def name(self) -> str:
        return f"{self.model} b{self.batch}"

    @functools.cached_property
    def _built(self):
        return models.as_function(models.get(self.model, jax.random.key(0)))

    @property
    def fn(self):
        return self._built[0]

    @functools.cached_property
    def args(self):
        x = jax.random.normal(jax.random.key(1), models.input_shape(self.model, batch=self.batch))
        return self._built[1], x

    def jtile_fn(self):
        params, x = self.args
        return swap_backend(fold_params(self.fn, params), algorithms="auto"), (x,)

    @functools.cache
    def reference(self) -> np.ndarray:
        return np.asarray(jax.jit(self.fn)(*self.args))

    @functools.cache
    def onnx_model(self):
        params, x = self.args
        return export(self.fn, x, params=params)

    def onnx_inputs(self) -> list[np.ndarray]:
        return [np.asarray(self.args[1])]

    def torch_fn(self, torch):
        run = _TorchGraph(self.onnx_model(), torch)
        return run, (torch.from_numpy(np.asarray(self.args[1]).copy()),)


class _TorchGraph:
    """An exported ONNX graph run op by op with torch; weight-only nodes folded once."""

    def __init__(self, model, torch):
        self.torch, F = torch, torch.nn.functional
        self.ops = {
            "Conv": self._conv, "MaxPool": self._max_pool, "AveragePool": self._avg_pool,
            "MatMul": torch.matmul, "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul,
            "Div": torch.div, "Max": torch.maximum, "Min": torch.minimum, "Sqrt": torch.sqrt,
            "Reciprocal": torch.reciprocal, "Identity": lambda x: x, "Relu": F.relu,
            "Reshape": lambda x, shape: x.reshape([x.shape[i] if s == 0 else s for i, s in enumerate(shape.tolist())]),
            "Transpose": lambda x, *, perm: x.permute(*perm).contiguous(),
            "Concat": lambda *xs, axis: torch.cat(xs, axis),
        }
        self.inputs = [i.name for i in model.graph.input]
        self.output = model.graph.output[0].name
        consts = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
        self.nodes = []
        for node in model.graph.node:
            if node.op_type not in self.ops:
                raise NotImplementedError(f"bench_models: no torch op for ONNX {node.op_type} ({node.name})")
            attrs = {a.name: _attr(a) for a in node.attribute}
            if all(i in consts for i in node.input):
                consts[node.output[0]] = self._apply(node.op_type, [consts[i] for i in node.input], attrs)
            else:
                self.nodes.append((node.op_type, list(node.input), node.output[0], attrs))
        self.consts = consts

    def _apply(self, op, args, attrs):
        return self.ops[op](*args, **attrs)

    def __call__(self, *inputs):
        env = dict(self.consts, **dict(zip(self.inputs, inputs)))
        for op, names, out, attrs in self.nodes:
            env[out] = self._apply(op, [env[n] for n in names], attrs)
        return env[self.output]

    def _pad(self, x, pads, value):
        """Pad ONNX-style `[top, left, bottom, right]`; returns x and torch's symmetric padding."""
        top, left, bottom, right = pads or (0, 0, 0, 0)
        if (top, left) == (bottom, right):
            return x, (top, left)
        return self.torch.nn.functional.pad(x, (left, right, top, bottom), value=value), (0, 0)

    def _conv(self, x, w, b=None, *, pads=None, strides=(1, 1), dilations=(1, 1), group=1, kernel_shape=None):
        x, padding = self._pad(x, pads, 0.0)
        return self.torch.nn.functional.conv2d(x, w, b, strides, padding, dilations, group)

    def _max_pool(self, x, *, kernel_shape, pads=None, strides=None, dilations=(1, 1)):
        x, padding = self._pad(x, pads, float("-inf"))
        return self.torch.nn.functional.max_pool2d(x, kernel_shape, strides or kernel_shape, padding, dilations)

    def _avg_pool(self, x, *, kernel_shape, pads=None, strides=None, count_include_pad=0):
        if count_include_pad == 0 and any(pads or ()):
            raise NotImplementedError("bench_models: AveragePool excluding padding")
        x, padding = self._pad(x, pads, 0.0)
        return self.torch.nn.functional.avg_pool2d(x, kernel_shape, strides or kernel_shape, padding)


def _attr(attribute):
    from onnx import helper

    value = helper.get_attribute_value(attribute)
    return list(value) if isinstance(value, (list, tuple)) else value


_BIG = ("vgg16", "alexnet")
CASES = tuple(ModelCase(m, b) for b in (1, 8) for m in ("resnet18", "mobilenet_v2", "googlenet", *_BIG))


def _marks(case: ModelCase):
    return [pytest.mark.slow] if case.batch > 1 or case.model in _BIG else []


@pytest.mark.parametrize("backend", ("jtile", "jax", "ort", "torch"))
@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name.replace(" ", "_"), marks=_marks(c)) for c in CASES]
)
def test_model(time_case, case, backend):
    time_case(case, backend)
