import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtile.models as zoo
from jtile import ConfigError
from jtile._interpreter import iter_eqns
from jtile._layers import describe


def _struct(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _normal(shape, seed=0):
    """N(0, 1) test input from numpy: jax.random would compile a kernel per shape."""
    return np.random.default_rng(seed).standard_normal(shape, np.float32)


def _abstract(name, key):
    """The model's tree with `ShapeDtypeStruct` leaves: no weights are generated."""
    return jax.eval_shape(lambda k: zoo.get(name, k), key)


# ------------------------------------------------------------- building blocks


def _np_conv(x, w, b, stride, pad, dil, groups):
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho = (h + 2 * pad - dil * (kh - 1) - 1) // stride + 1
    wo = (wd + 2 * pad - dil * (kw - 1) - 1) // stride + 1
    out = np.zeros((n, o, ho, wo), np.float64)
    for b_, oc, i, j in itertools.product(range(n), range(o), range(ho), range(wo)):
        g = oc // (o // groups)
        patch = xp[b_, g * cg:(g + 1) * cg,
                   i * stride:i * stride + dil * (kh - 1) + 1:dil,
                   j * stride:j * stride + dil * (kw - 1) + 1:dil]
        out[b_, oc, i, j] = np.sum(patch * w[oc]) + b[oc]
    return out


@pytest.mark.parametrize("stride,pad,dil,groups", [(1, 0, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (2, 1, 1, 4)])
def test_conv2d_matches_direct_convolution(getkey, stride, pad, dil, groups):
    conv = zoo.Conv2d(4, 8, 3, stride=stride, padding=pad, dilation=dil, groups=groups, key=getkey(), name="c")
    conv = eqx.tree_at(lambda c: c.bias, conv, _normal((8,)))
    x = _normal((2, 4, 7, 6))
    expect = _np_conv(np.asarray(x), np.asarray(conv.weight), np.asarray(conv.bias), stride, pad, dil, groups)
    np.testing.assert_allclose(conv(x), expect, rtol=1e-5, atol=1e-5)


def test_batchnorm_matches_formula(getkey):
    bn = zoo.BatchNorm2d(5, eps=1e-3, name="bn")
    g, b, m = (_normal((5,), seed) for seed in range(3))
    v = np.random.default_rng(3).uniform(0.1, 2.0, 5).astype(np.float32)
    bn = eqx.tree_at(lambda n: (n.weight, n.bias, n.running_mean.value, n.running_var.value), bn, (g, b, m, v))
    x = _normal((2, 5, 3, 4))
    r = lambda a: np.asarray(a).reshape(1, -1, 1, 1)  # noqa: E731
    expect = (x - r(m)) / np.sqrt(r(v) + 1e-3) * r(g) + r(b)
    np.testing.assert_allclose(bn(x), expect, rtol=1e-5, atol=1e-5)


def test_linear_matches_formula(getkey):
    fc = zoo.Linear(6, 3, key=getkey(), name="fc")
    x = _normal((4, 6))
    expect = x @ np.asarray(fc.weight).T + np.asarray(fc.bias)
    np.testing.assert_allclose(fc(x), expect, rtol=1e-5, atol=1e-6)


def _torch_pool_size(n, k, s, p, ceil):
    """Output length as torch documents it for MaxPool2d."""
    out = (n + 2 * p - k + (s - 1 if ceil else 0)) // s + 1
    return out - 1 if ceil and (out - 1) * s >= n + p else out


def _np_pool(x, k, s, p, ceil, reduce):
    ho, wo = (_torch_pool_size(n, k, s, p, ceil) for n in x.shape[2:])
    out = np.empty(x.shape[:2] + (ho, wo), x.dtype)
    for i, j in itertools.product(range(ho), range(wo)):
        r0, c0 = i * s - p, j * s - p
        out[:, :, i, j] = reduce(x[:, :, max(r0, 0):r0 + k, max(c0, 0):c0 + k])
    return out


@pytest.mark.parametrize("size,k,s,p,ceil", [
    (8, 2, 2, 0, False), (9, 3, 2, 0, True), (10, 3, 2, 1, False), (7, 3, 1, 1, True),
    (14, 3, 2, 0, True), (13, 2, 2, 0, True), (11, 3, 3, 1, True), (6, 3, 2, 1, True),
])
def test_maxpool_matches_torch_window_rule(getkey, size, k, s, p, ceil):
    x = _normal((2, 3, size, size + 1))
    pool = zoo.MaxPool2d(k, s, p, ceil_mode=ceil, name="pool")
    np.testing.assert_array_equal(pool(x), _np_pool(x, k, s, p, ceil, lambda w: w.max(axis=(2, 3))))


def test_avgpool_counts_padding_as_zero(getkey):
    x = _normal((1, 2, 7, 7))
    pool = zoo.AvgPool2d(3, 2, 1, name="pool")
    expect = _np_pool(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), 3, 2, 0, False, lambda w: w.mean(axis=(2, 3)))
    np.testing.assert_allclose(pool(x), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size,out", [(7, 7), (14, 7), (12, 1), (7, 6), (5, 3), (1, 7), (3, 7)])
def test_adaptive_avgpool_matches_torch_windows(getkey, size, out):
    x = _normal((2, 3, size, size + 1))
    starts = lambda n, o: [(i * n // o, -(-(i + 1) * n // o)) for i in range(o)]  # noqa: E731
    expect = np.empty((2, 3, out, out))
    for (i, (r0, r1)), (j, (c0, c1)) in itertools.product(
        enumerate(starts(size, out)), enumerate(starts(size + 1, out))
    ):
        expect[:, :, i, j] = x[:, :, r0:r1, c0:c1].mean(axis=(2, 3))
    np.testing.assert_allclose(zoo.AdaptiveAvgPool2d(out, name="p")(x), expect, rtol=1e-5, atol=1e-6)


def test_activations_match_formulas():
    x = jnp.linspace(-8.0, 8.0, 33).reshape(1, 1, 3, 11)
    np.testing.assert_array_equal(zoo.ReLU(name="r")(x), np.maximum(x, 0))
    np.testing.assert_array_equal(zoo.ReLU6(name="r")(x), np.clip(x, 0, 6))
    np.testing.assert_allclose(zoo.LeakyReLU(0.1, name="r")(x), np.where(x > 0, x, 0.1 * x), rtol=1e-6)
    np.testing.assert_array_equal(zoo.Dropout(0.5, name="d")(x), x)


# ----------------------------------------------------------------- the zoo


@pytest.mark.parametrize("name,params", [
    ("alexnet", 61_100_840), ("vgg16", 138_357_544), ("resnet18", 11_689_512),
    ("mobilenet_v2", 3_504_872), ("googlenet", 6_624_904),
    ("tutorial", 32 * 3 * 9 + 32 + 2 * 32), ("ai3_convnet", 16 * 3 * 9 + 16 + 32 * 16 * 9 + 32),
])
def test_parameter_counts_match_torchvision(getkey, name, params):
    assert zoo.count_params(_abstract(name, getkey())).params == params


def test_buffers_are_counted_apart(getkey):
    # ResNet-18 has 4800 batch-norm channels, each with a running mean and variance
    count = zoo.count_params(_abstract("resnet18", getkey()))
    assert count == zoo.ParamCount(params=11_689_512, buffers=2 * 4800)
    model = zoo.get("tutorial", getkey())
    params, buffers = eqx.partition(model, zoo.trainable_mask(model))
    assert [x.shape for x in jax.tree.leaves(buffers)] == [(32,), (32,)]
    assert len(jax.tree.leaves(params)) == 4


@pytest.mark.parametrize("name,out", [
    ("tutorial", (4, 32, 64, 64)), ("ai3_convnet", (1, 32 * 112 * 112)), ("alexnet", (1, 1000)),
    ("vgg16", (1, 1000)), ("resnet18", (1, 1000)), ("mobilenet_v2", (1, 1000)), ("googlenet", (1, 1000)),
])
def test_output_shape_at_default_input(getkey, name, out):
    shape = jax.eval_shape(lambda k, x: zoo.get(name, k)(x), getkey(), _struct(zoo.input_shape(name)))
    assert shape.shape == out and shape.dtype == jnp.float32


@pytest.mark.parametrize("name,size", [("alexnet", 256), ("vgg16", 64), ("googlenet", 31), ("resnet18", 1)])
def test_other_input_sizes_run(getkey, name, size):
    shape = jax.eval_shape(lambda k, x: zoo.get(name, k, num_classes=7)(x), getkey(), _struct((2, 3, size, size)))
    assert shape.shape == (2, 7)


def test_tutorial_padding_keeps_size(getkey):
    model = zoo.get("tutorial", getkey(), padding=1)
    assert jax.eval_shape(model, _struct((4, 3, 66, 66))).shape == (4, 32, 66, 66)


@pytest.mark.parametrize("name,size", [("alexnet", 62), ("vgg16", 31), ("googlenet", 30)])
def test_too_small_input_raises(getkey, name, size):
    with pytest.raises(ConfigError, match="larger input size"):
        jax.eval_shape(lambda k, x: zoo.get(name, k)(x), getkey(), _struct((1, 3, size, size)))


def test_wrong_channels_raise(getkey):
    model = zoo.get("ai3_convnet", getkey())
    with pytest.raises(ConfigError, match="conv1: expected 3 input channels"):
        model(jnp.zeros((1, 4, 8, 8)))


def test_same_key_same_params_other_key_other_params(getkey):
    key = getkey()
    a, b, c = zoo.get("resnet18", key), zoo.get("resnet18", key), zoo.get("resnet18", getkey())
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert not np.array_equal(a.conv1.weight, c.conv1.weight)
    assert not np.array_equal(a.layer1[0].conv1.weight, a.layer1[1].conv1.weight)
    traced = eqx.filter_jit(lambda k: zoo.get("resnet18", k))(key)  # the draw as a callback
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(traced)))


@pytest.mark.parametrize("name,size", [
    ("tutorial", 66), ("ai3_convnet", 32), ("resnet18", 64), ("mobilenet_v2", 64), ("googlenet", 64),
    # XLA's CPU fusion of VGG's dot -> relu -> dot classifier runs 17 s instead of 0.1 s
    ("alexnet", 63), pytest.param("vgg16", 32, marks=pytest.mark.slow),
])
def test_forward_on_normal_input_is_finite_and_unit_scale(getkey, name, size):
    fn, params = zoo.as_function(zoo.get(name, getkey()))
    y = jax.jit(fn)(params, _normal(zoo.input_shape(name, batch=2, size=size)))
    assert bool(jnp.isfinite(y).all())
    assert 1e-2 < float(jnp.std(y)) < 1e2


def test_as_function_is_pure_and_equals_the_model(getkey, tree_allclose):
    model = zoo.get("resnet18", getkey(), num_classes=10)
    fn, params = zoo.as_function(model)
    x = _normal((2, 3, 32, 32))
    expect = model(x)
    assert tree_allclose(fn(params, x), expect, rtol=0, atol=0)
    assert tree_allclose(jax.jit(fn)(params, x), expect, rtol=1e-5, atol=1e-5)
    assert zoo.count_params(params) == zoo.count_params(model)
    doubled = jax.tree.map(lambda p: 2 * p, params)
    assert not np.allclose(fn(doubled, x), fn(params, x))  # the output depends on params, not on the closure


def test_layers_carry_torchvision_scope_names(getkey):
    jaxpr = jax.make_jaxpr(lambda k, x: zoo.get("resnet18", k)(x))(getkey(), _struct((1, 3, 32, 32)))
    convs = [layer.name for e in iter_eqns(jaxpr.jaxpr) if (layer := describe(e)) is not None and layer.kind == "conv2d"]
    blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    downsampled = {"layer2.0", "layer3.0", "layer4.0"}
    expect = ["conv1"] + [
        f"{b}.{c}" for b in blocks for c in ("conv1", "conv2") + (("downsample.0",) if b in downsampled else ())
    ]
    assert convs == expect


def test_state_dict_uses_torchvision_names(getkey):
    names = set(zoo.state_dict(_abstract("mobilenet_v2", getkey())))
    assert {"features.0.0.weight", "features.1.conv.0.0.weight", "features.1.conv.1.weight",
            "features.2.conv.0.1.running_var", "features.18.1.bias", "classifier.1.weight"} <= names
    names = set(zoo.state_dict(_abstract("googlenet", getkey())))
    assert {"conv1.conv.weight", "conv1.bn.running_mean", "inception4e.branch4.1.conv.weight", "fc.bias"} <= names
    names = set(zoo.state_dict(_abstract("alexnet", getkey())))
    assert names == {f"{p}.{i}.{w}" for p, idx in (("features", (0, 3, 6, 8, 10)), ("classifier", (1, 4, 6)))
                     for i in idx for w in ("weight", "bias")}


def test_load_state_dict_round_trip_and_errors(getkey, tree_allclose):
    a, b = zoo.get("tutorial", getkey()), zoo.get("tutorial", getkey())
    weights = {k: np.asarray(v) + 1 for k, v in zoo.state_dict(a).items()}
    loaded = zoo.load_state_dict(b, {**weights, "bn0.num_batches_tracked": np.array(3)})
    assert tree_allclose(zoo.state_dict(loaded), weights)
    assert isinstance(loaded.bn0.running_var, zoo.Buffer)
    with pytest.raises(ConfigError, match=r"missing weights \['bn0.bias'\]"):
        zoo.load_state_dict(b, {k: v for k, v in weights.items() if k != "bn0.bias"})
    with pytest.raises(ConfigError, match=r"unknown weights \['fc.weight'\]"):
        zoo.load_state_dict(b, {**weights, "fc.weight": np.zeros(1)})
    with pytest.raises(ConfigError, match="conv0.bias has shape"):
        zoo.load_state_dict(b, {**weights, "conv0.bias": np.zeros(3)})


def test_registry_names_and_input_shapes(getkey):
    assert zoo.NAMES == ("tutorial", "ai3_convnet", "alexnet", "vgg16", "resnet18", "mobilenet_v2", "googlenet")
    assert zoo.input_shape("tutorial") == (4, 3, 66, 66)
    assert zoo.input_shape("googlenet") == (1, 3, 224, 224)
    assert zoo.input_shape("resnet18", batch=8, size=64) == (8, 3, 64, 64)
    assert isinstance(zoo.get("ai3_convnet"), zoo.AI3ConvNet)
    with pytest.raises(ConfigError, match="unknown model 'resnet50'; valid names are tutorial, ai3_convnet"):
        zoo.get("resnet50")
    with pytest.raises(ConfigError, match="unknown model"):
        zoo.input_shape("lenet")
    with pytest.raises(ConfigError, match="size must be a positive int"):
        zoo.input_shape("vgg16", size=0)
    with pytest.raises(ConfigError, match=r"get\('vgg16'\).*num_clases"):
        zoo.get("vgg16", getkey(), num_clases=10)


# ------------------------------------------------------------- against torch


def _torch_resnet18(torch):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(out + (x if self.downsample is None else self.downsample(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            for i, (cin, cout) in enumerate(((64, 64), (64, 128), (128, 256), (256, 512)), start=1):
                blocks = (Block(cin, cout, 1 if i == 1 else 2), Block(cout, cout, 1))
                setattr(self, f"layer{i}", nn.Sequential(*blocks))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, 1000)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return Net()


@pytest.mark.slow
def test_resnet18_matches_torch(getkey):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = _torch_resnet18(torch).eval()
    with torch.no_grad():
        for name, buf in net.named_buffers():  # non-trivial batch-norm statistics
            if name.endswith("running_mean"):
                buf.normal_(0.0, 0.1)
            elif name.endswith("running_var"):
                buf.uniform_(0.5, 1.5)
        for name, p in net.named_parameters():
            if name.endswith("bn1.weight") or name.endswith("bn2.weight"):
                p.uniform_(0.5, 1.5)
    model = zoo.load_state_dict(zoo.get("resnet18", getkey()), net.state_dict())
    x = _normal((2, 3, 64, 72))
    with torch.no_grad():
        expect = net(torch.tensor(x)).numpy()
    np.testing.assert_allclose(model(x), expect, rtol=1e-4, atol=1e-4)

