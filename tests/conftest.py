import itertools

import jax
import numpy as np
import pytest


@pytest.fixture
def getkey():
    """A function returning a fresh PRNG key on every call."""
    counter = itertools.count()
    return lambda: jax.random.fold_in(jax.random.key(0), next(counter))


def _tree_allclose(x, y, *, rtol=1e-5, atol=1e-6) -> bool:
    xs, xt = jax.tree.flatten(x)
    ys, yt = jax.tree.flatten(y)
    return xt == yt and all(
        np.shape(a) == np.shape(b) and np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
        for a, b in zip(xs, ys)
    )


@pytest.fixture
def tree_allclose():
    """`tree_allclose(x, y, rtol=, atol=)`: same structure, shapes, and values within tolerance."""
    return _tree_allclose
