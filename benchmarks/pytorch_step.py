#!/usr/bin/env python3
"""PyTorch reference for bench_train_step: one GPT-2 124M fp32 training step on the CPU.

The same model as llmpar's gpt2-124m (learned positions, pre-LayerNorm, GELU-tanh,
tied LM head, vocabulary padded to 50304), the same batch (B=4, T=64 by default) and
AdamW, timed the same way (best and median wall time of full steps after warm-up).
Run with Debian's python3-torch:  OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE python3 pytorch_step.py
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
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
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.h)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.c_fc_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers=12, heads=12, dim=768, max_seq=1024, vocab=50304):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = GPT()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, 50257, (args.batch, args.seq + 1))
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        if step > 0:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - t0)
    flops = (6 * n + 6 * 12 * 768 * args.seq) * args.batch * args.seq
    best, median = min(times), statistics.median(times)
    print(f"pytorch {torch.__version__} gpt2_124m/train_step B={args.batch} T={args.seq} threads={args.threads}: "
          f"best {best * 1e3:.1f} ms, median {median * 1e3:.1f} ms, {flops / best * 1e-9:.1f} model GFLOP/s, "
          f"{args.batch * args.seq / best:.0f} tokens/s ({n / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
