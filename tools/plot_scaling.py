#!/usr/bin/env python3
"""Loss against training compute from a scaling report, with the fitted law, as a PNG.

  plot_scaling.py REPORT.json [--out scaling.png] [--title TEXT]

The report is the JSON that llmpar::scaling::to_json writes (examples/scaling_law.hpp,
format "llmpar-scaling-report", version 1): the runs fitted and the runs held out, the
power law L(C) = a*C^b + c with its bootstrap intervals, a band of predicted loss and
interval over compute, the prediction of each held-out run, Chinchilla's
E + A/N^alpha + B/D^beta where the runs could identify it, and optional learning-rate
sweep records.

Left panel, log-log: the fit runs as points labelled by parameter count, the power law
as a line with its bootstrap band shaded, each held-out run as a star beside its
prediction and interval (an error bar), the runs only the Chinchilla fit takes (other
tokens per parameter) hollow, and a box with the fitted parameters, their intervals and
the prediction error. Right panel, when the report has lr_sweep records:
loss against learning rate (log x) for each (parametrization, width), the best LR of
each curve marked; a diverged run (loss null) is an x on the top edge.

Errors (a missing file, not JSON, a missing or mistyped field, named by its path such as
fit_runs[2].loss) print one line and exit 1.
"""
import argparse
import json
import math
import os
import sys

try:
    import matplotlib
except ImportError:
    sys.exit("plot_scaling.py: needs matplotlib (Debian: apt-get install python3-matplotlib; or run /usr/bin/python3)")

matplotlib.use("Agg")  # no display: write files only
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

FORMAT = "llmpar-scaling-report"
VERSION = 1
# Runs closer than this (decades of compute, decades of loss) share one size label.
LABEL_DX, LABEL_DY = 0.12, 0.012


class ReportError(Exception):
    pass


def field(obj, key, where):
    if not isinstance(obj, dict):
        raise ReportError(f"{where} must be a JSON object, is {type(obj).__name__}")
    if key not in obj:
        raise ReportError(f"{where} has no field \"{key}\"")
    return obj[key]


def number(obj, key, where, allow_null=False):
    value = field(obj, key, where)
    if value is None and allow_null:
        return math.nan  # nlohmann::json writes a NaN as null: a diverged run
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{where}.{key} must be a number, is {json.dumps(value)}")
    return float(value)


def positive(obj, key, where):
    value = number(obj, key, where)
    if not (math.isfinite(value) and value > 0):
        raise ReportError(f"{where}.{key} must be a positive number, is {value!r}")
    return value


def array(obj, key, where):
    value = field(obj, key, where)
    if not isinstance(value, list):
        raise ReportError(f"{where}.{key} must be an array, is {json.dumps(value)[:40]}")
    return value


def interval(obj, key, where):
    value = field(obj, key, where)
    return number(value, "lo", f"{where}.{key}"), number(value, "hi", f"{where}.{key}")


def read_runs(report, key):
    runs = []
    for i, r in enumerate(array(report, key, "the report")):
        where = f"{key}[{i}]"
        name = field(r, "name", where)
        if not isinstance(name, str):
            raise ReportError(f"{where}.name must be a string, is {json.dumps(name)}")
        runs.append({"name": name, "params": positive(r, "params", where), "flops": positive(r, "flops", where),
                     "loss": positive(r, "loss", where)})
    return runs


def read_report(path):
    """The parts of a report the plot draws, checked."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not text; a scaling report is JSON (llmpar-scaling --report)") from None
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(report, dict):
        raise ReportError(f"{path} is not a scaling report (a JSON {type(report).__name__}, not an object with "
                          f"\"format\": \"{FORMAT}\")")
    if report.get("format") != FORMAT:
        raise ReportError(f"{path} is not a scaling report (format {json.dumps(report.get('format'))}, "
                          f"expected \"{FORMAT}\")")
    if report.get("version") != VERSION:
        raise ReportError(f"{path}: report version {json.dumps(report.get('version'))}, this script reads {VERSION}")

    out = {"fit_runs": read_runs(report, "fit_runs"), "held_out": read_runs(report, "held_out"),
           "chinchilla_only_runs": read_runs(report, "chinchilla_only_runs") if "chinchilla_only_runs" in report
           else [],
           "excluded_runs": read_runs(report, "excluded_runs") if "excluded_runs" in report else [],
           "excluded_why": report.get("excluded_why", "")}
    if not out["fit_runs"]:
        raise ReportError(f"{path} has no fit runs: nothing to plot")
    pl = field(report, "power_law", "the report")
    boot = field(pl, "bootstrap", "power_law")
    out["power_law"] = {
        "a": number(pl, "a", "power_law"), "b": number(pl, "b", "power_law"), "c": number(pl, "c", "power_law"),
        "intervals": {k: interval(boot, k, "power_law.bootstrap") for k in ("a", "b", "c")},
        "confidence": number(boot, "confidence", "power_law.bootstrap"),
        "used": int(number(boot, "used", "power_law.bootstrap")),
        "degenerate": int(number(boot, "degenerate", "power_law.bootstrap")),
    }
    band = []
    for i, b in enumerate(array(report, "band", "the report")):
        where = f"band[{i}]"
        band.append(tuple(number(b, k, where) for k in ("flops", "loss", "lo", "hi")))
    if len(band) < 2:
        raise ReportError(f"{path}: the band has {len(band)} point(s); the fit's line needs at least 2")
    out["band"] = sorted(band)
    predictions = []
    for i, p in enumerate(array(report, "held_out_predictions", "the report")):
        where = f"held_out_predictions[{i}]"
        predictions.append({"name": str(field(p, "name", where)), "flops": positive(p, "flops", where),
                            "achieved": number(p, "achieved", where), "predicted": number(p, "predicted", where),
                            "lo": number(p, "lo", where), "hi": number(p, "hi", where),
                            "relative_error": number(p, "relative_error", where),
                            # reports from before the seed bootstrap have no seed_noise
                            "seed_noise": (interval(p, "seed_noise", where)
                                           if p.get("seed_noise") is not None else None)})
    out["predictions"] = predictions
    ch = field(report, "chinchilla", "the report")
    out["chinchilla"] = None
    if ch is not None:
        cb = field(ch, "bootstrap", "chinchilla")
        out["chinchilla"] = {k: (number(ch, k, "chinchilla"), interval(cb, k, "chinchilla.bootstrap"))
                             for k in ("E", "A", "B", "alpha", "beta")}
    note = field(report, "chinchilla_note", "the report")
    out["chinchilla_note"] = note if isinstance(note, str) else ""
    sweep = []
    for i, s in enumerate(array(report, "lr_sweep", "the report")):
        where = f"lr_sweep[{i}]"
        p = field(s, "parametrization", where)
        if p not in ("sp", "mup"):
            raise ReportError(f"{where}.parametrization is {json.dumps(p)}; expected \"sp\" or \"mup\"")
        width = field(s, "width", where)
        if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
            raise ReportError(f"{where}.width must be a positive whole number (the model dim), is {json.dumps(width)}")
        sweep.append((p, width, positive(s, "lr", where), number(s, "loss", where, allow_null=True)))
    out["lr_sweep"] = sweep
    return out


def count(n):
    """124000000 -> '124M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def label_groups(runs):
    """Parameter-count labels, one per cluster of runs that sit within a label's size of
    each other on the log-log plot (sizes at nearly the same compute and loss would
    print over each other): [((flops, loss) of the cluster's first run, [label, ...])]."""
    groups = []
    for r in sorted(runs, key=lambda r: (r["flops"], r["loss"])):
        x, y = math.log10(r["flops"]), math.log10(r["loss"])
        for (gx, gy), anchor, labels in groups:
            if abs(x - gx) < LABEL_DX and abs(y - gy) < LABEL_DY:
                if count(r["params"]) not in labels:
                    labels.append(count(r["params"]))
                break
        else:
            groups.append(((x, y), (r["flops"], r["loss"]), [count(r["params"])]))
    return [(anchor, labels) for _, anchor, labels in groups]


def nice_ticks(lo, hi, want=8):
    """About `want` round values between lo and hi (for a log axis spanning less than a decade)."""
    span = hi - lo
    step = 10 ** math.floor(math.log10(span / want))
    for m in (1, 2, 2.5, 5, 10):
        if span / (m * step) <= want:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def plot_compute(ax, r):
    pl, band = r["power_law"], r["band"]
    color, held_color, pred_color = "tab:blue", "tab:red", "tab:orange"
    flops = [b[0] for b in band]
    conf = pl["confidence"]
    ax.fill_between(flops, [b[2] for b in band], [b[3] for b in band], color=color, alpha=0.18, linewidth=0,
                    label=f"{conf:.0%} bootstrap band ({pl['used']} resamples)")
    ax.plot(flops, [b[1] for b in band], color=color, linewidth=1.6, label="power law a\u00b7C^b + c")
    fit = r["fit_runs"]
    ax.plot([x["flops"] for x in fit], [x["loss"] for x in fit], linestyle="none", marker="o", markersize=6,
            color=color, markeredgecolor="white", zorder=4, label=f"fit runs ({len(fit)})")
    for (flops, loss), sizes in label_groups(fit):
        ax.annotate(", ".join(sizes), (flops, loss), xytext=(5, 5), textcoords="offset points", fontsize=8,
                    color="0.25")

    extra = r["chinchilla_only_runs"]
    if extra:
        ax.plot([x["flops"] for x in extra], [x["loss"] for x in extra], linestyle="none", marker="o", markersize=6,
                markerfacecolor="none", markeredgecolor="0.45", zorder=3,
                label=f"other tokens/param ({len(extra)}, Chinchilla fit only)")

    excluded = r["excluded_runs"]
    if excluded:
        ax.plot([x["flops"] for x in excluded], [x["loss"] for x in excluded], linestyle="none", marker="x",
                markersize=7, color="0.45", zorder=3, label=f"not fitted ({len(excluded)}): {r['excluded_why']}")

    losses = [x["loss"] for x in fit + extra + excluded] + [b[1] for b in band]
    for i, p in enumerate(r["predictions"]):
        ax.errorbar([p["flops"]], [p["predicted"]], yerr=[[p["predicted"] - p["lo"]], [p["hi"] - p["predicted"]]],
                    fmt="D", markersize=6, color=pred_color, capsize=5, elinewidth=1.5, zorder=5,
                    label=f"prediction, {conf:.0%} interval" if i == 0 else None)
        if p["seed_noise"]:
            lo, hi = p["seed_noise"]
            ax.errorbar([p["flops"]], [p["predicted"]], yerr=[[p["predicted"] - lo], [hi - p["predicted"]]],
                        fmt="none", color=pred_color, capsize=0, elinewidth=5, alpha=0.45, zorder=4,
                        label=f"from the fit runs' seeds alone, {conf:.0%}" if i == 0 else None)
        ax.plot([p["flops"]], [p["achieved"]], linestyle="none", marker="*", markersize=15, color=held_color,
                markeredgecolor="black", markeredgewidth=0.6, zorder=6, label="held-out run" if i == 0 else None)
        ax.annotate(f"{p['name']}: {p['relative_error']:+.2%}", (p["flops"], p["achieved"]), xytext=(8, -12),
                    textcoords="offset points", fontsize=8, color=held_color)
        losses += [p["achieved"], p["lo"], p["hi"]]

    ax.set_xscale("log")
    ax.set_yscale("log")
    finite = [v for v in losses if math.isfinite(v) and v > 0]
    low, high = min(finite), max(finite)
    pad = (high / low) ** 0.06
    ax.set_ylim(low / pad, high * pad)
    if high / low < 10:  # within a decade a log axis has no labelled ticks of its own
        ax.yaxis.set_major_locator(FixedLocator(nice_ticks(low / pad, high * pad)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower left", fontsize=8)

    iv = pl["intervals"]
    lines = ["L(C) = a\u00b7C^b + c",
             f"a = {pl['a']:.4g}  [{iv['a'][0]:.3g}, {iv['a'][1]:.3g}]",
             f"b = {pl['b']:.4f}  [{iv['b'][0]:.4f}, {iv['b'][1]:.4f}]",
             f"c = {pl['c']:.4f}  [{iv['c'][0]:.4f}, {iv['c'][1]:.4f}]",
             f"{conf:.0%} intervals, {pl['used']} resamples ({pl['degenerate']} degenerate)"]
    for p in r["predictions"]:
        lines.append(f"{p['name']}: predicted {p['predicted']:.4f} [{p['lo']:.4f}, {p['hi']:.4f}], "
                     f"achieved {p['achieved']:.4f} ({p['relative_error']:+.2%})")
        if p["seed_noise"]:
            lines.append(f"  from the seeds alone: [{p['seed_noise'][0]:.4f}, {p['seed_noise'][1]:.4f}]")
    if r["chinchilla"]:
        ch = r["chinchilla"]
        lines.append("E + A/N^\u03b1 + B/D^\u03b2:")
        lines.append("  " + ", ".join(f"{k} = {ch[k][0]:.3g}" for k in ("E", "A", "B")))
        lines.append("  " + ", ".join(f"{s} = {ch[k][0]:.3f} [{ch[k][1][0]:.3f}, {ch[k][1][1]:.3f}]"
                                      for k, s in (("alpha", "\u03b1"), ("beta", "\u03b2"))))
    elif r["chinchilla_note"]:
        note = r["chinchilla_note"].split(";")[0].removeprefix("Chinchilla fit: ")
        lines.append("no Chinchilla fit: " + (note if len(note) <= 70 else note[:69] + "\u2026"))
    ax.text(0.98, 0.98, "\n".join(lines), transform=ax.transAxes, ha="right", va="top", fontsize=8,
            family="monospace", bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.7"})


def plot_lr_sweep(ax, sweep):
    curves = {}
    for p, width, lr, loss in sweep:
        curves.setdefault((p, width), []).append((lr, loss))
    widths = sorted({w for _, w in curves})
    cmap = plt.get_cmap("viridis")
    color = {w: cmap(0.1 + 0.8 * i / max(1, len(widths) - 1)) for i, w in enumerate(widths)}
    top = blended_transform_factory(ax.transData, ax.transAxes)
    finite = [loss for _, _, _, loss in sweep if math.isfinite(loss)]
    for (p, width), points in sorted(curves.items()):
        points.sort()
        ok = [(lr, loss) for lr, loss in points if math.isfinite(loss)]
        style = "-" if p == "mup" else "--"
        name = "\u03bcP" if p == "mup" else "SP"
        if ok:
            ax.plot([x for x, _ in ok], [y for _, y in ok], linestyle=style, marker="o", markersize=4,
                    color=color[width], label=f"{name}, width {width}")
            best_lr, best = min(ok, key=lambda t: t[1])
            ax.plot([best_lr], [best], linestyle="none", marker="*", markersize=14, color=color[width],
                    markeredgecolor="black", markeredgewidth=0.7, zorder=5)
            ax.annotate(f"{best_lr:.2g}", (best_lr, best), xytext=(0, -13), textcoords="offset points", ha="center",
                        fontsize=7, color="0.2")
        for lr, _ in (pt for pt in points if not math.isfinite(pt[1])):
            ax.plot([lr], [0.98], transform=top, linestyle="none", marker="x", markersize=8, markeredgewidth=2,
                    color=color[width], clip_on=False, zorder=5)
    if len(finite) != len(sweep):
        ax.plot([], [], linestyle="none", marker="x", color="0.3", label="diverged (loss not finite)")
    ax.plot([], [], linestyle="none", marker="*", markersize=10, color="0.5", markeredgecolor="black",
            label="best LR of each curve")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss (nats per token)")
    if finite:
        low, high = min(finite), max(finite)
        pad = 0.08 * (high - low if high > low else max(abs(high), 1.0))
        ax.set_ylim(low - pad, high + pad)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
    ax.set_title("learning-rate sweep: the best LR of each width (under \u03bcP it should not move)", fontsize=10)


def plot(r, out, title):
    panels = 2 if r["lr_sweep"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(9.5 * panels, 6.2), layout="constrained", squeeze=False)
    plot_compute(axes[0][0], r)
    if panels == 2:
        plot_lr_sweep(axes[0][1], r["lr_sweep"])
    fig.suptitle(title, fontsize=12)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description="Plot an llmpar scaling report: loss against compute, the fitted "
                                     "power law and its bootstrap band, held-out predictions, and LR sweeps.")
    parser.add_argument("report", help="the report (JSON, from llmpar::plan::to_json)")
    parser.add_argument("--out", help="the PNG to write (default: the report path with .png for .json)")
    parser.add_argument("--title", help="the figure's title (default: the report's file name)")
    args = parser.parse_args()

    base = args.report[:-len(".json")] if args.report.endswith(".json") else args.report
    out = args.out or base + ".png"
    try:
        report = read_report(args.report)
        plot(report, out, args.title or f"scaling fit \u2014 {os.path.basename(args.report)}")
    except ReportError as e:
        print(f"plot_scaling.py: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        print(f"plot_scaling.py: cannot write {out}: {e.strerror}", file=sys.stderr)
        sys.exit(1)
    print(out)


if __name__ == "__main__":
    main()
