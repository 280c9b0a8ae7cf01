import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jtile
from jtile import _cpu, _measured
from jtile.algorithms import swap_backend

NCHW = ("NCHW", "OIHW", "NCHW")


def _net(p, x):
    y = jax.nn.relu(lax.conv_general_dilated(x, p["w1"], (1, 1), "SAME", dimension_numbers=NCHW))
    y = lax.conv_general_dilated(y, p["w2"], (2, 2), "SAME", dimension_numbers=NCHW)
    return y.mean(axis=(2, 3)) @ p["fc"]


@pytest.fixture
def model(getkey, tmp_path, monkeypatch):
    monkeypatch.setenv("JTILE_CACHE_DIR", str(tmp_path))
    params = {
        "w1": 0.3 * jax.random.normal(getkey(), (8, 3, 3, 3)),
        "w2": 0.3 * jax.random.normal(getkey(), (16, 8, 3, 3)),
        "fc": 0.3 * jax.random.normal(getkey(), (16, 5)),
    }
    return jtile.fold_params(_net, params), params, jax.random.normal(getkey(), (2, 3, 12, 12))


def _targets(fn, x) -> list[str]:
    return re.findall(r"target_name=(\w+)", str(jax.make_jaxpr(fn)(x)))


def test_measured_matches_the_model_and_caches_every_layer(model, capsys, tree_allclose):
    folded, params, x = model
    out = jax.jit(swap_backend(folded, algorithms="measured"))(x)
    assert tree_allclose(out, _net(params, x), rtol=2e-4, atol=2e-4)
    with open(_measured.cache_path()) as f:
        table = json.load(f)
    assert len(table) == 4  # two convs, the global average pool and the dense layer
    for timings in table.values():
        assert "default" in timings and len(timings) >= 2 and all(t > 0 for t in timings.values())
    printed = capsys.readouterr().err
    assert printed.count("jtile: measured") == 4 and "conv2d #1" in printed


def test_choice_is_the_fastest_cached_timing_and_nothing_is_measured_twice(model, monkeypatch):
    folded, _, x = model
    swap_backend(folded, algorithms="measured")(x)
    path = _measured.cache_path()
    with open(path) as f:
        table = json.load(f)

    def never(*args):
        raise AssertionError("a cached layer was measured again")

    monkeypatch.setattr(_measured, "_time", never)
    for fastest, expected in (("direct", "jtile_conv_direct"), ("default", None)):
        for timings in table.values():
            for name in timings:
                timings[name] = 0.0 if name == fastest else 1.0
        with open(path, "w") as f:
            json.dump(table, f)
        targets = _targets(swap_backend(folded, algorithms={"conv2d": "measured"}), x)
        assert targets == ([expected] * 2 if expected else [])


def test_an_unreadable_cache_names_the_file(model):
    folded, _, x = model
    path = _measured.cache_path()
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(jtile.ConfigError, match=re.escape(path) + ".*delete it"):
        swap_backend(folded, algorithms="measured")(x)


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("JTILE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _measured.cache_dir() == str(tmp_path / "jtile")
    assert _measured.cache_path().startswith(str(tmp_path / "jtile" / "measured-"))


@pytest.mark.parametrize("field", ["model name", "vendor_id", "no such field"])
def test_the_cpu_fields_are_read_from_proc_cpuinfo(field):
    """What the cache key and the Intel rule of `auto` read: the first CPU's line, stripped, or ''."""
    with open("/proc/cpuinfo") as f:
        found = re.search(rf"^{field}\s*:(.*)$", f.read(), re.MULTILINE)
    assert _cpu.cpu_field(field) == (found.group(1).strip() if found else "")
