"""Gemm, MatMul and Einsum, lowered to `lax.dot_general` (`jnp.matmul`, `jnp.einsum`) so split_gemm sees a dot."""

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import register


@register("Gemm", since=1)
def gemm(node, a, b, c=None):
    if np.ndim(a) != 2 or np.ndim(b) != 2:
        raise node.fail(f"Gemm needs 2-D A and B, got shapes {np.shape(a)} and {np.shape(b)}")
    contract_a = 0 if node.attr("transA", 0) else 1
    contract_b = 1 if node.attr("transB", 0) else 0
    if np.shape(a)[contract_a] != np.shape(b)[contract_b]:
        raise node.fail(f"Gemm inner dimensions differ: A {np.shape(a)} (transA={node.attr('transA', 0)}), "
                        f"B {np.shape(b)} (transB={node.attr('transB', 0)})")
    y = lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())))
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    if alpha != 1.0:
        y = y * np.asarray(alpha, y.dtype)
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * np.asarray(beta, y.dtype))
    return y.astype(np.result_type(a.dtype))


@register("MatMul", since=1)
def matmul(node, a, b):
    return jnp.matmul(a, b)


@register("Einsum", since=12)
def einsum(node, *xs):
    equation = node.attr("equation")
    if not isinstance(equation, str) or not equation:
        raise node.fail("equation is required")
    return jnp.einsum(equation.replace(" ", ""), *xs)


__all__ = ["gemm", "matmul", "einsum"]
