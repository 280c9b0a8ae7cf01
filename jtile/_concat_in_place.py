"""Concatenations whose branches write their parts in place.

A concatenation along channels of conv outputs (SqueezeNet's fire modules,
GoogLeNet's inception blocks) costs a copy of every part. When a part is a conv
`swap_backend` runs on a kernel that can write into a larger buffer
(`jtile.kernels.conv2d(into=...)`), and nothing else reads the part, the kernel
writes its channels straight into the concatenation's buffer: the first such
part creates the buffer, each later one writes into the buffer the previous one
returned (the call's output aliases it, so XLA copies nothing), and the other
parts are copied in with `dynamic_update_slice` at the concatenation.

Only one image (batch 1) and NCHW outputs: there a part's channels are one
contiguous run of the buffer. And only where the parts written in place hold at
least half the channels: DenseNet's concatenations (each layer's 32 new
channels after up to 992 copied) ran 0.99x as fast in place, SqueezeNet's
(every part in place) 1.06x, ShuffleNetV2's (half) 1.02x.
"""

import dataclasses

from ._graph import Graph


@dataclasses.dataclass(frozen=True)
class Part:
    """A conv that writes channels `[channel0, channel0 + its own)` of the
    `channels`-channel output of the concatenation `concat` (an equation id)."""

    concat: int
    channel0: int
    channels: int


def find_parts(graph: Graph, writes_into) -> dict[int, Part]:
    """`{id(conv eqn): Part}` over the top-level concatenations along axis 1 of
    4-D, one-image outputs; `writes_into(eqn)` says whether a conv's kernel can
    write into the buffer (swapped, and its output fits)."""
    parts = {}
    for op in graph.ops:
        if op.primitive != "concatenate" or op.eqn.params["dimension"] != 1:
            continue
        (out,) = op.outs
        if len(out.shape) != 4 or out.shape[0] != 1:
            continue
        found, channel0, in_place = {}, 0, 0
        for value in op.ins:
            producer = value.producer
            if (producer is not None and value.consumers == [op] and not value.is_output
                    and op.ins.count(value) == 1 and writes_into(producer.eqn)):
                found[id(producer.eqn)] = Part(id(op.eqn), channel0, out.shape[1])
                in_place += value.shape[1]
            channel0 += value.shape[1]
        if 2 * in_place >= out.shape[1]:
            parts.update(found)
    return parts
