"""The ONNX backend test suite (`onnx.backend.test`) run through `jtile.onnx.backend`.

Included: every node, PyTorch-converted, PyTorch-operator and light-model case
whose graph uses only ops jtile registers. Cases with other ops are left out
by the include mechanism (the op list is printed by running this file).
Excluded on top, each for a reason jtile raises `UnsupportedError` for:
`EXCLUDED` below. The light models and the function-expanded node cases
(`*_expanded`, compositions of ops tested on their own) are marked `slow`.

`PYTHONPATH=. python tests/test_onnx_backend.py` prints pass counts per op.
"""

import collections
import os
import sys
import unittest
import warnings

import numpy as np
import onnx
import onnx.backend.test
import pytest
from onnx.backend.test.loader import load_model_tests

import jtile.onnx.backend as backend
from jtile.onnx.ops import REGISTRY

KINDS = ("node", "pytorch-converted", "pytorch-operator", "real")
EXCLUDED = {
    r"FLOAT8|FLOAT4|INT4|INT2|_string": "float8/float4/int4/int2/string tensors are not supported dtypes",
    r"^test_training_dropout(_default)?(_mask)?_cpu$": "training-mode Dropout with a non-zero ratio is random",
    r"^test_identity_(opt|sequence)_": "optional and sequence values are not tensors",
}


def _graph_ops(case) -> set[str]:
    if case.model is not None:
        model = case.model
    elif case.model_dir is not None:
        model = onnx.load(os.path.join(case.model_dir, "model.onnx"), load_external_data=False)
    else:  # a light model shipped with onnx
        root = os.path.dirname(os.path.dirname(onnx.__file__))
        model = onnx.load(os.path.join(root, case.url), load_external_data=False)
    return {node.op_type for node in model.graph.node}


def _cases() -> dict[str, set[str]]:
    with warnings.catch_warnings():  # the node-case generators warn about overflow in casts
        warnings.simplefilter("ignore")
        return {case.name: _graph_ops(case) for kind in KINDS for case in load_model_tests(kind=kind)}


CASES = _cases()
SUPPORTED = sorted(name for name, ops in CASES.items() if ops <= REGISTRY.keys())


def _backend_test() -> onnx.backend.test.BackendTest:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = onnx.backend.test.BackendTest(backend, __name__)
    for name in SUPPORTED:
        runner.include(f"^{name}_cpu$")
    for pattern in EXCLUDED:
        runner.exclude(pattern)
    return runner


def _select(test_cases: dict) -> dict:
    """Drop the cases the runner would skip (not included, or excluded) so that
    they are not collected at all; mark the light models (covered by
    test_onnx_models) and the function-expanded node cases slow."""
    test_cases["OnnxBackendRealModelTest"].pytestmark = [pytest.mark.slow]
    for case in test_cases.values():
        for name in [n for n in vars(case) if n.startswith("test_")]:
            method = getattr(case, name)
            if getattr(method, "__unittest_skip__", False):
                delattr(case, name)
            elif "_expanded" in name:
                setattr(case, name, pytest.mark.slow(method))
    return test_cases


globals().update(_select(_backend_test().test_cases))


@pytest.fixture(autouse=True)
def _onnx_home(tmp_path_factory, monkeypatch):
    """The runner writes the light models' inputs under $ONNX_HOME; keep them out of ~."""
    monkeypatch.setenv("ONNX_HOME", str(tmp_path_factory.getbasetemp() / "onnx_home"))


def test_every_registered_op_has_backend_cases():
    assert REGISTRY.keys() <= set().union(*(CASES[name] for name in SUPPORTED))


def test_run_node_and_run_model_evaluate_one_node():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.0, 2.0, 3.0], np.float32)
    node = onnx.helper.make_node("Add", ["a", "b"], ["c"])
    (out,) = backend.run_node(node, [a, b])
    np.testing.assert_array_equal(out, a + b)
    (out,) = backend.run_node(onnx.helper.make_node("Cast", ["a"], ["c"], to=onnx.TensorProto.INT64), {"a": a})
    assert out.dtype == np.int64  # the backend keeps 64-bit ONNX dtypes
    assert backend.supports_device("CPU") and not backend.supports_device("CUDA")


def _report() -> None:
    """Run the included cases and print passed/failed/excluded counts per op."""
    suite = unittest.TestSuite()
    for case in _backend_test().test_cases.values():
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    with open(os.devnull, "w") as sink:
        result = unittest.TextTestRunner(stream=sink, verbosity=0).run(suite)
    failed = {t.id().rsplit(".", 1)[1].removesuffix("_cpu") for t, _ in result.failures + result.errors}
    skipped = {t.id().rsplit(".", 1)[1].removesuffix("_cpu") for t, _ in result.skipped}
    counts = collections.defaultdict(collections.Counter)
    for name in SUPPORTED:
        status = "failed" if name in failed else "excluded" if name in skipped else "passed"
        for op in CASES[name]:
            counts[op][status] += 1
    print(f"{'op':<22}{'passed':>8}{'failed':>8}{'excluded':>10}")
    for op, c in sorted(counts.items()):
        print(f"{op:<22}{c['passed']:>8}{c['failed']:>8}{c['excluded']:>10}")
    total = collections.Counter(
        "failed" if n in failed else "excluded" if n in skipped else "passed" for n in SUPPORTED
    )
    print(f"cases: {dict(total)}; not included (unsupported ops): {len(CASES) - len(SUPPORTED)}")
    unsupported = collections.Counter(op for ops in CASES.values() for op in ops - REGISTRY.keys())
    print("unsupported ops:", ", ".join(f"{op} ({n})" for op, n in sorted(unsupported.items())))


if __name__ == "__main__":
    os.environ.setdefault("ONNX_HOME", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".onnx_home"))
    sys.exit(_report())
