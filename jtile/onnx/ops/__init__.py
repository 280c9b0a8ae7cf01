"""The registry of ONNX op handlers: `{op_type: OpSpec}`, and the `Node` handlers receive.

A handler is `handler(node, *inputs) -> output | tuple of outputs`. An input is
a numpy array when its value is known at import time (initializers feeding
shape inputs, constants, folded shape arithmetic) and a jax array otherwise;
a missing optional input is `None`. Handlers compute with numpy when all their
inputs are numpy (`xp`), so shape subgraphs fold statically, and call
`node.static(x, what)` where JAX needs a Python value (a reshape target, slice
bounds, pads, resize scales).

Each spec names the schema versions it implements (`since`..`upto`, as in
`onnx.defs.get_schema(op, opset).since_version`) and which inputs must be
static; the loader keeps initializers feeding those inputs out of `params`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._errors import OnnxError, UnsupportedError

LATEST_SCHEMA = 28  # onnx 1.23; later schema versions have not been checked


@dataclasses.dataclass(frozen=True)
class OpSpec:
    handler: Callable[..., Any]
    since: int
    upto: int
    static_inputs: tuple[int, ...]
    shape_only: bool  # reads only the static shape of its input (Shape, Size)


REGISTRY: dict[str, OpSpec] = {}


def register(*op_types: str, since: int = 1, upto: int = LATEST_SCHEMA, static: tuple[int, ...] = (),
             shape_only: bool = False):
    """Decorator: register `handler` for `op_types` and schema versions `since..upto`."""

    def wrap(handler):
        for op_type in op_types:
            REGISTRY[op_type] = OpSpec(handler, since, upto, static, shape_only)
        return handler

    return wrap


@dataclasses.dataclass
class Node:
    """What a handler knows about the node it lowers."""

    op_type: str
    name: str
    opset: int
    schema: int
    attrs: dict[str, Any]
    n_outputs: int

    def __str__(self) -> str:
        return f"node {self.name!r} ({self.op_type}, opset {self.opset})"

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def fail(self, message: str) -> OnnxError:
        return OnnxError(f"{self}: {message}")

    def unsupported(self, message: str) -> UnsupportedError:
        return UnsupportedError(f"{self}: {message}")

    def static(self, value: Any, what: str) -> np.ndarray:
        """`value` as a numpy array; raise if it is only known at run time."""
        if isinstance(value, np.ndarray):
            return value
        raise self.unsupported(
            f"{what} depends on the model inputs; jtile needs it at import time "
            "because shapes are static in JAX"
        )

    def ints(self, value: Any, what: str) -> list[int]:
        return [int(v) for v in self.static(value, what).reshape(-1)]

    def axis(self, axis: int, rank: int) -> int:
        if not -rank <= axis < max(rank, 1):
            raise self.fail(f"axis {axis} is out of range for rank {rank}")
        return axis % max(rank, 1)


def jax_dtype(dtype: Any) -> np.dtype:
    """`dtype` as JAX will hold it (int64 -> int32 unless x64 is enabled), without a warning."""
    return jax.dtypes.canonicalize_dtype(dtype)


def xp(*values: Any):
    """`numpy` if every given value is static (numpy or None), else `jax.numpy`."""
    return np if all(v is None or isinstance(v, np.ndarray) for v in values) else jnp


from . import activation, conv, elementwise, indexing, linalg, norm, reduce, resize, shape  # noqa: E402,F401



__all__ = ["LATEST_SCHEMA", "OpSpec", "REGISTRY", "register", "Node", "jax_dtype", "xp"]
