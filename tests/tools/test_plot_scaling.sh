#!/usr/bin/env bash
# tools/plot_scaling.py draws a scaling report, and rejects a broken one by name:
#   - a synthetic report (6 fit runs on L(C) = 200 C^-0.12 + 1.7, 2 runs for Chinchilla
#     only, a band, one held-out run with its prediction and seed interval, a Chinchilla fit, and an SP/muP
#     learning-rate sweep with a diverged run) becomes a PNG of more than 20 KB at the default path, and the reader
#     finds its runs, prediction and sweep;
#   - the same report without a Chinchilla fit, held-out runs, extra runs or a sweep plots
#     (one panel, to --out);
#   - a missing file, a file that is not JSON, another format, a missing field and a
#     mistyped field each exit 1 with one line naming the problem, and write no PNG.
# Exits 77 (skipped) where no python3 imports matplotlib (Debian: python3-matplotlib).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
script="$root/tools/plot_scaling.py"

fail() {
  echo "test_plot_scaling: FAIL: $*" >&2
  exit 1
}

source "$root/tests/tools/matplotlib_python.sh" test_plot_scaling

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The report, in the layout llmpar::plan::to_json writes.
PYTHONDONTWRITEBYTECODE=1 "$python" - "$work" <<'PY'
import json, math, sys
work = sys.argv[1]
a, b, c = 200.0, -0.12, 1.7
law = lambda flops: a * flops ** b + c
def run(name, flops, wiggle):
    params = math.sqrt(flops / 120.0)  # 20 tokens per parameter
    return {"name": name, "params": params, "tokens": flops / (6 * params), "flops": flops,
            "loss": law(flops) * (1 + wiggle)}
fit = [run(f"run{i}", 10 ** (17 + 0.6 * i), 0.004 * math.sin(3 * i)) for i in range(6)]
held = run("held-out 1e21", 1e21, 0.006)
flops = [10 ** (17 - 0.18 + k * (4 + 0.36) / 31) for k in range(32)]
band = [{"flops": f, "loss": law(f), "lo": law(f) * (1 - 0.01 * math.log10(f / 1e16)),
         "hi": law(f) * (1 + 0.01 * math.log10(f / 1e16))} for f in flops]
pred = law(1e21)
interval = lambda lo, hi: {"lo": lo, "hi": hi}
boot = {"resamples": 400, "confidence": 0.95, "seed": 0, "used": 3, "degenerate": 397,
        "a": interval(150.0, 260.0), "b": interval(-0.14, -0.10), "c": interval(1.55, 1.80),
        "samples": [[190.0, -0.118, 1.68, 1e-5], [205.0, -0.121, 1.71, 1e-5], [210.0, -0.123, 1.72, 1e-5]]}
chinchilla_boot = {"resamples": 400, "confidence": 0.95, "seed": 0, "used": 1, "degenerate": 399,
                   "E": interval(1.6, 1.8), "A": interval(300.0, 500.0), "B": interval(350.0, 480.0),
                   "alpha": interval(0.30, 0.38), "beta": interval(0.25, 0.31),
                   "samples": [[1.69, 406.4, 410.7, 0.34, 0.28, 1e-5]]}
sweep = []
for p, widths in (("sp", (256, 512, 1024)), ("mup", (256, 512, 1024))):
    for w in widths:
        best = 3e-3 if p == "mup" else 3e-3 * 256 / w  # muP's optimum stays put, SP's moves
        for k in range(7):
            lr = 3e-4 * 2 ** k
            loss = 3.0 - 0.1 * math.log2(w / 256) + 0.08 * math.log(lr / best) ** 2
            diverged = p == "sp" and w == 1024 and k == 6
            sweep.append({"parametrization": p, "width": w, "lr": lr, "loss": None if diverged else loss})
# Two runs of the smallest model at 5 and 80 tokens per parameter, above the frontier.
other = [dict(fit[0], name=f"run0 x{r}", tokens=fit[0]["params"] * r, flops=6 * fit[0]["params"] ** 2 * r,
              loss=law(6 * fit[0]["params"] ** 2 * r) * 1.03) for r in (5, 80)]
report = {"format": "llmpar-scaling-report", "version": 1, "fit_runs": fit, "held_out": [held],
          "chinchilla_only_runs": other,
          "power_law": {"a": a, "b": b, "c": c, "objective": 2e-5, "huber_delta": 1e-3, "bootstrap": boot},
          "chinchilla": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28, "objective": 3e-5,
                         "huber_delta": 1e-3, "allocation_coefficient": 1.3447, "bootstrap": chinchilla_boot},
          "chinchilla_note": "", "band": band,
          "held_out_predictions": [{"name": held["name"], "flops": 1e21, "params": held["params"],
                                    "tokens": held["tokens"], "achieved": held["loss"], "predicted": pred,
                                    "lo": pred * 0.95, "hi": pred * 1.05,
                                    "relative_error": (pred - held["loss"]) / held["loss"], "chinchilla": None,
                                    "seed_noise": interval(pred * 0.98, pred * 1.02)}],
          "lr_sweep": sweep}
json.dump(report, open(f"{work}/report.json", "w"), indent=1)
plain = dict(report, chinchilla=None, held_out=[], chinchilla_only_runs=[], held_out_predictions=[], lr_sweep=[],
             chinchilla_note="Chinchilla fit: every run has about the same tokens per parameter (D/N from 20 to 20)")
json.dump(plain, open(f"{work}/plain.json", "w"))
PY

is_png() { [[ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" == 89504e470d0a1a0a ]]; }

out="$("$python" "$script" "$work/report.json" --title "synthetic scaling report")" ||
  fail "plot_scaling.py exited $? on a well-formed report"
[[ "$out" == "$work/report.png" ]] || fail "printed '$out', expected the default output $work/report.png"
[[ -f "$out" ]] || fail "$out was not written"
is_png "$out" || fail "$out is not a PNG"
size=$(wc -c <"$out")
((size > 20480)) || fail "$out is $size bytes; two panels of points, a band and six sweep curves are more than 20 KB"

PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$root/tools" "$python" - "$work/report.json" <<'PY' ||
import math, sys
import plot_scaling
r = plot_scaling.read_report(sys.argv[1])
assert len(r["fit_runs"]) == 6 and len(r["held_out"]) == 1 and len(r["chinchilla_only_runs"]) == 2
assert len(r["band"]) == 32 and r["band"] == sorted(r["band"])
assert r["power_law"]["intervals"]["b"] == (-0.14, -0.10)
assert len(r["predictions"]) == 1 and r["predictions"][0]["lo"] < r["predictions"][0]["hi"]
lo, hi = r["predictions"][0]["seed_noise"]
assert r["predictions"][0]["lo"] < lo < r["predictions"][0]["predicted"] < hi < r["predictions"][0]["hi"]
assert r["chinchilla"]["alpha"] == (0.34, (0.30, 0.38))
assert len(r["lr_sweep"]) == 42 and sum(not math.isfinite(s[3]) for s in r["lr_sweep"]) == 1
assert plot_scaling.count(124e6) == "124M" and plot_scaling.count(1.5e9) == "1.5B"
PY
  fail "the report was not read as expected"

"$python" "$script" "$work/plain.json" --out "$work/plain.png" >/dev/null || fail "a report without extras did not plot"
is_png "$work/plain.png" || fail "$work/plain.png is not a PNG"

# Broken reports: exit 1, one line, naming the problem.
expect_error() {
  local file="$1" pattern="$2" rc=0
  "$python" "$script" "$file" --out "$work/bad.png" >"$work/stdout" 2>"$work/stderr" || rc=$?
  ((rc == 1)) || fail "$(basename "$file"): exited $rc, expected 1 (stderr: $(cat "$work/stderr"))"
  [[ "$(wc -l <"$work/stderr")" -eq 1 ]] || fail "$(basename "$file"): the error is not one line: $(cat "$work/stderr")"
  grep -q -- "$pattern" "$work/stderr" ||
    fail "$(basename "$file"): the error '$(cat "$work/stderr")' does not say '$pattern'"
  [[ ! -e "$work/bad.png" ]] || fail "$(basename "$file"): a PNG was written for a broken report"
}
broken() {  # broken NAME PYTHON-STATEMENT-ON-r: a copy of the report, changed
  PYTHONDONTWRITEBYTECODE=1 "$python" -c "import json, sys
r = json.load(open(sys.argv[1]))
$2
json.dump(r, open(sys.argv[2], 'w'))" "$work/report.json" "$work/$1"
}
expect_error "$work/missing.json" "cannot read .*missing.json"
echo '{"format": "llmpar-scaling-report", "version": 1,' >"$work/truncated.json"
expect_error "$work/truncated.json" "truncated.json is not JSON"
echo '{"type": "step", "step": 1}' >"$work/metrics.json"
expect_error "$work/metrics.json" "not a scaling report"
broken no_b.json 'del r["power_law"]["b"]'
expect_error "$work/no_b.json" 'power_law has no field "b"'
broken bad_loss.json 'r["fit_runs"][2]["loss"] = "low"'
expect_error "$work/bad_loss.json" 'fit_runs\[2\].loss must be a number'
broken bad_interval.json 'del r["held_out_predictions"][0]["hi"]'
expect_error "$work/bad_interval.json" 'held_out_predictions\[0\] has no field "hi"'
broken bad_sweep.json 'r["lr_sweep"][3]["parametrization"] = "ntk"'
expect_error "$work/bad_sweep.json" 'lr_sweep\[3\].parametrization is "ntk"'
broken bad_seed_noise.json 'del r["held_out_predictions"][0]["seed_noise"]["lo"]'
expect_error "$work/bad_seed_noise.json" 'held_out_predictions\[0\].seed_noise has no field "lo"'
# A report from before the seed bootstrap has no seed_noise, and plots.
broken old.json 'del r["held_out_predictions"][0]["seed_noise"]'
"$python" "$script" "$work/old.json" --out "$work/old.png" >/dev/null || fail "a report without seed_noise did not plot"
is_png "$work/old.png" || fail "$work/old.png is not a PNG"

echo "test_plot_scaling: ok ($out, $size bytes; plain report and broken reports)"
