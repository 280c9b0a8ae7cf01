"""From a `jtile.Graph` to the scheduler's `Dag`: one node per layer or per op.

Nodes are the graph's data inputs (kind "input", Aidge's Producers) and the
layers (or ops) that depend on them. Layers that depend on no input (weight
preprocessing, shape constants) form the *prologue*: they run first, and
their results count as parameters, not activations. Each value a node hands
on is one buffer, read by the nodes that consume it.

!!! warning

    At layer granularity a layer's internal temporaries are not buffers: the
    peak counts the values passed between layers only.
"""

import dataclasses
from collections import Counter

from .._graph import Graph, Op, Value
from ..onnx import OnnxModel
from ._dag import Buffer, Dag, Node

GRANULARITIES = ("layer", "op")


@dataclasses.dataclass
class Built:
    """The `Dag` of a graph and, per node, the graph ops it runs (none for inputs)."""

    dag: Dag
    ops: list[list[Op]]
    prologue: list[Op]


def _groups(graph: Graph, granularity: str) -> list[tuple[str, str, list[Op], Counter]]:
    if granularity == "layer":
        return [(g.name, g.kind, g.ops, g.macs) for g in graph.layers()]
    return [(f"{op.scope}/{op.primitive}_{op.index}" if op.scope else f"{op.primitive}_{op.index}",
             op.kind, [op], +op.macs) for op in graph.ops]


def _input_name(graph: Graph, value: Value, fn) -> str:
    if isinstance(fn, OnnxModel):
        position = [v for v in graph.inputs if v.role == "input"].index(value)
        if position < len(fn.input_names):
            return fn.input_names[position]
    return graph.leaves[graph.inputs.index(value)].path


def build(graph: Graph, granularity: str, fn=None) -> Built:
    """Nodes for the data inputs, then one per data layer (or op) in program order."""
    producer: dict[int, int] = {}  # id(value) -> index of the node that makes it
    node_of: dict[int, int] = {}  # op index -> index of its node
    nodes, ops, prologue, handed = [], [], [], []
    for value in graph.inputs:
        if value.role == "input":
            producer[id(value)] = len(nodes)
            nodes.append(Node(_input_name(graph, value, fn), "input", (), value.nbytes, Counter(), value.shape))
            ops.append([])
            handed.append([value])
    for name, kind, group_ops, macs in _groups(graph, granularity):
        outs = [v for op in group_ops for v in op.outs]
        if not any(v.is_data for v in outs):
            prologue += group_ops
            continue
        index = len(nodes)
        mine = {op.index for op in group_ops}
        preds = [nodes[producer[id(v)]].name for op in group_ops for v in op.ins if id(v) in producer]
        out = [v for v in outs if v.is_output or any(c.index not in mine for c in v.consumers)]
        for op in group_ops:
            node_of[op.index] = index
        for v in outs:
            producer[id(v)] = index
        nodes.append(Node(name, kind, tuple(dict.fromkeys(preds)), sum(v.nbytes for v in out), macs,
                          out[0].shape if out else ()))
        ops.append(group_ops)
        handed.append(out)
    buffers = []
    for index, values in enumerate(handed):
        for k, v in enumerate(values):
            readers = dict.fromkeys(node_of[c.index] for c in v.consumers if node_of[c.index] != index)
            name = nodes[index].name if len(values) == 1 else f"{nodes[index].name}.{k}"
            buffers.append(Buffer(name, v.nbytes, index, tuple(readers), v.is_output))
    return Built(Dag(nodes, buffers), ops, prologue)
