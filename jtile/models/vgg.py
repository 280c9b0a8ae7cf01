"""VGG-16 as torchvision builds it (`torchvision.models.vgg16`, configuration "D").

`features` (thirteen 3x3 convs with ReLU, five 2x2 max pools), `avgpool`
(`AdaptiveAvgPool2d((7, 7))`), `classifier` (25088->4096->4096->classes with
dropout). 138,357,544 parameters with 1000 classes. At 224x224 the features
are 7x7 and the adaptive pool is the identity; the smallest input is 32x32.
"""

import jax

from ._layers import AdaptiveAvgPool2d, Conv2d, Dropout, FeaturesClassifier, Linear, MaxPool2d, ReLU

_CFG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(FeaturesClassifier):
    """torchvision's VGG-16 (no batch norm); input (N, 3, 224, 224)."""

    def __init__(self, key: jax.Array, *, num_classes: int = 1000):
        keys = iter(jax.random.split(key, 16))
        features, cin = [], 3
        for v in _CFG_D:
            name = f"features.{len(features)}"
            if v == "M":
                features.append(MaxPool2d(2, 2, name=name))
                continue
            features.append(Conv2d(cin, v, 3, padding=1, key=next(keys), name=name))
            features.append(ReLU(name=f"features.{len(features)}"))
            cin = v
        self.features = tuple(features)
        self.avgpool = AdaptiveAvgPool2d(7, name="avgpool")
        self.classifier = (
            Linear(512 * 7 * 7, 4096, key=next(keys), name="classifier.0"),
            ReLU(name="classifier.1"),
            Dropout(0.5, name="classifier.2"),
            Linear(4096, 4096, key=next(keys), name="classifier.3"),
            ReLU(name="classifier.4"),
            Dropout(0.5, name="classifier.5"),
            Linear(4096, num_classes, key=next(keys), name="classifier.6"),
        )


__all__ = ["VGG16"]
