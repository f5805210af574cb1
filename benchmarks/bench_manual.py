"""
The hand-derived step (eager PyTorch, no autograd) against autograd's forward + backward
of the same GPT-2, side by side in one run: tokens/s and peak memory per step.
GPT-2 124M, batch 12 x 1024 by default; 3 warm-up and 10 timed steps each, median.

    python benchmarks/bench_manual.py            # on a CUDA GPU
Peak memory is what one step allocates above the weights (torch.cuda.max_memory_allocated
after reset, minus what was allocated before the step).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hetero_gpt as hg  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument('--batch_size', type=int, default=12)
p.add_argument('--block_size', type=int, default=1024)
p.add_argument('--n_layer', type=int, default=12)
p.add_argument('--n_embd', type=int, default=768)
p.add_argument('--n_head', type=int, default=12)
p.add_argument('--iters', type=int, default=10)
a = p.parse_args()

device = torch.device('cuda')
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
cfg = hg.GPTConfig(block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
torch.manual_seed(0)
model = hg.GPT(cfg).to(device)
params = dict(model.named_parameters())
x = torch.randint(cfg.vocab_size, (a.batch_size, a.block_size), device=device)
y = torch.randint(cfg.vocab_size, (a.batch_size, a.block_size), device=device)


def measure(fn):
    times = []
    for i in range(3 + a.iters):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base
        del out
    return a.batch_size * a.block_size / statistics.median(times[3:]), peak / 2**30


def autograd(dtype):
    ctx = torch.autocast('cuda', dtype=dtype) if dtype != torch.float32 else torch.autocast('cuda', enabled=False)

    def fn():
        for q in params.values():
            q.grad = None
        with ctx:
            _, loss = model(x, y)
        loss.backward()
        return {k: q.grad for k, q in params.items()}
    return fn


def manual(dtype, scale):
    w = {k: v.detach().to(dtype) for k, v in params.items()}  # the engine's weight buffers
    return lambda: hg.eager_loss_and_grads(cfg, w, x, y, dtype, device, scale)[1]


rows = [('fp32 (TF32 matmuls)', autograd(torch.float32), manual(torch.float32, 1.0)),
        ('bf16 (autograd: autocast; manual: bf16 weights)', autograd(torch.bfloat16), manual(torch.bfloat16, 1.0)),
        ('fp16 (autograd: autocast; manual: fp16, loss scale 1024)', autograd(torch.float16), manual(torch.float16, 1024.0))]
print(f"GPT-2 {sum(q.numel() for q in params.values()) / 1e6:.1f}M, batch {a.batch_size} x {a.block_size}, "
      f"{torch.cuda.get_device_name()}")
print("| precision | autograd tok/s | manual tok/s | manual/autograd | autograd peak GiB | manual peak GiB |")
print("|---|---|---|---|---|---|")
for name, ag, mn in rows:
    (ta, ma), (tm, mm) = measure(ag), measure(mn)
    print(f"| {name} | {ta:,.0f} | {tm:,.0f} | {tm / ta:.2f}x | {ma:.2f} | {mm:.2f} |", flush=True)
