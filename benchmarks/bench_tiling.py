"""Cost of horizontal tiling: `tile_conv` against the untiled function, both jitted.

Cases: a 64->64 3x3 conv at 224x224 (batch 1) untiled and in 2, 4 and 16
stripes along H, and the zoo's VGG-16 at 224 untiled and in 4 stripes. Each
tiled output is checked against the untiled one before it is timed. At the
end the ratio tiled / untiled (min over rounds) is printed; 1.00x means no
slice-and-concat overhead.

Run: `python -m pytest benchmarks/bench_tiling.py`.
"""

import equinox as eqx
import jax
import numpy as np
import pytest
from jax import lax

import jtile

TIMES: dict[tuple[str, int], float] = {}


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _vgg(model, x):
    return model(x)


def _case(name: str):
    key_w, key_x = jax.random.split(jax.random.key(0))
    if name == "conv3x3_64_224":
        return _conv, (jax.random.normal(key_x, (1, 64, 224, 224)), jax.random.normal(key_w, (64, 64, 3, 3)) * 0.05)
    return _vgg, (jtile.models.get("vgg16", key_w), jax.random.normal(key_x, (1, 3, 224, 224)))


@pytest.fixture(scope="module", autouse=True)
def ratio_table(request):
    yield
    lines = ["", "tile_conv overhead (tiled / untiled, min over rounds):"]
    for (name, tiles), seconds in sorted(TIMES.items()):
        if tiles and (name, 0) in TIMES:
            ratio = seconds / TIMES[(name, 0)]
            lines.append(f"  {name:<16} {tiles:>3} stripes  {ratio:.3f}x  ({seconds * 1e3:.1f} ms)")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines))


@pytest.mark.parametrize(
    "name, tiles",
    [("conv3x3_64_224", t) for t in (0, 2, 4, 16)] + [("vgg16", 0), ("vgg16", 4)],
)
def test_tiled_against_untiled(benchmark, name, tiles):
    fn, args = _case(name)
    untiled = eqx.filter_jit(fn)
    run = eqx.filter_jit(jtile.tile_conv(fn, axis="H", tiles=tiles)) if tiles else untiled
    got = np.asarray(run(*args))
    np.testing.assert_allclose(got, np.asarray(untiled(*args)), rtol=1e-5, atol=1e-5)
    benchmark.group = name
    benchmark.pedantic(lambda: jax.block_until_ready(run(*args)), rounds=10, warmup_rounds=2)
    TIMES[(name, tiles)] = benchmark.stats.stats.min
