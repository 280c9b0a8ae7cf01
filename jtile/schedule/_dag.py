"""The scheduler's own small graph: named nodes, their dependencies, the buffers they make.

Every scheduling algorithm (orders, steps, memory, C-P simulation, arena)
reads a `Dag`, never a jaxpr: a `Dag` is built by hand (tests, examples) or
from a `jtile.Graph` by `_from_graph`. Nodes keep the order they were given
in ("program" order); the constructor checks names and refuses cycles.

!!! warning

    A buffer is freed after its last consumer runs and lives while its
    producer runs; there is no in-place reuse of an input by its consumer.
"""

import dataclasses
import heapq
from collections import Counter

from .._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Node:
    """One schedulable node: a layer, an op, or a graph input (kind "input")."""

    name: str
    kind: str
    inputs: tuple[str, ...] = ()
    out_bytes: int = 0
    macs: Counter = dataclasses.field(default_factory=Counter, compare=False)
    out_shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One activation: made by node `producer`, read by `consumers` (node indices)."""

    name: str
    nbytes: int
    producer: int
    consumers: tuple[int, ...]
    is_output: bool


class Dag:
    """Nodes with dependencies by name, checked: unique names, known inputs, no cycle.

    `buffers` defaults to one buffer per node of `out_bytes`, read by the nodes
    that depend on it; a node nobody depends on is an output.
    """

    def __init__(self, nodes: list[Node], buffers: list[Buffer] | None = None):
        self.nodes = list(nodes)
        self.index: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.name in self.index:
                raise ConfigError(f"schedule: two nodes are named {node.name!r}; node names must be unique")
            self.index[node.name] = i
        self.preds: list[list[int]] = []
        self.succs: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            preds = []
            for name in node.inputs:
                if name not in self.index:
                    raise ConfigError(
                        f"schedule: node {node.name!r} reads input {name!r}, which no node makes; "
                        f"its data never arrives (known nodes: {', '.join(list(self.index)[:8])}"
                        f"{', ...' if len(self.index) > 8 else ''})"
                    )
                j = self.index[name]
                if j not in preds:
                    preds.append(j)
                    self.succs[j].append(i)
            self.preds.append(preds)
        self.topological = self._stable_topological()
        if buffers is None:
            buffers = [Buffer(n.name, n.out_bytes, i, tuple(self.succs[i]), not self.succs[i])
                       for i, n in enumerate(self.nodes)]
        self.buffers = buffers
        self.made = [[] for _ in self.nodes]  # node -> indices of the buffers it makes
        for b, buf in enumerate(buffers):
            self.made[buf.producer].append(b)

    def __len__(self) -> int:
        return len(self.nodes)

    def _stable_topological(self) -> list[int]:
        """Kahn's algorithm, always taking the ready node given first; a cycle raises."""
        missing = [len(p) for p in self.preds]
        ready = [i for i, m in enumerate(missing) if m == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for s in self.succs[i]:
                missing[s] -= 1
                if missing[s] == 0:
                    heapq.heappush(ready, s)
        if len(order) < len(self.nodes):
            raise ConfigError(f"schedule: the graph has a cycle: {' -> '.join(self._cycle(set(order)))}; "
                              "a static schedule needs an acyclic graph (unroll recurrences)")
        return order

    def _cycle(self, done: set[int]) -> list[str]:
        """Names along one cycle among the nodes Kahn's algorithm could not order."""
        start = next(i for i in range(len(self.nodes)) if i not in done)
        seen: dict[int, int] = {}
        path = []
        i = start
        while i not in seen:
            seen[i] = len(path)
            path.append(i)
            i = next(p for p in self.preds[i] if p not in done)
        cycle = path[seen[i]:][::-1]
        return [self.nodes[j].name for j in cycle + cycle[:1]]

    def check_order(self, order: list[int]) -> None:
        """Raise `ConfigError` unless `order` runs every node once, after all its inputs."""
        position = {i: k for k, i in enumerate(order)}
        if sorted(position) != list(range(len(self.nodes))) or len(order) != len(self.nodes):
            raise ConfigError("schedule: an order must list every node exactly once")
        for i, preds in enumerate(self.preds):
            for p in preds:
                if position[p] > position[i]:
                    raise ConfigError(f"schedule: node {self.nodes[i].name!r} is ordered before its "
                                      f"input {self.nodes[p].name!r}")
