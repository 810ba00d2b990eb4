"""`kvbank bench --plot-classes`: pages held by each request class over virtual time, one panel
per policy, stacked, against the pool's usable pages. It shows what a policy lets each class
hold: strict requests holding their pages steadily while best-effort ones fill what is left, or
a preempting engine taking pages from whichever class arrived last."""

from __future__ import annotations

from pathlib import Path

from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.simulate import RunResult

POINTS = 1500  # per panel: enough for the shape, small enough to draw fast


def plot_classes(scenario: Scenario, results: list[RunResult], path: Path) -> None:
    """Write the figure to `path` (its folder must exist)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c.name for c in scenario.workload.classes]
    labels = [f"{c.name} ({c.service_class.value})" for c in scenario.workload.classes]
    fig, axes = plt.subplots(
        len(results), 1, figsize=(9, 1.9 * len(results) + 0.8), sharex=True, squeeze=False
    )
    usable = scenario.pages - 1
    for ax, result in zip(axes[:, 0], results, strict=True):
        step = max(1, len(result.class_timeline) // POINTS)
        points = result.class_timeline[::step]
        times = [t for t, _ in points]
        series = [[held[i] for _, held in points] for i in range(len(names))]
        ax.stackplot(times, *series, labels=labels, alpha=0.85)
        ax.axhline(usable, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel("pages")
        ax.set_title(result.policy, fontsize=9, loc="left")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("virtual time (s)")
    fig.suptitle(
        f"{scenario.name}: pages held by class ({usable} usable; a shared page counts for each "
        f"holder)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
