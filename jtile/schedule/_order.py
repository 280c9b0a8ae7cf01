"""The scheduling policies: each turns a `Dag` into a topological order of its nodes.

`program` keeps the order the nodes were given in (the jaxpr's), `asap` and
`alap` sort by early and late step, `critical` runs a node on the critical
path as soon as it is ready and the others by their late step, `memory`
minimises the peak of live bytes (`_memory.memory_order`). Ties always go to
program order, so every policy is deterministic.

!!! warning

    Steps count dependency levels, not time: `critical` is Aidge's logical
    critical path, not the longest path in MACs.
"""

import heapq
from collections.abc import Callable

from .._errors import ConfigError
from ._dag import Dag
from ._memory import memory_order
from ._steps import steps


def _list_schedule(dag: Dag, key: Callable[[int], tuple]) -> list[int]:
    """Repeatedly run the ready node with the smallest `key`."""
    missing = [len(p) for p in dag.preds]
    ready = [(key(i), i) for i, m in enumerate(missing) if m == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for s in dag.succs[i]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(ready, (key(s), s))
    return order


def _by_step(which: int) -> Callable[[Dag], tuple[list[int], bool]]:
    def order(dag: Dag) -> tuple[list[int], bool]:
        program = dag.topological
        step = steps(dag, program)[which]
        at = {node: step[k] for k, node in enumerate(program)}
        rank = {node: k for k, node in enumerate(program)}
        return _list_schedule(dag, lambda i: (at[i], rank[i])), True

    return order


def _critical(dag: Dag) -> tuple[list[int], bool]:
    program = dag.topological
    early, late = steps(dag, program)
    rank = {node: k for k, node in enumerate(program)}
    info = {node: (early[k] != late[k], late[k]) for k, node in enumerate(program)}
    return _list_schedule(dag, lambda i: (*info[i], rank[i])), True


POLICIES: dict[str, Callable[[Dag], tuple[list[int], bool]]] = {
    "program": lambda dag: (list(dag.topological), True),
    "asap": _by_step(0),
    "alap": _by_step(1),
    "critical": _critical,
    "memory": memory_order,
}


def order(dag: Dag, policy: str) -> tuple[list[int], bool]:
    """`(order, exact)` under `policy`; `exact` is False where `memory` fell back to its heuristic."""
    if policy not in POLICIES:
        raise ConfigError(f"schedule: unknown policy {policy!r}; valid policies are {', '.join(POLICIES)}")
    return POLICIES[policy](dag)
