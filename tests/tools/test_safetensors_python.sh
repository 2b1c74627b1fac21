#!/usr/bin/env bash
# train_gpt's Hugging Face GPT-2 files are the real safetensors format, both ways, as
# the reference implementation (the `safetensors` Python package, numpy API) reads and
# writes it:
#   (a) Python writes an HF-style GPT-2 for the gpt2-tiny preset (4 layers, 4 heads, dim
#       128, vocab 256, n_positions 64) of random float32 values, every name prefixed
#       "transformer." as GPT2LMHeadModel.save_pretrained does, with each layer's
#       attn.bias buffer (the causal mask);
#   (b) train_gpt --init-from it --export out --steps 0 converts without training;
#   (c) Python reads out back: every tensor equals the input bit for bit, under the
#       names without the prefix, no buffer, float32, metadata format "pt";
#   (d) train_gpt --steps 3 --export trained: Python reads it: the 4*12+4 = 52 names of
#       GPT-2, HF's shapes, float32, every value finite.
#
#   test_safetensors_python.sh DIR_WITH_TRAIN_GPT WORK_DIR
#
# The Python is $LLMPAR_TOOLS_PYTHON (./llmpar.sh test sets it up: a venv with
# safetensors from PyPI); exits 77 (skipped) when it is unset or cannot import
# safetensors and numpy.
set -euo pipefail

fail() {
  echo "test_safetensors_python: FAIL: $*" >&2
  exit 1
}

(($# == 2)) || fail "usage: $0 DIR_WITH_TRAIN_GPT WORK_DIR"
train_gpt="$1/train_gpt"
work="$2"
[[ -x "$train_gpt" ]] || fail "$train_gpt is not an executable (build the train_gpt target)"
train_gpt="$(cd "$(dirname "$train_gpt")" && pwd)/train_gpt"

python="${LLMPAR_TOOLS_PYTHON:-}"
if [[ -z "$python" ]]; then
  echo "test_safetensors_python: skipped: LLMPAR_TOOLS_PYTHON is not set (./llmpar.sh test sets it up)"
  exit 77
fi
if ! "$python" -c 'import safetensors, numpy' >/dev/null 2>&1; then
  echo "test_safetensors_python: skipped: $python cannot import safetensors and numpy" \
    "(pip install safetensors numpy)"
  exit 77
fi

mkdir -p "$work"
work="$(cd "$work" && pwd)"
rm -f "$work"/{in,out,trained}.safetensors

# GPT-2's tensors for the gpt2-tiny preset, in HF's names and shapes (Conv1D: (in, out)).
gpt2_spec='
def gpt2_shapes(layers=4, dim=128, vocab=256, positions=64):
    C = dim
    shapes = {"wte.weight": (vocab, C), "wpe.weight": (positions, C)}
    for i in range(layers):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
            h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
            h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,),
        })
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes
'

# (a) The input: random values, the prefix, the buffers.
"$python" - "$work/in.safetensors" <<EOF || fail "(a) Python could not write the HF-style input file"
import sys
import numpy as np
from safetensors.numpy import save_file
$gpt2_spec
rng = np.random.default_rng(1234)
tensors = {}
for name, shape in gpt2_shapes().items():
    tensors["transformer." + name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
for i in range(4):
    tensors[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((64, 64), dtype=np.float32)).reshape(1, 1, 64, 64)
save_file(tensors, sys.argv[1], metadata={"format": "pt"})
print(f"(a) wrote {sys.argv[1]}: {len(tensors)} tensors (52 with the prefix 'transformer.', 4 attn.bias buffers)")
EOF

# (b) Convert without training.
(cd "$work" && "$train_gpt" --init-from in.safetensors --export out.safetensors --steps 0 --eval-every 0 \
  --sample-tokens 0 >convert.log 2>&1) ||
  fail "(b) train_gpt --init-from in.safetensors --export out.safetensors --steps 0 failed; its output:
$(tail -n 20 "$work/convert.log")"
[[ -f "$work/out.safetensors" ]] || fail "(b) train_gpt --export did not write $work/out.safetensors"
echo "(b) train_gpt --init-from in.safetensors --export out.safetensors --steps 0: converted"

# (c) The export is the input, bit for bit.
"$python" - "$work/in.safetensors" "$work/out.safetensors" <<EOF || fail "(c) out.safetensors is not the input"
import sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
$gpt2_spec
source, out_path = sys.argv[1], sys.argv[2]
inp = load_file(source)
out = load_file(out_path)
want = {name[len("transformer."):]: t for name, t in inp.items() if not name.endswith(".attn.bias")}
assert set(want) == set(gpt2_shapes()), "the input file is not what (a) wrote"
missing = sorted(set(want) - set(out))
extra = sorted(set(out) - set(want))
assert not missing and not extra, f"names differ: missing {missing[:5]}, unexpected {extra[:5]}"
for name, t in want.items():
    o = out[name]
    assert o.dtype == np.float32, f"{name} is {o.dtype}, not float32"
    assert o.shape == t.shape, f"{name} has shape {o.shape}, the input {t.shape}"
    assert np.array_equal(o.view(np.uint32), t.view(np.uint32)), (
        f"{name} differs from the input ({int((o != t).sum())} of {t.size} elements)")
with safe_open(out_path, framework="np") as f:
    meta = f.metadata() or {}
assert meta.get("format") == "pt", f"metadata is {meta}, not format pt"
print(f"(c) out.safetensors: {len(out)} tensors, names without the prefix, no buffers, float32, "
      "equal to the input bit for bit, metadata format pt")
EOF

# (d) A trained model's export.
(cd "$work" && "$train_gpt" --steps 3 --eval-every 0 --sample-tokens 0 --export trained.safetensors \
  >train.log 2>&1) ||
  fail "(d) train_gpt --steps 3 --export trained.safetensors failed; its output:
$(tail -n 20 "$work/train.log")"
"$python" - "$work/trained.safetensors" <<EOF || fail "(d) trained.safetensors is not GPT-2 in HF's layout"
import sys
import numpy as np
from safetensors.numpy import load_file
$gpt2_spec
tensors = load_file(sys.argv[1])
shapes = gpt2_shapes()
assert len(shapes) == 52
assert set(tensors) == set(shapes), (
    f"names differ: missing {sorted(set(shapes) - set(tensors))[:5]}, unexpected {sorted(set(tensors) - set(shapes))[:5]}")
for name, t in tensors.items():
    assert t.dtype == np.float32, f"{name} is {t.dtype}, not float32"
    assert t.shape == shapes[name], f"{name} has shape {t.shape}, GPT-2's is {shapes[name]}"
    assert np.isfinite(t).all(), f"{name} holds {int((~np.isfinite(t)).sum())} values that are not finite"
print(f"(d) trained.safetensors (3 steps): the {len(tensors)} names of GPT-2, HF's shapes, float32, all finite")
EOF

echo "test_safetensors_python: PASS"
