"""The kernels' helper threads (kernels/crew.cc): one per core beside the caller,
started once, asleep soon after the last call, off the caller's core (awake, and
barred from it asleep, so that they wake elsewhere), and right under concurrent
callers."""

import os
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax import lax

from jtile import kernels

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((32, 16, 3, 3), dtype=np.float32)
W2 = RNG.standard_normal((16, 32, 3, 3), dtype=np.float32)
SAME = ((1, 1), (1, 1))


def _crew_stat(*fields: int) -> dict[str, int]:
    """`{thread id: sum of fields}` of the helper threads' (`jtile-crew-N`)
    /proc stat, fields counted from 0 after the name (11, 12: user and system
    clock ticks; 36: the core it last ran on)."""
    values = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # a thread that ended while listed
            continue
        name, stat_fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name.startswith("jtile-crew"):
            values[task] = sum(int(stat_fields[i]) for i in fields)
    return values


@jax.jit
def _layers(x):
    y = kernels.conv2d(x, W1, algorithm="smm", padding=SAME, activation="relu")
    y = kernels.conv2d(y, W2, algorithm="winograd", padding=SAME)
    return kernels.max_pool2d(y, window=(3, 3), stride=(2, 2), padding=((0, 0), (0, 0)))


def _reference(x):
    y = jax.nn.relu(lax.conv_general_dilated(x, W1, (1, 1), SAME))
    y = lax.conv_general_dilated(y, W2, (1, 1), SAME)
    return lax.reduce_window(y, -np.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "VALID")


def test_concurrent_callers_each_get_their_own_result():
    inputs = [RNG.standard_normal((2, 16, 40, 40), dtype=np.float32) for _ in range(6)]
    alone = [np.asarray(_layers(x)) for x in inputs]
    for x, y in zip(inputs, alone):
        np.testing.assert_allclose(y, np.asarray(_reference(x)), rtol=2e-4, atol=2e-3)
    got = [[] for _ in inputs]

    def call(i):
        for _ in range(15):
            got[i].append(np.asarray(_layers(inputs[i])))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, results in enumerate(got):
        assert len(results) == 15
        for y in results:
            np.testing.assert_array_equal(y, alone[i])


def test_one_helper_per_extra_core_started_once():
    x = RNG.standard_normal((1, 16, 40, 40), dtype=np.float32)
    for _ in range(50):
        _layers(x).block_until_ready()
    cores = len(os.sched_getaffinity(0))
    assert len(_crew_stat(11, 12)) == cores - 1
    for _ in range(50):
        _layers(x).block_until_ready()
    assert len(_crew_stat(11, 12)) == cores - 1


def test_helpers_stop_using_the_cpu_soon_after_the_last_call():
    x = RNG.standard_normal((1, 16, 40, 40), dtype=np.float32)
    for _ in range(20):
        _layers(x).block_until_ready()
    time.sleep(0.05)  # past the helpers' 2 ms of polling
    before = _crew_stat(11, 12)
    time.sleep(0.5)
    after = _crew_stat(11, 12)
    # a polling helper would take 50 ticks of 10 ms in that half second
    assert all(after[t] - before[t] <= 5 for t in before), (before, after)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_helper_on_the_callers_core_moves_off_it():
    # Linux may put a helper on the caller's core and leave it there while
    # another core idles; the two then share one core (twice the time). Put
    # there by hand, on an idle machine, a helper without step_aside left in
    # 0, 2 and 4 attempts of 20 (the scheduler moved it), with it in 20 of 20
    # (beside a process spinning on a core, the scheduler moved it back in one
    # attempt of five runs' attempts).
    x = jax.device_put(RNG.standard_normal((1, 16, 40, 40), dtype=np.float32))  # run on this thread
    _layers(x).block_until_ready()
    cores = os.sched_getaffinity(0)
    caller_core = min(cores)
    moved = 0
    try:
        os.sched_setaffinity(0, {caller_core})  # this thread only
        for _ in range(10):
            _layers(x).block_until_ready()  # the helpers poll for 2 ms after each
            for helper in _crew_stat(36):
                os.sched_setaffinity(int(helper), {caller_core})  # moves it there at once
                os.sched_setaffinity(int(helper), cores)  # where it may move from
            _layers(x).block_until_ready()
            time.sleep(0.0005)  # the core is the helpers' while this thread sleeps
            moved += caller_core not in _crew_stat(36).values()
    finally:
        os.sched_setaffinity(0, cores)
    assert moved >= 7, f"the helpers left the caller's core in {moved} attempts of 10"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_sleeping_helper_is_barred_from_the_callers_core_and_free_awake():
    # Woken on the busy caller's core, a helper waited there for about a
    # millisecond before it could step aside, and the kernels ran on one core.
    x = jax.device_put(RNG.standard_normal((1, 16, 40, 40), dtype=np.float32))  # run on this thread
    cores = os.sched_getaffinity(0)
    caller_core = min(cores)
    try:
        os.sched_setaffinity(0, {caller_core})  # this thread only
        _layers(x).block_until_ready()
        time.sleep(0.05)  # past the helpers' 2 ms of polling: asleep
        asleep = {helper: os.sched_getaffinity(int(helper)) for helper in _crew_stat()}
        for _ in range(100):  # wakes them; they poll for 2 ms after each call
            _layers(x).block_until_ready()
            awake = {helper: os.sched_getaffinity(int(helper)) for helper in _crew_stat()}
            if awake == dict.fromkeys(asleep, cores):
                break
    finally:
        os.sched_setaffinity(0, cores)
    assert len(asleep) == len(cores) - 1
    assert asleep == dict.fromkeys(asleep, cores - {caller_core}), asleep
    assert awake == dict.fromkeys(asleep, cores), awake
