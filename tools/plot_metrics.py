#!/usr/bin/env python3
"""Training and validation loss of a train_gpt run, from its --metrics file, as a PNG.

  plot_metrics.py METRICS.jsonl [--out loss.png] [--title TEXT]

The metrics file holds one JSON object per line, told apart by "type": config (tokens
per step = global_batch * seq, for the top axis), step, eval, rollback, incident (a
loss-spike incident: the rollbacks of one bad stretch of data, shaded with its count of
rollbacks and skipped steps) and resume; other types (memory, ...) are ignored.

What the run kept is the curve: a rollback from step s to step c (a loss spike at s
restored the state after step c), and a resumed run that starts again after step c,
both make the steps after c that were already logged history, and the step records
that follow replace them. A step record for a step that is already there does the
same (a resumed run rewriting steps), so the last record of each step wins, and what
came before is drawn faded and dashed where it was abandoned.

The y axis is linear (a log axis flattens the last tenths of a nat, which is where a
run near convergence moves). Its range leaves out the first 2% of steps where their
loss, still near log(vocab), would squeeze the rest of the run into the bottom of the
plot: the descent then runs off the top. Spike and skipped-step markers are never
clipped away; one far above the curve is drawn on the top edge (a spike's label says
its loss).

Errors (a malformed line names its number; no step records) exit 2.
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write files only
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import EngFormatter  # noqa: E402

# The fraction of the first steps left out when choosing the y range, where the whole
# range would be more than CLIP_GAIN times the range without them.
WARMUP_FRACTION = 0.02
CLIP_GAIN = 1.5
# A marker more than this many curve ranges above the curve goes on the top edge.
FAR_ABOVE = 2.0
# From this many steps on, the train loss is drawn with its moving average.
SMOOTH_FROM = 200


class MetricsError(Exception):
    pass


def number(record, key, where, allow_null=False):
    value = record.get(key)
    if value is None and allow_null:
        return math.nan  # nlohmann::json writes a NaN or inf as null
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetricsError(f"{where}: {record.get('type')} record needs a number \"{key}\", has {value!r}")
    return float(value)


def step_number(record, key, where):
    value = number(record, key, where)
    if not math.isfinite(value) or value != int(value):
        raise MetricsError(f"{where}: \"{key}\" must be a whole step number, has {value!r}")
    return int(value)


class Run:
    """The records of one metrics file, with the abandoned history split off."""

    def __init__(self):
        self.tokens_per_step = set()
        self.model = None
        self.kept = {}  # step -> (loss, skipped)
        self.evals = {}  # step -> val_loss
        self.abandoned = []  # [(branch step, [(step, loss, skipped), ...])]
        self.abandoned_evals = []  # [(step, val_loss)]
        self.rollbacks = []  # [(step, to_step, the loss at step, reason, skipped_batches)]
        self.resumes = []  # [step]
        self.incidents = []  # [(first_step, last_step, rollbacks, skipped_steps)]

    def rewind(self, to_step):
        """Everything after to_step becomes history."""
        later = sorted(s for s in self.kept if s > to_step)
        if later:
            self.abandoned.append((to_step, [(s, *self.kept.pop(s)) for s in later]))
        for s in sorted(s for s in self.evals if s > to_step):
            self.abandoned_evals.append((s, self.evals.pop(s)))

    def add(self, record, where):
        kind = record["type"]
        if kind == "config":
            if "global_batch" in record and "seq" in record:
                self.tokens_per_step.add(number(record, "global_batch", where) * number(record, "seq", where))
            self.model = record.get("model", self.model)
        elif kind == "step":
            s = step_number(record, "step", where)
            loss = number(record, "loss", where, allow_null=True)
            if s in self.kept or (self.kept and s <= max(self.kept)):
                self.rewind(s - 1)  # a step logged again: the later record is the one kept
            self.kept[s] = (loss, bool(record.get("skipped", False)))
        elif kind == "eval":
            s = step_number(record, "step", where)
            if s in self.evals:
                self.abandoned_evals.append((s, self.evals[s]))
            self.evals[s] = number(record, "val_loss", where, allow_null=True)
        elif kind == "rollback":
            s, c = step_number(record, "step", where), step_number(record, "to_step", where)
            if c >= s:
                raise MetricsError(f"{where}: a rollback goes back, but \"to_step\" {c} is not before \"step\" {s}")
            spike = self.kept.get(s, (math.nan,))[0]  # the step record before the rollback, if logged
            self.rollbacks.append((s, c, spike, str(record.get("reason", "")), record.get("skipped_batches")))
            self.rewind(c)
        elif kind == "incident":
            a, b = step_number(record, "first_step", where), step_number(record, "last_step", where)
            if b < a:
                raise MetricsError(f"{where}: an incident's \"last_step\" {b} is before its \"first_step\" {a}")
            self.incidents.append((a, b, record.get("rollbacks"), record.get("skipped_steps")))
        elif kind == "resume":
            c = step_number(record, "step", where)
            self.resumes.append(c)
            self.rewind(c)


def read_run(path):
    run = Run()
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise MetricsError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise MetricsError(f"{path} is not text; a metrics file is JSON lines (train_gpt --metrics)") from None
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line.rstrip())
        except json.JSONDecodeError as e:
            raise MetricsError(f"{where}: not a JSON object ({e.msg} at column {e.colno}): "
                               f"{line.strip()[:80]}") from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise MetricsError(f"{where}: a metrics record is a JSON object with a \"type\": {line.strip()[:80]}")
        run.add(record, where)
    if not lines or all(not line.strip() for line in lines):
        raise MetricsError(f"{path} is empty: nothing to plot (is it the file train_gpt --metrics wrote?)")
    if not run.kept:
        raise MetricsError(f"{path} has no step records: nothing to plot (did the run reach its first step?)")
    return run


def centred_mean(values, window):
    """The mean of the `window` values around each one (fewer at the ends; NaNs left out).
    Centred, so it does not lag behind a fast descent the way an EMA does."""
    sums, counts = [0.0], [0]
    for v in values:
        ok = math.isfinite(v)
        sums.append(sums[-1] + (v if ok else 0.0))
        counts.append(counts[-1] + ok)
    half, n, out = window // 2, len(values), []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        count = counts[hi] - counts[lo]
        out.append((sums[hi] - sums[lo]) / count if count else math.nan)
    return out


def finite(values):
    return [v for v in values if math.isfinite(v)]


def y_range(run):
    """Linear y limits: the kept curve and the validation losses, leaving out the first 2%
    of steps where they would take more than a third of the height; then room for the
    markers that are not far above the curve."""
    steps = sorted(run.kept)
    everything = finite([run.kept[s][0] for s in steps] + list(run.evals.values())) or [0.0]
    cut = steps[0] + math.ceil(WARMUP_FRACTION * (steps[-1] - steps[0] + 1))
    later = finite([run.kept[s][0] for s in steps if s >= cut] + [v for s, v in run.evals.items() if s >= cut])
    low, high = min(everything), max(later or everything)
    if max(everything) - low <= CLIP_GAIN * (high - low):
        high = max(everything)  # the first steps fit without squeezing the rest: show them
    span = max(high - low, 1e-3 * max(abs(high), 1.0))
    # The markers that must stay visible, skipped steps and each rollback's spike, widen
    # the range where they are past the first steps and not far above the curve; the
    # others sit on the top edge.
    markers = ([(s, loss) for s, (loss, skipped) in run.kept.items() if skipped] +
               [(s, loss) for _, seg in run.abandoned for s, loss, skipped in seg if skipped] +
               [(s, spike) for s, _, spike, _, _ in run.rollbacks])
    near = [y for s, y in markers if s >= cut and math.isfinite(y) and y <= high + FAR_ABOVE * span]
    high = max([high] + near)
    low = min([low] + finite(y for _, y in markers))
    pad = 0.06 * (high - low if high > low else span)
    return low - pad, high + pad


def plot(run, out, title):
    fig, ax = plt.subplots(figsize=(10, 5.6), layout="constrained")
    train_color, val_color, spike_color = "tab:blue", "tab:orange", "tab:red"
    bottom, top = y_range(run)
    ax.set_ylim(bottom, top)
    steps = sorted(run.kept)
    first = min([steps[0]] + [b for b, _ in run.abandoned] + list(run.evals) + run.resumes)
    last = max([steps[-1]] + [seg[-1][0] for _, seg in run.abandoned] + list(run.evals))

    losses = [run.kept[s][0] for s in steps]
    if len(steps) >= SMOOTH_FROM:
        # Step losses of a long run are a band of noise: the raw band faint, its mean on top.
        window = 2 * max(5, len(steps) // 100) + 1
        ax.plot(steps, losses, color=train_color, linewidth=0.8, alpha=0.3, label="train loss", zorder=3)
        ax.plot(steps, centred_mean(losses, window), color=train_color, linewidth=1.5, zorder=3,
                label=f"train loss, mean of {window} steps")
    else:
        ax.plot(steps, losses, color=train_color, linewidth=1.3, label="train loss", zorder=3)
    for i, (branch, seg) in enumerate(run.abandoned):
        xs = [s for s, _, _ in seg]
        ys = [loss for _, loss, _ in seg]
        if branch in run.kept:  # start from the point the run went back to
            xs, ys = [branch] + xs, [run.kept[branch][0]] + ys
        ax.plot(xs, ys, color="0.45", alpha=0.8, linewidth=1.1, linestyle=(0, (4, 2)), zorder=2,
                label="abandoned (rolled back or rewritten)" if i == 0 else None)

    if run.evals or run.abandoned_evals:
        es = sorted(run.evals)
        ax.plot(es, [run.evals[s] for s in es], color=val_color, linewidth=1.6, marker="o", markersize=5, zorder=4,
                label="validation loss")
        if run.abandoned_evals:
            ax.plot([s for s, _ in run.abandoned_evals], [v for _, v in run.abandoned_evals], linestyle="none",
                    marker="o", markersize=5, markerfacecolor="none", markeredgecolor=val_color, alpha=0.6,
                    zorder=4, label="validation loss (abandoned)")

    # Markers above the range sit on the top edge (clip_on off: drawn over the frame).
    skipped = [(s, loss, 1.0) for s, (loss, sk) in run.kept.items() if sk]
    skipped += [(s, loss, 0.45) for _, seg in run.abandoned for s, loss, sk in seg if sk]
    for i, (s, loss, alpha) in enumerate(sorted(skipped)):
        y = min(loss, top) if math.isfinite(loss) else bottom
        ax.plot([s], [y], linestyle="none", marker="x", markersize=8, markeredgewidth=2, color="tab:purple",
                alpha=alpha, clip_on=False, zorder=5, label="skipped step (loss scale)" if i == 0 else None)

    for i, (s, c, spike, reason, batches) in enumerate(run.rollbacks):
        ax.axvline(s, color=spike_color, linestyle=":", linewidth=1.2, zorder=2,
                   label="rollback (loss spike)" if i == 0 else None)
        text = f"rollback {s}\u2192{c}"
        if math.isfinite(spike):
            ax.plot([s], [min(spike, top)], linestyle="none", marker="v", markersize=8, color=spike_color,
                    clip_on=False, zorder=5)
            text += f" at loss {spike:.3g}" + (" (off the scale)" if spike > top else "")
        if isinstance(batches, int) and batches > 0:
            text += f", skip {batches} batch{'es' if batches != 1 else ''}"
        if reason:
            text += "\n" + (reason if len(reason) <= 40 else reason[:39] + "\u2026")
        right = s > first + 0.7 * (last - first)  # the text goes where there is room
        ax.annotate(text, xy=(s, 1.0), xycoords=("data", "axes fraction"), xytext=(-4 if right else 4, -4),
                    textcoords="offset points", ha="right" if right else "left", va="top", fontsize=8,
                    color=spike_color)

    for i, (a, b, rollbacks, skipped_steps) in enumerate(run.incidents):
        label = f"loss-spike incident ({rollbacks} rollbacks, {skipped_steps} steps of data skipped)"
        ax.axvspan(a - 0.5, b + 0.5, color=spike_color, alpha=0.12, zorder=1, label=label if i == 0 else None)

    for i, c in enumerate(run.resumes):
        ax.axvline(c, color="0.35", linestyle="-", linewidth=0.8, alpha=0.8,
                   label="resumed from checkpoint" if i == 0 else None)

    ax.set_xlim(first - 0.01 * (last - first + 1), last + 0.01 * (last - first + 1))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(True, alpha=0.3)
    # Below the plot: inside, it would cover the curve or a rollback's label.
    handles = ax.get_legend_handles_labels()[0]
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=min(len(handles), 4), fontsize=9, frameon=False)

    if len(run.tokens_per_step) == 1:
        tps = run.tokens_per_step.pop()
        top_axis = ax.secondary_xaxis("top", functions=(lambda s: s * tps, lambda t: t / tps))
        top_axis.xaxis.set_major_formatter(EngFormatter(sep=""))
        top_axis.set_xlabel(f"tokens ({tps:,.0f} per step)")
    elif len(run.tokens_per_step) > 1:
        print(f"plot_metrics.py: the config records disagree on tokens per step "
              f"({sorted(run.tokens_per_step)}): no tokens axis", file=sys.stderr)

    final = [run.kept[s][0] for s in steps if math.isfinite(run.kept[s][0])]
    summary = f"{len(steps)} steps"
    if final:
        summary += f", last train loss {final[-1]:.4f}"
    if run.evals:
        summary += f", last val loss {run.evals[max(run.evals)]:.4f}"
    ax.set_title(f"{title}\n{summary}", fontsize=11)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description="Plot a train_gpt --metrics file: loss against steps and tokens.")
    parser.add_argument("metrics", help="the metrics file (JSON lines, from train_gpt --metrics)")
    parser.add_argument("--out", help="the PNG to write (default: the metrics path with .png for .jsonl)")
    parser.add_argument("--title", help="the plot's title (default: the model and the file name)")
    args = parser.parse_args()

    out = args.out or (args.metrics[:-len(".jsonl")] if args.metrics.endswith(".jsonl") else args.metrics) + ".png"
    try:
        run = read_run(args.metrics)
        title = args.title or " \u2014 ".join(filter(None, [run.model, os.path.basename(args.metrics)]))
        plot(run, out, title)
    except MetricsError as e:
        print(f"plot_metrics.py: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        print(f"plot_metrics.py: cannot write {out}: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    print(out)


if __name__ == "__main__":
    main()
