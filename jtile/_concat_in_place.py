"""Concatenations assembled in one buffer that their parts write in place.

A concatenation along channels of conv outputs (SqueezeNet's fire modules,
GoogLeNet's inception blocks) costs a copy of every part. When a part is a conv
`swap_backend` runs on a kernel that can write into a larger buffer
(`jtile.kernels.conv2d(into=...)`), and nothing else reads the part, the kernel
writes its channels straight into the concatenation's buffer: the first such
part creates the buffer, each later one writes into the buffer the previous one
returned (the call's output aliases it, so XLA copies nothing), and the other
parts are copied in with `dynamic_update_slice` at the concatenation.

Concatenations that grow (DenseNet's dense blocks: layer k reads the
concatenation of the block's input and every earlier layer's output, each one
the previous one's operands and more) share the buffer of the last one. Every
part lands in it once, and each earlier concatenation is the buffer's first
channels: a conv whose kernel reads a prefix of its input's channels
(`conv2d(reads_prefix=True)`) gets the buffer itself, any other reader a copy
of those channels. Without this, DenseNet-121's concatenations copied 40 MB a
run (9% of its time).

Only one image (batch 1) and NCHW outputs: there a part's channels are one
contiguous run of the buffer, and so is a prefix. A single concatenation is
assembled in place only where the parts written in place hold at least half
its channels: DenseNet's (each layer's 32 new channels after up to 992 copied),
taken one by one, ran 0.99x as fast in place, SqueezeNet's (every part in place)
1.06x, ShuffleNetV2's (half) 1.02x.
"""

import dataclasses

from ._graph import Graph, Op


@dataclasses.dataclass(frozen=True)
class Part:
    """A conv that writes channels `[channel0, channel0 + its own)` of the
    `channels`-channel buffer of the concatenation `concat` (an equation id)."""

    concat: int
    channel0: int
    channels: int


@dataclasses.dataclass(frozen=True)
class Assembly:
    """A concatenation assembled in the buffer of the concatenation `buffer` (an
    equation id, its own if it is the last of a growing chain): its value is the
    buffer's first `channels` channels, handed on as the whole buffer when
    `whole` (it is the last, or every reader reads a prefix)."""

    buffer: int
    channels: int
    whole: bool


def find_parts(graph: Graph, writes_into, prefix_reader) -> tuple[dict[int, Part], dict[int, Assembly], set[int]]:
    """`({id(conv eqn): Part}, {id(concatenate eqn): Assembly}, {id(conv eqn)
    that reads a buffer's prefix})` over the top-level concatenations along
    axis 1 of 4-D, one-image outputs. `writes_into(eqn)` says whether a conv's
    kernel can write into the buffer (swapped, and its output fits);
    `prefix_reader(op, value)` gives the conv equation that reads `value`
    through `op` (the conv itself, or the end of a prologue chain `op` starts)
    if its kernel can read it as a prefix of a larger buffer, else None."""
    parts, assemblies, readers = {}, {}, set()
    for chain in _growing_chains(graph):
        last = chain[-1]
        found, channel0, in_place = {}, 0, 0
        members = {id(op) for op in chain}
        for value in last.ins:
            producer = value.producer
            if (producer is not None and not value.is_output and last.ins.count(value) == 1
                    and all(id(c) in members for c in value.consumers) and writes_into(producer.eqn)):
                found[id(producer.eqn)] = Part(id(last.eqn), channel0, last.outs[0].shape[1])
                in_place += value.shape[1]
            channel0 += value.shape[1]
        prefixes = {}
        for op in chain[:-1]:
            (value,) = op.outs
            convs = [prefix_reader(c, value) for c in value.consumers]
            if convs and not value.is_output and all(conv is not None for conv in convs):
                prefixes[id(op.eqn)] = {id(conv) for conv in convs}
        if (len(chain) == 1 and 2 * in_place < channel0) or (not found and not prefixes):
            continue
        parts.update(found)
        for op in chain:
            assemblies[id(op.eqn)] = Assembly(id(last.eqn), op.outs[0].shape[1], op is last or id(op.eqn) in prefixes)
        readers.update(*prefixes.values())
    return parts, assemblies, readers


def _growing_chains(graph: Graph) -> list[list[Op]]:
    """The candidate concatenations in program order, grouped into chains in
    which each one's operands start with all of the previous one's."""
    chains: list[list[Op]] = []
    for op in graph.ops:
        if op.primitive != "concatenate" or op.eqn.params["dimension"] != 1:
            continue
        (out,) = op.outs
        if len(out.shape) != 4 or out.shape[0] != 1:
            continue
        grows = next((chain for chain in chains if len(chain[-1].ins) < len(op.ins)
                      and all(a is b for a, b in zip(chain[-1].ins, op.ins))), None)
        if grows is None:
            chains.append([op])
        else:
            grows.append(op)
    return chains
