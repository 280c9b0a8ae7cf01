"""Where a real model's time goes, block by block: jtile against ONNX Runtime and OpenVINO, inside the model.

For a torchvision case of `bench_real.py` (exported to ONNX at opset 17), both
engines run the same graph at batch 1, and each reports its own per-op times:

- jtile: `jax.jit(swap_backend(fold_params(fn, params), algorithms="auto"))`;
  every thunk of the executable (a kernel's `ffi_call`, an XLA fusion, a
  concatenate) is named back to its ONNX node through the compiled HLO's
  `op_name` metadata. Kernel calls are timed by the kernels themselves
  (`jtile.kernels.call_times`, in the executable's order); the other thunks
  by `jax.profiler.trace`, whose figures for short calls read long (a 40 us
  depthwise conv showed as 60-100 us);
- ONNX Runtime (2 threads) with `enable_profiling`: its per-node kernel times,
  after its own fusions and NCHWc rewrite (a fused node is named after the
  tensor it writes, e.g. `.../conv.0.2/Clip_output_0_nchwc` for Conv + Clip);
- OpenVINO (CPU, latency hint, 2 threads, f32) with `enable_profiling`: the
  real time of each node it executed (a conv is named after its ONNX node
  with `/WithoutBiases` appended, a layout reorder after the node it feeds).

Nodes are grouped into blocks by their module path less its last two parts
(`/features/features.2/conv/conv.0/conv.0.0/Conv` and ONNX Runtime's fused
`/features/features.2/conv/conv.0/conv.0.2/Clip_output_0_nchwc` are both block
`/features/features.2/conv/conv.0`), since the engines fuse differently; a
node two levels deep keeps its module (`/features/features.0/Conv` is block
`/features/features.0`, and ONNX Runtime may name the same fused stem after
its activation, `/features/features.1`). The
table gives each block's median time per run in each engine, largest gap to
the faster peer first, and the totals; `benchmarks/results/layers-<model>-<time>.json` holds every
figure.

Run: `python benchmarks/profile_layers.py mobilenet_v3_large [--runs 20] [--top 25] [--depth N]`.
Where the engines name a block's nodes too differently to meet (GoogLeNet's
`/conv1/conv/Conv` against ONNX Runtime's fused `/conv1/Relu_output_0_nchwc`),
`--depth 1` groups both by their top module (`/conv1`, `/inception3a`).

!!! warning

    Needs the `bench` extra. The peers' profilers and jax's add a few
    microseconds an op, so the totals exceed the models' plain run times;
    compare blocks, not totals against `bench_real.py`. A zoo model's name
    (`mobilenet_v2`, `resnet18`, `googlenet`, `alexnet`) profiles torchvision's
    module of that architecture, exported with its own random weights, not the
    zoo's function, whose layer names differ from the ONNX export's.
"""

import argparse
import collections
import datetime
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import TORCHVISION, ZOO, RealCase, _openvino, _ort  # noqa: E402

from jtile import kernels  # noqa: E402
from jtile.algorithms import swap_backend  # noqa: E402
from jtile.fusion import fold_params  # noqa: E402


def block(name: str, depth: int | None = None) -> str:
    """A node's module path less its last two parts, or less its op alone
    where two parts would be left (`/features/features.0/Conv`); with `depth`,
    the path's first `depth` modules (`/inception3a` at depth 1)."""
    parts = name.strip("/").split("/")[:-1]
    if depth is not None:
        return "/" + "/".join(parts[:depth])
    return "/" + "/".join(parts[:-1] if len(parts) > 2 else parts)


def jtile_blocks(case: RealCase, path: Path, runs: int, depth: int | None) -> dict[str, float]:
    """`{block: median ms a run}` of jtile's thunks, from one `jax.profiler` trace."""
    model_fn, params = case.jax_function(path)
    fn = jax.jit(swap_backend(fold_params(model_fn, params), algorithms="auto"))
    x = jnp.asarray(case.input)
    hlo = fn.lower(x).compile().as_text()
    names = dict(re.findall(r"%([\w.-]+) = [^\n]*?op_name=\"jit\([^)]*\)/*([^\"]*)\"", hlo))
    for _ in range(5):
        jax.block_until_ready(fn(x))
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for _ in range(runs):
                jax.block_until_ready(fn(x))
        (trace,) = glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(trace))["traceEvents"]
    per_thunk = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["name"] in names:
            per_thunk[e["name"]].append(e["dur"] / 1e3)
    per_thunk.update(kernel_thunks(fn, x, hlo, runs))
    blocks = collections.defaultdict(float)
    for thunk, times in per_thunk.items():
        layer = names[thunk].rsplit("/", 1)[0]  # less the primitive: the ONNX node's scope
        blocks[block(layer, depth)] += statistics.median(times)
    return dict(blocks)


def kernel_thunks(fn, x, hlo: str, runs: int) -> dict[str, list[float]]:
    """`{kernel call's HLO name: ms per run}` from the kernels' own timing,
    matched to the entry computation's custom calls in order, or {} if the
    calls ran in another order than the HLO lists them."""
    entry = hlo[hlo.index("ENTRY"):]
    calls = re.findall(r"%([\w.-]+) = f32\[([\d,]*)\][^\n]*custom_call_target=\"jtile_", entry)
    with kernels.call_times() as times:
        for _ in range(runs):
            jax.block_until_ready(fn(x))
    per_run = len(times.calls) // runs
    shapes = [tuple(int(d) for d in dims.split(",")) if dims else () for _, dims in calls]
    if per_run != len(calls) or [c.out_shape for c in times.calls[:per_run]] != shapes:
        print("kernel call order differs from the HLO's: kernel times come from the profiler")
        return {}
    return {name: [c.us / 1e3 for c in times.calls[i::per_run]] for i, (name, _) in enumerate(calls)}


def ort_blocks(path: Path, feed, runs: int, depth: int | None) -> dict[str, float]:
    """`{block: median ms a run}` of ONNX Runtime's per-node kernel times."""
    session = _ort(path, profile=True)
    for _ in range(5 + runs):
        session.run(None, feed)
    profile = session.end_profiling()
    events = json.load(open(profile))
    os.remove(profile)
    per_node = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_node[e["name"][: -len("_kernel_time")]].append(e["dur"] / 1e3)
    blocks = collections.defaultdict(float)
    for node, times in per_node.items():
        layer = re.sub(r"_output_\d+(_nchwc)?$", "", node)
        blocks[block(layer, depth)] += statistics.median(times[-runs:])
    return dict(blocks)


def openvino_blocks(path: Path, x, runs: int, depth: int | None) -> dict[str, float]:
    """`{block: median ms a run}` of OpenVINO's per-node real times."""
    request = _openvino(path, profile=True).create_infer_request()
    per_node = collections.defaultdict(list)
    for i in range(5 + runs):
        request.infer([x])
        if i >= 5:
            for info in request.get_profiling_info():
                if info.real_time.total_seconds() > 0:
                    per_node[info.node_name].append(info.real_time.total_seconds() * 1e3)
    blocks = collections.defaultdict(float)
    for node, times in per_node.items():
        layer = re.sub(r"/WithoutBiases$", "", node[node.find("/"):] if "/" in node else node)
        blocks[block(layer, depth)] += statistics.median(times)
    return dict(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=TORCHVISION + ZOO)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="blocks to print, largest gap first")
    parser.add_argument("--depth", type=int, help="group by the first DEPTH modules of each path instead")
    args = parser.parse_args()
    case = RealCase(args.model)
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as directory:
        path = case.onnx_path(Path(directory))
        ours = jtile_blocks(case, path, args.runs, args.depth)
        ort = ort_blocks(path, {"x": case.input}, args.runs, args.depth)
        openvino = openvino_blocks(path, case.input, args.runs, args.depth)
    def gap(b: str) -> float:  # the faster peer's time less jtile's; a peer without the block does not count
        peers = [times[b] for times in (ort, openvino) if b in times]
        return min(peers, default=0.0) - ours.get(b, 0.0)

    rows = sorted(ours.keys() | ort.keys() | openvino.keys(), key=gap)
    print(f"{args.model}: per block, median ms a run (profilers on); ratios = peer / jtile")
    print(f"{'block':56s} {'jtile':>7s} {'ORT':>7s} {'ratio':>6s} {'OV':>7s} {'ratio':>6s}")
    ratio = lambda peer, mine: f"{peer / mine:6.2f}" if mine > 0 else "     -"  # noqa: E731
    for name in rows[: args.top]:
        mine, a, b = ours.get(name, 0.0), ort.get(name, 0.0), openvino.get(name, 0.0)
        print(f"{name[:56]:56s} {mine:7.3f} {a:7.3f} {ratio(a, mine)} {b:7.3f} {ratio(b, mine)}")
    mine, a, b = sum(ours.values()), sum(ort.values()), sum(openvino.values())
    print(f"{'total':56s} {mine:7.3f} {a:7.3f} {ratio(a, mine)} {b:7.3f} {ratio(b, mine)}")
    print(f"load average at end: {os.getloadavg()}")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = results / f"layers-{args.model}-{stamp}.json"
    out.write_text(json.dumps({"model": args.model, "runs": args.runs, "jtile_ms": ours, "ort_ms": ort,
                                          "openvino_ms": openvino},
                              indent=1, sort_keys=True))
    print(f"json: {out}")


if __name__ == "__main__":
    main()
