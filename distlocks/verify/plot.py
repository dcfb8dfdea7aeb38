"""The timeline of a verifier run as a PNG: one row per process, its critical sections, the faults."""

from __future__ import annotations

from pathlib import Path

from distlocks.verify.history import History, Section, Verdict

COLORS = {"ok": "#4c9f70", "rejected": "#f0a202", "killed": "#7f7f7f"}
OTHER = "#c0392b"  # an error, a section cut short


def draw(history: History, verdict: Verdict, path: str | Path, title: str) -> None:
    """Draw ``history`` to the PNG file ``path``; sections that overlap another get a red outline.

    Raise ImportError if matplotlib is missing (``pip install 'distlocks[plot]'``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    processes = list(dict.fromkeys(section.process for section in history.sections))
    for fault in history.faults:
        if fault.process not in processes:
            processes.append(fault.process)
    row = {process: i for i, process in enumerate(processes)}
    overlapping = {id(section) for pair in verdict.overlaps for section in pair}

    figure = Figure(figsize=(12, 1.2 + 0.45 * max(len(processes), 2)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()

    def x(moment: float) -> float:
        return moment - history.origin

    for fault in history.faults:
        y = row[fault.process]
        if fault.kind == "pause":
            axes.axvspan(x(fault.start), x(fault.end), ymin=0, ymax=1, color="#3b75af", alpha=0.08)
            axes.plot([x(fault.start), x(fault.end)], [y, y], color="#3b75af", linewidth=6, alpha=0.35)
        else:
            axes.plot([x(fault.start)], [y], marker="X", markersize=11, color="black", linestyle="none")

    def bar(section: Section) -> None:
        color = COLORS.get(section.outcome, OTHER)
        edge = "red" if id(section) in overlapping else color
        start, width = x(section.start), max(section.end - section.start, 1e-4)
        axes.broken_barh([(start, width)], (row[section.process] - 0.3, 0.6), facecolors=color, edgecolors=edge)

    for section in history.sections:
        bar(section)
    axes.set_yticks(range(len(processes)), [f"pid {process}" for process in processes])
    axes.set_ylim(-0.7, len(processes) - 0.3)
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the run started (one monotonic clock for every process)")
    axes.set_title(title, loc="left", fontsize=10)
    legend = [
        Patch(color=COLORS["ok"], label="critical section, write committed"),
        Patch(color=COLORS["rejected"], label="write rejected by the fence"),
        Patch(color=COLORS["killed"], label="killed inside"),
        Patch(facecolor="white", edgecolor="red", label="overlaps another section"),
        Patch(color="#3b75af", alpha=0.35, label="paused (SIGSTOP)"),
        axes.plot([], [], marker="X", color="black", linestyle="none", label="killed (SIGKILL)")[0],
    ]
    axes.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=3, fontsize=8, frameon=False)
    figure.savefig(path, dpi=110)
