"""The model zoo: equinox modules with torchvision's layer names, shapes and parameter counts.

Every model is built as `Model(key)` (or `jtile.models.get(name, key)`), takes
NCHW float32 input and is also a pure function over its parameters:
`fn, params = jtile.models.as_function(model)`; `fn(params, x) == model(x)`.
"""

from ._layers import AdaptiveAvgPool2d as AdaptiveAvgPool2d
from ._layers import AvgPool2d as AvgPool2d
from ._layers import BatchNorm2d as BatchNorm2d
from ._layers import Buffer as Buffer
from ._layers import Conv2d as Conv2d
from ._layers import Dropout as Dropout
from ._layers import LeakyReLU as LeakyReLU
from ._layers import Linear as Linear
from ._layers import MaxPool2d as MaxPool2d
from ._layers import ReLU as ReLU
from ._layers import ReLU6 as ReLU6
from ._registry import NAMES as NAMES
from ._registry import get as get
from ._registry import input_shape as input_shape
from ._tree import ParamCount as ParamCount
from ._tree import as_function as as_function
from ._tree import count_params as count_params
from ._tree import load_state_dict as load_state_dict
from ._tree import state_dict as state_dict
from ._tree import trainable_mask as trainable_mask
from .ai3 import AI3ConvNet as AI3ConvNet
from .alexnet import AlexNet as AlexNet
from .googlenet import GoogLeNet as GoogLeNet
from .mobilenet import MobileNetV2 as MobileNetV2
from .resnet import ResNet18 as ResNet18
from .tutorial import Tutorial as Tutorial
from .vgg import VGG16 as VGG16

__all__ = [
    "AdaptiveAvgPool2d", "AvgPool2d", "BatchNorm2d", "Buffer", "Conv2d", "Dropout", "LeakyReLU",
    "Linear", "MaxPool2d", "ReLU", "ReLU6", "NAMES", "get", "input_shape", "ParamCount",
    "as_function", "count_params", "load_state_dict", "state_dict", "trainable_mask",
    "AI3ConvNet", "AlexNet", "GoogLeNet", "MobileNetV2", "ResNet18", "Tutorial", "VGG16"
]
