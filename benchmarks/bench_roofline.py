"""Per-layer GFLOP/s of real models against the machine's measured FMA peak.

For each model of `bench_real.py` (torchvision exports and zoo models),
`jax.jit(swap_backend(fold_params(fn, params), algorithms="auto"))` is traced
and every conv and dense layer of the result (a C kernel's `ffi_call`, or the
XLA op `"auto"` kept) is timed alone: its folded weights as constants, random
activations, best of 7 calls. Its rate is `2 * MACs / time`, with the MACs of
a direct convolution (so Winograd's rate is an effective one).

The ceiling is a tiny C loop of independent vector multiply-adds (16 lanes,
12 accumulators, so neither latency nor memory limits it), compiled here with
`-O3 -march=native` and run on 1 and on 2 threads at once: the machine's FMA
peak. Each of the 2 cores has its own FMA units, so the ceiling is twice the
1-thread rate (the 2-thread run also shows what other load on the machine
leaves). The table gives each layer's share of that ceiling; `benchmarks/results/roofline-<time>.{json,png}` hold every
figure and a scatter of rate against MACs per model.

Run: `python -m pytest benchmarks/bench_roofline.py -m slow -s` (add
`-k "fma or resnet50"` to pick models).

!!! warning

    Needs a C compiler and the `bench` extra. A layer timed alone runs with
    warm caches, so the sum of the layers is less than the model's time.
"""

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import CASES, onnx_dir  # noqa: E402,F401 (onnx_dir is a fixture)

import jtile  # noqa: E402
from jtile import _measured  # noqa: E402
from jtile.algorithms import swap_backend  # noqa: E402
from jtile.fusion import fold_params  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch,
              pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")]

_FMA_LOOP = r"""
typedef float v16 __attribute__((vector_size(64)));
#define STEP(r) r = r * a + b;
double fma_loop(long iterations) {
  v16 a, b;
  for (int i = 0; i < 16; i++) { a[i] = 1.0f - 1e-7f * i; b[i] = 1e-7f; }
  v16 r0 = b, r1 = b * 2, r2 = b * 3, r3 = b * 4, r4 = b * 5, r5 = b * 6;
  v16 r6 = b * 7, r7 = b * 8, r8 = b * 9, r9 = b * 10, r10 = b * 11, r11 = b * 12;
  for (long n = 0; n < iterations; n++) {  /* 12 independent chains hide the FMA latency */
    STEP(r0) STEP(r1) STEP(r2) STEP(r3) STEP(r4) STEP(r5)
    STEP(r6) STEP(r7) STEP(r8) STEP(r9) STEP(r10) STEP(r11)
  }
  v16 sum = r0 + r1 + r2 + r3 + r4 + r5 + r6 + r7 + r8 + r9 + r10 + r11;
  double total = 0;
  for (int i = 0; i < 16; i++) total += sum[i];
  return total;
}
"""
_ITERATIONS = 20_000_000  # 12 * 16 * 2 flops each: 7.7 GFLOP per thread
PEAK: dict[str, float] = {}
LAYERS: dict[str, list[dict]] = {}


def _fma_library(directory: str) -> ctypes.CDLL:
    source, library = os.path.join(directory, "fma.c"), os.path.join(directory, "fma.so")
    with open(source, "w") as f:
        f.write(_FMA_LOOP)
    subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", source, "-o", library], check=True)
    lib = ctypes.CDLL(library)
    lib.fma_loop.restype, lib.fma_loop.argtypes = ctypes.c_double, [ctypes.c_long]
    return lib


def _rate(lib: ctypes.CDLL, threads: int) -> float:
    """GFLOP/s of `threads` copies of the loop at once (ctypes releases the GIL)."""
    workers = [threading.Thread(target=lib.fma_loop, args=(_ITERATIONS,)) for _ in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * _ITERATIONS * 12 * 16 * 2 / (time.perf_counter() - start) / 1e9


def test_fma_peak():
    with tempfile.TemporaryDirectory() as directory:
        lib = _fma_library(directory)
        assert np.isfinite(lib.fma_loop(1000))
        for threads in (1, 2):
            PEAK[f"{threads} thread{'s' * (threads > 1)}"] = max(_rate(lib, threads) for _ in range(3))
    PEAK["machine"] = 2 * PEAK["1 thread"]
    assert PEAK["2 threads"] > 0 and PEAK["1 thread"] > 0


def _layers(fn) -> list[tuple[str, str, object, list]]:
    """`(name, algorithm, eqn, known operands)` of every conv and dense layer."""
    graph = jtile.graph(fn, jax.ShapeDtypeStruct((1, 3, 224, 224), jnp.float32))
    closed = graph.closed
    consts = dict(zip(closed.jaxpr.constvars, closed.consts))
    found = []
    for op in graph.ops:
        layer = op.layer()
        if layer is None or layer.kind not in ("conv2d", "dense"):
            continue
        algorithm = op.eqn.params["target_name"] if op.primitive == "ffi_call" else f"xla {op.primitive}"
        known = [v.val if isinstance(v, jcore.Literal) else consts.get(v) for v in op.eqn.invars]
        found.append((layer.name, algorithm, op, known))
    return found


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name.replace(" ", "_")) for c in CASES])
def test_layer_rates(onnx_dir, case):
    fn, params = case.jax_function(case.onnx_path(onnx_dir))
    fast = swap_backend(fold_params(fn, params), algorithms="auto")
    rows = []
    for name, algorithm, op, known in _layers(fast):
        macs = sum(op.macs.values())
        seconds = _measured._time(op.eqn, known, None, {})
        rows.append({"layer": name, "algorithm": algorithm, "macs": int(macs), "ms": seconds * 1e3,
                     "gflops": 2 * macs / seconds / 1e9})
    assert rows and all(r["gflops"] > 0 for r in rows)
    LAYERS[case.name] = rows


def _plot(path: Path, peak: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for model, rows in LAYERS.items():
        ax.scatter([r["macs"] for r in rows], [r["gflops"] for r in rows], s=12, label=model, alpha=0.7)
    ax.axhline(peak, color="k", linestyle="--", label=f"FMA peak, 2 cores ({peak:.0f} GFLOP/s)")
    ax.set(xscale="log", xlabel="layer MACs", ylabel="GFLOP/s (layer alone)",
           title="jtile per-layer rate against the machine's FMA peak")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@pytest.fixture(scope="session", autouse=True)
def roofline_report(request):
    yield
    if not LAYERS or not PEAK:
        return
    peak = PEAK["machine"]
    lines = ["", f"FMA peak GFLOP/s: {', '.join(f'{k} {v:.0f}' for k, v in PEAK.items())}"]
    for model, rows in LAYERS.items():
        total_ms = sum(r["ms"] for r in rows)
        rate = 2 * sum(r["macs"] for r in rows) / total_ms / 1e6
        lines.append(f"\n{model}: {len(rows)} layers, {total_ms:.2f} ms alone, {rate:.0f} GFLOP/s "
                     f"({rate / peak:.0%} of peak); the slowest five by time:")
        for r in sorted(rows, key=lambda r: -r["ms"])[:5]:
            lines.append(f"  {r['layer'][:40]:<40} {r['algorithm'][:26]:<26} {r['ms']:7.3f} ms "
                         f"{r['gflops']:6.1f} GFLOP/s {r['gflops'] / peak:5.0%}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    stem = out / f"roofline-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps({"peak_gflops": PEAK, "layers": LAYERS,
                                                     "loadavg": os.getloadavg()}, indent=1))
    _plot(stem.with_suffix(".png"), peak)
    lines.append(f"\nwritten: {stem}.json, {stem}.png; load average {os.getloadavg()}")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines))
