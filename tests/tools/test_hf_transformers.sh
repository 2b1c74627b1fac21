#!/usr/bin/env bash
# llmpar's Hugging Face folders (checkpoint/hf_llama.hpp, hf_gpt2.hpp) against the
# `transformers` package itself, both ways (tests/tools/hf_transformers_reference.py says
# what each side computes):
#   (a) Python builds tiny random models (a Llama with grouped-query attention; one with
#       Llama 3's rope scaling and a tied head; a GPT-2), save_pretrained's them, and
#       records in float64 the mean loss of a fixed batch and every parameter's gradient;
#   (b) test_hf_llama's "hf against transformers" case reads each folder
#       (family_of_folder, read_llama_config / read_gpt2_config, read_llama / read_gpt2),
#       computes the loss and the gradients in double and checks them (loss to 1e-5
#       relative, each gradient to 1e-4 of its largest element; the gradients mapped by
#       the same table as the weights), then exports a model of its own
#       (write_llama / write_gpt2_folder) with its loss and logits;
#   (c) Python loads each export with AutoModelForCausalLM.from_pretrained (no missing,
#       unexpected or mismatched tensor) and computes the same logits and loss.
#
#   test_hf_transformers.sh TEST_HF_LLAMA WORK_DIR
#
# The Python is the first of $LLMPAR_TORCH_PYTHON, the venv of benchmarks/pytorch_venv.sh
# ($LLMPAR_TORCH_VENV, default ~/.cache/llmpar/torch-venv), $LLMPAR_TOOLS_PYTHON and
# python3 that imports torch, transformers, safetensors and numpy; exits 77 (skipped)
# when none does.
set -euo pipefail

fail() {
  echo "test_hf_transformers: FAIL: $*" >&2
  exit 1
}

(($# == 2)) || fail "usage: $0 TEST_HF_LLAMA WORK_DIR"
test_binary="$1"
work="$2"
[[ -x "$test_binary" ]] || fail "$test_binary is not an executable (build the test_hf_llama target)"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

python=""
for candidate in "${LLMPAR_TORCH_PYTHON:-}" "${LLMPAR_TORCH_VENV:-$HOME/.cache/llmpar/torch-venv}/bin/python" \
  "${LLMPAR_TOOLS_PYTHON:-}" python3; do
  [[ -n "$candidate" ]] || continue
  if "$candidate" -c 'import torch, transformers, safetensors, numpy' >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done
if [[ -z "$python" ]]; then
  echo "test_hf_transformers: skipped: no Python here imports torch, transformers, safetensors and numpy" \
    "(bash benchmarks/pytorch_venv.sh makes a venv with them, or set LLMPAR_TORCH_PYTHON)"
  exit 77
fi

rm -rf "$work"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

# (a) transformers' models and their numbers.
"$python" "$here/hf_transformers_reference.py" make "$work" || fail "(a) Python could not make the reference cases"

# (b) llmpar reads them, checks its loss and gradients, and exports its own.
LLMPAR_HF_REFERENCE="$work" "$test_binary" --test-case='hf against transformers*' >"$work/check.log" 2>&1 ||
  fail "(b) test_hf_llama's comparison with transformers failed; its output:
$(tail -n 40 "$work/check.log")"
grep -q 'test cases: *1 | *1 passed' "$work/check.log" ||
  fail "(b) test_hf_llama did not run its case 'hf against transformers'; its output:
$(tail -n 20 "$work/check.log")"
grep 'MESSAGE: ' "$work/check.log" | sed 's/.*MESSAGE: /(b) /'

# (c) transformers loads llmpar's exports.
"$python" "$here/hf_transformers_reference.py" check "$work" || fail "(c) transformers disagrees with llmpar's exports"

echo "test_hf_transformers: PASS"
