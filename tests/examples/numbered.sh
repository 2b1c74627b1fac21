#!/usr/bin/env bash
# The numbered examples (examples/NN_name/) as a user runs them, each against the
# serial run.
#   numbered.sh BIN_DIR WORK_DIR CASE
# Cases:
#   minimal_trainer   trains 100 steps and reports a validation loss below the start
#   swap_mlp          the GeGLU block: its gradient check passes; 1 rank and --ranks 2
#                     --tp 2 (and --sp) log the same losses to 1e-5 relative, step by step;
#                     bf16 trains (the loss falls) and stays within 2% of fp32 at step 12
#   custom_attention  the rotary block: the gradient check; --tp 2 --sp and dp 2 equal the
#                     serial losses to 1e-5
#   bf16_elementwise  the squared-ReLU block: the gradient check; bf16 on 1 rank and with
#                     --tp 2 within 2e-2 of each other and of fp32; fp32 --tp 2 equal to
#                     the serial run to 1e-5
set -euo pipefail
bin="$1" work="$2" case="$3"
rm -rf "$work" && mkdir -p "$work" && cd "$work"

fail() { echo "FAILED: $*" >&2; exit 1; }
losses() { grep '^losses ' "$1" | tr ' ' '\n' | tail -n +2; }  # the 9-digit losses line
# same_losses A B TOL: the step losses of two logs agree to TOL relative, step by step.
same_losses() {
  local n
  n=$(paste <(losses "$1") <(losses "$2") | awk -v tol="$3" '
    { d = $1 - $2; if (d < 0) d = -d; if (d > tol * $2) bad++; n++ }
    END { if (bad || n == 0) exit 1; print n }') ||
    fail "$1 and $2 differ by more than $3 relative (or logged no steps): $(paste <(losses "$1") <(losses "$2") | tr '\t\n' ' ;')"
  echo "$1 = $2 to $3 over $n steps"
}
run() {  # run LOG ARGS...: the example, its output in LOG (shown)
  local log="$1"
  shift
  "$bin/$case" "$@" | tee "$log"
}
gradcheck_ok() { grep -q '^gradcheck: [0-9]* elements, 0 failed' "$1" || fail "$1: the block's gradient check did not pass"; }

steps=(--steps 12)
case "$case" in
  minimal_trainer)
    "$bin/minimal_trainer" | tee out.txt
    first=$(grep -m1 '^step' out.txt | sed 's/.*| loss \([0-9.]*\) |.*/\1/')
    val=$(grep 'val loss' out.txt | awk '{print $NF}')
    awk -v a="$first" -v b="$val" 'BEGIN { exit !(b < a - 1.0) }' || fail "val loss $val is not 1 nat below the first step's $first"
    ;;
  swap_mlp)
    run serial.txt "${steps[@]}"
    gradcheck_ok serial.txt
    run tp2.txt "${steps[@]}" --ranks 2 --tp 2 --no-gradcheck
    same_losses tp2.txt serial.txt 1e-5
    run tp2sp.txt "${steps[@]}" --ranks 2 --tp 2 --sp --no-gradcheck
    same_losses tp2sp.txt serial.txt 1e-5
    run bf16.txt "${steps[@]}" --precision bf16 --no-gradcheck
    same_losses bf16.txt serial.txt 2e-2
    ;;
  custom_attention)
    run serial.txt "${steps[@]}"
    gradcheck_ok serial.txt
    run tp2sp.txt "${steps[@]}" --ranks 2 --tp 2 --sp --no-gradcheck
    same_losses tp2sp.txt serial.txt 1e-5
    run dp2.txt "${steps[@]}" --ranks 2 --no-gradcheck
    same_losses dp2.txt serial.txt 1e-5
    ;;
  bf16_elementwise)
    run fp32.txt "${steps[@]}"
    gradcheck_ok fp32.txt
    run fp32_tp2.txt "${steps[@]}" --ranks 2 --tp 2 --no-gradcheck
    same_losses fp32_tp2.txt fp32.txt 1e-5
    run bf16.txt "${steps[@]}" --precision bf16 --no-gradcheck
    same_losses bf16.txt fp32.txt 2e-2
    run bf16_tp2.txt "${steps[@]}" --precision bf16 --ranks 2 --tp 2 --no-gradcheck
    same_losses bf16_tp2.txt bf16.txt 2e-2
    ;;
  *) fail "unknown case $case" ;;
esac
