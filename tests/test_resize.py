import hypothesis.strategies as st
import jax
import numpy as np
import onnx.reference
import pytest
from hypothesis import given, settings
from onnx import TensorProto, helper

import jtile._resize as _resize_module
from jtile._resize import resize

COORDS = ("half_pixel", "pytorch_half_pixel", "asymmetric", "half_pixel_symmetric", "align_corners")


def _reference(x, scales, mode, coords, nearest_mode):
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode=mode, coordinate_transformation_mode=coords,
                            nearest_mode=nearest_mode)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("s", TensorProto.FLOAT, [len(scales)], scales)])
    return onnx.reference.ReferenceEvaluator(helper.make_model(graph)).run(None, {"x": x})[0]


def _resize(x, scales, mode, coords, nearest_mode):
    sizes = tuple(int(n * s) for n, s in zip(x.shape, scales))
    return resize(x, sizes=sizes, scales=tuple(scales), roi=((0.0, 1.0),) * x.ndim, mode=mode,
                  nearest_mode=nearest_mode, coords=coords, cubic_a=-0.75, exclude_outside=0,
                  extrapolation=0.0, antialias=0)


@settings(deadline=None, max_examples=25)
@given(h=st.integers(1, 7), w=st.integers(1, 7), rh=st.integers(1, 5), rw=st.integers(2, 5),
       mode=st.sampled_from(("linear", "cubic", "nearest")), coords=st.sampled_from(COORDS),
       nearest_mode=st.sampled_from(("round_prefer_floor", "floor", "ceil")), seed=st.integers(0, 99))
def test_integer_upsampling_matches_the_onnx_reference(h, w, rh, rw, mode, coords, nearest_mode, seed):
    x = np.random.default_rng(seed).standard_normal((2, 3, h, w)).astype(np.float32)
    scales = [1.0, 1.0, float(rh), float(rw)]
    expected = _reference(x, scales, mode, coords, nearest_mode)
    got = np.asarray(_resize(x, scales, mode, coords, nearest_mode))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_bilinear_upsampling_by_an_integer_factor_needs_no_gather():
    x = np.random.default_rng(0).standard_normal((1, 21, 14, 14)).astype(np.float32)
    args = ([1.0, 1.0, 16.0, 16.0], "linear", "pytorch_half_pixel", "round_prefer_floor")
    assert "gather" not in str(jax.make_jaxpr(lambda x: _resize(x, *args))(x))
    np.testing.assert_allclose(np.asarray(_resize(x, *args)), _reference(x, *args), rtol=1e-6, atol=1e-6)


@settings(deadline=None, max_examples=15)
@given(mode=st.sampled_from(("linear", "cubic", "nearest")), coords=st.sampled_from(COORDS[:4]),
       r=st.integers(2, 4), seed=st.integers(0, 99))
def test_non_finite_inputs_reach_the_same_outputs_as_through_the_gather(mode, coords, r, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 2, 6, 5)).astype(np.float32)
    x.flat[rng.choice(x.size, 3, replace=False)] = [np.inf, -np.inf, np.nan]
    args = ([1.0, 1.0, float(r), float(r)], mode, coords, "round_prefer_floor")
    periodic = np.asarray(_resize(x, *args))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_resize_module, "_periodic", lambda *a: None)
        gathered = np.asarray(_resize(x, *args))
    np.testing.assert_allclose(periodic, gathered, rtol=1e-6, atol=1e-6)  # NaN and Inf positions included
