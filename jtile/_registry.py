"""The op registry: what jtile knows about one primitive, in one entry.

One `OpEntry` per JAX primitive, per jtile fused op (`conv_bias_act`,
`dense`) and per jtile kernel target (`ffi_call:jtile_conv_smm`, ...). Its
facets, each optional:

- `geometry(eqn)`: its shapes and windows parsed once (`jtile._geometry`:
  `ConvGeometry`, `DotGeometry`, `PoolGeometry`), which the other facets read;
- `macs(eqn) -> Counter`: multiply-accumulates by category (conv, dense,
  pool, norm, activation, elementwise); a layout op counts an empty Counter;
- `describe(eqn) -> jtile.Layer`: the layer a selector or `select=` sees;
- `region`: the receptive-field rule spatial tiling propagates windows with;
- `stripes`: how `shard_spatial` cuts a windowed op (a conv, a pool) into
  stripes along a spatial axis: layouts, padding, fill and global reduction;
- `onnx(graph, eqn, *inputs)`: the ONNX emitter `jtile.onnx.export` calls;
- `view(eqn, out) -> ViewStep | None`: for a layout op (a transpose, reshape,
  slice, split, or a multiplication by one number), how its output `out`
  reads an operand in place (`jtile._views`), so a kernel can read through it;
- `weights`, `activations`: operand positions read as weights (a conv
  kernel, a fused bias) and as activations, from which `jtile.Graph` tells
  parameters from inputs.

A module registers the facets of the ops it defines or knows, next to their
definition: `register("conv_bias_act", describe=..., macs=...)`. Registering
a facet twice for one op is an error, so two modules never disagree.

!!! warning

    The registry holds facts about primitives; it never changes what a
    primitive computes. An op with no entry is still run, exported if it has
    an emitter, and counted as "uncounted" by the analysis.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

FACETS = ("geometry", "macs", "describe", "region", "stripes", "onnx", "view", "weights", "activations")


@dataclasses.dataclass
class OpEntry:
    """Every fact jtile has about one op (see the module docstring)."""

    name: str
    geometry: Callable | None = None
    macs: Callable | None = None
    describe: Callable | None = None
    region: Any = None
    stripes: Any = None
    onnx: Callable | None = None
    view: Callable | None = None
    weights: tuple[int, ...] | None = None
    activations: tuple[int, ...] | None = None

    def facets(self) -> tuple[str, ...]:
        return tuple(f for f in FACETS if getattr(self, f) is not None)


_ENTRIES: dict[str, OpEntry] = {}


def register(name: str, **facets) -> OpEntry:
    """Add `facets` to the entry of op `name` (a primitive name, or
    `"ffi_call:<target>"` for a kernel target), creating it if needed."""
    entry = _ENTRIES.setdefault(name, OpEntry(name))
    for facet, value in facets.items():
        if facet not in FACETS:
            raise TypeError(f"register: unknown facet {facet!r}; facets are {', '.join(FACETS)}")
        if getattr(entry, facet) is not None:
            raise ValueError(f"register: {name!r} already has a {facet!r} facet")
        setattr(entry, facet, value)
    return entry


def key(eqn) -> str:
    """The registry key of an equation: its primitive, or `ffi_call:<target>`."""
    name = eqn.primitive.name
    return f"ffi_call:{eqn.params['target_name']}" if name == "ffi_call" else name


def lookup(eqn) -> OpEntry | None:
    """The entry of `eqn`'s op, or None."""
    return _ENTRIES.get(key(eqn))


def facet(eqn, name: str):
    """One facet of `eqn`'s entry, or None."""
    entry = lookup(eqn)
    return None if entry is None else getattr(entry, name)


def entries() -> dict[str, OpEntry]:
    """Every registered entry, by name."""
    return dict(_ENTRIES)
