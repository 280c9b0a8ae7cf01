"""Host memory: heap per extra input shape of compiled ResNet-18 variants, and
scratch the C kernels keep after their calls.

Each figure comes from a fresh subprocess reading the resident set size
(`VmRSS` in /proc/self/status) after `gc.collect()` and glibc's
`malloc_trim(0)` (so freed heap that malloc keeps for reuse, such as XLA's
output buffers, does not count). Variants, side by side:

- `jit`: `jax.jit(lambda m, x: m(x))(model, x)`, the weights passed as arguments;
- `fold`: `jax.jit(fold_params(lambda m, x: m(x), model))(x)`;
- `swap`: `jax.jit(swap_backend(fold_params(...), algorithms="auto"))(x)`, the C kernels;

`fold` and `swap` each compiled by `jax.jit` (closed-over constants embedded
in every executable) and by `jtile.jit` (`hoisted`: passed as arguments).

Per extra shape: the model runs at batch 6, 5, ..., 1 (one compile each,
largest first so that later shapes need no larger activation buffers); the
figure is the median RSS growth of the last four (the second shape still
pays for some first-time work). Target: under 10 MB for the fast pattern,
`jtile.jit(swap_backend(fold_params(...)))`. `jtile.jit` keeps the weights of
convs XLA runs itself embedded (XLA lays them out at compile time), so
hoisted `fold` stays close to `fold`.
RSS moves by a few MB from run to run (plain `jit` measured 10.6 to 13.6 MB
on a busy machine), so compare the variants of one run.

Retained scratch: a layer per kernel at batch 32, compiled, then ten calls
(outputs dropped); the figure is the RSS growth over the compiled state, next
to XLA's own conv run the same way. Target: at most the kernels' scratch cache
bound (`SCRATCH_KEEP_MB`, kScratchKeepBytes in kernels/common.h).

Run: `python -m pytest benchmarks/bench_memory.py -s` (a few minutes).
"""

import json
import subprocess
import sys

import pytest

SCRATCH_KEEP_MB = 32  # kernels/common.h: kScratchKeepBytes
FIGURES: dict[str, dict[str, float]] = {}


LAYERS = [  # (name, x shape, w shape, algorithm): batch 32, the kernels' largest scratch
    ("winograd 3x3 64->64 @56", (32, 64, 56, 56), (64, 64, 3, 3), "winograd"),
    ("smm 3x3 512->512 @7", (32, 512, 7, 7), (512, 512, 3, 3), "smm"),
    ("smm 3x3 256->256 @14", (32, 256, 14, 14), (256, 256, 3, 3), "smm"),
    ("depthwise 3x3 144 @56", (32, 144, 56, 56), (144, 1, 3, 3), "depthwise"),
]

_CHILD = f"LAYERS = {LAYERS!r}\n" + r"""
import ctypes, gc, json, sys
import jax, numpy as np
import jtile
from jtile.fusion import fold_params

libc = ctypes.CDLL("libc.so.6")

def rss_mb():
    gc.collect()
    libc.malloc_trim(0)  # hand freed heap back, so RSS counts live memory only
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

variant, what = sys.argv[1], sys.argv[2]
if what == "layers":
    from jax import lax
    from jtile import kernels
    out = {}
    for name, xs, ws, algorithm in LAYERS:
        x, w = jax.random.normal(jax.random.key(0), xs), jax.random.normal(jax.random.key(1), ws)
        groups = ws[0] if algorithm == "depthwise" else 1
        conv = dict(padding=((1, 1), (1, 1)), groups=groups)
        if variant == "jit":
            f = jax.jit(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), conv["padding"], feature_group_count=groups))
        else:
            f = jax.jit(lambda x, w: kernels.conv2d(x, w, algorithm=algorithm, **conv))
        compiled = f.lower(x, w).compile()
        before = rss_mb()
        for _ in range(10):
            compiled(x, w).block_until_ready()
        out[name] = rss_mb() - before
    print(json.dumps(out))
    sys.exit()
model = jtile.models.get("resnet18", jax.random.key(0))
if variant == "jit":
    plain = jax.jit(lambda m, x: m(x))
    assert what == "shapes"
    run = lambda x: plain(model, x)
else:
    folded = fold_params(lambda m, x: m(x), model)
    compile = jtile.jit if sys.argv[3] == "hoisted" else jax.jit
    run = compile(jtile.swap_backend(folded, algorithms="auto") if variant == "swap" else folded)
x = lambda batch: jax.random.normal(jax.random.key(1), (batch, 3, 224, 224))
rss = []
for batch in (6, 5, 4, 3, 2, 1):
    run(x(batch)).block_until_ready()
    rss.append(rss_mb())
print(json.dumps({"per_shape_mb": float(np.median(np.diff(rss)[1:])), "rss_mb": rss}))
"""


def _measure(variant: str, what: str, hoisted: bool = False) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, variant, what, "hoisted" if hoisted else "embedded"],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def figure_table(request):
    yield
    lines = ["", "Host memory (RSS growth, MB; one subprocess per row):"]
    for row, figures in FIGURES.items():
        lines.append(f"  {row:<34} " + "  ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines))


@pytest.mark.parametrize("variant, hoisted", [("jit", False), ("fold", False), ("fold", True),
                                              ("swap", False), ("swap", True)])
def test_heap_per_extra_input_shape(benchmark, variant, hoisted):
    result = benchmark.pedantic(_measure, args=(variant, "shapes", hoisted), rounds=1, iterations=1)
    FIGURES[f"ResNet-18 per extra shape: {variant}{' hoisted' if hoisted else ''}"] = {
        "MB": result["per_shape_mb"]}
    benchmark.extra_info.update(result)
    if hoisted and variant == "swap":
        assert result["per_shape_mb"] < 10, result


@pytest.mark.parametrize("variant", ["jit", "kernels"])
def test_scratch_retained_after_calls_at_batch_32(benchmark, variant):
    result = benchmark.pedantic(_measure, args=(variant, "layers"), rounds=1, iterations=1)
    FIGURES[f"retained after 10 calls, batch 32: {variant}"] = result
    benchmark.extra_info.update(result)
    if variant == "kernels":
        assert max(result.values()) <= SCRATCH_KEEP_MB, result
