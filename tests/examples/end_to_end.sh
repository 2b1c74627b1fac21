#!/usr/bin/env bash
# End-to-end checks of the example programs, as a user runs them.
#   end_to_end.sh BIN_DIR WORK_DIR CASE
# Cases:
#   fortunes      the default run (shortened) learns: validation loss falls by > 1 nat,
#                 metrics are JSON lines, a sample is printed
#   shards        prepare_data turns text into shards that train_gpt trains on
#   missing-data  a glob that matches nothing names the pattern and how to make shards
#   corrupt-shard a text file passed as a shard names the file and the wrong magic
#   bad-config    a dim that heads does not divide names both values; every option is
#                 checked before the first step (a shard-trained model that cannot be
#                 sampled as bytes, a warmup longer than the run, ...): no step runs
#   mfu           the default run (shortened) with its measured MFU peak: the peak is the
#                 run's precision's, and no step's MFU exceeds 100%, in fp32 and bf16; the
#                 bf16 run says which path each of the step's 15 GEMM shapes takes
#   precision     gpt2-tiny for 150 steps in fp32, bf16 and fp16: the final validation
#                 losses of bf16 and fp16 are within 2% of fp32's, and fp16's loss scale
#                 is in the metrics
#   ranks         --ranks 2 --batch 4 trains exactly as one rank with --batch 8: the same
#                 losses step by step (replicas average gradients); so do --ranks 2 --tp 2
#                 --batch 8 (each block split over 2 ranks), the same with --sp
#                 (sequence parallel), and ZeRO 1 (2 micro-batches from --global-batch),
#                 2 (tp 2 x dp 2) and 3 (with and without overlap); bad --ranks, --tp and
#                 --sp are named
#   mpi           the same under mpirun -np 2 (MPIEXEC: the launcher and its flags), and
#                 ZeRO 3 and a 2-stage 1F1B pipeline over the two processes
#   restart       tools/supervise.sh (./llmpar.sh train --restarts N): one of 2 MPI
#                 processes kill -9's itself after step 8 (a test-only fault) in a run
#                 with --restarts 2 --save; the run restarts from its latest checkpoint
#                 (step 6, or 3 if 6's background write had not finished) on its own and
#                 finishes, and every step's kept loss equals, bit for bit, the
#                 uninterrupted run's; a process that stops answering after step 8 is
#                 named by the watchdog (exit 75) and the run restarts too; with
#                 --min-ranks 1 the restart runs on one process and trains the same run
#                 to 1e-5 (global batch kept, resharded); the same kill and hang on 2
#                 thread ranks restart too (a timed-out collective ends the process with
#                 75); an
#                 error a restart would repeat (a bad flag) is not restarted
#   pipeline      --pp 2 with every schedule (gpipe, 1f1b, interleaved with 2 virtual
#                 stages, zb), recompute selective and full, and tp 2 x pp 2 with sp and
#                 ZeRO 1 on 4 ranks, train as one rank does with the same micro-batches:
#                 the same losses step by step; --trace writes a Chrome trace of every
#                 rank's actions; bad pipeline flags are named before the first step
#   checkpoint    a run stopped after step 6 (--exit-after) and resumed (--resume latest)
#                 logs the uninterrupted run's losses bit for bit; its step-6 checkpoint
#                 resumes at tp 2 x dp 1, at dp 2 with ZeRO 2 and at pp 2 x dp 2 with
#                 ZeRO 1 within 1e-5; --keep keeps the newest; --export and --init-from
#                 round-trip the weights (the same bytes, the same validation loss); a
#                 loss spike guard set too tight rolls back, logs it, and stops when a
#                 spike outlasts --spike-max-skip; a stretch of 5 bad batches is one
#                 logged incident and the run finishes, the same incident at tp 2 and
#                 at dp 2; bad checkpoints and flags are named, a µP
#                 checkpoint resumed without --mup (or with another base width) too
#   llama         --model llama-tiny (grouped-query attention, RoPE, SwiGLU, RMSNorm,
#                 untied head) learns, and trains at tp 2 with sp, tp 2 x dp 2 with ZeRO 1,
#                 cp 2 x tp 2 and cp 4 (context parallelism, ring attention),
#                 dp 2 with ZeRO 3, a 2-stage 1F1B and ZB-H1 pipeline as one rank does with
#                 the same micro-batches (fp32 losses to 1e-5), bf16 within 2e-2; a checkpoint of
#                 step 3 resumes at tp 2 within 1e-5 of the uninterrupted run; bad Llama
#                 flags are named before the first step
#   plan          llmpar-plan: --calibrate writes this machine's cluster file; the quick
#                 validation grid (8 layouts: precisions, recomputation, ZeRO 2 and 3, tp
#                 with sp, zb and interleaved pipelines) predicts every rank-0 memory
#                 report of train_gpt within 10%; the search over h200x8x4 for gpt2-1.5b
#                 lists layouts and prints the best's command; one layout's breakdown;
#                 llama-tiny with --kv-heads and --ffn-dim: the search on this machine
#                 tries cp, --cp 2 fixes it, and the best's command (--cp 2 and the
#                 Llama flags) trains; on GPUs cp is searched where train_gpt's CUDA
#                 backend runs it, and where not the search says why; bad flags are named
#   scaling       llmpar-scaling --synthetic: the whole sweep (fit sizes, off-ratio runs,
#                 the held-out model at 10x the largest fit run's compute) with losses from
#                 a known Chinchilla law and 0.3% noise; the fit recovers E, alpha and beta
#                 within 0.05 and predicts the held-out loss within 2%; the report, CSV and
#                 a rerun that reuses every finished run; bad flags are named. Then the
#                 tuned sweep on shards of a small text with a stand-in trainer
#                 (fake_train_gpt.sh, a known law): the walks find the law's best rates,
#                 each fit size is the mean of 3 seeds, the plateau size is excluded, the
#                 held-out run is at the trend's rate, and a rerun reuses every run
#   cuda          --backend cuda trains as the CPU backend does: the same 5 step losses
#                 to 1e-4 relative in fp32 (different kernels sum in different orders),
#                 2e-2 in bf16 and 5e-3 in fp16 (each against the CPU backend in the same
#                 precision); on a machine with 2 GPUs, also mpirun -np 2 --tp 2 --sp
#                 (NCCL, fp32) and ZeRO 2 and 3 over dp 2; ZeRO 3 on one GPU against ZeRO 0.
#                 Exits 77 (skipped) after checking the no-device error
#                 where there is no GPU.
set -euo pipefail
bin="$1" work="$2" case="$3"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rm -rf "$work" && mkdir -p "$work" && cd "$work"

fail() { echo "FAILED: $*" >&2; exit 1; }
expect_error() {  # expect_error PATTERN COMMAND...: the command fails and says PATTERN
  local pattern="$1" out
  shift
  if out="$("$@" 2>&1)"; then fail "expected '$*' to fail; it printed: $out"; fi
  echo "$out"
  grep -qF -- "$pattern" <<<"$out" || fail "the error does not say '$pattern'"
}

case "$case" in
  fortunes)
    "$bin/train_gpt" --steps 40 --warmup 10 --eval-every 40 --eval-batches 8 --sample-tokens 60 \
      --peak-gflops 50 --metrics metrics.jsonl | tee out.txt
    first=$(grep -m1 'val loss' out.txt | awk '{print $NF}')
    last=$(grep 'val loss' out.txt | tail -1 | awk '{print $NF}')
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 1.0) }' || fail "val loss $first -> $last did not fall by 1 nat"
    grep -q -- '---- sample' out.txt || fail "no sample printed"
    [[ $(grep -c '"type":"step"' metrics.jsonl) == 40 ]] || fail "metrics.jsonl lacks 40 step records"
    grep -q '"type":"config"' metrics.jsonl || fail "metrics.jsonl lacks the config record"
    grep -q '"type":"eval"' metrics.jsonl || fail "metrics.jsonl lacks eval records"
    ;;
  shards)
    for i in $(seq 1 200); do echo "Line $i of a small corpus, with words to learn and bytes to predict."; done >text.txt
    "$bin/prepare_data" --out data/small text.txt
    [[ -f data/small_train.bin && -f data/small_val.bin ]] || fail "prepare_data wrote no shards"
    "$bin/train_gpt" --data 'data/small_train*.bin' --steps 5 --batch 2 --seq 32 --eval-every 5 \
      --eval-batches 2 --sample-tokens 0 --peak-gflops 50 | tee out.txt
    grep -q 'step     5/5' out.txt || fail "training on shards did not reach step 5"
    # The recipe's flags reach the run: the config records them, and another init std
    # starts from another validation loss.
    small=(--data 'data/small_train*.bin' --steps 2 --batch 2 --seq 32 --eval-every 2 --eval-batches 2
      --sample-tokens 0 --peak-gflops 50)
    "$bin/train_gpt" "${small[@]}" --metrics default.jsonl >/dev/null
    "$bin/train_gpt" "${small[@]}" --init-std 0.2 --beta1 0.8 --beta2 0.99 --final-lr 0 --metrics recipe.jsonl
    config=$(grep '"type":"config"' recipe.jsonl)
    for field in '"init_std":0.2' '"beta1":0.8' '"beta2":0.99' '"final_lr":0.0[,}]'; do
      grep -Eq "$field" <<<"$config" || fail "the metrics config does not record $field: $config"
    done
    first_eval() { grep -m1 '"type":"eval"' "$1" | sed 's/.*"val_loss":\([0-9.]*\).*/\1/'; }
    [[ $(first_eval default.jsonl) != $(first_eval recipe.jsonl) ]] || fail "--init-std 0.2 started from the default loss"
    ;;
  missing-data)
    expect_error "no shard matches 'nowhere/x_train*.bin'" "$bin/train_gpt" --data 'nowhere/x_train*.bin'
    ;;
  corrupt-shard)
    echo "plain text, not a shard" >x_train.bin
    expect_error "'x_train.bin' is 24 bytes, shorter than the 1024-byte shard header" "$bin/train_gpt" --data x_train.bin
    for i in $(seq 1 100); do echo "plain text, not a shard"; done >x_train.bin
    expect_error "magic" "$bin/train_gpt" --data x_train.bin
    ;;
  bad-config)
    expect_error "dim 100 is not divisible by heads 12" "$bin/train_gpt" --heads 12 --dim 100
    # Options that can only fail late must fail before the first step.
    for i in $(seq 1 200); do echo "Line $i of a small corpus, with words to learn and bytes to predict."; done >text.txt
    "$bin/prepare_data" --out data/small text.txt
    no_step() {  # no_step PATTERN ARGS...: fails with PATTERN before training anything
      local out
      out="$(expect_error "$@")"
      echo "$out"
      if grep -q '^step ' <<<"$out"; then fail "'${*:2}' ran a step before failing"; fi
    }
    no_step "sampling decodes with the byte tokenizer, but --data trains a vocabulary of 512" \
      "$bin/train_gpt" --data 'data/small_train*.bin' --vocab 512 --steps 3
    no_step "--warmup 30 must be in [0, --steps 10]" "$bin/train_gpt" --steps 10 --warmup 30
    no_step "--eval-batches 0; validation needs at least 1 batch" "$bin/train_gpt" --eval-batches 0
    no_step "--tf32 is a CUDA option" "$bin/train_gpt" --tf32
    no_step "cannot derive validation shards from --data 'data/small*.bin'" "$bin/train_gpt" --data 'data/small*.bin'
    no_step "--seq 30 is not divisible by --tp 4" "$bin/train_gpt" --ranks 4 --tp 4 --sp --seq 30
    expect_error "--precision: fp8 not in {fp32,bf16,fp16}" "$bin/train_gpt" --precision fp8
    expect_error "--cpu-bf16-gemm: fast not in {measured,native,upconvert}" "$bin/train_gpt" --cpu-bf16-gemm fast
    no_step "--cpu-bf16-gemm native chooses how the CPU backend runs bf16 GEMMs; use it with --backend cpu" \
      "$bin/train_gpt" --cpu-bf16-gemm native
    no_step "--global-batch 10 is not a multiple of --micro-batch 4 x dp 2 = 8" "$bin/train_gpt" --ranks 2 \
      --global-batch 10 --micro-batch 4
    no_step "--grad-accum 3 contradicts --global-batch 16 / (--micro-batch 8 x dp 1) = 2" "$bin/train_gpt" \
      --global-batch 16 --batch 8 --grad-accum 3
    no_step "--zero 4 is not a ZeRO stage; use 0 (replicated), 1" "$bin/train_gpt" --zero 4
    no_step "--bucket-mb 0; the gradient bucket size must be a positive number of MiB" "$bin/train_gpt" --bucket-mb 0
    no_step "the model has 4 layers but the pipeline has 4 stages x 2 chunks = 8 virtual stages" "$bin/train_gpt" \
      --ranks 4 --pp 4 --schedule interleaved --virtual-stages 2 --grad-accum 4
    no_step "needs the micro-batches per step (3, from --grad-accum or --global-batch) to be a multiple of --pp 2" \
      "$bin/train_gpt" --ranks 2 --pp 2 --schedule interleaved --virtual-stages 2 --grad-accum 3
    no_step "--zero 2 with --pp 2: ZeRO stages 2 and 3 reduce and gather per micro-batch" "$bin/train_gpt" --ranks 2 \
      --pp 2 --zero 2
    no_step "--virtual-stages 2 needs --schedule interleaved" "$bin/train_gpt" --ranks 2 --pp 2 --virtual-stages 2
    no_step "--schedule zb needs --pp 2 or more" "$bin/train_gpt" --schedule zb
    no_step "the partition's stages hold 3 layers but the model has 4" "$bin/train_gpt" --ranks 2 --pp 2 --partition 1,2
    no_step "--sample-tokens 10 with --pp 2: sampling runs the whole model on one rank" "$bin/train_gpt" --ranks 2 \
      --pp 2 --sample-tokens 10
    no_step "--tp 2 x --pp 2 does not divide the 2 ranks" "$bin/train_gpt" --ranks 2 --tp 2 --pp 2
    no_step "init_std (--init-std) is 0; give a positive standard deviation" "$bin/train_gpt" --init-std 0
    no_step "--beta2 1; AdamW's second-moment decay must be in [0, 1)" "$bin/train_gpt" --beta2 1
    no_step "--beta1 -0.5; AdamW's first-moment decay must be in [0, 1)" "$bin/train_gpt" --beta1 -0.5
    no_step "--final-lr 2 is the last step's rate as a fraction of --lr; give a number in [0, 1]" "$bin/train_gpt" \
      --final-lr 2
    no_step "--mup-base-dim 64 sets µP's base width; it needs --mup" "$bin/train_gpt" --mup-base-dim 64
    no_step "mup_base_dim (--mup-base-dim) is 0; µP needs a positive base width" "$bin/train_gpt" --mup \
      --mup-base-dim 0
    no_step "--export: Hugging Face GPT-2 weights cannot be written from a µP model of width multiplier 2" \
      "$bin/train_gpt" --mup --mup-base-dim 64 --export model.safetensors
    ;;
  mfu)
    for precision in fp32 bf16; do
      "$bin/train_gpt" --steps 30 --eval-every 0 --sample-tokens 0 --precision "$precision" \
        --metrics "mfu_$precision.jsonl" | tee "mfu_$precision.txt"
      want=$([[ "$precision" == fp32 ]] && echo f32 || echo bf16)
      grep -q "^MFU peak: .* GFLOP/s: best $want GEMM of" "mfu_$precision.txt" ||
        fail "the $precision run's MFU peak is not a measured $want GEMM peak"
      if [[ "$precision" == bf16 ]]; then
        grep -Eq '^bf16 GEMMs \(--cpu-bf16-gemm measured\): native on [0-9]+ of 15 shapes' "mfu_$precision.txt" ||
          fail "the bf16 run did not say which path each of the step's 15 GEMM shapes takes"
      fi
      grep -o '"mfu":[^,}]*' "mfu_$precision.jsonl" | cut -d: -f2 | awk -v p="$precision" '
        { n++; if ($1 > max) max = $1; if ($1 <= 0) bad = 1 }
        END { printf "%s: %d steps, highest MFU %.1f%%\n", p, n, 100 * max; exit !(n == 30 && max <= 1.0 && !bad) }' ||
        fail "a $precision step reported MFU above 100% (or none)"
    done
    ;;
  precision)
    for precision in fp32 bf16 fp16; do
      "$bin/train_gpt" --steps 150 --eval-every 150 --eval-batches 16 --sample-tokens 0 --peak-gflops 50 \
        --precision "$precision" --metrics "$precision.jsonl" | grep -v '^step .*/150 ' | tee "$precision.txt"
    done
    val() { grep 'val loss' "$1.txt" | tail -1 | awk '{print $NF}'; }
    for precision in bf16 fp16; do
      awk -v a="$(val fp32)" -v b="$(val "$precision")" -v p="$precision" 'BEGIN {
          d = (b - a) / a; printf "final val loss: fp32 %s, %s %s (%+.2f%%)\n", a, p, b, 100 * d
          if (d < 0) d = -d; exit !(d <= 0.02) }' || fail "$precision's final validation loss is not within 2% of fp32's"
    done
    grep -q '"loss_scale":65536.0' fp16.jsonl || fail "fp16.jsonl does not show the loss scale"
    grep -q '"loss_scale":1.0[,}]' bf16.jsonl || fail "bf16.jsonl does not show its loss scale of 1"
    ;;
  ranks | mpi)
    # Shuffled (the default): the data order is a function of the seed, the global batch
    # and T alone, so every layout of one global batch trains on the same sequences.
    common=(--steps 5 --warmup 2 --eval-every 5 --eval-batches 2 --sample-tokens 0 --peak-gflops 50)
    "$bin/train_gpt" "${common[@]}" --batch 8 --metrics one.jsonl | tee one.txt
    if [[ "$case" == ranks ]]; then
      "$bin/train_gpt" "${common[@]}" --ranks 2 --batch 4 --metrics two.jsonl | tee two.txt
      grep -q '2 ranks (thread; tp 1 x dp 2, ZeRO 0)' two.txt || fail "train_gpt --ranks 2 did not run two thread ranks"
      # Tensor parallel: 2 ranks split every block and see the whole batch of 8.
      "$bin/train_gpt" "${common[@]}" --ranks 2 --tp 2 --batch 8 --metrics tp.jsonl | tee tp.txt
      grep -q '2 ranks (thread; tp 2 x dp 1, ZeRO 0)' tp.txt || fail "train_gpt --ranks 2 --tp 2 did not split over tp 2"
      "$bin/train_gpt" "${common[@]}" --ranks 2 --tp 2 --sp --batch 8 --metrics sp.jsonl | tee sp.txt
      grep -q '2 ranks (thread; tp 2 sp x dp 1, ZeRO 0)' sp.txt || fail "train_gpt --tp 2 --sp did not run sequence parallel"
    else
      read -r -a launcher <<<"${MPIEXEC:?set MPIEXEC to the MPI launcher command}"
      "${launcher[@]}" -np 2 "$bin/train_gpt" "${common[@]}" --batch 4 --metrics two.jsonl | tee two.txt
      grep -q '2 ranks (mpi; tp 1 x dp 2, ZeRO 0)' two.txt || fail "mpirun -np 2 train_gpt did not run two MPI ranks"
      # ZeRO 3 over the two processes, the global batch of 8 as 2 micro-batches of 2 each.
      "${launcher[@]}" -np 2 "$bin/train_gpt" "${common[@]}" --zero 3 --global-batch 8 --micro-batch 2 \
        --metrics zero3.jsonl | tee zero3.txt
      grep -q '2 ranks (mpi; tp 1 x dp 2, ZeRO 3) x micro-batch 2 x .*, grad accum 2 (global batch 8)' zero3.txt ||
        fail "mpirun -np 2 train_gpt --zero 3 did not run ZeRO 3 with 2 micro-batches of 2"
      # A 2-stage pipeline over the two processes: 4 micro-batches of 2 per step, as one
      # rank accumulates them.
      "$bin/train_gpt" "${common[@]}" --batch 2 --grad-accum 4 --metrics one_accum.jsonl >one_accum.txt
      "${launcher[@]}" -np 2 "$bin/train_gpt" "${common[@]}" --pp 2 --batch 2 --grad-accum 4 --metrics pp.jsonl |
        tee pp.txt
      grep -q '2 ranks (mpi; tp 1 x pp 2 x dp 1, ZeRO 0)' pp.txt || fail "mpirun -np 2 train_gpt --pp 2 did not run 2 stages"
      paste <(grep -o '"loss":[^,}]*' one_accum.jsonl | cut -d: -f2) <(grep -o '"loss":[^,}]*' pp.jsonl | cut -d: -f2) |
        awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * $1) { print "step " NR ": " $1 " vs " $2; bad = 1 } }
             END { exit bad || NR != 5 }' || fail "a 2-stage pipeline over 2 MPI processes did not reproduce the 1-rank losses"
    fi
    losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }
    [[ $(losses one.jsonl | wc -l) == 5 ]] || fail "one.jsonl lacks 5 step losses"
    # fp32, different summation orders: equal to 1e-5 relative.
    paste <(losses one.jsonl) <(losses two.jsonl) | awk '{
        d = $1 - $2; if (d < 0) d = -d
        if (d > 1e-5 * $1) { print "step " NR ": loss " $1 " (1 rank) vs " $2 " (2 ranks)"; bad = 1 }
      } END { exit bad }' || fail "2 ranks did not reproduce the 1-rank losses"
    if [[ "$case" == ranks ]]; then
      # ZeRO: optimizer state (1), gradients (2) and parameters (3) sharded over dp 2;
      # stage 1 with the global batch as 2 micro-batches of 2 per rank; stage 2 with tp 2
      # x dp 2 on 4 ranks.
      "$bin/train_gpt" "${common[@]}" --ranks 2 --zero 1 --global-batch 8 --micro-batch 2 --metrics zero1.jsonl |
        tee zero1.txt
      grep -q 'tp 1 x dp 2, ZeRO 1) x micro-batch 2 x .*, grad accum 2 (global batch 8)' zero1.txt ||
        fail "--zero 1 --global-batch 8 --micro-batch 2 did not accumulate 2 micro-batches"
      "$bin/train_gpt" "${common[@]}" --ranks 4 --tp 2 --zero 2 --batch 4 --metrics zero2.jsonl | tee zero2.txt
      grep -q 'memory per rank (start): ' zero2.txt || fail "train_gpt printed no memory line"
      grep -q '"type":"memory"' zero2.jsonl || fail "the metrics log has no memory record"
      "$bin/train_gpt" "${common[@]}" --ranks 2 --zero 3 --batch 4 --bucket-mb 0.25 --metrics zero3.jsonl |
        tee zero3.txt
      "$bin/train_gpt" "${common[@]}" --ranks 2 --zero 3 --batch 4 --no-overlap --metrics zero3n.jsonl
      # Micro-batches and accumulation: the global batch of 8 as 2 micro-batches of 2 on
      # tp 2 x dp 2 with ZeRO 1, and as 2 micro-batches of 4 on one rank.
      "$bin/train_gpt" "${common[@]}" --ranks 4 --tp 2 --zero 1 --global-batch 8 --micro-batch 2 \
        --metrics tp2dp2.jsonl | tee tp2dp2.txt
      grep -q 'tp 2 x dp 2, ZeRO 1) x micro-batch 2 x .*, grad accum 2 (global batch 8)' tp2dp2.txt ||
        fail "--ranks 4 --tp 2 --global-batch 8 --micro-batch 2 did not accumulate 2 micro-batches of 2"
      "$bin/train_gpt" "${common[@]}" --global-batch 8 --micro-batch 4 --metrics accum.jsonl >/dev/null
      for layout in tp sp zero1 zero2 zero3 zero3n tp2dp2 accum; do
        paste <(losses one.jsonl) <(losses $layout.jsonl) | awk -v layout=$layout '{
            d = $1 - $2; if (d < 0) d = -d
            if (d > 1e-5 * $1) { print "step " NR ": loss " $1 " (1 rank) vs " $2 " (" layout ")"; bad = 1 }
          } END { exit bad }' || fail "$layout with 2 ranks did not reproduce the 1-rank losses"
      done
      expect_error "--sp splits the sequence over the tensor-parallel group" "$bin/train_gpt" --sp
      # Sampling runs on every rank of a split model (the blocks need their whole group).
      "$bin/train_gpt" --ranks 2 --tp 2 --sp --steps 1 --eval-every 0 --sample-tokens 8 --peak-gflops 50 |
        tee sample.txt
      grep -q -- '---- sample' sample.txt || fail "train_gpt --tp 2 --sp printed no sample"
      expect_error "--tp 3 does not divide the 2 ranks" "$bin/train_gpt" --ranks 2 --tp 3
      expect_error "heads (4) is not divisible by the tensor-parallel degree 8" "$bin/train_gpt" --ranks 8 --tp 8 \
        --steps 1
    fi
    if [[ "$case" == mpi ]]; then
      paste <(losses one.jsonl) <(losses zero3.jsonl) | awk '{
          d = $1 - $2; if (d < 0) d = -d
          if (d > 1e-5 * $1) { print "step " NR ": loss " $1 " (1 rank) vs " $2 " (ZeRO 3)"; bad = 1 }
        } END { exit bad }' || fail "ZeRO 3 over 2 MPI processes did not reproduce the 1-rank losses"
    fi
    val1=$(grep 'val loss' one.txt | tail -1 | awk '{print $NF}')
    val2=$(grep 'val loss' two.txt | tail -1 | awk '{print $NF}')
    awk -v a="$val1" -v b="$val2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-4 * a) }' ||
      fail "validation loss $val1 (1 rank) vs $val2 (2 ranks)"
    if [[ "$case" == ranks ]]; then
      expect_error "--ranks 0 is not a positive whole number" "$bin/train_gpt" --ranks 0
    fi
    ;;
  llama)
    common=(--model llama-tiny --steps 6 --warmup 2 --eval-every 0 --sample-tokens 0 --peak-gflops 50 --seq 64
      --global-batch 8)
    "$bin/train_gpt" "${common[@]}" --batch 2 --metrics one.jsonl | tee one.txt
    grep -q 'Llama: 2 kv heads, SwiGLU 384, RoPE theta 500000, untied head' one.txt ||
      fail "train_gpt --model llama-tiny did not say its model"
    run() {  # run NAME FLAGS...: a layout's run, its losses in NAME.jsonl
      local name="$1"
      shift
      "$bin/train_gpt" "${common[@]}" "$@" --metrics "$name.jsonl" | tee "$name.txt"
    }
    run tp --ranks 2 --tp 2 --sp --batch 2
    run tp2dp2 --ranks 4 --tp 2 --zero 1 --batch 1
    run zero3 --ranks 2 --zero 3 --batch 1
    run 1f1b --ranks 2 --pp 2 --schedule 1f1b --batch 2
    run zb --ranks 2 --pp 2 --schedule zb --recompute selective --batch 2
    run cp --ranks 4 --cp 2 --tp 2 --batch 2
    run cp4 --ranks 4 --cp 4 --batch 2
    grep -q '4 ranks (thread; tp 2 x cp 2 x dp 1, ZeRO 0)' cp.txt || fail "the cp run did not say its layout"
    losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }
    for layout in tp tp2dp2 zero3 1f1b zb cp cp4; do
      paste <(losses one.jsonl) <(losses $layout.jsonl) | awk -v layout=$layout '{
          d = $1 - $2; if (d < 0) d = -d
          if (d > 1e-5 * $1) { print "step " NR ": loss " $1 " (1 rank) vs " $2 " (" layout ")"; bad = 1 }
        } END { exit bad || NR != 6 }' || fail "llama $layout did not reproduce the 1-rank losses"
    done
    # It learns: 60 steps on the fortunes take the loss well below the bytes' 5.5 nats;
    # bf16 tracks fp32 (2e-2 relative).
    "$bin/train_gpt" --model llama-tiny --steps 60 --eval-every 0 --sample-tokens 0 --peak-gflops 50 --batch 8 \
      --metrics learn.jsonl | tee learn.txt
    last=$(losses learn.jsonl | tail -1)
    awk -v l="$last" 'BEGIN { exit !(l < 3.2) }' || fail "llama-tiny ended at loss $last"
    run bf16 --batch 2 --precision bf16
    paste <(losses one.jsonl) <(losses bf16.jsonl) | awk '{
        d = $1 - $2; if (d < 0) d = -d
        if (d > 2e-2 * $1) { print "step " NR ": " $1 " (fp32) vs " $2 " (bf16)"; bad = 1 } } END { exit bad || NR != 6 }' ||
      fail "llama-tiny in bf16 did not track fp32"
    # A checkpoint of step 3 resumes at tp 2 x dp 1 within 1e-5 of the run that went on.
    "$bin/train_gpt" "${common[@]}" --batch 2 --save ckpt --save-every 3 --exit-after 3 >/dev/null
    "$bin/train_gpt" "${common[@]}" --batch 2 --ranks 2 --tp 2 --resume latest --save ckpt --metrics resumed.jsonl |
      tee resumed.txt
    grep -q 'resume: step 3' resumed.txt || fail "the Llama run did not resume at step 3"
    paste <(losses one.jsonl | tail -3) <(losses resumed.jsonl) | awk '{
        d = $1 - $2; if (d < 0) d = -d
        if (d > 1e-5 * $1) { print "step " NR + 3 ": " $1 " vs " $2; bad = 1 } } END { exit bad || NR != 3 }' ||
      fail "the resumed Llama run at tp 2 did not continue the run"
    expect_error "was saved from a llama model but this run builds a gpt2" "$bin/train_gpt" --resume ckpt --steps 8
    expect_error "kv_heads (--kv-heads) is 3; it must divide heads 4" "$bin/train_gpt" --model llama-tiny --kv-heads 3
    expect_error "--tp 4 does not divide the kv heads" "$bin/train_gpt" --model llama-tiny --ranks 4 --tp 4
    expect_error "--kv-heads, --ffn-dim and --rope-theta shape a Llama" "$bin/train_gpt" --kv-heads 2
    expect_error "a Llama (--model llama-tiny) trains without it" "$bin/train_gpt" --model llama-tiny --mup
    expect_error "--seq 62 is not divisible by 2 x --cp 2" "$bin/train_gpt" --model llama-tiny --ranks 2 --cp 2 --seq 62
    expect_error "--tp 2 does not divide the model's 383 MLP hidden units" "$bin/train_gpt" --model llama-tiny \
      --ffn-dim 383 --ranks 2 --tp 2
    expect_error "--cp-comm a2a splits the heads over the cp ranks, but --cp 4 does not divide the 2 kv heads" \
      "$bin/train_gpt" --model llama-tiny --ranks 4 --cp 4 --cp-comm a2a
    expect_error "--cp-comm: ulysses not in {ring,a2a}" "$bin/train_gpt" --model llama-tiny --ranks 2 --cp 2 --cp-comm ulysses
    # Hugging Face: a folder out and back in, the same bytes.
    "$bin/train_gpt" "${common[@]}" --batch 2 --export hf >/dev/null
    [[ -f hf/config.json && -f hf/model.safetensors ]] || fail "--export hf wrote no model folder"
    "$bin/train_gpt" --init-from hf --steps 0 --export hf2 | tee hf.txt
    grep -q 'model: hf, .* Llama: 2 kv heads' hf.txt || fail "--init-from hf did not build the folder's Llama"
    cmp hf/model.safetensors hf2/model.safetensors || fail "the Hugging Face folder did not round-trip" 
    ;;
  pipeline)
    common=(--steps 5 --warmup 2 --eval-every 5 --eval-batches 2 --peak-gflops 50 --batch 2 --grad-accum 4)
    "$bin/train_gpt" "${common[@]}" --metrics one.jsonl | tee one.txt
    run() {  # run NAME FLAGS...: a layout's run, its losses in NAME.jsonl
      local name="$1"
      shift
      "$bin/train_gpt" "${common[@]}" "$@" --metrics "$name.jsonl" | tee "$name.txt"
    }
    run gpipe --ranks 2 --pp 2 --schedule gpipe
    run 1f1b --ranks 2 --pp 2 --schedule 1f1b --trace trace.json
    run interleaved --ranks 2 --pp 2 --schedule interleaved --virtual-stages 2
    run zb --ranks 2 --pp 2 --schedule zb --recompute selective
    run full --ranks 2 --pp 2 --recompute full --partition 1,3
    run selective --recompute selective
    run 3d --ranks 4 --tp 2 --sp --pp 2 --zero 1
    grep -q 'pipeline: 2 stages x 2 chunks, schedule interleaved, layers per virtual stage 1,1,1,1' interleaved.txt ||
      fail "the interleaved run did not say its layout"
    grep -q '4 ranks (thread; tp 2 sp x pp 2 x dp 1, ZeRO 1)' 3d.txt || fail "the 3D run did not say its layout"
    grep -q 'bubble' 1f1b.txt || fail "the pipeline's step lines do not show its bubble"
    losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }
    for layout in gpipe 1f1b interleaved zb full selective 3d; do
      paste <(losses one.jsonl) <(losses $layout.jsonl) | awk -v layout=$layout '{
          d = $1 - $2; if (d < 0) d = -d
          if (d > 1e-5 * $1) { print "step " NR ": loss " $1 " (1 rank) vs " $2 " (" layout ")"; bad = 1 }
        } END { exit bad || NR != 5 }' || fail "$layout did not reproduce the 1-rank losses"
    done
    # The trace: Chrome's JSON, both ranks' forwards and backwards of step 2, and waits.
    python3 - trace.json <<'PY' || fail "trace.json is not the pipeline's Chrome trace"
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
slices = [e for e in events if e["ph"] == "X"]
ranks = {e["tid"] for e in slices}
work = [e for e in slices if e["cat"] in ("F", "B")]
assert ranks == {0, 1}, ranks
assert len(work) == 2 * 2 * 4, len(work)  # 2 ranks x (F + B) x 4 micro-batches
assert any(e["name"] == "wait" for e in slices), "no wait slices"
print("trace: %d slices on ranks %s" % (len(slices), sorted(ranks)))
PY
    ;;
  checkpoint)
    common=(--steps 12 --warmup 4 --eval-every 0 --sample-tokens 0 --peak-gflops 50)
    losses() { grep '"type":"step"' "$1" | grep -o '"loss":[^,}]*' | cut -d: -f2; }
    "$bin/train_gpt" "${common[@]}" --batch 8 --save whole --save-every 6 --metrics whole.jsonl | tee whole.txt
    [[ "$(cat whole/latest)" == step_00000012 && -f whole/step_00000006/metadata.json ]] ||
      fail "the run did not checkpoint steps 6 and 12"
    grep -q 'spike guard: a loss above' whole.txt || fail "--save did not turn the spike guard on"
    "$bin/train_gpt" "${common[@]}" --batch 8 --save part --exit-after 6 --metrics part.jsonl | tee part1.txt
    grep -q 'step     7/12' part1.txt && fail "--exit-after 6 trained on"
    "$bin/train_gpt" "${common[@]}" --batch 8 --save part --resume latest --metrics part.jsonl | tee part2.txt
    grep -q 'resume: step 6 from part/step_00000006 (saved at tp 1 x pp 1 x dp 1, ZeRO 0, precision::FP32)' part2.txt ||
      fail "the resumed run did not say where from"
    grep -q '"type":"resume"' part.jsonl || fail "part.jsonl lacks the resume record"
    diff <(losses whole.jsonl) <(losses part.jsonl) || fail "the resumed run's losses are not the uninterrupted run's"
    reshard() {  # reshard NAME FLAGS...: steps 7-12 from whole's step 6 at another layout
      local name="$1"
      shift
      "$bin/train_gpt" "${common[@]}" --resume whole/step_00000006 --metrics "$name.jsonl" "$@" | tee "$name.txt"
      paste <(losses whole.jsonl | tail -6) <(losses "$name.jsonl") | awk -v name="$name" '{
          d = $1 - $2; if (d < 0) d = -d
          if (d > 1e-5 * $1) { print "step " NR + 6 ": loss " $1 " (whole) vs " $2 " (" name ")"; bad = 1 }
        } END { exit bad || NR != 6 }' || fail "$name did not continue the run"
    }
    reshard tp2 --ranks 2 --tp 2 --batch 8
    reshard zero2 --ranks 2 --batch 4 --zero 2
    reshard pp2 --ranks 4 --pp 2 --batch 4 --zero 1
    "$bin/train_gpt" --steps 8 --eval-every 0 --sample-tokens 0 --peak-gflops 50 --save kept --save-every 2 --keep 2 >/dev/null
    [[ "$(ls kept)" == "$(printf 'latest\nstep_00000006\nstep_00000008')" ]] || fail "--keep 2 kept $(ls kept | xargs)"
    # Hugging Face weights: export, import and export again are the same bytes; the
    # imported model's validation loss is the exported one's.
    "$bin/train_gpt" --steps 12 --peak-gflops 50 --sample-tokens 0 --eval-every 12 --eval-batches 4 --export model.safetensors | tee export.txt
    "$bin/train_gpt" --steps 0 --eval-every 1 --eval-batches 4 --sample-tokens 0 --init-from model.safetensors \
      --export again.safetensors | tee import.txt
    cmp model.safetensors again.safetensors || fail "export -> import -> export changed the file"
    [[ "$(grep 'val loss' export.txt | tail -1 | awk '{print $NF}')" == "$(grep 'val loss' import.txt | awk '{print $NF}')" ]] ||
      fail "the imported model's validation loss differs"
    # A guard set far too tight: the spikes come back within --spike-incident-steps, so
    # they are one incident whose skips double (0, 1, 2 extra steps), each rollback
    # logged, until the next would pass --spike-max-skip.
    out="$(expect_error 'the run is unstable, not unlucky' "$bin/train_gpt" --steps 60 --eval-every 0 \
      --sample-tokens 0 --peak-gflops 50 --batch 8 --spike-guard --spike-factor 1.02 --spike-min-history 3 \
      --spike-window 5 --spike-snapshot-every 2 --spike-max-skip 2 --metrics spike.jsonl)"
    echo "$out"
    grep -q 'came back at step .* after 3 rollbacks' <<<"$out" || fail "the error does not count the incident's 3 rollbacks"
    [[ $(grep -c '"type":"rollback"' spike.jsonl) == 3 ]] || fail "spike.jsonl lacks the 3 rollback records"
    # A stretch of 5 bad batches (random bytes in place of steps 31-35's windows): one
    # incident, logged and recorded; the run finishes.
    for i in $(seq 1 400); do echo "Line $i of a small corpus, with words to learn and bytes to predict."; done >clean.txt
    "$bin/prepare_data" --out data/stretch clean.txt >/dev/null
    python3 - data/stretch_train.bin <<'PY'
import sys, random
f = open(sys.argv[1], "r+b")
window = 8 * 64 * 2  # batch 8 x seq 64 tokens of 2 bytes
f.seek(1024 + 30 * window)
random.seed(5)
f.write(bytes(random.randrange(256) if i % 2 == 0 else 0 for i in range(5 * window)))
PY
    "$bin/train_gpt" --data 'data/stretch_train.bin' --steps 50 --batch 8 --seq 64 --no-shuffle --eval-every 0 \
      --sample-tokens 0 --peak-gflops 50 --spike-guard --metrics stretch.jsonl | tee stretch.txt
    grep -q '^loss spike incident: steps 31-' stretch.txt || fail "the bad stretch was not one logged incident"
    [[ $(grep -c '"type":"incident"' stretch.jsonl) == 1 ]] || fail "stretch.jsonl lacks the one incident record"
    grep -q 'step    50/50' stretch.txt || fail "the run with a bad stretch did not finish"
    # Split over 2 ranks (tp 2) and over 2 replicas (dp 2): the same incident, the same
    # windows skipped (every rank decides from the same reduced loss).
    incident() { grep '^loss spike incident' "$1" | sed 's/ steps of data skipped.*//'; }
    for layout in "--ranks 2 --tp 2 --batch 8" "--ranks 2 --batch 4"; do  # --batch: per replica
      # shellcheck disable=SC2086  # the layout's flags are words
      "$bin/train_gpt" --data 'data/stretch_train.bin' --steps 50 --seq 64 --no-shuffle --eval-every 0 \
        --sample-tokens 0 --peak-gflops 50 --spike-guard $layout >stretch_split.txt
      [[ "$(incident stretch_split.txt)" == "$(incident stretch.txt)" && -n "$(incident stretch.txt)" ]] ||
        fail "$layout: the incident differs from one rank's: $(incident stretch_split.txt) vs $(incident stretch.txt)"
    done
    # Bad checkpoints and flags.
    expect_error 'was saved from a model with dim 128 but this run builds 64; pass --dim 128' \
      "$bin/train_gpt" "${common[@]}" --batch 8 --dim 64 --resume whole
    expect_error 'the data order was shuffled with seed 1337' "$bin/train_gpt" "${common[@]}" --batch 8 --seed 7 --resume whole
    # Another global batch resumes where it divides the sequences read (48 at step 6); 5 does not.
    "$bin/train_gpt" "${common[@]}" --batch 4 --resume whole/step_00000006 --metrics half.jsonl >/dev/null
    [[ $(losses half.jsonl | wc -l) == 6 ]] || fail "the resume at global batch 4 did not train steps 7-12"
    expect_error "which is not a whole number of this run's global batches of 5" "$bin/train_gpt" "${common[@]}" \
      --batch 5 --resume whole/step_00000006
    expect_error 'but this loader reads T=32; resume with the checkpoint' "$bin/train_gpt" "${common[@]}" --batch 8 \
      --seq 32 --resume whole
    # µP is part of the model: a µP checkpoint resumes only with --mup and its base width.
    expect_error 'was saved from a standard model but this run builds a µP one; drop --mup' \
      "$bin/train_gpt" "${common[@]}" --batch 8 --mup --resume whole
    "$bin/train_gpt" --steps 2 --warmup 1 --eval-every 0 --sample-tokens 0 --peak-gflops 50 --batch 8 --mup \
      --mup-base-dim 64 --save mup | tee mup.txt
    grep -q 'µP base width 64 (width multiplier 2)' mup.txt || fail "the model: line does not describe µP"
    expect_error 'a µP model (--mup --mup-base-dim 64) but this run builds a standard one; pass --mup --mup-base-dim 64' \
      "$bin/train_gpt" "${common[@]}" --batch 8 --resume mup
    expect_error 'saved from a µP model of base width 64 but this run builds one of 32; pass --mup-base-dim 64' \
      "$bin/train_gpt" "${common[@]}" --batch 8 --mup --mup-base-dim 32 --resume mup
    cp -r whole broken
    truncate -s 1000 broken/step_00000012/rank_00000.safetensors
    expect_error 'shard rank_00000.safetensors holds 1000 bytes but metadata.json says' \
      "$bin/train_gpt" "${common[@]}" --batch 8 --resume broken
    expect_error 'is at step 12, the end of a run of --steps 12' "$bin/train_gpt" "${common[@]}" --batch 8 --resume whole
    expect_error '--resume latest resumes from the newest checkpoint of --save DIR' \
      "$bin/train_gpt" "${common[@]}" --resume latest
    expect_error '--spike-factor 0.5' "$bin/train_gpt" "${common[@]}" --spike-guard --spike-factor 0.5
    expect_error '--exit-after 13 must be in [1, --steps 12]' "$bin/train_gpt" "${common[@]}" --exit-after 13
    expect_error '--steps 0 only converts' "$bin/train_gpt" --steps 0
    expect_error '--resume and --init-from both set the weights' "$bin/train_gpt" "${common[@]}" \
      --resume whole --init-from model.safetensors
    echo "checkpoint: OK"
    ;;
  plan)
    "$bin/llmpar-plan" --calibrate cpu.json | tee calibrate.txt
    grep -q '"shared_node": true' cpu.json || fail "--calibrate did not write a shared-node cluster file"
    "$bin/llmpar-plan" --validate --quick --steps 3 --cluster cpu.json --out table.md | tee validate.txt
    [[ $(grep -c '^| [124] |' table.md) == 8 ]] || fail "the quick validation table does not hold 8 layouts"
    "$bin/llmpar-plan" --model gpt2-1.5b --cluster h200x8x4 --global-batch 512 | tee search.txt
    grep -q '^best: mpirun -np 32 train_gpt --backend cuda --model gpt2-1.5b' search.txt ||
      fail "the search printed no best command line"
    grep -q 'layouts fit in 131 GiB per device' search.txt || fail "the search did not count the layouts that fit"
    "$bin/llmpar-plan" --model gpt2-124m --cluster h100x8x1 --ranks 8 --tp 2 --pp 2 --zero 1 --batch 4 \
      --global-batch 64 --precision bf16 | tee one.txt
    grep -q 'memory per rank' one.txt && grep -q 'bubble' one.txt || fail "one layout's breakdown is incomplete"
    expect_error "unknown cluster 'a100x8x1'" "$bin/llmpar-plan" --model gpt2-124m --cluster a100x8x1 --global-batch 8
    expect_error "give --global-batch" "$bin/llmpar-plan" --model gpt2-124m --cluster h100x8x1
    expect_error "--tp 3 does not divide the 8 ranks" "$bin/llmpar-plan" --cluster h100x8x1 --ranks 8 --tp 3
    expect_error "--tp 8 does not divide the model's 12 heads" "$bin/llmpar-plan" --model gpt2-124m \
      --cluster h100x8x1 --ranks 8 --tp 8
    # A Llama with train_gpt's shape flags, and context parallelism on this machine's ranks.
    llama=(--model llama-tiny --kv-heads 4 --ffn-dim 512 --seq 512 --global-batch 8)
    "$bin/llmpar-plan" "${llama[@]}" --cluster cpu.json | tee llama.txt
    grep -qE '^ +[0-9]+  tp [0-9]+( sp)? cp 2 pp' llama.txt || fail "the Llama search listed no cp 2 layout"
    "$bin/llmpar-plan" "${llama[@]}" --cluster cpu.json --cp 2 | tee llama_cp.txt
    grep -qE '^ +[0-9]+  tp [0-9]+( sp)? pp' llama_cp.txt && fail "--cp 2 listed a layout without cp 2"
    grep -qE '^best: train_gpt --ranks [0-9]+ --model llama-tiny --kv-heads 4 --ffn-dim 512 --seq 512 .*--cp 2 ' llama_cp.txt ||
      fail "the best command line lacks the Llama flags or --cp 2"
    read -r -a best <<<"$(sed -n 's/^best: train_gpt //p' llama_cp.txt)"
    "$bin/train_gpt" "${best[@]}" --steps 2 --eval-every 0 --peak-gflops 50 | tee llama_run.txt
    grep -q 'step     2/2' llama_run.txt || fail "the planner's best command did not train"
    "$bin/llmpar-plan" "${llama[@]}" --cluster cpu.json --ranks 2 --cp 2 --batch 4 | tee llama_one.txt
    grep -q '^layout: tp 1 cp 2 pp 1 dp 1' llama_one.txt && grep -q 'of it cp comm' llama_one.txt &&
      grep -q '^command: train_gpt --ranks 2 .*--cp 2 --batch 4' llama_one.txt || fail "one cp layout's breakdown is incomplete"
    # On GPUs cp is searched where train_gpt's CUDA backend runs it; where it does not
    # (no ring attention yet), the search says why, and --cp there is refused with it.
    "$bin/llmpar-plan" "${llama[@]}" --cluster h100x8x1 | tee llama_gpu.txt
    if grep -q '^context parallelism not searched: train_gpt says: --cp 2: ' llama_gpu.txt; then
      expect_error "--cp 2 cannot run on h100x8x1, whose layouts train_gpt runs with --backend cuda: --cp 2: " \
        "$bin/llmpar-plan" "${llama[@]}" --cluster h100x8x1 --cp 2
    else
      grep -qE '^ +[0-9]+  tp [0-9]+( sp)? cp 2 pp' llama_gpu.txt || fail "the GPU search neither tried cp nor said why"
    fi
    expect_error "unknown Llama preset 'llama-9b'; use llama-tiny, llama3.2-1b or llama3-8b" "$bin/llmpar-plan" \
      --model llama-9b --cluster h100x8x1 --global-batch 8
    expect_error "kv_heads (--kv-heads) is 3; it must divide heads 4" "$bin/llmpar-plan" --model llama-tiny --kv-heads 3 \
      --cluster h100x8x1 --global-batch 8
    expect_error "ffn_dim (--ffn-dim) is 0; the MLP needs at least 1 hidden unit" "$bin/llmpar-plan" --model llama-tiny \
      --ffn-dim 0 --cluster h100x8x1 --global-batch 8
    expect_error "--kv-heads, --ffn-dim and --rope-theta shape a Llama; gpt2-124m is a GPT-2" "$bin/llmpar-plan" \
      --model gpt2-124m --rope-theta 10000 --cluster h100x8x1 --global-batch 8
    expect_error "--tp 2 does not divide the model's 383 MLP hidden units" "$bin/llmpar-plan" --model llama-tiny \
      --ffn-dim 383 --cluster h100x8x1 --ranks 2 --tp 2
    expect_error "--cp 3 does not divide the 8 ranks of h100x8x1; use a --cp that divides them and cuts --seq 512: 1, 2, 4, 8" \
      "$bin/llmpar-plan" "${llama[@]}" --cluster h100x8x1 --cp 3
    expect_error "--seq 100 is not divisible by 2 x --cp 4 = 8" "$bin/llmpar-plan" --model llama-tiny --seq 100 \
      --cluster h100x8x1 --global-batch 8 --cp 4
    expect_error "--cp 0; the context-parallel degree is at least 1" "$bin/llmpar-plan" "${llama[@]}" --cluster h100x8x1 \
      --cp 0
    ;;
  scaling)
    "$bin/llmpar-scaling" --synthetic --out syn | tee syn.txt
    grep -q 'recovered$' syn.txt || fail "the fit did not recover the synthetic law"
    grep -q '^prediction for held-out-' syn.txt || fail "no prediction was made before the held-out run"
    [[ $(grep -c '"role":"held-out"' syn/runs.jsonl) == 1 ]] || fail "runs.jsonl does not hold the held-out run"
    [[ $(wc -l <syn/runs.csv) == 15 ]] || fail "runs.csv does not hold a header and 14 runs"
    grep -q '"format": "llmpar-scaling-report"' syn/scaling.json || fail "scaling.json is not a scaling report"
    "$bin/llmpar-scaling" --synthetic --out syn | tee again.txt
    [[ $(grep -c 'from syn/runs.jsonl' again.txt) == 14 ]] || fail "a rerun did not reuse the finished runs"
    expect_error "--budget 0" "$bin/llmpar-scaling" --synthetic --budget 0
    expect_error "give --data" "$bin/llmpar-scaling" --out x
    expect_error "--data nowhere_train.bin: no such file" "$bin/llmpar-scaling" --data nowhere_train.bin
    : >tokens.bin
    expect_error "does not contain 'train'" "$bin/llmpar-scaling" --data tokens.bin
    expect_error "--batch 16 is not divisible by --ranks 3" "$bin/llmpar-scaling" --synthetic --ranks 3
    expect_error "--seeds 0; give at least 1" "$bin/llmpar-scaling" --synthetic --seeds 0
    # The tuned sweep (learning-rate sweep, walks, seeds, plateau, rate trend) on real
    # shards, with a stand-in trainer whose losses follow a known law.
    fake="$here/fake_train_gpt.sh"
    for i in $(seq 1 200); do echo "Line $i of a small corpus, with words to learn and bytes to predict."; done >text.txt
    "$bin/prepare_data" --out data/small text.txt
    "$bin/llmpar-scaling" --data data/small_train.bin --out tuned --train-gpt "$fake" | tee tuned.txt
    [[ $(grep -c '^  mean of 3 seeds' tuned.txt) == 9 ]] || fail "not every fit size took the mean of 3 seeds"
    [[ $(grep -c '"seed":2' tuned/runs.jsonl) == 9 ]] || fail "runs.jsonl lacks the third seed of each fit size"
    # The smallest size's walk finds the law's best rate, 0.02 x 64 / 16; it sits on the
    # plateau (its loss above the bigram loss) and the fits leave it out.
    grep -q '^  best: .*(the parabola.s vertex: 0.08)$' tuned.txt || fail "the first walk missed the best rate 0.08"
    grep -q '"excluded_runs"' tuned/scaling.json || fail "the plateau size is not among the excluded runs"
    # The held-out run trains at the trend of the best rates, the law's 0.02 x 64 / 128.
    grep -q '^prediction for held-out-L7-C128-x20-b16-lr0.01 ' tuned.txt || fail "the held-out run is not at lr 0.01"
    grep -q '^held-out .*achieved' tuned.txt || fail "no held-out result"
    "$bin/llmpar-scaling" --data data/small_train.bin --out tuned --train-gpt "$fake" | tee again.txt
    runs=$(grep -c '^run ' tuned.txt)
    [[ $(grep -c 'from tuned/runs.jsonl' again.txt) == "$runs" ]] || fail "a rerun did not reuse all $runs runs"
    # Every run trains with the sweep's recipe: init std sqrt(2 / (5 width)), AdamW β2 0.99;
    # runs of another recipe (--gpt2-init) are not taken up as this one's.
    [[ $(cat tuned/runs/fit-L1-C16-x20-b1-lr0.0591.recipe) == "16 0.158114 0.99" ]] ||
      fail "the width-16 run did not get --init-std 0.158114 --beta2 0.99"
    [[ $(cat tuned/runs/held-out-L7-C128-x20-b16-lr0.01.recipe) == "128 0.0559017 0.99" ]] ||
      fail "the held-out run did not get --init-std 0.0559017 --beta2 0.99"
    cp -r tuned gpt2-init
    "$bin/llmpar-scaling" --data data/small_train.bin --out gpt2-init --gpt2-init --beta2 0.95 --train-gpt "$fake" |
      tee gpt2.txt
    ! grep -q 'from gpt2-init/runs.jsonl' gpt2.txt || fail "a run of another recipe was taken up"
    [[ $(cat gpt2-init/runs/fit-L1-C16-x20-b1-lr0.0591.recipe) == "16 0.02 0.95" ]] ||
      fail "--gpt2-init --beta2 0.95 did not reach train_gpt"
    expect_error "--beta2 1; AdamW" "$bin/llmpar-scaling" --synthetic --beta2 1
    "$bin/llmpar-scaling" --data data/small_train.bin --out one-seed --seeds 1 --train-gpt "$fake" | tee one.txt
    ! grep -q 'mean of' one.txt || fail "--seeds 1 averaged seeds"
    ;;
  cuda)
    base=(--steps 5 --warmup 2 --eval-every 5 --eval-batches 2 --sample-tokens 20 --peak-gflops 50 --no-shuffle)
    common=("${base[@]}" --batch 8)
    if ! out="$("$bin/train_gpt" --backend cuda "${common[@]}" --metrics gpu.jsonl 2>&1)"; then
      echo "$out"
      grep -qF "sees no CUDA device" <<<"$out" || fail "train_gpt --backend cuda failed for another reason than no GPU"
      echo "SKIPPED: no CUDA device"
      exit 77
    fi
    echo "$out" | tee gpu.txt
    grep -q 'cuda backend' gpu.txt || fail "train_gpt --backend cuda did not say it trains on the cuda backend"
    "$bin/train_gpt" "${common[@]}" --metrics cpu.jsonl | tee cpu.txt
    losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }
    # same_losses CPU GPU RTOL LABEL: both runs logged 5 step losses, equal to RTOL relative.
    same_losses() {
      [[ $(losses "$1" | wc -l) == 5 && $(losses "$2" | wc -l) == 5 ]] || fail "$1 or $2 lacks 5 step losses"
      paste <(losses "$1") <(losses "$2") | awk -v rtol="$3" -v label="$4" '{
          d = $1 - $2; if (d < 0) d = -d
          if (d > rtol * $1) { print "step " NR ": loss " $1 " (cpu) vs " $2 " (" label ")"; bad = 1 }
        } END { exit bad }'
    }
    same_losses cpu.jsonl gpu.jsonl 1e-4 cuda || fail "the CUDA backend did not reproduce the CPU backend's losses"
    # Mixed precision, each against the CPU backend in the same precision. Both store the
    # same format (the same bf16/fp16 weights and activations, f32 main grads and master
    # weights), but their GEMMs and reductions sum in different orders, so an activation
    # rounded to 16 bits differs in its last bit here and there, and the differences grow
    # over the steps as they feed the next layer and the next update. Hence tolerances
    # set by the format's precision, not fp32's: bf16 keeps 8 significant bits (unit
    # roundoff 2^-8 = 3.9e-3), fp16 11 (2^-11 = 4.9e-4); 2e-2 and 5e-3 relative per step
    # are about 5 and 10 of those roundings, over 5 steps.
    for precision in bf16 fp16; do
      if [[ "$precision" == bf16 ]]; then rtol=2e-2; else rtol=5e-3; fi
      "$bin/train_gpt" --backend cuda "${common[@]}" --precision "$precision" --metrics "gpu_$precision.jsonl" |
        tee "gpu_$precision.txt"
      "$bin/train_gpt" "${common[@]}" --precision "$precision" --metrics "cpu_$precision.jsonl" |
        tee "cpu_$precision.txt"
      same_losses "cpu_$precision.jsonl" "gpu_$precision.jsonl" "$rtol" "cuda, $precision" ||
        fail "the CUDA backend in $precision did not reproduce the CPU backend's $precision losses to $rtol"
    done
    # ZeRO 3 on one GPU: shards, pooled gradients and gathered layers in device memory.
    "$bin/train_gpt" --backend cuda "${common[@]}" --zero 3 --metrics gpu_zero3.jsonl | tee gpu_zero3.txt
    same_losses gpu.jsonl gpu_zero3.jsonl 1e-5 "cuda, ZeRO 3" || fail "ZeRO 3 on the GPU did not reproduce ZeRO 0's losses"
    # Tensor and sequence parallelism over 2 GPUs (NCCL), where the machine has them.
    # (MPIEXEC is set where the build has NCCL; without it the CUDA backend runs one GPU.)
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if (( gpus >= 2 )) && [[ -n "${MPIEXEC:-}" ]]; then
      read -r -a launcher <<<"${MPIEXEC:?set MPIEXEC to the MPI launcher command}"
      "${launcher[@]}" -np 2 "$bin/train_gpt" --backend cuda --tp 2 --sp "${common[@]}" --metrics gpu_tp.jsonl |
        tee gpu_tp.txt
      grep -q 'tp 2 sp x dp 1' gpu_tp.txt || fail "train_gpt --backend cuda --tp 2 --sp did not split over tp 2"
      same_losses cpu.jsonl gpu_tp.jsonl 1e-4 "cuda, tp 2, sp" ||
        fail "tp 2 with sequence parallelism on 2 GPUs did not reproduce the CPU's losses"
      # Data parallelism over 2 GPUs: NCCL's reduce-scatter and all-gather under ZeRO 2
      # and the gathers of ZeRO 3, each against the CPU's one-rank run of the global batch.
      for zero in 2 3; do
        "${launcher[@]}" -np 2 "$bin/train_gpt" --backend cuda --zero "$zero" "${base[@]}" --batch 4 \
          --metrics "gpu_dp_zero$zero.jsonl" | tee "gpu_dp_zero$zero.txt"
        grep -q "tp 1 x dp 2, ZeRO $zero" "gpu_dp_zero$zero.txt" || fail "--zero $zero did not run dp 2 on 2 GPUs"
        same_losses cpu.jsonl "gpu_dp_zero$zero.jsonl" 1e-4 "cuda, dp 2, ZeRO $zero" ||
          fail "ZeRO $zero over 2 GPUs did not reproduce the CPU's losses"
      done
    else
      echo "tensor parallelism on CUDA not checked: $gpus GPU(s); it needs 2 and a build with NCCL (MPIEXEC set)"
    fi
    ;;
  restart)
    read -r -a launcher <<<"${MPIEXEC:?set MPIEXEC to the MPI launcher command}"
    supervise="$here/../../tools/supervise.sh"
    run=(--steps 12 --batch 4 --seq 64 --no-shuffle --eval-every 0 --sample-tokens 0 --peak-gflops 50
      --save-every 3 --comm-timeout 5)
    "${launcher[@]}" -np 2 "$bin/train_gpt" "${run[@]}" --save whole --metrics whole.jsonl >whole.txt
    step_losses() { grep '"type":"step"' "$1" | sed 's/.*"loss":\([^,}]*\).*"step":\([0-9]*\).*/\2 \1/' | sort -n | uniq; }
    for fault in kill hang; do
      rm -f "fault_$fault"
      start=$(date +%s.%N)
      LLMPAR_TEST_FAULT="$fault:8:1" LLMPAR_TEST_FAULT_ONCE="$work/fault_$fault" bash "$supervise" --restarts 2 -- \
        "${launcher[@]}" -np 2 "$bin/train_gpt" "${run[@]}" --save "ck_$fault" --metrics "$fault.jsonl" \
        >"$fault.txt" 2>"$fault.err" || fail "the supervised run with a $fault fault did not finish: $(tail -5 "$fault.err")"
      echo "$fault: recovered and finished in $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
      grep 'supervise: restart 1/2' "$fault.err"
      [[ -f "fault_$fault" ]] || fail "the $fault fault never fired"
      grep -Eq '"type":"restart".*"from_step":[36],' "$fault.jsonl" || fail "$fault.jsonl lacks the restart record from a checkpoint (step 3 or 6)"
      # The kept steps (the last record of each) equal the uninterrupted run's, bit for bit.
      diff <(step_losses whole.jsonl) <(step_losses "$fault.jsonl" | awk '{ last[$1] = $2 } END { for (s in last) print s, last[s] }' | sort -n) ||
        fail "the restarted run's losses differ from the uninterrupted run's"
    done
    # With --min-ranks 1 the restart runs on one process: the global batch of 8 as 2
    # micro-batches of 4 instead of 2 replicas' 4, resharded from the checkpoint; the
    # same run to float rounding (1e-5).
    fixed=(--steps 12 --global-batch 8 --micro-batch 4 --seq 64 --no-shuffle --eval-every 0 --sample-tokens 0
      --peak-gflops 50 --save-every 3 --comm-timeout 5)
    "${launcher[@]}" -np 2 "$bin/train_gpt" "${fixed[@]}" --save whole_gb --metrics whole_gb.jsonl >whole_gb.txt
    rm -f fault_fewer
    LLMPAR_TEST_FAULT="kill:8:1" LLMPAR_TEST_FAULT_ONCE="$work/fault_fewer" bash "$supervise" --restarts 1 \
      --min-ranks 1 -- "${launcher[@]}" -np 2 "$bin/train_gpt" "${fixed[@]}" --save ck_fewer --metrics fewer.jsonl \
      >fewer.txt 2>fewer.err || fail "the run restarted on fewer ranks did not finish: $(tail -5 fewer.err)"
    grep 'runs on 1 process ' fewer.err || fail "the restart did not run on one process fewer"
    grep -q '1 rank (' fewer.txt || fail "the restarted run is not on 1 rank"
    paste <(step_losses whole_gb.jsonl) <(step_losses fewer.jsonl | awk '{ last[$1] = $2 } END { for (s in last) print s, last[s] }' | sort -n) |
      awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-5 * $2) { print; bad = 1 } } END { exit bad || NR != 12 }' ||
      fail "the run restarted on 1 rank does not train as the 2-rank run (1e-5)"
    grep -q 'a rank stopped answering' hang.err || fail "the hang was not reported as a lost rank"
    # Thread ranks: a killed rank kills its process, a hung one times out the others'
    # collectives (exit 75); both restart and train the uninterrupted run bit for bit.
    "$bin/train_gpt" "${run[@]}" --ranks 2 --save whole_threads --metrics whole_threads.jsonl >whole_threads.txt
    for fault in kill hang; do
      rm -f "fault_threads_$fault"
      LLMPAR_TEST_FAULT="$fault:8:1" LLMPAR_TEST_FAULT_ONCE="$work/fault_threads_$fault" bash "$supervise" \
        --restarts 1 -- "$bin/train_gpt" "${run[@]}" --ranks 2 --save "ck_threads_$fault" \
        --metrics "threads_$fault.jsonl" >"threads_$fault.txt" 2>"threads_$fault.err" ||
        fail "thread ranks with a $fault fault did not finish: $(tail -5 "threads_$fault.err")"
      grep 'supervise: restart 1/1' "threads_$fault.err" || fail "thread ranks with a $fault fault did not restart"
      diff <(step_losses whole_threads.jsonl) <(step_losses "threads_$fault.jsonl" | awk '{ last[$1] = $2 } END { for (s in last) print s, last[s] }' | sort -n) ||
        fail "thread ranks restarted after a $fault fault: the losses differ from the uninterrupted run's"
    done
    grep -q 'killed by signal' kill.err || fail "the kill was not reported as a signal"
    # An error a restart would repeat ends the run with its status, without a restart.
    if bash "$supervise" --restarts 2 -- "$bin/train_gpt" --steps 0 --save bad --heads 12 --dim 100 2>bad.err; then
      fail "a bad flag under supervision did not fail"
    fi
    grep -q 'not restarting' bad.err || fail "the supervisor restarted an error: $(cat bad.err)"
    ;;
  *) fail "unknown case '$case'" ;;
esac
echo "PASSED: $case"
