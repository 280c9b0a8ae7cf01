"""The consumer-producer (C-P) model of seed 002: plan repeated runs without running anything.

Each node has a `CPModel` saying how many elements it needs at each input
before a run (and consumes by it) and how many it makes per run; the model
may keep state. The default consumes and produces the whole tensor, so
every node runs once. `simulate` follows Aidge's scheduler: run the
consumers that have enough data, make the children of those that produced
new consumers, and when none is left go back to the nodes that still have
data to consume. Graph inputs (and other nodes without inputs) produce their
whole data once, at the start. The simulation also records, per edge, the
most elements made and not yet consumed: the FIFO the pipelined schedule
needs between two nodes. `factorize` folds repeated runs into
`(start, length, repeats)` sections as Aidge's factorised diagram does.

!!! warning

    Counts are elements of a node's first output; a node with several
    outputs is modelled through its first one.
"""

import math

from .._errors import ConfigError
from ._dag import Dag

MAX_RUNS = 1_000_000


class CPModel:
    """Whole tensors as single tokens; subclass and override `required` / `produced` for others.

    `start` is called once before each simulation with the shapes of the
    node's inputs (in the order of `Node.inputs`) and of its output; reset
    any state there. `required(i)` is the element count needed at input `i`
    for the next run, which that run consumes; `produced()` is the element
    count the next run makes, asked once per run after `required`.
    """

    def start(self, inputs: list[tuple[int, ...]], output: tuple[int, ...]) -> None:
        self.inputs, self.output = inputs, output

    def required(self, i: int) -> int:
        return math.prod(self.inputs[i])

    def produced(self) -> int:
        return math.prod(self.output)


class _Sim:
    def __init__(self, dag: Dag, models: dict[int, CPModel]):
        self.dag = dag
        self.models = [models.get(i) or CPModel() for i in range(len(dag))]
        for i, model in enumerate(self.models):
            model.start([dag.nodes[p].out_shape for p in dag.preds[i]], dag.nodes[i].out_shape)
        self.made = [0] * len(dag)
        self.taken = [[0] * len(p) for p in dag.preds]  # per node, per input: elements consumed
        self.sequence: list[int] = []
        self.backlog: dict[tuple[int, int], int] = {}  # (producer, consumer): most elements waiting

    def available(self, node: int, k: int) -> int:
        return self.made[self.dag.preds[node][k]] - self.taken[node][k]

    def runnable(self, node: int) -> bool:
        return all(self.available(node, k) >= self.models[node].required(k)
                   for k in range(len(self.dag.preds[node])))

    def run(self, node: int) -> None:
        need = [self.models[node].required(k) for k in range(len(self.dag.preds[node]))]
        if self.dag.preds[node] and not any(need):
            raise ConfigError(f"C-P schedule: node {self.dag.nodes[node].name!r} consumes nothing per run, "
                              "so it would run forever; its C-P model must require data at some input")
        for k, n in enumerate(need):
            self.taken[node][k] += n
        self.made[node] += self.models[node].produced()
        for s in self.dag.succs[node]:
            waiting = self.made[node] - self.taken[s][self.dag.preds[s].index(node)]
            self.backlog[node, s] = max(self.backlog.get((node, s), 0), waiting)
        self.sequence.append(node)
        if len(self.sequence) > MAX_RUNS:
            raise ConfigError(f"C-P schedule: more than {MAX_RUNS} runs; node "
                              f"{self.dag.nodes[node].name!r} is still running, check its C-P model")

    def still_consumer(self, node: int) -> bool:
        return any(self.available(node, k) > 0 for k in range(len(self.dag.preds[node])))

    def feeds(self, node: int) -> bool:
        return any(self.made[node] > self.taken[s][self.dag.preds[s].index(node)] for s in self.dag.succs[node])

    def simulate(self) -> tuple[list[int], dict[tuple[int, int], int]]:
        sources = [i for i in self.dag.topological if not self.dag.preds[i]]
        for i in sources:
            self.run(i)
        consumers = _unique(s for i in sources for s in self.dag.succs[i])
        still: list[int] = []
        while consumers:
            runnable = [c for c in consumers if self.runnable(c)]
            for c in runnable:
                self.run(c)
            fresh = []
            for c in runnable:
                if self.still_consumer(c) and c not in still:
                    still.append(c)
                if self.feeds(c):
                    fresh += self.dag.succs[c]
            consumers = _unique(fresh)
            if not consumers:
                consumers, still = still, []
        self.check()
        return self.sequence, self.backlog

    def check(self) -> None:
        ran = set(self.sequence)
        for node in self.dag.topological:
            name = self.dag.nodes[node].name
            for k, p in enumerate(self.dag.preds[node]):
                need, left, pname = self.models[node].required(k), self.available(node, k), self.dag.nodes[p].name
                if node not in ran and left < need:
                    raise ConfigError(
                        f"C-P schedule: node {name!r} never runs: its input #{k} from {pname!r} needs "
                        f"{need} elements, but {pname!r} makes only {self.made[p]} in total; the data "
                        "never arrives (check the C-P models of both nodes)")
                if left:
                    raise ConfigError(
                        f"C-P schedule: node {name!r} stops with {left} of the {self.made[p]} elements of "
                        f"its input #{k} from {pname!r} unconsumed (its next run needs {need}); the data "
                        "it waits for never arrives (check the C-P models of both nodes)")


def _unique(items) -> list[int]:
    return list(dict.fromkeys(items))


def simulate(dag: Dag, models: dict[int, CPModel]) -> tuple[list[int], dict[tuple[int, int], int]]:
    """The run sequence (node indices, repeated) of the C-P schedule and, per edge, the
    most elements ever made and not yet consumed (the FIFO an edge needs); or a
    `ConfigError` naming the node and the input whose data never arrives."""
    return _Sim(dag, models).simulate()


def factorize(sequence: list[int]) -> list[tuple[int, int, int]]:
    """`(start, length, repeats)` sections covering `sequence`: at each position the
    repetition covering most runs (the shortest pattern on ties), else one run."""
    sections, i, n = [], 0, len(sequence)
    while i < n:
        best_len, best_rep = 1, 1
        for length in range(1, (n - i) // 2 + 1):
            pattern, rep = sequence[i : i + length], 1
            while sequence[i + rep * length : i + (rep + 1) * length] == pattern:
                rep += 1
            if rep > 1 and rep * length > best_len * best_rep:
                best_len, best_rep = length, rep
        sections.append((i, best_len, best_rep))
        i += best_len * best_rep
    return sections
