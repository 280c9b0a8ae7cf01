"""A double-buffered stripe pipeline for `tile_conv` stripes, timed by a roofline cost model.

For every layer `tile_conv` split into stripes (convs whose outputs are
concatenated), stripe i is loaded (its input window, plus the weights with
the first stripe), computed, and stored, as in seed 001's gantt. One
transfer engine moves loads and stores in turn (prefetching stripe i+2
before storing stripe i), one compute engine runs the convs; with two
buffers on each side, stripe i+2 loads only once stripe i's compute has
freed its input buffer. Durations come from `Roofline`: 2 x MACs over
FLOP/s, bytes over bandwidth, measured once per process or given.

!!! warning

    A model, not a measurement: on a CPU loads and stores are cache traffic
    and the engines are not separate hardware; the gantt shows what overlap
    would buy on a machine with a DMA engine of that bandwidth.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from .._errors import ConfigError
from .._graph import graph
from ._render import Bar, gantt, plot


@dataclasses.dataclass(frozen=True)
class Roofline:
    """FLOP/s and bytes/s of the machine (`Roofline.measure()` times a matmul and a sum)."""

    flops: float
    bandwidth: float

    @staticmethod
    @functools.cache
    def measure() -> "Roofline":
        def best(f, *a):
            jax.block_until_ready(f(*a))
            times = []
            for _ in range(5):
                t = time.perf_counter()
                jax.block_until_ready(f(*a))
                times.append(time.perf_counter() - t)
            return min(times)

        n = 512
        a = jnp.ones((n, n), jnp.float32)
        flops = 2 * n**3 / best(jax.jit(jnp.dot), a, a)
        x = jnp.ones((1 << 24,), jnp.float32)  # 64 MiB read, nothing allocated
        bandwidth = x.nbytes / best(jax.jit(jnp.sum), x)
        return Roofline(flops, bandwidth)

    def compute_us(self, macs: float) -> float:
        return 2 * macs / self.flops * 1e6

    def transfer_us(self, nbytes: float) -> float:
        return nbytes / self.bandwidth * 1e6


@dataclasses.dataclass(frozen=True)
class Task:
    """One load, compute or store of one stripe, in microseconds."""

    name: str
    kind: str
    stripe: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The timed pipeline: its tasks, its length and the length without any overlap."""

    tasks: list[Task]
    makespan_us: float
    serial_us: float
    roofline: Roofline

    def critical_path(self) -> list[str]:
        """The chain of tasks, each starting as the previous one ends, that ends the timeline."""
        if not self.tasks:
            return []
        chain = [max(self.tasks, key=lambda t: t.end)]
        while chain[-1].start > 0:
            before = [t for t in self.tasks if abs(t.end - chain[-1].start) < 1e-9]
            if not before:
                break
            chain.append(max(before, key=lambda t: t.end - t.start))
        return [t.name for t in reversed(chain)]

    def _bars(self) -> list[Bar]:
        critical = set(self.critical_path())
        return [Bar(t.name, t.kind, f"{t.kind}#{t.stripe}", round(t.start, 3), round(t.end, 3),
                    t.name in critical) for t in self.tasks]

    def to_mermaid(self) -> str:
        """Aidge's gantt with real durations, in microseconds."""
        return gantt(self._bars(), title=f"double-buffered stripes, microseconds: {self.makespan_us:.1f} "
                                          f"pipelined vs {self.serial_us:.1f} serial")

    def plot(self, path: str) -> None:
        plot(self._bars(), path, xlabel="microseconds",
             title=f"stripe pipeline: {self.makespan_us:.1f} us (serial {self.serial_us:.1f} us)")


def _stripes(fn, args) -> list[tuple[str, list]]:
    """(layer name, its stripe convs) for every concatenate of conv outputs."""
    g = graph(fn, *args)
    layers = []
    for op in g.ops:
        if op.primitive != "concatenate" or len(op.ins) < 2:
            continue
        convs = [v.producer for v in op.ins]
        if all(c is not None and c.primitive == "conv_general_dilated" for c in convs):
            layers.append((op.scope or f"concatenate_{op.index}", convs))
    if not layers:
        raise ConfigError("stripe_pipeline: no conv stripes found (no concatenate of conv outputs); "
                          "apply jtile.tile_conv to the function first")
    return layers


def stripe_pipeline(fn, *args, roofline: Roofline | None = None, buffers: int = 2) -> Timeline:
    """Time every tiled conv of `fn(*args)` as a pipeline with `buffers` buffers per side."""
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise ConfigError(f"stripe_pipeline: buffers must be a positive int, got {buffers!r}")
    roofline = roofline or Roofline.measure()
    tasks: list[Task] = []
    clock = serial = 0.0
    for name, convs in _stripes(fn, args):
        load = [roofline.transfer_us(c.ins[0].nbytes + (c.ins[1].nbytes if i == 0 else 0))
                for i, c in enumerate(convs)]
        work = [roofline.compute_us(sum(c.macs.values())) for c in convs]
        store = [roofline.transfer_us(c.outs[0].nbytes) for c in convs]
        serial += sum(load) + sum(work) + sum(store)
        layer, clock = _simulate(name, load, work, store, buffers, clock)
        tasks += layer
    return Timeline(tasks, clock, serial, roofline)


def _simulate(name, load, work, store, buffers, clock) -> tuple[list[Task], float]:
    """Start times on one transfer and one compute engine; returns the tasks and the end time."""
    n = len(load)
    transfers = [("load", i) for i in range(min(buffers, n))]
    for i in range(n):
        transfers += ([("load", i + buffers)] if i + buffers < n else []) + [("store", i)]
    end: dict[tuple[str, int], float] = {}
    tasks, dma_free, cpu_free = [], clock, clock
    next_compute = 0
    for what, i in transfers:
        while next_compute < n and ("load", next_compute) in end and (
                next_compute < buffers or ("store", next_compute - buffers) in end):
            k = next_compute
            ready = max(cpu_free, end[("load", k)], end.get(("store", k - buffers), clock))
            cpu_free = end[("compute", k)] = ready + work[k]
            tasks.append(Task(f"{name} compute {k}", "compute", k, ready, cpu_free))
            next_compute += 1
        after = end[("compute", i - buffers)] if what == "load" and i >= buffers else clock
        if what == "store":
            after = end[("compute", i)]
        start = max(dma_free, after)
        dma_free = end[(what, i)] = start + (load[i] if what == "load" else store[i])
        tasks.append(Task(f"{name} {what} {i}", what, i, start, dma_free))
    tasks.sort(key=lambda t: (t.start, t.end))
    return tasks, max(dma_free, cpu_free)
