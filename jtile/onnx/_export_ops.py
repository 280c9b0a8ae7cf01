"""One ONNX emitter per JAX primitive, for `jtile.onnx.export`.

An emitter is `emit(graph, eqn, *input_names) -> output name(s)`; `graph` is
`export.Graph` (`node(op, inputs, **attrs)`, `const(value)`). Layout-generic
primitives (`dot_general`, `conv_general_dilated`, `reduce_window_*`) are
transposed into the layout ONNX wants and back, with no-op transposes and
reshapes skipped. Each emitter is the `onnx` facet of its primitive's
`jtile._registry` entry.
"""

import math

import numpy as np
from onnx import helper

from .._errors import OnnxError
from .._geometry import ConvGeometry, DotGeometry
from .._registry import register


def _in_shape(eqn, i: int = 0) -> tuple[int, ...]:
    return tuple(eqn.invars[i].aval.shape)


def _out(eqn):
    return eqn.outvars[0].aval


def _reshape(g, x: str, old, new) -> str:
    if tuple(old) == tuple(new):
        return x
    if x in g.constants:  # a folded weight or bias: reshape the value, not the graph
        return g.const(g.constants[x].reshape(new))
    return g.node("Reshape", [x, g.const(np.asarray(new, np.int64))])


def _transpose(g, x: str, perm) -> str:
    perm = [int(p) for p in perm]
    return x if perm == sorted(perm) else g.node("Transpose", [x], perm=perm)


def _inverse(perm) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _cast(g, x: str, src, dst) -> str:
    if np.dtype(src) == np.dtype(dst):
        return x
    return g.node("Cast", [x], to=helper.np_dtype_to_tensor_dtype(np.dtype(dst)))


def _fail(eqn, why: str):
    raise OnnxError(f"export: {eqn.primitive.name} in layer {str(eqn.source_info.name_stack) or '<top level>'!r}: {why}")


def _unary(op: str):
    return lambda g, eqn, x: g.node(op, [x])


def _binary(op: str):
    return lambda g, eqn, a, b: g.node(op, [a, b])


def _logical(op: str, bitwise: str):
    def emit(g, eqn, *xs):
        return g.node(op if np.dtype(_out(eqn).dtype) == np.bool_ else bitwise, list(xs))

    return emit


def _integer_pow(g, eqn, x):
    return g.node("Pow", [x, g.const(eqn.params["y"], _out(eqn).dtype)])


def _select_n(g, eqn, pred, *cases):
    if len(cases) == 1:
        return g.node("Identity", [cases[0]])
    if len(cases) != 2:
        _fail(eqn, f"select_n with {len(cases)} cases has no ONNX mapping; use two cases")
    pred = _cast(g, pred, eqn.invars[0].aval.dtype, np.bool_)
    return g.node("Where", [pred, cases[1], cases[0]])


def _clamp(g, eqn, lo, x, hi):
    return g.node("Min", [g.node("Max", [x, lo]), hi])


def _convert(g, eqn, x):
    return _cast(g, x, eqn.invars[0].aval.dtype, eqn.params["new_dtype"])


def _reshape_eqn(g, eqn, x, *dynamic):
    if dynamic or eqn.params.get("dimensions") is not None:
        _fail(eqn, "reshape with dynamic shapes or a dimensions permutation")
    return g.node("Reshape", [x, g.const(np.asarray(_out(eqn).shape, np.int64))])


def _squeeze(g, eqn, x):
    return g.node("Reshape", [x, g.const(np.asarray(_out(eqn).shape, np.int64))])


def _broadcast_in_dim(g, eqn, x, *dynamic):
    if dynamic:
        _fail(eqn, "broadcast_in_dim with dynamic shapes")
    shape, src = _out(eqn).shape, _in_shape(eqn)
    inter = [1] * len(shape)
    for i, d in enumerate(eqn.params["broadcast_dimensions"]):
        inter[d] = src[i]
    y = _reshape(g, x, src, inter)
    if tuple(inter) == tuple(shape):
        return y if y != x else g.node("Identity", [x])
    return g.node("Expand", [y, g.const(np.asarray(shape, np.int64))])


def _slice(g, eqn, x):
    p = eqn.params
    n = len(p["start_indices"])
    steps = p["strides"] or (1,) * n
    return g.node("Slice", [
        x,
        g.const(np.asarray(p["start_indices"], np.int64)),
        g.const(np.asarray(p["limit_indices"], np.int64)),
        g.const(np.arange(n, dtype=np.int64)),
        g.const(np.asarray(steps, np.int64)),
    ])


def _pad(g, eqn, x, value):
    config = eqn.params["padding_config"]
    if any(interior for _, _, interior in config):
        _fail(eqn, "interior padding has no ONNX mapping")
    shape = _in_shape(eqn)
    pads = [max(lo, 0) for lo, _, _ in config] + [max(hi, 0) for _, hi, _ in config]
    if any(lo < 0 or hi < 0 for lo, hi, _ in config):
        starts = [max(-lo, 0) for lo, _, _ in config]
        ends = [n - max(-hi, 0) for n, (_, hi, _) in zip(shape, config)]
        x = g.node("Slice", [x, g.const(np.asarray(starts, np.int64)), g.const(np.asarray(ends, np.int64))])
    elif not any(pads):
        return g.node("Identity", [x])
    return g.node("Pad", [x, g.const(np.asarray(pads, np.int64)), value], mode="constant") if any(pads) else x


def _reduce(op: str):
    def emit(g, eqn, x):
        axes = g.const(np.asarray(eqn.params["axes"], np.int64))
        return g.node(op, [x, axes], keepdims=0)

    return emit


def _arg(op: str):
    def emit(g, eqn, x):
        (axis,) = eqn.params["axes"]
        y = g.node(op, [x], axis=int(axis), keepdims=0)
        return _cast(g, y, np.int64, eqn.params["index_dtype"])

    return emit


def _split(g, eqn, x):
    sizes = g.const(np.asarray(eqn.params["sizes"], np.int64))
    outs = g.node("Split", [x, sizes], n_out=len(eqn.outvars), axis=int(eqn.params["axis"]))
    return outs if isinstance(outs, list) else [outs]


def dot(g, eqn, lhs: str, rhs: str) -> str:
    """`dot_general` as transposes, reshapes and one batched `MatMul`."""
    geo = DotGeometry.of(eqn)
    ls, rs = _in_shape(eqn, 0), _in_shape(eqn, 1)
    lb, lc, lf, rb, rc, rf = geo.lhs_batch, geo.lhs_contract, geo.lhs_free, geo.rhs_batch, geo.rhs_contract, geo.rhs_free
    batch, (m, k, n) = [ls[d] for d in lb], (geo.m, geo.k, geo.n)
    dtype = _out(eqn).dtype
    x = _transpose(g, _cast(g, lhs, eqn.invars[0].aval.dtype, dtype), [*lb, *lf, *lc])
    x = _reshape(g, x, [*batch, *(ls[d] for d in lf), *(ls[d] for d in lc)], [*batch, m, k])
    w = _transpose(g, _cast(g, rhs, eqn.invars[1].aval.dtype, dtype), [*rb, *rc, *rf])
    w = _reshape(g, w, [*batch, *(rs[d] for d in rc), *(rs[d] for d in rf)], [*batch, k, n])
    y = g.node("MatMul", [x, w])
    return _reshape(g, y, [*batch, m, n], _out(eqn).shape)


def conv(g, eqn, x: str, w: str, bias: str | None = None) -> str:
    """`conv_general_dilated` as an ONNX `Conv` in NCHW / OIHW, transposed back."""
    geo = ConvGeometry.of(eqn)
    if any(d != 1 for d in geo.lhs_dilation) or geo.batch_groups != 1:
        _fail(eqn, "input dilation (transposed conv) and batch groups have no ONNX Conv mapping")
    if any(lo < 0 or hi < 0 for lo, hi in geo.padding):
        _fail(eqn, "negative conv padding has no ONNX Conv mapping")
    dtype = _out(eqn).dtype
    x = _transpose(g, _cast(g, x, eqn.invars[0].aval.dtype, dtype), geo.lhs_spec)
    w = _transpose(g, _cast(g, w, eqn.invars[1].aval.dtype, dtype), geo.rhs_spec)
    y = g.node(
        "Conv", [x, w] + ([bias] if bias else []),
        strides=list(geo.stride),
        pads=[lo for lo, _ in geo.padding] + [hi for _, hi in geo.padding],
        dilations=list(geo.dilation),
        group=int(geo.groups),
        kernel_shape=list(geo.window),
    )
    return _transpose(g, y, _inverse(geo.out_spec))


def _pool(op: str):
    def emit(g, eqn, x):
        p = eqn.params
        if any(d != 1 for d in p["base_dilation"]):
            _fail(eqn, "base dilation has no ONNX pooling mapping")
        shape, out_shape = _in_shape(eqn), _out(eqn).shape
        window, strides, pads, dil = p["window_dimensions"], p["window_strides"], p["padding"], p["window_dilation"]
        pooled = [i for i in range(len(shape)) if (window[i], strides[i], tuple(pads[i]), dil[i]) != (1, 1, (0, 0), 1)]
        if not pooled:
            return g.node("Identity", [x])
        if op == "sum" and any(dil[i] != 1 for i in pooled):
            _fail(eqn, "window dilation of a sum pooling has no ONNX mapping")
        kept = [i for i in range(len(shape)) if i not in pooled]
        perm = kept + pooled
        kept_shape = [shape[i] for i in kept]
        nchw = [1, math.prod(kept_shape)] if len(kept) != 2 else kept_shape
        y = _reshape(g, _transpose(g, x, perm), [shape[i] for i in perm], nchw + [shape[i] for i in pooled])
        attrs = dict(
            kernel_shape=[window[i] for i in pooled],
            strides=[strides[i] for i in pooled],
            pads=[pads[i][0] for i in pooled] + [pads[i][1] for i in pooled],
        )
        if op == "max":
            y = g.node("MaxPool", [y], dilations=[dil[i] for i in pooled], **attrs)
        else:
            y = g.node("AveragePool", [y], count_include_pad=1, **attrs)
            size = math.prod(window[i] for i in pooled)
            y = g.node("Mul", [y, g.const(size, _out(eqn).dtype)])
        pooled_out = [out_shape[i] for i in pooled]
        y = _reshape(g, y, nchw + pooled_out, kept_shape + pooled_out)
        return _transpose(g, y, _inverse(perm))

    return emit


def activation(g, y: str, act: tuple, dtype) -> str:
    """The ONNX nodes of a `jtile._fused` activation tuple."""
    if not act:
        return y
    kind, *args = act
    if kind == "relu":
        return g.node("Relu", [y])
    if kind == "clip":
        return g.node("Clip", [y, g.const(args[0], dtype), g.const(args[1], dtype)])
    if kind == "leaky_relu":
        return g.node("LeakyRelu", [y], alpha=float(args[0]))
    if kind in ("sigmoid", "silu"):
        gate = g.node("Sigmoid", [y])
    elif kind == "hard_swish" and np.float32(args[0]) == np.float32(1 / 6) and np.float32(args[1]) == 0.5:
        return g.node("HardSwish", [y])
    elif kind in ("hard_sigmoid", "hard_swish"):
        gate = g.node("HardSigmoid", [y], alpha=float(args[0]), beta=float(args[1]))
    elif kind == "gelu":  # opset 18 has no Gelu: x * (1 + erf(x / sqrt 2)) / 2
        erf = g.node("Erf", [g.node("Mul", [y, g.const(np.sqrt(0.5), dtype)])])
        gate = g.node("Mul", [g.node("Add", [erf, g.const(1, dtype)]), g.const(0.5, dtype)])
    else:  # gelu_tanh: (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2
        cube = g.node("Mul", [g.node("Mul", [y, y]), y])
        inner = g.node("Add", [y, g.node("Mul", [cube, g.const(0.044715, dtype)])])
        tanh = g.node("Tanh", [g.node("Mul", [inner, g.const(np.sqrt(2 / np.pi), dtype)])])
        gate = g.node("Mul", [g.node("Add", [tanh, g.const(1, dtype)]), g.const(0.5, dtype)])
    return gate if kind in ("sigmoid", "hard_sigmoid") else g.node("Mul", [y, gate])


def _conv_bias_act(g, eqn, x, w, bias, *residual):
    """One `Conv` with its bias input when the bias is per output channel, then
    the residual `Add` and the activation."""
    channel = eqn.params["dimension_numbers"].out_spec[1]
    shape = _in_shape(eqn, 2)
    if len(shape) == len(_out(eqn).shape) and all(n == 1 for i, n in enumerate(shape) if i != channel):
        y = conv(g, eqn, x, w, _reshape(g, bias, shape, [shape[channel]]))
    else:
        y = g.node("Add", [conv(g, eqn, x, w), bias])
    if residual:
        y = g.node("Add", [y, residual[0]])
    return activation(g, y, eqn.params["activation"], _out(eqn).dtype)


def _dense(g, eqn, lhs, rhs, bias, *residual):
    y = g.node("Add", [dot(g, eqn, lhs, rhs), bias])
    if residual:
        y = g.node("Add", [y, residual[0]])
    return activation(g, y, eqn.params["activation"], _out(eqn).dtype)


def _gather(g, eqn, x, indices):
    """The gather `jnp.take(x, indices, axis=a)` writes, as an ONNX `Gather`; other gathers raise."""
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    shape, index_shape = _in_shape(eqn), _in_shape(eqn, 1)
    axes = tuple(dn.start_index_map)
    rank, batch = len(shape), len(index_shape) - 1
    if len(axes) == 1 and index_shape[-1:] == (1,):
        a = axes[0]
        offsets = tuple(range(a)) + tuple(range(a + batch, rank - 1 + batch))
        if (tuple(dn.collapsed_slice_dims) == axes and not dn.operand_batching_dims and tuple(dn.offset_dims) == offsets
                and all(n == (1 if d == a else shape[d]) for d, n in enumerate(sizes))):
            return g.node("Gather", [x, _reshape(g, indices, index_shape, index_shape[:-1])], axis=a)
    _fail(eqn, "only the gather of jnp.take (one axis, whole slices) has an ONNX mapping")


def _resize(g, eqn, x):
    """jtile's fused `resize` as one ONNX `Resize`: by sizes when the scales are
    exactly sizes / input, else by the (float32) scales."""
    p = eqn.params
    shape = _in_shape(eqn)
    exact = all(s == o / i for s, o, i in zip(p["scales"], p["sizes"], shape))
    roi = g.const(np.asarray([lo for lo, _ in p["roi"]] + [hi for _, hi in p["roi"]], np.float32)) \
        if p["coords"] == "tf_crop_and_resize" else ""
    operands = [x, roi, "", g.const(np.asarray(p["sizes"], np.int64))] if exact else \
        [x, roi, g.const(np.asarray(p["scales"], np.float32))]
    return g.node("Resize", operands, mode=p["mode"], nearest_mode=p["nearest_mode"],
                  coordinate_transformation_mode=p["coords"], cubic_coeff_a=p["cubic_a"],
                  exclude_outside=int(p["exclude_outside"]), extrapolation_value=p["extrapolation"],
                  antialias=int(p["antialias"]))


def _trailing_axes(eqn) -> int:
    """The first of a row normalisation's axes, which must be the trailing ones."""
    axes, rank = tuple(eqn.params["axes"]), len(_in_shape(eqn))
    if not axes or axes != tuple(range(rank - len(axes), rank)):
        _fail(eqn, f"ONNX normalises trailing axes; axes {axes} of a rank-{rank} input are not")
    return axes[0]


def _softmax(g, eqn, x):
    """jtile's fused `softmax` as one ONNX Softmax (over several trailing axes:
    on the input flattened to 2-D there, then reshaped back)."""
    first, shape = _trailing_axes(eqn), _in_shape(eqn)
    if first == len(shape) - 1:
        return g.node("Softmax", [x], axis=first)
    flat = (int(np.prod(shape[:first])), int(np.prod(shape[first:])))
    return _reshape(g, g.node("Softmax", [_reshape(g, x, shape, flat)], axis=1), flat, shape)


def _layer_norm(g, eqn, x, scale, bias):
    return g.node("LayerNormalization", [x, scale, bias], axis=_trailing_axes(eqn), epsilon=eqn.params["epsilon"])


_EMITTERS = {  # registered below, one registry entry each
    **{p: _binary(op) for p, op in {
        "add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min",
        "pow": "Pow", "eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater",
        "ge": "GreaterOrEqual",
    }.items()},
    **{p: _unary(op) for p, op in {
        "neg": "Neg", "exp": "Exp", "log": "Log", "tanh": "Tanh", "logistic": "Sigmoid",
        "sqrt": "Sqrt", "erf": "Erf", "abs": "Abs", "sign": "Sign", "floor": "Floor",
        "ceil": "Ceil", "sin": "Sin", "cos": "Cos", "copy": "Identity", "copy_p": "Identity",
        "stop_gradient": "Identity",
    }.items()},
    "ne": lambda g, eqn, a, b: g.node("Not", [g.node("Equal", [a, b])]),
    "rsqrt": lambda g, eqn, x: g.node("Reciprocal", [g.node("Sqrt", [x])]),
    "erfc": lambda g, eqn, x: g.node("Sub", [g.const(1, _out(eqn).dtype), g.node("Erf", [x])]),
    "log1p": lambda g, eqn, x: g.node("Log", [g.node("Add", [x, g.const(1, _out(eqn).dtype)])]),
    "expm1": lambda g, eqn, x: g.node("Sub", [g.node("Exp", [x]), g.const(1, _out(eqn).dtype)]),
    "square": lambda g, eqn, x: g.node("Mul", [x, x]),
    "rem": lambda g, eqn, a, b: g.node("Mod", [a, b], fmod=1),
    "not": _logical("Not", "BitwiseNot"),
    "and": _logical("And", "BitwiseAnd"),
    "or": _logical("Or", "BitwiseOr"),
    "xor": _logical("Xor", "BitwiseXor"),
    "optimization_barrier": lambda g, eqn, *xs: [g.node("Identity", [x]) for x in xs],
    "integer_pow": _integer_pow,
    "select_n": _select_n,
    "clamp": _clamp,
    "convert_element_type": _convert,
    "reshape": _reshape_eqn,
    "squeeze": _squeeze,
    "transpose": lambda g, eqn, x: g.node("Transpose", [x], perm=list(eqn.params["permutation"])),
    "broadcast_in_dim": _broadcast_in_dim,
    "concatenate": lambda g, eqn, *xs: g.node("Concat", list(xs), axis=int(eqn.params["dimension"])),
    "slice": _slice,
    "pad": _pad,
    "split": _split,
    "reduce_sum": _reduce("ReduceSum"),
    "reduce_max": _reduce("ReduceMax"),
    "reduce_min": _reduce("ReduceMin"),
    "reduce_prod": _reduce("ReduceProd"),
    "argmax": _arg("ArgMax"),
    "argmin": _arg("ArgMin"),
    "dot_general": dot,
    "conv_general_dilated": conv,
    "reduce_window_max": _pool("max"),
    "reduce_window_sum": _pool("sum"),
    "conv_bias_act": _conv_bias_act,
    "dense": _dense,
    "resize": _resize,
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "gather": _gather,
}

for _name, _emitter in _EMITTERS.items():
    register(_name, onnx=_emitter)
