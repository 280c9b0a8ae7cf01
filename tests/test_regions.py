import hypothesis.strategies as st
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from jax import lax

from jtile._fused import conv_bias_act
from jtile._regions import SlidingWindow, Stop, Window, hull, split
from jtile._registry import facet


@given(st.integers(1, 50), st.integers(1, 50))
def test_split_covers_extent_with_near_equal_tiles(extent, tiles):
    windows = split(extent, min(tiles, extent))
    assert windows[0].start == 0 and windows[-1].stop == extent
    assert all(a.stop == b.start for a, b in zip(windows, windows[1:]))
    assert max(w.size for w in windows) - min(w.size for w in windows) <= 1


@given(
    size=st.integers(1, 30), window=st.integers(1, 4), stride=st.integers(1, 3),
    pad_lo=st.integers(0, 3), pad_hi=st.integers(0, 3), dilation=st.integers(1, 2),
    data=st.data(),
)
def test_input_region_reproduces_padded_window(size, window, stride, pad_lo, pad_hi, dilation, data):
    sw = SlidingWindow(size, window, stride, pad_lo, pad_hi, dilation)
    if sw.out_size < 1:
        return
    start = data.draw(st.integers(0, sw.out_size - 1))
    out = Window(start, data.draw(st.integers(start + 1, sw.out_size)))
    region, (lo, hi) = sw.input_region(out)
    rows = np.arange(size, dtype=float)
    padded = np.concatenate([np.full(pad_lo, -1.0), rows, np.full(pad_hi, -1.0)])
    tile = np.concatenate([np.full(lo, -1.0), rows[region.start : region.stop], np.full(hi, -1.0)])
    # Every output row of the tile sees exactly the taps it sees in the full padded input.
    for i in range(out.size):
        full = padded[(out.start + i) * stride + np.arange(window) * dilation]
        local = tile[i * stride + np.arange(window) * dilation]
        assert np.array_equal(full, local)
    assert lo >= 0 and hi >= 0 and lo <= pad_lo and hi <= pad_hi


# ---------------------------------------------------------------- region rules (tile_spatial)


_SETTINGS = settings(max_examples=6, deadline=None)


def _conv_case(data, rng):
    nd = data.draw(st.integers(1, 3))
    lhs_spec = tuple(data.draw(st.permutations(range(nd + 2))))
    rhs_spec = tuple(data.draw(st.permutations(range(nd + 2))))
    out_spec = tuple(data.draw(st.permutations(range(nd + 2))))
    groups = data.draw(st.sampled_from([1, 2]))
    cin, cout = 2 * groups, 2 * groups
    spatial = [data.draw(st.integers(3, 9 if nd < 3 else 6)) for _ in range(nd)]
    kernel = [data.draw(st.integers(1, 3)) for _ in range(nd)]
    strides = [data.draw(st.integers(1, 3)) for _ in range(nd)]
    dilation = [data.draw(st.integers(1, 2)) for _ in range(nd)]
    padding = [(data.draw(st.integers(-1, 2)), data.draw(st.integers(-1, 2))) for _ in range(nd)]
    for i in range(nd):  # keep at least one output row
        span = (kernel[i] - 1) * dilation[i] + 1
        if spatial[i] + sum(padding[i]) < span:
            padding[i] = (span, span)
    lhs_shape, rhs_shape = [0] * (nd + 2), [0] * (nd + 2)
    for dims, shape, sizes in ((lhs_spec, lhs_shape, [1, cin, *spatial]),
                               (rhs_spec, rhs_shape, [cout, cin // groups, *kernel])):
        for d, n in zip(dims, sizes):
            shape[d] = n
    dn = lax.ConvDimensionNumbers(lhs_spec, rhs_spec, out_spec)
    fused = data.draw(st.booleans())
    bias_shape = [1] * (nd + 2)
    bias_shape[out_spec[1]] = cout

    def fn(x, w, b):
        if fused:
            return conv_bias_act(x, w, b, activation=("relu",), window_strides=tuple(strides),
                                 padding=tuple(padding), lhs_dilation=(1,) * nd, rhs_dilation=tuple(dilation),
                                 dimension_numbers=dn, feature_group_count=groups, batch_group_count=1,
                                 precision=None, preferred_element_type=None)
        return lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=dn,
                                        feature_group_count=groups)

    args = [rng.standard_normal(lhs_shape), rng.standard_normal(rhs_shape), rng.standard_normal(bias_shape)]
    return fn, args, out_spec[2:], {0: not fused}  # relu zeroes some gradients


def _pool_case(data, rng):
    kind = data.draw(st.sampled_from(["max", "sum", "min"]))
    shape = (1, 2, data.draw(st.integers(3, 10)), data.draw(st.integers(3, 10)))
    window = (1, 1, data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)))
    strides = (1, 1, data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)))
    # jax has no VJP for a dilated max pool, which the brute force needs
    dil = (1, 1, data.draw(st.integers(1, 2)) if kind == "sum" else 1, 1)
    padding = ((0, 0), (0, 0), (data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))), (1, 0))
    init, op = {"max": (-jnp.inf, lax.max), "sum": (0.0, lax.add), "min": (jnp.inf, lax.min)}[kind]

    def fn(x):
        return lax.reduce_window(x, init, op, window, strides, padding, window_dilation=dil)

    return fn, [rng.standard_normal(shape)], (2, 3), {0: kind == "sum"}


def _pad_case(data, rng):
    shape = (1, 2, data.draw(st.integers(4, 10)), data.draw(st.integers(4, 10)))
    config = ((0, 0, 0), (1, 0, 1), *[(data.draw(st.integers(-2, 3)), data.draw(st.integers(-1, 3)), 0)
                                       for _ in range(2)])

    def fn(x, value):
        return lax.pad(x, value, config)

    return fn, [rng.standard_normal(shape), np.float32(rng.standard_normal())], (2, 3), {0: True}


def _elementwise_case(data, rng):
    shape = (1, 3, data.draw(st.integers(2, 8)), data.draw(st.integers(2, 8)))
    other = data.draw(st.sampled_from([shape, (1, 3, 1, 1), (1, 1, shape[2], 1), ()]))
    op = data.draw(st.sampled_from([lax.add, lax.mul, lax.sub, lax.max]))
    return op, [rng.standard_normal(shape), rng.standard_normal(other)], (2, 3), {0: op is not lax.max}


def _broadcast_case(data, rng):
    h, w = data.draw(st.integers(2, 8)), data.draw(st.integers(2, 8))
    operand, dims = data.draw(st.sampled_from([((3,), (1,)), ((3, 1, 1), (1, 2, 3)), ((h, w), (2, 3))]))

    def fn(x):
        return lax.broadcast_in_dim(x, (1, 3, h, w), dims)

    return fn, [rng.standard_normal(operand)], (2, 3), {0: True}


def _layout_case(data, rng):
    shape = (1, data.draw(st.integers(2, 6)), data.draw(st.integers(2, 6)), 3)
    kind = data.draw(st.sampled_from(["transpose", "concatenate", "reduce_sum", "convert", "dot"]))
    if kind == "transpose":
        return (lambda x: lax.transpose(x, (0, 3, 1, 2))), [rng.standard_normal(shape)], (2, 3), {0: True}
    if kind == "concatenate":
        return (lambda x, y: lax.concatenate([x, y], 3)), [rng.standard_normal(shape)] * 2, (1, 2), {0: True}
    if kind == "reduce_sum":
        return (lambda x: jnp.sum(x, axis=3)), [rng.standard_normal(shape)], (1, 2), {0: True}
    if kind == "convert":
        return (lambda x: x.astype(jnp.float16)), [rng.standard_normal(shape)], (1, 2), {0: True}
    dot = (lambda x, w: lax.dot_general(x, w, (((3,), (0,)), ((), ()))))
    return dot, [rng.standard_normal(shape), rng.standard_normal((3, 4))], (1, 2), {0: True}


_CASES = [_conv_case, _pool_case, _pad_case, _elementwise_case, _broadcast_case, _layout_case]


def _one_eqn(fn, args):
    args = [jnp.asarray(a, jnp.float32) for a in args]
    closed = jax.make_jaxpr(fn)(*args)
    eqn = closed.jaxpr.eqns[-1]
    env = dict(zip(closed.jaxpr.invars, args))
    vals = [v.val if isinstance(v, jcore.Literal) else env[v] for v in eqn.invars]
    return eqn, vals


def _bind(eqn, vals, params):
    return eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(params))


def _read(x, read, fill):
    """Operand `x` cut to `read` along each dim, `fill` outside its extent."""
    for entry in read:
        if entry is None:
            continue
        dim, w = entry
        idx = np.arange(w.start, w.stop)
        inside = (idx >= 0) & (idx < x.shape[dim])
        x = np.take(x, np.clip(idx, 0, x.shape[dim] - 1), axis=dim)
        shape = [1] * x.ndim
        shape[dim] = len(idx)
        x = np.where(inside.reshape(shape), x, np.asarray(fill, x.dtype))
    return x


def _assert_close(got, expected):
    # a product over a cut operand may sum in another order; NaN (a read the rule
    # promised unused) never passes
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=1e-5, atol=1e-5)


def _support(eqn, vals, j, axes, windows):
    """Rows of operand `j` that output `windows` depends on, per tiled axis (brute force: vjp)."""
    def window_sum(xj):
        out = _bind(eqn, [*vals[:j], xj, *vals[j + 1 :]], eqn.params)
        for d, w in zip(axes, windows):
            out = lax.slice_in_dim(out, w.start, w.stop, axis=d)
        weights = jax.random.uniform(jax.random.key(1), out.shape, out.dtype, 0.5, 1.5)
        return jnp.sum(out.astype(jnp.float32) * weights)

    grad = np.asarray(jax.grad(window_sum)(vals[j])) != 0
    return {d: np.flatnonzero(grad.any(axis=tuple(e for e in range(grad.ndim) if e != d))) for d in range(grad.ndim)}


@pytest.mark.parametrize("case", _CASES)
@_SETTINGS
@given(data=st.data())
def test_region_rule_matches_brute_force_receptive_field(case, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    fn, args, spatial, linear = case(data, rng)
    eqn, vals = _one_eqn(fn, args)
    rule = facet(eqn, "region")
    out_shape = eqn.outvars[0].aval.shape
    assume(all(n > 0 for n in out_shape))
    axes = tuple(data.draw(st.permutations(spatial))[: data.draw(st.integers(1, min(2, len(spatial))))])
    windows = []
    for d in axes:
        start = data.draw(st.integers(0, out_shape[d] - 1))
        windows.append(Window(start, data.draw(st.integers(start + 1, out_shape[d]))))
    expected = np.asarray(_bind(eqn, vals, eqn.params))
    for d, w in zip(axes, windows):
        expected = np.take(expected, np.arange(w.start, w.stop), axis=d)
    # Unrolled tiles: clipped windows, border padding in the params; exact.
    region = rule(eqn, axes, tuple(windows), True)
    vals = [np.asarray(v) for v in vals]
    operands = [v if read is None else _read(v, read, np.nan) for v, read in zip(vals, region.operands)]
    _assert_close(_bind(eqn, operands, region.params), expected)
    for j, read in enumerate(region.operands):
        if read is None or vals[j].ndim == 0:
            continue
        support = _support(eqn, vals, j, axes, windows)
        for entry in read:
            if entry is None:
                continue
            dim, w = entry
            assert 0 <= w.start and w.stop <= vals[j].shape[dim]
            rows = support[dim]
            assert rows.size == 0 or (w.start <= rows.min() and rows.max() < w.stop)
            if linear.get(j) and rows.size:
                # tight away from the border (at it, a stride may skip the first or last row kept)
                assert w.start == 0 or rows.min() == w.start
                assert w.stop == vals[j].shape[dim] or rows.max() + 1 == w.stop
    # Looped tiles: unclipped windows; what lies outside an operand is its fill,
    # or NaN where the rule promises it is never used.
    region = rule(eqn, axes, tuple(windows), False)
    operands = [
        v if read is None else _read(v, read, np.nan if fill is None else fill(vals))
        for v, read, fill in zip(vals, region.operands, region.fill)
    ]
    _assert_close(_bind(eqn, operands, region.params), expected)


def test_reshape_across_space_stops():
    eqn, _ = _one_eqn(lambda x: x.reshape(1, 2, 16), [jnp.ones((1, 2, 4, 4))])
    with pytest.raises(Stop):
        facet(eqn, "region")(eqn, (2,), (Window(0, 1),), True)


@pytest.mark.parametrize("fn, extra", [(lambda x: jnp.sum(x, axis=2), []), (lambda x, w: x @ w, [jnp.ones((4, 3))])])
def test_reduction_or_product_over_a_spatial_dim_reads_it_from_no_output_dim(fn, extra):
    """`tile_spatial` finds a value's tiled dims by asking which output dims read
    them: a reduced or contracted dim is read by none, so the block stops there."""
    eqn, _ = _one_eqn(fn, [jnp.ones((1, 2, 4, 4)), *extra])
    rank = len(eqn.outvars[0].aval.shape)
    reduced = 2 if eqn.primitive.name == "reduce_sum" else 3
    for d in range(rank):
        region = facet(eqn, "region")(eqn, (d,), (Window(0, 1),), True)
        assert region.operands[0] is None or region.operands[0][0] is None or region.operands[0][0][0] != reduced


def test_hull_is_the_smallest_covering_window():
    assert hull([Window(3, 5), Window(-1, 2), Window(4, 9)]) == Window(-1, 9)


@settings(deadline=None, max_examples=200)
@given(n=st.integers(1, 20), k=st.integers(1, 5), s=st.integers(1, 3), d=st.integers(1, 30),
       lo=st.integers(0, 40), hi=st.integers(0, 40))
def test_live_taps_keep_every_tap_that_reads_input_and_the_same_rows(n, k, s, d, lo, hi):
    sw = SlidingWindow(n, k, s, lo, hi, d)
    assume(sw.out_size >= 1)
    reads = {j: [o * s - lo + j * d for o in range(sw.out_size)] for j in range(k)}
    live = [j for j, rows in reads.items() if any(0 <= r < n for r in rows)]
    found = sw.live_taps()
    if found is None:  # nothing to crop (the check is conservative: a strided window may skip the input)
        return
        return
    first, last, cropped = found
    assert all(first <= j <= last for j in live) and (first, last) != (0, k - 1)
    assert cropped.out_size == sw.out_size and cropped.window == last - first + 1
    for j in range(first, last + 1):  # tap j is the cropped window's tap j - first, reading the same rows
        assert [o * s - cropped.pad_lo + (j - first) * cropped.dilation for o in range(sw.out_size)] == reads[j]


def test_live_taps_of_an_atrous_pyramid_on_a_small_map():
    assert SlidingWindow(14, 3, 1, 12, 12, 12).live_taps() is None  # every tap reads rows 0-1 or 12-13
    first, last, cropped = SlidingWindow(14, 3, 1, 36, 36, 36).live_taps()
    assert (first, last) == (1, 1) and cropped == SlidingWindow(14, 1, 1, 0, 0, 1)
