"""Activations kept channel-blocked (NCHWc) between kernel layers.

The depthwise kernel computes on vectors of W channels of one position
(`jtile.kernels.to_nchwc`'s layout, ONNX Runtime's NCHWc). Between NCHW layers
it transposes every input band into that layout and every output band back,
which costs it as much as its taps at 14x14 and 7x7 and on strided layers.
Where a swapped conv's output is read by nothing but swapped convs that take
an NCHWc x, and its own kernel can write one, the value stays blocked: an
inverted residual's 1x1 expansion writes its output NCHWc (`smm` in pixel
rows stores each vector of output channels into its block), the depthwise
conv copies bands in and out as they are, and the 1x1 projection broadcasts
each input from its block. Each output sums the same products in the same
order as in NCHW, so the bits do not change.
"""

import dataclasses

from ._graph import Graph


@dataclasses.dataclass(frozen=True)
class Blocked:
    """The convs that write their output NCHWc and those that read their x so, by `id(eqn)`."""

    writers: frozenset[int]
    readers: frozenset[int]


def find_blocked(graph: Graph, writes, reads, pays) -> Blocked:
    """The top-level values to keep NCHWc: a conv's output that `writes(conv
    eqn)` allows, read only as x (operand 0) of convs `reads(eqn)` allows,
    not an output of the function, and where `pays(shape, reader eqns)`."""
    writers, readers = set(), set()
    for op in graph.ops:
        value = op.outs[0] if op.outs else None
        if value is None or value.is_output or not value.consumers or not writes(op.eqn):
            continue
        consumers = value.consumers
        if all(reader.ins[0] is value and value not in reader.ins[1:] and reads(reader.eqn)
               for reader in consumers) and pays(value.shape, [reader.eqn for reader in consumers]):
            writers.add(id(op.eqn))
            readers |= {id(reader.eqn) for reader in consumers}
    return Blocked(frozenset(writers), frozenset(readers))
