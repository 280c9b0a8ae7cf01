"""Every ordered pair of transforms either works and changes the graph, or
raises a jtile error naming the order to use: never a silent no-op."""

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jtile

_DN = ("NCHW", "OIHW", "NCHW")


def _conv(x, w, stride=1, groups=1, pad=1):
    return lax.conv_general_dilated(x, w, (stride, stride), ((pad, pad), (pad, pad)),
                                    dimension_numbers=_DN, feature_group_count=groups)


def _bn(y, p):
    scale = p["gamma"] / jnp.sqrt(p["var"] + 1e-5)
    return (y - p["mean"][None, :, None, None]) * scale[None, :, None, None] + p["beta"][None, :, None, None]


def _head(y, p):
    return jnp.mean(y, axis=(2, 3)) @ p["fc"] + p["fc_b"]


def resnet_block(p, x):
    y = jax.nn.relu(_bn(_conv(x, p["w1"]), p["bn1"]))
    y = _bn(_conv(y, p["w2"]), p["bn2"])
    return _head(jax.nn.relu(y + x), p)


def mobilenet_block(p, x):
    y = jnp.clip(_bn(_conv(x, p["w1"], pad=0), p["bn1"]), 0.0, 6.0)
    y = jnp.clip(_bn(_conv(y, p["w2"], groups=y.shape[1]), p["bn2"]), 0.0, 6.0)
    y = _bn(_conv(y, p["w3"], pad=0), p["bn3"]) + x
    return _head(y, p)


def _bn_params(key, c):
    a, b, m, v = jax.random.split(key, 4)
    return dict(gamma=1 + 0.1 * jax.random.normal(a, (c,)), beta=0.1 * jax.random.normal(b, (c,)),
                mean=0.1 * jax.random.normal(m, (c,)), var=1 + jax.random.uniform(v, (c,)))


def _params(block, key):
    k = iter(jax.random.split(key, 12))
    if block is resnet_block:
        shapes = dict(w1=(8, 8, 3, 3), w2=(8, 8, 3, 3))
        norms = dict(bn1=8, bn2=8)
    else:
        shapes = dict(w1=(16, 8, 1, 1), w2=(16, 1, 3, 3), w3=(8, 16, 1, 1))
        norms = dict(bn1=16, bn2=16, bn3=8)
    p = {n: 0.3 * jax.random.normal(next(k), s) for n, s in shapes.items()}
    p |= {n: _bn_params(next(k), c) for n, c in norms.items()}
    return p | dict(fc=0.3 * jax.random.normal(next(k), (8, 10)), fc_b=jax.random.normal(next(k), (10,)))


NAMES = ("tile_conv", "fuse", "fold_params", "split_gemm", "swap_backend")

# (first, second) orders that must raise, and a word of the message.
REFUSED = {
    ("swap_backend", "tile_conv"): "tile_conv first",
    ("swap_backend", "fuse"): "fuse first",
    ("swap_backend", "fold_params"): "fuse first",
    ("swap_backend", "split_gemm"): "swap_backend(split_gemm(f))",
    ("tile_conv", "fuse"): "tile_conv(fuse(f))",
    ("tile_conv", "fold_params"): "tile_conv(fuse(f))",
    ("fold_params", "fuse"): "fused already",
}


def _apply(name, fn, folded, params):
    """`(transformed fn, whether it now takes only x)`."""
    if name == "fold_params":
        return jtile.fusion.fold_params(fn, params), True
    if name == "tile_conv":
        return jtile.tile_conv(fn, axis="H", tiles=2), folded
    if name == "fuse":
        return jtile.fuse(fn), folded
    if name == "split_gemm":
        return jtile.split_gemm(fn, max_m=1, max_k=4, max_n=4), folded
    return jtile.swap_backend(fn, algorithms="auto"), folded


def _ops(fn, folded, params, x) -> collections.Counter:
    args = (x,) if folded else (params, x)
    return collections.Counter(op.primitive for op in jtile.graph(fn, *args).all_ops())


@pytest.mark.parametrize("block", [resnet_block, mobilenet_block])
@pytest.mark.parametrize("first,second", list(itertools.permutations(NAMES, 2)))
def test_ordered_pair_works_or_names_the_order(block, first, second, getkey):
    params = _params(block, getkey())
    x = jax.random.normal(getkey(), (1, 8, 8, 8))
    once, folded = _apply(first, block, False, params)
    if (first, second) in REFUSED:
        with pytest.raises(jtile.ConfigError, match=f"already transformed by|{REFUSED[first, second]}") as info:
            _apply(second, once, folded, params)
        assert REFUSED[first, second] in str(info.value)
        return
    twice, folded2 = _apply(second, once, folded, params)
    got = jax.jit(twice)(*((x,) if folded2 else (params, x)))
    expected = block(params, x)
    scale = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * scale)
    assert _ops(twice, folded2, params, x) != _ops(once, folded, params, x), f"{second} changed nothing"


def atrous_block(p, x):
    """DeepLabV3's atrous conv on a small map: `fold_params` splits it into regions of live taps."""
    y = lax.conv_general_dilated(x, p["w"], (1, 1), ((12, 12), (12, 12)), rhs_dilation=(12, 12), dimension_numbers=_DN)
    return _conv(jax.nn.relu(y + p["b"][None, :, None, None]), p["w2"], pad=0)


@pytest.mark.parametrize("then", ["tile_conv", "tile_spatial loop", "tile_spatial unroll", "swap_backend"])
def test_transforms_compose_with_a_conv_split_into_regions(then, getkey):
    p = dict(w=0.02 * jax.random.normal(getkey(), (128, 256, 3, 3)), b=jax.random.normal(getkey(), (128,)),
             w2=0.1 * jax.random.normal(getkey(), (16, 128, 1, 1)))
    x = jax.random.normal(getkey(), (1, 256, 14, 14))
    folded = jtile.fusion.fold_params(atrous_block, p)
    convs = [op for op in jtile.graph(folded, x).all_ops() if op.primitive in ("conv_general_dilated", "conv_bias_act")]
    assert len(convs) > 2  # the atrous conv became one conv a region
    transformed = {
        "tile_conv": lambda f: jtile.tile_conv(f, axis="H", tiles=2),
        "tile_spatial loop": lambda f: jtile.tile_spatial(f, grid=(2, 2)),
        "tile_spatial unroll": lambda f: jtile.tile_spatial(f, grid=(2, 2), mode="unroll"),
        "swap_backend": lambda f: jtile.swap_backend(f, algorithms="auto"),
    }[then](folded)
    expected = atrous_block(p, x)
    np.testing.assert_allclose(jax.jit(transformed)(x), expected, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(expected))))
    assert _ops(transformed, True, p, x) != _ops(folded, True, p, x), f"{then} changed nothing"
