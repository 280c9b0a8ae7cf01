"""Wall time of each kernel call inside a compiled function (`jtile.kernels.call_times`).

The kernels time themselves while recording is on: from the handler's first
instruction to its return, as XLA runs it inside the model, so a call of
tens of microseconds is timed as it really runs (a profiler's trace of such
calls reads long). Records are kept in call order, with the target and the
shapes of the first input and the output.
"""

import contextlib
import ctypes
import dataclasses
from collections.abc import Iterator

import numpy as np

from ._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel call: its FFI target, first input's and output's shapes, and microseconds."""

    target: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    us: float


@dataclasses.dataclass
class CallTimes:
    """The kernel calls recorded by `call_times`, in order."""

    calls: list[KernelCall] = dataclasses.field(default_factory=list)

    def by_layer(self, runs: int) -> list[tuple[KernelCall, float]]:
        """`[(call with the fastest time, median µs)]`, one per call of a run,
        for `runs` runs of one function that each made the same calls."""
        if runs < 1 or len(self.calls) % runs:
            raise ConfigError(f"call_times: {len(self.calls)} calls do not split into {runs} runs")
        per_run = len(self.calls) // runs
        layers = []
        for i in range(per_run):
            same = self.calls[i::per_run]
            if len({(c.target, c.in_shape, c.out_shape) for c in same}) != 1:
                raise ConfigError(f"call_times: call {i} differs between runs; time one function, "
                                  "the same number of times, inside the `with` block")
            layers.append((min(same, key=lambda c: c.us), float(np.median([c.us for c in same]))))
        return layers

    def table(self, runs: int) -> str:
        """`by_layer(runs)` as text: the best and median µs, target and shapes per call, and the sum."""
        layers = self.by_layer(runs)
        rows = [f"{best.us:9.1f} {median:9.1f}  {best.target:26s} {best.in_shape} -> {best.out_shape}"
                for best, median in layers]
        total = sum(best.us for best, _ in layers)
        return "\n".join(["  best us  median  target / input -> output", *rows, f"{total:9.1f}  sum of the best"])


_active = False


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",")) if text else ()


def _take(library: ctypes.CDLL, targets: dict[str, str]) -> list[KernelCall]:
    take = library.JtileCallTimesTake
    take.restype = ctypes.c_int64
    while True:
        size = take(None, 0)
        buffer = ctypes.create_string_buffer(int(size))
        if take(buffer, size) <= size:
            text = buffer.raw[:size].decode()
            break
    calls = []
    for line in text.splitlines():
        symbol, inputs, output, us = line.split("\t")
        calls.append(KernelCall(targets.get(symbol, symbol), _shape(inputs), _shape(output), float(us)))
    return calls


@contextlib.contextmanager
def record(library: ctypes.CDLL, targets: dict[str, str]) -> Iterator[CallTimes]:
    """Record every kernel call made inside the block (see `jtile.kernels.call_times`)."""
    global _active
    if _active:
        raise ConfigError("call_times: already recording; nest no `with call_times()` blocks")
    _active = True
    times = CallTimes()
    # A call still running when an earlier block ended records when it returns: drop it.
    _take(library, targets)
    library.JtileCallTimesEnable(ctypes.c_int64(1))
    try:
        yield times
    finally:
        library.JtileCallTimesEnable(ctypes.c_int64(0))
        times.calls.extend(_take(library, targets))
        _active = False
