"""`kvbank bench --plot`: pages held and requests running over virtual time, one line per policy.

Policies often draw the same line (banker+backfill over banker when nothing backfills), so each
gets its own dash pattern, marker and width, drawn widest first: a line hidden under another
still shows at its edges and by its markers. The legend sits outside the axes, the pool's limit
is labelled, and a run that deadlocked ends in a marked cross.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.simulate import RunResult

if TYPE_CHECKING:  # matplotlib loads only when a plot is asked for
    from matplotlib.figure import Figure

STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "*", "X")
MARKS_PER_LINE = 12


def check_target(path: Path) -> str | None:
    """Why the plot cannot be written to `path` (None: it can), checked before any run."""
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        return f"--plot {path}: name a .png, .svg or .pdf file"
    if not path.parent.is_dir():
        return f"--plot {path}: the folder {path.parent} does not exist; create it first"
    return None


def plot(scenario: Scenario, results: list[RunResult], path: Path) -> None:
    """Write the figure to `path` (its folder must exist)."""
    import matplotlib.pyplot as plt

    fig = figure(scenario, results)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(scenario: Scenario, results: list[RunResult]) -> Figure:
    """The figure `plot` writes; the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (pages_ax, running_ax) = plt.subplots(
        2, 1, figsize=(13, 8), sharex=True, layout="constrained"
    )
    count = max(1, len(results))
    for i, r in enumerate(results):
        step = max(1, len(r.timeline) // 2000)  # a couple of thousand points a line is plenty
        points = r.timeline[::step]
        if not points:
            continue
        times = [t for t, _, _ in points]
        # Widest first, markers staggered along the line, so coinciding lines stay visible.
        every = max(1, len(points) // MARKS_PER_LINE)
        style = {
            "label": r.policy,
            "linestyle": STYLES[i % len(STYLES)],
            "linewidth": 1.0 + 2.0 * (count - 1 - i) / count,
            "marker": MARKERS[i % len(MARKERS)],
            "markersize": 5,
            "markevery": (i * every // count, every),
        }
        (line,) = pages_ax.plot(times, [held for _, held, _ in points], **style)
        style["color"] = line.get_color()
        running_ax.plot(times, [run for _, _, run in points], **style)
        if r.metrics.get("stopped", "").startswith("deadlock"):
            end_t, end_held, end_running = points[-1]
            for ax, y in ((pages_ax, end_held), (running_ax, end_running)):
                ax.plot([end_t], [y], marker="X", markersize=14, color="red", zorder=5)
            pages_ax.annotate(
                f"{r.policy}: deadlock",
                (end_t, end_held),
                textcoords="offset points",
                xytext=(-10, -18 - 12 * i),
                ha="right",
                color="red",
                fontsize=9,
            )
    usable = scenario.pages - 1
    pages_ax.axhline(usable, color="grey", linestyle=":", linewidth=1.5)
    pages_ax.annotate(
        f"pool limit: {usable} usable pages",
        (0, usable),
        xycoords=("axes fraction", "data"),
        textcoords="offset points",
        xytext=(4, 4),
        color="dimgrey",
        fontsize=9,
    )
    pages_ax.set_ylim(0, usable * 1.1)
    pages_ax.set_ylabel("pages held")
    running_ax.set_ylabel("requests running")
    running_ax.set_xlabel("virtual time (s)")
    pages_ax.set_title(f"{scenario.name}: {scenario.pages}-page pool")
    for ax in (pages_ax, running_ax):
        ax.grid(True, alpha=0.3)
    handles, labels = pages_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", title="policy", fontsize=9)
    return fig
