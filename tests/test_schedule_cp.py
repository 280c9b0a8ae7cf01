"""Consumer-producer schedules (seed 002 against Aidge 0.10.1's own output), rendering, LSTM, stripes."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest

import jtile
from jtile import ConfigError
from jtile.schedule import (CPModel, Roofline, seed_convs, seed_convs_params, seed_lstm, seed_lstm_params,
                            stripe_pipeline)

# Aidge 0.10.1, seed 002's dataflow example, save_factorized_static_scheduling_diagram (peers/aidge).
AIDGE_FACTORIZED = """gantt
dateFormat x
axisFormat %Q

section seq#0
dataProvider (Producer#0) :milestone, 0, 0
section seq#1 (x3)
conv1 (Conv2D_DF#0) :milestone, active, 1, 1
section seq#2 (x2)
conv2 (Conv2D_DF#1) :milestone, active, 2, 2
conv1 (Conv2D_DF#0) :milestone, active, 3, 3
section seq#3 (x41)
conv2 (Conv2D_DF#1) :milestone, active, 4, 4
conv3 (Conv2D_DF#2) :milestone, active, 5, 5
conv1 (Conv2D_DF#0) :milestone, active, 5, 5
section seq#4
conv2 (Conv2D_DF#1) :milestone, 6, 6
section seq#5
conv3 (Conv2D_DF#2) :milestone, 7, 7

"""

# The same run's save_static_scheduling_diagram: its first 28 runs and its last 4.
AIDGE_FULL_HEAD = """dataProvider (Producer#0) :milestone, 0, 0
conv1 (Conv2D_DF#0) :milestone, 1, 1
conv1 (Conv2D_DF#0) :milestone, 2, 2
conv1 (Conv2D_DF#0) :milestone, 3, 3
conv2 (Conv2D_DF#1) :milestone, 4, 4
conv1 (Conv2D_DF#0) :milestone, 5, 5
conv2 (Conv2D_DF#1) :milestone, 6, 6
conv1 (Conv2D_DF#0) :milestone, 7, 7
conv2 (Conv2D_DF#1) :milestone, 8, 8
conv3 (Conv2D_DF#2) :milestone, 9, 9
conv1 (Conv2D_DF#0) :milestone, 9, 9
conv2 (Conv2D_DF#1) :milestone, 10, 10
conv3 (Conv2D_DF#2) :milestone, 11, 11
conv1 (Conv2D_DF#0) :milestone, 11, 11
conv2 (Conv2D_DF#1) :milestone, 12, 12
conv3 (Conv2D_DF#2) :milestone, 13, 13
conv1 (Conv2D_DF#0) :milestone, 13, 13
conv2 (Conv2D_DF#1) :milestone, 14, 14
conv3 (Conv2D_DF#2) :milestone, 15, 15
conv1 (Conv2D_DF#0) :milestone, 15, 15
conv2 (Conv2D_DF#1) :milestone, 16, 16
conv3 (Conv2D_DF#2) :milestone, 17, 17
conv1 (Conv2D_DF#0) :milestone, 17, 17
conv2 (Conv2D_DF#1) :milestone, 18, 18
conv3 (Conv2D_DF#2) :milestone, 19, 19
conv1 (Conv2D_DF#0) :milestone, 19, 19
conv2 (Conv2D_DF#1) :milestone, 20, 20
conv3 (Conv2D_DF#2) :milestone, 21, 21"""
AIDGE_FULL_TAIL = """conv3 (Conv2D_DF#2) :milestone, 89, 89
conv1 (Conv2D_DF#0) :milestone, 89, 89
conv2 (Conv2D_DF#1) :milestone, 90, 90
conv3 (Conv2D_DF#2) :milestone, 91, 91"""


class LineByLine(CPModel):
    """Seed 002's Conv2D_DataFlow_CP: 3 "lines" (dims[2] elements) first, then 1 per run."""

    def start(self, inputs, output):
        super().start(inputs, output)
        self.begin = True

    def required(self, i):
        return (3 if self.begin else 1) * self.inputs[i][2]

    def produced(self):
        self.begin = False
        return self.output[2]


def aidge_names(text: str) -> str:
    text = text.replace("args[1] (input#0)", "dataProvider (Producer#0)")
    return re.sub(r"\(conv2d#(\d)\)", r"(Conv2D_DF#\1)", text)


@pytest.fixture
def pipelined(getkey):
    params = seed_convs_params(getkey())
    x = jax.random.normal(getkey(), (1, 3, 16, 16))
    s = jtile.schedule(seed_convs, params, x, cp=lambda node: None if node.kind == "input" else LineByLine())
    return s, params, x


def test_line_by_line_counts_match_aidge(pipelined):
    s, _, _ = pipelined
    assert s.counts == Counter({"conv1": 46, "conv2": 44, "conv3": 42, "args[1]": 1})


def test_factorized_diagram_is_aidges(pipelined):
    s, _, _ = pipelined
    assert aidge_names(s.to_mermaid("factorized")) == AIDGE_FACTORIZED


def test_full_pipelined_gantt_is_aidges(pipelined):
    s, _, _ = pipelined
    lines = aidge_names(s.to_mermaid("gantt")).splitlines()
    assert lines[:4] == ["gantt", "dateFormat x", "axisFormat %Q", ""] and lines[-1] == ""
    runs = lines[4:-1]
    assert len(runs) == 1 + 46 + 44 + 42
    assert runs[:28] == AIDGE_FULL_HEAD.splitlines()
    assert runs[-4:] == AIDGE_FULL_TAIL.splitlines()


def test_line_by_line_edges_need_three_lines_not_whole_tensors(pipelined, getkey):
    s, params, x = pipelined
    line = 16 * 4  # Aidge's "line": dims[2] float32 elements
    assert s.fifo_bytes == {"args[1]->conv1": x.nbytes, "conv1->conv2": 3 * line, "conv2->conv3": 3 * line}
    whole = jtile.schedule(seed_convs, params, x)
    assert set(whole.fifo_bytes.values()) == {x.nbytes}


def test_pipelined_schedule_still_runs_the_function(pipelined, tree_allclose):
    s, params, x = pipelined
    assert tree_allclose(s.run(params, x), seed_convs(params, x))


def test_default_model_is_one_whole_tensor_run_per_node(getkey):
    params = seed_convs_params(getkey())
    x = jnp.ones((1, 3, 16, 16))
    plain = jtile.schedule(seed_convs, params, x)
    tokens = jtile.schedule(seed_convs, params, x, cp={})
    assert tokens.order == plain.order and tokens.early == plain.early and tokens.late == plain.late


class Greedy(CPModel):
    def required(self, i):
        return 10 * super().required(i)


class Silent(CPModel):
    def produced(self):
        return 0


class Hungry(LineByLine):
    def required(self, i):
        return (3 if self.begin else 2) * self.inputs[i][2]


class Idle(CPModel):
    def required(self, i):
        return 0


@pytest.mark.parametrize("cp, message", [
    ({"conv2": Greedy()}, r"node 'conv2' never runs: its input #0 from 'conv1' needs 7680 elements, "
                          r"but 'conv1' makes only 768 in total"),
    ({"conv1": Silent()}, r"node 'conv2' never runs: its input #0 from 'conv1' needs 768 elements, "
                          r"but 'conv1' makes only 0"),
    ({"conv1": Hungry()}, r"node 'conv1' stops with 16 of the 768 elements of its input #0 from 'args\[1\]' "
                          r"unconsumed"),
    ({"conv3": Idle()}, r"node 'conv3' consumes nothing per run"),
    ({"conv9": CPModel()}, r"cp names unknown node\(s\) 'conv9'"),
])
def test_cp_models_whose_data_never_arrives_are_named(getkey, cp, message):
    params = seed_convs_params(getkey())
    with pytest.raises(ConfigError, match=message):
        jtile.schedule(seed_convs, params, jnp.ones((1, 3, 16, 16)), cp=cp)


def test_cp_schedule_refuses_another_policy(getkey):
    params = seed_convs_params(getkey())
    with pytest.raises(ConfigError, match="policy must be 'program'"):
        jtile.schedule(seed_convs, params, jnp.ones((1, 3, 16, 16)), cp={}, policy="memory")


def lstm_args(getkey):
    return (seed_lstm_params(getkey()), jax.random.normal(getkey(), (5, 1, 4)),
            jnp.zeros((1, 8)), jnp.zeros((1, 8)))


def test_seed_lstm_has_slack_and_wide_steps(getkey, tree_allclose):
    args = lstm_args(getkey)
    s = jtile.schedule(seed_lstm, *args)
    per_step = [n for n in s.order if n.startswith("t0/")]
    assert len(per_step) == 1 + 21  # Pop + Aidge's 21 LSTM nodes per step
    slack = [n for n in s.order if s.early[n] < s.late[n]]
    # Aidge 0.10.1 on the same LSTM: 42 of 122 nodes with slack, up to 21 per step.
    assert len(slack) == 41 and max(len(g) for g in s.parallel_groups) == 20
    assert "t1/fc_x_i" in slack  # the input projections do not wait for the previous step
    assert all(s.early[n] == s.late[n] for n in ("t4/mul_h", "t4/add_c", "t3/mul_h"))
    assert tree_allclose(s.run(*args), seed_lstm(*args))


def test_gantt_lines_follow_aidges_format(getkey):
    s = jtile.schedule(seed_lstm, *lstm_args(getkey))
    lines = s.to_mermaid().splitlines()
    assert lines[:4] == ["gantt", "dateFormat x", "axisFormat %Q", ""] and lines[-1] == ""
    pattern = re.compile(r"^(\S+) \((\w+)#(\d+)\) :(milestone, )?(\d+), (\d+)$")
    for line, run in zip(lines[4:-1], s.runs):
        m = pattern.match(line)
        assert m, line
        name, kind, _, milestone, early, late = m.groups()
        assert (name, kind, int(early), int(late)) == (run.name, run.kind, run.early, run.late)
        assert bool(milestone) == (run.early == run.late)
    assert len(lines) == 5 + len(s.runs)


def test_flowchart_has_a_node_per_node_and_an_edge_per_dependency(getkey):
    s = jtile.schedule(seed_lstm, *lstm_args(getkey))
    text = s.to_mermaid("flowchart")
    assert text.startswith("flowchart TB\n")
    nodes = re.findall(r"^n(\d+)\(", text, re.M)
    edges = re.findall(r"^n(\d+) -->\|\"[0-9x]*\"\| n(\d+)$", text, re.M)
    assert len(nodes) == len(s.nodes)
    assert len(edges) == sum(len(n.inputs) for n in s.nodes)
    assert text.count(":::critical") == len(s.critical_path)


def test_plot_writes_a_png(getkey, tmp_path):
    pytest.importorskip("matplotlib")
    s = jtile.schedule(seed_lstm, *lstm_args(getkey))
    path = tmp_path / "lstm.png"
    s.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def tiled_conv(w, x):
    with jax.named_scope("conv"):
        return jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"))


def test_stripe_pipeline_overlaps_loads_with_compute(getkey):
    w, x = jnp.ones((16, 8, 3, 3)), jnp.ones((1, 8, 32, 32))
    f = jtile.tile_conv(tiled_conv, axis="H", tiles=4)
    roof = Roofline(flops=1e9, bandwidth=1e9)  # 1 GFLOP/s, 1 GB/s: both engines matter
    t = stripe_pipeline(f, w, x, roofline=roof)
    loads = [task for task in t.tasks if task.kind == "load"]
    computes = [task for task in t.tasks if task.kind == "compute"]
    stores = [task for task in t.tasks if task.kind == "store"]
    assert len(loads) == len(computes) == len(stores) == 4
    macs = 16 * 8 * 9 * 32 * 32 // 4
    assert computes[0].end - computes[0].start == pytest.approx(2 * macs / 1e9 * 1e6)
    stripe_in = 8 * 10 * 32 * 4  # 8 channels, 10 rows (8 + halo 2 inside), 32 wide
    assert loads[1].end - loads[1].start == pytest.approx(stripe_in / 1e9 * 1e6)
    assert loads[1].start < computes[0].end  # prefetch while stripe 0 computes
    for i in range(2, 4):  # double buffering: stripe i loads after compute i-2 freed its buffer
        assert loads[i].start >= computes[i - 2].end
    for i in range(4):
        assert computes[i].start >= loads[i].end and stores[i].start >= computes[i].end
    assert t.makespan_us < t.serial_us
    assert t.makespan_us == pytest.approx(sum(c.end - c.start for c in computes) + loads[0].end + (
        stores[-1].end - stores[-1].start))  # compute bound: the loads hide behind it
    gantt = t.to_mermaid().splitlines()
    assert gantt[:3] == ["gantt", "dateFormat x", "axisFormat %Q"] and len(gantt) == 4 + 1 + 12 + 1


def test_stripe_pipeline_needs_stripes():
    with pytest.raises(ConfigError, match="apply jtile.tile_conv"):
        stripe_pipeline(tiled_conv, jnp.ones((4, 3, 3, 3)), jnp.ones((1, 3, 8, 8)),
                        roofline=Roofline(1e9, 1e9))


# Aidge 0.10.1, seed 002's sequential net on 1x3x64x64 (peers/aidge/c_seq_scheduling_1x3x64x64.mmd),
# the non-Producer lines.
AIDGE_SEQ = """conv1 (Conv2D#0) :milestone, 1, 1
relu1 (ReLU#0) :milestone, 2, 2
conv2 (PaddedConv2D#0) :milestone, 3, 3
relu2 (ReLU#1) :milestone, 4, 4
conv3 (PaddedConv2D#1) :milestone, 5, 5
relu3 (ReLU#2) :milestone, 6, 6"""


def test_sequential_net_steps_match_aidges():
    shapes = {"w1": (4, 3, 5, 5), "b1": (4,), "w2": (8, 4, 5, 5), "b2": (8,), "w3": (16, 8, 3, 3)}
    params = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}

    def conv(x, w, pad):
        return jax.lax.conv_general_dilated(x, w, (1, 1), [(pad, pad)] * 2)

    def net(p, x):
        with jax.named_scope("conv1"):
            x = conv(x, p["w1"], 0) + p["b1"][:, None, None]
        with jax.named_scope("relu1"):
            x = jax.nn.relu(x)
        with jax.named_scope("conv2"):
            x = conv(x, p["w2"], 2) + p["b2"][:, None, None]
        with jax.named_scope("relu2"):
            x = jax.nn.relu(x)
        with jax.named_scope("conv3"):
            x = conv(x, p["w3"], 2)
        with jax.named_scope("relu3"):
            return jax.nn.relu(x)

    s = jtile.schedule(net, params, jax.ShapeDtypeStruct((1, 3, 64, 64), jnp.float32))
    lines = s.to_mermaid().splitlines()[5:-1]
    ours = [re.sub(r" \(\w+#\d+\)", "", line) for line in lines]
    assert ours == [re.sub(r" \(\w+#\d+\)", "", line) for line in AIDGE_SEQ.splitlines()]
    assert lines[0] == "conv1 (conv2d#0) :milestone, 1, 1"


def test_tiled_conv_schedule_has_aidges_shape():
    # peers/aidge/a_tiled_static_scheduling.mmd: seed 000's net after 4 horizontal stripes:
    # 4 Slices at one step, the 4 Conv2D at the next, then Concat.
    model = jax.eval_shape(lambda: jtile.models.get("tutorial"))
    x = jax.ShapeDtypeStruct((4, 3, 66, 66), jnp.float32)
    tiled = jtile.tile_conv(lambda m, v: m(v), axis="H", tiles=4)
    s = jtile.schedule(tiled, model, x, granularity="op")
    kinds = {n.name: n.kind for n in s.nodes}
    steps_of = lambda kind: sorted(s.early[n] for n in s.order if kinds[n] == kind)  # noqa: E731
    slices, convs, concat = steps_of("slice"), steps_of("conv2d"), steps_of("concatenate")
    assert len(set(slices)) == len(set(convs)) == 1 and len(slices) == len(convs) == 4
    assert convs[0] == slices[0] + 1 and concat == [convs[0] + 1]
    assert [g for g in s.parallel_groups if len(g) == 4] == [
        [n for n in s.order if kinds[n] == "slice"], [n for n in s.order if kinds[n] == "conv2d"]]


# peers/aidge/c_light_squeezenet_scheduling.mmd: the compute nodes' early steps (Aidge puts the
# weights' ConstantOfShape at step 1, so its first conv is at step 2; n61 is a Dropout).
AIDGE_SQUEEZENET = """n0 2, n1 3, n2 4, n3 5, n4 6, n5 7, n7 7, n6 8, n8 8, n9 9, n10 10, n11 11, n12 12, n14 12,
n13 13, n15 13, n16 14, n17 15, n18 16, n19 17, n20 18, n22 18, n21 19, n23 19, n24 20, n25 21, n26 22,
n27 23, n29 23, n28 24, n30 24, n31 25, n32 26, n33 27, n34 28, n35 29, n37 29, n36 30, n38 30, n39 31,
n40 32, n41 33, n42 34, n44 34, n43 35, n45 35, n46 36, n47 37, n48 38, n49 39, n51 39, n50 40, n52 40,
n53 41, n54 42, n55 43, n56 44, n58 44, n57 45, n59 45, n60 46, n61 47, n62 48, n63 49, n64 50, n65 51"""


def test_light_squeezenet_steps_match_aidges():
    import os

    import onnx

    path = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_squeezenet.onnx")
    model = jtile.onnx.load(path)
    s = jtile.schedule(model, jax.ShapeDtypeStruct(model.input_shapes[0], jnp.float32))
    aidge = dict((name, int(step)) for name, step in (e.split() for e in AIDGE_SQUEEZENET.replace("\n", " ").split(", ")))
    # jtile has no weight-constant step (one less) and no node for the identity Dropout n61 (one less after it)
    expected = {name: step - 1 - (int(name[1:]) > 61) for name, step in aidge.items() if name != "n61"}
    assert {n: s.early[n] for n in expected} == expected
    assert set(s.early) == set(expected) | {"data_0"}
    assert all(s.early[n] == s.late[n] for n in expected)  # a chain of fire modules: all critical
