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
#   ./llmpar.sh gpu-pack [--arch ARCHS]      build (here, no GPU needed) every program the GPU check
#                                            runs, for sm_90a and any x86-64-v3 host, and pack them
#                                            with their libraries and data into
#                                            .gpu-pack/llmpar-gpu-pack.tar.gz (LLMPAR_LLMC_DIR: also
#                                            llm.c's train_gpt2cu from that checkout)
#   ./llmpar.sh gpu-check [--sanitize] [--no-peers] [--out DIR]
#                                            on a machine with an NVIDIA GPU, from the pack (or a build
#                                            when there is none): the gpu tests, train_gpt on both
#                                            backends compared, the kernel benchmarks, GPT-2 124M beside
#                                            PyTorch (eager, compiled) and llm.c; one summary table
#
# Each command first makes sure the Debian packages below are installed (it installs
# the missing ones when run as root, and prints the command otherwise), then configures
# (Ninja, Release, warnings as errors) and builds incrementally; plot builds nothing.
#
# Environment:
#   LLMPAR_BUILD_DIR    build directory (default: build, relative to this script's folder)
#   LLMPAR_JOBS         parallel compile and test jobs (default: number of CPUs)
#   LLMPAR_CMAKE_ARGS   extra arguments for the first configure, e.g. "-DLLMPAR_CUDA=OFF"
#   LLMPAR_GPU_BUILD_DIR  gpu-check's folder for the unpacked pack or its build (default: build-gpu)
#   LLMPAR_GPU_PACK_BUILD_DIR  gpu-pack's build directory (default: build-gpu-pack)
#   LLMPAR_TORCH_PYTHON gpu-check and bench: the Python that imports torch (default: python3 / the venv)
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
  # The documentation corpus (prepare_data --corpus docs, examples/docs_corpus.hpp): 31 MB of
  # English prose from the kernel, Python, Perl and LLVM manuals, for scaling-law sweeps.
  linux-doc-6.1 python3.11-doc perl-doc llvm-15-doc
  python3-matplotlib python3-numpy python3-venv
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
    # Compile CUDA code for the GPUs of this machine, where there are any. Without one
    # the CUDA code is only compiled, to check it (GPU tests skip): to PTX for sm_90a
    # (H100/H200, what gpu-pack ships), without the ptxas pass that turns it into
    # machine code, which nothing here could run (ops_float.cu: 16.2 s against 20.1 s
    # with it, on one core of a 2-core Xeon), and unoptimised (LLMPAR_CUDA_CHECK_ONLY:
    # tests/cuda/test_cuda_attention.cu in 12 s against 66 s, on the 2-core AMD EPYC of
    # docs/benchmarks.md, "Build time"). gpu-pack compiles optimised machine code
    # (tools/gpu.sh), and with it ptxas's resource checks. Name others in
    # LLMPAR_CMAKE_ARGS, e.g. -DCMAKE_CUDA_ARCHITECTURES=80;90a (the library's own
    # default) for machine code for A100s and H100s.
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      args+=(-DCMAKE_CUDA_ARCHITECTURES=native)
    else
      args+=(-DCMAKE_CUDA_ARCHITECTURES=90a-virtual -DLLMPAR_CUDA_CHECK_ONLY=ON)
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
  # --np N runs N processes under mpirun; --restarts N restarts the run after a crash or
  # a lost rank, from --save's latest checkpoint (tools/supervise.sh); the other flags
  # go to train_gpt.
  local np="" restarts="" min_ranks=() args=()
  while (($# > 0)); do
    case "$1" in
      --np) (($# >= 2)) || die "--np needs a number of processes, e.g. --np 2"; np="$2"; shift 2 ;;
      --np=*) np="${1#--np=}"; shift ;;
      --restarts) (($# >= 2)) || die "--restarts needs a count, e.g. --restarts 3"; restarts="$2"; shift 2 ;;
      --restarts=*) restarts="${1#--restarts=}"; shift ;;
      --min-ranks) (($# >= 2)) || die "--min-ranks needs a number of processes"; min_ranks=(--min-ranks "$2"); shift 2 ;;
      *) args+=("$1"); shift ;;
    esac
  done
  [[ -z "$np" || "$np" =~ ^[1-9][0-9]*$ ]] || die "--np $np is not a number of processes; use e.g. --np 2"
  [[ -z "$restarts" || "$restarts" =~ ^[0-9]+$ ]] || die "--restarts $restarts is not a count; use e.g. --restarts 3"
  ((${#min_ranks[@]} == 0)) || [[ -n "$restarts" && -n "$np" ]] || die "--min-ranks restarts on fewer processes: give it with --restarts and --np"
  if [[ -n "$restarts" ]] && ! printf '%s\n' "${args[@]}" | grep -q -- '^--save'; then
    die "--restarts needs --save DIR: a restart resumes from the latest checkpoint there"
  fi
  setup
  build --target train_gpt
  local binary="$build_dir/examples/train_gpt" launch=()
  [[ -x "$binary" ]] || die "$binary was not built (is LLMPAR_BUILD_EXAMPLES off?)"
  if [[ -n "$np" ]]; then
    command -v mpirun >/dev/null 2>&1 || die "--np needs mpirun (Debian: openmpi-bin)"
    mpi_environment "$np"
    launch=(mpirun -np "$np")
  fi
  if [[ -n "$restarts" ]]; then
    exec bash "$root/tools/supervise.sh" --restarts "$restarts" "${min_ranks[@]}" -- "${launch[@]}" "$binary" "${args[@]}"
  fi
  exec "${launch[@]}" "$binary" "${args[@]}"
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
  # Ring attention's exposed communication across 2 MPI processes (cp 2) too.
  if [[ -x "$build_dir/benchmarks/bench_context_parallel" ]] && command -v mpirun >/dev/null 2>&1; then
    echo "==> mpirun -np 2 benchmarks/bench_context_parallel $*"
    OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
      mpirun -np 2 "$build_dir/benchmarks/bench_context_parallel" "$@" || failed+=("bench_context_parallel (mpirun)")
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
  # What is installed, and nothing else: the headers and the CMake package need no
  # build; the three programs do.
  build --target train_gpt prepare_data llmpar_plan
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

# gpu-pack and gpu-check: tools/gpu.sh.
# shellcheck source=tools/gpu.sh
source "$root/tools/gpu.sh"

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
  gpu-pack) cmd_gpu_pack "$@" ;;
  gpu-check) cmd_gpu_check "$@" ;;
  -h | --help | help) usage ;;
  "") usage >&2; exit 2 ;;
  *) usage >&2; die "unknown command '$command'" ;;
esac
