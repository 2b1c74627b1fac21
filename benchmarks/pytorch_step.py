#!/usr/bin/env python3
"""PyTorch reference for llmpar's training step: one GPT-2 124M step, CPU or one GPU.

The same model as llmpar's gpt2-124m (learned positions, pre-LayerNorm, GELU-tanh,
tied LM head, vocabulary padded to 50304), the same batch (B=4, T=64 by default on the
CPU) and AdamW with gradient clipping at 1.0, timed the same way (best and median wall
time of full steps after warm-up), written the way a PyTorch user writes it today.

Precisions (--precision, default both):
  fp32  everything in float32.
  bf16  the usual PyTorch mixed precision: forward and loss run under
        torch.autocast(device, dtype=torch.bfloat16); parameters, gradients and the
        AdamW state stay float32 (backward runs outside the autocast region, as usual).

--device cuda runs the step on the first GPU (nanoGPT's recipe): bf16 autocast, fused
SDPA attention, the fused AdamW (fused=True), the tied head, and the step timed between
torch.cuda.synchronize() calls; --compile wraps the model in torch.compile. llmpar's
`./llmpar.sh gpu-check` runs it beside `train_gpt --model gpt2-124m --batch 16 --seq
1024 --backend cuda --precision bf16`.

Attention uses F.scaled_dot_product_attention(q, k, v, is_causal=True) when this torch
has it (torch >= 2.0), since that is what a current-PyTorch user writes; on CPU it
dispatches to a fused flash-attention kernel, on a GPU to FlashAttention or cuDNN.
--naive-attention (or an older torch) uses the explicit path instead: q @ k^T / sqrt(d),
causal mask, softmax, @ v.

Current PyTorch from PyPI in a virtualenv:  bash benchmarks/pytorch_venv.sh
Run:  OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE ~/.cache/llmpar/torch-venv/bin/python pytorch_step.py
      python3 pytorch_step.py --device cuda --batch 16 --seq 1024 --precision bf16 [--compile]
"""
import argparse
import contextlib
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class Block(nn.Module):
    def __init__(self, c, h, naive_attention):
        super().__init__()
        self.h = h
        self.naive_attention = naive_attention
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_fc_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        if self.naive_attention:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.h)
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.c_fc_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers=12, heads=12, dim=768, max_seq=1024, vocab=50304, naive_attention=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.h = nn.ModuleList(Block(dim, heads, naive_attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        # GPT-2's initialisation, as llmpar's model has it: N(0, 0.02) weights (the
        # projections into the residual stream scaled by 1/sqrt(2L)), N(0, 0.01)
        # positions, zero biases. PyTorch's defaults (N(0, 1) embeddings, tied to the
        # head) give logits in the tens and a loss near 67, whose softmax gradients are
        # largely subnormal floats: that measures the CPU's subnormal arithmetic, not
        # the training step.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            elif name == "wpe.weight":
                nn.init.normal_(p, std=0.01)
            elif name.endswith("c_proj.weight") or name.endswith("c_fc_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def cpu_capability():
    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # torch < 2.1
        return "n/a"


def bench(precision, args):
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    naive = args.naive_attention or not HAS_SDPA
    model = GPT(naive_attention=naive).to(args.device)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if cuda else {}))
    step_model = torch.compile(model) if args.compile else model
    idx = torch.randint(0, 50257, (args.batch, args.seq + 1), device=args.device)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    if precision == "bf16":
        autocast = lambda: torch.autocast(args.device, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        if step >= args.warmup:  # the first steps allocate the optimizer state (and compile)
            times.append(time.perf_counter() - t0)
    flops = (6 * n + 6 * 12 * 768 * args.seq) * args.batch * args.seq
    best, median = min(times), statistics.median(times)
    attention = "naive" if naive else "sdpa"
    where = (f"device={torch.cuda.get_device_name()}" if cuda else
             f"threads={torch.get_num_threads()} cpu={cpu_capability()}")
    mode = " compile" if args.compile else ""
    memory = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
    print(f"pytorch {torch.__version__}{mode} gpt2_124m/train_step {precision} B={args.batch} T={args.seq} "
          f"{where} attention={attention} steps={args.steps}+{args.warmup}warmup: "
          f"best {best * 1e3:.1f} ms, median {median * 1e3:.1f} ms, {flops / best * 1e-9:.1f} model GFLOP/s, "
          f"{args.batch * args.seq / best:.0f} tokens/s best, {args.batch * args.seq / median:.0f} tokens/s median "
          f"({n / 1e6:.2f}M parameters, loss {loss.item():.3f}{memory})",
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--naive-attention", action="store_true",
                    help="explicit q@k^T, mask, softmax, @v instead of F.scaled_dot_product_attention")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    for precision in ("fp32", "bf16") if args.precision == "both" else (args.precision,):
        bench(precision, args)


if __name__ == "__main__":
    main()
