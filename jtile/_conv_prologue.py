"""Per-channel affine chains and their ReLU applied by the 1x1 conv that reads them.

DenseNet normalises every concatenation before its 1x1 conv: a batch norm
(folded to `(x - mean) * scale + beta`, per channel) and a ReLU, which XLA runs
as one pass that reads the whole concatenation and writes it again (58 passes
in DenseNet-121, 5-6% of its time). When the conv runs on a kernel that applies such a
prologue while packing its input (`jtile.kernels.conv2d(prologue=...)`), and
nothing else reads the chain's values, `swap_backend` drops the chain (each of
its equations passes the chain's input on) and the conv applies it. The kernel
computes the ops in the chain's order, so the bits are XLA's unless XLA
contracts the multiply and add into one rounding.
"""

import dataclasses

import numpy as np

from ._graph import Graph, Op, Value
from .fusion._chains import _fits

_STEPS = ("sub", "mul", "add")  # in the order the chain applies them


@dataclasses.dataclass(frozen=True)
class Prologue:
    """The chain a conv applies: `ops` maps each dropped equation's id to its
    role (`"sub"`, `"mul"`, `"add"`, `"relu"`) and the position of its
    per-channel operand (for the ReLU, of its zero)."""

    ops: dict

    @property
    def activation(self) -> str | None:
        return "relu" if any(role == "relu" for role, _ in self.ops.values()) else None


def _per_channel(value: Value) -> bool:
    """One number per channel of an NCHW image, or one in all (as `fuse` reads
    a per-axis operand): a batch norm's parameters, or a squeeze-excitation
    block's scales (computed from the image itself, so batch 1 only)."""
    return _fits(value.shape, 4, frozenset({1}))


def _step(op: Op, x: Value) -> tuple[str, int, Value] | None:
    """`(role, constant position, chain input)` when `op` is one step of the
    chain applied to a value of `x`'s shape, else None."""
    if op.primitive == "max" and len(op.ins) == 2:
        for pos, value in enumerate(op.ins):
            other = op.ins[1 - pos]
            val = getattr(value.var, "val", None)
            if value.role == "literal" and np.ndim(val) == 0 and val == 0 and other.shape == x.shape:
                return "relu", pos, other
        return None
    if op.primitive not in _STEPS or len(op.ins) != 2:
        return None
    for pos in ((1,) if op.primitive == "sub" else (1, 0)):
        constant, other = op.ins[pos], op.ins[1 - pos]
        if other.shape == x.shape and _per_channel(constant):
            return op.primitive, pos, other
    return None


def find_prologues(graph: Graph, takes_prologue) -> dict[int, Prologue]:
    """`{id(conv eqn): Prologue}` for top-level convs whose input is made by
    `[sub] [mul] [add] [relu]` steps (at least one, each value read only by
    the next step); `takes_prologue(eqn)` says whether an equation is a conv
    whose kernel can apply one."""
    found = {}
    for op in graph.ops:
        if takes_prologue(op.eqn):
            prologue = _walk(op)
            if prologue is not None:
                found[id(op.eqn)] = prologue
    return found


def _walk(conv: Op) -> Prologue | None:
    ops = {}
    allowed = ["relu", *reversed(_STEPS)]  # the order met walking back from the conv
    value, reader = conv.ins[0], conv
    while value.producer is not None and not value.is_output and value.consumers == [reader]:
        step = _step(value.producer, value)
        if step is None or step[0] not in allowed:
            break
        role, pos, source = step
        del allowed[:allowed.index(role) + 1]
        ops[id(value.producer.eqn)] = (role, pos)
        value, reader = source, value.producer
    return Prologue(ops) if ops else None
