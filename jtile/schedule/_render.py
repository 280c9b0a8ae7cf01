"""Mermaid text and matplotlib PNGs of schedules, in Aidge's formats.

`gantt` writes Aidge's static-scheduling diagram: `gantt`, `dateFormat x`,
`axisFormat %Q`, then `name (Kind#k) :early, late` per run, `milestone`
where early == late. `factorized` adds Aidge's `section seq#k (xN)`
headers, lists one iteration of each repeated section (its runs flagged
`active`) and numbers steps on that folded sequence. `flowchart` draws the
nodes and their tensors. `plot` draws bars from early to late (or from start
to end for timed tasks), coloured by kind, the critical path outlined.

!!! warning

    Mermaid forbids ":" in task names; it becomes "_" as in Aidge.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Bar:
    """One run (steps) or one timed task (microseconds) to draw."""

    name: str
    kind: str
    label: str  # "Kind#k", Aidge's ranked type name
    start: float
    end: float
    critical: bool = False
    active: bool = False


def _clean(name: str) -> str:
    return name.replace(":", "_").replace(";", "_")


_HEADER = "gantt\ndateFormat x\naxisFormat %Q\n"


def _line(bar: Bar) -> str:
    flags = ("milestone, " if bar.start == bar.end else "") + ("active, " if bar.active else "")
    return f"{_clean(bar.name)} ({bar.label}) :{flags}{_num(bar.start)}, {_num(bar.end)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"


def gantt(bars: list[Bar], title: str | None = None) -> str:
    lines = [_HEADER] + ([f"title {title}"] if title else []) + [_line(b) for b in bars]
    return "\n".join(lines) + "\n\n"


def factorized(sections: list[tuple[int, list[Bar]]]) -> str:
    """`sections`: (repeats, the bars of one iteration) in order."""
    lines = [_HEADER]
    for k, (repeats, bars) in enumerate(sections):
        lines.append(f"section seq#{k}" + (f" (x{repeats})" if repeats > 1 else ""))
        lines += [_line(dataclasses.replace(b, active=repeats > 1)) for b in bars]
    return "\n".join(lines) + "\n\n"


def flowchart(nodes: list[tuple[str, str, bool]], edges: list[tuple[int, int, str]]) -> str:
    """`nodes`: (name, Kind#k label, critical); `edges`: (from, to, tensor label)."""
    lines = ["flowchart TB"]
    for i, (name, label, critical) in enumerate(nodes):
        text = f'"{_quote(name)}<br/><sub><em>({label})</em></sub>"'
        shape = f"([{text}])" if label.startswith("input#") else f"({text})"
        lines.append(f"n{i}{shape}" + (":::critical" if critical else ""))
    lines += [f'n{a} -->|"{_quote(label)}"| n{b}' for a, b, label in edges]
    lines.append("classDef critical stroke:#c00,stroke-width:3px")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return text.replace('"', "#quot;")


def plot(bars: list[Bar], path: str, xlabel: str = "logical step", title: str | None = None) -> None:
    """A PNG timeline of `bars`, one row each (needs matplotlib, the `plot` extra).

    Draws on a bare `Figure`, so the caller's pyplot state and backend are untouched."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:  # pragma: no cover - depends on the environment
        from .._errors import ConfigError

        raise ConfigError(f"Schedule.plot needs matplotlib (pip install 'jtile[plot]'): {e}") from None
    kinds = list(dict.fromkeys(b.kind for b in bars))
    cmap = matplotlib.colormaps["tab20"]
    colour = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    steps = xlabel == "logical step"
    fig = Figure(figsize=(11, min(0.22 * len(bars) + 1.5, 40)))
    ax = fig.subplots()
    for row, b in enumerate(bars):
        width = (b.end - b.start) + (1 if steps else 0)
        ax.barh(row, width, left=b.start - (0.5 if steps else 0), height=0.8, color=colour[b.kind],
                edgecolor="#c00" if b.critical else "none", linewidth=1.5)
    if len(bars) <= 120:
        ax.set_yticks(range(len(bars)), [b.name for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    handles = [Rectangle((0, 0), 1, 1, color=colour[k]) for k in kinds]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#c00", linewidth=1.5))
    ax.legend(handles, [*kinds, "critical path"], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    if steps:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title or "schedule")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
