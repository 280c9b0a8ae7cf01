"""Turn benchmark timings into the ratio table, a JSON file and a bar chart.

`write(results, directory)` takes `{case: {backend: {"min": s, "median": s}}}`,
writes `bench-<time>.json` and `bench-<time>.png` into `directory` and returns
the table as text. A ratio is `time(other) / time(jtile)` on the best (min)
round: above 1 jtile is faster. `python benchmarks/report.py FILE.json` prints
the table of an earlier run again.

!!! warning

    The chart needs matplotlib (the `bench` extra); without it only the table and
    the JSON are written.
"""

import datetime
import json
import platform
import sys
from pathlib import Path

OTHERS = ("jax", "ort", "torch")
_LABELS = {"jax": "jax.jit", "ort": "ORT", "torch": "torch"}


def ratios(results: dict) -> dict[str, dict[str, float]]:
    """`{case: {other backend: time(other) / time(jtile)}}` where both were timed."""
    table = {}
    for case, times in results.items():
        if "jtile" in times:
            mine = times["jtile"]["min"]
            table[case] = {b: times[b]["min"] / mine for b in OTHERS if b in times}
    return table


def table(results: dict) -> str:
    """The ratio table, one row per case, times in milliseconds."""
    head = f"{'case':<28}" + "".join(f"{b + ' ms':>11}" for b in ("jtile", *OTHERS))
    head += "".join(f"{'vs ' + _LABELS[b]:>11}" for b in OTHERS)
    lines = [head, "-" * len(head)]
    speedups = ratios(results)
    for case, times in results.items():
        row = f"{case:<28}"
        row += "".join(
            f"{times[b]['min'] * 1e3:>11.3f}" if b in times else f"{'-':>11}" for b in ("jtile", *OTHERS)
        )
        row += "".join(
            f"{speedups[case][b]:>10.2f}x" if b in speedups.get(case, {}) else f"{'-':>11}"
            for b in OTHERS
        )
        lines.append(row)
    return "\n".join(lines)


def _chart(results: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install '.[bench]')"
    speedups = ratios(results)
    cases = list(speedups)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4.5))
    width = 0.8 / len(OTHERS)
    for i, other in enumerate(OTHERS):
        xs = [c + (i - 1) * width for c in range(len(cases))]
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


def write(results: dict, directory: Path) -> str:
    """Write JSON and chart for `results` into `directory`; return the table and file names."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = directory / f"bench-{stamp}"
    meta = {"utc": stamp, "machine": platform.machine(), "python": platform.python_version()}
    payload = {"meta": meta, "results": results, "ratios": ratios(results)}
    base.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    chart = _chart(results, base.with_suffix(".png"))
    return "\n".join(["", table(results), "", f"json: {base.with_suffix('.json')}", chart])


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1]).read_text())["results"]))
