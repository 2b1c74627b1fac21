# shellcheck shell=bash
# tools/gpu.sh — llmpar on a GPU in the few minutes one is at hand; sourced by llmpar.sh.
#
#   ./llmpar.sh gpu-pack   on the CPU machine: builds everything the GPU check runs and
#                          packs it into .gpu-pack/llmpar-gpu-pack.tar.gz
#   ./llmpar.sh gpu-check  on the GPU machine: runs the pack (or, with no pack, builds
#                          first), prints one summary table
#
# Why a pack: a GPU is lent for 15 minutes at a time, start-up included, and a build of
# the CUDA programs takes minutes of a 2-core machine's time. So the programs are built
# on the CPU machine, for the GPU's architecture (sm_90a, H100/H200) and a host ISA
# every x86-64 server runs (x86-64-v3, not -march=native), stripped, and packed with the
# libraries the GPU image may lack (oneDNN, the OpenCL loader, Google Benchmark, libgomp,
# the C++ runtime) and the token shards the training runs read. The CUDA runtime and cuBLASLt are not packed (cuBLASLt
# alone is 500 MB): the check finds them on the GPU machine, in the CUDA toolkit or in
# PyTorch's wheel folder (nvidia/cu13/lib).
#
# What the check runs, in this order, and why:
#   1. the gpu test programs, several at once (each compares a CUDA kernel or a training
#      step with the CPU backend); the ones that measure device memory run alone after
#      (ctest's RUN_SERIAL, read from tests/CMakeLists.txt when the pack is built);
#      meanwhile train_gpt in fp32, bf16, fp16 and ZeRO 3 on both backends, compared;
#   2. bench_cuda_kernels, alone on the GPU (its figures are fractions of the peak);
#   3. one GPT-2 124M step (B 16, T 1024, bf16) side by side, alone on the GPU and
#      alternated (A B A B): train_gpt, PyTorch eager and torch.compile
#      (benchmarks/pytorch_step.py --device cuda) and llm.c's train_gpt2cu when the pack
#      holds one (LLMPAR_LLMC_DIR at pack time).
# --sanitize adds compute-sanitizer memcheck and racecheck over the kernels' test
# programs. Logs go to --out DIR (default: $OUT when set, as on a lent device, else
# build-gpu/gpu-check).
#
# Uses llmpar.sh's root, jobs, die and ensure_packages.
# shellcheck disable=SC2154  # root and jobs are llmpar.sh's

LLMPAR_GPU_PACK="$root/.gpu-pack/llmpar-gpu-pack.tar.gz"
LLMPAR_GPU_PACK_MAX_MB=60
# The programs whose tests compare our own kernels (compute-sanitizer runs these).
LLMPAR_GPU_KERNEL_TESTS=(test_cuda_attention test_cuda_attention_block test_cuda_elementwise test_cuda_layernorm
  test_cuda_cross_entropy test_cuda_adamw)

# The CMake arguments of a GPU build: the CUDA backend for `arch`, one GPU (no MPI or
# NCCL: the image has neither, and one GPU needs neither), and a host ISA of every
# x86-64-v3 server instead of this machine's.
gpu_cmake_args() {
  local arch="$1" nvcc
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  [[ -x "$nvcc" ]] || die "no nvcc on PATH or in /usr/local/cuda/bin: install the CUDA toolkit"
  echo -DCMAKE_BUILD_TYPE=Release -DLLMPAR_WERROR=ON -DLLMPAR_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc" \
    "-DCMAKE_CUDA_ARCHITECTURES=$arch" -DLLMPAR_MPI=OFF -DLLMPAR_NCCL=OFF -DLLMPAR_NATIVE=OFF \
    -DCMAKE_CXX_FLAGS=-march=x86-64-v3 -DCMAKE_CUDA_FLAGS=-Xcompiler=-march=x86-64-v3
}

# The targets the check runs: the trainer, the data tool, the kernel benchmarks and
# every gpu test program.
gpu_targets() {
  local source
  echo train_gpt prepare_data bench_cuda_kernels
  for source in "$root"/tests/cuda/test_*.cu "$root"/tests/cuda/test_*.cpp; do
    if [[ -f "$source" ]]; then basename "${source%.*}"; fi
  done
}

# gpu_build DIR ARCH: configures and builds the GPU targets in DIR (Ninja).
gpu_build() {
  local dir="$1" arch="$2" args
  mkdir -p "$dir"
  read -r -a args <<<"$(gpu_cmake_args "$arch")"
  local gen=()
  [[ -f "$dir/CMakeCache.txt" ]] || gen=(-G Ninja)
  cmake -S "$root" -B "$dir" "${gen[@]}" "${args[@]}" >"$dir/configure.log" 2>&1 ||
    { tail -30 "$dir/configure.log"; die "configuring $dir failed (log: $dir/configure.log)"; }
  local targets
  read -r -a targets <<<"$(gpu_targets | tr '\n' ' ')"
  cmake --build "$dir" --parallel "$jobs" --target "${targets[@]}" ||
    die "building the GPU targets in $dir failed"
}

# gpu_stage BUILD_DIR STAGE: lays out what the check runs, as the pack holds it:
#   bin/      train_gpt prepare_data bench_cuda_kernels (train_gpt2cu from llm.c, optional)
#   tests/    the gpu test programs, and tests.tsv: name, run alone (0/1), timeout seconds
#   lib/      the shared libraries the programs need besides the C library and CUDA's
#   data/     text_{train,val}.bin: this repository's own text in byte tokens (2 MB)
#   MANIFEST  where and how it was built
gpu_stage() {
  local build="$1" stage="$2"
  rm -rf "$stage" && mkdir -p "$stage"/{bin,tests,lib,data}
  local program
  for program in train_gpt prepare_data; do cp "$build/examples/$program" "$stage/bin/"; done
  cp "$build/benchmarks/bench_cuda_kernels" "$stage/bin/"
  for program in $(gpu_targets | grep '^test_'); do cp "$build/tests/$program" "$stage/tests/"; done
  strip --strip-unneeded "$stage"/bin/* "$stage"/tests/* 2>/dev/null || strip "$stage"/bin/* "$stage"/tests/*

  # tests.tsv from ctest's own description of the gpu tests (tests/CMakeLists.txt is the
  # one place that says which run alone and for how long).
  ctest --test-dir "$build" -L gpu --show-only=json-v1 >"$stage/ctest.json"
  python3 - "$stage/ctest.json" "$stage/tests" >"$stage/tests/tests.tsv" <<'PY'
import json, os, sys
described = json.load(open(sys.argv[1]))
for test in described.get("tests", []):
    name = test["name"]
    if not os.path.exists(os.path.join(sys.argv[2], name)):
        continue  # a script (example_cuda: gpu-check's training comparison) or an mpirun test
    props = {p["name"]: p["value"] for p in test.get("properties", [])}
    # A gpu test takes seconds; one that hangs is cut at 180 s unless it says otherwise.
    print(f"{name}\t{1 if props.get('RUN_SERIAL') else 0}\t{int(float(props.get('TIMEOUT', 180)))}")
PY
  rm -f "$stage/ctest.json"

  # The libraries: every shared object the programs load, but the C library's own (the
  # GPU machine has a glibc at least as new) and CUDA's (found there).
  local lib
  for lib in $(ldd "$stage"/bin/* "$stage"/tests/* 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u); do
    case "$(basename "$lib")" in
      ld-linux* | libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | libcuda.so* | libcudart.so* | \
        libcublas* | libnvidia* | libnccl*) ;;
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done

  # The token shards: this repository's text, the same on every machine.
  (cd "$root" && git ls-files -- README.md 'docs/*.md' 'include/*.hpp' 'kernels/*.cuh' 'examples/*' 'tests/*.cpp' |
    xargs cat) >"$stage/data/text.txt"
  LD_LIBRARY_PATH="$stage/lib" "$stage/bin/prepare_data" --out "$stage/data/text" "$stage/data/text.txt" \
    >"$stage/data/prepare.log" 2>&1 || { cat "$stage/data/prepare.log"; die "prepare_data failed"; }
  rm -f "$stage/data/text.txt"
}

# A hash of the sources the programs are built from (git or not: the GPU machine's copy
# of the tree may have no .git), so gpu-check can tell whether the pack is this tree's.
source_hash() {
  (cd "$root" && find include kernels examples tests benchmarks cmake CMakeLists.txt -type f \
    ! -name '*.pyc' -print0 2>/dev/null | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}

# llm.c's train_gpt2cu from a checkout at $LLMPAR_LLMC_DIR (never vendored): built in a
# copy, for sm_90, without MPI, NCCL, cuDNN or NVML (the build machine has no driver to
# link NVML against; it only reads the GPU's clocks), with its one CUDA-12-only call
# (cudaMemAdvise with a device id) moved to CUDA 13's cudaMemLocation form.
gpu_build_llmc() {
  local src="$1" stage="$2" work
  [[ -f "$src/train_gpt2.cu" ]] || die "LLMPAR_LLMC_DIR=$src holds no train_gpt2.cu (a checkout of llm.c)"
  work="$(mktemp -d)"
  cp -r "$src/." "$work/"
  sed -i -E 's/cudaMemAdvise\(([^,]+), ([^,]+), ([^,]+), cudaCpuDeviceId\)/cudaMemAdvise(\1, \2, \3, cudaMemLocation{cudaMemLocationTypeHost, 0})/' \
    "$work"/llmc/*.cuh "$work"/*.cu 2>/dev/null || true
  sed -i 's/__has_include(<nvml.h>)/0/' "$work"/llmc/*.h "$work"/llmc/*.cuh 2>/dev/null || true
  if ! (cd "$work" && PATH="$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"):$PATH" \
    make train_gpt2cu NO_MULTI_GPU=1 NO_USE_MPI=1 USE_CUDNN=0 GPU_COMPUTE_CAPABILITY=90 \
    NVCC_LDFLAGS="-lcublas -lcublasLt" >"$stage/llmc-build.log" 2>&1); then
    tail -20 "$stage/llmc-build.log"
    rm -rf "$work"
    die "building llm.c's train_gpt2cu from $src failed (log: $stage/llmc-build.log)"
  fi
  cp "$work/train_gpt2cu" "$stage/bin/" && strip "$stage/bin/train_gpt2cu"
  git -C "$src" rev-parse --short HEAD >"$stage/bin/train_gpt2cu.commit" 2>/dev/null || echo unknown >"$stage/bin/train_gpt2cu.commit"
  rm -rf "$work"
}

cmd_gpu_pack() {
  local arch=90a
  while (($# > 0)); do
    case "$1" in
      --arch) (($# >= 2)) || die "--arch needs CUDA architectures, e.g. --arch 90a or --arch '80;90a'"; arch="$2"; shift 2 ;;
      *) die "gpu-pack: unknown flag '$1' (flags: --arch ARCHS)" ;;
    esac
  done
  local start=$SECONDS dir="${LLMPAR_GPU_PACK_BUILD_DIR:-build-gpu-pack}"
  [[ "$dir" = /* ]] || dir="$root/$dir"
  ensure_packages
  mkdir -p "$dir"
  gpu_build "$dir" "$arch"
  local built=$((SECONDS - start))
  local stage="$dir/pack/llmpar-gpu-pack"
  gpu_stage "$dir" "$stage"
  [[ -z "${LLMPAR_LLMC_DIR:-}" ]] || gpu_build_llmc "$LLMPAR_LLMC_DIR" "$stage"
  {
    echo "commit $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "sources $(source_hash)"
    echo "dirty $(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null | wc -l) files"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
    echo "cuda_architectures $arch"
    echo "host_isa x86-64-v3"
    echo "nvcc $("$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | tail -1)"
    echo "glibc_needed $(objdump -T "$stage"/bin/* "$stage"/tests/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
    echo "llmc $(cat "$stage/bin/train_gpt2cu.commit" 2>/dev/null || echo none)"
    echo "build_seconds $built"
  } >"$stage/MANIFEST"
  mkdir -p "$(dirname "$LLMPAR_GPU_PACK")"
  tar -C "$(dirname "$stage")" -czf "$LLMPAR_GPU_PACK.tmp" "$(basename "$stage")"
  mv "$LLMPAR_GPU_PACK.tmp" "$LLMPAR_GPU_PACK"
  local mb=$(($(stat -c %s "$LLMPAR_GPU_PACK") / 1000000))
  if ((mb > LLMPAR_GPU_PACK_MAX_MB)); then
    du -ab "$stage" | sort -n | tail -8 >&2
    die "the pack is $mb MB, over the ${LLMPAR_GPU_PACK_MAX_MB} MB a device call carries comfortably; the largest files are above"
  fi
  echo "llmpar.sh: packed $(find "$stage" -type f | wc -l) files, $mb MB, in $((SECONDS - start)) s (build $built s):" \
    "${LLMPAR_GPU_PACK#"$root"/}; carry .gpu-pack to the GPU machine and run ./llmpar.sh gpu-check there"
}

# The folder holding a library whose file name matches $1 (a glob), on this machine:
# the loader's cache, the CUDA toolkit, then the Python packages (PyTorch's wheels).
find_library_dir() {
  local pattern="$1" dir found
  found="$(ldconfig -p 2>/dev/null | awk -v p="$pattern" '$1 ~ p { print $NF; exit }')"
  [[ -n "$found" ]] && { dirname "$found"; return 0; }
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64; do
    compgen -G "$dir/$pattern*" >/dev/null && { echo "$dir"; return 0; }
  done
  local python site
  for python in "${LLMPAR_TORCH_PYTHON:-}" python3 /usr/bin/python3; do
    if [[ -z "$python" ]] || ! command -v "$python" >/dev/null 2>&1; then continue; fi
    for site in $("$python" -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null); do
      for dir in "$site"/nvidia/cu13/lib "$site"/nvidia/*/lib; do
        compgen -G "$dir/$pattern*" >/dev/null && { echo "$dir"; return 0; }
      done
    done
  done
  return 1
}

# Runs "$@" in the background as job NAME: its output in $logs/NAME.log, its exit code
# and seconds in $logs/NAME.rc, at most $parallel at once.
start_job() {
  local name="$1"
  shift
  while (($(jobs -rp | wc -l) >= parallel)); do wait -n 2>/dev/null || true; done
  (
    local t0=$SECONDS rc=0
    "$@" >"$logs/$name.log" 2>&1 || rc=$?
    echo "$rc $((SECONDS - t0))" >"$logs/$name.rc"
  ) &
}

# The verdict of a finished job: ok (0), skip (77), timeout (124), FAIL otherwise.
job_verdict() {
  local rc seconds
  read -r rc seconds <"$logs/$1.rc" || { echo "FAIL ? no exit code"; return; }
  case "$rc" in
    0) echo "ok $seconds" ;;
    77) echo "skip $seconds" ;;
    124) echo "FAIL $seconds timed out" ;;
    *) echo "FAIL $seconds exit $rc" ;;
  esac
}

# The median of the "ms" of a train_gpt metrics file's steps after the first three.
median_step_ms() {
  grep '"type":"step"' "$1" | grep -o '"ms":[0-9.]*' | cut -d: -f2 | tail -n +4 | sort -g |
    awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'
}

cmd_gpu_check() {
  local sanitize=0 peers=1 out_dir="${OUT:-}" pack="$LLMPAR_GPU_PACK"
  while (($# > 0)); do
    case "$1" in
      --sanitize) sanitize=1; shift ;;
      --no-peers) peers=0; shift ;;
      --out) (($# >= 2)) || die "--out needs a folder"; out_dir="$2"; shift 2 ;;
      --pack) (($# >= 2)) || die "--pack needs the pack's .tar.gz"; pack="$2"; shift 2 ;;
      *) die "gpu-check: unknown flag '$1' (flags: --sanitize, --no-peers, --out DIR, --pack FILE)" ;;
    esac
  done
  local start=$SECONDS gdir="${LLMPAR_GPU_BUILD_DIR:-build-gpu}"
  [[ "$gdir" = /* ]] || gdir="$root/$gdir"
  [[ -n "$out_dir" ]] || out_dir="$gdir/gpu-check"
  local logs="$out_dir" summary=() failures=0 cores parallel
  mkdir -p "$logs"
  cores="$(nproc 2>/dev/null || echo 2)"
  note() {
    summary+=("$(printf '%-26s %-5s %s' "$1" "$2" "$3")")
    [[ "$2" == FAIL ]] && failures=$((failures + 1))
    return 0
  }
  elapsed() { echo "$((SECONDS - start)) s"; }

  # The GPU.
  local gpus=0 gpu_name="no GPU"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$logs/gpus.txt" 2>&1; then
    gpus=$(grep -c '^GPU' "$logs/gpus.txt" || true)
    gpu_name="$(head -1 "$logs/gpus.txt")"
    nvidia-smi >"$logs/nvidia-smi.txt" 2>&1 || true
  fi
  echo "gpu-check: $gpu_name; $cores host cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1))"

  # The programs: the pack's, or a build here when there is no pack.
  local packdir
  if [[ -f "$pack" ]]; then
    packdir="$gdir/pack"
    rm -rf "$packdir" && mkdir -p "$packdir"
    tar -C "$packdir" -xzf "$pack" || die "gpu-check: cannot unpack $pack"
    packdir="$packdir/llmpar-gpu-pack"
    cp "$packdir/MANIFEST" "$logs/MANIFEST"
    local commit sources
    commit="$(awk '$1 == "commit" { print $2 }' "$packdir/MANIFEST")"
    sources="$(awk '$1 == "sources" { print $2 }' "$packdir/MANIFEST")"
    if [[ "$sources" == "$(source_hash)" ]]; then
      note pack ok "${pack#"$root"/}: this tree's sources (commit ${commit:0:10}, $(awk '$1 == "dirty" { print $2 }' "$packdir/MANIFEST") files changed; $(elapsed))"
    else
      note pack warn "built from other sources than this tree's (commit ${commit:0:10}): rebuild it with ./llmpar.sh gpu-pack"
    fi
  else
    echo "gpu-check: no pack at ${pack#"$root"/}: building here (./llmpar.sh gpu-pack on a CPU machine saves this)"
    local arch=90a cap
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    [[ -n "$cap" && "$cap" != 90 ]] && arch="$cap"
    mkdir -p "$gdir"
    if ! gpu_build "$gdir" "$arch" >"$logs/build.log" 2>&1; then
      grep -E 'error|FAILED' "$logs/build.log" | head -20
      die "gpu-check: the build failed (log: $logs/build.log)"
    fi
    gpu_stage "$gdir" "$gdir/stage" >>"$logs/build.log" 2>&1
    packdir="$gdir/stage"
    note build ok "for sm_$arch here ($(elapsed))"
  fi

  # The loader's path: the pack's libraries, then CUDA's runtime and cuBLASLt.
  local libpath="$packdir/lib" needed dir
  for needed in 'libcudart.so.1[0-9]' 'libcublasLt.so.1[0-9]'; do
    if dir="$(find_library_dir "$needed")"; then
      [[ ":$libpath:" == *":$dir:"* ]] || libpath="$libpath:$dir"
    else
      note libraries FAIL "no ${needed%%.so*} on this machine (not in ldconfig, /usr/local/cuda or a Python nvidia/ wheel)"
    fi
  done
  export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "export LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >"$logs/env.sh"
  local bin="$packdir/bin" tests="$packdir/tests" data="$packdir/data"

  # 1. The gpu tests, several at once (2 OpenMP threads each, for their CPU references),
  # and the training comparison beside them.
  parallel=$((cores / 2 > 1 ? cores / 2 : 1))
  local name alone timeout alone_tests=()
  while IFS=$'\t' read -r name alone timeout; do
    if ((alone)); then alone_tests+=("$name $timeout"); continue; fi
    start_job "$name" env OMP_NUM_THREADS=2 timeout "$timeout" "$tests/$name"
  done <"$tests/tests.tsv"
  # train_gpt on both backends, per precision (same data, seed and flags). Tolerances
  # per step, relative: the same storage format on both backends, but GEMMs and
  # reductions sum in different orders, so 16-bit roundings differ in the last bit and
  # the differences grow over the steps: fp32 1e-4, fp16 (11 significant bits) 5e-3,
  # bf16 (8) 2e-2. ZeRO 3 on the GPU against its ZeRO 0: the same arithmetic, 1e-5.
  local common=(--data "$data/text_train.bin" --steps 10 --warmup 2 --batch 8 --seq 64 --eval-every 0
    --sample-tokens 0 --no-shuffle --peak-gflops 1)
  local precision
  for precision in fp32 bf16 fp16; do
    start_job "cpu_$precision" env OMP_NUM_THREADS=2 timeout 120 "$bin/train_gpt" "${common[@]}" \
      --precision "$precision" --metrics "$logs/cpu_$precision.jsonl"
    ((gpus > 0)) || continue
    start_job "gpu_$precision" timeout 120 "$bin/train_gpt" "${common[@]}" --backend cuda \
      --precision "$precision" --metrics "$logs/gpu_$precision.jsonl"
  done
  ((gpus == 0)) || start_job gpu_zero3 timeout 120 "$bin/train_gpt" "${common[@]}" --backend cuda --zero 3 \
    --metrics "$logs/gpu_zero3.jsonl"
  wait
  parallel=1
  local entry
  for entry in "${alone_tests[@]}"; do
    read -r name timeout <<<"$entry"
    start_job "$name" env OMP_NUM_THREADS="$cores" timeout "$timeout" "$tests/$name"
    wait
  done
  local verdict detail
  while IFS=$'\t' read -r name alone timeout; do
    read -r -a verdict <<<"$(job_verdict "$name")"
    if [[ "${verdict[0]}" == FAIL ]]; then
      detail="$(grep -c '^FAILED' "$logs/$name.log" || true) FAILED lines, the first: $(grep -m1 '^FAILED' "$logs/$name.log" | cut -c9-100)"
    else
      detail="$(tail -1 "$logs/$name.log" | cut -c1-90)"
    fi
    ((alone)) && verdict[1]="${verdict[1]} s alone" || verdict[1]="${verdict[1]} s"
    note "$name" "${verdict[0]}" "${verdict[*]:1}; $detail"
  done <"$tests/tests.tsv"
  compare_losses() {  # compare_losses LABEL A.jsonl B.jsonl TOL
    paste <(grep -o '"loss":[^,}]*' "$2" | cut -d: -f2) <(grep -o '"loss":[^,}]*' "$3" | cut -d: -f2) |
      awk -v tol="$4" '{ d = ($2 - $1) / $1; if (d < 0) d = -d; if (d > worst) worst = d; a = $1; b = $2 }
        END { printf "%s %d steps, last loss %.4f and %.4f, worst step %.1e (tol %s)\n",
              (NR == 10 && worst <= tol) ? "ok" : "FAIL", NR, a, b, worst, tol }'
  }
  local tol v
  for precision in fp32 bf16 fp16 zero3; do
    case "$precision" in fp32) tol=1e-4 ;; fp16) tol=5e-3 ;; bf16) tol=2e-2 ;; zero3) tol=1e-5 ;; esac
    local reference="cpu_$precision"
    [[ "$precision" == zero3 ]] && reference=gpu_fp32
    if ((gpus == 0)); then
      [[ "$precision" == zero3 ]] || note "train $precision" skip "no GPU; the CPU run: $(job_verdict "$reference")"
      continue
    fi
    read -r -a v <<<"$(job_verdict "gpu_$precision")"
    if [[ "${v[0]}" != ok ]]; then
      note "train $precision" FAIL "the CUDA run: ${v[*]}; $(tail -1 "$logs/gpu_$precision.log" | cut -c1-100)"
      continue
    fi
    read -r -a v <<<"$(job_verdict "$reference")"
    [[ "${v[0]}" == ok ]] || { note "train $precision" FAIL "the reference run $reference: ${v[*]}"; continue; }
    local result
    result="$(compare_losses "$precision" "$logs/$reference.jsonl" "$logs/gpu_$precision.jsonl" "$tol")"
    note "train $precision" "${result%% *}" "vs ${reference/_/ }: ${result#* }"
  done
  echo "gpu-check: tests and training comparison done ($(elapsed))"

  # 2. The kernel benchmarks, alone on the GPU.
  if ((gpus == 0)); then
    note bench_cuda_kernels skip "no GPU"
  elif timeout 150 "$bin/bench_cuda_kernels" --benchmark_min_time=0.05 >"$logs/bench_cuda_kernels.txt" 2>&1; then
    note bench_cuda_kernels ok "$(grep -c 'manual_time' "$logs/bench_cuda_kernels.txt" || true) kernels ($(elapsed)); table below"
  else
    note bench_cuda_kernels FAIL "$(tail -1 "$logs/bench_cuda_kernels.txt" | cut -c1-100)"
  fi

  # 3. GPT-2 124M, one step, side by side.
  local peer_rows=()
  if ((peers && gpus > 0)); then
    gpu_peers
  fi

  # 4. compute-sanitizer over the kernels' tests.
  if ((sanitize && gpus > 0)); then
    local sanitizer tool
    sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    if [[ -x "$sanitizer" ]]; then
      parallel=$((cores / 2 > 1 ? cores / 2 : 1))
      for tool in memcheck racecheck; do
        for name in "${LLMPAR_GPU_KERNEL_TESTS[@]}"; do
          [[ -x "$tests/$name" ]] || continue
          start_job "${tool}_$name" env OMP_NUM_THREADS=2 timeout 240 \
            "$sanitizer" --tool "$tool" --error-exitcode 3 "$tests/$name"
        done
      done
      wait
      for tool in memcheck racecheck; do
        for name in "${LLMPAR_GPU_KERNEL_TESTS[@]}"; do
          [[ -f "$logs/${tool}_$name.rc" ]] || continue
          read -r -a v <<<"$(job_verdict "${tool}_$name")"
          note "$tool $name" "${v[0]}" "${v[1]} s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/${tool}_$name.log" | tail -1)"
        done
      done
    else
      note sanitize FAIL "no compute-sanitizer on PATH or in /usr/local/cuda/bin"
    fi
  fi

  echo
  echo "gpu-check summary ($(elapsed); $gpu_name; logs in $logs):"
  printf '  %s\n' "${summary[@]}"
  if [[ -s "$logs/bench_cuda_kernels.txt" ]]; then
    echo "  kernel benchmarks (bench_cuda_kernels):"
    grep -E 'manual_time' "$logs/bench_cuda_kernels.txt" | sed 's/^/    /' | cut -c1-160
  fi
  if ((${#peer_rows[@]} > 0)); then
    echo "  GPT-2 124M, B 16, T 1024, bf16, one training step (median ms of each run's steps after 3; A B A B):"
    printf '    %s\n' "${peer_rows[@]}"
  fi
  ((failures == 0)) || die "gpu-check: $failures check(s) failed"
}

# GPT-2 124M side by side: llmpar, PyTorch eager and compiled, llm.c (when packed), each
# run twice, alternated, alone on the GPU. Appends to peer_rows and summary.
gpu_peers() {
  local steps=13 round ms names=()
  local torch_python="${LLMPAR_TORCH_PYTHON:-python3}"
  names+=(llmpar)
  if "$torch_python" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    names+=(pytorch-eager pytorch-compile)
  else
    note "peers: pytorch" skip "$torch_python does not import a torch that sees the GPU (set LLMPAR_TORCH_PYTHON)"
  fi
  [[ -x "$bin/train_gpt2cu" ]] && names+=(llm.c)
  local -A times=()
  for round in 1 2; do
    for name in "${names[@]}"; do
      local log="$logs/peer_${name}_$round.log"
      case "$name" in
        llmpar)
          timeout 120 "$bin/train_gpt" --model gpt2-124m --batch 16 --seq 1024 --backend cuda --precision bf16 \
            --data "$data/text_train.bin" --steps "$steps" --eval-every 0 --sample-tokens 0 \
            --metrics "$logs/peer_llmpar_$round.jsonl" >"$log" 2>&1 &&
            ms="$(median_step_ms "$logs/peer_llmpar_$round.jsonl")" || ms=""
          ;;
        pytorch-eager | pytorch-compile)
          local flags=(--device cuda --batch 16 --seq 1024 --precision bf16 --steps 10 --warmup 3)
          [[ "$name" == pytorch-compile ]] && flags+=(--compile)
          TORCHINDUCTOR_CACHE_DIR="$logs/inductor-cache" timeout 240 "$torch_python" \
            "$root/benchmarks/pytorch_step.py" "${flags[@]}" >"$log" 2>&1 &&
            ms="$(grep -o 'median [0-9.]* ms' "$log" | awk '{ print $2 }')" || ms=""
          ;;
        llm.c)
          timeout 120 "$bin/train_gpt2cu" -i "$data/text_train.bin" -j "$data/text_val.bin" -e d12 -b 16 -t 1024 \
            -x "$steps" -v 1000 -s 0 -h 0 >"$log" 2>&1 &&
            ms="$(grep -E '^step +[0-9]+/' "$log" | tail -n +4 | grep -o '| *[0-9.]* ms' | tr -d '| ms' | sort -g |
              awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }')" || ms=""
          ;;
      esac
      times[$name]="${times[$name]:-} ${ms:-x}"
    done
  done
  local base="" row
  for name in "${names[@]}"; do
    local vals
    read -r -a vals <<<"${times[$name]}"
    if [[ " ${vals[*]} " == *" x "* ]]; then
      note "peers: $name" FAIL "a run failed: $logs/peer_${name}_*.log"
      continue
    fi
    # The mean of the two runs' medians; the ratio is tokens/s against llmpar's.
    local mean
    mean="$(awk -v a="${vals[0]}" -v b="${vals[1]}" 'BEGIN { print (a + b) / 2 }')"
    [[ "$name" == llmpar ]] && base="$mean"
    row="$(awk -v n="$name" -v a="${vals[0]}" -v b="${vals[1]}" -v m="$mean" -v base="$base" 'BEGIN {
      printf "%-16s %7.1f %7.1f ms/step  %9.0f tokens/s", n, a, b, 16 * 1024 / m * 1000
      if (base != "" && n != "llmpar") printf "  %.2fx llmpar", base / m
    }')"
    peer_rows+=("$row")
  done
  note "peers: gpt2-124m" ok "${#names[@]} trainers, 2 rounds ($(elapsed)); table below"
}
