"""AlexNet as torchvision builds it (`torchvision.models.alexnet`).

`features` (five convs, three 3x3/2 max pools), `avgpool`
(`AdaptiveAvgPool2d((6, 6))`), `classifier` (dropout, 9216->4096->4096->classes).
61,100,840 parameters with 1000 classes. At 224x224 the features are already
6x6 and the adaptive pool is the identity; the smallest input is 63x63.
"""

import jax

from ._layers import AdaptiveAvgPool2d, Conv2d, Dropout, FeaturesClassifier, Linear, MaxPool2d, ReLU

_CONVS = {0: (3, 64, 11, 4, 2), 3: (64, 192, 5, 1, 2), 6: (192, 384, 3, 1, 1),
          8: (384, 256, 3, 1, 1), 10: (256, 256, 3, 1, 1)}  # index: in, out, kernel, stride, pad
_POOLS = (2, 5, 12)


class AlexNet(FeaturesClassifier):
    """torchvision's AlexNet; input (N, 3, 224, 224)."""

    def __init__(self, key: jax.Array, *, num_classes: int = 1000):
        keys = iter(jax.random.split(key, 8))
        features = []
        for i in range(13):
            name = f"features.{i}"
            if i in _CONVS:
                cin, cout, k, s, p = _CONVS[i]
                features.append(Conv2d(cin, cout, k, stride=s, padding=p, key=next(keys), name=name))
            elif i in _POOLS:
                features.append(MaxPool2d(3, 2, name=name))
            else:
                features.append(ReLU(name=name))
        self.features = tuple(features)
        self.avgpool = AdaptiveAvgPool2d(6, name="avgpool")
        self.classifier = (
            Dropout(0.5, name="classifier.0"),
            Linear(256 * 6 * 6, 4096, key=next(keys), name="classifier.1"),
            ReLU(name="classifier.2"),
            Dropout(0.5, name="classifier.3"),
            Linear(4096, 4096, key=next(keys), name="classifier.4"),
            ReLU(name="classifier.5"),
            Linear(4096, num_classes, key=next(keys), name="classifier.6"),
        )


__all__ = ["AlexNet"]
