"""Runs `shard_spatial` cases on N host devices in a fresh process, for tests/test_sharding.py.

The device count is fixed when jax starts, so each device count gets its own
process: `python tests/sharding_runner.py <devices> <suite>[,<suite>...]` sets
`XLA_FLAGS=--xla_force_host_platform_device_count=<devices>` before importing
jax, runs the suite's cases, and prints one JSON object per case: the largest
difference from the unsharded function, the output scale, the collectives of
the compiled program, or the jtile error a bad input raised. The test process
asserts on them.

`python tests/sharding_runner.py process <id> <port>` is one of two
processes that `jax.distributed` joins into one 4-device mesh.
"""

import json
import os
import sys

if __name__ == "__main__":
    DEVICES = 2 if sys.argv[1] == "process" else int(sys.argv[1])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jtile  # noqa: E402
from jtile.sharding import collectives  # noqa: E402


def _conv(x, w, stride=1, pad=1, dilation=1, groups=1):
    pad = pad if isinstance(pad, tuple) else (pad, pad)
    return lax.conv_general_dilated(
        x, w, (stride, stride), (pad, pad), rhs_dilation=(dilation, dilation), feature_group_count=groups
    )


def _weights(key, shapes):
    return [jax.random.normal(k, s) * 0.3 for k, s in zip(jax.random.split(key, len(shapes)), shapes)]


def _chain(size, batch=1):
    """Odd sizes, strides 1 and 2, dilation, asymmetric and no padding, pools,
    a residual add, a channel concatenation, a depthwise conv."""
    key_x, key_w = jax.random.split(jax.random.key(size))
    weights = _weights(key_w, [(6, 3, 3, 3), (6, 6, 3, 3), (6, 8, 5, 5), (6, 1, 3, 3), (8, 12, 1, 1), (8, 8, 3, 3)])

    def fn(ws, x):
        w0, w1, w2, w3, w4, w5 = ws
        a = jax.nn.relu(_conv(x, w0, pad=(1, 2)))  # size + 1 rows
        b = _conv(a, w1, dilation=2, pad=2) + a  # residual
        c = lax.reduce_window(b, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
        d = jnp.concatenate([c, _conv(c, w3, groups=6)], axis=1)  # depthwise branch, channel concat
        e = jax.nn.relu6(_conv(d, w4, pad=0))
        f = _conv(e, w5, stride=2, pad=0)  # no padding, stride 2
        g = lax.reduce_window(f, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 1, 1), ((0, 0), (0, 0), (0, 1), (0, 1))) / 4
        return _conv(g, w2, pad=2)[:, 1:]  # a channel slice keeps the stripes

    return fn, (weights, jax.random.normal(key_x, (batch, 3, size, size)))


def _model(name, size, batch=1):
    key_m, key_x = jax.random.split(jax.random.key(1))
    return (lambda model, x: model(x)), (jtile.models.get(name, key_m), jax.random.normal(key_x, (batch, 3, size, size)))


def _tutorial():
    """Aidge's tutorial net with padding, whose edge stripes keep their padding."""
    model = jtile.models.Tutorial(jax.random.key(0), padding=1)
    return (lambda model, x: model(x)), (model, jax.random.normal(jax.random.key(1), (4, 3, 66, 66)))


def _mesh(devices, batch_split=1):
    if batch_split == 1:
        return jax.make_mesh((devices,), ("x",))
    return jax.make_mesh((batch_split, devices // batch_split), ("batch", "x"))


def run_case(name, fn, args, mesh, **config):
    """One case as a dict: outputs against the unsharded function, and the collectives."""
    record = {"case": name}
    try:
        sharded = jax.jit(jtile.shard_spatial(fn, mesh=mesh, **config))
        compiled = sharded.lower(*args).compile()
    except jtile.JtileError as e:
        return {**record, "error": type(e).__name__, "message": str(e)}
    expected = np.asarray(jax.jit(fn)(*args))
    got = np.asarray(compiled(*args))
    memory = compiled.memory_analysis()
    return {
        **record,
        "shape": list(got.shape),
        "max_diff": float(np.max(np.abs(got - expected))),
        "scale": float(np.max(np.abs(expected))),
        "collectives": [[c.kind, c.bytes, list(map(list, c.shapes))] for c in collectives(compiled)],
        "temp_bytes": int(memory.temp_size_in_bytes),
    }


def _chain_size(devices):
    return {2: 41, 4: 67, 8: 131}[devices]  # odd; the last layer's rows divide evenly


def _suite_chains(devices):
    for halo in ("auto", "ppermute"):
        yield f"chain-{halo}", *_chain(_chain_size(devices)), _mesh(devices), {"halo": halo}


def _suite_axes(devices):
    size = _chain_size(devices)
    yield "chain-W", *_chain(size), _mesh(devices), {"axis": "W"}
    if devices >= 4:
        yield "chain-batch", *_chain(size, batch=4), _mesh(devices, 2), {"batch_axis": "batch", "mesh_axis": "x"}
        yield "chain-batch-ppermute", *_chain(size, batch=4), _mesh(devices, 2), {
            "batch_axis": "batch", "halo": "ppermute"}


def _suite_bad(devices):
    mesh = _mesh(devices)
    x = jnp.ones((1, 3, devices * 4 + 1, 9))
    yield "too-few-rows", lambda w, x: _conv(x, w, stride=2, pad=0), (jnp.ones((2, 3, 1, 1)), x[:, :, : 2 * devices - 2]), mesh, {}
    yield "halo-past-neighbour", lambda w, x: _conv(x, w, pad=0), (jnp.ones((2, 3, 15, 1)), jnp.ones((1, 3, devices * 4 + 14, 9))), mesh, {}
    yield "transpose-in-block", lambda w, x: _conv(_conv(x, w).transpose(0, 1, 3, 2), w[:, :3]), (
        jnp.ones((3, 3, 3, 3)), x), mesh, {}
    yield "stripes-drift", lambda w, x: _conv(x, w, stride=3, pad=0), (jnp.ones((2, 3, 1, 1)), jnp.ones((1, 3, 25, 9))), mesh, {
        "halo": "ppermute"}


def _suite_exits(devices):
    """Blocks that end in a global pool (ResNet's head) and in a flatten (VGG's)."""
    mesh, rows = _mesh(devices), 4 * devices + 3
    key_w, key_d, key_x = jax.random.split(jax.random.key(2), 3)
    w, dense, x = jax.random.normal(key_w, (8, 3, 3, 3)), jax.random.normal(key_d, (8, 5)), jax.random.normal(key_x, (2, 3, rows, rows))

    def global_pool(w, dense, x):
        y = jax.nn.relu(_conv(x, w))
        pooled = lax.reduce_window(y, 0.0, lax.add, (1, 1, rows, rows), (1, 1, 1, 1), "VALID") / rows**2
        return pooled.reshape(2, 8) @ dense

    def flatten(w, dense, x):
        return jax.nn.relu(_conv(x, w, stride=2)).reshape(2, -1)[:, :5] @ dense[:5]

    yield "global-pool", global_pool, (w, dense, x), mesh, {}
    yield "flatten", flatten, (w, dense, x), mesh, {}


def _suite_models(devices):
    size = 32 * devices
    for name in ("resnet18", "mobilenet_v2"):
        yield f"{name}-{size}", *_model(name, size), _mesh(devices), {}


SUITES = {"chains": _suite_chains, "axes": _suite_axes, "bad": _suite_bad, "exits": _suite_exits,
          "models": _suite_models}


def main(devices: int, suites: str) -> None:
    """Run the comma-separated `suites` on `devices` host devices."""
    assert jax.device_count() == devices, (jax.device_count(), devices)
    for suite in suites.split(","):
        for name, fn, args, mesh, config in SUITES[suite](devices):
            print(json.dumps(run_case(name, fn, args, mesh, **config)), flush=True)


def process(process_id: int, port: int) -> None:
    """One of two processes with 2 devices each: `shard_spatial` over the global
    4-device mesh, the output replicated back, compared with this process's
    unsharded run on one of its own devices."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120
    )
    fn, args = _tutorial()
    mesh = _mesh(4)
    sharded = jax.jit(jtile.shard_spatial(fn, mesh=mesh), out_shardings=jax.sharding.NamedSharding(mesh, jax.P()))
    compiled = sharded.lower(*args).compile()
    got = np.asarray(compiled(*args).addressable_data(0))
    expected = np.asarray(jax.jit(fn)(*jax.device_put(args, jax.local_devices()[0])))
    print(json.dumps({
        "case": f"process-{process_id}",
        "devices": [jax.device_count(), jax.local_device_count()],
        "max_diff": float(np.max(np.abs(got - expected))),
        "scale": float(np.max(np.abs(expected))),
        "collectives": [[c.kind, c.bytes, list(map(list, c.shapes))] for c in collectives(compiled)],
    }), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "process":
        process(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(int(sys.argv[1]), sys.argv[2])
