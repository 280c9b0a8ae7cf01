"""Early and late logical steps of a run sequence, as Aidge's scheduler defines them.

A run sequence lists node indices in execution order; a node may run many
times (consumer-producer schedules). A run starts at the earliest step after
its parents' latest runs, after its own previous run, and after every child
has run since its previous run (its output is overwritten); `late` is the
mirror image, counted back from the latest early step. With one run per
node this is ASAP and ALAP on the graph: `early` is the longest path from a
source, `late` is `max(early)` minus the longest path to a sink.

!!! warning

    Steps are logical (one per dependency level), not times; durations are
    the business of `_pipeline`.
"""

from ._dag import Dag


def steps(dag: Dag, sequence: list[int]) -> tuple[list[int], list[int]]:
    """`(early, late)` per position of `sequence`."""
    n = len(sequence)
    early = [0] * n
    last: dict[int, int] = {}  # node -> position of its latest run so far
    for k, node in enumerate(sequence):
        e = 0
        prev = last.get(node)
        if prev is not None:
            e = early[prev] + 1
            for child in dag.succs[node]:
                c = last.get(child)
                if c is not None and c > prev:
                    e = max(e, early[c] + 1)
        for parent in dag.preds[node]:
            p = last.get(parent)
            if p is not None:
                e = max(e, early[p] + 1)
        early[k] = e
        last[node] = k
    latest = max(early, default=0)
    late = [latest] * n
    following: dict[int, int] = {}  # node -> position of its next run
    for k in range(n - 1, -1, -1):
        node = sequence[k]
        t = latest
        nxt = following.get(node)
        if nxt is not None:
            t = late[nxt] - 1
            for parent in dag.preds[node]:
                p = following.get(parent)
                if p is not None and p < nxt:
                    t = min(t, late[p] - 1)
        for child in dag.succs[node]:
            c = following.get(child)
            if c is not None:
                t = min(t, late[c] - 1)
        late[k] = t
        following[node] = k
    return early, late
