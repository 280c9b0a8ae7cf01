"""The model zoo by name: `get`, `NAMES` and each model's default input shape."""

import inspect

import equinox as eqx
import jax

from .._errors import ConfigError, require_positive_int
from .ai3 import AI3ConvNet
from .alexnet import AlexNet
from .googlenet import GoogLeNet
from .mobilenet import MobileNetV2
from .resnet import ResNet18
from .tutorial import Tutorial
from .vgg import VGG16

# name: (model class, default batch, default spatial size)
_ZOO = {
    "tutorial": (Tutorial, 4, 66),
    "ai3_convnet": (AI3ConvNet, 1, 224),
    "alexnet": (AlexNet, 1, 224),
    "vgg16": (VGG16, 1, 224),
    "resnet18": (ResNet18, 1, 224),
    "mobilenet_v2": (MobileNetV2, 1, 224),
    "googlenet": (GoogLeNet, 1, 224),
}
NAMES: tuple[str, ...] = tuple(_ZOO)


def _entry(name: str):
    if name not in _ZOO:
        raise ConfigError(f"jtile.models: unknown model {name!r}; valid names are {', '.join(NAMES)}")
    return _ZOO[name]


def get(name: str, key: jax.Array | None = None, **kwargs) -> eqx.Module:
    """Build the model called `name` from `key` (default `jax.random.key(0)`).

    `kwargs` go to the model's constructor (e.g. `num_classes=10`).
    """
    cls = _entry(name)[0]
    key = jax.random.key(0) if key is None else key
    try:
        inspect.signature(cls).bind(key, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"jtile.models.get({name!r}): {e}; the signature is {cls.__name__}{inspect.signature(cls)}"
        ) from None
    return cls(key, **kwargs)


def input_shape(name: str, batch: int | None = None, size: int | None = None) -> tuple[int, int, int, int]:
    """The NCHW input shape of model `name`: (4, 3, 66, 66) for "tutorial", else (1, 3, 224, 224).

    `batch` and `size` (height = width) override the defaults.
    """
    _, default_batch, default_size = _entry(name)
    batch = default_batch if batch is None else require_positive_int("input_shape", "batch", batch)
    size = default_size if size is None else require_positive_int("input_shape", "size", size)
    return (batch, 3, size, size)
