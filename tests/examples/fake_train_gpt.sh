#!/usr/bin/env bash
# Stands in for train_gpt in llmpar-scaling's tuned sweep (end_to_end.sh, case scaling):
# writes the metrics line of one final evaluation whose loss is a known function of the
# model (n = 12 layers dim^2), its tokens, its learning rate and its seed: a Chinchilla
# law, a parabola in log2(lr) around the best rate 0.02 x 64 / dim, and 0.001 per seed
# above train_gpt's default 1337. Beside the metrics it writes the recipe it was given
# (width, --init-std, --beta2) to METRICS.recipe.
set -euo pipefail
while (($#)); do
  case "$1" in
    --layers) layers=$2 ;; --dim) dim=$2 ;; --steps) steps=$2 ;; --batch) batch=$2 ;; --seq) seq=$2 ;;
    --lr) lr=$2 ;; --seed) seed=$2 ;; --metrics) metrics=$2 ;; --init-std) init=$2 ;; --beta2) beta2=$2 ;;
  esac
  shift
done
awk -v l="$layers" -v d="$dim" -v s="$steps" -v b="$batch" -v q="$seq" -v lr="$lr" -v seed="$seed" 'BEGIN {
  n = 12 * l * d * d; t = s * b * q; best = 0.02 * 64 / d; x = log(lr / best) / log(2);
  printf "{\"type\":\"eval\",\"val_loss\":%.6f}\n", (0.2 + 10 / n ^ 0.34 + 50 / t ^ 0.36) * (1 + 0.01 * x * x) + 0.001 * (seed - 1337)
}' >"$metrics"
echo "$dim ${init:-none} ${beta2:-none}" >"${metrics%.jsonl}.recipe"
