#!/usr/bin/env bash
# Proves that bench_collectives' #wrong column means something, on the thread engine.
#   check_collectives.sh BENCH RANKS exact    every collective x type x reduction at sizes
#                                             8 B..256 KiB: every #wrong is 0, exit 0
#   check_collectives.sh BENCH RANKS corrupt  the same with one output element corrupted on
#                                             purpose: every row with elements counts exactly
#                                             1 wrong, the totals say FAILED, exit non-zero
set -euo pipefail
bench="$1" ranks="$2" mode="$3"

fail() { echo "FAILED: $*" >&2; exit 1; }

args=(--engine thread --ranks "$ranks" --collective all -d all -o all -b 8 -e 256K -f 8 -n 2 -w 1)
[[ "$mode" == corrupt ]] && args+=(--debug_corrupt_one_element)
set +e
out="$("$bench" "${args[@]}" 2>&1)"
status=$?
set -e
echo "$out"

# 6 sizes (8 B x 8^k up to 256 KiB); reductions: 3 collectives x 6 types x 4 ops;
# the other 4 collectives x 6 types.
expected_rows=$(((3 * 6 * 4 + 4 * 6) * 6))
# Rows: size count type redop root, then time algbw busbw #wrong twice (out of place,
# in place). Tables start with "# <collective>: busbw = ...".
report="$(awk -v mode="$mode" '
  /^# [a-z_]+: busbw/ { table = substr($2, 1, length($2) - 1); next }
  /^#/ { next }
  NF == 13 {
    rows++
    want = (mode == "corrupt" && $2 > 0) ? 1 : 0
    if ($9 != want) { bad++; print "  " table ": out-of-place #wrong " $9 ", expected " want ": " $0 }
    if ($13 == "N/A") { if (table != "sendrecv") { bad++; print "  " table ": in place not run: " $0 } }
    else if ($13 != want) { bad++; print "  " table ": in-place #wrong " $13 ", expected " want ": " $0 }
    next
  }
  { bad++; print "  unexpected line: " $0 }
  END { print "rows " rows + 0; print "bad " bad + 0 }' <<<"$out")"

rows=$(sed -n 's/^rows //p' <<<"$report")
bad=$(sed -n 's/^bad //p' <<<"$report")
grep '^  ' <<<"$report" | head -20 >&2 || true
((rows == expected_rows)) || fail "$rows result rows, expected $expected_rows (every collective x type x reduction x size)"
((bad == 0)) || fail "$bad rows with an unexpected #wrong (first ones above)"
if [[ "$mode" == corrupt ]]; then
  ((status != 0)) || fail "bench_collectives exited 0 although it counted wrong elements"
  grep -q '^# Out of bounds values : [1-9][0-9]* FAILED' <<<"$out" || fail "no table reports FAILED"
else
  ((status == 0)) || fail "bench_collectives exited $status"
  if grep -q 'FAILED' <<<"$out"; then fail "a table reports FAILED"; fi
fi
echo "PASSED: $mode on $ranks ranks, $rows rows"
