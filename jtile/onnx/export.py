"""`export`: the jaxpr of any function (a rewritten one too) as an ONNX model.

`export(fn, *args, params=None, path=None)` traces `fn` with filter semantics
(array leaves traced, others static), reads its ops from `jtile.Graph` (calls
such as `jit` and custom derivatives inlined), and writes one or a few ONNX
nodes per op:

- every array leaf of `args` becomes a graph input, named by its pytree path;
- with `params=`, the function is called as `fn(params, *args)` and the array
  leaves of `params` become initializers (embedded weights), named the same way;
- closed-over arrays and literals become initializers; an equation whose
  operands are all constants (an `iota`, `jnp.ones(...)`) is evaluated and
  written as an initializer;
- node names are the equation's `jax.named_scope` path plus the op, so a
  model imported with `jtile.onnx.load` keeps its layer names, and
  `split_gemm` tiles show as `<layer>/gemm_tile_m0_k1_n0/...`.

The ops the zoo and the importer use are covered (convolution, matrix product,
pooling as `reduce_window_*`, reductions, elementwise math, shape ops, and
jtile's fused `conv_bias_act` / `dense`). A primitive without a mapping raises
`OnnxError` naming it and its layer; nothing is written unless the whole
model was built and passed `onnx.checker`.

!!! warning

    Control flow (`cond`, `scan`, `while`) is not exported; unroll it or keep
    it out of the exported function. The opset is 18.
"""

import os
import re
import tempfile
from collections.abc import Callable

import jax
import jax.extend.core as jcore
import numpy as np
import onnx
from jax._src.interpreters import partial_eval as pe
from onnx import helper, numpy_helper

from .. import _graph as jtile_graph
from .._errors import OnnxError
from .._interpreter import make_jaxpr
from .. import _registry
from . import _export_ops  # noqa: F401  (registers the emitters)

OPSET = 18


def _leaf_names(prefix: str, tree) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = []
    for path, leaf in paths:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            key = jax.tree_util.keystr(path, simple=True, separator=".")
            key = re.sub(r"[^A-Za-z0-9_.]+", "_", key).strip("_")
            names.append(f"{prefix}.{key}" if key else prefix)
    return names


class Graph:
    """The ONNX graph under construction: nodes, initializers, fresh names."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.constants: dict[str, np.ndarray] = {}
        self.scope = ""
        self._count = 0

    def fresh(self, hint: str = "v") -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value, dtype=None, name: str | None = None) -> str:
        array = np.asarray(value, dtype=dtype)
        name = name or self.fresh("const")
        self.initializers.append(numpy_helper.from_array(array, name))
        self.constants[name] = array
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str] | str:
        outs = [self.fresh("v") for _ in range(n_out)]
        label = f"{self.scope}/{op}" if self.scope else op
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"{label}_{self._count}", **attrs))
        return outs if n_out > 1 else outs[0]


class _Exporter:
    def __init__(self, graph: Graph):
        self.graph = graph

    def read(self, env: dict, v) -> str:
        if v.role == "literal":
            return self.graph.const(np.asarray(v.var.val, dtype=v.dtype))
        return env[v]

    def run(self, dataflow: jtile_graph.Graph, env: dict) -> list[str]:
        for op in dataflow.ops:
            ins = [self.read(env, v) for v in op.ins]
            if all(i in self.graph.constants for i in ins) and not op.subgraphs:
                outs = self.fold(op.eqn, ins)
            else:
                outs = self.emit(op.eqn, ins, op.scope)
            env.update(zip(op.outs, outs))
        return [self.read(env, v) for v in dataflow.outputs]

    def fold(self, eqn, ins: list[str]) -> list[str]:
        values = [self.graph.constants[i] for i in ins]
        with jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
        out = out if eqn.primitive.multiple_results else [out]
        return [self.graph.const(np.asarray(o)) for o in out]

    def emit(self, eqn, ins: list[str], scope: str) -> list[str]:
        name = eqn.primitive.name
        emitter = _registry.facet(eqn, "onnx")
        if emitter is None:
            raise OnnxError(
                f"export: primitive {name!r} in layer {scope or '<top level>'!r} has no ONNX mapping "
                f"(exportable: {', '.join(sorted(n for n, e in _registry.entries().items() if e.onnx))}); rewrite or remove it before exporting"
            )
        self.graph.scope = scope
        out = emitter(self.graph, eqn, *ins)
        return out if isinstance(out, list) else [out]


def _value_info(name: str, aval) -> onnx.ValueInfoProto:
    dtype = helper.np_dtype_to_tensor_dtype(np.dtype(aval.dtype))
    return helper.make_tensor_value_info(name, dtype, list(aval.shape))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _save(model: onnx.ModelProto, path) -> None:
    """Write `model` to `path` atomically, with the permissions `open()` would give
    (0o666 less the umask); every failure is an `OnnxError` naming the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OnnxError(f"export: {path} is a directory; give a file path, e.g. {os.path.join(path, 'model.onnx')}")
    if not os.path.isdir(folder):
        problem = "is not a directory" if os.path.exists(folder) else "does not exist; create it first"
        raise OnnxError(f"export: cannot write {path}: {folder} {problem}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".jtile-", suffix=".onnx", dir=folder)
    except OSError as e:
        raise OnnxError(f"export: cannot write {path}: {e.strerror} (in {folder})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(model.SerializeToString())
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise OnnxError(f"export: cannot write {path}: {e.strerror}") from None
    except BaseException:
        os.unlink(tmp)
        raise


def export(
    fn: Callable, *args, params=None, path: str | os.PathLike | None = None, name: str = "jtile"
) -> onnx.ModelProto:
    """The ONNX model of `fn(*args)`, or of `fn(params, *args)` with `params` embedded.

    Returns the checked `ModelProto`; with `path` also writes it (atomically,
    with the user's umask); a path that cannot be written raises `OnnxError`.
    """
    call_args = args if params is None else (params, *args)
    closed = make_jaxpr(fn, *call_args)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    arg_names = [] if params is None else _leaf_names("params", params)
    n_params = len(arg_names)
    arg_names += _leaf_names("input", list(args))
    if len(arg_names) != len(jaxpr.invars):
        raise OnnxError(f"export: {len(jaxpr.invars)} traced arguments but {len(arg_names)} array leaves")

    graph = Graph()
    dataflow = jtile_graph.Graph(jcore.ClosedJaxpr(jaxpr, closed.consts))
    env = {v: graph.const(c) for v, c in zip(dataflow.consts, closed.consts)}
    flat_params = [x for x in jax.tree.leaves(params) if isinstance(x, (jax.Array, np.ndarray, np.generic))]
    for v, n, value in zip(dataflow.inputs[:n_params], arg_names, flat_params):
        env[v] = graph.const(np.asarray(value), name=n)
    inputs = []
    for v, n in zip(dataflow.inputs[n_params:], arg_names[n_params:]):
        env[v] = n
        inputs.append(_value_info(n, v.aval))
    for n in arg_names[:n_params]:
        graph.constants.pop(n)  # a weight is a value, not a foldable constant
    outs = _Exporter(graph).run(dataflow, env)

    outputs = []
    for i, (o, v) in enumerate(zip(outs, jaxpr.outvars)):
        graph.nodes.append(helper.make_node("Identity", [o], [f"output_{i}"], name=f"output_{i}"))
        outputs.append(_value_info(f"output_{i}", v.aval))
    used = {i for n in graph.nodes for i in n.input}
    initializers = [t for t in graph.initializers if t.name in used]
    onnx_graph = helper.make_graph(graph.nodes, name, inputs, outputs, initializers)
    model = helper.make_model(
        onnx_graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="jtile"
    )
    model.ir_version = min(model.ir_version, 10)
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise OnnxError(f"export: the built model fails onnx.checker ({e}); nothing was written") from None
    if path is not None:
        _save(model, path)
    return model


__all__ = ["OPSET", "Graph", "export"]
