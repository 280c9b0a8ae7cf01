"""Average pools moved in front of the 1x1 conv they read.

DenseNet's transitions halve the image after a 1x1 conv: `avg_pool2x2(conv1x1(x)
+ b)`. A 1x1 conv with no activation after it is linear per pixel, so averaging
its input first gives the same result (up to rounding) for a quarter of the
MACs: 3 of DenseNet-121's 120 convs, 11% of its MACs. `swap_backend` pools the
conv's input by the pool's own algorithm (its kernel where swapped: XLA's
`reduce_window`, fused with the batch norm and ReLU before it, took 0.4-1.1
ms a transition) and runs the conv on the pooled image; the pool's equations
pass the conv's output on. The conv's prologue chain, if any
(`jtile._conv_prologue`), goes to the pool's kernel.
"""

from ._graph import Graph
from ._regions import pool_axes


def find_pools_first(graph: Graph, avg_pools: dict[int, int], linear_pointwise) -> dict[int, object]:
    """`{id(conv eqn): sum-pool eqn}` for the top-level unpadded NCHW average
    pools (`avg_pools`: sum eqn id -> its division's id) whose input is the
    output of a conv that nothing else reads and for which
    `linear_pointwise(conv eqn)` holds."""
    found = {}
    for op in graph.ops:
        if id(op.eqn) not in avg_pools or op.primitive != "reduce_window_sum" or pool_axes(op.eqn) != (2, 3):
            continue
        p = op.eqn.params
        dilations = (*p["base_dilation"], *p["window_dilation"])
        if any(lo or hi for lo, hi in p["padding"]) or any(d != 1 for d in dilations) or max(p["window_strides"]) == 1:
            continue
        value = op.ins[0]
        producer = value.producer
        if producer is not None and value.consumers == [op] and not value.is_output and linear_pointwise(producer.eqn):
            found[id(producer.eqn)] = op.eqn
    return found
