"""Real models: torchvision CNNs nobody tuned jtile for, against ONNX Runtime, OpenVINO and PyTorch.

Every case is a torchvision module at batch 1 (224x224): the torchvision models
are built with `weights=None` after `torch.manual_seed(0)` (ViT-B/16's
zero-initialised classifier then gets normal weights, so its output checks
something); the zoo models
(`jtile.models`) are torchvision's module with the zoo's weights loaded through
`jtile.models.state_dict`. The module is exported once per session by
`torch.onnx.export(opset_version=17, dynamo=False)` into a temporary directory.
One interleaved run per model (each round runs every engine in turn: `WARM`
untimed calls, then one timed call) times:

- `jtile`: `jax.jit(swap_backend(fold_params(fn, params), algorithms="auto"))`, where
  `fn` is `jtile.onnx.load(path).fn` (for a zoo model, the zoo's own function);
- `jax`: plain `jax.jit(fn)(params, x)`;
- `ort`: ONNX Runtime, 2 intra-op threads;
- `openvino`: OpenVINO CPU, latency hint, 2 inference threads, f32;
- `torch`: the torchvision module eager, 2 threads, inference mode;
- `torch_compile`: `torch.compile` of that module, unless `BENCH_TORCH_COMPILE=0`
  or compiling takes over 120 s (then the case records why it is missing).

Every output is checked against ONNX Runtime's. At the end the ratio table
(peer time / jtile time on the best round: above 1 jtile is faster), with the
geometric mean per peer and the best peer (the faster of ORT and OpenVINO per
model), goes to `benchmarks/results/real-<time>.{json,png}`, and a second
table with the median over rounds of each round's ratio (the best peer of a
round is the faster of ORT and OpenVINO in it). This machine's speed drifts by
up to 2x for minutes at a time (whole-process timings of SqueezeNet went from
1.7 to 3.3 ms within an hour, every engine alike); a round's engines run
milliseconds apart, so the paired ratio is the steadier figure. `test_matmul_peak`
measures the machine's attainable f32 multiply-add rate (a large jitted matmul
and numpy's BLAS matmul) so per-layer GFLOP/s have a ceiling to compare with.

Run: `python -m pytest benchmarks/bench_real.py -m slow -s` (`BENCH_ROUNDS=N`
sets the rounds, default 20; `BENCH_WARM=N` the untimed calls before each timed
one, default 2).

The untimed calls are there because every engine's first call after another
engine ran is slow: caches hold the other engine's data and its worker threads
are asleep. One squeezenet1_1 run, best of 10 rounds, ms: with no warm call
jtile 8.0, ORT 5.4, OpenVINO 7.1, torch 22.5; with two 5.1, 3.6, 6.7, 18.0;
each engine alone 5.0, 3.6, 3.9, 17.8. Between turns `settle` waits until no
thread of the process uses the CPU: ONNX Runtime's workers keep spinning for
about 30 ms after each run (a whole core; OpenVINO's for about 1 ms), and the
engine that ran next shared its two cores with them. On squeezenet1_1,
OpenVINO, which runs after ONNX Runtime, took 2.45 ms (best of 40) without
the wait and 1.70 with it; ONNX Runtime itself 1.58 and 1.57. Rounds stay
interleaved, so a drift in the machine's state reaches every engine alike.

!!! warning

    Needs the `bench` extra (torch, torchvision, onnxruntime, openvino). Timings
    on a shared machine are noisy; the report records the load average before
    and after the run.
"""

import dataclasses
import functools
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

# libgomp's workers spin while they wait; on a shared, oversubscribed machine that
# made torch eager 100x slower (2 s for squeezenet). Set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
import pytest

import jtile.onnx
from jtile import models
from jtile.algorithms import swap_backend
from jtile.fusion import fold_params

sys.path.insert(0, str(Path(__file__).parent))
import report  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    # `import openvino` sends telemetry from a thread that forks; JAX warns about any fork.
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
]

THREADS = 2
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "20"))
WARM = int(os.environ.get("BENCH_WARM", "2"))
COMPILE_LIMIT_S = 120.0
ENGINES = ("jtile", "jax", "ort", "openvino", "torch", "torch_compile")
PEERS = ENGINES[1:]
BEST_OF = ("ort", "openvino")  # the "best peer" column: the faster of these per model
RESULTS: dict[str, dict[str, dict[str, float]]] = {}
NOTES: dict[str, dict[str, str]] = {}
PEAK: dict[str, float] = {}
COPY_GBPS: dict[str, float] = {}


def _torch():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import torchvision
    torch.set_num_threads(THREADS)
    return torch, torchvision


@dataclasses.dataclass(frozen=True)
class RealCase:
    """One torchvision model; `zoo=True` means the weights come from `jtile.models`."""

    model: str
    zoo: bool = False
    rtol: float = 1e-3

    @property
    def name(self) -> str:
        return f"zoo {self.model}" if self.zoo else self.model

    @functools.cached_property
    def input(self) -> np.ndarray:
        return np.random.default_rng(1).standard_normal((1, 3, 224, 224), dtype=np.float32)

    @functools.cached_property
    def zoo_model(self):
        return models.get(self.model, jax.random.key(0))

    @functools.cached_property
    def module(self):
        """The torchvision module in eval mode, with this case's weights."""
        torch, torchvision = _torch()
        torch.manual_seed(0)
        if self.model.startswith("deeplabv3"):
            net = getattr(torchvision.models.segmentation, self.model)(weights=None, weights_backbone=None).eval()

            class SegmentationOutput(torch.nn.Module):
                """torchvision's segmentation models return a dict; export wants the tensor."""

                def __init__(self):
                    super().__init__()
                    self.net = net

                def forward(self, x):
                    return self.net(x)["out"]

            return SegmentationOutput().eval()
        extra = {"aux_logits": False, "init_weights": False} if self.model == "googlenet" else {}
        net = getattr(torchvision.models, self.model)(weights=None, **extra).eval()
        if self.model.startswith("vit_"):
            # torchvision zero-initialises ViT's classifier: every output would be 0 and check nothing.
            torch.nn.init.normal_(net.heads.head.weight, std=0.02)
        if self.zoo:
            weights = models.state_dict(self.zoo_model)
            net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
        return net

    def onnx_path(self, directory: Path) -> Path:
        path = directory / f"{self.name.replace(' ', '_')}.onnx"
        if not path.exists():
            torch, _ = _torch()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(self.module, (torch.from_numpy(self.input),), str(path),
                                  opset_version=17, dynamo=False, input_names=["x"])
        return path

    def jax_function(self, path: Path):
        """`(fn, params)`: the zoo's own function, or the ONNX import of the exported graph."""
        if self.zoo:
            return models.as_function(self.zoo_model)
        model = jtile.onnx.load(path)
        return model.fn, model.params


TORCHVISION = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "squeezenet1_1",
               "densenet121", "shufflenet_v2_x1_0", "deeplabv3_mobilenet_v3_large", "regnet_y_400mf",
               "vit_b_16")
ZOO = ("resnet18", "mobilenet_v2", "googlenet", "alexnet")
CASES = tuple(RealCase(m) for m in TORCHVISION) + tuple(RealCase(m, zoo=True) for m in ZOO)


# ------------------------------------------------------------------ engines


def _ort(path: Path, profile: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.enable_profiling = profile
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _openvino(path: Path, profile: bool = False):
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hint

    config = {
        hint.performance_mode: hint.PerformanceMode.LATENCY,
        props.inference_num_threads: THREADS,
        hint.inference_precision: ov.Type.f32,
        props.enable_profiling: profile,
    }
    return ov.Core().compile_model(str(path), "CPU", config)


def _runners(case: RealCase, path: Path) -> tuple[dict, dict[str, str]]:
    """`({engine: no-argument callable returning numpy}, {engine: why it is missing})`."""
    fn, params = case.jax_function(path)
    x = jnp.asarray(case.input)
    fast = jax.jit(swap_backend(fold_params(fn, params), algorithms="auto"))
    plain = jax.jit(fn)
    session = _ort(path)
    feed = {session.get_inputs()[0].name: case.input}
    request = _openvino(path).create_infer_request()
    torch, _ = _torch()
    tx = torch.from_numpy(case.input)

    def on_torch(module):
        def run():
            with torch.inference_mode():
                return module(tx).numpy()
        return run

    runners = {
        "jtile": lambda: np.asarray(jax.block_until_ready(fast(x))),
        "jax": lambda: np.asarray(jax.block_until_ready(plain(params, x))),
        "ort": lambda: session.run(None, feed)[0],
        "openvino": lambda: request.infer([case.input])[0].copy(),
        "torch": on_torch(case.module),
    }
    missing = {}
    if os.environ.get("BENCH_TORCH_COMPILE", "1") == "0":
        missing["torch_compile"] = "not measured: BENCH_TORCH_COMPILE=0"
    else:
        start = time.perf_counter()
        try:
            compiled = on_torch(torch.compile(case.module))
            compiled()
        except Exception as error:  # a peer's failure is a result to report, not a benchmark error
            missing["torch_compile"] = f"not measured: torch.compile failed ({type(error).__name__}: {error})"[:300]
        else:
            took = time.perf_counter() - start
            if took > COMPILE_LIMIT_S:
                missing["torch_compile"] = f"not measured: compiling took {took:.0f} s (> {COMPILE_LIMIT_S:.0f} s)"
            else:
                runners["torch_compile"] = compiled
    return runners, missing


def settle(step: float = 0.005, limit: float = 0.25) -> None:
    """Wait until the process's threads leave the CPU idle for `step` seconds
    (at most `limit` seconds): a peer's spinning workers must not run beside
    the next engine's turn."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        cpu = time.process_time()
        time.sleep(step)
        if time.process_time() - cpu < 0.1 * step:
            return


def interleaved(runners: dict, rounds: int, warm: int = 0) -> dict[str, dict]:
    """Time every runner once per round, in turn, each after `settle` and
    `warm` untimed calls; `{engine: {"min": s, "median": s, "rounds": [s, ...]}}`."""
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            settle()
            for _ in range(warm):
                run()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: {"min": min(t), "median": float(np.median(t)), "rounds": t} for name, t in times.items()}


@pytest.fixture(scope="session")
def onnx_dir():
    with tempfile.TemporaryDirectory(prefix="jtile-bench-real-") as directory:
        yield Path(directory)


@pytest.fixture(scope="session", autouse=True)
def real_report(request):
    before = os.getloadavg()
    yield
    if RESULTS:
        load = os.getloadavg()
        meta = {"rounds": ROUNDS, "warm": WARM, "threads": THREADS, "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"],
                "notes": NOTES, "matmul_peak_gflops": PEAK, "copy_gbps": COPY_GBPS, "loadavg_start": before, "loadavg_end": load}
        text = report.write(RESULTS, Path(__file__).parent / "results", others=PEERS, prefix="real",
                            meta=meta, best_of=BEST_OF)
        missing = [f"{case}: {engine} {why}" for case, notes in NOTES.items() for engine, why in notes.items()]
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print("\n".join([text, f"matmul peak GFLOP/s: {PEAK}", f"memory copy GB/s (read + written): {COPY_GBPS}",
                             f"load average (1, 5, 15 min) at start {before}, at end {load}", *missing]))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name.replace(" ", "_")) for c in CASES])
def test_real_model(onnx_dir, case):
    path = case.onnx_path(onnx_dir)
    runners, missing = _runners(case, path)
    expected = runners["ort"]()
    scale = float(np.max(np.abs(expected))) or 1.0
    for name, run in runners.items():
        np.testing.assert_allclose(run(), expected, rtol=case.rtol, atol=case.rtol * scale,
                                   err_msg=f"{case.name} on {name} against ONNX Runtime")
    RESULTS[case.name] = interleaved(runners, ROUNDS, WARM)
    NOTES[case.name] = missing


def test_matmul_peak():
    """Attainable f32 multiply-add rate: 2*n^3 flops of an n=1024 matmul, best of 10."""
    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    jitted = jax.jit(jnp.matmul)
    ja = jnp.asarray(a)
    runners = {"jax matmul": lambda: jax.block_until_ready(jitted(ja, ja)), "numpy matmul": lambda: a @ a}
    np.testing.assert_allclose(np.asarray(runners["jax matmul"]()), runners["numpy matmul"](), rtol=1e-3, atol=1e-1)
    for name, timing in interleaved(runners, 10).items():
        PEAK[name] = 2 * n**3 / timing["min"] / 1e9
    assert all(math.isfinite(v) and v > 0 for v in PEAK.values())


def test_memory_copy():
    """Memory bandwidth: bytes read and written by a 64 MB array copy (numpy), best of 10."""
    size = 64 << 20
    source = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32)
    target = np.empty_like(source)
    timing = interleaved({"copy": lambda: np.copyto(target, source)}, 10)["copy"]
    np.testing.assert_array_equal(target, source)
    COPY_GBPS["64 MB"] = 2 * size / timing["min"] / 1e9
    assert math.isfinite(COPY_GBPS["64 MB"]) and COPY_GBPS["64 MB"] > 0
