import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jtile
from jtile import _regions, sharding

RUNNER = Path(__file__).with_name("sharding_runner.py")
ROOT = Path(jtile.__file__).parent.parent


def subprocess_env() -> dict:
    """The environment of a child python that imports this jtile."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@functools.cache
def run_suites(devices: int, suites: str) -> dict:
    """The runner's records of `suites` on `devices` host devices, by case name."""
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(devices), suites],
        capture_output=True, text=True, timeout=900, env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    return {r["case"]: r for r in records}


def assert_matches(record, *, rtol=1e-5):
    assert "error" not in record, record.get("message")
    assert record["max_diff"] <= rtol * max(record["scale"], 1.0), record["case"]


def kinds(record) -> set:
    return {kind for kind, _, _ in record["collectives"]}


# ---------------------------------------------------------------- several devices, in a child process


@pytest.mark.parametrize("devices", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_sharded_conv_chain_equals_unsharded_and_swaps_only_halos(devices):
    records = run_suites(devices, "chains")
    for halo in ("auto", "ppermute"):
        record = records[f"chain-{halo}"]
        assert_matches(record)
        # every layer runs on stripes: neighbours swap rows, nothing is gathered
        assert kinds(record) == {"collective-permute"}, record["collectives"]
        # a halo is a few rows: no permute moves more than a tenth of the largest activation
        largest = 1 * 12 * (_chain_rows(devices) + 1) * (_chain_rows(devices) + 1) * 4
        assert max(b for _, b, _ in record["collectives"]) < largest / 10


def _chain_rows(devices):
    spec = importlib.util.spec_from_file_location("sharding_runner", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return runner._chain_size(devices)


@pytest.mark.parametrize("devices", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_width_axis_and_batch_axis_on_a_2d_mesh(devices):
    records = run_suites(devices, "axes")
    for case in ("chain-W", "chain-batch", "chain-batch-ppermute"):
        assert_matches(records[case])
        assert kinds(records[case]) == {"collective-permute"}
    # with the batch split in two, each device's halo rows carry half the batch of 4
    (kind, nbytes, (shape,)) = records["chain-batch"]["collectives"][0]
    assert shape[0] == 2


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_bad_input_on_several_devices_says_what_to_change(devices):
    records = run_suites(devices, "bad,exits")
    few = records["too-few-rows"]
    assert few["error"] == "ConfigError"
    assert f"has {devices - 1} output rows along H, fewer than the {devices} devices" in few["message"]
    past = records["halo-past-neighbour"]
    assert past["error"] == "ConfigError" and "halo would reach past the neighbour" in past["message"]
    transpose = records["transpose-in-block"]
    assert transpose["error"] == "UnsupportedError"
    assert transpose["message"].startswith("shard_spatial: transpose (op #1) reads an activation sharded along H")
    drift = records["stripes-drift"]
    if devices == 8:  # 25 -> 9 rows at stride 3: device 4 reads rows 24.. but holds 16..19
        assert drift["error"] == "UnsupportedError" and "drift apart by more than a stripe" in drift["message"]
    else:
        assert_matches(drift)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_a_global_pool_ends_the_block_with_an_all_reduce_and_a_flatten_with_a_gather(devices):
    records = run_suites(devices, "bad,exits")
    pool, flatten = records["global-pool"], records["flatten"]
    assert_matches(pool)
    assert_matches(flatten)
    assert kinds(pool) == {"collective-permute", "all-reduce"}
    (_, nbytes, _), = [c for c in pool["collectives"] if c[0] == "all-reduce"]
    assert nbytes <= 2 * 8 * (4 * devices + 3) * 4  # partial sums of one row per channel, not the activation
    assert kinds(flatten) == {"collective-permute", "all-gather"}  # the last activation, once, for the dense layer


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4, 8])
def test_resnet18_and_mobilenet_v2_sharded_equal_unsharded(devices):
    records = run_suites(devices, "models")
    for name in ("resnet18", "mobilenet_v2"):
        record = records[f"{name}-{32 * devices}"]
        assert_matches(record, rtol=1e-4)
        # halos inside the block; one all-reduce where global pooling ends it
        assert kinds(record) == {"collective-permute", "all-reduce"}
        assert sum(kind == "all-reduce" for kind, _, _ in record["collectives"]) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_of_two_devices_run_one_sharded_mesh():
    port = _free_port()
    children = [
        subprocess.Popen([sys.executable, str(RUNNER), "process", str(i), str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=subprocess_env())
        for i in range(2)
    ]
    try:
        outputs = [child.communicate(timeout=300) for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, err[-3000:]
        record = json.loads(out.splitlines()[-1])
        assert record["devices"] == [4, 2]
        assert_matches(record)
        # halos cross the process boundary as collective-permutes; one all-gather replicates the output
        assert kinds(record) == {"collective-permute", "all-gather"}


# ---------------------------------------------------------------- one device, in process


def test_collectives_read_kinds_shapes_and_bytes_from_hlo_text():
    hlo = """
  %collective-permute.1 = f32[1,8,2,64]{3,2,1,0} collective-permute(f32[1,8,2,64]{3,2,1,0} %s), channel_id=1, source_target_pairs={{0,1}}, metadata={op_name="jit(f)/conv_general_dilated"}
  %ag = bf16[4,6]{1,0} all-gather(bf16[1,6]{1,0} %p), dimensions={0}
  ROOT %ar = (f32[3]{0}, s8[5]{0}) all-reduce(f32[3]{0} %a, s8[5]{0} %b), to_apply=%add
  %cps = (f32[2,2]{1,0}, f32[2,2]{1,0}, u32[], u32[]) collective-permute-start(f32[2,2]{1,0} %x), source_target_pairs={{1,0}}
  %cpd = f32[2,2]{1,0} collective-permute-done(%cps)
  %add.3 = f32[3]{0} add(%a, %b)
"""
    found = sharding.collectives(hlo)
    assert [(c.kind, c.shapes, c.bytes) for c in found] == [
        ("collective-permute", ((1, 8, 2, 64),), 1 * 8 * 2 * 64 * 4),
        ("all-gather", ((4, 6),), 4 * 6 * 2),
        ("all-reduce", ((3,), (5,)), 3 * 4 + 5),
        ("collective-permute", ((2, 2),), 16),
    ]
    assert found[0].op_name == "jit(f)/conv_general_dilated" and found[1].op_name == ""


def _tutorial(padding=1):
    model = jtile.models.Tutorial(jax.random.key(0), padding=padding)
    return (lambda model, x: model(x)), model, jax.random.normal(jax.random.key(1), (2, 3, 20, 20))


@pytest.mark.parametrize("halo", ["auto", "ppermute", "xla"])
def test_one_device_mesh_gives_the_same_outputs_and_no_collectives(halo, tree_allclose):
    fn, model, x = _tutorial()
    mesh = jax.make_mesh((1,), ("x",))
    sharded = jax.jit(jtile.shard_spatial(fn, mesh=mesh, halo=halo))
    compiled = sharded.lower(model, x).compile()
    assert tree_allclose(compiled(model, x), fn(model, x))
    assert sharding.collectives(compiled) == []


def test_decorator_form_and_composition_with_jit(tree_allclose):
    mesh = jax.make_mesh((1,), ("x",))

    @jtile.shard_spatial(mesh=mesh, axis="W")
    def f(w, x):
        return jax.nn.relu(lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1))))

    w, x = jnp.ones((4, 3, 3, 3)), jax.random.normal(jax.random.key(0), (1, 3, 9, 9))
    expected = jax.nn.relu(lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1))))
    assert tree_allclose(jax.jit(f)(w, x), expected)


def test_auto_takes_the_ppermute_exchange_where_xla_would_gather(monkeypatch, tree_allclose):
    """Where the probe's HLO shows an all-gather in a layer's scope, that layer is
    built as a shard_map with ppermutes (the probe's verdict, not its compile, is faked)."""
    real = sharding.collectives

    def gathering(compiled):
        found = real(compiled)
        return found + [sharding.Collective("all-gather", "ag", ((1,),), 4, "jit(program)/jtile_probe_0/conv")]

    monkeypatch.setattr(sharding, "collectives", gathering)
    monkeypatch.setattr(sharding, "_PROBED", {})
    fn, model, x = _tutorial()
    mesh = jax.make_mesh((1,), ("x",))
    sharded = jtile.shard_spatial(fn, mesh=mesh)
    prims = {e.primitive.name for e in jax.make_jaxpr(sharded)(model, x).jaxpr.eqns}
    assert "shard_map" in prims
    assert tree_allclose(jax.jit(sharded)(model, x), fn(model, x))
    monkeypatch.setattr(sharding, "_PROBED", {})
    monkeypatch.setattr(sharding, "collectives", real)
    prims = {e.primitive.name for e in jax.make_jaxpr(jtile.shard_spatial(fn, mesh=mesh))(model, x).jaxpr.eqns}
    assert "shard_map" not in prims


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(mesh_axis="y"), "mesh_axis 'y' is not an axis of the mesh; its axes are ('x',)"),
        (dict(batch_axis="b"), "batch_axis 'b' is not an axis of the mesh"),
        (dict(axis="C"), "axis must be one of W, H, D, got 'C'"),
        (dict(halo="allgather"), "halo must be one of auto, ppermute, xla"),
        (dict(mesh_axis="x", batch_axis="x"), "mesh_axis and batch_axis are both 'x'"),
        (dict(tiles=4), "unknown keyword(s) tiles"),
    ],
)
def test_bad_configuration_raises_config_error(config, message):
    with pytest.raises(jtile.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        jtile.shard_spatial(lambda x: x, mesh=jax.make_mesh((1,), ("x",)), **config)


def test_mesh_without_a_named_axis_or_not_a_mesh():
    with pytest.raises(jtile.ConfigError, match=r"the mesh has axes \('a', 'b'\); say which one splits H"):
        jtile.shard_spatial(lambda x: x, mesh=jax.make_mesh((1, 1), ("a", "b")))
    with pytest.raises(jtile.ConfigError, match="mesh must be a jax.sharding.Mesh"):
        jtile.shard_spatial(lambda x: x, mesh=("x", 4))


def test_a_function_without_convolutions_is_refused():
    sharded = jtile.shard_spatial(lambda x: jnp.tanh(x), mesh=jax.make_mesh((1,), ("x",)))
    with pytest.raises(jtile.UnsupportedError, match="no convolution or pooling along H"):
        sharded(jnp.ones((1, 3, 8, 8)))


def test_a_transposed_convolution_is_refused_by_name():
    def f(w, x):
        return lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), lhs_dilation=(2, 2))

    sharded = jtile.shard_spatial(f, mesh=jax.make_mesh((1,), ("x",)))
    with pytest.raises(jtile.UnsupportedError, match=r"cannot partition conv_general_dilated \(op #0\) along H: "
                       r"it has lhs_dilation \(2, 2\) \(a transposed convolution\)"):
        sharded(jnp.ones((2, 3, 3, 3)), jnp.ones((1, 3, 8, 8)))


@pytest.mark.parametrize("seed", range(40))
def test_stripe_halo_holds_every_row_each_device_reads(seed):
    """Brute force with `SlidingWindow.input_region`: the rows device i's outputs read
    lie in its extended stripe at `offset(i)`, and those held by other devices
    come from its direct neighbours, at most `fetch_lo` / `fetch_hi` of them."""
    rng = np.random.default_rng(seed)
    window, stride, dilation = int(rng.choice([1, 2, 3, 5, 7])), int(rng.choice([1, 2, 3])), int(rng.choice([1, 2]))
    sw = _regions.SlidingWindow(int(rng.integers(8, 80)), window, stride, int(rng.integers(0, window)),
                                int(rng.integers(0, window)), dilation)
    devices = int(rng.choice([2, 3, 4, 8]))
    if sw.out_size < devices:
        return
    halo = _regions.stripe_halo(sw, devices)
    ci, co = halo.in_rows, halo.out_rows
    for i in range(devices):
        outs = _regions.Window(i * co, min((i + 1) * co, sw.out_size))
        if outs.size <= 0:
            continue
        region, (pad_lo, _) = sw.input_region(outs)
        first = region.start - pad_lo  # the first row read, padding included
        assert i * ci - halo.lo <= first and first + halo.read_rows <= (i + 1) * ci + halo.hi
        assert halo.offset(i) == first - (i * ci - halo.lo)
        below = max(0, min(i * ci, region.stop) - region.start)
        above = max(0, region.stop - max((i + 1) * ci, region.start))
        assert below <= halo.fetch_lo and above <= halo.fetch_hi
        if max(halo.fetch_lo, halo.fetch_hi) <= ci:  # exchangeable: only neighbours' rows are read
            assert region.start >= (i - 1) * ci and region.stop <= (i + 2) * ci


def test_demo_devices_shards_the_tutorial_over_host_devices_and_prints_collectives(capsys):
    from jtile.cli import main

    assert main(["demo", "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "tutorial on input (4, 3, 66, 66), shard_spatial(axis='H') on 4 devices" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith("  ") and all(w.isdigit() for w in line.split()[1:])}
    assert int(rows["collective-permute"][0]) > 0 and "all-gather" not in rows
    unsharded, sharded = map(int, rows["output"])
    assert sharded == unsharded // 4  # each device holds a quarter of the output rows
    assert "OK: sharded outputs match" in out


def test_refuses_to_follow_transforms_that_hide_or_split_the_convs():
    fn, model, x = _tutorial()
    mesh = jax.make_mesh((1,), ("x",))
    with pytest.raises(jtile.ConfigError, match="already transformed by swap_backend: shard_spatial partitions"):
        jtile.shard_spatial(jtile.swap_backend(fn, algorithms={"conv2d": "smm"}), mesh=mesh)
    with pytest.raises(jtile.ConfigError, match="already transformed by tile_conv"):
        jtile.shard_spatial(jtile.tile_conv(fn, axis="H", tiles=2), mesh=mesh)


def test_a_pool_reading_nhwc_input_shards_its_height(tree_allclose):
    def f(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))

    x = jax.random.normal(jax.random.key(0), (2, 9, 11, 3))
    sharded = jtile.shard_spatial(f, mesh=jax.make_mesh((1,), ("x",)), halo="ppermute")
    text = str(jax.make_jaxpr(sharded)(x))
    assert "P(None, 'x', None, None)" in text  # dim 1 (H of NHWC) is split, not W
    assert tree_allclose(jax.jit(sharded)(x), f(x))


def test_a_reshape_that_keeps_the_sharded_rows_is_refused_but_a_flatten_ends_the_block(tree_allclose):
    w = jax.random.normal(jax.random.key(0), (4, 3, 3, 3))
    x = jax.random.normal(jax.random.key(1), (1, 3, 8, 8))
    mesh = jax.make_mesh((1,), ("x",))

    def flatten(w, x):
        return jnp.tanh(_conv_nchw(x, w)).reshape(1, -1)

    def channel_groups(w, x):
        return _conv_nchw(x, w).reshape(1, 2, 2, 8, 8)

    assert tree_allclose(jax.jit(jtile.shard_spatial(flatten, mesh=mesh))(w, x), flatten(w, x))
    with pytest.raises(jtile.UnsupportedError, match=r"reshape \(op #1\) reads an activation sharded along H"):
        jtile.shard_spatial(channel_groups, mesh=mesh)(w, x)


def _conv_nchw(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)))
