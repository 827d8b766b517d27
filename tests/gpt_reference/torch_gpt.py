#!/usr/bin/env python3
"""The PyTorch reference of dflow's character-level GPT (graph/src/layers/gpt.rs).

The same model as nanoGPT's `model.py` with bias=True, tied embeddings and GPT-2's tanh GELU,
parameter names and layouts equal to dflow's variables, and the same training recipe: AdamW
(weight decay on tensors of rank >= 2 only, as nanoGPT's configure_optimizers), nanoGPT's
warm-up + cosine lr schedule, and clipping by global norm with TensorFlow's formula
scale = clip / max(norm, clip) (what dflow's GlobalNormScale computes; torch's
clip_grad_norm_ adds 1e-6 to the norm).

Two uses:
  fixtures  python torch_gpt.py fixtures OUT_DIR
            A tiny model's initial weights, a batch, the loss and every gradient, and the
            parameters and losses over 3 AdamW steps: what tests/gpt_reference.rs compares
            dflow against (committed under tests/fixtures/gpt/).
  bench     python torch_gpt.py bench --data examples/data/shakespeare.txt.gz [--threads 2]
            nanoGPT's shakespeare_char CPU configuration for --iters steps: tokens/s, the final
            validation loss, peak RSS (the peer figures in BENCHMARKS.md).

Environment: the peers' venv (../shared/bench/setup.sh makes it: numpy, torch, safetensors).
"""
import argparse
import gzip
import json
import math
import os
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Config:
    def __init__(self, vocab_size=76, block_size=64, n_layer=4, n_head=4, n_embd=128):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head
        self.register_buffer("mask", torch.tril(torch.ones(c.block_size, c.block_size)).bool(), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hd = C // self.n_head
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.block_size, c.n_embd),
            h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            ln_f=nn.LayerNorm(c.n_embd),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_lr(it, lr, warmup, decay, min_lr):
    """nanoGPT's get_lr (dflow's LrSchedule::lr_at)."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if decay == 0:
        return lr
    if it > decay:
        return min_lr
    r = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (lr - min_lr)


def optimizer(model, lr, weight_decay, betas):
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, foreach=False)


def clip_like_dflow(model, clip):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    scale = clip / max(norm, clip)
    for g in grads:
        g.mul_(scale)
    return norm


def state(model):
    """Parameters by dflow's names; the tied head is stored once, as transformer.wte.weight."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def fixtures(out_dir):
    from safetensors.torch import save_file
    torch.manual_seed(7)
    torch.set_num_threads(1)
    cfg = Config(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg)
    batch = 3
    idx = torch.randint(cfg.vocab_size, (batch, cfg.block_size))
    targets = torch.randint(cfg.vocab_size, (batch, cfg.block_size))
    os.makedirs(out_dir, exist_ok=True)
    save_file(state(model), os.path.join(out_dir, "init.safetensors"))
    _, loss = model(idx, targets)
    loss.backward()
    # named_parameters yields the tied tensor once, as transformer.wte.weight (its gradient sums
    # the lookup's and the head's).
    grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
    assert "lm_head.weight" not in grads
    save_file(grads, os.path.join(out_dir, "grads.safetensors"))
    # Three steps of the training recipe on the same batch.
    lr, min_lr, warmup, decay, wd, clip = 1e-2, 1e-3, 1, 3, 0.1, 1.0
    model.zero_grad(set_to_none=True)
    opt = optimizer(model, lr, wd, (0.9, 0.99))
    losses = []
    for it in range(3):
        for g in opt.param_groups:
            g["lr"] = get_lr(it, lr, warmup, decay, min_lr)
        _, l = model(idx, targets)
        losses.append(l.item())
        opt.zero_grad(set_to_none=True)
        l.backward()
        clip_like_dflow(model, clip)
        opt.step()
    save_file(state(model), os.path.join(out_dir, "after3.safetensors"))
    meta = {
        "config": {"vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "n_layer": cfg.n_layer,
                   "n_head": cfg.n_head, "n_embd": cfg.n_embd},
        "recipe": {"learning_rate": lr, "min_lr": min_lr, "warmup_steps": warmup, "decay_steps": decay,
                   "weight_decay": wd, "beta1": 0.9, "beta2": 0.99, "grad_clip": clip},
        "idx": idx.tolist(), "targets": targets.tolist(),
        "loss": loss.item(), "losses": losses,
        "torch": torch.__version__,
    }
    with open(os.path.join(out_dir, "batch.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote fixtures to {out_dir}: loss {loss.item():.6f}, losses {losses}")


def bench(args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with gzip.open(args.data, "rt") if args.data.endswith(".gz") else open(args.data) as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = len(data) - int(len(data) * 0.1)
    train, val = data[:n], data[n:]
    cfg = Config(vocab_size=len(chars), block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    opt = optimizer(model, 1e-3, 0.1, (0.9, 0.99))
    T, B = cfg.block_size, args.batch_size

    def batch(split):
        d = train if split == "train" else val
        ix = torch.randint(len(d) - T, (B,))
        return torch.stack([d[i:i + T] for i in ix]), torch.stack([d[i + 1:i + 1 + T] for i in ix])

    @torch.no_grad()
    def val_loss():
        model.eval()
        g = torch.Generator().manual_seed(1234)
        total = 0.0
        for _ in range(args.eval_batches):
            ix = torch.randint(len(val) - T, (B,), generator=g)
            x = torch.stack([val[i:i + T] for i in ix])
            y = torch.stack([val[i + 1:i + 1 + T] for i in ix])
            total += model(x, y)[1].item()
        model.train()
        return total / args.eval_batches

    start = time.perf_counter()
    for it in range(args.iters):
        for g in opt.param_groups:
            g["lr"] = get_lr(it, 1e-3, 100, 2000, 1e-4)
        x, y = batch("train")
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_like_dflow(model, 1.0)
        opt.step()
        if (it + 1) % max(1, args.iters // 10) == 0:
            print(f"step {it + 1} loss {loss.item():.4f}", file=sys.stderr)
    elapsed = time.perf_counter() - start
    v = val_loss()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"iters": args.iters, "threads": args.threads, "seconds": round(elapsed, 2),
                      "tokens_per_s": round(args.iters * B * T / elapsed),
                      "val_loss": round(v, 4), "peak_rss_mib": round(rss), "torch": torch.__version__}))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixtures")
    f.add_argument("out_dir")
    b = sub.add_parser("bench")
    b.add_argument("--data", required=True)
    b.add_argument("--iters", type=int, default=2000)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--batch-size", type=int, default=12)
    b.add_argument("--eval-batches", type=int, default=200)
    b.add_argument("--seed", type=int, default=1337)
    a = p.parse_args()
    fixtures(a.out_dir) if a.cmd == "fixtures" else bench(a)


if __name__ == "__main__":
    main()
