"""Turn benchmark timings into the ratio table, a JSON file and a bar chart.

`write(results, directory)` takes `{case: {backend: {"min": s, "median": s}}}`,
writes `bench-<time>.json` and `bench-<time>.png` into `directory` and returns
the table as text. A ratio is `time(other) / time(jtile)` on the best (min)
round: above 1 jtile is faster. Where every backend of a case also has
`"rounds"` (its time in each round of an interleaved run), a second table
gives the median over rounds of each round's ratio: the engines of a round run
milliseconds apart, so a drift of the machine between rounds (a noisy
neighbour slowing every engine for minutes) cancels out of it.
`python benchmarks/report.py FILE.json` prints the tables of an earlier run again.

!!! warning

    The chart needs matplotlib (the `bench` extra); without it only the table and
    the JSON are written.
"""

import datetime
import json
import math
import platform
import statistics
import sys
from pathlib import Path

OTHERS = ("jax", "ort", "torch")
_LABELS = {"jax": "jax.jit", "ort": "ORT", "torch": "torch", "openvino": "OpenVINO",
           "torch_compile": "t.compile", "best": "best peer"}
BEST = "best"  # the per-case faster of the `best_of` backends, a column of its own


def with_best(results: dict, best_of: tuple[str, ...]) -> dict:
    """`results` with a `"best"` backend per case: the fastest (min) of `best_of`
    timed there; its `"rounds"`, where all of them have some, are the fastest
    of them in each round."""
    out = {}
    for case, times in results.items():
        timed = [times[b] for b in best_of if b in times]
        best = dict(min(timed, key=lambda t: t["min"])) if timed else None
        if best is not None and all("rounds" in t for t in timed):
            best["rounds"] = [min(r) for r in zip(*(t["rounds"] for t in timed))]
        out[case] = dict(times, **({BEST: best} if best is not None else {}))
    return out


def ratios(results: dict, others: tuple[str, ...] = OTHERS, paired: bool = False) -> dict[str, dict[str, float]]:
    """`{case: {other backend: time(other) / time(jtile)}}` where both were
    timed: of the best rounds, or with `paired` the median of each round's
    ratio (cases and backends without `"rounds"` left out)."""
    table = {}
    for case, times in results.items():
        if "jtile" not in times:
            continue
        mine = times["jtile"]
        if not paired:
            table[case] = {b: times[b]["min"] / mine["min"] for b in others if b in times}
        elif "rounds" in mine:
            table[case] = {b: statistics.median([t / m for t, m in zip(times[b]["rounds"], mine["rounds"])])
                           for b in others if "rounds" in times.get(b, {})}
    return table


def geomeans(results: dict, others: tuple[str, ...] = OTHERS, paired: bool = False) -> dict[str, float]:
    """The geometric mean of each backend's ratio (as `ratios`) over the cases that timed it."""
    speedups = ratios(results, others, paired)
    means = {}
    for b in others:
        logs = [math.log(r[b]) for r in speedups.values() if b in r]
        if logs:
            means[b] = math.exp(sum(logs) / len(logs))
    return means


def table(results: dict, others: tuple[str, ...] = OTHERS, paired: bool = False) -> str:
    """The ratio table, one row per case, times in milliseconds; geometric means
    last. The best rounds' times and ratios, or with `paired` the median times
    and the median of each round's ratio."""
    w = max(11, 2 + max(len(f"vs {_LABELS[b]}") for b in others), 2 + max(len(f"{b} ms") for b in others))
    head = f"{'case':<28}" + "".join(f"{b + ' ms':>{w}}" for b in ("jtile", *others))
    head += "".join(f"{'vs ' + _LABELS[b]:>{w}}" for b in others)
    lines = [head, "-" * len(head)]
    speedups, shown = ratios(results, others, paired), "median" if paired else "min"
    for case, times in results.items():
        row = f"{case:<28}"
        row += "".join(
            f"{times[b][shown] * 1e3:>{w}.3f}" if b in times else f"{'-':>{w}}" for b in ("jtile", *others)
        )
        row += "".join(
            f"{speedups[case][b]:>{w - 1}.2f}x" if b in speedups.get(case, {}) else f"{'-':>{w}}"
            for b in others
        )
        lines.append(row)
    if len(results) > 1:
        means = geomeans(results, others, paired)
        row = f"{'geometric mean':<28}" + " " * w * (1 + len(others))
        row += "".join(f"{means[b]:>{w - 1}.2f}x" if b in means else f"{'-':>{w}}" for b in others)
        lines += ["-" * len(head), row]
    return "\n".join(lines)


def _chart(results: dict, path: Path, others: tuple[str, ...] = OTHERS) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install '.[bench]')"
    speedups = ratios(results, others)
    cases = list(speedups)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4.5))
    width = 0.8 / len(others)
    for i, other in enumerate(others):
        xs = [c + (i - (len(others) - 1) / 2) * width for c in range(len(cases))]
        ax.bar(xs, [speedups[c].get(other, 0.0) for c in cases], width, label=f"vs {_LABELS[other]}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("jtile speed-up (time other / time jtile)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart: {path}"


def write(results: dict, directory: Path, *, others: tuple[str, ...] = OTHERS, prefix: str = "bench",
          meta: dict | None = None, best_of: tuple[str, ...] = ()) -> str:
    """Write JSON and chart for `results` into `directory`; return the table and file names.

    `best_of` adds a `best` column, the faster of those backends per case;
    `meta` is stored beside the machine description.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if best_of:
        results, others = with_best(results, best_of), (*others, BEST)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = directory / f"{prefix}-{stamp}"
    meta = {"utc": stamp, "machine": platform.machine(), "python": platform.python_version(),
            "others": others, **(meta or {})}
    payload = {"meta": meta, "results": results, "ratios": ratios(results, others),
               "geomeans": geomeans(results, others), "paired_ratios": ratios(results, others, paired=True),
               "paired_geomeans": geomeans(results, others, paired=True)}
    base.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    chart = _chart(results, base.with_suffix(".png"), others)
    return "\n".join(["", *tables(results, others), "", f"json: {base.with_suffix('.json')}", chart])


def tables(results: dict, others: tuple[str, ...] = OTHERS) -> list[str]:
    """The best rounds' table, and the paired one where the results have rounds."""
    out = [table(results, others)]
    if ratios(results, others, paired=True):
        out += ["", "Median over rounds of each round's ratio (times: medians):", table(results, others, paired=True)]
    return out


if __name__ == "__main__":
    payload = json.loads(Path(sys.argv[1]).read_text())
    print("\n".join(tables(payload["results"], tuple(payload["meta"].get("others", OTHERS)))))
