"""Cost and quality of the static scheduler on the light ONNX model-zoo graphs and the zoo.

Times `jtile.schedule` (tracing included) per model and policy, and prints a
table: nodes, steps, the time of tracing and building the graph alone and of
the scheduler alone on that graph (Aidge's 4-266 ms is of the latter kind), peak live bytes under the program order and under the
memory policy (and their ratio, the figure Serenity reports as 1.68x on
irregular nets), whether the search was exact, the greedy-by-size arena, and
XLA's own temporary buffer size (`compiled.memory_analysis()`) for the same
function. The issue's target: DenseNet-121's layer graph scheduled in under
0.5 s, tracing included. Graphs come from the `onnx` wheel
(`onnx/backend/test/data/light/`) and the zoo, plus five RandWire-style
networks (Watts-Strogatz DAGs of 32 relu-conv nodes, Serenity's setting);
weights are shapes only, nothing here is run.

Run: `python -m pytest benchmarks/bench_schedule.py`.
"""

import gc
import os
import random
import time

import jax
import jax.numpy as jnp
import onnx
import pytest

import jtile
from jtile.schedule._build import build
from jtile.schedule._order import order
from jtile.schedule._schedule import Schedule

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
ONNX = ("squeezenet", "inception_v1", "inception_v2", "densenet121", "resnet50")
ZOO = ("googlenet", "resnet18", "mobilenet_v2")
RANDWIRE = tuple(f"randwire{seed}" for seed in range(5))
ROWS: dict[str, dict] = {}
_MODELS: dict = {}


def _randwire(seed: int, n: int = 32, k: int = 4, p: float = 0.75, channels: int = 16):
    """RandWire's graph: a Watts-Strogatz ring rewired with probability `p`, edges oriented
    from lower to higher index; node i sums its inputs, then relu and a 3x3 conv."""
    rng = random.Random(seed)
    edges = set()
    for i in range(n):
        for j in range(1, k // 2 + 1):
            b = (i + j) % n if rng.random() >= p else rng.choice([x for x in range(n) if x != i])
            edges.add((min(i, b), max(i, b)))
    preds = {i: sorted(a for a, b in edges if b == i) for i in range(n)}
    sinks = [i for i in preds if not any(i in preds[j] for j in preds)]

    def net(weights, x):
        outs = {}
        for i in range(n):
            with jax.named_scope(f"node{i}"):
                ins = [outs[j] for j in preds[i]] or [x]
                outs[i] = jax.lax.conv_general_dilated(jax.nn.relu(sum(ins[1:], ins[0])), weights[i], (1, 1), "SAME")
        with jax.named_scope("out"):
            return sum((outs[i] for i in sinks[1:]), outs[sinks[0]])

    weights = {i: jax.ShapeDtypeStruct((channels, channels if preds[i] else 3, 3, 3), jnp.float32) for i in preds}
    return net, [weights, jax.ShapeDtypeStruct((1, 3, 56, 56), jnp.float32)]


def _load(name: str):
    """`(model, inputs, (function, arguments) for XLA's memory analysis)`, shapes only."""
    if name not in _MODELS:
        if name in RANDWIRE:
            net, inputs = _randwire(int(name[len("randwire"):]))
            _MODELS[name] = (net, inputs, (net, inputs))
        elif name in ZOO:
            model = jax.eval_shape(lambda: jtile.models.get(name))
            inputs = [jax.ShapeDtypeStruct(jtile.models.input_shape(name), jnp.float32)]
            _MODELS[name] = (model, inputs, (lambda m, *xs: m(*xs), [model, *inputs]))
        else:
            model = jtile.onnx.load(os.path.join(LIGHT, f"light_{name}.onnx"))
            inputs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in model.input_shapes]
            params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
            _MODELS[name] = (model, inputs, (model.fn, [params, *inputs]))
    return _MODELS[name]


def _xla_temp_bytes(fn, args) -> int:
    """XLA's temporary buffers for the same call, parameters as arguments."""
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module", autouse=True)
def table(request):
    yield
    lines = ["", "static schedules (layer granularity unless 'ops'; t program / t memory include tracing; "
             "noisy shared machine):",
             f"{'model':<15}{'nodes':>6}{'steps':>6}{'program B':>12}{'memory B':>12}{'prog/mem':>9}"
             f"{'search':>10}{'arena B':>12}{'XLA temp B':>12}{'t graph':>9}{'t order':>9}{'t program':>10}"
             f"{'t memory':>9}"]
    for name, r in ROWS.items():
        if "program" in r and "memory" in r:
            lines.append(
                f"{name:<15}{r['nodes']:>6}{r['steps']:>6}{r['program']:>12,}{r['memory']:>12,}"
                f"{r['program'] / r['memory']:>8.2f}x{r['exact']:>10}{r['arena']:>12,}"
                f"{r.get('xla', 0):>12,}{r['t_graph']:>8.3f}s{r['t_order']:>8.3f}s{r['t_program']:>9.3f}s"
                f"{r['t_memory']:>8.3f}s")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines))


CASES = [(name, "layer") for name in ONNX + ZOO + RANDWIRE] + [(name, "op") for name in RANDWIRE]


@pytest.mark.parametrize("policy", ["program", "memory"])
@pytest.mark.parametrize("name, granularity", CASES)
def test_schedule(benchmark, name, granularity, policy):
    model, inputs, xla = _load(name)
    label = name if granularity == "layer" else f"{name} ops"
    benchmark.group = label
    s = benchmark.pedantic(jtile.schedule, args=(model, *inputs), rounds=3, iterations=1, warmup_rounds=1,
                           kwargs={"policy": policy, "granularity": granularity})
    row = ROWS.setdefault(label, {"nodes": len(s.nodes), "steps": len(s.parallel_groups)})
    row[policy] = s.peak_bytes
    row[f"t_{policy}"] = (min(benchmark.stats.stats.data) if benchmark.stats
                          else _time(model, inputs, policy, granularity))
    if policy == "memory":
        plan = s.memory_plan()
        assert plan.peak_bytes <= plan.arena_bytes
        row.update(exact="exact" if s.exact else "heuristic", arena=plan.arena_bytes,
                   xla=_xla_temp_bytes(*xla), t_graph=_graph_time(model, inputs),
                   t_order=_order_time(model, inputs, granularity))


def _graph_time(model, inputs) -> float:
    """Tracing and `jtile.graph` alone (collector paused, as in `jtile.schedule`): the part
    of a schedule's time that is not the scheduler's."""
    gc.disable()
    try:
        return min(_timed(jtile.graph, model, *inputs) for _ in range(3))
    finally:
        gc.enable()


def _order_time(model, inputs, granularity) -> float:
    """The scheduler alone on a built graph (program order): nodes, order, steps, peak;
    what Aidge's `generate_scheduling` does."""
    g = jtile.graph(model, *inputs)

    def schedule_graph():
        built = build(g, granularity, model)
        Schedule(built, order(built.dag, "program")[0], "program", granularity)

    return min(_timed(schedule_graph) for _ in range(3))


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _time(model, inputs, policy, granularity="layer") -> float:
    return _timed(lambda: jtile.schedule(model, *inputs, policy=policy, granularity=granularity))


def test_densenet121_layer_schedule_time():
    model, inputs, _ = _load("densenet121")
    jtile.schedule(model, *inputs)  # warm the caches jax keeps per primitive
    best = min(_time(model, inputs, "program") for _ in range(5))
    verdict = "met" if best < 0.5 else "MISSED (timings on this shared machine are noisy)"
    print(f"\nDenseNet-121 light graph, layer schedule incl. tracing: {best:.3f} s; target < 0.5 s {verdict}")
