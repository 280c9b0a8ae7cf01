"""Cost of `shard_spatial` on N host devices, read from the compiled HLO.

Cases: a chain of four 3x3 16->16 convs (+ReLU) at 1024x1024 and ResNet-18 at
896x896, batch 1, each sharded along H over 2 and 4 host devices
(`--xla_force_host_platform_device_count`, so one child process per device
count), with `halo="auto"` (XLA's partitioner) and, for the chain,
`halo="ppermute"` (jtile's shard_map exchange). Each child compiles the
unsharded function and the sharded one side by side, checks the outputs
agree, and reports:

- the collectives in the sharded HLO (collective-permute, all-gather, ...) and
  the bytes each device receives (`jtile.sharding.collectives`);
- per-device memory from `memory_analysis()`: activation bytes = temp + output
  minus the temp of the unsharded program at 64x64 (XLA's copies of the
  weights in its conv layout, which every device holds whatever the image
  size), against the unsharded program's, with the target `1/N + halo`;
- the time of one call, min over rounds, sharded / unsharded (one device).

Host devices share this machine's cores, so the time ratio measures overhead,
not a speed-up; on a loaded machine it is noisy.

Run: `python -m pytest benchmarks/bench_sharding.py -s` (a table at the end),
or one case: `python benchmarks/bench_sharding.py 4 conv_chain auto`.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(sys.argv[1])}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

import jtile  # noqa: E402
from jtile.sharding import collectives  # noqa: E402

ROUNDS = 3
RESULTS: list[dict] = []


def _case(name: str, size: int | None = None):
    key_w, key_x = jax.random.split(jax.random.key(0))
    if name == "conv_chain":
        weights = [w * 0.1 for w in jax.random.normal(key_w, (4, 16, 16, 3, 3))]

        def chain(weights, x):
            for w in weights:
                x = jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1))))
            return x

        return chain, (weights, jax.random.normal(key_x, (1, 16, size or 1024, size or 1024)))
    fn, params = jtile.models.as_function(jtile.models.get("resnet18", key_w))
    return fn, (params, jax.random.normal(key_x, (1, 3, size or 896, size or 896)))


def _best_time(fn, args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def measure(devices: int, name: str, halo: str) -> dict:
    """The sharded and unsharded programs of case `name`, compiled side by side."""
    fn, (params, x) = _case(name)
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,))
    x_sharded = jax.device_put(x, NamedSharding(mesh, jax.P(None, None, "x", None)))
    unsharded = jax.jit(fn).lower(params, x).compile()
    sharded = jax.jit(jtile.shard_spatial(fn, mesh=mesh, halo=halo)).lower(params, x_sharded).compile()
    expected = np.asarray(unsharded(params, x))
    got = np.asarray(sharded(params, x_sharded))
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)
    found = collectives(sharded)
    one, many = unsharded.memory_analysis(), sharded.memory_analysis()
    # XLA copies the weights into its conv layout in temp memory, whatever the image size, and every
    # device holds them: the temp of the unsharded program at 64x64 measures that part
    small = jax.jit(fn).lower(*_case(name, 64)[1]).compile().memory_analysis().temp_size_in_bytes
    return {
        "case": name, "devices": devices, "halo": halo,
        "collectives": {k: [sum(c.kind == k for c in found), sum(c.bytes for c in found if c.kind == k)]
                        for k in sorted({c.kind for c in found})},
        "activation_bytes_1": one.temp_size_in_bytes + one.output_size_in_bytes - small,
        "activation_bytes_n": many.temp_size_in_bytes + many.output_size_in_bytes - small,
        "weight_copy_bytes": small,
        "argument_bytes_1": one.argument_size_in_bytes,
        "argument_bytes_n": many.argument_size_in_bytes,
        "input_bytes": int(x.nbytes),
        "seconds_1": _best_time(unsharded, (params, x)),
        "seconds_n": _best_time(sharded, (params, x_sharded)),
    }


# ---------------------------------------------------------------- pytest: one child per case


def _table() -> list[str]:
    lines = ["", "shard_spatial on N host devices (per device; halo = collective-permute bytes received):",
             f"  {'case':<12}{'N':>3} {'halo':<9}{'collectives':<34}{'act 1 dev':>11}{'act/dev':>11}"
             f"{'ratio':>7}{'1/N+halo':>9}{'time N/1':>9}"]
    for r in RESULTS:
        permute = r["collectives"].get("collective-permute", [0, 0])[1]
        kinds = ", ".join(f"{k} {n}x {b / 1e6:.2f}MB" for k, (n, b) in r["collectives"].items())
        one, many = r["activation_bytes_1"], r["activation_bytes_n"]
        lines.append(
            f"  {r['case']:<12}{r['devices']:>3} {r['halo']:<9}{kinds:<34}{one / 1e6:>9.1f}MB{many / 1e6:>9.1f}MB"
            f"{many / one:>7.3f}{1 / r['devices'] + permute / one:>9.3f}{r['seconds_n'] / r['seconds_1']:>8.2f}x"
        )
    return lines


def pytest_generate_tests(metafunc):
    if "devices" in metafunc.fixturenames:
        cases = [(d, "conv_chain", h) for d in (2, 4) for h in ("auto", "ppermute")]
        cases += [(d, "resnet18", h) for d in (2, 4) for h in ("auto", "ppermute")]
        metafunc.parametrize("devices, name, halo", cases)


def test_sharded_against_one_device(devices, name, halo, request):
    done = subprocess.run(
        [sys.executable, __file__, str(devices), name, halo], capture_output=True, text=True, timeout=1800,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(jtile.__file__).parent.parent),
                                                           os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.splitlines()[-1])
    RESULTS.append(record)
    permute = record["collectives"].get("collective-permute", [0, 0])[1]
    assert "all-gather" not in record["collectives"]
    target = record["activation_bytes_1"] / devices + permute
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(_table()[-1:]), f" target met: {record['activation_bytes_n'] <= target}")


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), sys.argv[2], sys.argv[3])))
