"""`jtile.schedule(fn, *args, policy=, granularity=, cp=)`: a static schedule of a traced function.

The graph (`jtile.graph`) becomes a `Dag` of inputs and layers (or ops);
the policy orders it, or with `cp=` the consumer-producer simulation plans
repeated runs. Early and late steps follow Aidge's definition; the schedule
then measures its peak of live bytes and the FIFO each edge needs (a whole
tensor, or less when a C-P model pipelines), plans an arena, draws itself, runs
node by node (threads over parallel groups) or returns a reordered function.

!!! warning

    A `cp=` schedule models data movement only: `run` and `apply` execute
    each node once, whole, in the order of the nodes' first runs.
"""

import dataclasses
import math
from collections import Counter
from collections.abc import Callable

import jax

from .._errors import ConfigError
from .._graph import Graph, graph
from .._interpreter import gc_paused
from ._build import GRANULARITIES, Built, build
from ._cp import CPModel, factorize, simulate
from ._dag import Dag, Node
from ._memory import MemoryPlan, peak_bytes, plan_arena
from ._order import POLICIES, order
from ._render import Bar, factorized, flowchart, gantt, plot
from ._run import Runner, flat_arguments, reordered
from ._steps import steps


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a node at logical steps `early` (ASAP) to `late` (ALAP)."""

    name: str
    kind: str
    early: int
    late: int


class Schedule:
    """A static schedule; build it with `jtile.schedule`.

    - `nodes`: `Node`s (name, kind, macs, out_bytes, inputs), inputs first, then program order.
    - `runs`, `order`: the runs and their node names in execution order (a name repeats
      when a C-P model runs a node more than once; `counts` says how often).
    - `early`, `late`: name -> logical step (of the first run); `critical_path`: the
      names with early == late, in order; `parallel_groups`: names sharing an early step.
    - `peak_bytes`: the most activation bytes live at once; `fifo_bytes`: per edge
      "a->b", the bytes it holds at once; `exact`: False where `memory` fell back to
      its heuristic.
    """

    def __init__(self, built: Built, sequence: list[int], policy: str, granularity: str,
                 exact: bool = True, graph: Graph | None = None, fn=None,
                 backlog: dict[tuple[int, int], int] | None = None):
        self._built, self._dag, self._sequence = built, built.dag, sequence
        self._graph, self._fn = graph, fn
        self.policy, self.granularity, self.exact = policy, granularity, exact
        dag = self._dag
        early, late = steps(dag, sequence)
        self.nodes: list[Node] = dag.nodes
        self.runs = [Run(dag.nodes[i].name, dag.nodes[i].kind, e, l) for i, e, l in zip(sequence, early, late)]
        self.order = [r.name for r in self.runs]
        self.early: dict[str, int] = {}
        self.late: dict[str, int] = {}
        for r in self.runs:  # a node's first run, where it runs more than once
            self.early.setdefault(r.name, r.early)
            self.late.setdefault(r.name, r.late)
        self.counts = Counter(self.order)
        self.critical_path = [r.name for r in self.runs if r.early == r.late]
        by_step: dict[int, list[str]] = {}
        for r in self.runs:
            by_step.setdefault(r.early, []).append(r.name)
        self.parallel_groups = [by_step[s] for s in sorted(by_step)]
        self.peak_bytes = peak_bytes(dag, sequence)
        self.fifo_bytes: dict[str, int] = {}  # "producer->consumer": bytes the edge must hold at once
        for i, preds in enumerate(dag.preds):
            for p in preds:
                node = dag.nodes[p]
                whole = math.prod(node.out_shape)
                waiting = whole if backlog is None else backlog.get((p, i), 0)
                self.fifo_bytes[f"{node.name}->{dag.nodes[i].name}"] = node.out_bytes * waiting // max(whole, 1)

    def __repr__(self) -> str:
        return (f"Schedule({len(self.nodes)} nodes, {len(self.runs)} runs, policy={self.policy!r}, "
                f"{len(self.parallel_groups)} steps, peak {self.peak_bytes:,} B)")

    # ------------------------------------------------------------ memory

    def memory_plan(self, align: int = 64) -> MemoryPlan:
        """A static arena for this order: greedy by size (TFLite Micro), offsets aligned to `align`."""
        return plan_arena(self._dag, self._sequence, align)

    # ------------------------------------------------------------ drawing

    def _labels(self) -> dict[str, str]:
        seen: Counter = Counter()
        labels = {}
        for node in self.nodes:
            labels[node.name] = f"{node.kind}#{seen[node.kind]}"
            seen[node.kind] += 1
        return labels

    def _bars(self, sequence: list[int]) -> list[Bar]:
        labels = self._labels()
        early, late = steps(self._dag, sequence)
        return [Bar(self.nodes[i].name, self.nodes[i].kind, labels[self.nodes[i].name], e, l, e == l)
                for i, e, l in zip(sequence, early, late)]

    def to_mermaid(self, kind: str = "gantt") -> str:
        """Mermaid text: Aidge's "gantt", its "factorized" form, or a "flowchart"."""
        if kind == "gantt":
            return gantt(self._bars(self._sequence))
        if kind == "factorized":
            sections = factorize(self._sequence)
            folded = [i for start, length, _ in sections for i in self._sequence[start : start + length]]
            bars, out = self._bars(folded), []
            for _, length, repeats in sections:
                out.append((repeats, bars[:length]))
                bars = bars[length:]
            return factorized(out)
        if kind == "flowchart":
            labels, critical = self._labels(), set(self.critical_path)
            nodes = [(n.name, labels[n.name], n.name in critical) for n in self.nodes]
            edges = [(p, i, "x".join(map(str, self.nodes[p].out_shape)))
                     for i, preds in enumerate(self._dag.preds) for p in preds]
            return flowchart(nodes, edges)
        raise ConfigError(f"Schedule.to_mermaid: unknown kind {kind!r}; valid kinds are gantt, factorized, flowchart")

    def plot(self, path: str) -> None:
        """Write a PNG timeline (matplotlib): a bar per run from early to late step."""
        plot(self._bars(self._sequence), path, title=f"{self.policy} schedule, peak {self.peak_bytes:,} B")

    def to_json(self) -> dict:
        return {
            "policy": self.policy, "granularity": self.granularity, "exact": self.exact,
            "peak_bytes": self.peak_bytes,
            "nodes": [{"name": n.name, "kind": n.kind, "macs": dict(n.macs), "out_bytes": n.out_bytes,
                       "inputs": list(n.inputs)} for n in self.nodes],
            "runs": [dataclasses.asdict(r) for r in self.runs],
            "critical_path": self.critical_path,
            "parallel_groups": self.parallel_groups,
            "fifo_bytes": self.fifo_bytes,
        }

    # ------------------------------------------------------------ running

    def _runnable(self, where: str):
        if self._graph is None:
            raise ConfigError(f"{where}: this schedule was built without a function; nothing to run")
        return self._graph

    def _first_runs(self) -> list[int]:
        return list(dict.fromkeys(self._sequence))

    def run(self, *args, workers: int = 1):
        """Execute the nodes in the scheduled order and return what `fn(*args)` returns.

        With `workers > 1`, each parallel group runs on a pool of that many threads.
        """
        where = "Schedule.run"
        graph_ = self._runnable(where)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"{where}: workers must be a positive int, got {workers!r}")
        leaves = flat_arguments(where, graph_, self._fn, args)
        if workers == 1:
            groups = [[i] for i in self._first_runs()]
        else:
            index = self._dag.index
            groups = [list(dict.fromkeys(index[n] for n in g)) for g in self.parallel_groups]
        runner = Runner(graph_, self._built.ops, self._built.prologue)
        return jax.tree.unflatten(graph_.out_tree, runner.run(leaves, groups, workers))

    def apply(self) -> Callable:
        """A function with `fn`'s signature whose jaxpr runs the equations in this order."""
        graph_ = self._runnable("Schedule.apply")
        eqns = [op.eqn for op in self._built.prologue]
        eqns += [op.eqn for i in self._first_runs() for op in self._built.ops[i]]
        body, fn = reordered(graph_, eqns), self._fn

        def scheduled(*args):
            leaves = flat_arguments("Schedule.apply", graph_, fn, args)
            return jax.tree.unflatten(graph_.out_tree, body(*leaves))

        return scheduled


def _models(dag: Dag, cp) -> dict[int, CPModel]:
    if callable(cp) and not isinstance(cp, dict):
        return {i: m for i, node in enumerate(dag.nodes) if (m := cp(node)) is not None}
    if not isinstance(cp, dict):
        raise ConfigError(f"schedule: cp must be a dict from node name to CPModel or a function of a Node, "
                          f"got {cp!r}")
    unknown = [name for name in cp if name not in dag.index]
    if unknown:
        raise ConfigError(f"schedule: cp names unknown node(s) {', '.join(map(repr, unknown))}; nodes are "
                          f"{', '.join(n.name for n in dag.nodes[:12])}{', ...' if len(dag) > 12 else ''}")
    return {dag.index[name]: model for name, model in cp.items()}


def schedule(fn, *args, policy: str = "program", granularity: str = "layer",
             cp: dict | Callable | None = None) -> Schedule:
    """The static schedule of `fn(*args)` (a zoo model, a function or an `OnnxModel`).

    `policy`: "program", "asap", "alap", "memory" or "critical". `granularity`:
    "layer" (one node per named scope / ONNX node) or "op" (one per equation).
    `cp`: consumer-producer models, `{node name: CPModel}` or `f(node) -> CPModel | None`;
    then nodes may run many times and the policy must be "program".

    ```python
    s = jtile.schedule(model, x, policy="memory")
    print(s.peak_bytes, s.critical_path, s.memory_plan().arena_bytes)
    ```
    """
    if policy not in POLICIES:
        raise ConfigError(f"schedule: unknown policy {policy!r}; valid policies are {', '.join(POLICIES)}")
    if granularity not in GRANULARITIES:
        raise ConfigError(f"schedule: unknown granularity {granularity!r}; valid granularities are "
                          f"{', '.join(GRANULARITIES)}")
    with gc_paused():
        g = graph(fn, *args)
        built = build(g, granularity, fn)
    if cp is not None:
        if policy != "program":
            raise ConfigError(f"schedule: a C-P schedule orders itself; policy must be 'program', got {policy!r}")
        sequence, backlog = simulate(built.dag, _models(built.dag, cp))
        return Schedule(built, sequence, policy, granularity, True, g, fn, backlog)
    sequence, exact = order(built.dag, policy)
    return Schedule(built, sequence, policy, granularity, exact, g, fn)
