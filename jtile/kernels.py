"""jtile's C kernels, called through `jax.ffi`, and the jnp reference of each.

At import this module loads `libjtile_kernels.so` and registers every FFI
target listed in `_TARGETS` for the CPU. It looks next to this file first (a
regular install, or a source checkout after `kernels/dev_build.sh`), then in
the installed `jtile` distribution (an editable install, or a script run from
a clone's root after `pip install .`); `JTILE_KERNELS_LIB=/path/lib.so` loads
that build only. Importing never fails: if the library is missing, calling a
kernel raises `UnsupportedError` saying how to build it, and `"auto"`
selectors warn once (`KernelsUnavailableWarning`) and keep XLA. A library
found in the installed distribution was built from that install's sources: if
the checkout being run has newer kernels, rebuild. Run from a checkout, the
import warns (`StaleKernelsWarning`) when the library it loads, unless
`JTILE_KERNELS_LIB` chose it, is older than a file of the checkout's
`kernels/` sources; a missing handler symbol is reported as a stale build.

Every kernel computes in float32 (any other dtype raises `UnsupportedError`;
cast, or leave that layer to XLA), works under `jax.jit`, and differentiates
through its jnp reference (`jax.custom_vjp`), so `jax.grad` gives the
reference's gradients. Layouts: NCHW activations, OIHW conv weights
`(O, I/groups, KH, KW)`, dense weights `(K, N)` for `x @ w`, or `(N, K)` with
`transpose_w=True`; `matmul` takes any `dot_general` of two float32 arrays
and reads each operand in place when its batch, free and contracting axes are
contiguous runs (a head split or transpose feeding attention's products is
not copied). Threads: the caller's and one helper per further thread of XLA's
intra-op pool (`jtile-crew-N`, kernels/crew.cc), which polls for the next
kernel call for 2 ms after each and then sleeps.

Numerics, measured against a float64 reference (unit-normal inputs, weights
scaled by 1/sqrt(fan-in); error = max |y - y64| / max |y64|;
tests/test_kernels_numerics.py holds every kernel to `TOLERANCE`):

| layer | XLA | direct | smm | grouped | winograd | depthwise / dense / pool |
|---|---|---|---|---|---|---|
| 3x3 64->64 @56 | 8.1e-7 | 8.1e-7 | 5.0e-7 | 8.1e-7 | 6.5e-6 | |
| 3x3 256->256 @14 | 6.6e-7 | 2.1e-6 | 3.7e-7 | 2.1e-6 | 9.5e-6 | |
| 3x3 s2 128->256 @28 | 5.1e-7 | 9.7e-7 | 3.2e-7 | 9.7e-7 | | |
| 3x3 1000->1001 @14 | 4.7e-7 | 4.0e-6 | 3.5e-7 | 4.0e-6 | 1.9e-5 | |
| 1x1 144->24 @56 | 1.4e-7 | 4.1e-7 | 4.1e-7 | 4.1e-7 | | |
| 3x3 512->512, 32 groups @14 | 1.8e-7 | 4.5e-7 | 4.5e-7 | 4.5e-7 | | |
| depthwise 3x3 144 @56 | 1.5e-7 | 1.1e-7 | 1.1e-7 | 1.1e-7 | | 1.1e-7 |
| depthwise 5x5 672 @14 | 2.6e-7 | 2.6e-7 | 2.6e-7 | 2.6e-7 | | 2.6e-7 |
| dense 512->1000, batch 1 | 5.0e-7 | | | | | 1.5e-7 |
| dense 4096->1000 (N, K), batch 1 | 2.1e-6 | | | | | 3.9e-7 |
| dense 512->1000, batch 32 | 4.7e-7 | | | | | 4.7e-7 |
| avg pool 3x3 s2 @112 | 2.0e-7 | | | | | 2.0e-7 |
| global avg pool @112 | 7.7e-8 | | | | | 4.3e-7 |
| 1x1 144->24 @56 + sigmoid | 4.5e-7 | | 5.8e-7 | | | |
| 1x1 144->24 @56 + silu | 1.7e-7 | | 6.2e-7 | | | |
| 1x1 144->24 @56 + hard_sigmoid | 3.4e-7 | | 6.7e-7 | | | |
| 1x1 144->24 @56 + hard_swish | 1.9e-7 | | 5.4e-7 | | | |
| 1x1 144->24 @56 + gelu | 1.9e-7 | | 5.4e-7 | | | |
| 1x1 144->24 @56 + gelu_tanh | 1.9e-7 | | 5.4e-7 | | | |
| depthwise 3x3 144 @56 + sigmoid | 2.6e-7 | | | | | 2.6e-7 |
| depthwise 3x3 144 @56 + silu | 1.3e-7 | | | | | 1.2e-7 |
| depthwise 3x3 144 @56 + hard_sigmoid | 2.3e-7 | | | | | 1.9e-7 |
| depthwise 3x3 144 @56 + hard_swish / gelu / gelu_tanh | 9.5e-8 | | | | | 1.1e-7 |

Activation rows: weights scaled to 3/sqrt(fan-in) so that pre-activations
reach the saturated regions; hard ones with alpha 1/6, beta 0.5; XLA is its
conv followed by `jax.nn`'s activation. Sigmoid, SiLU and GELU-tanh use a
vectorised exp (Cephes' range reduction and degree-6 polynomial, ~1 ulp,
flushed to 0 below -87.3), GELU's erf Abramowitz & Stegun 7.1.26 (absolute
error < 1.5e-7, so up to ~2e-4 relative far in GELU's negative tail, where
the output is tiny); the scalar tail of each kernel runs the same vector code,
so every element gets the same bits whichever path computes it.

Winograd's transforms scale values by up to ~100, so its error is relative to
the output's magnitude, not to each element: ~50x XLA's at 1000 channels.
`direct` and `grouped` sum each output's taps in one long chain (their error
grows with the fan-in). NaN and Inf come out where XLA's op puts them, with the same signs,
in every kernel (Winograd recomputes the tiles they reach directly). Every
kernel gives the same bits for any thread count: work is split over
independent outputs, and the batch-1 dense path splits its sum by shape only.
Scratch memory is taken per call and released when it returns; at most 32 MB
of released blocks are kept for reuse (kernels/common.h).

!!! warning

    Forward-mode differentiation (`jax.jvp`) is not supported, and `jax.vmap`
    over `conv2d`, `dense` or `matmul` runs the kernel once per batch element.
"""

import contextlib
import ctypes
import dataclasses
import functools
import importlib.metadata
import math
import operator
import os
import pathlib
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _call_times, _registry
from ._call_times import CallTimes, KernelCall
from ._errors import ConfigError, KernelsUnavailableWarning, StaleKernelsWarning, UnsupportedError
from ._fused import activate, describe_as, element_macs
from ._interpreter import eager_if_known, is_known, on_host, shared, to_device
from ._regions import SlidingWindow
from ._views import Strided

Pair = tuple[int, int]
Padding = tuple[Pair, Pair]

LIBRARY_ENV = "JTILE_KERNELS_LIB"
_LIBRARY_NAME = "libjtile_kernels.so"
_BUILD_HINT = (
    "build them with `pip install .` or `pip install -e .` (or `kernels/dev_build.sh` in a "
    "source checkout), or point JTILE_KERNELS_LIB at a built libjtile_kernels.so"
)

# FFI target name -> handler symbol exported by the library.
_TARGETS: dict[str, str] = {
    "jtile_conv_direct": "JtileConvDirect",
    "jtile_conv_smm": "JtileConvSmm",
    "jtile_dense": "JtileDense",
    "jtile_matmul": "JtileMatmul",
    "jtile_max_pool2d": "JtileMaxPool2d",
    "jtile_avg_pool2d": "JtileAvgPool2d",
    "jtile_global_avg_pool2d": "JtileGlobalAvgPool2d",
    "jtile_resize2d": "JtileResize2d",
    "jtile_softmax": "JtileSoftmax",
    "jtile_layer_norm": "JtileLayerNorm",
    "jtile_gather_planes": "JtileGatherPlanes",
}

# ----------------------------------------------------------------- epilogues

# Activation name -> code understood by the kernels (kernels/common.h).
_ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2, "clip": 2, "leaky_relu": 3, "sigmoid": 4, "silu": 5,
                "hard_sigmoid": 6, "hard_swish": 7, "gelu": 8, "gelu_tanh": 9}
_HARD = ("hard_sigmoid", "hard_swish")  # clip(alpha * y + beta, 0, 1), beta travels as clip_lo


def _clip_bounds(activation: str | None, clip: Sequence[float]) -> tuple[float, float]:
    return (0.0, 6.0) if activation == "relu6" else (float(clip[0]), float(clip[1]))


def _check_activation(where: str, activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        names = ", ".join(repr(a) for a in _ACTIVATIONS)
        raise ConfigError(f"{where}: unknown activation {activation!r}; valid ones are {names}")


def _epilogue_attrs(activation: str | None, alpha: float, beta: float, clip: Sequence[float]) -> dict:
    lo, hi = (beta, 1.0) if activation in _HARD else _clip_bounds(activation, clip)
    return dict(
        activation=np.int64(_ACTIVATIONS[activation]),
        alpha=np.float32(alpha),
        clip_lo=np.float32(lo),
        clip_hi=np.float32(hi),
    )


def _activation_tuple(activation: str | None, alpha: float = 0.0, beta: float = 0.0,
                     clip: Sequence[float] = (0.0, 6.0)) -> tuple:
    """A named activation and its parameters as a `jtile._fused` activation tuple."""
    _check_activation("activation", activation)
    if activation is None:
        return ()
    if activation in ("relu6", "clip"):
        return ("clip", *_clip_bounds(activation, clip))
    if activation == "leaky_relu":
        return ("leaky_relu", float(alpha))
    if activation in _HARD:
        return (activation, float(alpha), float(beta))
    return (activation,)


def activation_reference(y: jax.Array, activation: str | None, alpha: float = 0.0,
                         clip: Sequence[float] = (0.0, 6.0), beta: float = 0.0) -> jax.Array:
    """The jnp meaning of a fused activation: None, relu, relu6, clip(lo, hi),
    leaky_relu(alpha), sigmoid, silu, hard_sigmoid / hard_swish (`clip(alpha * y
    + beta, 0, 1)`, times y for hard_swish), gelu (erf), gelu_tanh."""
    return activate(y, _activation_tuple(activation, alpha, beta, clip))


# ------------------------------------------------------------------ loading


def library_candidates() -> list[str]:
    """Where the library is looked for, in order: `$JTILE_KERNELS_LIB` alone if
    set, else next to this module, then inside the installed `jtile` distribution."""
    if os.environ.get(LIBRARY_ENV):
        return [os.environ[LIBRARY_ENV]]
    paths = [os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIBRARY_NAME)]
    try:
        installed = importlib.metadata.distribution("jtile").locate_file(f"jtile/{_LIBRARY_NAME}")
    except importlib.metadata.PackageNotFoundError:
        return paths
    if os.path.abspath(installed) not in paths:
        paths.append(os.path.abspath(installed))
    return paths


def _open_library(paths: list[str]) -> tuple[str, ctypes.CDLL | None, str]:
    """The first of `paths` that loads, or `(paths[0], None, why none did)`."""
    errors = []
    for path in paths:
        try:
            return path, ctypes.cdll.LoadLibrary(path), ""
        except OSError as error:
            errors.append(str(error))
    return paths[0], None, "; ".join(errors)


def _newer_sources(library: str, checkout: str) -> list[str]:
    """The kernel sources (`*.cc`, `*.h`, `CMakeLists.txt` in `checkout`'s
    `kernels/` directory) modified after `library` was, newest first; empty if
    `checkout` has no such directory (an installed package)."""
    sources = pathlib.Path(checkout, "kernels")
    if not sources.is_dir():
        return []
    built = os.path.getmtime(library)
    modified = {str(f): f.stat().st_mtime for f in sources.iterdir()
                if f.suffix in (".cc", ".h") or f.name == "CMakeLists.txt"}
    return sorted((f for f, mtime in modified.items() if mtime > built), key=modified.get, reverse=True)


def _warn_if_stale(library: str) -> None:
    """Warn with `StaleKernelsWarning` if the checkout this module runs from has
    kernel sources newer than `library`, unless `$JTILE_KERNELS_LIB` chose it."""
    if os.environ.get(LIBRARY_ENV):
        return
    newer = _newer_sources(library, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if newer:
        more = f" and {len(newer) - 1} more" if len(newer) > 1 else ""
        warnings.warn(
            f"the jtile kernels loaded from {library} are older than {newer[0]}{more}, so they may "
            f"not be what the sources say; rebuild them (`pip install -e .`, or "
            f"`kernels/dev_build.sh` for the build next to jtile/kernels.py, which is looked for "
            f"first), or delete a development build you no longer use",
            StaleKernelsWarning,
            stacklevel=2,
        )


def _load_library() -> tuple[str, dict[str, str]]:
    """Load the library and register its targets; return its path and
    `{target: why it is unavailable}` for targets that could not be registered."""
    path, library, error = _open_library(library_candidates())
    if library is None:
        reason = f"the jtile kernels are not built ({error}); {_BUILD_HINT}"
        return path, dict.fromkeys(_TARGETS, reason)
    _warn_if_stale(path)
    missing = {}
    for target, symbol in _TARGETS.items():
        handler = getattr(library, symbol, None)
        if handler is None:
            missing[target] = f"{path} has no symbol {symbol} (stale build?); {_BUILD_HINT}"
        else:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return path, missing


def kernel_unavailable(target: str) -> str | None:
    """Why the FFI `target` cannot run (library not built, symbol missing), or None."""
    return _UNAVAILABLE.get(target)


_warned = False


def warn_if_unavailable(where: str) -> bool:
    """Warn once per process, with `KernelsUnavailableWarning`, if any kernel
    cannot run: `where` (an `"auto"` or `"measured"` selector) then keeps XLA
    for it. Returns whether any kernel cannot run."""
    global _warned
    if _UNAVAILABLE and not _warned:
        _warned = True
        reason = next(iter(_UNAVAILABLE.values()))
        warnings.warn(
            f"{where}: 'auto' and 'measured' keep XLA for layers whose kernel cannot run, so this "
            f"function runs slower than it could: {reason}",
            KernelsUnavailableWarning,
            stacklevel=3,
        )
    return bool(_UNAVAILABLE)


def call_times() -> contextlib.AbstractContextManager[CallTimes]:
    """Record how long each kernel call made inside the `with` block takes, as
    the compiled function runs it (the time inside the kernel, exact for calls
    of a few microseconds, unlike a profiler's trace):

    ```python
    with jtile.kernels.call_times() as times:
        for _ in range(20):
            f(x).block_until_ready()
    print(times.table(runs=20))  # best and median per kernel call of f
    ```

    `times.calls` holds every `KernelCall` in order. Raises `UnsupportedError`
    if the kernels are not built or were built before call timing existed,
    `ConfigError` if another block is recording.
    """
    reason = next(iter(_UNAVAILABLE.values()), None)
    library = ctypes.cdll.LoadLibrary(LIBRARY_PATH) if reason is None else None
    if library is not None and not hasattr(library, "JtileCallTimesEnable"):
        reason = f"{LIBRARY_PATH} has no call timing (stale build?); {_BUILD_HINT}"
    if reason is not None:
        raise UnsupportedError(f"call_times: {reason}")
    return _call_times.record(library, {symbol: target for target, symbol in _TARGETS.items()})


def _call(target: str, out: jax.ShapeDtypeStruct, *arrays, vmap_method: str, aliases=None, **attrs):
    reason = kernel_unavailable(target)
    if reason is not None:
        raise UnsupportedError(reason)
    return jax.ffi.ffi_call(target, out, vmap_method=vmap_method, input_output_aliases=aliases)(*arrays, **attrs)


def _with_reference_vjp(kernel: Callable, reference: Callable, derived: int = 0) -> Callable:
    """`kernel` on the forward pass, gradients of `reference` on the backward pass.

    The last `derived` arrays are forms of the others prepared for the kernel
    (packed weights): `reference` does not take them and they get zero cotangents.
    """

    def first(arrays):
        return arrays[: len(arrays) - derived]

    @jax.custom_vjp
    def call(*arrays):
        return kernel(*arrays)

    def forward(*arrays):
        return kernel(*arrays), arrays

    def backward(arrays, cotangent):
        grads = jax.vjp(reference, *first(arrays))[1](cotangent)
        return (*grads, *(jnp.zeros_like(a) for a in arrays[len(arrays) - derived:]))

    call.defvjp(forward, backward)
    return call


def _kernel_bias(b: jax.Array | None) -> jax.Array | np.ndarray:
    """A bias as the kernels take it: `b`, or one float where `b` is missing or
    known to repeat one value (bit for bit). XLA turns a constant of equal
    floats into a broadcast op run before the kernels on every call: 24 of
    them cost MobileNetV3 90-140 us of thread wake-ups a run."""
    if b is None:
        return np.zeros(1, np.float32)
    if is_known(b):
        host = np.ascontiguousarray(b, np.float32).reshape(-1)
        if host.size > 1 and (host.view(np.uint32) == host.view(np.uint32)[0]).all():
            return host[:1].copy()
    return b


def _require_float32(where: str, **arrays) -> None:
    for name, a in arrays.items():
        if a is not None and jnp.result_type(a) != jnp.float32:
            raise UnsupportedError(
                f"{where}: the kernels compute in float32 only, {name} is {jnp.result_type(a)}; "
                "cast with .astype(jnp.float32) or keep this layer on XLA"
            )


def _require_rank(where: str, name: str, a, rank: int) -> None:
    if jnp.ndim(a) != rank:
        raise ConfigError(f"{where}: {name} must be {rank}-D, got shape {jnp.shape(a)}")


def _padding(padding) -> Padding:
    (t, b), (l, r) = padding
    return (int(t), int(b)), (int(l), int(r))


# ------------------------------------------------------------------- conv2d

# Bounds on max |y - y64| / max |y64| for unit-normal data (see the table
# above): what a caller may rely on, per algorithm ("dense", "pool" for those kernels).
TOLERANCE = {"direct": 1e-5, "grouped": 1e-5, "smm": 2e-6, "winograd": 5e-5, "depthwise": 1e-6, "dense": 2e-6, "pool": 2e-6}


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """One 2-D convolution: NCHW input shape, OIHW weight, explicit padding, the
    layouts x and y are stored in ("NCHW", or "NCHWc": see `to_nchwc`), and
    whether it applies a prologue to x (see `conv2d`'s `prologue`)."""

    x_shape: tuple[int, int, int, int]
    w_shape: tuple[int, int, int, int]
    stride: Pair
    padding: Padding
    dilation: Pair
    groups: int
    dtype: np.dtype
    layouts: tuple[str, str] = ("NCHW", "NCHW")
    prologue: bool = False

    @property
    def nchwc(self) -> bool:
        """Whether x or y is channel-blocked."""
        return "NCHWc" in self.layouts

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        n, o = self.x_shape[0], self.w_shape[0]
        oh, ow = (
            SlidingWindow(size, k, s, lo, hi, d).out_size
            for size, k, s, (lo, hi), d in zip(
                self.x_shape[2:], self.w_shape[2:], self.stride, self.padding, self.dilation
            )
        )
        return n, o, oh, ow

    def problem(self, crops: bool = False) -> str | None:
        """Why no kernel can run this convolution, or None; with `crops`, a
        kernel that takes negative padding (see `ConvAlgorithm.crops`)."""
        if np.dtype(self.dtype) != np.float32:
            return f"the kernels compute in float32 only, this layer is {np.dtype(self.dtype)}"
        if len(self.x_shape) != 4 or len(self.w_shape) != 4:
            return f"conv2d needs 4-D NCHW input and OIHW weight, got {self.x_shape} and {self.w_shape}"
        if self.groups < 1 or self.x_shape[1] != self.w_shape[1] * self.groups or self.w_shape[0] % self.groups:
            return (
                f"input {self.x_shape} and weight {self.w_shape} do not match groups={self.groups} "
                "(need C == I * groups and O divisible by groups)"
            )
        if min(self.stride + self.dilation) < 1:
            return f"stride {self.stride} and dilation {self.dilation} must be >= 1"
        if min(p for pair in self.padding for p in pair) < 0 and not crops:
            takers = ", ".join(repr(name) for name, kernel in _CONV_ALGORITHMS.items() if kernel.crops)
            return f"negative padding {self.padding} (cropping): only {takers} takes it; crop the input first"
        if min(self.out_shape) < 1:
            return f"the output {self.out_shape} is empty"
        return None


@dataclasses.dataclass(frozen=True)
class ConvAlgorithm:
    """A conv kernel: its FFI target, which layers it can run, and how it wants
    the weight: `prepare(spec, w)` returns the array the kernel takes and any
    extra FFI attributes (by default `w` itself, none)."""

    target: str
    support: Callable[[ConvSpec], str | None]
    prepare: Callable[[ConvSpec, jax.Array], tuple[jax.Array, dict]] = lambda spec, w: (w, {})
    # The handler binds JTILE_CONV_RESIDUAL_BINDING: a residual added before the
    # activation, and a concatenation buffer to write into (`conv2d(into=)`).
    residual: bool = False
    # Why the handler cannot fuse a max pool after this layer's activation
    # (`conv2d(max_pool=)`, the "max_pool" attribute), or None; unset: never.
    max_pool: Callable[[ConvSpec], str | None] | None = None
    # Why the handler cannot apply a per-input-channel prologue to this layer
    # (`conv2d(prologue=)`, the "prologue" buffer), or None; unset: never.
    prologue: Callable[[ConvSpec], str | None] | None = None
    # The handler binds the "x_channels" attribute: it reads the first
    # x_channels channels of an x of one image that may hold more
    # (`conv2d(reads_prefix=True)`).
    reads_prefix: bool = False
    # The handler takes negative padding: it reads a window of x that starts or
    # ends inside it (a crop of x, read in place).
    crops: bool = False
    # Why the handler cannot take this layer's x or y channel-blocked
    # (`conv2d(x_layout=, y_layout=)`, the "x_nchwc" and "y_nchwc"
    # attributes), or None; unset: NCHW only.
    nchwc: Callable[[ConvSpec], str | None] | None = None


# ------------------------------------------- what a kernel call computes
# Each target's registry entry describes a call as the layer it runs, from the
# call's own attributes, so analysis and selectors see a conv2d, not an ffi_call.


def _attribute(eqn, name: str) -> np.ndarray | None:
    value = dict(eqn.params["attributes"] or ()).get(name)
    return None if value is None else np.asarray(getattr(value, "val", value))


def _layer(eqn, kind: str, **fields):
    from ._layers import Layer, layer_fields

    return Layer(kind=kind, **layer_fields(eqn), **fields)


def _describe_conv_call(eqn):
    from ._layers import Layer, layer_fields

    sh, sw, pt, pb, pl, pr, dh, dw, groups = (int(v) for v in _attribute(eqn, "conv"))
    kernel = _attribute(eqn, "kernel")  # [O, KH, KW] when the weight is packed
    o, *window = (int(k) for k in kernel) if kernel is not None else (
        eqn.invars[1].aval.shape[0], *eqn.invars[1].aval.shape[2:])
    fields = layer_fields(eqn)
    x_channels = _attribute(eqn, "x_channels")  # the channels it reads of a larger or channel-blocked x
    if x_channels is None and _attribute(eqn, "x_nchwc"):  # a handler without x_channels: what w reads
        x_channels = groups * eqn.invars[1].aval.shape[1]
    if x_channels is not None:  # NCHW (N, C, H, W) or NCHWc (N, C / W, H, W, W) alike
        n, _, h, w = fields["in_shapes"][0][:4]
        fields["in_shapes"] = ((n, int(x_channels), h, w), *fields["in_shapes"][1:])
    if _attribute(eqn, "y_nchwc"):
        n, _, h, w = fields["out_shape"][:4]
        fields["out_shape"] = (n, o, h, w)
    # out_shape is what the call returns: a concatenation's whole buffer when it writes into one
    return Layer(kind="conv2d", **fields, in_channels=fields["in_shapes"][0][1],
                 out_channels=o, kernel_size=tuple(window), stride=(sh, sw),
                  padding=((pt, pb), (pl, pr)), dilation=(dh, dw), lhs_dilation=(1, 1), groups=groups,
                  batch_groups=1)


def _describe_dense_call(eqn):
    return _layer(eqn, "dense", in_channels=eqn.invars[0].aval.shape[1],
                  out_channels=eqn.outvars[0].aval.shape[1])


def _describe_pool_call(kind: str):
    def describe(eqn):
        x = eqn.invars[0].aval.shape
        wh, ww, sh, sw, pt, pb, pl, pr = (int(v) for v in _attribute(eqn, "pool")) if kind != "global" else (
            *x[2:], 1, 1, 0, 0, 0, 0)
        return _layer(eqn, "maxpool2d" if kind == "max" else "avgpool2d", in_channels=x[1],
                      out_channels=x[1], kernel_size=(wh, ww), stride=(sh, sw),
                      padding=((pt, pb), (pl, pr)), dilation=(1, 1), lhs_dilation=(1, 1))

    return describe


def _call_macs(eqn):
    """MACs of a kernel call: the layer it runs, plus its epilogue (an empty
    residual buffer is none)."""
    from ._macs import epilogue, out_elements

    layer = (_registry.facet(eqn, "describe"))(eqn)
    per_output = math.prod(layer.kernel_size or ())
    # (an NCHWc y's padding lanes are not outputs)
    outputs, pooling = math.prod(layer.out_shape) if _attribute(eqn, "y_nchwc") else out_elements(eqn), Counter()
    if layer.kind == "conv2d":
        per_output *= layer.in_channels // layer.groups
        outputs = outputs // layer.out_shape[1] * layer.out_channels  # its own part of a concatenation
        max_pool = _attribute(eqn, "max_pool")
        if max_pool is not None and max_pool.size:  # a fused max pool: the conv's own outputs, then the pool
            pooling["pool"] = outputs * int(max_pool[0] * max_pool[1])
            outputs = math.prod(_conv_spec_of(layer).out_shape)
    elif layer.kind == "dense":
        per_output = layer.in_channels
    category = {"conv2d": "conv", "dense": "dense"}.get(layer.kind, "pool")
    adds = [v for v in eqn.invars[2:4] if math.prod(v.aval.shape)] if category != "pool" else []
    activation = dict(eqn.params["attributes"] or ()).get("activation")
    return (Counter({category: outputs * per_output}) + pooling
            + _prologue_macs(eqn, 1 if category == "pool" else 5) + epilogue(eqn, len(adds), activation, outputs))


def _prologue_macs(eqn, position: int) -> Counter:
    """A conv's or average pool's prologue (its shift at operand `position`,
    then its scale and bias): a subtract, a multiply and an add per input
    element, and its activation."""
    from ._macs import epilogue

    steps = sum(math.prod(v.aval.shape) > 0 for v in eqn.invars[position:position + 3])
    activation = int(_attribute(eqn, "prologue_activation") or 0) != 0
    if not (steps or activation):
        return Counter()
    x = eqn.invars[0].aval.shape
    channels = _attribute(eqn, "x_channels")  # what it reads of a larger x
    inputs = math.prod(x) // x[1] * (x[1] if channels is None else int(channels))
    return epilogue(eqn, steps, activation, inputs)


def _conv_spec_of(layer) -> ConvSpec:
    w_shape = (layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size)
    return _geometry_spec(layer.in_shapes[0], w_shape, layer.stride, layer.padding, layer.dilation, layer.groups)


_CONV_ALGORITHMS: dict[str, ConvAlgorithm] = {}


def register_conv_algorithm(name: str, target: str, symbol: str,
                            support: Callable[[ConvSpec], str | None], prepare=None,
                            residual: bool = False, max_pool=None, prologue=None,
                            reads_prefix: bool = False,
                            nchwc: Callable[[ConvSpec], str | None] | None = None, crops: bool = False) -> None:
    """Add a conv algorithm whose handler takes (x, prepared weight, bias[,
    residual]) and the "conv" and epilogue attributes of `JTILE_CONV_BINDING`
    (kernels/common.h); an empty residual buffer means none. The optional
    arguments are `ConvAlgorithm`'s fields: what else the handler binds."""
    _TARGETS[target] = symbol
    _registry.register(f"ffi_call:{target}", describe=_describe_conv_call, macs=_call_macs,
                       weights=(1, 2, 5), activations=(0, 3, 4))
    keep = ConvAlgorithm.prepare if prepare is None else prepare
    _CONV_ALGORITHMS[name] = ConvAlgorithm(target, support, keep, residual, max_pool, prologue, reads_prefix, crops,
                                           nchwc)


def conv2d_writes_into(algorithm: str) -> bool:
    """Whether `conv2d(algorithm=...)` takes `into=` (writes into a concatenation's buffer)."""
    return algorithm in _CONV_ALGORITHMS and _CONV_ALGORITHMS[algorithm].residual


def conv2d_crops(algorithm: str) -> bool:
    """Whether `conv2d(algorithm=...)` takes negative padding (reads a crop of x in place)."""
    return algorithm in _CONV_ALGORITHMS and _CONV_ALGORITHMS[algorithm].crops


def conv2d_reads_prefix(algorithm: str) -> bool:
    """Whether `conv2d(algorithm=...)` takes `reads_prefix=True` (reads the first
    channels of a concatenation's buffer)."""
    return algorithm in _CONV_ALGORITHMS and _CONV_ALGORITHMS[algorithm].reads_prefix


def conv2d_max_pool_support(algorithm: str, **geometry) -> str | None:
    """Why `conv2d(algorithm=..., max_pool=...)` cannot fuse a max pool after
    this layer, or None; the layer as `conv2d_support` takes it (`x_shape`,
    `w_shape`, and `stride`, `padding`, `dilation`, `groups` where not 1 or 0)."""
    return _extra_support(algorithm, "max_pool", _geometry_spec(**geometry))


def conv2d_prologue_support(algorithm: str, **geometry) -> str | None:
    """Why `conv2d(algorithm=..., prologue=...)` cannot apply a prologue to
    this layer, or None; the layer as for `conv2d_max_pool_support`."""
    return _extra_support(algorithm, "prologue", _geometry_spec(**geometry))


def conv2d_nchwc_support(algorithm: str, x_layout: str = "NCHW", y_layout: str = "NCHW",
                         **geometry) -> str | None:
    """Why `conv2d(algorithm=..., x_layout=..., y_layout=...)` cannot take
    this layer's x or y in those layouts, or None; the layer as for
    `conv2d_max_pool_support`, x_shape NCHW whatever its layout."""
    spec = dataclasses.replace(_geometry_spec(**geometry), layouts=_layouts(x_layout, y_layout))
    return _extra_support(algorithm, "nchwc", spec) if spec.nchwc else None


def _layouts(x_layout: str, y_layout: str) -> tuple[str, str]:
    for name, layout in (("x_layout", x_layout), ("y_layout", y_layout)):
        if layout not in ("NCHW", "NCHWc"):
            raise ConfigError(f"conv2d: {name} must be 'NCHW' or 'NCHWc', got {layout!r}")
    return x_layout, y_layout


def nchwc_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The NCHWc shape `(N, ceil(C / W), H, W_img, W)` of an NCHW shape, W = `vector_lanes()`."""
    lanes = vector_lanes()
    n, c, h, w = shape
    return n, -(-c // lanes), h, w, lanes


def to_nchwc(x: jax.Array) -> jax.Array:
    """NCHW `x` channel-blocked, as ONNX Runtime's NCHWc: `(N, ceil(C / W),
    H, W_img, W)`, the W = `vector_lanes()` channels of each position in one
    vector, the last block's lanes past C zero."""
    n, blocks, h, w, lanes = nchwc_shape(jnp.shape(x))
    x = jnp.pad(x, ((0, 0), (0, blocks * lanes - jnp.shape(x)[1]), (0, 0), (0, 0)))
    return jnp.reshape(x, (n, blocks, lanes, h, w)).transpose(0, 1, 3, 4, 2)


def from_nchwc(x: jax.Array, channels: int | None = None) -> jax.Array:
    """NCHWc `x` (see `to_nchwc`) back in NCHW, its first `channels` (all the blocks' by default)."""
    lanes = vector_lanes()
    if jnp.ndim(x) != 5 or jnp.shape(x)[4] != lanes:
        raise ConfigError(f"NCHWc: expected (N, ceil(C / {lanes}), H, W, {lanes}), got {jnp.shape(x)}")
    n, blocks, h, w, _ = jnp.shape(x)
    channels = blocks * lanes if channels is None else channels
    if not (blocks - 1) * lanes < channels <= blocks * lanes:
        raise ConfigError(f"NCHWc: {blocks} blocks of {lanes} do not hold {channels} channels")
    return jnp.transpose(x, (0, 1, 4, 2, 3)).reshape(n, blocks * lanes, h, w)[:, :channels]


def _geometry_spec(x_shape: Sequence[int], w_shape: Sequence[int], stride: Pair = (1, 1),
                   padding: Padding = ((0, 0), (0, 0)), dilation: Pair = (1, 1), groups: int = 1,
                   dtype=np.float32) -> ConvSpec:
    return ConvSpec(tuple(x_shape), tuple(w_shape), tuple(stride), _padding(padding), tuple(dilation), int(groups),
                    np.dtype(dtype))


def _extra_support(algorithm: str, extra: str, spec: ConvSpec) -> str | None:
    """Why `algorithm` cannot take `conv2d`'s `extra` argument for `spec`, or None."""
    check = getattr(_CONV_ALGORITHMS.get(algorithm), extra, None)
    if check is None:
        takers = " or ".join(repr(name) for name, a in _CONV_ALGORITHMS.items() if getattr(a, extra) is not None)
        return f"algorithm {algorithm!r} takes no {extra}=; {takers} does"
    return check(spec)


def _any_conv(spec: ConvSpec) -> str | None:
    return None


def conv2d_reference(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
                     stride: Pair = (1, 1), padding: Padding = ((0, 0), (0, 0)),
                     dilation: Pair = (1, 1), groups: int = 1, activation: str | None = None,
                     alpha: float = 0.0, beta: float = 0.0, clip: Sequence[float] = (0.0, 6.0),
                     residual: jax.Array | None = None) -> jax.Array:
    """`conv2d` in `lax`: NCHW x, OIHW w, optional bias (O,) and residual, fused activation."""
    y = lax.conv_general_dilated(
        x, w, tuple(stride), tuple(tuple(p) for p in padding), rhs_dilation=tuple(dilation),
        dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups,
        precision=lax.Precision.HIGHEST,
    )
    if b is not None:
        y = y + b[None, :, None, None]
    if residual is not None:
        y = y + residual
    return activation_reference(y, activation, alpha, clip, beta)


def conv2d_support(algorithm: str, *, x_shape: Sequence[int], w_shape: Sequence[int],
                   stride: Sequence[int], padding, dilation: Sequence[int], groups: int,
                   dtype) -> str | None:
    """None if `algorithm` can run this convolution, else the reason it cannot."""
    if algorithm not in _CONV_ALGORITHMS:
        raise ConfigError(
            f"conv2d: unknown algorithm {algorithm!r}; known ones are {', '.join(_CONV_ALGORITHMS)}"
        )
    spec = _geometry_spec(x_shape, w_shape, stride, padding, dilation, groups, dtype)
    kernel = _CONV_ALGORITHMS[algorithm]
    return spec.problem(kernel.crops) or kernel.support(spec) or kernel_unavailable(kernel.target)


def conv2d(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, algorithm: str = "direct",
           stride: Pair = (1, 1), padding: Padding = ((0, 0), (0, 0)), dilation: Pair = (1, 1),
           groups: int = 1, activation: str | None = None, alpha: float = 0.0, beta: float = 0.0,
           clip: Sequence[float] = (0.0, 6.0), residual: jax.Array | None = None,
           into: tuple[jax.Array | int, int] | None = None,
           max_pool: tuple[Pair, Pair, Padding] | None = None,
           prologue: tuple[jax.Array, jax.Array, jax.Array, str | None] | None = None,
           reads_prefix: bool = False, x_layout: str = "NCHW", y_layout: str = "NCHW") -> jax.Array:
    """2-D convolution by the C kernel `algorithm`, with bias, residual and activation fused.

    `x` NCHW, `w` OIHW `(O, C/groups, KH, KW)`, `b` `(O,)` or None;
    `residual`, of the output's shape, is added before the activation (fused
    in "smm", "grouped" and "winograd", added in jnp after the others); `activation` one
    of None, "relu", "relu6", "clip" (to `clip=(lo, hi)`), "leaky_relu"
    (slope `alpha`), "sigmoid", "silu", "hard_sigmoid" / "hard_swish"
    (`clip(alpha * y + beta, 0, 1)`), "gelu", "gelu_tanh". Raises `UnsupportedError` naming why if the algorithm
    cannot run this layer (see `conv2d_support`).

    `into=(buffer, channel0)` writes the output, of one image, straight into
    channels `[channel0, channel0 + O)` of `buffer` (1, C, OH, OW) and returns
    the whole buffer, the rest as it was: the branches of a concatenation write
    their parts in place. The first branch gives the buffer's channel count C
    instead of a buffer; its other channels are then undefined until the other
    branches write them. "smm", "grouped" and "winograd" only.

    `max_pool=(window, stride, padding)` max-pools the activated output in the
    same call (padding counts as -inf) and returns the pooled output: the image
    stem's conv, ReLU and pool, with the conv's output never written out.
    "grouped" only, without `residual` or `into` (see `conv2d_max_pool_support`).

    `prologue=(shift, scale, bias, activation)`, each `(C,)`, `(1,)` (one
    for all channels) or None (an identity), convolves `activation((x - shift) * scale + bias)` (a folded
    batch norm and its ReLU, or a squeeze-excitation's scale, per input
    channel; activation None, "relu" or "relu6") instead of `x`, applied as
    the kernel packs x: "smm" on 1x1 unpadded convs of one group (a strided
    one on the pixels it reads) only (see `conv2d_prologue_support`).

    `reads_prefix=True` lets `x`, of one image, hold more channels than the
    conv reads: it convolves the first `C = w.shape[1] * groups` of them, so a
    concatenation that later parts extend is read from their shared buffer
    without a copy. "smm" only.

    On "smm", a 1x1 unpadded conv with a stride over an NCHW x copies the
    pixels it uses, `x[:, :, ::sh, ::sw]`, inside its call, then runs at
    stride 1 on the copy (ResNet's downsampling convs, alone: 512->1024 from
    28x28 0.48 against 0.68 ms, 256->512 from 56x56 0.44 against 0.56 with
    XLA's strided slice; inside ResNet-50 that slice then took 19-131 us a
    conv, in the gap between two kernel calls).

    `x_layout="NCHWc"` takes x channel-blocked (see `to_nchwc`) and
    `y_layout="NCHWc"` returns y so (a residual then comes in y's layout), so
    that consecutive kernel layers pass activations on without transposing
    them: "depthwise" with one output channel per input channel, "smm" of one
    group and one image in pixel rows (an NCHWc x on 1x1, stride-1, unpadded
    convs); channels a multiple of the vector lanes (see
    `conv2d_nchwc_support`). Not with `into`, `max_pool`, `prologue` or
    `reads_prefix`.
    """
    _check_activation("conv2d", activation)
    _require_float32("conv2d", x=x, w=w, b=b, residual=residual)
    config = dict(stride=tuple(int(s) for s in stride), padding=_padding(padding),
                  dilation=tuple(int(d) for d in dilation), groups=int(groups))
    layouts = _layouts(x_layout, y_layout)
    x_nchwc, y_nchwc = (layout == "NCHWc" for layout in layouts)
    if (x_nchwc or y_nchwc) and (into is not None or max_pool is not None or reads_prefix) or (
            x_nchwc and prologue is not None):
        raise ConfigError("conv2d: NCHWc layouts do not combine with into=, max_pool= or reads_prefix=, nor an "
                          "NCHWc x with prologue=; run the layer in NCHW")
    if x_nchwc:
        x_shape = _blocked_x_shape(jnp.shape(x), jnp.shape(w), config["groups"])
    else:
        x_shape = _read_shape(algorithm, jnp.shape(x), jnp.shape(w), config["groups"], reads_prefix)
    reason = conv2d_support(algorithm, x_shape=x_shape, w_shape=jnp.shape(w),
                            dtype=jnp.result_type(x), **config)
    if reason is not None:
        raise UnsupportedError(f"conv2d: algorithm {algorithm!r} cannot run this layer: {reason}")
    if b is not None and jnp.shape(b) != (jnp.shape(w)[0],):
        raise ConfigError(f"conv2d: bias must have shape ({jnp.shape(w)[0]},), got {jnp.shape(b)}")
    spec = ConvSpec(x_shape, jnp.shape(w), dtype=np.dtype(np.float32), layouts=layouts,
                    prologue=prologue is not None, **config)
    algo = _CONV_ALGORITHMS[algorithm]
    if spec.nchwc:
        reason = _extra_support(algorithm, "nchwc", spec)
        if reason is not None:
            raise UnsupportedError(f"conv2d: algorithm {algorithm!r} cannot take x as {x_layout} and y as "
                                   f"{y_layout}: {reason}; use NCHW")
    y_shape = nchwc_shape(spec.out_shape) if y_nchwc else spec.out_shape
    if residual is not None and jnp.shape(residual) != y_shape:
        raise ConfigError(f"conv2d: residual must have the output's shape {y_shape}, "
                          f"got {jnp.shape(residual)}")
    if residual is not None and not algo.residual:
        y = conv2d(x, w, b, algorithm=algorithm, **config, x_layout=x_layout, y_layout=y_layout)
        return activation_reference(y + residual, activation, alpha, clip, beta)
    buffer, channel0 = _concat_slot(algorithm, algo, spec, into)
    pooled = _fused_pool(algorithm, algo, spec, max_pool, residual is not None or into is not None)
    prologue = _checked_prologue(algorithm, algo, spec, prologue)
    (pt, pb), (pl, pr) = spec.padding
    attrs = dict(
        conv=np.array([*spec.stride, pt, pb, pl, pr, *spec.dilation, spec.groups], np.int64),
        **_epilogue_attrs(activation, alpha, beta, clip),
        **({} if algo.max_pool is None else {"max_pool": np.zeros(0, np.int64) if pooled is None
                                               else _pool_attr(*pooled)}),
        **({} if algo.prologue is None else {
            "prologue_activation": np.int64(_ACTIVATIONS[prologue[3] if prologue else None])}),
        **({"x_channels": np.int64(x_shape[1])} if algo.reads_prefix else {}),
        **({} if algo.nchwc is None else {"x_nchwc": np.int64(x_nchwc), "y_nchwc": np.int64(y_nchwc)}),
    )
    out_shape = y_shape if into is None else (1, _concat_channels(into), *spec.out_shape[2:])
    if pooled is not None:
        out_shape = _pool_out_shape("conv2d", jax.ShapeDtypeStruct(out_shape, jnp.float32), *pooled)
    out = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    kernel_b = _kernel_bias(b)
    b = jnp.zeros(spec.w_shape[0], jnp.float32) if b is None else b
    with eager_if_known(w):
        weight, extra = algo.prepare(spec, w)
    weight = shared(weight)
    empty = np.zeros((0,), np.float32)  # no residual, no buffer, no prologue
    has_residual, has_buffer, has_prologue = residual is not None, buffer is not None, prologue is not None

    def kernel(x, w, b, *rest):
        *arrays, weight, b = rest
        res = arrays.pop(0) if has_residual else empty
        buf = arrays.pop(0) if has_buffer else empty
        if not algo.residual:
            return _call(algo.target, out, x, weight, b, vmap_method="sequential", **attrs, **extra)
        more = () if algo.prologue is None else tuple(arrays) if has_prologue else (empty,) * 3
        return _call(algo.target, out, x, weight, b, res, buf, *more, vmap_method="sequential",
                     aliases={4: 0} if has_buffer else None, channel0=np.int64(channel0), **attrs, **extra)

    def reference(x, w, b, *arrays):
        arrays = list(arrays)
        if x_nchwc:
            x = from_nchwc(x, x_shape[1])
        if y_nchwc and has_residual:
            arrays[0] = from_nchwc(arrays[0], spec.out_shape[1])
        x = x[:, :x_shape[1]]
        if has_prologue:
            x = _apply_prologue(x, *arrays[-3:], prologue[3])
            del arrays[-3:]
        y = conv2d_reference(x, w, b, **config, activation=activation, alpha=alpha, beta=beta, clip=clip,
                             residual=arrays.pop(0) if has_residual else None)
        if pooled is not None:
            return max_pool2d_reference(y, *pooled)
        if into is None:
            return to_nchwc(y) if y_nchwc else y
        whole = arrays.pop(0) if has_buffer else jnp.zeros(out_shape, jnp.float32)
        return lax.dynamic_update_slice_in_dim(whole, y, channel0, axis=1)

    operands = (x, w, b, *((residual,) if has_residual else ()), *((buffer,) if has_buffer else ()),
                *(prologue[:3] if has_prologue else ()))
    return _with_reference_vjp(kernel, reference, derived=2)(*operands, weight, kernel_b)


def _blocked_x_shape(x_shape, w_shape, groups: int) -> tuple:
    """The NCHW shape of an NCHWc x holding the `w_shape[1] * groups` channels the conv reads."""
    lanes = vector_lanes()
    channels = w_shape[1] * groups if len(w_shape) == 4 else None
    if len(x_shape) != 5 or x_shape[4] != lanes or channels is None or x_shape[1] != -(-channels // lanes):
        raise ConfigError(f"conv2d: an NCHWc x holding the {channels} channels the weight {tuple(w_shape)} reads "
                          f"(groups={groups}) is (N, {-(-channels // lanes) if channels else 'ceil(C / W)'}, H, W, "
                          f"{lanes}), got {tuple(x_shape)}; block it with to_nchwc")
    n, _, h, w, _ = x_shape
    return n, channels, h, w


def _read_shape(name: str, x_shape, w_shape, groups: int, reads_prefix: bool) -> tuple:
    """The part of x `conv2d` convolves: all of it, or with `reads_prefix` its
    first `w_shape[1] * groups` channels."""
    if not reads_prefix:
        return tuple(x_shape)
    if not conv2d_reads_prefix(name):
        takers = " or ".join(repr(n) for n, a in _CONV_ALGORITHMS.items() if a.reads_prefix)
        raise ConfigError(f"conv2d: algorithm {name!r} takes no reads_prefix=True; {takers} does")
    channels = w_shape[1] * groups if len(w_shape) == 4 else None
    if len(x_shape) != 4 or x_shape[0] != 1 or channels is None or x_shape[1] < channels:
        raise ConfigError(f"conv2d: reads_prefix=True needs one NCHW image with at least the {channels} "
                          f"channels the weight {tuple(w_shape)} reads (groups={groups}), got x {tuple(x_shape)}")
    return (1, channels, *x_shape[2:])


def _fused_pool(name: str, algo: ConvAlgorithm, spec: ConvSpec, max_pool, with_extras: bool):
    """`conv2d`'s `max_pool` as checked `(window, stride, padding)`, or None."""
    if max_pool is None:
        return None
    reason = "it cannot be fused with residual= or into=" if with_extras else _extra_support(name, "max_pool", spec)
    if reason is not None:
        raise ConfigError(f"conv2d: max_pool={max_pool!r}: {reason}; pool the output with max_pool2d instead")
    try:
        window, stride, padding = max_pool
    except (TypeError, ValueError):
        raise ConfigError(f"conv2d: max_pool must be (window, stride, padding), got {max_pool!r}") from None
    return _pool_config(window, stride, padding)


def _checked_prologue(name: str, algo: ConvAlgorithm, spec: ConvSpec, prologue):
    """`conv2d`'s `prologue` as `(shift, scale, bias, activation)`, each array
    float32 `(C,)`, checked; or None."""
    if prologue is None:
        return None
    return _prologue_arrays("conv2d", "conv", prologue, spec.x_shape[1], _extra_support(name, "prologue", spec))


def _prologue_arrays(where: str, layer: str, prologue, channels: int, reason: str | None = None) -> tuple:
    """A kernel's per-channel `prologue` as `(shift, scale, bias, activation)`,
    each array float32 `(channels,)` or `(1,)` (the same for every channel),
    or empty for one given as None (its identity), checked; `reason`: why the
    `layer` cannot take one at all, or None."""
    if reason is None and (not isinstance(prologue, (tuple, list)) or len(prologue) != 4):
        reason = "it must be (shift, scale, bias, activation)"
    if reason is None and prologue[3] not in (None, "relu", "relu6"):
        reason = f"its activation must be None, 'relu' or 'relu6', got {prologue[3]!r}"
    if reason is None and any(a is not None and jnp.shape(a) not in ((channels,), (1,)) for a in prologue[:3]):
        reason = f"shift, scale and bias must each be None or have shape ({channels},) or (1,)"
    if reason is not None:
        raise ConfigError(f"{where}: prologue: {reason}; apply it to x before the {layer} instead")
    _require_float32(where, shift=prologue[0], scale=prologue[1], bias=prologue[2])
    return (*(np.zeros((0,), np.float32) if a is None else jnp.asarray(a) for a in prologue[:3]), prologue[3])


def _apply_prologue(x: jax.Array, shift, scale, bias, activation: str | None) -> jax.Array:
    """`activation((x - shift) * scale + bias)` per channel of NCHW `x`; an
    empty operand is its identity."""
    for a, op in ((shift, jnp.subtract), (scale, jnp.multiply), (bias, jnp.add)):
        if jnp.size(a):
            x = op(x, a[:, None, None])
    return activation_reference(x, activation)


def _concat_channels(into) -> int:
    target, _ = into
    return int(target) if isinstance(target, (int, np.integer)) else int(jnp.shape(target)[1])


def _concat_slot(name: str, algo: ConvAlgorithm, spec: ConvSpec, into) -> tuple[jax.Array | None, int]:
    """`(buffer or None, channel0)` of `conv2d`'s `into`, checked; channel0 is -1 without it."""
    if into is None:
        return None, -1
    target, channel0 = into
    channel0 = int(channel0)
    if not algo.residual:
        raise ConfigError(f"conv2d: algorithm {name!r} cannot write into a concatenation's buffer; "
                          "use 'smm', 'grouped' or 'winograd', or concatenate its output")
    channels, (n, o, oh, ow) = _concat_channels(into), spec.out_shape
    buffer = None if isinstance(target, (int, np.integer)) else target
    if buffer is not None:
        _require_float32("conv2d", into=buffer)
    wanted = (1, channels, oh, ow)
    if n != 1 or not 0 <= channel0 <= channels - o or (buffer is not None and jnp.shape(buffer) != wanted):
        raise ConfigError(
            f"conv2d: into=(buffer, channel0) needs one image and a (1, C, {oh}, {ow}) buffer holding "
            f"channels [channel0, channel0 + {o}); got batch {n}, channel0 {channel0}, buffer "
            f"{jnp.shape(buffer) if buffer is not None else f'of {channels} channels'}"
        )
    return buffer, channel0


# ----------------------------------------------------------- smm (GEMM) conv


@functools.cache
def gemm_tile(shape: str = "wide") -> Pair:
    """The C GEMM's register tile `(MR, NR)`: rows by columns of C held in
    registers. `shape` "wide" serves every GEMM but a conv's in channel rows,
    which takes the "tall" one (`smm` packs such a weight in its MR-row strips)."""
    if shape not in ("wide", "tall"):
        raise ConfigError(f"gemm_tile: shape must be 'wide' or 'tall', got {shape!r}")
    reason = kernel_unavailable("jtile_conv_smm")
    if reason is not None:
        raise UnsupportedError(reason)
    tile = (ctypes.c_int64 * 4)()
    ctypes.cdll.LoadLibrary(LIBRARY_PATH).JtileGemmTile(tile)
    return (int(tile[0]), int(tile[1])) if shape == "wide" else (int(tile[2]), int(tile[3]))


def smm_pixel_rows(spec: ConvSpec) -> bool:
    """Whether `smm` makes output pixels the GEMM's rows (channels in vector
    lanes, written back transposed) rather than output channels.

    Measured on ResNet-18's and MobileNetV2's layers with the 7x64 AVX-512
    tile: pixel rows win for windowed convs with at most 16x16 output pixels an
    image (3x3 512->512 at 7x7: 1.06 against 1.58 ms; at 14x14: 0.88 against
    1.27 ms; stride 2 to 7x7: 0.49 against 0.81 ms), channel rows everywhere
    else (stride 2 to 28x28: 0.57 against 0.59 ms), 1x1 convs included
    (960->160 at 7x7: 0.078 against 0.095 ms), since there x itself is the
    packed operand. Since edge tiles compute only their own vectors, a
    windowed conv with a deep GEMM (K = C/g*KH*KW of 256 and more) over at most
    16x16 pixels takes pixel rows whatever its channels fill: DenseNet-121's
    3x3 128->32 at 7x7 0.043 against 0.078 ms, at 14x14 0.145 against 0.184,
    at 28x28 (784 pixels, over the limit) 0.46 against 0.52; with K = 144 (16->16
    at 16x16) channel rows stay faster, 0.017 against 0.028 ms.

    A 1x1 conv whose pixels fill less than 95% of their vectors (7x7: 49 of
    64 lanes; 10x10 and 14x14) takes pixel rows too once it has at least 64
    output channels (a whole strip of the wide tile's columns), where
    packing x costs less than the lanes channel rows leave idle. Alone, warm,
    pixel rows' time over channel rows' on this release's Zen 5: 7x7
    0.69-0.84 (512->64 to 160->480), 10x10 0.87-0.95, 14x14 0.90-0.97 (and
    160->480 1.00); with whole vectors 8x8 0.98-1.06, 16x16 0.99-1.06,
    20x20 1.05-1.06, and 13x13 (96%) 0.98-1.02 but for 1024->256 (0.78).
    In the models, two compiled functions in alternating rounds, either
    compiled first: ResNet-50 0.985-0.993x (its thirteen 14x14 1x1s 3397-3443
    against 3604-3657 us a run), ShuffleNetV2 0.973-0.995x, GoogLeNet,
    ResNet-18, RegNet-Y and MobileNetV3 level. (It was 80% and 2^17
    weights, from the previous tile's measurements.)

    A 1x1 conv with a prologue (`spec.prologue`) takes pixel rows if it has
    one image and under 4 pixels an output channel: the kernel applies the prologue
    to one copy of x there, where channel rows apply it to every task's
    strips of x (or, a prologue that only scales x, to the weights, which
    pays with more pixels: see kernels/conv_smm.cc). In the model against
    channel rows, us: MobileNetV3's squeeze-excitation projections 480->112
    at 14x14 55.6 against 64.8, 672->112 75.0 against 88.8, EfficientNet-B0's
    672->192 at 7x7 42.5 against 55.5; DenseNet-121's 24 1x1 convs to 128
    channels at 14x14, after their batch norm and ReLU, 1894-1963 against
    2234-2326 a run (two runs). Its 7x7 ones measured level.
    """
    nr = gemm_tile()[1]
    pixels = spec.out_shape[2] * spec.out_shape[3]
    channels = spec.w_shape[0] // spec.groups
    depth = spec.w_shape[1] * spec.w_shape[2] * spec.w_shape[3]
    fill = lambda n, r: n / (-(-n // r) * r)  # noqa: E731
    if spec.w_shape[2] * spec.w_shape[3] == 1:
        if spec.prologue:  # pixel rows apply one to one image only
            return spec.x_shape[0] == 1 and pixels < 4 * channels
        return fill(pixels, vector_lanes()) < 0.95 and channels >= 64
    return pixels <= 256 and (depth >= 256 or fill(channels, nr) >= fill(pixels, nr))


def pack_gemm_weight(w: jax.Array, groups: int, rows: int) -> jax.Array:
    """OIHW `w` as the GEMM's packed operand `(groups, strips, K, rows)`: per
    group, `rows` output channels a strip, K = I * KH * KW deep, zero-padded.
    A known `w` is packed in numpy (`on_host`), a traced one in jnp."""
    w = on_host(w)
    xp = np if isinstance(w, np.ndarray) else jnp
    o = w.shape[0]
    per_group = w.reshape(groups, o // groups, -1)
    strips = -(-(o // groups) // rows)
    padded = xp.pad(per_group, ((0, 0), (0, strips * rows - o // groups), (0, 0)))
    return to_device(padded.reshape(groups, strips, rows, -1).transpose(0, 1, 3, 2))


def _smm_prepare(spec: ConvSpec, w: jax.Array) -> tuple[jax.Array, dict]:
    pixel_rows = spec.nchwc or smm_pixel_rows(spec)
    rows = gemm_tile()[1] if pixel_rows else gemm_tile("tall")[0]
    return pack_gemm_weight(w, spec.groups, rows), dict(
        kernel=np.array([spec.w_shape[0], *spec.w_shape[2:]], np.int64),
        pixel_rows=np.int64(pixel_rows),
    )


register_conv_algorithm("direct", "jtile_conv_direct", "JtileConvDirect", _any_conv)
def _smm_prologue(spec: ConvSpec) -> str | None:
    """A 1x1 unpadded conv (a strided one on the pixels it copies first)."""
    pointwise = spec.w_shape[2:] == (1, 1) and spec.padding == ((0, 0), (0, 0))
    if not pointwise or spec.groups != 1:
        return ("a prologue is applied to a 1x1 unpadded conv of one group only (x packed as it is "
                f"read), this layer has a {spec.w_shape[2:]} window, stride {spec.stride}, padding "
                f"{spec.padding} and {spec.groups} group(s)")
    return None


def _smm_nchwc(spec: ConvSpec) -> str | None:
    """NCHWc in pixel rows: the GEMM broadcasts x from its blocks and stores
    vectors of output channels into theirs."""
    pointwise = spec.w_shape[2:] == (1, 1) and spec.stride == (1, 1) and spec.padding == ((0, 0), (0, 0))
    problems = [
        *(["it runs one image of one group only"] if spec.x_shape[0] != 1 or spec.groups != 1 else []),
        *(["an NCHWc x needs a 1x1, stride-1, unpadded conv"] if spec.layouts[0] == "NCHWc" and not pointwise
          else []),
    ]
    return "; ".join(problems) or None


register_conv_algorithm("smm", "jtile_conv_smm", "JtileConvSmm", _any_conv, _smm_prepare, residual=True,
                        prologue=_smm_prologue, reads_prefix=True, nchwc=_smm_nchwc, crops=True)

# ------------------------------------------------- grouped (channel-blocked) conv


@functools.cache
def vector_lanes() -> int:
    """The lanes W of the kernels' vectors (16 with AVX-512, else 8): the
    `grouped` kernel computes W output channels of one group at a time."""
    reason = kernel_unavailable("jtile_conv_grouped")
    if reason is not None:
        raise UnsupportedError(reason)
    library = ctypes.cdll.LoadLibrary(LIBRARY_PATH)
    library.JtileVectorLanes.restype = ctypes.c_int64
    return int(library.JtileVectorLanes())


def _grouped_prepare(spec: ConvSpec, w: jax.Array) -> tuple[jax.Array, dict]:
    """`w` packed per group in blocks of W output channels; OIHW when vectors
    span several groups: at stride 1 with at most W / 4 output channels a group,
    where that measured 1.4x (ResNeXt-50's 32 groups of 4 at 56x56; at stride 2
    it was up to 3x slower, as it transposes every input column); or packed
    several groups a vector where their outputs divide W (RegNet's 8)."""
    span_groups, per_vector = _spans_groups(spec), _groups_per_vector(spec)
    if span_groups:
        packed = w
    elif per_vector > 1:
        packed = pack_group_lanes(w, spec.groups, per_vector)
    else:
        packed = pack_gemm_weight(w, spec.groups, vector_lanes())
    return packed, dict(kernel=np.array([spec.w_shape[0], *spec.w_shape[2:]], np.int64),
                        span_groups=np.int64(span_groups), groups_per_vector=np.int64(per_vector))


def _spans_groups(spec: ConvSpec) -> bool:
    return (spec.w_shape[0] // spec.groups * 4 <= vector_lanes() and spec.stride[1] == 1
            and _groups_per_vector(spec) == 1)


def _groups_per_vector(spec: ConvSpec) -> int:
    """How many groups one vector of the `grouped` kernel holds: W / their output
    channels where that is 2, 4 or 8, else 1. Against one group a vector
    (alone, AVX-512) it measured 1.1-2.1x on RegNet-Y-400MF's groups of 8 and
    ResNeXt's of 4 to 8, and against vectors spanning groups 1.4-1.7x on groups
    of 4 at stride 1, even on groups of 2."""
    per_group, lanes = spec.w_shape[0] // spec.groups, vector_lanes()
    if spec.groups == 1 or lanes % per_group or lanes // per_group not in (2, 4, 8):
        return 1
    return lanes // per_group


def pack_group_lanes(w: jax.Array, groups: int, per_vector: int) -> jax.Array:
    """OIHW `w` as `grouped`'s operand `(groups / per_vector, 1, K, W)` with
    `per_vector` groups a vector: channel c of the pack's group i in lane
    `c * per_vector + i`, zeros for the groups past the last."""
    w = on_host(w)
    xp = np if isinstance(w, np.ndarray) else jnp
    packs = -(-groups // per_vector)
    per_group = xp.pad(w.reshape(groups, w.shape[0] // groups, -1), ((0, packs * per_vector - groups), (0, 0), (0, 0)))
    lanes = per_group.reshape(packs, per_vector, w.shape[0] // groups, -1).transpose(0, 3, 2, 1)
    return to_device(lanes.reshape(packs, 1, lanes.shape[1], -1))


def _grouped_max_pool(spec: ConvSpec) -> str | None:
    if _spans_groups(spec) or _groups_per_vector(spec) > 1:
        return (f"its groups of {spec.w_shape[0] // spec.groups} output channels run on vectors holding several "
                "groups, which do not pool")
    return None


register_conv_algorithm("grouped", "jtile_conv_grouped", "JtileConvGrouped", _any_conv, _grouped_prepare,
                        residual=True, max_pool=_grouped_max_pool)

# ------------------------------------------------------------- more kernels
# How to add a kernel:
#  1. Write kernels/<family>.cc. A conv algorithm implements the signature in
#     kernels/common.h and exports it with
#     JTILE_DEFINE_HANDLER(JtileConvX, Impl, JTILE_CONV_BINDING);
#     (or JTILE_CONV_RESIDUAL_BINDING.Ret<...>() to fuse a residual too).
#  2. Add one entry here:
#        register_conv_algorithm("x", "jtile_conv_x", "JtileConvX", _x_support)
#     where `_x_support(spec: ConvSpec) -> str | None` explains which layers it
#     cannot run (shape, dtype and padding checks are already done by
#     `ConvSpec.problem`); pass `prepare=` to hand the kernel a packed weight
#     and `residual=True` for the residual binding. `conv2d(..., algorithm="x")`
#     then dispatches to it.
#  3. A kernel with another signature: add `_TARGETS["jtile_x"] = "JtileX"`, a
#     jnp reference, and a thin wrapper calling `_call(...)` inside
#     `_with_reference_vjp(kernel, reference)` like `dense` below.
#  4. Rebuild: kernels/dev_build.sh; test in tests/test_kernels*.py.


def _winograd_support(spec: ConvSpec) -> str | None:
    """Winograd F(4x4, 3x3): 3x3 kernel, stride 1, dilation 1, groups 1 only."""
    found = {"kernel": spec.w_shape[2:], "stride": spec.stride, "dilation": spec.dilation,
             "groups": spec.groups}
    wanted = {"kernel": (3, 3), "stride": (1, 1), "dilation": (1, 1), "groups": 1}
    wrong = [f"{key} {found[key]}" for key in wanted if found[key] != wanted[key]]
    if wrong:
        return ("winograd F(4x4, 3x3) needs a 3x3 kernel, stride 1, dilation 1 and groups 1; "
                f"this layer has {', '.join(wrong)}; use 'direct' or 'smm'")
    return None


def _depthwise_support(spec: ConvSpec) -> str | None:
    """Depthwise: one group per input channel (any channel multiplier)."""
    channels = spec.x_shape[1]
    if spec.groups != channels:
        return (f"depthwise needs groups == input channels ({channels}), this layer has "
                f"groups {spec.groups}; use 'direct' or 'smm'")
    return None


register_conv_algorithm("winograd", "jtile_conv_winograd", "JtileConvWinograd", _winograd_support,
                        residual=True)
def _depthwise_nchwc(spec: ConvSpec) -> str | None:
    """NCHWc channel blocks: one output channel per input channel."""
    channels = spec.x_shape[1]
    if spec.w_shape[0] != channels:
        return (f"NCHWc needs one output channel per input channel; this layer maps {channels} to "
                f"{spec.w_shape[0]}")
    return None


register_conv_algorithm("depthwise", "jtile_conv_depthwise", "JtileConvDepthwise", _depthwise_support,
                        nchwc=_depthwise_nchwc)

# ------------------------------------------ depthwise conv of an expansion

_TARGETS["jtile_conv_expanded_depthwise"] = "JtileConvExpandedDepthwise"


def expanded_depthwise_support(x_shape: Sequence[int], expand_shape: Sequence[int], w_shape: Sequence[int],
                               stride: Pair = (1, 1), padding: Padding = ((0, 0), (0, 0)),
                               dilation: Pair = (1, 1), dtype=np.float32) -> str | None:
    """Why `expanded_depthwise_conv2d` cannot run this pair of layers, or None:
    x NCHW, the 1x1 conv's weight `expand_shape` (C, c, 1, 1), the depthwise
    conv's `w_shape` (C, 1, KH, KW)."""
    if len(expand_shape) != 4 or tuple(expand_shape[2:]) != (1, 1) or len(x_shape) != 4 \
            or expand_shape[1] != x_shape[1]:
        return f"the expansion must be a 1x1 conv of x {tuple(x_shape)}, got a weight {tuple(expand_shape)}"
    channels = expand_shape[0]
    spec = _geometry_spec((x_shape[0], channels, *x_shape[2:]), w_shape, stride, padding, dilation, channels, dtype)
    problem = spec.problem() or _depthwise_support(spec) or _depthwise_nchwc(spec)
    return problem or kernel_unavailable("jtile_conv_expanded_depthwise")


def expanded_depthwise_conv2d(x: jax.Array, expand_w: jax.Array, expand_b: jax.Array | None, w: jax.Array,
                              b: jax.Array | None = None, *, stride: Pair = (1, 1),
                              padding: Padding = ((0, 0), (0, 0)), dilation: Pair = (1, 1),
                              activation: str | None = None, alpha: float = 0.0, beta: float = 0.0,
                              clip: Sequence[float] = (0.0, 6.0), expand_activation: str | None = None,
                              expand_alpha: float = 0.0, expand_beta: float = 0.0,
                              expand_clip: Sequence[float] = (0.0, 6.0), y_layout: str = "NCHW") -> jax.Array:
    """The depthwise conv `w` (C, 1, KH, KW) of `expand_activation(conv1x1(x,
    expand_w) + expand_b)` in one kernel call: the inverted residual block's
    expansion and depthwise conv, with the expansion (C, c, 1, 1) computed
    band by band where the depthwise conv reads it, so its output (C channels
    at x's size, the block's largest tensor) is never written out. Rows that
    bands share are computed twice (`in_rows / (band * stride)` of the
    expansion: 1.1-1.3x). x NCHW; y NCHW, or channel-blocked with
    `y_layout="NCHWc"`; activations as `conv2d`'s. Tolerance that of
    "depthwise" after "smm" (`TOLERANCE`)."""
    _check_activation("expanded_depthwise_conv2d", activation)
    _check_activation("expanded_depthwise_conv2d", expand_activation)
    _require_float32("expanded_depthwise_conv2d", x=x, expand_w=expand_w, expand_b=expand_b, w=w, b=b)
    _, y_nchwc = (layout == "NCHWc" for layout in _layouts("NCHW", y_layout))
    config = dict(stride=tuple(int(v) for v in stride), padding=_padding(padding),
                  dilation=tuple(int(d) for d in dilation))
    reason = expanded_depthwise_support(jnp.shape(x), jnp.shape(expand_w), jnp.shape(w), **config,
                                        dtype=jnp.result_type(x))
    if reason is not None:
        raise UnsupportedError(f"expanded_depthwise_conv2d: cannot run this pair of layers: {reason}")
    channels = jnp.shape(expand_w)[0]
    for name, bias in (("expand_b", expand_b), ("b", b)):
        if bias is not None and jnp.shape(bias) != (channels,):
            raise ConfigError(f"expanded_depthwise_conv2d: {name} must have shape ({channels},), got {jnp.shape(bias)}")
    spec = _geometry_spec((jnp.shape(x)[0], channels, *jnp.shape(x)[2:]), jnp.shape(w), **config, groups=channels)
    out = jax.ShapeDtypeStruct(nchwc_shape(spec.out_shape) if y_nchwc else spec.out_shape, jnp.float32)
    (pt, pb), (pl, pr) = spec.padding
    expand_attrs = _epilogue_attrs(expand_activation, expand_alpha, expand_beta, expand_clip)
    attrs = dict(conv=np.array([*spec.stride, pt, pb, pl, pr, *spec.dilation, channels], np.int64),
                 **_epilogue_attrs(activation, alpha, beta, clip),
                 **{f"expand_{name}": value for name, value in expand_attrs.items()}, y_nchwc=np.int64(y_nchwc))
    kernel_biases = (_kernel_bias(expand_b), _kernel_bias(b))
    zeros = jnp.zeros(channels, jnp.float32)
    expand_b, b = (zeros if v is None else v for v in (expand_b, b))

    def kernel(x, expand_w, expand_b, w, b, kernel_expand_b, kernel_b):
        return _call("jtile_conv_expanded_depthwise", out, x, w, kernel_b, expand_w.reshape(channels, -1),
                     kernel_expand_b, vmap_method="sequential", **attrs)

    def reference(x, expand_w, expand_b, w, b):
        e = conv2d_reference(x, expand_w, expand_b, activation=expand_activation, alpha=expand_alpha,
                             beta=expand_beta, clip=expand_clip)
        y = conv2d_reference(e, w, b, **config, groups=channels, activation=activation, alpha=alpha, beta=beta,
                             clip=clip)
        return to_nchwc(y) if y_nchwc else y

    return _with_reference_vjp(kernel, reference, derived=2)(x, expand_w, expand_b, w, b, *kernel_biases)


def _describe_expanded_call(eqn):
    """The depthwise conv of an expanded depthwise call, reading the expansion's output."""
    layer = _describe_conv_call(eqn)
    n, _, h, w = eqn.invars[0].aval.shape
    channels = eqn.invars[3].aval.shape[0]
    return dataclasses.replace(layer, in_shapes=((n, channels, h, w), *layer.in_shapes[1:]), in_channels=channels)


def _expanded_call_macs(eqn):
    """MACs of an expanded depthwise call: the 1x1 conv's with its bias and
    activation, then the depthwise conv's with its own."""
    from ._macs import epilogue

    n, c, h, w = eqn.invars[0].aval.shape
    layer = _describe_expanded_call(eqn)
    expanded, outputs = n * layer.in_channels * h * w, math.prod(layer.out_shape)
    attributes = dict(eqn.params["attributes"] or ())
    return (Counter({"conv": expanded * c + outputs * math.prod(layer.kernel_size)})
            + epilogue(eqn, 1, attributes.get("expand_activation"), expanded)
            + epilogue(eqn, 1, attributes.get("activation"), outputs))


_registry.register("ffi_call:jtile_conv_expanded_depthwise", describe=_describe_expanded_call,
                   macs=_expanded_call_macs, weights=(1, 2, 3, 4), activations=(0,))

# ----------------------------------------------------------------- end more

# -------------------------------------------------------------------- dense


def dense_reference(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
                    activation: str | None = None, alpha: float = 0.0, beta: float = 0.0,
                    clip: Sequence[float] = (0.0, 6.0), transpose_w: bool = False,
                    residual: jax.Array | None = None) -> jax.Array:
    """`act(x @ w + b + residual)` in jnp (`x @ w.T` if `transpose_w`)."""
    y = jnp.dot(x, w.T if transpose_w else w, precision=lax.Precision.HIGHEST)
    if b is not None:
        y = y + b
    if residual is not None:
        y = y + residual
    return activation_reference(y, activation, alpha, clip, beta)


# Rows below which `dense` streams its weight in place (matrix-vector paths)
# rather than run the GEMM on it packed: a known (folded) weight is packed once,
# at trace time; a traced one would be packed on every call. Measured, fc
# 9216->4096 (x @ W.T): at 8 rows, 6.3 ms packed at trace time, 12.2 ms in
# place, 39.7 ms packed per call. Since the GEMM computes only the rows a tile
# keeps, a known weight is packed even for one row: alone on the Zen 5, hot,
# kernel us packed against in place, 1280->1000 44 / 58, 960->1280 45 / 63,
# 960->240 8 / 19, 2048->1000 98 / 103, 9216->4096 2881 / 3221; in one process,
# alternated (30 rounds, best ms) AlexNet 8.09 / 8.69, MobileNetV2 2.38 / 2.43,
# MobileNetV3 3.59 / 3.63 (medians 4.04 / 4.28), EfficientNet-B0 and
# ResNet-50 level.
GEMV_ROWS = {"known": 1, "traced": 17}


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
          activation: str | None = None, alpha: float = 0.0, beta: float = 0.0,
          clip: Sequence[float] = (0.0, 6.0), transpose_w: bool = False,
          residual: jax.Array | None = None) -> jax.Array:
    """`act(x @ w + b + residual)` by the C kernel: x `(M, K)`, w `(K, N)`, b
    `(N,)` or None, `residual` `(M, N)` or None (a transformer's shortcut,
    added as the product is stored).

    With `transpose_w`, w is `(N, K)` (PyTorch's Linear layout) and the kernel
    computes `x @ w.T` without transposing w. A known (folded) w is packed
    once, at trace time, for the register-blocked GEMM, whatever the rows (one
    row streams the packed strips several at a time instead); a
    traced w is streamed in place by a matrix-vector path for few rows (see
    `GEMV_ROWS`), packed in `jnp` on every call for more.
    """
    _check_activation("dense", activation)
    _require_float32("dense", x=x, w=w, b=b)
    _require_rank("dense", "x", x, 2)
    _require_rank("dense", "w", w, 2)
    (m, k), (k2, n) = jnp.shape(x), jnp.shape(w)[::-1] if transpose_w else jnp.shape(w)
    if k != k2:
        op = "x @ w.T" if transpose_w else "x @ w"
        raise ConfigError(f"dense: x {jnp.shape(x)} and w {jnp.shape(w)} do not chain ({op})")
    if b is not None and jnp.shape(b) != (n,):
        raise ConfigError(f"dense: bias must have shape ({n},), got {jnp.shape(b)}")
    _require_float32("dense", residual=residual)
    if residual is not None and jnp.shape(residual) != (m, n):
        raise ConfigError(f"dense: the residual must have the output's shape ({m}, {n}), got {jnp.shape(residual)}")
    packed = m >= GEMV_ROWS["known" if is_known(w) else "traced"]
    attrs = dict(_epilogue_attrs(activation, alpha, beta, clip), transpose_w=np.int64(bool(transpose_w)),
                 packed=np.int64(packed))
    out = jax.ShapeDtypeStruct((m, n), jnp.float32)
    kernel_b = _kernel_bias(b)
    b = jnp.zeros(n, jnp.float32) if b is None else b
    with eager_if_known(w):
        weight = shared(pack_gemm_weight(w if transpose_w else on_host(w).T, 1, gemm_tile()[1]) if packed else w)

    residuals = () if residual is None else (residual,)

    def kernel(x, w, b, *rest):
        *res, weight, kernel_b = rest
        return _call("jtile_dense", out, x, weight, kernel_b, res[0] if res else np.zeros((0,), np.float32),
                     vmap_method="sequential", **attrs)

    def reference(x, w, b, *res):
        return dense_reference(x, w, b, activation=activation, alpha=alpha, beta=beta, clip=clip,
                               transpose_w=transpose_w, residual=res[0] if res else None)

    return _with_reference_vjp(kernel, reference, derived=2)(x, w, b, *residuals, weight, kernel_b)


# ------------------------------------------------------------------- matmul

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def matmul_reference(a: jax.Array, c: jax.Array, dimension_numbers: DimensionNumbers) -> jax.Array:
    """`lax.dot_general(a, c, dimension_numbers)` at full float32 precision."""
    return lax.dot_general(a, c, dimension_numbers, precision=lax.Precision.HIGHEST)


def _merged_stride(shape, strides, axes) -> int | None:
    """The stride of `axes` read as one axis (in their order), 0 if they hold one
    element, None if they are not one contiguous run in memory."""
    kept = [ax for ax in axes if shape[ax] != 1]
    for outer, inner in zip(kept, kept[1:]):
        if strides[outer] != strides[inner] * shape[inner]:
            return None
    return strides[kept[-1]] if kept else 0


def _matmul_view(view: Strided, batch, rows, contract) -> tuple[int, int, int] | None:
    """`(batch, row, k)` strides of `view` read as `(B, rows, K)` with those
    axis groups in place, or None if the groups are not contiguous runs or
    neither rows nor K has stride 1."""
    shape, strides = view.shape, view.strides
    sb, sr, sk = (_merged_stride(shape, strides, axes) for axes in (batch, rows, contract))
    if None in (sb, sr, sk):
        return None
    if sk == 0 or sr == 0:  # one row or one k: that group's stride is free
        sk, sr = (1, sr) if sk == 0 else (sk, 1)
    return (sb, sr, sk) if 1 in (sr, sk) else None


def _free_axes(rank: int, batch, contract) -> list[int]:
    return [ax for ax in range(rank) if ax not in (*batch, *contract)]


def matmul_reads_in_place(view: Strided, batch: Sequence[int], contract: Sequence[int]) -> bool:
    """Whether `matmul(a_view=view)` reads an operand with these batch and
    contracting axes where it lies: its batch, free and contracting axes each
    one run in memory, with its free or its contracting axes innermost."""
    return _matmul_view(view, batch, _free_axes(len(view.shape), batch, contract), contract) is not None


def _strided_reference(buffer: jax.Array, view: Strided) -> jax.Array:
    """The elements `view` reads from `buffer`, gathered."""
    index = view.offset + sum(np.arange(n).reshape([-1 if a == ax else 1 for a in range(len(view.shape))]) * s
                              for ax, (n, s) in enumerate(zip(view.shape, view.strides)))
    return jnp.ravel(buffer)[np.broadcast_to(index, view.shape)]


def _matmul_operand(x: jax.Array, view: Strided | None, batch, contract) -> tuple[jax.Array, tuple[int, ...]]:
    """The buffer to pass and its `(offset, batch, row, k)` view: `x` read in
    place where its layout allows, else copied to (B, rows, K) order first."""
    if view is None:
        view = Strided.contiguous(jnp.shape(x))
    rows = _free_axes(len(view.shape), batch, contract)
    strides = _matmul_view(view, batch, rows, contract)
    if strides is not None:
        return x, (view.offset, *strides)
    if view != Strided.contiguous(jnp.shape(x)):
        raise ConfigError(f"matmul: the view {view} cannot be read in place (see matmul_reads_in_place)")
    groups = [math.prod(view.shape[ax] for ax in axes) for axes in (batch, rows, contract)]
    x = jnp.transpose(x, (*batch, *rows, *contract)).reshape(groups)
    return x, (0, groups[1] * groups[2], groups[2], 1)


def _checked_view(name: str, x: jax.Array, view: Strided | None) -> jax.ShapeDtypeStruct | jax.Array:
    """What the product reads of operand `name`: `x`, or the shape `view` reads
    from the buffer `x` (which must hold it)."""
    if view is None:
        return x
    if min(view.offset, *view.strides, 0) < 0 or view.span() > math.prod(jnp.shape(x)):
        raise ConfigError(f"matmul: {name}_view {view} reaches outside its buffer of shape {jnp.shape(x)}")
    return jax.ShapeDtypeStruct(view.shape, jnp.result_type(x))


def matmul_stored_axes(a_ndim: int, out_ndim: int, dimension_numbers: DimensionNumbers,
                       batch_inner: bool) -> list[int]:
    """The axes of a product of `out_ndim` axes (`dot_general` order: batch,
    a's free, c's free) in the order `matmul(batch_inner=...)` returns them."""
    (a_contract, _), (a_batch, _) = dimension_numbers
    batch, rows = len(a_batch), a_ndim - len(a_batch) - len(a_contract)
    axes = list(range(out_ndim))
    return [*axes[batch:batch + rows], *axes[:batch], *axes[batch + rows:]] if batch_inner else axes


def matmul(a: jax.Array, c: jax.Array, dimension_numbers: DimensionNumbers, *,
           a_view: Strided | None = None, c_view: Strided | None = None, scale: float = 1.0,
           batch_inner: bool = False) -> jax.Array:
    """`lax.dot_general(a, c, dimension_numbers) * scale` by the C GEMM, for
    float32 activations times activations (attention's `Q @ K^T`, `P @ V`).

    Each batch element is one GEMM. An operand is read in place (a head split
    or a transpose feeding the product costs no copy) when its batch, free and
    contracting axes each form one contiguous run in memory, with its free or
    its contracting axes innermost; otherwise it is copied to (batch, free,
    contracting) order first. With `a_view` (a `jtile._views.Strided`), `a`
    is a buffer and the operand is that view of it, read in place (it must be:
    see `matmul_reads_in_place`); likewise `c_view`. With `batch_inner`, the
    product comes in (free axes of a, batch axes, free axes of c) order: the
    heads of attention's `P @ V` side by side per token, as the head merge
    after it lays them out (which then costs no copy).
    """
    _require_float32("matmul", a=a, c=c)
    dn = tuple(tuple(tuple(int(ax) for ax in axes) for axes in pair) for pair in dimension_numbers)
    (a_contract, c_contract), (a_batch, c_batch) = dn
    a_read, c_read = _checked_view("a", a, a_view), _checked_view("c", c, c_view)
    try:
        out = jax.eval_shape(lambda a, c: matmul_reference(a, c, dn), a_read, c_read)
    except TypeError as error:
        raise ConfigError(f"matmul: a {jnp.shape(a_read)} and c {jnp.shape(c_read)} do not match the dimension "
                          f"numbers {dn}: {error}") from None
    a_shape, c_shape = jnp.shape(a_read), jnp.shape(c_read)
    dims = [math.prod(a_shape[ax] for ax in a_batch),
            *(math.prod(shape[ax] for ax in _free_axes(len(shape), batch, contract))
              for shape, batch, contract in ((a_shape, a_batch, a_contract), (c_shape, c_batch, c_contract))),
            math.prod(a_shape[ax] for ax in a_contract)]
    if min(dims) == 0:
        raise ConfigError(f"matmul: the product of {a_shape} and {c_shape} is empty (dims [B, M, N, K] = {dims})")
    flat = jax.ShapeDtypeStruct((dims[0] * dims[1] * dims[2],), jnp.float32)
    order = matmul_stored_axes(len(a_shape), len(out.shape), dn, batch_inner)

    def kernel(a, c):
        (a, a_offsets), (c, c_offsets) = (_matmul_operand(a, a_view, a_batch, a_contract),
                                          _matmul_operand(c, c_view, c_batch, c_contract))
        attrs = {name: np.array(v, np.int64) for name, v in
                 (("dims", dims), ("a_view", a_offsets), ("c_view", c_offsets))}
        y = _call("jtile_matmul", flat, a, c, vmap_method="sequential", scale=np.float32(scale),
                  batch_inner=np.int64(batch_inner), **attrs)
        return y.reshape([out.shape[ax] for ax in order])

    def reference(a, c):
        a, c = (x if v is None else _strided_reference(x, v) for x, v in ((a, a_view), (c, c_view)))
        product = jnp.transpose(matmul_reference(a, c, dn), order)
        return product if scale == 1.0 else product * np.float32(scale)

    return _with_reference_vjp(kernel, reference)(a, c)


# ------------------------------------------------------------------ pooling


def _pool_config(window, stride, padding) -> tuple[Pair, Pair, Padding]:
    window, stride = tuple(int(v) for v in window), tuple(int(v) for v in stride)
    padding = _padding(padding)
    if len(window) != 2 or len(stride) != 2 or min(window + stride) < 1:
        raise ConfigError(f"pool2d: window {window} and stride {stride} must be two positive ints each")
    if min(p for pair in padding for p in pair) < 0:
        raise ConfigError(f"pool2d: padding {padding} must be non-negative")
    return window, stride, padding


def _pool_out_shape(where: str, x, window: Pair, stride: Pair, padding: Padding) -> tuple[int, ...]:
    _require_float32(where, x=x)
    _require_rank(where, "x", x, 4)
    *lead, h, w = jnp.shape(x)
    oh, ow = (
        SlidingWindow(size, k, s, lo, hi).out_size
        for size, k, s, (lo, hi) in zip((h, w), window, stride, padding)
    )
    if oh < 1 or ow < 1:
        raise ConfigError(f"{where}: window {window} does not fit the padded input {jnp.shape(x)}")
    return (*lead, oh, ow)


def _reduce_window(x, init, op, window, stride, padding):
    return lax.reduce_window(x, init, op, (1, 1, *window), (1, 1, *stride), ((0, 0), (0, 0), *padding))


def max_pool2d_reference(x: jax.Array, window: Pair, stride: Pair, padding: Padding) -> jax.Array:
    """NCHW max pooling in `lax`; padding counts as -inf."""
    return _reduce_window(x, -jnp.inf, lax.max, window, stride, padding)


def avg_pool2d_reference(x: jax.Array, window: Pair, stride: Pair, padding: Padding,
                         count_include_pad: bool = True) -> jax.Array:
    """NCHW average pooling in `lax`; padding counts as 0, and as a divisor
    element only if `count_include_pad`."""
    total = _reduce_window(x, 0.0, lax.add, window, stride, padding)
    if count_include_pad:
        return total / (window[0] * window[1])
    ones = jnp.ones(x.shape[2:], x.dtype)[None, None]
    return total / _reduce_window(ones, 0.0, lax.add, window, stride, padding)


def global_avg_pool2d_reference(x: jax.Array) -> jax.Array:
    """Mean over H and W, kept as (N, C, 1, 1)."""
    return jnp.mean(x, axis=(2, 3), keepdims=True)


def _pool_call(target: str, out_shape, x, reference: Callable, *more, **attrs) -> jax.Array:
    """`target` on x (and the constant operands `more`), gradients of `reference`."""
    out = jax.ShapeDtypeStruct(out_shape, jnp.float32)

    def kernel(x):
        return _call(target, out, x, *more, vmap_method="broadcast_all", **attrs)

    return _with_reference_vjp(kernel, reference)(x)


def _pool_attr(window: Pair, stride: Pair, padding: Padding) -> np.ndarray:
    return np.array([*window, *stride, *padding[0], *padding[1]], np.int64)


def max_pool2d(x: jax.Array, window: Pair, stride: Pair, padding: Padding = ((0, 0), (0, 0))) -> jax.Array:
    """NCHW max pooling by the C kernel (padding counts as -inf, NaN propagates)."""
    window, stride, padding = _pool_config(window, stride, padding)
    out_shape = _pool_out_shape("max_pool2d", x, window, stride, padding)
    reference = lambda x: max_pool2d_reference(x, window, stride, padding)  # noqa: E731
    return _pool_call("jtile_max_pool2d", out_shape, x, reference, pool=_pool_attr(window, stride, padding))


def avg_pool2d(x: jax.Array, window: Pair, stride: Pair, padding: Padding = ((0, 0), (0, 0)),
               count_include_pad: bool = True,
               prologue: tuple[jax.Array, jax.Array, jax.Array, str | None] | None = None) -> jax.Array:
    """NCHW average pooling by the C kernel; see `avg_pool2d_reference`.

    `prologue=(shift, scale, bias, activation)`, each `(C,)`, `(1,)` or None
    (an identity), pools `activation((x - shift) * scale + bias)` (activation
    None, "relu" or "relu6") without writing it: a folded batch norm and its ReLU, applied as
    the kernel reads x (padding stays 0). Not for a window that is the whole
    image (use `global_avg_pool2d` after applying it)."""
    window, stride, padding = _pool_config(window, stride, padding)
    out_shape = _pool_out_shape("avg_pool2d", x, window, stride, padding)
    attrs = dict(pool=_pool_attr(window, stride, padding), count_include_pad=np.int64(bool(count_include_pad)))
    if prologue is None:
        attrs["prologue_activation"] = np.int64(0)
        reference = lambda x: avg_pool2d_reference(x, window, stride, padding, count_include_pad)  # noqa: E731
        return _pool_call("jtile_avg_pool2d", out_shape, x, reference, *(np.zeros((0,), np.float32),) * 3, **attrs)
    whole = out_shape[2:] == (1, 1) and window == jnp.shape(x)[2:] and not any(map(any, padding))
    prologue = _prologue_arrays("avg_pool2d", "pool", prologue, jnp.shape(x)[1],
                                "the window is the whole image" if whole else None)
    attrs["prologue_activation"] = np.int64(_ACTIVATIONS[prologue[3]])

    def kernel(x, shift, scale, bias):
        return _call("jtile_avg_pool2d", jax.ShapeDtypeStruct(out_shape, jnp.float32), x, shift, scale, bias,
                     vmap_method="sequential", **attrs)

    def reference(x, shift, scale, bias):
        return avg_pool2d_reference(_apply_prologue(x, shift, scale, bias, prologue[3]), window, stride, padding,
                                    count_include_pad)

    return _with_reference_vjp(kernel, reference)(x, *prologue[:3])


def global_avg_pool2d(x: jax.Array) -> jax.Array:
    """Mean over H and W of NCHW `x` by the C kernel, shape (N, C, 1, 1)."""
    _require_float32("global_avg_pool2d", x=x)
    _require_rank("global_avg_pool2d", "x", x, 4)
    return _pool_call("jtile_global_avg_pool2d", (*jnp.shape(x)[:2], 1, 1), x, global_avg_pool2d_reference)


# ------------------------------------------------------------------ resize


def resize2d_reference(x: jax.Array, rows: np.ndarray, row_weights: np.ndarray, cols: np.ndarray,
                       col_weights: np.ndarray) -> jax.Array:
    """`resize2d` in jnp: along H, then along W, each output the sum over its
    taps of input times weight."""
    def along(x, axis, index, weights):
        terms = [jnp.take(x, index[:, t], axis=axis)
                 * jnp.expand_dims(jnp.asarray(weights[:, t], x.dtype), tuple(range(axis + 1 - x.ndim, 0)))
                 for t in range(index.shape[1])]
        return functools.reduce(operator.add, terms)

    return along(along(x, x.ndim - 2, rows, row_weights), x.ndim - 1, cols, col_weights)


def resize2d(x: jax.Array, rows: np.ndarray, row_weights: np.ndarray, cols: np.ndarray,
             col_weights: np.ndarray) -> jax.Array:
    """Separable resize of the last two axes of `x` by the C kernel: output
    row `i` is `sum_t x[..., rows[i, t], :] * row_weights[i, t]`, then column
    `j` of it `sum_t row[cols[j, t]] * col_weights[j, t]` (taps `(out, n)`,
    indices inside the input; `jtile._resize.axis_taps` computes them for
    every ONNX Resize mode)."""
    _require_float32("resize2d", x=x)
    tables = [np.asarray(t) for t in (rows, row_weights, cols, col_weights)]
    rows, row_weights, cols, col_weights = tables
    if rows.ndim != 2 or rows.shape != row_weights.shape or cols.ndim != 2 or cols.shape != col_weights.shape:
        raise ConfigError("resize2d: rows / row_weights and cols / col_weights must be (out, taps) pairs of one shape")
    h, w = jnp.shape(x)[-2:]
    if rows.min() < 0 or rows.max() >= h or cols.min() < 0 or cols.max() >= w:
        raise ConfigError(f"resize2d: tap indices must lie inside the {h}x{w} input; clamp them first")
    out = jax.ShapeDtypeStruct((*jnp.shape(x)[:-2], rows.shape[0], cols.shape[0]), jnp.float32)
    attrs = dict(taps=np.array([rows.shape[1], cols.shape[1]], np.int64), rows=rows.astype(np.int64).ravel(),
                 row_weights=row_weights.astype(np.float32).ravel(), cols=cols.astype(np.int64).ravel(),
                 col_weights=col_weights.astype(np.float32).ravel())

    def kernel(x):
        return _call("jtile_resize2d", out, x, vmap_method="broadcast_all", **attrs)

    return _with_reference_vjp(kernel, lambda x: resize2d_reference(x, *tables))(x)


def softmax_reference(x: jax.Array) -> jax.Array:
    """`softmax` in jnp: `jax.nn.softmax` over the last axis."""
    return jax.nn.softmax(x, axis=-1)


def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis of `x` by the C kernel: `exp(x - max) / sum`
    per row, a row's passes in L1 (attention's probabilities)."""
    _require_float32("softmax", x=x)
    if jnp.ndim(x) < 1:
        raise ConfigError("softmax: x must have an axis to normalise over; it is a scalar")

    def kernel(x):
        return _call("jtile_softmax", jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32), x, vmap_method="broadcast_all")

    return _with_reference_vjp(kernel, softmax_reference)(x)


def layer_norm_reference(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """`layer_norm` in jnp: `(x - mean) / sqrt(var + epsilon) * scale + bias`
    over the last axis, the variance of the centred values."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    return centred * lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + epsilon) * scale + bias


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *, epsilon: float = 1e-5) -> jax.Array:
    """Layer norm over the last axis of `x` by the C kernel, with `scale` and
    `bias` (None: zero) of one value per column or one in all (a
    transformer block's norms)."""
    _require_float32("layer_norm", x=x, scale=scale, bias=bias)
    n = jnp.shape(x)[-1] if jnp.ndim(x) else None
    bias = jnp.zeros((), jnp.float32) if bias is None else bias
    for name, v in (("scale", scale), ("bias", bias)):
        if n is None or jnp.size(v) not in (1, n) or jnp.ndim(v) > 1:
            raise ConfigError(f"layer_norm: {name} must hold one value or one per column of x's last axis "
                              f"({n}); it has shape {jnp.shape(v)} for x of shape {jnp.shape(x)}")

    def kernel(x, scale, bias):
        return _call("jtile_layer_norm", jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32), x,
                     jnp.ravel(scale), jnp.ravel(bias), vmap_method="broadcast_all", epsilon=np.float32(epsilon))

    return _with_reference_vjp(kernel, functools.partial(layer_norm_reference, epsilon=epsilon))(x, scale, bias)


def gather_planes_reference(x: jax.Array, planes: Sequence[int]) -> jax.Array:
    """`gather_planes` in jnp: `x[:, planes]`."""
    return jnp.take(x, np.asarray(planes, np.int32), axis=1)


def gather_planes(x: jax.Array, planes: Sequence[int]) -> jax.Array:
    """`x[:, planes]` for `x` of shape (N, C, ...) by the C kernel, which copies
    whole planes in the order `planes` gives (a channel shuffle and split,
    ShuffleNetV2's); `planes` are channel indices in [0, C), known at trace time."""
    _require_float32("gather_planes", x=x)
    shape = jnp.shape(x)
    picked = np.asarray(planes)
    picked = picked.astype(np.int64) if picked.size == 0 else picked  # ([] reads as floats)
    if len(shape) < 2 or picked.ndim != 1 or not np.issubdtype(picked.dtype, np.integer) or (
            picked.size and not (0 <= picked.min() and picked.max() < shape[1])):
        raise ConfigError(f"gather_planes: planes must be a list of channel indices in [0, C) for x of shape "
                          f"(N, C, ...); got x of shape {shape} and planes {planes!r}")
    out = jax.ShapeDtypeStruct((shape[0], picked.size, *shape[2:]), jnp.float32)
    if picked.size == 0:
        return jnp.zeros(out.shape, jnp.float32)

    def kernel(x):
        return _call("jtile_gather_planes", out, x, vmap_method="sequential", planes=picked.astype(np.int64))

    return _with_reference_vjp(kernel, lambda x: gather_planes_reference(x, picked))(x)


def _describe_resize_call(eqn):
    channels = eqn.invars[0].aval.shape[1] if eqn.invars[0].aval.ndim > 1 else 1
    return _layer(eqn, "resize", in_channels=channels, out_channels=channels)


def _resize_call_macs(eqn):
    """Output elements x taps per axis (the H pass writes OH x W rows)."""
    taps = [int(t) for t in _attribute(eqn, "taps")]
    x, y = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    return Counter({"elementwise": math.prod(y[:-1]) * x[-1] * taps[0] + math.prod(y) * taps[1]})


_registry.register("ffi_call:jtile_dense", describe=_describe_dense_call, macs=_call_macs,
                   weights=(1, 2), activations=(0,))
_registry.register("ffi_call:jtile_matmul", describe=lambda eqn: _layer(eqn, "matmul"),
                   macs=lambda eqn: Counter({"dense": math.prod(int(d) for d in _attribute(eqn, "dims"))}),
                   activations=(0, 1))
_registry.register("ffi_call:jtile_resize2d", describe=_describe_resize_call, macs=_resize_call_macs,
                   activations=(0,))
for _kind in ("max", "avg", "global"):
    _name = "jtile_global_avg_pool2d" if _kind == "global" else f"jtile_{_kind}_pool2d"
    _registry.register(f"ffi_call:{_name}", describe=_describe_pool_call(_kind), macs=_call_macs,
                       activations=(0,))

_registry.register("ffi_call:jtile_softmax", describe=describe_as("softmax"), macs=element_macs("activation"),
                   activations=(0,))
_registry.register("ffi_call:jtile_layer_norm", describe=describe_as("layer_norm"), macs=element_macs("norm"),
                   weights=(1, 2), activations=(0,))
_registry.register("ffi_call:jtile_gather_planes", macs=lambda eqn: Counter(), activations=(0,))

LIBRARY_PATH, _UNAVAILABLE = _load_library()


__all__ = [
    "Pair", "Padding", "LIBRARY_ENV", "activation_reference", "library_candidates",
    "kernel_unavailable", "warn_if_unavailable", "call_times", "CallTimes", "KernelCall", "ConvSpec", "ConvAlgorithm",
    "register_conv_algorithm", "conv2d_reference", "conv2d_support", "conv2d", "conv2d_writes_into",
    "conv2d_reads_prefix", "gemm_tile",
    "smm_pixel_rows", "pack_gemm_weight", "to_nchwc", "from_nchwc", "nchwc_shape",
    "conv2d_nchwc_support", "expanded_depthwise_support", "expanded_depthwise_conv2d", "vector_lanes",
    "dense_reference", "GEMV_ROWS", "dense",
    "matmul_reference", "matmul", "matmul_stored_axes",
    "max_pool2d_reference", "avg_pool2d_reference", "global_avg_pool2d_reference", "max_pool2d",
    "avg_pool2d", "global_avg_pool2d", "resize2d_reference", "resize2d", "softmax_reference", "softmax",
    "layer_norm_reference", "layer_norm", "gather_planes_reference", "gather_planes", "LIBRARY_PATH"
]
