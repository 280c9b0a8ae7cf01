"""Layer suite: the layers where per-layer algorithms matter, each timed four ways.

The 3x3 convolutions of VGG / ResNet at three depths, MobileNetV2's depthwise
3x3 and pointwise 1x1, and AlexNet's first fully-connected layer at batch 1,
with its weight stored `(in, out)` for `x @ w` and, as torch and the zoo store
it, `(out, in)` for `x @ w.T`.
Weights are initializers of the ONNX graph, constants of the torch call and of
jtile's function (`fold_params`, folded at trace time as ORT folds at session
creation); plain `jax.jit` takes them as arguments, as a model's parameters are.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from jax import lax
from onnx import TensorProto, helper, numpy_helper

from jtile.algorithms import swap_backend
from jtile.fusion import fold_params


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One conv (NCHW / OIHW, `padding` on every side) or, with `dense`, `x @ w`
    (`x @ w.T` with `w` stored `(out, in)` as torch does, when `transposed`)."""

    name: str
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    padding: int = 0
    groups: int = 1
    dense: bool = False
    transposed: bool = False
    rtol: float = 1e-3

    def fn(self, w, x):
        if self.dense:
            return x @ w.T if self.transposed else x @ w
        pads = ((self.padding, self.padding),) * 2
        return lax.conv_general_dilated(
            x, w, (1, 1), pads, dimension_numbers=("NCHW", "OIHW", "NCHW"),
            feature_group_count=self.groups,
        )

    def jtile_fn(self):
        return swap_backend(fold_params(self.fn, self.args[0]), algorithms="auto"), self.args[1:]

    @functools.cached_property
    def args(self) -> tuple[jax.Array, jax.Array]:
        kx, kw = jax.random.split(jax.random.key(0))
        fan_in = self.w_shape[self.transposed] if self.dense else int(np.prod(self.w_shape[1:]))
        x = jax.random.normal(kx, self.x_shape, jnp.float32)
        w = jax.random.normal(kw, self.w_shape, jnp.float32) / np.sqrt(fan_in)
        return w, x

    @functools.cache
    def reference(self) -> np.ndarray:
        return np.asarray(self.fn(*self.args))

    def onnx_inputs(self) -> list[np.ndarray]:
        return [np.asarray(self.args[1])]

    def onnx_model(self) -> onnx.ModelProto:
        w, x = (np.asarray(a) for a in self.args)
        y_shape = self.reference().shape
        if self.dense:
            node = helper.make_node("Gemm", ["x", "w"], ["y"], transB=int(self.transposed))
        else:
            node = helper.make_node(
                "Conv", ["x", "w"], ["y"], kernel_shape=list(w.shape[2:]),
                pads=[self.padding] * 4, group=self.groups,
            )
        graph = helper.make_graph(
            [node], self.name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
            initializer=[numpy_helper.from_array(w, "w")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    def torch_fn(self, torch):
        w, x = (torch.from_numpy(np.asarray(a).copy()) for a in self.args)
        if self.dense:
            weight = w if self.transposed else w.T.contiguous()  # torch.nn.Linear keeps (out, in)
            return (lambda x: torch.nn.functional.linear(x, weight)), (x,)
        conv = functools.partial(torch.nn.functional.conv2d, padding=self.padding, groups=self.groups)
        return (lambda x: conv(x, w)), (x,)


CASES = (
    LayerCase("conv3x3 64->64 @224", (1, 64, 224, 224), (64, 64, 3, 3), padding=1),
    LayerCase("conv3x3 256->256 @56", (1, 256, 56, 56), (256, 256, 3, 3), padding=1),
    LayerCase("conv3x3 512->512 @14", (1, 512, 14, 14), (512, 512, 3, 3), padding=1),
    LayerCase("depthwise3x3 144 @56", (1, 144, 56, 56), (144, 1, 3, 3), padding=1, groups=144),
    LayerCase("conv1x1 144->24 @56", (1, 144, 56, 56), (24, 144, 1, 1)),
    LayerCase("fc 9216->4096 batch1", (1, 9216), (9216, 4096), dense=True),
    LayerCase("fc 9216->4096 b1 x@W.T", (1, 9216), (4096, 9216), dense=True, transposed=True),
)


@pytest.mark.parametrize("backend", ("jtile", "jax", "ort", "torch"))
@pytest.mark.parametrize("case", CASES, ids=[c.name.replace(" ", "_") for c in CASES])
def test_layer(time_case, case, backend):
    time_case(case, backend)
