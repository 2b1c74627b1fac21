#!/usr/bin/env bash
# The README's code excerpts are the code: every ```cpp block of README.md marked
#
#   <!-- excerpt: examples/custom_layer.cpp -->
#   ```cpp
#   ...
#   ```
#
# (the marker on the line just before the fence) must be a contiguous run of lines of
# the named file, each line exactly as it is there (trailing blanks aside), in order. A
# block that does not match fails, naming the block, the file and the first line that
# has no match where it should. No compiling: the source files are compiled and run by
# their own tests (example_minimal_trainer, example_swap_mlp), so a README that matches
# them shows code that builds and trains.
#
# Before it checks the README, it checks itself: a copy of an excerpt with one line
# changed, and one with a line left out, must both be refused.
#
#   test_readme_snippets.sh [README]        (default: the repository's README.md)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readme="${1:-$root/README.md}"

fail() {
  echo "test_readme_snippets: FAIL: $*" >&2
  exit 1
}

# check_excerpts README: checks every marked block of README against its file (paths
# relative to $root). Prints one line per block; returns 1 at the first block that
# does not match, after saying why. Sets $checked to the number of blocks checked.
check_excerpts() {
  local md="$1" line path="" in_block=0 after_marker=0 start=0
  local marker_re='^<!-- excerpt: ([^ ]+) -->$'
  local -a snippet=()
  checked=0
  local n=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    n=$((n + 1))
    line="${line%$'\r'}"
    if ((in_block)); then
      if [[ "$line" == '```' ]]; then
        in_block=0
        match_block "$path" "$start" "${snippet[@]}" || return 1
        checked=$((checked + 1))
      else
        snippet+=("$line")
      fi
      continue
    fi
    if ((after_marker)); then
      after_marker=0
      [[ "$line" == '```cpp' ]] || {
        echo "$md:$n: an excerpt marker must be followed at once by a \`\`\`cpp fence, not '$line'" >&2
        return 1
      }
      in_block=1
      start=$((n + 1))
      snippet=()
      continue
    fi
    if [[ "$line" =~ $marker_re ]]; then
      path="${BASH_REMATCH[1]}"
      after_marker=1
    fi
  done <"$md"
  ((!in_block)) || {
    echo "$md: the excerpt of $path that starts at line $start has no closing fence" >&2
    return 1
  }
}

# match_block PATH README_LINE LINES...: the lines are a contiguous run of PATH's lines.
match_block() {
  local path="$1" at="$2"
  shift 2
  local -a want=("$@") have=()
  local file="$root/$path" line
  [[ -f "$file" ]] || {
    echo "the excerpt at README line $at names $path, which does not exist" >&2
    return 1
  }
  ((${#want[@]} > 0)) || {
    echo "the excerpt of $path at README line $at is empty" >&2
    return 1
  }
  while IFS= read -r line || [[ -n "$line" ]]; do
    line="${line%$'\r'}"
    have+=("${line%"${line##*[![:space:]]}"}")
  done <"$file"
  local i j best=0 best_at=-1 k
  for ((i = 0; i < ${#want[@]}; i++)); do want[i]="${want[i]%"${want[i]##*[![:space:]]}"}"; done
  # The longest prefix of the excerpt that some run of the file matches.
  for ((i = 0; i + ${#want[@]} <= ${#have[@]}; i++)); do
    [[ "${have[i]}" == "${want[0]}" ]] || continue
    k=0
    for ((j = 0; j < ${#want[@]}; j++)); do
      [[ "${have[i + j]}" == "${want[j]}" ]] || break
      k=$((k + 1))
    done
    if ((k == ${#want[@]})); then
      echo "ok: README lines $at-$((at + ${#want[@]} - 1)) are $path lines $((i + 1))-$((i + ${#want[@]}))"
      return 0
    fi
    if ((k > best)); then
      best=$k
      best_at=$i
    fi
  done
  if ((best_at < 0)); then
    echo "the excerpt of $path at README line $at: its first line is not in $path:" >&2
    echo "  ${want[0]}" >&2
  else
    echo "the excerpt of $path at README line $at follows $path from its line $((best_at + 1)), but README" \
      "line $((at + best)) is not the file's next line ($((best_at + best + 1))):" >&2
    echo "  README: ${want[best]}" >&2
    echo "  $path line $((best_at + best + 1)): ${have[best_at + best]:-(end of file)}" >&2
  fi
  return 1
}

# The check refuses what it must refuse: a changed line, and a line left out.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
printf '%s\n' 'int f() {' '  int a = 1;' '  int b = 2;' '  return a + b;' '}' >"$work/src/f.cpp"
excerpt() {  # excerpt FILE LINES...: a README with one excerpt of src/f.cpp
  local out="$1"
  shift
  { echo '# t'; echo '<!-- excerpt: src/f.cpp -->'; echo '```cpp'; printf '%s\n' "$@"; echo '```'; } >"$out"
}
real_root="$root"
root="$work"
excerpt "$work/good.md" '  int a = 1;' '  int b = 2;' '  return a + b;'
check_excerpts "$work/good.md" >/dev/null || fail "the self-check's faithful excerpt was refused"
((checked == 1)) || fail "the self-check's excerpt was not found"
excerpt "$work/changed.md" '  int a = 1;' '  int b = 3;' '  return a + b;'
if check_excerpts "$work/changed.md" >/dev/null 2>&1; then fail "an excerpt with a changed line was accepted"; fi
excerpt "$work/gap.md" '  int a = 1;' '  return a + b;'
if check_excerpts "$work/gap.md" >/dev/null 2>&1; then fail "an excerpt with a line left out was accepted"; fi
root="$real_root"

# The README.
[[ -f "$readme" ]] || fail "$readme does not exist"
check_excerpts "$readme" || fail "$readme: an excerpt is not its source (above); copy the lines again"
((checked > 0)) || fail "$readme has no marked excerpts (<!-- excerpt: PATH --> before a \`\`\`cpp fence)"
echo "test_readme_snippets: $checked excerpt(s) of $readme match their sources"
