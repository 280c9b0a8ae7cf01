"""Peak memory, recompute and time of `tile_spatial` on MobileNetV2's first stages.

Which block: MCUNetV2's. Its MobileNetV2 numbers (int8, one byte per element,
peak = the input plus the output of one op, kB = KiB) are
- untiled, 1372 kB: `features.2`'s 1x1 expansion, 16x112x112 in and
  96x112x112 out, 200,704 + 1,204,224 = 1,404,928 B = 1372.0 KiB, the
  largest of the whole network;
- with patch-based inference, 172 kB: the 28x28 stage's expansion, 32x28x28
  in and 192x28x28 out, 25,088 + 150,528 = 175,616 B = 171.5 KiB (`features.5`
  to `features.7` all have it). So the patches end where the next layers are
  that small: ending after `features.3` would leave `features.4`'s 24x56x56 in
  and 144x56x56 out (514.5 KiB) untiled; ending after `features.4` (the 4th
  inverted-residual block, 32x28x28 out) leaves 171.5 KiB, MCUNetV2's figure.
The block is therefore `features.0` to `features.4` inclusive (`until=
"features.4"`); `features.3` and `features.10` (the end of the 4th stage of
the paper's table, 64x14x14) are extra rows.

Inputs 224 and 448, grids 2x2, 4x4, 8x8, loop mode (tiles reuse the overlap of
earlier tiles: a line buffer above, a cache on the left) against the untiled
function, all jitted. For each case:

- XLA's peak: `jax.jit(f).lower(x).compile().memory_analysis()`, temp plus
  output bytes (the weights and the input are arguments, not counted);
- jtile's own count: `jtile.summary(f).peak_bytes`, live activations in
  program order (`jtile.Graph.peak_bytes`: a loop body counted at its own
  peak, no buffer reuse, so it runs above XLA on the untiled net);
- MACs: `jtile.summary` of the tiled function over the untiled one. A looped
  tile's shape class is a `lax.switch` branch, which the summary counts at
  its most expensive branch (the first tile of a row, with no overlap to
  reuse) for every tile: an upper bound. The `exact` column counts what the
  tiles compute (each op's windows from the plan, times its MACs per output
  element), for comparison;
- time: min over rounds, tiled over untiled, measured side by side (noisy on
  a shared machine).

Targets (MCUNetV2's): at least 8x lower XLA peak at 4x4 @224 on the block, at
most 15% extra MACs, at most 1.2x the untiled time. Every tiled output is
checked against the untiled one (rtol 1e-5, atol 1e-5 x scale: a conv in a
loop body is summed in another order than at top level) before it is measured.

Run: `python -m pytest benchmarks/bench_spatial.py -m ""` (the 448 cases are slow).
"""

import equinox as eqx
import jax
import numpy as np
import pytest

import jtile
from jtile._graph import Graph
from jtile._interpreter import make_jaxpr
from jtile.models._layers import sequential
from jtile.spatial import make_plan, select_block

ROWS: dict[tuple, dict] = {}
TIMES: dict[tuple, float] = {}
BLOCK = "features.4"  # MCUNetV2's (see the module docstring)
STAGES = {BLOCK: 4, "features.3": 3, "features.10": 10}


def first_stages(last: int):
    def fn(features, x):
        return sequential(features[: last + 1], x)

    return fn


def xla_peak(fn, *args) -> int:
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes


def exact_macs(fn, grid, until, *args) -> int:
    """MACs the looped tiles compute: each block op's MACs scaled by the area of its
    windows over all tiles; ops outside the block once."""
    graph = Graph.of(make_jaxpr(fn, *args))
    block = select_block(graph, len(grid), until)
    plan = make_plan(block, grid, uniform=False, reuse=True)
    total = 0.0
    for op in graph.ops:
        macs = sum(op.macs.values())
        if op in block.ops:
            v = op.outs[0]
            full = np.prod([v.shape[d] for d in block.axes[v]])
            macs *= sum(np.prod([w.size for w in ws]) for ws in plan.windows[v]) / full
        total += macs
    return round(total)


@pytest.fixture(scope="module")
def model():
    return jtile.models.get("mobilenet_v2", jax.random.key(0))


@pytest.fixture(scope="module", autouse=True)
def memory_table(request):
    yield
    lines = ["", "tile_spatial on MobileNetV2's first stages (loop mode; peak = temp + output bytes):",
             f"  {'block':<12}{'size':>5}{'grid':>6}{'XLA peak':>12}{'cut':>8}{'jtile peak':>12}{'cut':>8}"
             f"{'MACs':>9}{'exact':>8}{'time':>8}{'max err/scale':>15}"]
    for (stage, size, grid), row in sorted(ROWS.items(), key=lambda kv: (kv[0][0] != BLOCK, *kv[0])):
        base = ROWS.get((stage, size, 0))
        if base is None:
            continue
        macs, exact = (row[k] / base["macs"] for k in ("macs", "exact"))
        time = TIMES.get((stage, size, grid), float("nan")) / TIMES.get((stage, size, 0), float("nan"))
        label = f"{grid}x{grid}" if grid else "none"
        lines.append(f"  {stage:<12}{size:>5}{label:>6}{row['xla'] / 1e6:>10.2f}MB{base['xla'] / row['xla']:>7.1f}x"
                     f"{row['graph'] / 1e6:>10.2f}MB{base['graph'] / row['graph']:>7.1f}x{macs:>8.3f}x"
                     f"{exact:>7.3f}x{time:>7.2f}x{row.get('error', 0.0):>15.1e}")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines))


CASES = [(stage, size, grid) for stage in STAGES for size in (224, 448) for grid in (0, 2, 4, 8)]


@pytest.mark.parametrize(
    "stage, size, grid",
    [pytest.param(*c, marks=pytest.mark.slow) if c[1] == 448 or c[0] != BLOCK else c for c in CASES],
)
def test_tile_spatial_memory_macs_time(benchmark, model, stage, size, grid):
    fn = first_stages(STAGES[stage])
    x = jax.random.normal(jax.random.key(1), (1, 3, size, size))
    args = (model.features, x)
    untiled = eqx.filter_jit(fn)
    if grid:
        tiled = jtile.tile_spatial(fn, grid=(grid, grid), until=stage)
        run = eqx.filter_jit(tiled)
        expected = np.asarray(untiled(*args))
        scale = max(1.0, float(np.abs(expected).max()))
        got = np.asarray(run(*args))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
        summary = jtile.summary(tiled, *args)
        row = dict(xla=xla_peak(tiled, *args), graph=summary.peak_bytes, macs=summary.macs,
                   exact=exact_macs(fn, (grid, grid), stage, *args), error=float(np.abs(got - expected).max()) / scale)
    else:
        run = untiled
        summary = jtile.summary(fn, *args)
        row = dict(xla=xla_peak(fn, *args), graph=summary.peak_bytes, macs=summary.macs, exact=summary.macs)
    ROWS[stage, size, grid] = row
    jax.block_until_ready(run(*args))
    benchmark.group = f"{stage}@{size}"
    benchmark.pedantic(lambda: jax.block_until_ready(run(*args)), rounds=5, iterations=1)
    TIMES[stage, size, grid] = benchmark.stats.stats.min
