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
#
# Each command first makes sure the Debian packages below are installed (it installs
# the missing ones when run as root, and prints the command otherwise), then configures
# (Ninja, Release, warnings as errors) and builds incrementally.
#
# Environment:
#   LLMPAR_BUILD_DIR    build directory (default: build, relative to this script's folder)
#   LLMPAR_JOBS         parallel compile and test jobs (default: number of CPUs)
#   LLMPAR_CMAKE_ARGS   extra arguments for the first configure, e.g. "-DLLMPAR_CUDA=OFF"
set -euo pipefail

# The Debian packages the build needs: the one list (CMake finds them; nothing is
# downloaded at build time).
LLMPAR_PACKAGES=(
  cmake g++ ninja-build
  libdnnl-dev ocl-icd-opencl-dev nlohmann-json3-dev libcli11-dev doctest-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin
  fortunes
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

command="${1:-}"
(($# > 0)) && shift
case "$command" in
  train) cmd_train "$@" ;;
  test) cmd_test "$@" ;;
  bench) cmd_bench "$@" ;;
  build) cmd_build "$@" ;;
  install) cmd_install "$@" ;;
  -h | --help | help) usage ;;
  "") usage >&2; exit 2 ;;
  *) usage >&2; die "unknown command '$command'" ;;
esac
