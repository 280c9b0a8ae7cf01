"""Per-layer timing of the grouped and depthwise convs of torchvision models.

Every distinct conv with groups > 1 in the chosen models (batch 1, 224x224),
timed as: the jtile kernels named by `--algorithms` (default: depthwise) and XLA
(`lax.conv_general_dilated` with the weight a constant), each inside a jitted
`fori_loop` (the time per step), and ONNX Runtime running a one-node Conv
(group=C, 2 threads) by its own per-node profiler (its kernels only).
Prints GFLOP/s per engine and the ratios peer time / jtile time.

Usage: python benchmarks/profile_grouped_convs.py [--models efficientnet_b0 ...]
       [--algorithms depthwise smm] [--rounds 30]
"""

import argparse
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from onnx import TensorProto, helper, numpy_helper

from jtile import kernels

THREADS = 2


def conv_layers(model: str) -> list[dict]:
    """The distinct grouped convs of torchvision `model` at batch 1, 224x224."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import torchvision
    net = getattr(torchvision.models, model)(weights=None).eval()
    found = {}

    def hook(module, inputs, output):
        if module.groups == 1:
            return
        key = (tuple(inputs[0].shape), tuple(module.weight.shape), module.stride, module.padding,
               module.dilation, module.groups)
        found.setdefault(key, 0)
        found[key] += 1

    for m in net.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.inference_mode():
        net(torch.zeros(1, 3, 224, 224))
    return [dict(x_shape=k[0], w_shape=k[1], stride=k[2], padding=((k[3][0],) * 2, (k[3][1],) * 2),
                 dilation=k[4], groups=k[5], count=n, model=model) for k, n in found.items()]


def _ort_conv(layer, w, b):
    import onnxruntime as ort

    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=list(w.shape[2:]),
                            strides=list(layer["stride"]), dilations=list(layer["dilation"]),
                            pads=[layer["padding"][0][0], layer["padding"][1][0],
                                  layer["padding"][0][1], layer["padding"][1][1]],
                            group=layer["groups"])
    graph = helper.make_graph(
        [node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, layer["x_shape"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.enable_profiling = True
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session


def _looped(conv, x, reps):
    """`conv` applied to `x` `reps` times in one jitted loop: the time of a layer
    as it runs inside a model, without Python's dispatch. An optimization
    barrier ties each step's input to the previous step's output, so XLA can
    neither hoist the call out of the loop nor run only the last one."""

    def body(_, carry):
        x, _ = carry
        return lax.optimization_barrier((x, conv(x)))

    out = jax.eval_shape(conv, x)
    f = jax.jit(lambda x: lax.fori_loop(0, reps, body, (x, jnp.zeros(out.shape, out.dtype)))[1])
    return lambda: jax.block_until_ready(f(x))


def _ort_kernel_seconds(session, x, runs):
    """ONNX Runtime's own per-node timings: the fastest run's summed kernel time."""
    import json

    for _ in range(runs):
        session.run(None, {"x": x})
    path = session.end_profiling()
    events = json.load(open(path))
    os.remove(path)
    per_run, current = [], 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            current += e["dur"] * 1e-6
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            per_run.append(current)
            current = 0.0
    return min(per_run[1:])


def time_layer(layer, algorithms, rounds, reps=20):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(layer["x_shape"], dtype=np.float32)
    w = (rng.standard_normal(layer["w_shape"]) / np.sqrt(np.prod(layer["w_shape"][1:]))).astype(np.float32)
    b = rng.standard_normal(layer["w_shape"][0], dtype=np.float32)
    geometry = dict(stride=layer["stride"], padding=layer["padding"], dilation=layer["dilation"],
                    groups=layer["groups"])
    jx, jw, jb = jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)
    convs = {}
    for name in algorithms:
        reason = kernels.conv2d_support(name, x_shape=x.shape, w_shape=w.shape, dtype=np.float32, **geometry)
        if reason is None:
            convs[name] = lambda x, name=name: kernels.conv2d(x, jw, jb, algorithm=name, **geometry,
                                                              activation="relu")
    convs["xla"] = lambda x: jax.nn.relu(lax.conv_general_dilated(
        x, jw, layer["stride"], layer["padding"], rhs_dilation=layer["dilation"],
        feature_group_count=layer["groups"], dimension_numbers=("NCHW", "OIHW", "NCHW"))
        + jb[None, :, None, None])
    session = _ort_conv(layer, w, b)
    expected = np.maximum(session.run(None, {"x": x})[0], 0)
    for name, conv in convs.items():
        got = np.asarray(jax.jit(conv)(jx))
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
    runners = {name: _looped(conv, jx, reps) for name, conv in convs.items()}
    for run in runners.values():
        run()
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / reps)
    best = {name: min(t) for name, t in times.items()}
    best["ort"] = _ort_kernel_seconds(session, x, rounds)
    n, o, oh, ow = expected.shape
    flops = 2 * n * o * oh * ow * np.prod(w.shape[1:])
    return best, flops


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["efficientnet_b0", "mobilenet_v3_large"])
    parser.add_argument("--algorithms", nargs="+", default=["depthwise"])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    layers = [layer for model in args.models for layer in conv_layers(model)]
    totals = {}
    for layer in layers:
        times, flops = time_layer(layer, args.algorithms, args.rounds)
        first = next(a for a in args.algorithms if a in times)
        k = layer["w_shape"][2:]
        desc = (f"{layer['model'][:12]:12s} x{layer['count']} {str(layer['x_shape']):18s} k{k[0]}x{k[1]} "
                f"s{layer['stride'][0]} g{layer['groups']:4d} o{layer['w_shape'][0]:4d}")
        cols = "  ".join(f"{name} {t * 1e3:7.3f}ms {flops / t / 1e9:6.1f}GF" for name, t in times.items())
        ratios = "  ".join(f"{name}/{first} {times[name] / times[first]:5.2f}" for name in times if name != first)
        print(f"{desc}  {cols}  {ratios}", flush=True)
        for name, t in times.items():
            totals[name] = totals.get(name, 0.0) + t * layer["count"]
    print("total per model set (ms, each layer x its count): "
          + "  ".join(f"{name} {t * 1e3:.3f}" for name, t in totals.items()))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
