"""transformers' side of tests/tools/test_hf_transformers.sh.

  hf_transformers_reference.py make ROOT    # the reference cases, one folder each
  hf_transformers_reference.py check ROOT   # llmpar's exports, loaded by from_pretrained

make: for each case, a tiny random model of transformers (a Llama with grouped-query
attention, untied; a Llama with 8 query heads on 2 kv heads, Llama 3's rope scaling and
a tied head; a GPT-2), its parameters moved off transformers' init (norm gains and
biases random too, so every path shows), saved by save_pretrained as ROOT/CASE/hf. Then,
in float64, the mean cross-entropy of a fixed batch (input t, target t + 1, as train_gpt
reads a sequence) and every parameter's gradient: ROOT/CASE/reference.json {"loss"},
ROOT/CASE/reference.safetensors {"tokens": (B, T + 1) int32} and ROOT/CASE/grads/
model.safetensors (each gradient under its parameter's name, float32).

check: test_hf_llama's case has written ROOT/CASE/export (a model of llmpar's, by
write_llama or write_gpt2_folder), ROOT/CASE/export.json {"loss"} and
ROOT/CASE/export_logits.safetensors {"logits": (B, T, vocab)}, both computed by llmpar
in double. from_pretrained must load the folder with no missing, unexpected or
mismatched tensor, and compute the same logits (to 1e-5 of their largest) and loss (to
1e-5 relative) in float64.

transformers computes RMSNorm and the rotary angles' cos/sin in float32 even in a
float64 model, so the two sides agree to float32's rounding, not float64's.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.numpy import load_file, save_file

BATCH, SEQ, VOCAB = 3, 12, 64


def cases():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    llama = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 max_position_embeddings=64, initializer_range=0.1, attention_bias=False, mlp_bias=False)
    return {
        "llama_gqa": (LlamaForCausalLM, LlamaConfig(**llama, num_attention_heads=4, num_key_value_heads=2,
                                                    rope_theta=10000.0, rms_norm_eps=1e-5,
                                                    tie_word_embeddings=False)),
        "llama_llama3_tied": (LlamaForCausalLM, LlamaConfig(
            **llama, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_theta=500000.0,
            # original_max_position_embeddings 16: with heads of 4 channels the first
            # frequency is interpolated and the second divided by the factor.
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16})),
        "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                             activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                             attn_pdrop=0.0, initializer_range=0.1, bos_token_id=None,
                                             eos_token_id=None)),
    }


def tokens(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def loss_and_logits(model, toks):
    inputs, targets = toks[:, :-1], toks[:, 1:]
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, logits


def make(root):
    for k, (name, (cls, config)) in enumerate(sorted(cases().items())):
        case = root / name
        (case / "grads").mkdir(parents=True, exist_ok=True)
        torch.manual_seed(100 + k)
        model = cls(config).float().eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1:  # norm gains around 1, biases around 0
                    base = 0.0 if pname.endswith(".bias") else 1.0
                    p.copy_(base + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.1 * torch.randn_like(p))
        model.save_pretrained(case / "hf")
        model = model.double()
        toks = tokens(7 + k)
        loss, _ = loss_and_logits(model, toks)
        loss.backward()
        grads = {pname: p.grad.float().numpy() for pname, p in model.named_parameters()}
        save_file(grads, str(case / "grads" / "model.safetensors"), metadata={"format": "pt"})
        save_file({"tokens": toks.to(torch.int32).numpy()}, str(case / "reference.safetensors"))
        (case / "reference.json").write_text(json.dumps({"loss": loss.item()}))
        print(f"make {name}: {sum(p.numel() for p in model.parameters())} parameters, {len(grads)} gradients, "
              f"loss {loss.item():.10f}")


def check(root):
    from transformers import AutoModelForCausalLM

    for name in sorted(cases()):
        case = root / name
        if not (case / "export.json").exists():
            sys.exit(f"check {name}: {case / 'export.json'} is missing: test_hf_llama did not run the case")
        model, info = AutoModelForCausalLM.from_pretrained(case / "export", output_loading_info=True)
        problems = {key: value for key, value in info.items() if value}
        assert not problems, f"check {name}: from_pretrained reports {problems}"
        assert next(model.parameters()).dtype == torch.float32, "the export should load as float32"
        model = model.double().eval()
        toks = torch.from_numpy(load_file(str(case / "reference.safetensors"))["tokens"]).long()
        with torch.no_grad():
            loss, logits = loss_and_logits(model, toks)
        ours = torch.from_numpy(load_file(str(case / "export_logits.safetensors"))["logits"]).double()
        assert ours.shape == logits.shape, f"check {name}: logits {tuple(ours.shape)}, transformers' {tuple(logits.shape)}"
        logit_error = ((ours - logits).abs().max() / logits.abs().max()).item()
        want = json.loads((case / "export.json").read_text())["loss"]
        loss_error = abs(loss.item() - want) / abs(want)
        print(f"check {name}: from_pretrained loaded llmpar's export ({type(model).__name__}); logits differ by "
              f"{logit_error:.3g} of their largest, loss {loss.item():.10f} against llmpar's {want:.10f} "
              f"(relative {loss_error:.3g})")
        assert logit_error <= 1e-5, f"check {name}: the logits differ by {logit_error} of their largest"
        assert loss_error <= 1e-5 and math.isfinite(want), f"check {name}: the losses differ by {loss_error}"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(f"usage: {sys.argv[0]} make|check ROOT")
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    (make if sys.argv[1] == "make" else check)(Path(sys.argv[2]))
