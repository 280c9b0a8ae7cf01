"""The nine model-zoo graphs shipped in `onnx/backend/test/data/light/` against their shipped outputs.

Inputs are built as `onnx.backend.test.runner.Runner.generate_dummy_data` builds
them (`arange(n) / n`, float32), tolerances are the ones in each model's
`backend/test/data/real/test_<name>/data.json`. DenseNet-121 (about 9 s of
compilation alone) is marked slow.
"""

import json
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.backend.test.runner import Runner

import jtile.onnx

DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
MODELS = ["bvlc_alexnet", pytest.param("densenet121", marks=pytest.mark.slow), "inception_v1",
          "inception_v2", "resnet50", "shufflenet", "squeezenet", "vgg19", "zfnet512"]


def _tolerances(name: str) -> tuple[float, float]:
    with open(os.path.join(DATA, "real", f"test_{name}", "data.json")) as f:
        data = json.load(f)
    return data.get("rtol", 1e-3), data.get("atol", 1e-7)


@pytest.mark.parametrize("name", MODELS)
def test_light_model_matches_shipped_output(name):
    path = os.path.join(DATA, "light", f"light_{name}.onnx")
    model = jtile.onnx.load(path)
    proto = onnx.load(path)
    initializers = {t.name for t in proto.graph.initializer}
    (graph_input,) = [v for v in proto.graph.input if v.name not in initializers]
    x = Runner.generate_dummy_data(graph_input, name=name)
    expected = numpy_helper.to_array(onnx.load_tensor(os.path.join(DATA, "light", f"light_{name}_output_0.pb")))
    got = np.asarray(model(x))
    rtol, atol = _tolerances(name)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    assert model.output_shapes == [expected.shape]
