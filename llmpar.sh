#!/usr/bin/env bash
# llmpar.sh — one entry point for building and using llmpar on Debian/Ubuntu.
#
#   ./llmpar.sh train [train_gpt flags...]   build, then run build/examples/train_gpt
#                                            (--np N: as N MPI processes, through mpirun)
#   ./llmpar.sh test  [ctest args...]        build everything, run the whole test suite
#   ./llmpar.sh bench [benchmark args...]    build, run every benchmarks/bench_* program
#                                            (and benchmarks/pytorch_step.py if torch is there)
#   ./llmpar.sh build [cmake --build args]   configure and build (everything by default)
#   ./llmpar.sh install PREFIX               build, then install headers and package config
#   ./llmpar.sh plot METRICS.jsonl [--out PNG] [--title TEXT]
#                                            draw a train_gpt --metrics file: train and validation
#                                            loss against steps and tokens, rollbacks, resumes and
#                                            skipped steps marked (default out: METRICS.png)
#   ./llmpar.sh plan [llmpar-plan flags...]  build, then predict memory per rank and step time of
#                                            layouts (--model M --cluster h200x8x4 --global-batch G
#                                            ranks every valid layout; --calibrate cpu.json measures
#                                            this machine; --validate compares with train_gpt runs)
#   ./llmpar.sh scaling [llmpar-scaling flags...]
#                                            build, prepare data/docs_*.bin (the Debian documentation
#                                            corpus), fit scaling laws to a sweep of small runs, train
#                                            a 10x larger model against the prediction, plot it
#                                            (OUT/scaling.png; about 3 hours on 2 cores; --budget B)
#   ./llmpar.sh gpu-check                    on a machine with an NVIDIA GPU, in at most 8 minutes:
#                                            build for that GPU only, ctest -L gpu, the CUDA kernel
#                                            benchmarks, train_gpt --backend cuda in fp32, bf16 and
#                                            fp16 against the CPU backend; one summary table
#   ./llmpar.sh gpu-bundle                   download the Debian packages gpu-check needs into
#                                            .gpu-bundle/, for a GPU machine that has the CUDA
#                                            toolkit but no package registry (carry .gpu-bundle)
#
# Each command first makes sure the Debian packages below are installed (it installs
# the missing ones when run as root, and prints the command otherwise), then configures
# (Ninja, Release, warnings as errors) and builds incrementally; plot builds nothing.
#
# Environment:
#   LLMPAR_BUILD_DIR    build directory (default: build, relative to this script's folder)
#   LLMPAR_JOBS         parallel compile and test jobs (default: number of CPUs)
#   LLMPAR_CMAKE_ARGS   extra arguments for the first configure, e.g. "-DLLMPAR_CUDA=OFF"
#   LLMPAR_GPU_BUILD_DIR  gpu-check's build directory (default: build-gpu)
#   LLMPAR_TOOLS_VENV   the Python venv of the tests' tools, with safetensors
#                       (default: ~/.cache/llmpar/tools-venv)
set -euo pipefail

# The Debian packages the build needs: the one list (CMake finds them; nothing is
# downloaded at build time). Python with matplotlib and numpy for tools/ (plot, the tests
# that read llmpar's files from Python), and venv for the tools' venv.
LLMPAR_PACKAGES=(
  cmake g++ ninja-build
  libdnnl-dev ocl-icd-opencl-dev nlohmann-json3-dev libcli11-dev doctest-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin
  fortunes
  # The documentation corpus (prepare_data --corpus docs, data/docs.hpp): 31 MB of
  # English prose from the kernel, Python, Perl and LLVM manuals, for scaling-law sweeps.
  linux-doc-6.1 python3.11-doc perl-doc llvm-15-doc
  python3-matplotlib python3-numpy python3-venv
)

# What gpu-check needs besides the CUDA toolkit, CMake, Ninja and a C++ compiler: the
# libraries of the build (a GPU machine's image may have none of them, and no registry).
# The CUDA backend without NCCL and MPI trains on one GPU, so those are not needed.
LLMPAR_GPU_BUNDLE_PACKAGES=(
  libdnnl2 libdnnl-dev ocl-icd-libopencl1 ocl-icd-opencl-dev opencl-c-headers opencl-clhpp-headers
  nlohmann-json3-dev libcli11-dev doctest-dev libbenchmark1debian libbenchmark-dev
)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build_dir="${LLMPAR_BUILD_DIR:-build}"
[[ "$build_dir" = /* ]] || build_dir="$root/$build_dir"
jobs="${LLMPAR_JOBS:-$(nproc 2>/dev/null || echo 2)}"

die() {
  echo "llmpar.sh: $*" >&2
  exit 1
}

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}

ensure_packages() {
  if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "llmpar.sh: not a Debian system; make sure these (or their equivalents) are installed:" \
      "${LLMPAR_PACKAGES[*]}" >&2
    return 0
  fi
  local missing=() package
  for package in "${LLMPAR_PACKAGES[@]}"; do
    if [[ "$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null)" != installed ]]; then
      missing+=("$package")
    fi
  done
  ((${#missing[@]} == 0)) && return 0

  local install=(apt-get install -y --no-install-recommends "${missing[@]}")
  if ((EUID != 0)); then
    echo "llmpar.sh: missing Debian packages: ${missing[*]}" >&2
    echo "llmpar.sh: install them with:" >&2
    echo "  sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive ${install[*]}" >&2
    exit 1
  fi
  echo "llmpar.sh: installing missing Debian packages: ${missing[*]}"
  apt-get update
  DEBIAN_FRONTEND=noninteractive "${install[@]}"
}

configure() {
  local args=(-S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DLLMPAR_WERROR=ON)
  if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
    args+=(-G Ninja)
    # Compile CUDA code for the GPUs of this machine, where there are any (otherwise
    # CMake's default architecture: the code still builds, and GPU tests skip).
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      args+=(-DCMAKE_CUDA_ARCHITECTURES=native)
    fi
    if [[ -n "${LLMPAR_CMAKE_ARGS:-}" ]]; then
      local extra
      read -r -a extra <<<"$LLMPAR_CMAKE_ARGS"
      args+=("${extra[@]}")
    fi
  fi
  cmake "${args[@]}"
}

build() {
  cmake --build "$build_dir" --parallel "$jobs" "$@"
}

setup() {
  ensure_packages
  configure
}

# Debian's python3-* packages are installed for /usr/bin/python3; a python3 earlier on
# PATH (pyenv, an activated venv) may not see them.
system_python() {
  if [[ -x /usr/bin/python3 ]]; then
    echo /usr/bin/python3
  else
    command -v python3 || die "no python3 on PATH (Debian: python3)"
  fi
}

# The Python of the tools that read llmpar's files: a venv over Debian's python3 that
# sees its packages (numpy) and adds safetensors from PyPI, which Debian 12 does not
# package. Exports LLMPAR_TOOLS_PYTHON where that works; offline (no PyPI) it warns and
# returns 0, and the tests that need it skip.
ensure_python_tools() {
  local venv="${LLMPAR_TOOLS_VENV:-$HOME/.cache/llmpar/tools-venv}" base
  local python="$venv/bin/python"
  base="$(system_python)"
  if [[ ! -x "$python" ]]; then
    if ! mkdir -p "$(dirname "$venv")" || ! "$base" -m venv --system-site-packages "$venv"; then
      echo "llmpar.sh: warning: cannot create the tools venv $venv with $base (Debian: python3-venv);" \
        "the tests that read safetensors from Python will skip" >&2
      return 0
    fi
  fi
  if ! "$python" -c 'import safetensors, numpy' >/dev/null 2>&1; then
    echo "llmpar.sh: installing safetensors into $venv"
    if ! "$python" -m pip install --quiet --disable-pip-version-check --retries 1 --timeout 20 safetensors ||
      ! "$python" -c 'import safetensors, numpy' >/dev/null 2>&1; then
      echo "llmpar.sh: warning: no safetensors in $venv (is PyPI reachable?);" \
        "the tests that read safetensors from Python will skip" >&2
      return 0
    fi
  fi
  export LLMPAR_TOOLS_PYTHON="$python"
}

cmd_train() {
  [[ -f "$root/examples/train_gpt.cpp" ]] || die "examples/train_gpt.cpp does not exist: nothing to train with"
  # --np N runs N processes under mpirun; the other flags go to train_gpt.
  local np="" args=()
  while (($# > 0)); do
    case "$1" in
      --np) (($# >= 2)) || die "--np needs a number of processes, e.g. --np 2"; np="$2"; shift 2 ;;
      --np=*) np="${1#--np=}"; shift ;;
      *) args+=("$1"); shift ;;
    esac
  done
  [[ -z "$np" || "$np" =~ ^[1-9][0-9]*$ ]] || die "--np $np is not a number of processes; use e.g. --np 2"
  setup
  build --target train_gpt
  local binary="$build_dir/examples/train_gpt"
  [[ -x "$binary" ]] || die "$binary was not built (is LLMPAR_BUILD_EXAMPLES off?)"
  if [[ -z "$np" ]]; then
    exec "$binary" "${args[@]}"
  fi
  command -v mpirun >/dev/null 2>&1 || die "--np needs mpirun (Debian: openmpi-bin)"
  mpi_environment "$np"
  exec mpirun -np "$np" "$binary" "${args[@]}"
}

# Open MPI refuses to run as root, or more processes than cores, unless told: the
# scripts tell it (users' code never has to), and each process gets its share of cores.
mpi_environment() {
  local np="$1" cores
  cores="$(nproc 2>/dev/null || echo 1)"
  if ((EUID == 0)); then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  if ((np > cores)); then
    export OMPI_MCA_rmaps_base_oversubscribe=1
  fi
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(((cores / np) > 0 ? cores / np : 1))}"
}

cmd_test() {
  setup
  ensure_python_tools  # the safetensors cross-test reads $LLMPAR_TOOLS_PYTHON
  build
  ctest --test-dir "$build_dir" --output-on-failure --no-tests=error --parallel "$jobs" "$@"
}

cmd_bench() {
  setup
  build
  local failed=() bench ran=0
  for bench in "$build_dir"/benchmarks/bench_*; do
    [[ -f "$bench" && -x "$bench" ]] || continue
    ran=1
    echo "==> ${bench#"$root"/} $*"
    "$bench" "$@" || failed+=("$(basename "$bench")")
  done
  ((ran)) || die "no benchmark programs in $build_dir/benchmarks (is LLMPAR_BUILD_BENCHMARKS off?)"
  # Data parallelism across 2 MPI processes too (the thread-rank run is above).
  if [[ -x "$build_dir/benchmarks/bench_data_parallel" ]] && command -v mpirun >/dev/null 2>&1; then
    echo "==> mpirun -np 2 benchmarks/bench_data_parallel $*"
    OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
      mpirun -np 2 "$build_dir/benchmarks/bench_data_parallel" "$@" || failed+=("bench_data_parallel (mpirun)")
  fi
  local script="$root/benchmarks/pytorch_step.py"
  if [[ -f "$script" ]]; then
    # PyTorch: $LLMPAR_TORCH_PYTHON, else the venv from benchmarks/pytorch_venv.sh, else
    # /usr/bin/python3 (Debian's python3-torch).
    local torch_python="${LLMPAR_TORCH_PYTHON:-}"
    local torch_venv_python="${LLMPAR_TORCH_VENV:-$HOME/.cache/llmpar/torch-venv}/bin/python"
    if [[ -z "$torch_python" ]]; then
      if [[ -x "$torch_venv_python" ]] && "$torch_venv_python" -c 'import torch' >/dev/null 2>&1; then
        torch_python="$torch_venv_python"
      elif [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import torch' >/dev/null 2>&1; then
        torch_python=/usr/bin/python3
      fi
    fi
    if [[ -n "$torch_python" ]]; then
      echo "==> benchmarks/pytorch_step.py ($torch_python)"
      OMP_WAIT_POLICY=PASSIVE "$torch_python" "$script" || failed+=(pytorch_step.py)
    else
      echo "==> benchmarks/pytorch_step.py skipped: no python that imports torch" \
        "(set it up with: bash benchmarks/pytorch_venv.sh, or set LLMPAR_TORCH_PYTHON)"
    fi
  fi
  ((${#failed[@]} == 0)) || die "benchmarks failed: ${failed[*]}"
}

cmd_build() {
  setup
  build "$@"
}

cmd_install() {
  (($# == 1)) || die "usage: ./llmpar.sh install PREFIX"
  setup
  build
  cmake --install "$build_dir" --prefix "$1"
}

# Reads a metrics file; needs matplotlib, not a build.
cmd_plot() {
  (($# > 0)) || die "usage: ./llmpar.sh plot METRICS.jsonl [--out loss.png] [--title TEXT]"
  ensure_packages
  local python
  python="$(system_python)"
  exec "$python" "$root/tools/plot_metrics.py" "$@"
}

# llmpar-plan: memory and step time of layouts, before a run (plan/cost.hpp).
cmd_plan() {
  setup
  build --target llmpar_plan train_gpt
  exec "$build_dir/examples/llmpar-plan" "$@"
}

# llmpar-scaling: the scaling-law sweep on the documentation corpus (prepared into
# data/docs_*.bin when missing), its report, and the plot (tools/plot_scaling.py).
cmd_scaling() {
  local out=scaling args=("$@") i
  for ((i = 0; i < ${#args[@]}; ++i)); do
    [[ "${args[i]}" == --out ]] && ((i + 1 < ${#args[@]})) && out="${args[i + 1]}"
    [[ "${args[i]}" == --out=* ]] && out="${args[i]#--out=}"
  done
  setup
  build --target llmpar_scaling train_gpt prepare_data
  local data="$root/data/docs_train.bin"
  if [[ ! -f "$data" ]]; then
    mkdir -p "$root/data"
    "$build_dir/examples/prepare_data" --out "$root/data/docs" --corpus docs
  fi
  "$build_dir/examples/llmpar-scaling" --data "$data" "$@"
  if "$(system_python)" -c 'import matplotlib' >/dev/null 2>&1; then
    "$(system_python)" "$root/tools/plot_scaling.py" "$out/scaling.json" --out "$out/scaling.png"
  fi
}

# ---- gpu-check ----------------------------------------------------------------------
# The first thing a machine with a GPU runs. No CUDA line of llmpar had run before it,
# so it checks everything a GPU can, in an order that keeps going after a failure and
# reports it, within 8 minutes on a 16-core host: build (this GPU's architecture only),
# the gpu tests, the kernel benchmarks with their fraction of peak, and a short training
# run per precision on both backends with the losses compared.

# Where gpu-check's dependencies come from: the system (Debian with the packages), or
# the Debian packages of .gpu-bundle/ unpacked into the build directory. Prints the
# CMake prefix to use (empty for the system).
gpu_dependencies() {
  local bundle="$root/.gpu-bundle" prefix="$1/deps" missing=() package
  if command -v dpkg-query >/dev/null 2>&1; then
    for package in "${LLMPAR_GPU_BUNDLE_PACKAGES[@]}"; do
      [[ "$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null)" == installed ]] || missing+=("$package")
    done
  else
    missing=("${LLMPAR_GPU_BUNDLE_PACKAGES[@]}")
  fi
  ((${#missing[@]} == 0)) && return 0
  compgen -G "$bundle/*.deb" >/dev/null ||
    die "gpu-check: missing ${missing[*]}, and no .gpu-bundle/*.deb to take them from; run ./llmpar.sh gpu-bundle on a" \
      "Debian 12 machine with its package registry, and carry .gpu-bundle to this one"
  if [[ ! -f "$prefix/.unpacked" ]]; then
    rm -rf "$prefix" && mkdir -p "$prefix"
    local deb
    for deb in "$bundle"/*.deb; do
      if command -v dpkg-deb >/dev/null 2>&1; then
        dpkg-deb -x "$deb" "$prefix"
      else  # an ar archive holding data.tar.*: read it with Python's standard library
        python3 - "$deb" "$prefix" <<'PY'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n", sys.argv[1] + " is not a Debian package"
i = 8
while i < len(data):
    name, size = data[i:i + 16].decode().strip().rstrip("/"), int(data[i + 48:i + 58].decode())
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(data[i + 60:i + 60 + size])).extractall(sys.argv[2])
    i += 60 + size + (size & 1)
PY
      fi
    done
    touch "$prefix/.unpacked"
  fi
  echo "$prefix/usr"
}

cmd_gpu_bundle() {
  command -v apt-get >/dev/null 2>&1 || die "gpu-bundle downloads Debian packages: run it on Debian 12 (apt-get)"
  local bundle="$root/.gpu-bundle"
  mkdir -p "$bundle"
  local sandbox=()
  ((EUID == 0)) && sandbox=(-o APT::Sandbox::User=root)  # root downloads into a folder _apt may not write
  (cd "$bundle" && apt-get "${sandbox[@]}" download "${LLMPAR_GPU_BUNDLE_PACKAGES[@]}")
  echo "llmpar.sh: $(ls "$bundle"/*.deb | wc -l) packages, $(du -sh "$bundle" | cut -f1), in $bundle:" \
    "carry .gpu-bundle to the GPU machine and run ./llmpar.sh gpu-check there"
}

cmd_gpu_check() {
  local start=$SECONDS gdir="${LLMPAR_GPU_BUILD_DIR:-build-gpu}"
  [[ "$gdir" = /* ]] || gdir="$root/$gdir"
  local out="$gdir/gpu-check" summary=() failures=0
  mkdir -p "$out"
  note() { summary+=("$(printf '%-22s %-6s %s' "$1" "$2" "$3")"); [[ "$2" == FAIL ]] && failures=$((failures + 1)); return 0; }
  elapsed() { echo "$((SECONDS - start)) s"; }

  # The GPU, and the architecture to build for: sm_90a on Hopper, the GPU's own otherwise.
  local gpus=0 arch=90a cap=""
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$out/gpus.txt" 2>&1; then
    gpus=$(grep -c '^GPU' "$out/gpus.txt" || true)
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    [[ -n "$cap" && "$cap" != 90 ]] && arch="$cap"
    echo "gpu-check: $(head -1 "$out/gpus.txt"), building for sm_$arch"
  else
    echo "gpu-check: no GPU visible (nvidia-smi -L failed): building for sm_$arch; the GPU steps will report skipped"
  fi
  command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]] ||
    die "gpu-check: no nvcc on PATH or in /usr/local/cuda/bin: install the CUDA toolkit"
  local nvcc; nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"

  # Configure and build the GPU targets only.
  local prefix args=()
  prefix="$(gpu_dependencies "$gdir")"
  if [[ -n "$prefix" ]]; then
    args+=("-DCMAKE_PREFIX_PATH=$prefix")
    # libdnnl's own dependency (libOpenCL) is found through this, not the executables' RUNPATH.
    export LD_LIBRARY_PATH="$prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  # One GPU: NCCL has nothing to carry (its tests need two), and the CUDA backend without
  # it trains on one GPU with no MPI; with several, NCCL and MPI are used where found.
  ((gpus >= 2)) || args+=(-DLLMPAR_MPI=OFF -DLLMPAR_NCCL=OFF)
  local gen=()
  if [[ ! -f "$gdir/CMakeCache.txt" ]]; then
    if command -v ninja >/dev/null 2>&1; then
      gen=(-G Ninja)
    else
      command -v make >/dev/null 2>&1 || die "gpu-check: neither ninja nor make is on PATH; install one (pip install ninja)"
    fi
  fi
  if ! cmake -S "$root" -B "$gdir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DLLMPAR_WERROR=ON -DLLMPAR_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$arch" "${args[@]}" >"$out/configure.log" 2>&1; then
    tail -30 "$out/configure.log"
    die "gpu-check: configure failed (full log: $out/configure.log)"
  fi
  local targets=(train_gpt prepare_data bench_cuda_kernels) source
  for source in "$root"/tests/cuda/test_*.cu; do targets+=("$(basename "$source" .cu)"); done
  if cmake --build "$gdir" --parallel "$jobs" --target "${targets[@]}" >"$out/build.log" 2>&1; then
    note build ok "${#targets[@]} targets for sm_$arch ($(elapsed))"
  else
    grep -E 'error|FAILED' "$out/build.log" | head -20
    note build FAIL "see $out/build.log"
    printf '%s\n' "${summary[@]}"
    die "gpu-check: the build failed"
  fi

  # The gpu tests (example_cuda is the training comparison below, with figures).
  if (cd "$gdir" && timeout 240 ctest -L gpu -E '^example_cuda$' --output-on-failure >"$out/ctest.log" 2>&1); then
    note "ctest -L gpu" ok "$(grep -E 'tests passed' "$out/ctest.log" | tail -1) ($(elapsed))"
  else
    grep -E 'Failed|\*\*\*|FAILED' "$out/ctest.log" | head -20
    note "ctest -L gpu" FAIL "$(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1); $out/ctest.log"
  fi
  grep -E 'Skipped|Not Run' "$out/ctest.log" | sed 's/^ */    /' | head -20 || true

  # The CUDA kernel benchmarks, with their fraction of the device's peak.
  if timeout 150 "$gdir/benchmarks/bench_cuda_kernels" --benchmark_min_time=0.05 >"$out/bench.txt" 2>&1; then
    note bench_cuda_kernels ok "$(grep -c '/' "$out/bench.txt" || true) lines ($(elapsed)); table below"
  else
    tail -5 "$out/bench.txt"
    note bench_cuda_kernels FAIL "$out/bench.txt"
  fi

  # train_gpt on the GPU against the CPU backend, per precision (same data, seed and
  # flags). Tolerances per step, relative: the same storage format on both backends,
  # but GEMMs and reductions sum in different orders, so 16-bit roundings differ in the
  # last bit and the differences grow over the steps: fp32 1e-4, fp16 (11 significant
  # bits) 5e-3, bf16 (8) 2e-2.
  sed -n '1,400p' "$root/README.md" "$root"/docs/*.md >"$out/text.txt"
  "$gdir/examples/prepare_data" --out "$out/text" "$out/text.txt" >"$out/prepare.log" 2>&1 ||
    die "gpu-check: prepare_data failed ($out/prepare.log)"
  local common=(--data "$out/text_train.bin" --steps 10 --warmup 2 --batch 8 --seq 64 --eval-every 0
    --sample-tokens 0 --no-shuffle)
  local precision tol
  for precision in fp32 bf16 fp16; do
    case "$precision" in fp32) tol=1e-4 ;; fp16) tol=5e-3 ;; bf16) tol=2e-2 ;; esac
    OMP_NUM_THREADS="$jobs" "$gdir/examples/train_gpt" "${common[@]}" --precision "$precision" --peak-gflops 1 \
      --metrics "$out/cpu_$precision.jsonl" >"$out/cpu_$precision.txt" 2>&1 ||
      { note "train $precision" FAIL "the CPU run failed: $out/cpu_$precision.txt"; continue; }
    if ((gpus == 0)); then
      note "train $precision" skip "no GPU (the CPU run passed)"
      continue
    fi
    if ! "$gdir/examples/train_gpt" "${common[@]}" --backend cuda --precision "$precision" \
      --metrics "$out/gpu_$precision.jsonl" >"$out/gpu_$precision.txt" 2>&1; then
      tail -3 "$out/gpu_$precision.txt"
      note "train $precision" FAIL "the CUDA run failed: $out/gpu_$precision.txt"
      continue
    fi
    local verdict
    verdict=$(paste <(grep -o '"loss":[^,}]*' "$out/cpu_$precision.jsonl" | cut -d: -f2) \
      <(grep -o '"loss":[^,}]*' "$out/gpu_$precision.jsonl" | cut -d: -f2) \
      <(grep -o '"ms":[^,}]*' "$out/gpu_$precision.jsonl" | cut -d: -f2) | awk -v tol="$tol" '
        { d = ($2 - $1) / $1; if (d < 0) d = -d; if (d > worst) worst = d; if (NR > 2) { ms += $3; n++ } last_cpu = $1; last_gpu = $2 }
        END { printf "%s: 10 steps, last loss cpu %.4f gpu %.4f, worst step %.1e (tol %s), %.1f ms/step gpu",
              (NR == 10 && worst <= tol) ? "ok" : "FAIL", last_cpu, last_gpu, worst, tol, n ? ms / n : 0 }')
    note "train $precision" "${verdict%%:*}" "${verdict#*: }"
  done
  # ZeRO 3 on the GPU (shards, pooled gradients, gathered layers in device memory)
  # against the fp32 run's losses: one GPU does the same arithmetic, so 1e-5.
  if ((gpus > 0)) && [[ -s "$out/gpu_fp32.jsonl" ]]; then
    if "$gdir/examples/train_gpt" "${common[@]}" --backend cuda --zero 3 --metrics "$out/gpu_zero3.jsonl" \
      >"$out/gpu_zero3.txt" 2>&1; then
      local zverdict
      zverdict=$(paste <(grep -o '"loss":[^,}]*' "$out/gpu_fp32.jsonl" | cut -d: -f2) \
        <(grep -o '"loss":[^,}]*' "$out/gpu_zero3.jsonl" | cut -d: -f2) | awk '
          { d = ($2 - $1) / $1; if (d < 0) d = -d; if (d > worst) worst = d }
          END { printf "%s: 10 steps, worst step %.1e against ZeRO 0 (tol 1e-5)", (NR == 10 && worst <= 1e-5) ? "ok" : "FAIL", worst }')
      note "train zero3" "${zverdict%%:*}" "${zverdict#*: }"
    else
      tail -3 "$out/gpu_zero3.txt"
      note "train zero3" FAIL "the CUDA ZeRO 3 run failed: $out/gpu_zero3.txt"
    fi
  fi

  echo
  echo "gpu-check summary ($(elapsed), $(head -1 "$out/gpus.txt" 2>/dev/null || echo 'no GPU'); logs in $out):"
  printf '  %s\n' "${summary[@]}"
  if [[ -s "$out/bench.txt" ]]; then
    echo "  kernel benchmarks (bench_cuda_kernels):"
    grep -E '^[a-z_]+/' "$out/bench.txt" | sed 's/^/    /' | cut -c1-160
  fi
  ((failures == 0)) || die "gpu-check: $failures step(s) failed"
}

command="${1:-}"
(($# > 0)) && shift
case "$command" in
  train) cmd_train "$@" ;;
  test) cmd_test "$@" ;;
  bench) cmd_bench "$@" ;;
  build) cmd_build "$@" ;;
  install) cmd_install "$@" ;;
  plot) cmd_plot "$@" ;;
  plan) cmd_plan "$@" ;;
  scaling) cmd_scaling "$@" ;;
  gpu-check) cmd_gpu_check "$@" ;;
  gpu-bundle) cmd_gpu_bundle "$@" ;;
  -h | --help | help) usage ;;
  "") usage >&2; exit 2 ;;
  *) usage >&2; die "unknown command '$command'" ;;
esac
