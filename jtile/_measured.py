"""The `"measured"` selector: pick each layer's algorithm by timing it.

`swap_backend(fn, algorithms="measured")` times every algorithm that can
serve a layer, XLA's own op included, on that layer alone (random
activations, the layer's own weights when they are known at trace time, as
under `fold_params`), and runs the fastest. Timings are kept in a JSON cache
per machine and kernel build, so a layer signature is measured once:

- the directory is `$JTILE_CACHE_DIR`, else `$XDG_CACHE_HOME/jtile`, else
  `~/.cache/jtile`;
- the file is `measured-<key>.json`, `<key>` a hash of the CPU model, the
  number of CPUs jax sees, the kernels library's bytes and the jax version.

Each measurement is printed to stderr as it is taken (`jtile: measured ...`),
since a model's first trace may take a while.

!!! warning

    Timings are as noisy as the machine: measure on a quiet one. A cache
    entry is never re-measured; delete the file to measure again.
"""

import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

from ._cpu import cpu_field
from ._errors import ConfigError
from ._interpreter import bind
from ._jit import embedding_any_constant
from ._layers import Layer

XLA = "default"
_REPEATS = 7


def cache_dir() -> str:
    """Where the measured timings live (see the module docstring)."""
    explicit = os.environ.get("JTILE_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jtile")


def _machine_key() -> str:
    from .kernels import LIBRARY_PATH

    digest = hashlib.blake2b(digest_size=8)
    model = cpu_field("model name") or platform.processor()
    digest.update(f"{model}|{len(os.sched_getaffinity(0))}|{jax.__version__}".encode())
    if os.path.exists(LIBRARY_PATH):
        with open(LIBRARY_PATH, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def cache_path() -> str:
    """The cache file of this machine and kernel build."""
    return os.path.join(cache_dir(), f"measured-{_machine_key()}.json")


def _load(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict):
            raise ValueError("not a JSON object")
        return table
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"swap_backend: the measured-timings cache {path} cannot be read ({e}); delete it to measure again"
        ) from None


def _store(path: str, table: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def signature(eqn, known: list, layer: Layer) -> str:
    """What a layer's timing depends on: its description, its equation's
    parameters, and which operands are known at trace time."""
    fields = {k: v for k, v in vars(layer).items() if k not in ("name", "index")}
    operands = [(str(v.aval), x is not None) for v, x in zip(eqn.invars, known)]
    return repr((fields, repr(sorted(eqn.params.items())), operands))


def _seconds(fn: Callable, args: list) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _time(eqn, known: list, run: Callable | None, producers) -> float:
    """Seconds of one call of the layer: random activations as arguments, and
    the operands `known` at trace time (folded weights) as constants, as in
    the real function under `jtile.jit` (embedded, whatever their size)."""
    rng = np.random.default_rng(0)
    fresh = [np.asarray(rng.standard_normal(v.aval.shape), v.aval.dtype) for v in eqn.invars]
    moving = [i for i, x in enumerate(known) if x is None]

    def call(*args):
        values = [fresh[i] if x is None else x for i, x in enumerate(known)]
        for i, a in zip(moving, args):
            values[i] = a
        if run is None:
            out = bind(eqn, *values)
            return out if eqn.primitive.multiple_results else out[0]
        return run(eqn, *values, producers=producers)

    with jax.ensure_compile_time_eval(), embedding_any_constant():
        return _seconds(jax.jit(call), [fresh[i] for i in moving])


def choose(eqn, known: list, layer: Layer, candidates: dict[str, Callable], producers) -> str:
    """The fastest of XLA and `candidates` (`{name: run}`) for this layer,
    measured now or read from the cache. `known` holds each operand's value
    when it is known at trace time, else None."""
    path = cache_path()
    table = _load(path)
    key = signature(eqn, known, layer)
    if key not in table:
        timings = {XLA: _time(eqn, known, None, producers)}
        for name, run in candidates.items():
            timings[name] = _time(eqn, known, run, producers)
        table = {**_load(path), key: timings}
        _store(path, table)
        shown = ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in sorted(timings.items(), key=lambda t: t[1]))
        print(f"jtile: measured {layer.label}: {shown}", file=sys.stderr)
    timings = table[key]
    return min((n for n in timings if n == XLA or n in candidates), key=timings.__getitem__)


__all__ = ["cache_dir", "cache_path", "choose", "signature"]
