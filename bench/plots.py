"""Draw a figure's timelines as PNG files next to its json (bench/run_all runs it).

    <main python> -m bench.plots bench/results/<figure>.json

For each timeline the figure recorded (bench/timeline.py: ``results
["timelines"]``), one plot ``<figure>.<key>.png``: completions answered per
second over the seconds from the fault, one line per side (stock against
ours), failed requests marked where they ended. Prints one markdown image
link per plot (relative to bench/results, where RESULTS.md is), nothing for a
figure without timelines. matplotlib is in the main env only.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Dict, List

BIN_S = 0.5
# Sides in the order the figure gives them, the baseline first and ours last:
# the baseline grey, ours blue, anything between in other colours.
BASELINE, OURS = "#888888", "#1f77b4"
BETWEEN = ["#ff7f0e", "#2ca02c", "#9467bd"]


def colours(n):
    if n == 1:
        return [OURS]
    return [BASELINE] + BETWEEN[:max(0, n - 2)] + [OURS]


def rate(requests: List[list], start: float, end: float, bin_s: float = BIN_S):
    """(bin starts, answered completions per second) over [start, end)."""
    bins = max(1, math.ceil((end - start) / bin_s))
    counts = [0] * bins
    for _sent, done, ok in requests:
        if ok and start <= done < end:
            counts[int((done - start) // bin_s)] += 1
    return [start + i * bin_s for i in range(bins)], [c / bin_s for c in counts]


def draw(key: str, timeline: Dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    arms = timeline["arms"]
    ends = [d for arm in arms.values() for _, d, _ in arm["requests"]]
    starts = [s for arm in arms.values() for s, _, _ in arm["requests"]]
    lo = math.floor(min(starts, default=-1.0))
    hi = math.ceil(max(ends, default=1.0)) + BIN_S
    fig, ax = plt.subplots(figsize=(10, 3.8), dpi=120)
    peak = 1.0
    drawn = []
    shown = [(label, arm) for label, arm in arms.items() if arm.get("requests")]
    for (label, arm), colour in zip(shown, colours(len(shown))):
        # Each side only over the stretch it was watched.
        first = math.floor(min(s for s, _, _ in arm["requests"]) / BIN_S) * BIN_S
        last = max(d for _, d, _ in arm["requests"])
        xs, ys = rate(arm["requests"], first, last)
        xs, ys = xs + [last], ys + [ys[-1]]
        peak = max(peak, max(ys, default=0.0))
        ax.step(xs, ys, where="post", color=colour, linewidth=1.8, label=label)
        drawn.append((label, arm, colour))
    # Below zero, one strip per side: each failed or timed-out request where it ended,
    # and the stretches when the bench held its traffic back (no requests sent).
    for i, (label, arm, colour) in enumerate(drawn):
        y = -peak * 0.07 * (i + 1)
        failed = [d for _, d, ok in arm["requests"] if not ok]
        if failed:
            ax.plot(failed, [y] * len(failed), linestyle="none", marker="x", markersize=4,
                    color=colour, label=f"{label}: a request failed or timed out")
        for start, end in arm.get("held", []):
            ax.plot([start, end], [y, y], color=colour, linewidth=5, alpha=0.3,
                    solid_capstyle="butt")
        for j, (t, text) in enumerate(arm.get("events", [])):
            ax.axvline(t, color=colour, linestyle=":", linewidth=1)
            ax.annotate(text, (t, 0.98 - 0.3 * (j % 3)), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="left", fontsize=7, color=colour)
    if any(arm.get("held") for _, arm, _ in drawn):
        ax.plot([], [], color="black", linewidth=5, alpha=0.3,
                label="traffic held back by the bench")
    ax.axvline(0, color="black", linestyle="--", linewidth=1)
    ax.annotate(timeline.get("zero", "fault"), (0, 0.98), xycoords=("data", "axes fraction"),
                rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(bottom=-peak * 0.07 * (len(drawn) + 1), top=peak * 1.1)
    ax.set_xlabel(f"seconds from the {timeline.get('zero', 'fault')}")
    ax.set_ylabel(f"completions answered / s\n({BIN_S:g} s bins)")
    ax.set_title(timeline.get("title", key), fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_file(figure: str, key: str) -> str:
    return f"{figure}.{re.sub(r'[^A-Za-z0-9_.-]+', '-', key)}.png"


def draw_all(json_path: Path) -> List[str]:
    """Draw every timeline of one figure's json; the markdown links."""
    document = json.loads(json_path.read_text())
    timelines = (document.get("results") or {}).get("timelines") or {}
    links = []
    for key, timeline in timelines.items():
        if not any(arm.get("requests") for arm in timeline.get("arms", {}).values()):
            continue
        name = plot_file(document["figure"], key)
        draw(key, timeline, json_path.parent / name)
        links.append(f"![{timeline.get('title', key)}]({name})")
    return links


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.plots bench/results/<figure>.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.is_file():
        print(f"bench.plots: no such results file: {path}", file=sys.stderr)
        return 2
    for link in draw_all(path):
        print(link)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
