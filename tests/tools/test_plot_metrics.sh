#!/usr/bin/env bash
# tools/plot_metrics.py draws a run with everything a metrics file can hold, and rejects
# a broken file by name:
#   - a synthetic 60-step run (config, 3 evals, a skipped fp16 step, a rollback from the
#     spike at step 40 to step 30 with steps 31..40 logged again and its incident record,
#     a resume after step 50
#     with steps 51..53 logged again) becomes a PNG of more than 10 KB at the default
#     path, and the curve it keeps is steps 1..60 from their last records, with the
#     rolled-back and rewritten steps as abandoned segments;
#   - a malformed line exits 2 naming its line number; an empty file and a file with no
#     step records exit 2.
# Exits 77 (skipped) where no python3 imports matplotlib (Debian: python3-matplotlib).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
script="$root/tools/plot_metrics.py"

fail() {
  echo "test_plot_metrics: FAIL: $*" >&2
  exit 1
}

source "$root/tests/tools/matplotlib_python.sh" test_plot_metrics

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The run: loss 2 + 3 exp(-s/12) with a little deterministic wiggle; step 22 skipped
# (loss-scale overflow), a spike at step 40 rolled back to step 30, then killed after
# step 53 and resumed from the checkpoint after step 50.
loss() { awk -v s="$1" -v bump="${2:-0}" 'BEGIN { printf "%.4f", 2 + 3 * exp(-s / 12) + 0.03 * sin(s * 1.7) + bump }'; }
step() {
  local s="$1" l="$2" skipped="${3:-false}"
  printf '{"type":"step","step":%d,"loss":%s,"lr":0.0006,"grad_norm":0.8,"ms":12.5,"loss_scale":%s,"skipped":%s}\n' \
    "$s" "$l" "$([[ $skipped == true ]] && echo 32768 || echo 65536)" "$skipped"
}
metrics="$work/run.jsonl"
{
  echo '{"type":"config","model":"gpt2-tiny","steps":60,"global_batch":8,"seq":64,"layers":2,"dim":64}'
  echo '{"type":"memory","when":"start","parameters":1000}'
  echo '{"type":"eval","step":0,"val_loss":5.55}'
  for s in $(seq 1 39); do
    if ((s == 22)); then step "$s" "$(loss "$s")" true; else step "$s" "$(loss "$s" 0.05)"; fi
  done
  step 40 "$(loss 40 4.5)"
  echo '{"type":"rollback","step":40,"to_step":30,"reason":"loss 6.58 > 3x the median","skipped_batches":1}'
  for s in $(seq 31 40); do step "$s" "$(loss "$s")"; done
  echo '{"type":"incident","kind":"loss_spike","step":40,"first_step":40,"last_step":40,"rollbacks":1,"skipped_steps":11,"losses":[6.58],"reason":"loss 6.58 > 3x the median","seconds":0.02}'
  echo '{"type":"eval","step":40,"val_loss":'"$(loss 40 0.08)"'}'
  for s in $(seq 41 53); do step "$s" "$(loss "$s")"; done
  echo '{"type":"resume","step":50,"from":"ckpt/step_50"}'
  for s in $(seq 51 60); do step "$s" "$(loss "$s" -0.01)"; done
  echo '{"type":"eval","step":60,"val_loss":'"$(loss 60 0.07)"'}'
} >"$metrics"

out="$("$python" "$script" "$metrics")" || fail "plot_metrics.py exited $? on a well-formed file"
[[ "$out" == "$work/run.png" ]] || fail "printed '$out', expected the default output $work/run.png"
[[ -f "$out" ]] || fail "$out was not written"
[[ "$(head -c 8 "$out" | od -An -tx1 | tr -d ' \n')" == 89504e470d0a1a0a ]] || fail "$out is not a PNG"
size=$(wc -c <"$out")
((size > 10240)) || fail "$out is $size bytes; a plot of 60 steps is more than 10 KB"

# The kept curve and the abandoned history, from the reader itself.
PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$root/tools" "$python" - "$metrics" <<'PY' || fail "the rollback and resume were not read as expected"
import sys
import plot_metrics
run = plot_metrics.read_run(sys.argv[1])
assert sorted(run.kept) == list(range(1, 61)), sorted(run.kept)
assert run.kept[22][1] and sum(skipped for _, skipped in run.kept.values()) == 1
assert [(b, [s for s, _, _ in seg]) for b, seg in run.abandoned] == [(30, list(range(31, 41))), (50, [51, 52, 53])]
assert run.kept[40][0] < 3.0 and run.abandoned[0][1][-1][1] > 6.0  # the spike is history, the rewrite is kept
assert run.rollbacks[0][:3] == (40, 30, run.abandoned[0][1][-1][1])  # with the spike's loss
assert sorted(run.evals) == [0, 40, 60] and run.resumes == [50]
assert run.incidents == [(40, 40, 1, 11)]
assert run.tokens_per_step == {512.0}
PY

# Broken files: exit 2, and say where.
expect_error() {
  local file="$1" pattern="$2" rc=0
  "$python" "$script" "$file" --out "$work/bad.png" >"$work/stdout" 2>"$work/stderr" || rc=$?
  ((rc == 2)) || fail "$(basename "$file"): exited $rc, expected 2 (stderr: $(cat "$work/stderr"))"
  grep -q -- "$pattern" "$work/stderr" ||
    fail "$(basename "$file"): the error '$(cat "$work/stderr")' does not say '$pattern'"
  [[ ! -e "$work/bad.png" ]] || fail "$(basename "$file"): a PNG was written for a broken file"
}
head -3 "$metrics" >"$work/malformed.jsonl"
echo '{"type":"step","step":4,"loss":' >>"$work/malformed.jsonl"
step 5 3.0 >>"$work/malformed.jsonl"
expect_error "$work/malformed.jsonl" "malformed.jsonl:4:"
printf '{"type":"step","step":1,"loss":"low"}\n' >"$work/badloss.jsonl"
expect_error "$work/badloss.jsonl" 'badloss.jsonl:1:.*"loss"'
: >"$work/empty.jsonl"
expect_error "$work/empty.jsonl" "is empty"
head -3 "$metrics" >"$work/nosteps.jsonl"
expect_error "$work/nosteps.jsonl" "no step records"

echo "test_plot_metrics: ok ($out, $size bytes; rollback, resume, skipped step and broken files)"
