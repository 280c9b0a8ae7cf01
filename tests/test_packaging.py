import ctypes
import importlib
import importlib.util
import io
import os
import pathlib
import pickle
import pkgutil
import re
import tomllib
import types
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jtile
from jtile import cli, kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _public_modules():
    names = ["jtile"]
    for info in pkgutil.walk_packages(jtile.__path__, "jtile."):
        python = importlib.util.find_spec(info.name).origin.endswith(".py")  # not the kernels' .so
        if python and not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _public_modules())
def test_every_public_module_lists_its_public_names(name):
    module = importlib.import_module(name)
    assert isinstance(module.__dict__.get("__all__"), list), f"{name} has no __all__"
    for public in module.__all__:
        assert hasattr(module, public) or importlib.util.find_spec(f"{name}.{public}"), public
        value = getattr(module, public, None)
        if isinstance(value, types.ModuleType):
            assert value.__name__.startswith("jtile."), f"{name} exports the module {value.__name__}"


def test_kernels_module_exports_no_imported_modules():
    assert not {"ctypes", "os", "np", "jax", "jnp", "warnings"} & set(kernels.__all__)
    namespace = {}
    exec("from jtile.kernels import *", namespace)
    assert "ctypes" not in namespace and "conv2d" in namespace


def test_exceptions_are_reexported_and_print_as_jtile_names():
    for cls in (jtile.JtileError, jtile.ConfigError, jtile.UnsupportedError, jtile.OnnxError,
                jtile.KernelsUnavailableWarning, jtile.StaleKernelsWarning):
        assert cls.__module__ == "jtile" and getattr(jtile, cls.__name__) is cls
        assert repr(cls) == f"<class 'jtile.{cls.__name__}'>"
    error = pickle.loads(pickle.dumps(jtile.ConfigError("bad tiles")))
    assert type(error) is jtile.ConfigError and str(error) == "bad tiles"
    assert issubclass(jtile.ConfigError, ValueError) and issubclass(jtile.UnsupportedError, NotImplementedError)


def test_version_matches_cli_changelog_and_metadata(capsys):
    assert re.fullmatch(r"\d+\.\d+\.\d+", jtile.__version__)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"jtile {jtile.__version__}"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## \[?(\d+\.\d+\.\d+)", changelog, re.M).group(1) == jtile.__version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["authors"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_package_ships_py_typed():
    assert (pathlib.Path(jtile.__file__).parent / "py.typed").is_file()


def test_top_level_help_is_for_users(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "jtile.commands" not in text and "module" not in text
    for command in ("demo", "summary", "onnx-info", "export", "--version"):
        assert command in text


# ------------------------------------------------------------- transforms


def _conv(x, w):
    return jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1))))


def _matmul(x, w):
    return jnp.einsum("nchw,oc->nohw", x, w[:, :, 1, 1])


# (transform, keyword configuration, what a positional call should be told)
TRANSFORMS = [
    (jtile.tile_conv, dict(axis="H", tiles=2), "axis="),
    (jtile.split_gemm, dict(max_m=4, max_k=4, max_n=4), "max_m="),
    (jtile.fuse, dict(recipes=("conv_bias_act",)), "recipes="),
    (jtile.fusion.fold_batchnorm, {}, "fold_batchnorm(fn)"),
    (jtile.swap_backend, dict(algorithms={"conv2d": "default"}), "algorithms="),
    (jtile.swap_conv2d, dict(selector="default"), "selector="),
]


@pytest.mark.parametrize("transform, config, keyword", TRANSFORMS, ids=lambda t: getattr(t, "__name__", None))
def test_transform_works_bare_and_as_decorator_alike(transform, config, keyword, getkey, tree_allclose):
    x = jax.random.normal(getkey(), (1, 3, 6, 6))
    w = jax.random.normal(getkey(), (4, 3, 3, 3))
    for fn in (_conv, _matmul):
        bare = transform(fn, **config)
        decorated = transform(**config)(fn)
        assert str(jax.make_jaxpr(bare)(x, w)) == str(jax.make_jaxpr(decorated)(x, w))
        assert tree_allclose(jax.jit(decorated)(x, w), fn(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transform, config, keyword", TRANSFORMS, ids=lambda t: getattr(t, "__name__", None))
def test_positional_configuration_raises_naming_the_keyword(transform, config, keyword):
    values = tuple(config.values()) or (3,)
    with pytest.raises(jtile.ConfigError, match=re.escape(keyword)):
        transform(_conv, *values)
    with pytest.raises(jtile.ConfigError, match=re.escape(keyword)):
        transform(*values)


def test_fold_params_is_top_level_and_a_decorator(getkey, tree_allclose):
    params = {"w": jax.random.normal(getkey(), (4, 3, 3, 3))}
    x = jax.random.normal(getkey(), (1, 3, 6, 6))

    def net(p, x):
        return _conv(x, p["w"])

    bare = jtile.fold_params(net, params)
    decorated = jtile.fold_params(params=params)(net)
    assert jtile.fold_params is jtile.fusion.fold_params
    assert tree_allclose(jax.jit(bare)(x), net(params, x), rtol=1e-5, atol=1e-5)
    assert str(jax.make_jaxpr(bare)(x)) == str(jax.make_jaxpr(decorated)(x))
    with pytest.raises(jtile.ConfigError, match=r"fold_params\(fn, params\)"):
        jtile.fold_params(net)


# ------------------------------------------------------------- kernel loading


def test_library_is_looked_for_next_to_the_module_then_in_the_installed_distribution(monkeypatch, tmp_path):
    monkeypatch.delenv(kernels.LIBRARY_ENV, raising=False)
    here = os.path.join(os.path.dirname(os.path.abspath(kernels.__file__)), "libjtile_kernels.so")

    class Installed:
        def locate_file(self, path):
            return tmp_path / path

    monkeypatch.setattr(kernels.importlib.metadata, "distribution", lambda name: Installed())
    assert kernels.library_candidates() == [here, str(tmp_path / "jtile" / "libjtile_kernels.so")]

    def not_installed(name):
        raise kernels.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(kernels.importlib.metadata, "distribution", not_installed)
    assert kernels.library_candidates() == [here]
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(tmp_path / "other.so"))
    assert kernels.library_candidates() == [str(tmp_path / "other.so")]


def test_library_falls_back_to_the_next_candidate_and_says_where_it_looked(tmp_path):
    assert not kernels.kernel_unavailable("jtile_conv_direct"), "the kernels are not built"
    missing = str(tmp_path / "jtile" / "libjtile_kernels.so")
    path, library, error = kernels._open_library([missing, kernels.LIBRARY_PATH])
    assert path == kernels.LIBRARY_PATH and isinstance(library, ctypes.CDLL) and error == ""
    path, library, error = kernels._open_library([missing, str(tmp_path / "other.so")])
    assert library is None and path == missing
    assert missing in error and str(tmp_path / "other.so") in error


def _checkout_with_a_library(tmp_path, sources: dict[str, int], library_mtime: int) -> pathlib.Path:
    """A fake checkout: `kernels/` files with the given mtimes, and a library file."""
    (tmp_path / "kernels").mkdir()
    for name, mtime in sources.items():
        (tmp_path / "kernels" / name).write_text("// source")
        os.utime(tmp_path / "kernels" / name, (mtime, mtime))
    library = tmp_path / "jtile" / "libjtile_kernels.so"
    library.parent.mkdir()
    library.write_bytes(b"")
    os.utime(library, (library_mtime, library_mtime))
    return library


def test_kernel_sources_newer_than_the_library_are_listed_newest_first(tmp_path):
    library = _checkout_with_a_library(
        tmp_path, {"a.cc": 2000, "b.h": 500, "CMakeLists.txt": 3000, "dev_build.sh": 4000}, 1000)
    newer = kernels._newer_sources(str(library), str(tmp_path))
    assert newer == [str(tmp_path / "kernels" / "CMakeLists.txt"), str(tmp_path / "kernels" / "a.cc")]
    os.utime(library, (5000, 5000))
    assert kernels._newer_sources(str(library), str(tmp_path)) == []
    assert kernels._newer_sources(str(library), str(tmp_path / "jtile")) == []  # no kernels/: installed


def test_a_library_older_than_the_checkouts_kernels_warns_how_to_rebuild(monkeypatch, tmp_path):
    library = _checkout_with_a_library(tmp_path, {"crew.cc": 2000, "pool.cc": 1500}, 1000)
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "jtile" / "kernels.py"))
    monkeypatch.delenv(kernels.LIBRARY_ENV, raising=False)
    with pytest.warns(jtile.StaleKernelsWarning, match=r"older than .*crew\.cc and 1 more.*rebuild") as caught:
        kernels._warn_if_stale(str(library))
    assert len(caught) == 1 and str(library) in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setenv(kernels.LIBRARY_ENV, str(library))  # chosen on purpose: no warning
        kernels._warn_if_stale(str(library))
        monkeypatch.delenv(kernels.LIBRARY_ENV)
        os.utime(library, (3000, 3000))
        kernels._warn_if_stale(str(library))


def test_the_loaded_library_is_not_older_than_this_checkouts_kernels():
    # Tests run from a checkout test the kernels its sources say, not an older build.
    assert kernels._newer_sources(kernels.LIBRARY_PATH, str(ROOT)) == []


def test_auto_warns_once_when_kernels_are_unavailable_and_explicit_requests_raise(monkeypatch, getkey, tree_allclose):
    unavailable = dict.fromkeys(kernels._TARGETS, "the jtile kernels are not built (test)")
    monkeypatch.setattr(kernels, "_UNAVAILABLE", unavailable)
    monkeypatch.setattr(kernels, "_warned", False)
    x = jax.random.normal(getkey(), (1, 3, 6, 6))
    w = jax.random.normal(getkey(), (4, 3, 3, 3))
    with pytest.warns(jtile.KernelsUnavailableWarning, match="slower than it could: the jtile kernels are not built") as caught:
        y = jtile.swap_backend(_conv, algorithms="auto")(x, w)
    assert len(caught) == 1 and tree_allclose(y, _conv(x, w))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jtile.swap_backend(lambda x, w: _conv(x, w) * 2, algorithms="auto")(x, w)
    with pytest.raises(jtile.UnsupportedError, match="not built"):
        jtile.swap_conv2d(_conv, selector="direct")(x, w)


def test_auto_does_not_warn_when_kernels_load(getkey):
    assert not kernels._UNAVAILABLE
    x = jax.random.normal(getkey(), (1, 3, 6, 6))
    w = jax.random.normal(getkey(), (4, 3, 3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jtile.swap_backend(_conv, algorithms="auto")(x, w)
