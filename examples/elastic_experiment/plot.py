"""Plots elastic_experiment's output: throughput and world size over time,
with the job's failure / resized / resumed events (and the scenario's own
actions) as labelled vertical lines.

    /usr/bin/python3 plot.py DIR   # reads DIR/timeline.csv, DIR/events.csv; writes DIR/elastic.png
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {  # kind: (colour, line style)
    "failure": ("tab:red", "-"),
    "resized": ("tab:green", "--"),
    "resumed": ("tab:blue", ":"),
    "scenario": ("0.4", "-."),
}


def main(out):
    rows = list(csv.DictReader(open(os.path.join(out, "timeline.csv"))))
    events = [e for e in csv.DictReader(open(os.path.join(out, "events.csv"))) if e["kind"] in STYLE]
    t = [float(r["time_s"]) for r in rows]
    sps = [float(r["samples_per_s"]) for r in rows]
    wall = [float(r.get("wall_samples_per_s") or 0) or float("nan") for r in rows]  # 0 = not measured
    world = [int(r["world_size"]) for r in rows]

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6.5),
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    if any(w == w for w in wall):
        top.plot(t, wall, color="tab:orange", lw=0.8, alpha=0.5, label="wall clock (incl. driver, recovery)")
    top.plot(t, sps, color="tab:blue", lw=1.2, label="train() time")
    top.set_ylabel("samples/s")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.set_title("elastic job: a node joins, then a node is SIGKILLed")
    bottom.step(t, world, where="post", color="tab:purple", lw=2)
    bottom.set_ylabel("workers")
    bottom.set_xlabel("seconds since fit() began")
    bottom.set_yticks(range(0, max(world + [3]) + 1))
    bottom.set_ylim(0, max(world + [3]) + 0.5)
    bottom.grid(alpha=0.3)

    # One line per event; labels stacked so close events stay readable.
    ymax = top.get_ylim()[1]
    seen = set()
    for i, e in enumerate(events):
        x = float(e["time_s"])
        colour, style = STYLE[e["kind"]]
        label = e["kind"] if e["kind"] not in seen else None
        seen.add(e["kind"])
        for ax in (top, bottom):
            ax.axvline(x, color=colour, ls=style, lw=1.2, label=label if ax is top else None)
        text = e["detail"] if e["kind"] in ("scenario", "resized") else e["kind"]
        if len(text) > 40:
            text = text[:38] + "…"
        top.text(x, ymax * (0.97 - 0.09 * (i % 4)), " " + text, color=colour, fontsize=8, va="top",
                 bbox=dict(facecolor="white", edgecolor="none", alpha=0.7, pad=1))
    top.legend(loc="lower left", fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "elastic.png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "elastic_experiment_out")
