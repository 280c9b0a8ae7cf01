"""Host memory of compiled ResNet-18 variants: heap per extra input shape, and
scratch the kernels keep after their calls.

Each measurement runs in a fresh subprocess and reads the resident set size
(`VmRSS` in /proc/self/status) after `gc.collect()`, for three variants run
side by side:

- `jit`: `jax.jit(lambda m, x: m(x))(model, x)`, the weights passed as arguments;
- `fold`: `jax.jit(fold_params(lambda m, x: m(x), model))(x)`;
- `swap`: `jax.jit(swap_backend(fold_params(...), "auto"))(x)`, the C kernels.

Per extra shape: the model runs at batch 1, 2, 3 and 4 (one compile each);
the figure is the mean RSS growth from batch 2 to 4 (batch 1 also pays for
first-time initialisation). Targets: under 10 MB per extra shape for `fold`
and `swap`. Retained scratch: after compiling at batch 32, ten calls (outputs
dropped), RSS growth over the compiled state. Target: no more than the
kernels' scratch cache bound (`SCRATCH_KEEP_MB`, kernels/common.h) above
what plain `jit` retains.

Run: `python -m pytest benchmarks/bench_memory.py -s`.
"""

import json
import subprocess
import sys

import pytest

SCRATCH_KEEP_MB = 32  # kernels/common.h: kScratchKeepBytes
FIGURES: dict[str, dict[str, float]] = {}

_CHILD = r"""
import gc, json, sys
import jax, numpy as np
import jtile
from jtile.fusion import fold_params

def rss_mb():
    gc.collect()
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

variant, what = sys.argv[1], sys.argv[2]
model = jtile.models.get("resnet18", jax.random.key(0))
if variant == "jit":
    plain = jax.jit(lambda m, x: m(x))
    run = lambda x: plain(model, x)
else:
    folded = fold_params(lambda m, x: m(x), model)
    run = jax.jit(jtile.swap_backend(folded, "auto") if variant == "swap" else folded)
x = lambda batch: jax.random.normal(jax.random.key(1), (batch, 3, 224, 224))
if what == "shapes":
    rss = []
    for batch in (4, 3, 2, 1):
        run(x(batch)).block_until_ready()
        rss.append(rss_mb())
    print(json.dumps({"per_shape_mb": (rss[3] - rss[1]) / 2, "rss_mb": rss}))
else:
    batch = x(32)
    run(x(1)).block_until_ready()          # first-time initialisation
    if variant == "jit":
        compiled = plain.lower(model, batch).compile()
        call = lambda: compiled(model, batch)
    else:
        compiled = run.lower(batch).compile()
        call = lambda: compiled(batch)
    before = rss_mb()
    for _ in range(10):
        call().block_until_ready()
    print(json.dumps({"retained_mb": rss_mb() - before}))
"""


def _measure(variant: str, what: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, variant, what], capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def figure_table(request):
    yield
    lines = ["", "ResNet-18 host memory (RSS, MB; one subprocess per figure):"]
    for variant, figures in FIGURES.items():
        lines.append(f"  {variant:<5} " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(figures.items())))
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines))


@pytest.mark.parametrize("variant", ["jit", "fold", "swap"])
def test_heap_per_extra_input_shape(benchmark, variant):
    result = benchmark.pedantic(_measure, args=(variant, "shapes"), rounds=1, iterations=1)
    FIGURES.setdefault(variant, {})["per_shape_mb"] = result["per_shape_mb"]
    benchmark.extra_info.update(result)
    if variant != "jit":
        assert result["per_shape_mb"] < 10, result


@pytest.mark.parametrize("variant", ["jit", "swap"])
def test_scratch_retained_after_calls_at_batch_32(benchmark, variant):
    result = benchmark.pedantic(_measure, args=(variant, "scratch"), rounds=1, iterations=1)
    FIGURES.setdefault(variant, {})["retained_mb"] = result["retained_mb"]
    benchmark.extra_info.update(result)
    if variant == "swap":
        assert result["retained_mb"] <= FIGURES.get("jit", {}).get("retained_mb", 0) + SCRATCH_KEEP_MB, result
