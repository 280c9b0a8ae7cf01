"""Seed 002's example networks as JAX functions with one named scope per Aidge node.

`seed_lstm`: the LSTM of the seed (4 inputs, 8 hidden, 5 steps), unrolled;
each step has Aidge's 21 nodes: 8 FCs, 4 gate adds, 3 sigmoids, 2 tanhs,
3 muls and the cell add. `seed_convs`: the three 3x3 convs of the seed's
dataflow example, sizes kept ("SAME", 3 channels), for the line-by-line C-P model.

!!! warning

    Examples for the scheduler, not trained models: weights are random normals.
"""

import jax
import jax.numpy as jnp

GATES = ("i", "f", "g", "o")  # input, forget, cell candidate (tanh), output


def seed_lstm_params(key: jax.Array, inputs: int = 4, hidden: int = 8) -> dict:
    """Random `W` (input -> gate), `R` (hidden -> gate) and biases, one of each per gate."""
    keys = iter(jax.random.split(key, 4 * len(GATES)))
    params = {}
    for g in GATES:
        params[f"W{g}"] = jax.random.normal(next(keys), (inputs, hidden)) * 0.3
        params[f"R{g}"] = jax.random.normal(next(keys), (hidden, hidden)) * 0.3
        params[f"bW{g}"] = jax.random.normal(next(keys), (hidden,)) * 0.1
        params[f"bR{g}"] = jax.random.normal(next(keys), (hidden,)) * 0.1
    return params


def seed_lstm(params: dict, x: jax.Array, h: jax.Array, c: jax.Array) -> jax.Array:
    """The hidden state after `x.shape[0]` steps; `x` is (steps, batch, inputs), `h`, `c` (batch, hidden)."""
    outputs = []
    for t in range(x.shape[0]):
        with jax.named_scope(f"t{t}"):
            with jax.named_scope("pop"):
                xt = x[t]
            act = {}
            for g in GATES:
                with jax.named_scope(f"fc_x_{g}"):
                    a = xt @ params[f"W{g}"] + params[f"bW{g}"]
                with jax.named_scope(f"fc_h_{g}"):
                    b = h @ params[f"R{g}"] + params[f"bR{g}"]
                with jax.named_scope(f"add_{g}"):
                    s = a + b
                with jax.named_scope(f"{'tanh' if g == 'g' else 'sigmoid'}_{g}"):
                    act[g] = jnp.tanh(s) if g == "g" else jax.nn.sigmoid(s)
            with jax.named_scope("mul_fc"):
                fc = act["f"] * c
            with jax.named_scope("mul_ig"):
                ig = act["i"] * act["g"]
            with jax.named_scope("add_c"):
                c = fc + ig
            with jax.named_scope("tanh_c"):
                tc = jnp.tanh(c)
            with jax.named_scope("mul_h"):
                h = act["o"] * tc
            outputs.append(h)
    return jnp.stack(outputs)


def seed_convs_params(key: jax.Array) -> dict:
    keys = jax.random.split(key, 3)
    return {f"conv{i + 1}": jax.random.normal(k, (3, 3, 3, 3)) * 0.3 for i, k in enumerate(keys)}


def seed_convs(params: dict, x: jax.Array) -> jax.Array:
    """conv1 -> conv2 -> conv3, 3x3, stride 1, "SAME": every tensor keeps `x`'s shape."""
    for name in ("conv1", "conv2", "conv3"):
        with jax.named_scope(name):
            x = jax.lax.conv_general_dilated(x, params[name], (1, 1), "SAME")
    return x
