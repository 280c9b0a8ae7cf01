"""Shared machinery of the speed benchmarks: four backends, checked, timed, reported.

Every case is run four ways — `jtile` (`jax.jit(swap_backend(fold_params(fn,
params), algorithms="auto"))`), `jax` (`jax.jit(fn)`), `ort` (ONNX Runtime on the same
graph, 2 intra-op threads) and `torch` (eager, 2 threads, inference mode) —
each output checked against the plain `jnp` function before it is timed. At the end of the session
`report.py` prints the ratio table and writes JSON and a bar chart to
`benchmarks/results/`.

Run: `python -m pytest benchmarks/bench_layers.py` (timing is switched on here,
whatever `--benchmark-disable` the project's addopts say; pass
`--benchmark-disable` on the command line for a one-shot smoke run). The
project's addopts say `-m "not slow"`; `-m ""` runs every case, `-m slow` only
the large ones.
"""

import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import report  # noqa: E402

THREADS = 2
RESULTS: dict[str, dict[str, dict[str, float]]] = {}


def pytest_configure(config):
    if "--benchmark-disable" not in config.invocation_params.args:
        config.option.benchmark_enable = True


def pytest_collect_file(file_path, parent):
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_terminal_summary(terminalreporter):
    if RESULTS:
        terminalreporter.write_line(report.write(RESULTS, Path(__file__).parent / "results"))


# ------------------------------------------------------------------ backends


def ort_session(model):
    """An ONNX Runtime session for `model` (a ModelProto) on `THREADS` threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _torch():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
    torch.set_num_threads(THREADS)
    return torch


def _runner(backend: str, case):
    """A no-argument callable computing `case` on `backend`, returning numpy."""
    if backend in ("jtile", "jax"):
        fn, args = case.jtile_fn() if backend == "jtile" else (case.fn, case.args)
        fn = jax.jit(fn)
        return lambda: np.asarray(jax.block_until_ready(fn(*args)))
    if backend == "ort":
        session = ort_session(case.onnx_model())
        feeds = dict(zip((i.name for i in session.get_inputs()), case.onnx_inputs()))
        return lambda: session.run(None, feeds)[0]
    torch = _torch()
    fn, inputs = case.torch_fn(torch)

    def run():
        with torch.inference_mode():
            return fn(*inputs).numpy()

    return run


@pytest.fixture
def time_case(benchmark):
    """`time_case(case, backend)`: check `backend`'s output on `case`, then time it."""

    def time(case, backend: str) -> None:
        run = _runner(backend, case)
        got = run()
        expected = case.reference()
        scale = float(np.max(np.abs(expected))) or 1.0
        np.testing.assert_allclose(
            got, expected, rtol=case.rtol, atol=case.rtol * scale, err_msg=f"{case.name} on {backend}"
        )
        benchmark.group = case.name
        benchmark(run)
        if benchmark.stats:
            stats = benchmark.stats.stats
            RESULTS.setdefault(case.name, {})[backend] = {"min": stats.min, "median": stats.median}

    return time
