"""
The GPU engine's training step at nanoGPT's bench.py settings: GPT-2 124M, batch 12 x 1024,
10 warm-up and 20 timed steps (forward, backward, AdamW), as hetero_gpt.py trains it
(AutogradEngine + HeteroStep + fused AdamW; --fast: tools/fast_standin.py's classes). Prints ms/iter (the timed loop's mean,
as bench.py times it: one wait before and one after) and tokens/s.

    python -m benchmarks.bench_gpu --dtype bfloat16 --compile     # from the repository's root
"""
import argparse
import time

import torch

import hetero_gpt as hg

p = argparse.ArgumentParser()
p.add_argument('--dtype', default='bfloat16')
p.add_argument('--compile', action='store_true')
p.add_argument('--vocab_size', type=int, default=50257)
p.add_argument('--batch_size', type=int, default=12)
p.add_argument('--block_size', type=int, default=1024)
p.add_argument('--bias', default='True', help="False: nanoGPT's bias=False (its bench.py default)")
p.add_argument('--fast', action='store_true', help="tools/fast_standin.py's classes: the LM head padded to 64 rows, no host wait")
a = p.parse_args()

cfg, _ = hg.parse_args(['--device', 'cuda', '--dtype', a.dtype, '--vocab_size', str(a.vocab_size),
                        '--batch_size', str(a.batch_size), '--block_size', str(a.block_size),
                        '--gradient_accumulation_steps', '1', '--bias', a.bias] + (['--compile'] if a.compile else []))
cfg, run = hg.setup(cfg, set())
device, dtype = run.device, run.dtype
classes = hg.Classes()
if a.fast:
    from tools import fast_standin  # defines: classes (its model and step)
    classes = fast_standin.classes(cfg)
torch.manual_seed(1337)
model = classes.model(hg.model_config(cfg)).to(device)
optimizer = hg.make_optimizer(model, cfg)
step = classes.step(model, hg.build_engines(cfg, model, run), hg.Split(1, 0.0), optimizer=optimizer)
x = torch.randint(a.vocab_size, (a.batch_size, a.block_size), device=device)
y = torch.randint(a.vocab_size, (a.batch_size, a.block_size), device=device)
for k in range(10):  # warm-up
    step.update(step([(x, y)]))
torch.cuda.synchronize()
t0 = time.perf_counter()
for k in range(20):  # timed as bench.py times: the loop between two waits, the step's own reads inside
    step.update(step([(x, y)]))
torch.cuda.synchronize()
ms = 1000 * (time.perf_counter() - t0) / 20
print(f"heterogpt dtype={a.dtype} compile={a.compile} vocab={a.vocab_size} bias={a.bias} fast={a.fast} "
      f": time per iteration: {ms:.4f}ms, {a.batch_size * a.block_size / (ms / 1000):.0f} tokens/s, "
      f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
