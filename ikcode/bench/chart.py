"""The bench chart: p50 and p95 time to first token, warm beside cold, all turns and the steady
state (turns sent after every agent's first turn finished), per policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_chart(reports: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = ("warm", "cold", "all", "steady")
    colors = {"warm": "#2a9d8f", "cold": "#e76f51", "all": "#6c757d", "steady": "#264653"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=False)
    width = 0.8 / len(classes)
    for ax, pct in zip(axes, ("p50", "p95"), strict=True):
        for k, cls in enumerate(classes):
            xs = [i + (k - 1.5) * width for i in range(len(reports))]
            blocks = [_block(r, cls) for r in reports]
            # No turn of the class finished: no bar (a 0.0 one would read as instant), "n/a" label.
            ys = [b[pct] if b.get("n", 1) else 0.0 for b in blocks]
            bars = ax.bar(xs, ys, width, label=cls, color=colors[cls])
            labels = [f"{y:.1f}" if b.get("n", 1) else "n/a" for y, b in zip(ys, blocks, strict=True)]
            ax.bar_label(bars, labels=labels, fontsize=8, padding=2)
        ax.set_xticks(range(len(reports)), [str(r["config"].get("policy", "?")) for r in reports])
        ax.set_title(f"{pct} time to first token")
        ax.set_ylabel("seconds")
        if pct == "p95":
            ax.axhline(15.0, color="black", linestyle="--", linewidth=0.8)
            ax.text(ax.get_xlim()[1], 15.0, " 15 s", va="bottom", ha="right", fontsize=8)
    axes[0].legend(title="turns")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def _block(report: dict[str, Any], cls: str) -> dict[str, Any]:
    if cls == "all":
        return report["ttft"]
    if cls == "steady":
        return report.get("steady", {}).get("ttft", {"n": 0, "p50": 0.0, "p95": 0.0})
    return report["ttft"][cls]
