"""torchvision's classification, segmentation and detection-backbone models, exported
to ONNX by both PyTorch exporters and imported with `jtile.onnx.load`, compared
against ONNX Runtime on the same file and against torch itself; then exported
back with `jtile.onnx.export` and run in ONNX Runtime, unchanged (Resize stays Resize).

Every model is built with random weights (`weights=None`, seed 0; zero-initialised
parameters such as ViT's head redrawn, batch-norm statistics randomised so the
folded affine is not the identity) and exported in the test setup at a small
input size. Exporters: TorchScript (`dynamo=False`) at opsets 17 and 18, and
the dynamo exporter (`dynamo=True`, opset 18). `QUICK` runs by default (attention
and LayerNorm, squeeze-excitation, a segmentation head with Resize); the whole
zoo is `slow`. Everything here is marked `torch`.
"""

import functools
import io
import contextlib
import warnings

import jax
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import jtile.onnx
from jtile._interpreter import iter_eqns

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from torchvision import models as tvm  # noqa: E402
from torchvision.models.detection import backbone_utils  # noqa: E402

pytestmark = pytest.mark.torch
RTOL = 2e-4  # max |jtile - reference| / max |reference|, per output


class _Outputs(torch.nn.Module):
    """A model whose dict output (segmentation, FPN) becomes a tuple of tensors."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        return tuple(out.values()) if isinstance(out, dict) else out


def _tiny_vit():
    return tvm.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)


def _tiny_swin():
    return tvm.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4])


# name -> (builder, input height and width)
ZOO = {
    "tiny_vit": (_tiny_vit, 32),
    "tiny_swin": (_tiny_swin, 32),
    "resnet18": (tvm.resnet18, 64),
    "resnet50": (tvm.resnet50, 64),
    "mobilenet_v2": (tvm.mobilenet_v2, 64),
    "mobilenet_v3_large": (tvm.mobilenet_v3_large, 64),
    "mobilenet_v3_small": (tvm.mobilenet_v3_small, 64),
    "efficientnet_b0": (tvm.efficientnet_b0, 64),
    "efficientnet_v2_s": (tvm.efficientnet_v2_s, 64),
    "regnet_y_400mf": (tvm.regnet_y_400mf, 64),
    "convnext_tiny": (tvm.convnext_tiny, 64),
    "vit_b_16": (functools.partial(tvm.vit_b_16, image_size=64), 64),
    "swin_t": (tvm.swin_t, 64),
    "maxvit_t": (tvm.maxvit_t, 224),  # its partition size 7 needs 224
    "squeezenet1_1": (tvm.squeezenet1_1, 64),
    "densenet121": (tvm.densenet121, 64),
    "shufflenet_v2_x1_0": (tvm.shufflenet_v2_x1_0, 64),
    "mnasnet0_5": (tvm.mnasnet0_5, 64),
    "googlenet": (functools.partial(tvm.googlenet, aux_logits=False, init_weights=True), 64),
    "inception_v3": (functools.partial(tvm.inception_v3, aux_logits=False, init_weights=True), 96),
    # the TorchScript exporter writes adaptive pools only when the output divides the input: 6x6, 7x7 at 224
    "alexnet": (tvm.alexnet, 224),
    "vgg11_bn": (tvm.vgg11_bn, 224),
    "wide_resnet50_2": (tvm.wide_resnet50_2, 64),
    "resnext50_32x4d": (tvm.resnext50_32x4d, 64),
    "fcn_resnet50": (functools.partial(tvm.segmentation.fcn_resnet50, weights_backbone=None, aux_loss=False), 64),
    "deeplabv3_mobilenet_v3_large": (
        functools.partial(tvm.segmentation.deeplabv3_mobilenet_v3_large, weights_backbone=None), 64),
    "lraspp_mobilenet_v3_large": (
        functools.partial(tvm.segmentation.lraspp_mobilenet_v3_large, weights_backbone=None), 64),
    "resnet50_fpn": (functools.partial(backbone_utils.resnet_fpn_backbone, backbone_name="resnet50", weights=None), 64),
    "mobilenet_v3_large_fpn": (
        functools.partial(backbone_utils.mobilenet_backbone, backbone_name="mobilenet_v3_large", weights=None,
                          fpn=True), 64),
}
EXPORTERS = [("torchscript", 17), ("torchscript", 18), ("dynamo", 18)]
QUICK = [("tiny_vit", "torchscript", 17), ("tiny_vit", "dynamo", 18), ("tiny_swin", "torchscript", 18),
         ("mobilenet_v3_small", "torchscript", 17), ("mobilenet_v3_small", "dynamo", 18),
         ("lraspp_mobilenet_v3_large", "torchscript", 17)]
CASES = [pytest.param(*case, id="-".join(map(str, case))) for case in QUICK] + [
    pytest.param(name, exporter, opset, id=f"{name}-{exporter}-{opset}", marks=pytest.mark.slow)
    for name in ZOO for exporter, opset in EXPORTERS if (name, exporter, opset) not in QUICK
]


def _randomised(model):
    """Redraw zero-initialised parameters and randomise batch-norm statistics."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.05)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model


def build(name: str):
    """The model `name` in eval mode with seeded random weights, and a random input for it."""
    make, size = ZOO[name]
    torch.manual_seed(0)
    model = _Outputs(_randomised(make())).eval()
    return model, torch.randn(1, 3, size, size)


def export(model, x, exporter: str, opset: int) -> bytes:
    """`model` as ONNX bytes, written by the given exporter at `opset`."""
    f = io.BytesIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(model, (x,), f, opset_version=opset, dynamo=False)
        else:
            program = torch.onnx.export(model, (x,), dynamo=True, opset_version=opset, verbose=False)
            program.model_proto.ir_version = min(program.model_proto.ir_version, 10)
            return program.model_proto.SerializeToString()
    return f.getvalue()


def relative_error(got, expected) -> float:
    """max |got - expected| / max |expected| (both float64)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape
    return float(np.max(np.abs(got - expected)) / max(np.max(np.abs(expected)), 1e-30))


def onnxruntime_outputs(data: bytes, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


@functools.lru_cache(maxsize=2)
def exported(name: str, exporter: str, opset: int):
    """(torch model, input, ONNX bytes), built once per case for this file's tests."""
    model, x = build(name)
    return model, x, export(model, x, exporter, opset)


@pytest.mark.parametrize("name,exporter,opset", CASES)
def test_torchvision_model_matches_onnxruntime_and_torch(name, exporter, opset):
    model, x, data = exported(name, exporter, opset)
    with torch.no_grad():
        expected_torch = model(x)
    expected_torch = [t.numpy() for t in (expected_torch if isinstance(expected_torch, tuple) else (expected_torch,))]
    imported = jtile.onnx.load(data)
    assert imported.opset == opset
    got = imported(x.numpy())
    got = got if isinstance(got, tuple) else (got,)
    expected_ort = onnxruntime_outputs(data, x.numpy())
    assert len(got) == len(expected_ort) == len(expected_torch)
    for g, e_ort, e_torch in zip(got, expected_ort, expected_torch):
        assert relative_error(g, e_ort) < RTOL
        assert relative_error(g, e_torch) < RTOL


@pytest.mark.parametrize("name,exporter,opset", CASES)
def test_torchvision_model_round_trips_through_export(name, exporter, opset):
    """Import, export with `jtile.onnx.export`, run the export in ORT: the output is unchanged."""
    _, x, data = exported(name, exporter, opset)
    imported = jtile.onnx.load(data)
    written = jtile.onnx.export(imported.fn, x.numpy(), params=imported.params)
    jaxpr = jax.make_jaxpr(imported.fn)(imported.params, x.numpy())
    resizes = sum(e.primitive.name == "resize" for e in iter_eqns(jaxpr.jaxpr))  # identity resizes vanish
    assert sum(n.op_type == "Resize" for n in written.graph.node) == resizes
    expected = imported(x.numpy())
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = onnxruntime_outputs(written.SerializeToString(), x.numpy())
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert relative_error(g, e) < RTOL


@pytest.mark.parametrize("exporter,opset", [("torchscript", 17), ("dynamo", 18)])
def test_exported_vit_runs_on_the_dense_and_matmul_kernels(exporter, opset):
    """Every projection, MLP layer and attention product of an exported ViT on
    the C kernels (the attention's head split as the exporter writes it)."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported("tiny_vit", exporter, opset)
    imported = jtile.onnx.load(data)
    swapped = swap_backend(fold_params(imported.fn, imported.params), algorithms={"dense": "gemm", "matmul": "gemm"})
    targets = [e.params["target_name"] for e in iter_eqns(jax.make_jaxpr(swapped)(x.numpy()).jaxpr)
               if e.primitive.name == "ffi_call"]
    layers = 2  # _tiny_vit: per layer, Q @ K^T and P @ V, and 4 dense (in/out projection, 2 MLP) + the head
    assert targets.count("jtile_matmul") == 2 * layers and targets.count("jtile_dense") == 4 * layers + 1
    assert relative_error(jax.jit(swapped)(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL


@pytest.mark.parametrize("exporter,opset", [("torchscript", 17), ("dynamo", 18)])
def test_exported_vit_runs_its_norms_softmaxes_scales_and_shortcuts_on_the_kernels(exporter, opset):
    """Under `auto`: every layer norm and softmax on the row kernels, the
    attention's 1 / sqrt(head width) applied by the scores product, and each
    MLP's and attention's shortcut added by the dense layer before it (the
    attention's through the exporter's reshape of its output projection); P @ V
    stores its heads side by side per token, as the head merge reads them."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported("tiny_vit", exporter, opset)
    imported = jtile.onnx.load(data)
    swapped = swap_backend(fold_params(imported.fn, imported.params), algorithms="auto")
    calls = [e for e in iter_eqns(jax.make_jaxpr(swapped)(x.numpy()).jaxpr) if e.primitive.name == "ffi_call"]
    targets = [e.params["target_name"] for e in calls]
    layers, width = 2, 16  # _tiny_vit: 2 layers of 2 heads over 32 features
    assert targets.count("jtile_layer_norm") == 2 * layers + 1 and targets.count("jtile_softmax") == layers
    scales = [float(dict(e.params["attributes"])["scale"]) for e in calls if e.params["target_name"] == "jtile_matmul"]
    assert scales == [width ** -0.5, 1.0] * layers
    merged = [int(dict(e.params["attributes"])["batch_inner"]) for e in calls
              if e.params["target_name"] == "jtile_matmul"]
    assert merged == [0, 1] * layers
    residuals = [e.invars[3].aval.shape for e in calls if e.params["target_name"] == "jtile_dense"]
    assert residuals.count((17, 32)) == 2 * layers  # 16 patches and the class token
    assert relative_error(jax.jit(swapped)(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL


def test_exported_regnet_holds_two_groups_in_a_vector():
    """RegNet-Y's grouped 3x3 convs (groups of 8 channels) on `grouped` with
    two groups a vector (AVX-512; one with AVX2's 8 lanes)."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported("regnet_y_400mf", "torchscript", 17)
    imported = jtile.onnx.load(data)
    swapped = swap_backend(fold_params(imported.fn, imported.params), algorithms="auto")
    grouped = [dict(e.params["attributes"]) for e in iter_eqns(jax.make_jaxpr(swapped)(x.numpy()).jaxpr)
               if e.primitive.name == "ffi_call" and e.params["target_name"] == "jtile_conv_grouped"]
    per_vector = [int(a["groups_per_vector"]) for a in grouped if int(np.asarray(a["conv"].val)[-1]) > 1]
    assert per_vector == [jtile.kernels.vector_lanes() // 8] * 16  # 16 blocks, one grouped conv each
    assert relative_error(jax.jit(swapped)(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL


@pytest.mark.parametrize("name", ["squeezenet1_1", "googlenet"])
def test_exported_branches_are_concatenated_in_place(name):
    """SqueezeNet's fire modules and GoogLeNet's inception blocks under
    `swap_backend`: every concatenation's branches write into its buffer (no
    concatenate left in the compiled program), and the output still matches
    ONNX Runtime."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported(name, "torchscript", 17)
    imported = jtile.onnx.load(data)
    swapped = jax.jit(swap_backend(fold_params(imported.fn, imported.params), algorithms="auto"))
    assert "concatenate(" not in swapped.lower(x.numpy()).compile().as_text()
    assert relative_error(swapped(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL


@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("dynamo", 18)])
def test_exported_channel_shuffles_are_read_through_the_plane_kernel(exporter, opset):
    """ShuffleNetV2 under `swap_backend`: each of the 13 stride-1 units' branches
    reads its half of the shuffled channels (a Slice, or a Split from the
    dynamo exporter), and each stage's next conv the whole shuffle (3), as one
    `jtile_gather_planes` call; the output still matches ONNX Runtime."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported("shufflenet_v2_x1_0", exporter, opset)
    imported = jtile.onnx.load(data)
    swapped = swap_backend(fold_params(imported.fn, imported.params), algorithms="auto")
    calls = [e.params["target_name"] for e in iter_eqns(jax.make_jaxpr(swapped)(x.numpy()).jaxpr)
             if e.primitive.name == "ffi_call"]
    assert calls.count("jtile_gather_planes") == 13 + 3
    assert relative_error(jax.jit(swapped)(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL


@pytest.mark.parametrize("name", ["resnet18", "googlenet"])
def test_exported_stem_pools_inside_its_conv(name):
    """The 7x7 stride-2 stem, its ReLU and its 3x3 stride-2 max pool run as one
    kernel call under `swap_backend` (no max-pool call left before the first
    block), and the output still matches ONNX Runtime."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported(name, "torchscript", 17)
    imported = jtile.onnx.load(data)
    swapped = swap_backend(fold_params(imported.fn, imported.params), algorithms="auto")
    calls = [e.params["target_name"] for e in iter_eqns(jax.make_jaxpr(swapped)(x.numpy()).jaxpr)
             if e.primitive.name == "ffi_call"]
    assert calls[0] == "jtile_conv_grouped" and calls[1] != "jtile_max_pool2d"
    assert relative_error(jax.jit(swapped)(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL


@pytest.mark.parametrize("name, prologues, pooled_first, prefix_reads", [
    # the dense layers' batch norms; the transitions; every dense layer but each block's first reads its
    # concatenation as the first channels of the block's buffer
    ("densenet121", 6 + 12 + 24 + 16, [256, 512, 1024], 5 + 11 + 23 + 15),
    # every squeeze-excitation block's scale, the four projections from 1152 channels at 7x7 (pixel rows) too
    ("efficientnet_b0", 16, [], 0),
])
def test_exported_pointwise_convs_take_the_ops_around_them(name, prologues, pooled_first, prefix_reads):
    """DenseNet's batch norm and ReLU before each dense layer's 1x1 conv, and
    EfficientNet's squeeze-excitation scale before each block's projection, run
    inside the conv's call under `swap_backend` (x packed through them);
    DenseNet's transitions average-pool before their 1x1 conv, applying the
    batch norm and ReLU before them as they read x, and its dense
    layers read their concatenations from one buffer per block. The output still
    matches ONNX Runtime."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported(name, "torchscript", 17)
    imported = jtile.onnx.load(data)
    swapped = swap_backend(fold_params(imported.fn, imported.params), algorithms="auto")
    kernels = [e for e in iter_eqns(jax.make_jaxpr(swapped)(x.numpy()).jaxpr) if e.primitive.name == "ffi_call"]
    calls = [e for e in kernels if e.params["target_name"] == "jtile_conv_smm"]
    given = lambda e, first: any(np.prod(v.aval.shape) > 0 for v in e.invars[first:first + 3])  # noqa: E731
    assert sum(given(e, 5) for e in calls) == prologues  # (shift, scale, bias: each per channel, one or none)
    pools = [e for e in kernels if e.params["target_name"] == "jtile_avg_pool2d"]
    assert [e.invars[0].aval.shape[1] for e in pools] == pooled_first  # their 256, 512, 1024 input channels
    assert all(given(e, 1) for e in pools)  # each transition's batch norm and ReLU applied by its pool
    attributes = [dict(e.params["attributes"]) for e in calls]
    assert sum(int(a["x_channels"]) < e.invars[0].aval.shape[1] for a, e in zip(attributes, calls)) == prefix_reads
    assert relative_error(jax.jit(swapped)(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL


@pytest.mark.parametrize("name, blocked", [
    # every inverted residual but the first: its expansion's and its depthwise conv's outputs (the first
    # block's depthwise output at 32x32 feeds a 1x1 conv, where blocking does not pay), but the second
    # block's expansion at 32x32, which its depthwise conv computes; the last projection's 320 channels,
    # read only by the final 1x1 conv
    ("mobilenet_v2", 2 * 16 - 1 + 1),
    # every expansion but that at 32x32 (the depthwise conv's output feeds squeeze-excitation's pool,
    # which is not a conv); the last projection
    ("efficientnet_b0", 14 + 1),
])
def test_exported_inverted_residuals_pass_channel_blocked_activations(name, blocked):
    """Activations that pass between kernel convs only stay NCHWc under
    `swap_backend`, the one expansion at 32x32 (from 64x64 images) runs inside
    its depthwise conv's call, and the output still matches ONNX Runtime."""
    from jtile.algorithms import swap_backend
    from jtile.fusion import fold_params

    _, x, data = exported(name, "torchscript", 17)
    imported = jtile.onnx.load(data)
    swapped = swap_backend(fold_params(imported.fn, imported.params), algorithms="auto")
    calls = [e for e in iter_eqns(jax.make_jaxpr(swapped)(x.numpy()).jaxpr) if e.primitive.name == "ffi_call"]
    assert sum(e.outvars[0].aval.ndim == 5 for e in calls) == blocked
    expanded = [e.invars[0].aval.shape for e in calls if e.params["target_name"] == "jtile_conv_expanded_depthwise"]
    assert expanded == [(1, 16, 32, 32)]
    assert relative_error(jax.jit(swapped)(x.numpy()), onnxruntime_outputs(data, x.numpy())[0]) < RTOL
