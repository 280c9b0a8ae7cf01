"""`load`: an ONNX model -> `OnnxModel`, a pure JAX function of (params, *inputs).

The graph is checked, every node is matched to a handler for its op and
opset before anything runs, and the function evaluates the nodes in order,
each under `jax.named_scope(node name)`. Values known without the inputs
(constants, initializers feeding shape operands, `Shape` of any tensor) stay
numpy, so shape subgraphs fold at trace time; every other initializer is a
leaf of `params`. `model(...)` jits `fn` (see `compiler_options`).

!!! warning

    Shapes are static in JAX. An input declared with a symbolic dimension
    (`dim_param`) takes whatever size the caller passes, and the function is
    re-traced per distinct input shape; its entry in `input_shapes` and
    `output_shapes` is `None`. Graph inputs that feed shape operands (listed
    in `static_inputs`: reshape targets, axes, pads, resize sizes) must be
    concrete arrays; `model(...)` bakes them in, one compilation per value.
    Control flow (`If`, `Loop`, `Scan`), sequences and non-default domains
    are not supported.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from .._errors import ConfigError, JtileError, OnnxError, UnsupportedError
from .._interpreter import is_known
from . import _proto
from .ops import LATEST_SCHEMA, REGISTRY, Node, OpSpec

DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclasses.dataclass(frozen=True)
class _Step:
    node: Node
    spec: OpSpec
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default ONNX domain the model imports."""
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    if not versions:
        raise OnnxError("onnx.load: the model does not import the default ONNX domain (opset_import)")
    if max(versions) > LATEST_SCHEMA:
        raise UnsupportedError(f"onnx.load: the model imports opset {max(versions)}, newer than the latest "
                               f"jtile knows ({LATEST_SCHEMA}); export it at opset {LATEST_SCHEMA} or older")
    return max(versions)


def _nearest_opset(op_type: str, spec: OpSpec, opset: int) -> int | None:
    """The opset closest to `opset` whose version of `op_type` jtile implements."""
    usable = []
    for candidate in range(1, LATEST_SCHEMA + 1):
        try:
            version = onnx.defs.get_schema(op_type, candidate).since_version
        except Exception:  # the op is not defined at this opset
            continue
        if spec.since <= version <= spec.upto:
            usable.append(candidate)
    return min(usable, key=lambda o: abs(o - opset), default=None)


def _unsupported_version(where: str, op_type: str, spec: OpSpec, opset: int, why: str) -> UnsupportedError:
    nearest = _nearest_opset(op_type, spec, opset)
    fix = f"; re-export the model at opset {nearest}" if nearest is not None else ""
    return UnsupportedError(f"{where}: {why}; jtile implements {op_type} versions {spec.since} to {spec.upto}{fix}")


def _spec(node: onnx.NodeProto, index: int, opset: int) -> tuple[Node, OpSpec]:
    name = node.name or f"{node.op_type}_{index}"
    where = f"node {name!r} ({node.op_type}, opset {opset})"
    if node.domain not in DEFAULT_DOMAINS:
        raise UnsupportedError(f"{where}: domain {node.domain!r} is not supported; only the default ONNX domain is")
    spec = REGISTRY.get(node.op_type)
    if spec is None:
        raise UnsupportedError(f"{where}: op type {node.op_type} is not supported by jtile.onnx "
                               f"(supported: {', '.join(sorted(REGISTRY))})")
    try:
        schema = onnx.defs.get_schema(node.op_type, opset).since_version
    except Exception as e:
        raise _unsupported_version(where, node.op_type, spec, opset,
                                   f"ONNX defines no {node.op_type} at opset {opset}") from e
    if not spec.since <= schema <= spec.upto:
        raise _unsupported_version(where, node.op_type, spec, opset, f"{node.op_type}-{schema} is not supported")
    attrs = _proto.attributes(node, where)
    n_outputs = max((i + 1 for i, o in enumerate(node.output) if o), default=0)
    return Node(node.op_type, name, opset, schema, attrs, n_outputs), spec


def _static_values(steps: list[_Step]) -> set[str]:
    """Names whose value must be known at import time (they feed shape operands)."""
    need: set[str] = set()
    for step in reversed(steps):
        need.update(step.inputs[i] for i in step.spec.static_inputs if i < len(step.inputs) and step.inputs[i])
        if not step.spec.shape_only and any(o in need for o in step.outputs):
            need.update(name for name in step.inputs if name)
    return need


def _run_step(step: _Step, values: list[Any]) -> tuple[Any, ...]:
    node = step.node
    try:
        with jax.named_scope(node.name), np.errstate(all="ignore"):
            out = step.spec.handler(node, *values)
    except JtileError:
        raise
    except Exception as e:  # a handler met data it cannot lower: name the node, keep the cause
        raise OnnxError(f"{node}: {type(e).__name__}: {e}") from e
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) < len(step.outputs):
        raise node.fail(f"produced {len(outs)} output(s), the graph expects {len(step.outputs)}")
    return tuple(np.asarray(o) if isinstance(o, np.generic) else o for o in outs)


class OnnxModel:
    """An imported ONNX model: `model(*inputs)`, or the pure `model.fn(model.params, *inputs)`.

    Returns one array for a single-output graph, else a tuple in graph output order.
    """

    def __init__(self, proto: onnx.ModelProto):
        self.proto = proto
        self.opset = default_opset(proto)
        graph = proto.graph
        steps = []
        for i, n in enumerate(graph.node):
            node, spec = _spec(n, i, self.opset)
            steps.append(_Step(node, spec, tuple(n.input), tuple(n.output)))
        self._steps = steps
        static = _static_values(steps)
        initializers = {t.name: t for t in graph.initializer}
        # integer and bool initializers (indices, shapes) are never weights: keep them static so index
        # arithmetic folds and ScatterND / Gather see known indices
        static |= {k for k, t in initializers.items() if _proto.is_integral(t.data_type)}
        self._constants = {k: _proto.to_array(t, "initializer") for k, t in initializers.items() if k in static}
        self.params: dict[str, jax.Array] = {  # device_put: jnp.asarray would compile a convert per shape
            k: jax.device_put(_proto.to_array(t, "initializer", copy=False))
            for k, t in initializers.items() if k not in static
        }
        inputs = [v for v in graph.input if v.name not in initializers]
        self.input_names = [v.name for v in inputs]
        self.input_shapes = [_proto.static_shape(v) for v in inputs]
        self._input_dtypes = [_input_dtype(v) for v in inputs]
        self.output_names = [v.name for v in graph.output]
        self.static_inputs = [i for i, name in enumerate(self.input_names) if name in static]
        self._jit_cache: dict[tuple, Callable] = {}
        self.output_shapes = self._infer_output_shapes()

    def fn(self, params: dict[str, Any], *inputs: Any) -> Any:
        """The model as a pure function of its initializers and inputs."""
        if len(inputs) != len(self.input_names):
            raise ConfigError(f"onnx model: expected {len(self.input_names)} input(s) "
                              f"{self.input_names}, got {len(inputs)}")
        env: dict[str, Any] = dict(self._constants)
        env.update(params)
        declared = zip(self.input_names, self.input_shapes, self._input_dtypes, inputs)
        for i, (name, shape, dtype, x) in enumerate(declared):
            env[name] = _check_input(name, shape, dtype, x, static=i in self.static_inputs)
        for step in self._steps:
            try:
                values = [env[name] if name else None for name in step.inputs]
            except KeyError as e:
                raise step.node.fail(f"input {e.args[0]!r} is neither a graph input, an initializer "
                                     "nor the output of an earlier node") from None
            for name, value in zip(step.outputs, _run_step(step, values)):
                if name:
                    env[name] = value
        missing = [name for name in self.output_names if name not in env]
        if missing:
            raise OnnxError(f"onnx model: graph output(s) {missing} are produced by no node")
        outs = [jnp.asarray(env[name]) for name in self.output_names]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __call__(self, *inputs: Any) -> Any:
        """Run jitted; inputs feeding shape operands are baked in (one compilation per value)."""
        fixed = {i: np.asarray(inputs[i]) for i in self.static_inputs if i < len(inputs)}
        key = tuple((i, a.dtype.str, a.shape, a.tobytes()) for i, a in fixed.items())
        if key not in self._jit_cache:

            def bound(params, *dynamic):
                args = list(dynamic)
                for i in sorted(fixed):
                    args.insert(i, fixed[i])
                return self.fn(params, *args)

            self._jit_cache[key] = jax.jit(bound, compiler_options=compiler_options())
        return self._jit_cache[key](self.params, *[x for i, x in enumerate(inputs) if i not in fixed])

    def _infer_output_shapes(self) -> list[tuple[int, ...] | None]:
        """Trace once abstractly (this also validates every node); `None`s if inputs are symbolic."""
        if self.static_inputs or any(s is None or None in s for s in self.input_shapes):
            return [None] * len(self.output_names)
        specs = [jax.ShapeDtypeStruct(s, _proto_jax_dtype(d)) for s, d in zip(self.input_shapes, self._input_dtypes)]
        outs = jax.eval_shape(self.fn, self.params, *specs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return [tuple(o.shape) for o in outs]

    def __repr__(self) -> str:
        return (f"OnnxModel(opset={self.opset}, nodes={len(self._steps)}, inputs={self.input_names}, "
                f"outputs={self.output_names}, params={len(self.params)})")


def compiler_options() -> dict[str, str] | None:
    """XLA options `OnnxModel.__call__` compiles with.

    On CPU, jaxlib 0.10's YNNPACK "reduce" library fusion (a reduction fused with
    the conv chain feeding it) returns garbage, run-to-run different, for the
    ResNet-50 and SqueezeNet test graphs (their global pool); only the
    individual-convolution fusion is kept.
    """
    if jax.default_backend() != "cpu":
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"}


def _input_dtype(v: onnx.ValueInfoProto) -> np.dtype | None:
    if not v.type.HasField("tensor_type"):
        raise UnsupportedError(f"onnx.load: input {v.name!r} is not a tensor; sequences and maps are not supported")
    elem = v.type.tensor_type.elem_type
    if not elem:
        return None
    dtype = _proto.np_dtype(elem, f"input {v.name!r}")
    _proto.require_x64(dtype, f"onnx.load: input {v.name!r}")
    return dtype


def _proto_jax_dtype(dtype: np.dtype | None) -> np.dtype:
    return jax.dtypes.canonicalize_dtype(np.float32 if dtype is None else dtype)


def _check_input(name: str, shape, dtype, x, static: bool) -> Any:
    if static:
        if not is_known(x):
            raise UnsupportedError(f"onnx model: input {name!r} feeds a shape operand (a reshape target, axes, "
                                   "pads, sizes...) and must be a concrete array, not traced; pass it as numpy")
        x = np.asarray(x, dtype)
    else:
        x = jnp.asarray(x) if dtype is None else jnp.asarray(x, _proto_jax_dtype(dtype))
    if shape is not None and (len(shape) != x.ndim or any(d is not None and d != s for d, s in zip(shape, x.shape))):
        declared = tuple("?" if d is None else d for d in shape)
        raise ConfigError(f"onnx model: input {name!r} has shape {x.shape}, the model declares {declared}")
    return x


def load(source: Any) -> OnnxModel:
    """Import an ONNX model from a path, serialized bytes or an `onnx.ModelProto`."""
    return OnnxModel(_proto.read_model(source))
