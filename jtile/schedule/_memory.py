"""Live activation bytes of an order, the memory-minimising order, and the arena plan.

`peak_bytes` measures an order; `memory_order` searches for the order of
least peak: Serenity's dynamic programming over the sets of nodes already
run (their frontier decides what is live), after cutting the graph where
every path crosses one node (each piece is solved on its own, exactly).
A piece of at most `exact_limit` nodes is searched exhaustively; a larger one
keeps a bounded number of the best states per level (a beam search), which is
still exact when no level overflows; the schedule says which it was. `plan_arena` places
every buffer at an offset in one arena, TFLite Micro's greedy-by-size idea:
largest buffer first, at the lowest offset free during its lifetime.

!!! warning

    Inputs and outputs count as activations (they occupy memory while live);
    parameters do not. Sizes are the arrays' bytes, no padding or in-place reuse.
"""

import dataclasses

from ._dag import Dag


def lifetimes(dag: Dag, sequence: list[int]) -> list[tuple[int, int]]:
    """`(first step, last step)` of every buffer under a run sequence: from its producer's
    first run to its readers' last run; outputs live to the end."""
    first_run, last_run = {}, {}
    for k, node in enumerate(sequence):
        first_run.setdefault(node, k)
        last_run[node] = k
    end = len(sequence) - 1
    spans = []
    for buf in dag.buffers:
        first = first_run[buf.producer]
        last = max((last_run[c] for c in buf.consumers), default=first)
        spans.append((first, end if buf.is_output else last))
    return spans


def live_bytes(dag: Dag, sequence: list[int]) -> list[int]:
    """Bytes live at each run of `sequence` (the running node's inputs and outputs included)."""
    delta = [0] * (len(sequence) + 1)
    for buf, (first, last) in zip(dag.buffers, lifetimes(dag, sequence)):
        delta[first] += buf.nbytes
        delta[last + 1] -= buf.nbytes
    live, total = [], 0
    for d in delta[:-1]:
        total += d
        live.append(total)
    return live


def peak_bytes(dag: Dag, sequence: list[int]) -> int:
    """The peak of `live_bytes`."""
    return max(live_bytes(dag, sequence), default=0)


# ------------------------------------------------------------ memory-minimising order


def _cuts(dag: Dag, order: list[int]) -> list[int]:
    """Positions t of `order` after which every optimal order may finish order[:t+1] first:
    every node before t feeds nodes up to t only (so it is an ancestor of
    order[t]), and every non-source node after t descends from order[t]."""
    n = len(order)
    position = {node: k for k, node in enumerate(order)}
    # furthest successor of each position; a sink other than the cut node blocks every later cut
    reach = [max((position[s] for s in dag.succs[node]), default=n) for node in order]
    anchor = [n] * (n + 1)  # suffix minimum of "latest non-source parent" of non-source nodes
    for k in range(n - 1, -1, -1):
        node = order[k]
        parents = [position[p] for p in dag.preds[node] if dag.preds[p]]
        mine = max(parents, default=-1) if dag.preds[node] else n
        anchor[k] = min(anchor[k + 1], mine)
    cuts, furthest = [], -1
    for t in range(n - 1):
        if furthest <= t and anchor[t + 1] >= t:
            cuts.append(t)
        furthest = max(furthest, reach[t])
    return cuts


def _search(dag: Dag, piece: list[int], done: set[int], carried: int, reads_of: list[list[int]],
            width: int) -> tuple[list[int], int, bool]:
    """Least-peak order of `piece` given that `done` already ran and `carried` bytes of
    outputs stay live: (order, peak, exact)."""
    local = {node: j for j, node in enumerate(piece)}
    m = len(piece)
    pred_mask = [sum(1 << local[p] for p in dag.preds[node] if p in local) for node in piece]
    succ_local = [[local[s] for s in dag.succs[node] if s in local] for node in piece]
    made = [sum(dag.buffers[b].nbytes for b in dag.made[node]) for node in piece]
    reads = [[] for _ in piece]  # per node: (bytes, mask of its readers here) of what it may free
    freed_now = [0] * m  # bytes a node makes that nobody reads
    base = carried
    relevant = {b for node in piece for b in (*dag.made[node], *reads_of[node])}
    for b in relevant:
        buf = dag.buffers[b]
        if buf.is_output:
            continue
        readers = sum(1 << local[c] for c in buf.consumers if c in local)
        if buf.producer in done:
            base += buf.nbytes
        if not readers:
            freed_now[local[buf.producer]] += buf.nbytes
        for c in buf.consumers:
            if c in local:
                reads[local[c]].append((buf.nbytes, readers))
    start_ready = sum(1 << j for j in range(m) if not pred_mask[j])
    states = {0: (0, base)}
    ready_of = {0: start_ready}
    history = []
    exact = True
    for _ in range(m):
        nxt: dict[int, tuple[int, int]] = {}
        parents: dict[int, tuple[int, int]] = {}
        next_ready: dict[int, int] = {}
        for mask, (peak, live) in states.items():
            ready = todo = ready_of[mask]
            while todo:
                low = todo & -todo
                todo ^= low
                j = low.bit_length() - 1
                new = mask | low
                step_peak = max(peak, live + made[j])
                after = live + made[j] - freed_now[j] - sum(size for size, r in reads[j] if not r & ~new)
                if new not in nxt:
                    next_ready[new] = (ready ^ low) | sum(1 << c for c in succ_local[j] if not pred_mask[c] & ~new)
                elif (step_peak, after) >= nxt[new]:
                    continue
                nxt[new] = (step_peak, after)
                parents[new] = (mask, j)
        if len(nxt) > width:
            exact = False
            nxt = dict(sorted(nxt.items(), key=lambda kv: kv[1])[:width])
        ready_of = next_ready
        history.append(parents)
        states = nxt
    (mask, (peak, _)), = states.items()
    order = []
    for parents in reversed(history):
        mask, j = parents[mask]
        order.append(piece[j])
    return order[::-1], peak, exact


def memory_order(dag: Dag, exact_limit: int = 30, work: int = 4_000_000) -> tuple[list[int], bool]:
    """The order of least peak live bytes, and whether it is exact.

    A piece of `exact_limit` nodes or fewer keeps up to 200,000 states per level;
    a piece of m nodes keeps `work / m**2` (at least 64), the best by peak. A
    heuristic result worse than the program order gives the program order."""
    program = dag.topological
    bounds = [-1, *_cuts(dag, program), len(program) - 1]
    reads_of: list[list[int]] = [[] for _ in dag.nodes]
    for b, buf in enumerate(dag.buffers):
        for c in buf.consumers:
            reads_of[c].append(b)
    order: list[int] = []
    done: set[int] = set()
    carried, exact = 0, True
    for a, b in zip(bounds, bounds[1:]):
        piece = program[a + 1 : b + 1]
        width = 200_000 if len(piece) <= exact_limit else max(64, work // len(piece) ** 2)
        part, _, piece_exact = _search(dag, piece, done, carried, reads_of, width)
        order += part
        done.update(part)
        carried += sum(dag.buffers[x].nbytes for node in part for x in dag.made[node] if dag.buffers[x].is_output)
        exact &= piece_exact
    if not exact and peak_bytes(dag, order) > peak_bytes(dag, program):
        return list(program), False  # a heuristic never does worse than the program order
    return order, exact


# ------------------------------------------------------------ arena


@dataclasses.dataclass(frozen=True)
class PlannedBuffer:
    """One activation in the arena: bytes [offset, offset + size) during steps [first, last]."""

    name: str
    size: int
    first: int
    last: int
    offset: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A static arena for one order: every activation's offset and lifetime."""

    buffers: list[PlannedBuffer]
    arena_bytes: int
    naive_bytes: int
    peak_bytes: int

    def table(self) -> str:
        rows = [f"{'buffer':<40} {'bytes':>12} {'offset':>12}  steps"]
        rows += [f"{b.name:<40} {b.size:>12,} {b.offset:>12,}  {b.first}..{b.last}" for b in self.buffers]
        rows.append(f"arena {self.arena_bytes:,} B, peak live {self.peak_bytes:,} B, "
                    f"sum of buffers {self.naive_bytes:,} B")
        return "\n".join(rows)


def plan_arena(dag: Dag, sequence: list[int], align: int = 64) -> MemoryPlan:
    """Greedy by size: biggest first, each at the lowest aligned offset free over its lifetime."""
    spans = lifetimes(dag, sequence)
    todo = sorted(range(len(dag.buffers)), key=lambda b: (-dag.buffers[b].nbytes, spans[b][0]))
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets = {}
    for b in todo:
        size, (first, last) = dag.buffers[b].nbytes, spans[b]
        busy = sorted((o, e) for o, e, f, l in placed if f <= last and first <= l)
        offset = 0
        for o, e in busy:
            if offset + size <= o:
                break
            offset = max(offset, -(-e // align) * align)
        offsets[b] = offset
        placed.append((offset, offset + size, first, last))
    buffers = [PlannedBuffer(buf.name, buf.nbytes, *spans[b], offsets[b]) for b, buf in enumerate(dag.buffers)]
    return MemoryPlan(
        buffers=sorted(buffers, key=lambda p: (p.first, p.offset)),
        arena_bytes=max((o + s for o, s in ((p.offset, p.size) for p in buffers)), default=0),
        naive_bytes=sum(buf.nbytes for buf in dag.buffers),
        peak_bytes=peak_bytes(dag, sequence),
    )
