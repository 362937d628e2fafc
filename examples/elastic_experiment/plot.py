"""Plots elastic_experiment's output: throughput and world size over time,
with the job's failure / resized / resumed events (and the scenario's own
actions) as labelled vertical lines.

    /usr/bin/python3 plot.py DIR   # reads DIR/timeline.csv, DIR/events.csv; writes DIR/elastic.png
"""
import csv
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {  # kind: (colour, line style)
    "scenario": ("0.35", "-."),
    "failure": ("tab:red", "-"),
    "resized": ("tab:green", "--"),
    "resumed": ("tab:blue", ":"),
}
NAN = float("nan")


def label(e):
    if e["kind"] == "scenario":
        return e["detail"]
    if e["kind"] == "resized":
        m = re.match(r"(\d+) -> (\d+)", e["detail"])
        return "resized %s → %s" % m.groups() if m else "resized"
    if e["kind"] == "resumed":
        return "resumed at step " + e["step"]
    return "failure at step " + e["step"]


def title(events):
    """Says what happened in this run: the scenario's actions as they were
    done, and the failures the job saw; nothing that did not happen."""
    parts = []
    for e in events:
        if e["kind"] != "scenario":
            continue
        detail = e["detail"].replace(" killed", " SIGKILLed").replace(" added", " joined")
        parts.append("%s at %.1f s" % (detail, float(e["time_s"])))
    failures = sum(1 for e in events if e["kind"] == "failure")
    if failures:
        parts.append("%d failure%s recovered from" % (failures, "" if failures == 1 else "s"))
    what = ", ".join(parts) if parts else "no node joined or died"
    return "elastic job: %s (%d CPU cores)" % (what, os.cpu_count() or 0)


def with_gaps(t, ys):
    """Breaks the line where no step boundary was seen for a long while (a
    recovery), rather than drawing a straight segment across it."""
    if len(t) < 3:
        return t, ys
    gaps = sorted(b - a for a, b in zip(t, t[1:]))
    limit = 4 * gaps[len(gaps) // 2]
    tt, out = [t[0]], [list(y[:1]) for y in ys]
    for i in range(1, len(t)):
        if t[i] - t[i - 1] > limit:
            tt.append((t[i] + t[i - 1]) / 2)
            for o in out:
                o.append(NAN)
        tt.append(t[i])
        for o, y in zip(out, ys):
            o.append(y[i])
    return tt, out


def smooth(t, ys, window):
    """Mean over the trailing `window` seconds, restarting after a gap (NaN)."""
    out, start = [], 0
    for i, y in enumerate(ys):
        if y != y:
            out.append(NAN)
            start = i + 1
            continue
        while t[i] - t[start] > window:
            start += 1
        vals = [v for v in ys[start:i + 1] if v == v]
        out.append(sum(vals) / len(vals))
    return out


def main(out):
    rows = list(csv.DictReader(open(os.path.join(out, "timeline.csv"))))
    events = list(csv.DictReader(open(os.path.join(out, "events.csv"))))
    t = [float(r["time_s"]) for r in rows]
    sps = [float(r["samples_per_s"]) for r in rows]
    wall = [float(r.get("wall_samples_per_s") or 0) or NAN for r in rows]  # 0 = not measured
    tg, (sps_g, wall_g) = with_gaps(t, [sps, wall])

    # World size: at each step boundary, and exactly when the job changed it.
    ws = [(float(r["time_s"]), int(r["world_size"])) for r in rows]
    ws += [(float(e["time_s"]), int(e["world_size"])) for e in events
           if e["kind"] in ("started", "resized", "resumed", "finished")]
    ws.sort()

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6.5),
                                      gridspec_kw={"height_ratios": [3, 1.2]})
    top.plot(tg, wall_g, color="tab:orange", lw=0.8, alpha=0.6, label="samples / wall time between step boundaries")
    top.plot(tg, sps_g, color="tab:blue", lw=0.7, alpha=0.45, label="samples / time in train(), per round")
    top.plot(tg, smooth(tg, sps_g, 1.0), color="tab:blue", lw=2, label="the same, 1 s mean")
    top.set_ylabel("samples/s")
    finite = sorted(s for s in sps if s == s) or [1.0]
    top.set_ylim(0, finite[int(0.98 * (len(finite) - 1))] * 1.6)
    top.grid(alpha=0.3)
    top.set_title(title(events), fontsize=10)
    bottom.step([w[0] for w in ws], [w[1] for w in ws], where="post", color="tab:purple", lw=2)
    top_world = max([w[1] for w in ws] + [3])
    bottom.set_ylabel("workers")
    bottom.set_xlabel("seconds since fit() began")
    bottom.set_yticks(range(0, top_world + 1))
    bottom.set_ylim(0, top_world + 0.6)
    bottom.grid(alpha=0.3)

    # One line per event, its label written up the line; labels of events
    # closer than 2% of the time axis stand side by side.
    marked = [e for e in events if e["kind"] in STYLE]
    span = max(t + [float(e["time_s"]) for e in marked] + [1.0]) - min(t + [0.0])
    seen = set()
    cluster_x, k = None, 0
    for e in marked:
        x = float(e["time_s"])
        if cluster_x is None or x - cluster_x > 0.02 * span:
            cluster_x, k = x, 0
        else:
            k += 1
        colour, style = STYLE[e["kind"]]
        legend = e["kind"] if e["kind"] not in seen else None
        seen.add(e["kind"])
        top.axvline(x, color=colour, ls=style, lw=1.2, label=legend)
        bottom.axvline(x, color=colour, ls=style, lw=1.2)
        top.annotate(label(e), (cluster_x, 0.985), xycoords=top.get_xaxis_transform(), xytext=(1 + 10 * k, 0),
                     textcoords="offset points", rotation=90, ha="left", va="top", fontsize=8, color=colour,
                     bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.85))
    top.legend(loc="lower left", fontsize=8, ncol=4, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "elastic.png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "elastic_experiment_out")
