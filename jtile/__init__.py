"""jtile: rewrite JAX inference functions before XLA compiles them."""

from ._errors import ConfigError as ConfigError
from ._errors import JtileError as JtileError
from ._errors import OnnxError as OnnxError
from ._errors import UnsupportedError as UnsupportedError
from ._layers import Layer as Layer
from .tiling import tile_conv as tile_conv
from . import models as models
from .analysis import Summary as Summary
from .analysis import intercept as intercept
from .analysis import summary as summary
from . import fusion as fusion
from . import onnx as onnx
from .fusion import fuse as fuse
from .gemm import split_gemm as split_gemm
from . import kernels as kernels
