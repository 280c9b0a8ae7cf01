"""Depthwise convs that compute the 1x1 conv feeding them.

The inverted residual block of MobileNetV2/V3 and EfficientNet expands c
channels to C = 4c-6c with a 1x1 conv, then runs a depthwise conv over them:
the expansion's output is the block's largest tensor (96x112x112, 4.8 MB, in
MobileNetV2), written out only for the depthwise conv to read it back. When
both are swapped and the depthwise kernel can run the pair
(`jtile.kernels.expanded_depthwise_conv2d`), the depthwise conv's call
computes the expansion band by band where it reads it, and the 1x1 conv's
equation passes its own input on.
"""

from ._graph import Graph


def find_expansions(graph: Graph, fuses) -> dict[int, object]:
    """`{id(depthwise conv eqn): 1x1 conv eqn}` over the top-level convs whose
    input is a conv's output read by nothing else; `fuses(expansion_eqn,
    conv_eqn)` says whether both are swapped and one call can run the pair."""
    return {id(conv.eqn): expansion.eqn for expansion, conv in graph.sole_readers("conv2d")
            if fuses(expansion.eqn, conv.eqn)}
