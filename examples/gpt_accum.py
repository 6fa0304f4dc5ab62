"""A tiny GPT trained the way nanoGPT's train.py does it, on synthetic tokens:
gradient accumulation with DDP's gradient sync switched on by hand for the last
micro-step only, a warm-up then cosine learning-rate schedule, gradient
clipping, and an evaluation that only rank 0 (the master process) runs every
`--eval-interval` iterations while the other ranks wait for it.

    torchrun --standalone --nproc-per-node 2 examples/gpt_accum.py --max-iters 200
    ddtrain start -n 2 examples/gpt_accum.py -- --max-iters 200 --grad-accum 4

The four lines marked `# ddtop` add the loss, progress and the evaluation phase
to ddtop's dashboard; without DDTOP_TELEMETRY they do nothing.
"""

import argparse
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddtop  # ddtop

# -----------------------------------------------------------------------------
# the model: token and position embeddings, pre-norm causal self-attention blocks


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# -----------------------------------------------------------------------------
# the data: a synthetic corpus with structure to learn (each token mostly
# follows from the one before), split 90/10 into train and val


def make_corpus(n_tokens: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)  # the same corpus on every rank
    tokens = torch.empty(n_tokens, dtype=torch.long)
    tokens[0] = 0
    noise = torch.randint(vocab_size, (n_tokens,), generator=generator)
    keep = torch.rand(n_tokens, generator=generator) < 0.9
    for i in range(1, n_tokens):
        tokens[i] = (tokens[i - 1] * 7 + 3) % vocab_size if keep[i] else noise[i]
    split = int(0.9 * n_tokens)
    return tokens[:split], tokens[split:]


def main() -> None:
    parser = argparse.ArgumentParser(description="tiny GPT with gradient accumulation (DDP)")
    parser.add_argument("--max-iters", type=int, default=200, help="optimizer steps in all")
    parser.add_argument("--grad-accum", type=int, default=4,
                        help="micro-batches per optimizer step, all ranks together")
    parser.add_argument("--eval-interval", type=int, default=50,
                        help="rank 0 evaluates every this many iterations")
    parser.add_argument("--eval-iters", type=int, default=20, help="batches per evaluation")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup-iters", type=int, default=20)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    args = parser.parse_args()

    # various inits, derived attributes, I/O setup
    ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
    if ddp:
        ddp_rank = int(os.environ["RANK"])
        ddp_local_rank = int(os.environ["LOCAL_RANK"])
        ddp_world_size = int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            device = f"cuda:{ddp_local_rank}"
            torch.cuda.set_device(device)
            init_process_group(backend="nccl")
        else:
            device = "cpu"
            init_process_group(backend="gloo")
        master_process = ddp_rank == 0  # this process will do logging, evaluation etc.
        seed_offset = ddp_rank  # each process gets a different seed
        # world_size number of processes will be training simultaneously, so we can scale
        # down the desired gradient accumulation iterations per process proportionally
        assert args.grad_accum % ddp_world_size == 0
        gradient_accumulation_steps = args.grad_accum // ddp_world_size
    else:
        # if not ddp, we are running on a single process
        device = "cuda" if torch.cuda.is_available() else "cpu"
        master_process = True
        seed_offset = 0
        ddp_world_size = 1
        gradient_accumulation_steps = args.grad_accum
    samples_per_iter = gradient_accumulation_steps * args.batch_size  # sequences, per rank
    tokens_per_iter = samples_per_iter * ddp_world_size * args.block_size
    if master_process:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
    torch.manual_seed(1337 + seed_offset)
    device_type = "cuda" if "cuda" in device else "cpu"
    ctx = (nullcontext() if device_type == "cpu"
           else torch.autocast(device_type=device_type, dtype=torch.bfloat16))

    vocab_size = 64
    train_data, val_data = make_corpus(20_000, vocab_size)

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = train_data if split == "train" else val_data
        ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
        x = torch.stack([data[i:i + args.block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + args.block_size] for i in ix])
        return x.to(device), y.to(device)

    torch.manual_seed(1337)  # the same initial weights on every rank
    model = GPT(vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    torch.manual_seed(1337 + seed_offset)  # and a different data stream on each
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    if ddp:
        model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)
    raw_model = model.module if ddp else model  # unwrap DDP container if needed

    # helps estimate an arbitrarily accurate loss over either split using many batches
    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        raw_model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    losses[k] = raw_model(X, Y).item()
            out[split] = losses.mean().item()
        raw_model.train()
        return out

    # learning rate decay scheduler (cosine with warmup)
    def get_lr(it: int) -> float:
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        if it > args.max_iters:
            return args.min_lr
        decay_ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return args.min_lr + coeff * (args.learning_rate - args.min_lr)

    # training loop
    ddtop.init(total_steps=args.max_iters)  # ddtop
    X, Y = get_batch("train")  # fetch the very first batch
    t0 = time.time()
    iter_num = 0
    while True:
        # determine and set the learning rate for this iteration
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        # evaluate the loss on train/val sets: rank 0 alone, the others wait for it in
        # the next all-reduce
        if iter_num % args.eval_interval == 0 and master_process:
            with ddtop.phase("eval"):  # ddtop
                losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, "
                  f"val loss {losses['val']:.4f}")
        if iter_num >= args.max_iters:
            break

        # forward backward update, with optional gradient accumulation to simulate larger
        # batch size
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                # in DDP training we only need to sync gradients at the last micro step.
                model.require_backward_grad_sync = (
                    micro_step == gradient_accumulation_steps - 1)
            with ctx:
                loss = model(X, Y)
                loss = loss / gradient_accumulation_steps  # scale the loss for accumulation
            # immediately async prefetch next batch while model is doing the forward pass
            X, Y = get_batch("train")
            loss.backward()
        if args.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ddtop.step(loss=loss * gradient_accumulation_steps, samples=samples_per_iter)  # ddtop

        # timing and logging
        t1 = time.time()
        dt = t1 - t0
        t0 = t1
        if iter_num % args.log_interval == 0 and master_process:
            # get loss as float. note: this is a CPU-GPU sync point
            lossf = loss.item() * gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, time {dt * 1000:.2f}ms")
        iter_num += 1

    if ddp:
        destroy_process_group()


if __name__ == "__main__":
    main()
