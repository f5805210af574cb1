"""Where does the hand-derived step (--fused_kernels, eager) lose to autograd? Times both
on GPT-2 124M, batch 12 x 1024, then prints the top CUDA kernels of one step of each
(torch.profiler), so the two kernel lists can be read side by side.

    python -m benchmarks.profile_manual [--dtype bfloat16]     # on a CUDA GPU, from the repository's root
"""
import argparse

import torch

import hetero_gpt as hg
from benchmarks.cuda_timing import timeit
from tools import fast_standin as standin

p = argparse.ArgumentParser()
p.add_argument('--dtype', default='bfloat16')
p.add_argument('--rows', type=int, default=30, help='kernels listed per side')
a = p.parse_args()
dtype = getattr(torch, a.dtype)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
dev = torch.device('cuda')
cfg = hg.GPTConfig()
torch.manual_seed(0)
model = hg.GPT(cfg).to(dev)
params = dict(model.named_parameters())
x, y = (torch.randint(cfg.vocab_size, (12, 1024), device=dev) for _ in range(2))
w = {k: v.detach().to(dtype) for k, v in params.items()}
scale = 1024.0 if dtype == torch.float16 else 1.0


def autograd():
    model.zero_grad(set_to_none=True)
    with torch.autocast('cuda', dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(x, y)
    loss.backward()


ops = standin.FusedOps(dtype, dev)


def manual():
    return hg.eager_loss_and_grads(ops, cfg, w, x, y, scale)


timeit('autograd forward+backward', autograd)
timeit('manual (fused kernels)', manual)
for name, f in (('autograd', autograd), ('manual', manual)):
    f()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    total = sum(e.self_device_time_total for e in ev) / 1e3
    print(f"==== {name}: {total:.2f} ms of kernels (sum of device time)")
    print(ev.table(sort_by='self_cuda_time_total', row_limit=a.rows, max_name_column_width=150))
