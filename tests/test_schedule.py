"""The scheduler's orders, steps, memory search and arena, on hand-built graphs and the zoo."""

import random

import jax
import jax.numpy as jnp
import pytest

import jtile
from jtile import ConfigError, models
from jtile.schedule._dag import Dag, Node
from jtile.schedule._memory import memory_order, peak_bytes, plan_arena
from jtile.schedule._order import POLICIES, order
from jtile.schedule._steps import steps


def random_dag(seed: int, size: int) -> Dag:
    rng = random.Random(seed)
    nodes = [Node("in", "input", (), rng.randint(1, 50))]
    for i in range(size):
        names = [n.name for n in nodes]
        inputs = tuple(rng.sample(names, k=min(len(names), rng.randint(1, 3))))
        nodes.append(Node(f"n{i}", "op", inputs, rng.randint(1, 100)))
    return Dag(nodes)


def all_orders(dag: Dag):
    """Every topological order, by brute force."""
    def extend(done, seq):
        if len(seq) == len(dag):
            yield list(seq)
        for i in range(len(dag)):
            if i not in done and all(p in done for p in dag.preds[i]):
                yield from extend(done | {i}, seq + [i])
    yield from extend(frozenset(), [])


def brute_peak(dag: Dag, order_: list[int]) -> int:
    """Live bytes by the definition: a buffer is live from its producer's step to its last reader's."""
    position = {n: k for k, n in enumerate(order_)}
    peak = 0
    for step in range(len(order_)):
        live = 0
        for b in dag.buffers:
            last = len(order_) - 1 if b.is_output else max([position[c] for c in b.consumers] + [position[b.producer]])
            if position[b.producer] <= step <= last:
                live += b.nbytes
        peak = max(peak, live)
    return peak


def longest_path(dag: Dag, neighbours: list[list[int]]) -> list[int]:
    """Per node, the most edges on a path following `neighbours` (preds: from a source)."""
    memo = {}

    def length(i):
        if i not in memo:
            memo[i] = max((length(j) + 1 for j in neighbours[i]), default=0)
        return memo[i]

    return [length(i) for i in range(len(dag))]


@pytest.mark.parametrize("seed", range(40))
def test_memory_order_is_the_brute_force_minimum(seed):
    dag = random_dag(seed, 3 + seed % 6)
    best = min(brute_peak(dag, o) for o in all_orders(dag))
    found, exact = memory_order(dag)
    dag.check_order(found)
    assert exact
    assert peak_bytes(dag, found) == brute_peak(dag, found) == best


@pytest.mark.parametrize("seed", range(20))
def test_every_policy_gives_a_topological_order(seed):
    dag = random_dag(100 + seed, 25)
    for policy in POLICIES:
        found, _ = order(dag, policy)
        dag.check_order(found)


@pytest.mark.parametrize("seed", range(20))
def test_early_and_late_are_asap_and_alap(seed):
    dag = random_dag(200 + seed, 15)
    for policy in ("program", "memory", "alap"):
        seq, _ = order(dag, policy)
        early, late = steps(dag, seq)
        depth, height = longest_path(dag, dag.preds), longest_path(dag, dag.succs)
        latest = max(depth)
        assert [early[seq.index(i)] for i in range(len(dag))] == depth
        assert [late[seq.index(i)] for i in range(len(dag))] == [latest - h for h in height]


def test_asap_and_alap_orders_sort_by_step():
    dag = random_dag(7, 20)
    for policy, which in (("asap", 0), ("alap", 1)):
        seq, _ = order(dag, policy)
        step = steps(dag, seq)[which]
        assert step == sorted(step)


def test_heuristic_memory_order_is_valid_and_flagged():
    dag = random_dag(3, 60)
    found, exact = memory_order(dag, exact_limit=4, work=2)
    dag.check_order(found)
    assert not exact
    assert peak_bytes(dag, found) <= peak_bytes(dag, dag.topological)


def test_cycle_is_reported_with_its_nodes():
    nodes = [Node("a", "op", ("c",)), Node("b", "op", ("a",)), Node("c", "op", ("b",)), Node("d", "op", ())]
    with pytest.raises(ConfigError, match=r"cycle: (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)"):
        Dag(nodes)


def test_unknown_input_names_the_node_and_the_input():
    with pytest.raises(ConfigError, match="node 'b' reads input 'ghost'.*never arrives"):
        Dag([Node("a", "op"), Node("b", "op", ("ghost",))])


@pytest.mark.parametrize("seed", range(30))
def test_arena_never_overlaps_live_buffers(seed):
    dag = random_dag(300 + seed, 12)
    seq, _ = order(dag, "memory")
    plan = plan_arena(dag, seq, align=1)
    assert_no_overlap(plan)
    assert plan.peak_bytes <= plan.arena_bytes <= plan.naive_bytes


def assert_no_overlap(plan):
    bufs = plan.buffers
    for i, a in enumerate(bufs):
        assert a.offset >= 0 and a.offset + a.size <= plan.arena_bytes
        for b in bufs[i + 1:]:
            if a.first <= b.last and b.first <= a.last and a.size and b.size:
                assert a.offset + a.size <= b.offset or b.offset + b.size <= a.offset, (a, b)


@pytest.mark.parametrize("name", models.NAMES)
def test_arena_of_every_zoo_model_has_no_overlap(name):
    model = jax.eval_shape(lambda: models.get(name))
    x = jax.ShapeDtypeStruct(models.input_shape(name), jnp.float32)
    for policy in ("program", "memory"):
        s = jtile.schedule(model, x, policy=policy)
        plan = s.memory_plan()
        assert_no_overlap(plan)
        assert plan.peak_bytes == s.peak_bytes <= plan.arena_bytes
        assert len(plan.buffers) >= len(s.nodes)


def test_schedule_of_a_zoo_model_has_every_field():
    model = jax.eval_shape(lambda: models.get("resnet18"))
    x = jax.ShapeDtypeStruct((1, 3, 64, 64), jnp.float32)
    s = jtile.schedule(model, x)
    names = [n.name for n in s.nodes]
    assert s.order == names  # program order
    assert names[0] == "args[0]" and s.nodes[0].kind == "input"
    conv = next(n for n in s.nodes if n.kind == "conv2d")
    assert conv.macs["conv"] > 0 and conv.out_bytes > 0 and conv.inputs
    assert set(s.early) == set(names) == set(s.late)
    assert s.critical_path == [n for n in s.order if s.early[n] == s.late[n]]
    flat = [n for g in s.parallel_groups for n in g]
    assert sorted(flat) == sorted(names)
    index = {n.name: n for n in s.nodes}
    for group in s.parallel_groups:  # no dependency inside a group
        assert not any(p in group for n in group for p in index[n].inputs)
    # residual adds leave the shortcut branch with slack
    assert any(s.early[n] < s.late[n] for n in names)


def test_op_granularity_has_one_node_per_data_op():
    def f(w, x):
        with jax.named_scope("layer"):
            y = jnp.tanh(x @ w) + 1.0
        return jnp.sin(y) * 2.0

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    layer = jtile.schedule(f, w, x)
    op = jtile.schedule(f, w, x, granularity="op")
    assert [n.kind for n in layer.nodes] == ["input", "dense", "elementwise", "elementwise"]
    assert len(op.nodes) == 1 + len(jtile.graph(f, w, x).ops)
    assert [n.kind for n in op.nodes] == ["input", "dense", "tanh", "add", "sin", "mul"]
    assert all(n.name.startswith("layer/") for n in op.nodes[1:4])


def test_memory_policy_lowers_the_peak_of_a_branchy_function():
    # In program order the branch whose big output waits for the join runs first,
    # and stays alive while the other branch makes its big temporary.
    def f(x):
        with jax.named_scope("wide"):
            a = jnp.tile(x, (8, 1))
        with jax.named_scope("temp"):
            t = jnp.tile(x, (16, 1))
        with jax.named_scope("reduce"):
            r = t.sum(0)
        with jax.named_scope("join"):
            return a.sum(0) + r

    x = jnp.ones((1, 256))
    program = jtile.schedule(f, x)
    memory = jtile.schedule(f, x, policy="memory")
    brute = min(peak_bytes(memory._dag, o) for o in all_orders(memory._dag))
    assert memory.exact and memory.peak_bytes == brute < program.peak_bytes
    assert memory.order.index("temp") < memory.order.index("wide")


def test_unknown_policy_and_granularity_list_the_valid_ones():
    x = jnp.ones((2, 2))
    with pytest.raises(ConfigError, match="valid policies are program, asap, alap, critical, memory"):
        jtile.schedule(jnp.sin, x, policy="fastest")
    with pytest.raises(ConfigError, match="valid granularities are layer, op"):
        jtile.schedule(jnp.sin, x, granularity="block")
    with pytest.raises(ConfigError, match="valid kinds are gantt, factorized, flowchart"):
        jtile.schedule(jnp.sin, x).to_mermaid("pie")


def test_onnx_model_schedules_with_onnx_node_names(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu_a"),
             helper.make_node("Sigmoid", ["x"], ["b"], name="sig_b"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add_y")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    om = jtile.onnx.load(str(path))
    s = jtile.schedule(om, jnp.ones((1, 4)))
    assert s.order == ["x", "relu_a", "sig_b", "add_y"]
    assert s.parallel_groups == [["x"], ["relu_a", "sig_b"], ["add_y"]]


@pytest.mark.parametrize("seed", range(20))
def test_critical_policy_runs_a_ready_critical_node_first(seed):
    dag = random_dag(400 + seed, 20)
    seq, _ = order(dag, "critical")
    early, late = steps(dag, seq)
    critical = {node for node, e, l in zip(seq, early, late) if e == l}
    done = set()
    for node in seq:
        ready = [i for i in range(len(dag)) if i not in done and all(p in done for p in dag.preds[i])]
        if any(i in critical for i in ready):
            assert node in critical
        done.add(node)
