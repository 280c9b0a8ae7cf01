"""jtile: rewrite JAX inference functions before XLA compiles them."""

__version__ = "0.1.0"

from . import algorithms as algorithms
from . import fusion as fusion
from . import kernels as kernels
from . import models as models
from . import onnx as onnx
from ._errors import ConfigError as ConfigError
from ._errors import JtileError as JtileError
from ._errors import KernelsUnavailableWarning as KernelsUnavailableWarning
from ._errors import StaleKernelsWarning as StaleKernelsWarning
from ._errors import OnnxError as OnnxError
from ._errors import UnsupportedError as UnsupportedError
from ._graph import Graph as Graph
from ._graph import graph as graph
from ._jit import jit as jit
from ._layers import Layer as Layer
from .algorithms import swap_backend as swap_backend
from .algorithms import swap_conv2d as swap_conv2d
from .analysis import Summary as Summary
from .analysis import intercept as intercept
from .analysis import summary as summary
from .fusion import fold_params as fold_params
from .fusion import fuse as fuse
from .gemm import split_gemm as split_gemm
from .schedule import Schedule as Schedule
from .schedule import schedule as schedule
from .sharding import shard_spatial as shard_spatial
from .tiling import tile_conv as tile_conv
from .spatial import tile_spatial as tile_spatial

__all__ = [
    "ConfigError", "JtileError", "KernelsUnavailableWarning", "Graph", "Layer", "OnnxError", "Summary",
    "Schedule", "StaleKernelsWarning", "UnsupportedError", "__version__", "algorithms", "fold_params", "fuse", "fusion", "graph", "intercept",
    "jit", "kernels", "models", "onnx", "schedule", "shard_spatial", "split_gemm", "summary", "swap_backend",
    "swap_conv2d", "tile_conv", "tile_spatial",
]
