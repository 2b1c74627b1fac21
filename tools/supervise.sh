#!/usr/bin/env bash
# supervise.sh — runs a training command again after a crash or a lost rank, from its
# latest checkpoint, until it finishes.
#
#   supervise.sh --restarts N [--backoff SEC] [--min-ranks M] -- COMMAND...
#
# COMMAND is train_gpt, or a launcher around it (mpirun -np 4 train_gpt ...), with
# --save DIR. Its exit status says what happened:
#   0        finished: so does this.
#   75       a rank stopped answering (comm::kLostRankExit): the MPI watchdog ended the
#            job, or a collective timed out (--comm-timeout) on thread ranks.
#   > 128    a process was killed by a signal (kill -9, the OOM killer), or the launcher
#            reports one that was.
#   other    an error that a restart would repeat (train_gpt exits 1 on a bad flag, a
#            corrupt checkpoint, an unstable run): this exits with it, no restart.
# On 75 or a signal it waits (--backoff, doubled each restart, at most 60 s) and runs
# COMMAND again with --resume latest (any --resume of COMMAND replaced): the run
# continues from the latest complete checkpoint in DIR, bit for bit as an uninterrupted
# run resumed there would, up to N times. Each restart is one line on stderr and, when
# COMMAND has --metrics FILE, one {"type":"restart"} record in FILE (the resumed run
# appends to it): the attempt, the exit status and why, the checkpoint's step, the
# failed attempt's seconds and the back-off.
#
# --min-ranks M: after a lost rank or process, the restart runs on one process fewer (the
# launcher's -np or -n, down to M): a run that keeps its global batch (--global-batch G
# --micro-batch B) resumes resharded, with more gradient accumulation, and trains the
# same run to float rounding.
#
# Under Slurm the same holds with srun as the launcher; with `sbatch --requeue` a node
# failure requeues the whole job instead, and the requeued job's `./llmpar.sh train
# --resume latest --save DIR` continues from the same checkpoint: this script covers
# the failures inside an allocation, --requeue the loss of the allocation.
set -uo pipefail

die() {
  echo "supervise: $*" >&2
  exit 2
}

restarts="" backoff=1 min_ranks=""
while (($# > 0)); do
  case "$1" in
    --restarts) (($# >= 2)) || die "--restarts needs a count"; restarts="$2"; shift 2 ;;
    --min-ranks) (($# >= 2)) || die "--min-ranks needs a count"; min_ranks="$2"; shift 2 ;;
    --backoff) (($# >= 2)) || die "--backoff needs seconds"; backoff="$2"; shift 2 ;;
    --) shift; break ;;
    *) die "unknown option '$1'; usage: supervise.sh --restarts N [--backoff SEC] [--min-ranks M] -- COMMAND..." ;;
  esac
done
[[ "$restarts" =~ ^[0-9]+$ ]] || die "--restarts '$restarts' is not a count of restarts (0 or more)"
[[ "$backoff" =~ ^[0-9]+$ ]] || die "--backoff '$backoff' is not a whole number of seconds"
[[ -z "$min_ranks" || "$min_ranks" =~ ^[1-9][0-9]*$ ]] || die "--min-ranks '$min_ranks' is not a number of processes"
(($# > 0)) || die "no command to supervise; usage: supervise.sh --restarts N -- train_gpt ... --save DIR"

# The command's --save and --metrics, and the command without its --resume.
save="" metrics=""
command=()
while (($# > 0)); do
  case "$1" in
    --save) save="${2:-}"; command+=("$1" "${2:-}"); shift 2 ;;
    --save=*) save="${1#--save=}"; command+=("$1"); shift ;;
    --metrics) metrics="${2:-}"; command+=("$1" "${2:-}"); shift 2 ;;
    --metrics=*) metrics="${1#--metrics=}"; command+=("$1"); shift ;;
    --resume) shift 2 ;;
    --resume=*) shift ;;
    *) command+=("$1"); shift ;;
  esac
done
[[ -n "$save" ]] || die "the command has no --save DIR: a restart resumes from the latest checkpoint there"
# Where the launcher's process count is (the word after -np or -n), for --min-ranks.
np_at=-1
for ((i = 0; i + 1 < ${#command[@]}; ++i)); do
  if [[ "${command[i]}" == -np || "${command[i]}" == -n ]] && [[ "${command[i + 1]}" =~ ^[0-9]+$ ]]; then
    np_at=$((i + 1))
    break
  fi
done
[[ -z "$min_ranks" || $np_at -ge 0 ]] || die "--min-ranks needs a launcher with -np N (mpirun) or -n N (srun) in the command"

attempt=0
resume=()
for ((;;)); do
  start=$(date +%s.%N)
  "${command[@]}" "${resume[@]}"
  rc=$?
  seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
  ((rc == 0)) && exit 0
  if ((rc == 75)); then
    why="a rank stopped answering (a collective timed out)"
  elif ((rc > 128)); then
    why="a process was killed by signal $((rc - 128))"
  else
    echo "supervise: the run exited with status $rc, an error a restart would repeat; not restarting" >&2
    exit "$rc"
  fi
  if ((attempt >= restarts)); then
    echo "supervise: $why (exit $rc) after $attempt restart(s), the most --restarts allows; giving up" >&2
    exit "$rc"
  fi
  attempt=$((attempt + 1))
  wait_s=$((backoff << (attempt - 1)))
  ((wait_s > 60)) && wait_s=60
  latest="$(cat "$save/latest" 2>/dev/null || true)"
  step=0
  if [[ "$latest" =~ ^step_([0-9]+)$ ]]; then step=$((10#${BASH_REMATCH[1]})); fi
  echo "supervise: restart $attempt/$restarts: $why (exit $rc) after ${seconds} s; resuming from step $step of $save in ${wait_s} s" >&2
  if [[ -n "$metrics" && -f "$metrics" ]]; then
    printf '{"type":"restart","attempt":%d,"exit":%d,"reason":"%s","from_step":%d,"seconds":%s,"backoff":%d}\n' \
      "$attempt" "$rc" "$why" "$step" "$seconds" "$wait_s" >>"$metrics"
  fi
  if [[ -n "$min_ranks" ]] && ((command[np_at] > min_ranks)); then
    command[np_at]=$((command[np_at] - 1))
    echo "supervise: the restart runs on ${command[np_at]} process$( ((command[np_at] == 1)) || echo es) (--min-ranks $min_ranks)" >&2
  fi
  sleep "$wait_s"
  resume=(--resume latest)
done
