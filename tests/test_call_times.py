"""jtile.kernels.call_times: each kernel call's own time, recorded inside a compiled function."""

import time

import jax
import numpy as np
import pytest

import jtile
from jtile import kernels

RNG = np.random.default_rng(0)
X = RNG.standard_normal((1, 16, 20, 20), dtype=np.float32)
W1 = RNG.standard_normal((32, 16, 1, 1), dtype=np.float32)
W2 = RNG.standard_normal((32, 1, 3, 3), dtype=np.float32)


@jax.jit
def two_kernels(x):
    y = kernels.conv2d(x, W1, algorithm="smm", activation="relu")
    return kernels.conv2d(y, W2, algorithm="depthwise", stride=(2, 2), padding=((1, 1), (1, 1)), groups=32)


def test_records_every_call_in_order_with_its_shapes():
    two_kernels(X).block_until_ready()  # compiled and run outside the block: not recorded
    start = time.perf_counter()
    with kernels.call_times() as times:
        for _ in range(3):
            two_kernels(X).block_until_ready()
    wall_us = (time.perf_counter() - start) * 1e6
    two_kernels(X).block_until_ready()  # after the block: not recorded either
    assert [(c.target, c.in_shape, c.out_shape) for c in times.calls] == [
        ("jtile_conv_smm", (1, 16, 20, 20), (1, 32, 20, 20)),
        ("jtile_conv_depthwise", (1, 32, 20, 20), (1, 32, 10, 10)),
    ] * 3
    assert all(c.us > 0 for c in times.calls)
    assert sum(c.us for c in times.calls) < wall_us  # the kernels ran inside the block's wall time
    layers = times.by_layer(3)
    assert [best.target for best, _ in layers] == ["jtile_conv_smm", "jtile_conv_depthwise"]
    assert all(best.us <= median for best, median in layers)
    table = times.table(3)
    assert "jtile_conv_depthwise" in table and "(1, 32, 20, 20) -> (1, 32, 10, 10)" in table


def test_by_layer_refuses_runs_that_differ():
    with kernels.call_times() as times:
        two_kernels(X).block_until_ready()
        kernels.conv2d(X, W1, algorithm="smm").block_until_ready()
    with pytest.raises(jtile.ConfigError, match="do not split into 2 runs"):
        times.by_layer(2)
    assert len(times.by_layer(1)) == 3
    with pytest.raises(jtile.ConfigError, match="call 0 differs between runs"):
        kernels.CallTimes(times.calls[:2]).by_layer(2)  # a conv, then a depthwise conv


def test_recording_blocks_do_not_nest():
    with kernels.call_times():
        with pytest.raises(jtile.ConfigError, match="already recording"):
            with kernels.call_times():
                pass
    with kernels.call_times() as times:  # the failed attempt left nothing recording
        two_kernels(X).block_until_ready()
    assert len(times.calls) == 2
