"""Max pools computed inside the conv kernel that feeds them.

The image stem of ResNet, GoogLeNet and DenseNet is a 7x7 stride-2 conv, a
ReLU, then a 3x3 stride-2 max pool: the conv's 64x112x112 output (3.2 MB)
is written out only for the pool to read it back, and inside a model both go
to memory. When the conv runs on a kernel that pools its own output
(`jtile.kernels.conv2d(max_pool=...)`), the pool reads nothing else's output
and `swap_backend` swapped the pool too, the conv's call returns the pooled
output and the pool's equation passes it on. The bits are those of the two
calls: each conv output sums its taps in the same order, and a max is exact.
"""

from ._graph import Graph
from ._regions import pool_axes


def find_pooled_convs(graph: Graph, fuses) -> dict[int, object]:
    """`{id(conv eqn): pool eqn}` over the top-level NCHW max pools whose input
    is a conv's output read by nothing else; `fuses(conv_eqn, pool_eqn)` says
    whether both are swapped and the conv's kernel can pool this layer."""
    return {id(conv.eqn): pool.eqn for conv, pool in graph.sole_readers("maxpool2d")
            if pool_axes(pool.eqn) == (2, 3) and fuses(conv.eqn, pool.eqn)}
