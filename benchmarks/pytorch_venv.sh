#!/usr/bin/env bash
# Creates (if missing) a Python virtualenv with current PyTorch and NumPy from PyPI for
# benchmarks/pytorch_step.py, and prints the venv's python path on the last line of stdout.
# It also installs transformers and safetensors, for tests/tools/test_hf_transformers.sh
# (llmpar's Hugging Face folders against transformers); without them (PyPI unreachable
# after torch was installed) it warns and the benchmark still works.
# Progress goes to stderr. Idempotent: when the venv's python already imports all of them,
# it only prints the path.
#
#   bash benchmarks/pytorch_venv.sh               # venv at ~/.cache/llmpar/torch-venv
#   LLMPAR_TORCH_VENV=/opt/torch-venv bash benchmarks/pytorch_venv.sh
#   LLMPAR_TORCH_PYTHON="$(bash benchmarks/pytorch_venv.sh | tail -n1)" ./llmpar.sh bench
#
# The default torch wheel on PyPI (Linux x86_64) pulls about 5 GB of CUDA libraries; the
# benchmark itself only uses the CPU.
set -euo pipefail

venv="${LLMPAR_TORCH_VENV:-$HOME/.cache/llmpar/torch-venv}"
python="$venv/bin/python"

log() { printf 'pytorch_venv: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# transformers and safetensors for the Hugging Face cross-test; a failure is a warning.
ensure_transformers() {
  "$python" -c 'import transformers, safetensors' >/dev/null 2>&1 && return 0
  log "installing transformers and safetensors from PyPI into $venv"
  "$venv/bin/pip" install transformers safetensors >&2 && "$python" -c 'import transformers, safetensors' >&2 ||
    log "warning: no transformers in $venv (is PyPI reachable?); tests/tools/test_hf_transformers.sh will skip"
}

if [[ -x "$python" ]] && "$python" -c 'import torch, numpy' >/dev/null 2>&1; then
  ensure_transformers
  printf '%s\n' "$python"
  exit 0
fi

base="${PYTHON:-python3}"
command -v "$base" >/dev/null 2>&1 || die "'$base' not found (set PYTHON=/path/to/python3)"

# Debian and Ubuntu split venv/ensurepip out of python3 into python3-venv (python3.X-venv).
has_venv() { "$base" -c 'import venv, ensurepip' >/dev/null 2>&1; }
if ! has_venv; then
  pkg="python$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv"
  if [[ -f /etc/debian_version && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "$base has no venv/ensurepip support; installing python3-venv $pkg with apt-get"
    apt-get update >&2 || log "apt-get update failed; trying the install anyway"
    DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv >&2 ||
      DEBIAN_FRONTEND=noninteractive apt-get install -y "$pkg" >&2 ||
      die "apt-get install python3-venv failed"
    has_venv || die "$base still lacks venv support after installing python3-venv (try: apt-get install $pkg)"
  elif [[ -f /etc/debian_version ]]; then
    die "$base lacks venv support (the 'venv'/'ensurepip' modules); install it with: sudo apt-get install python3-venv (or $pkg)"
  else
    die "$base lacks venv support (the 'venv'/'ensurepip' modules); install your distribution's python3 venv package"
  fi
fi

# A half-made venv (interrupted creation, or one without pip) is recreated.
if [[ -d "$venv" && ! -x "$venv/bin/pip" ]]; then
  log "removing incomplete virtualenv $venv"
  rm -rf "$venv"
fi
if [[ ! -d "$venv" ]]; then
  log "creating virtualenv $venv with $(command -v "$base") ($("$base" --version 2>&1))"
  mkdir -p "$(dirname "$venv")"
  "$base" -m venv "$venv"
fi

log "installing torch and numpy from PyPI into $venv (about 5 GB of wheels; this can take several minutes)"
"$venv/bin/pip" install --upgrade pip >&2
"$venv/bin/pip" install torch numpy >&2
"$python" -c 'import torch, numpy' >&2 || die "torch or numpy does not import from $python"
ensure_transformers
log "torch $("$python" -c 'import torch; print(torch.__version__)') ready"
printf '%s\n' "$python"
