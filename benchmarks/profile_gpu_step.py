"""Where does our GPU step stand against nanoGPT's, in one process? Five loops take turns, each
timed as nanoGPT's bench.py times its loop (mean ms of `--steps` steps, the host reading
loss.item() once a step), all at bench.py's config: GPT-2 124M, bias=False, vocabulary 50304,
batch 12 x 1024, fused AdamW:
  nanoGPT         nanoGPT's model.py and its optimizer;
  ours, plain     our model in the same plain loop;
  ours, step      the same model through HeteroStep, as hetero_gpt.py trains (batch on the GPU,
                  as bench.py's);
  ours, host batch  the same, the batch on the host (as hetero_gpt.py's get_batch makes it);
  ours, no wait   tools/fast_standin.NoWaitStep: the flag read after the update is queued.
The last three less the plain loop is what the step's machinery costs. --kernels adds the top CUDA
kernels of one forward+backward of each model, --gaps where each loop leaves the GPU idle
(torch.profiler's kernel timeline over 5 steps; the profiler slows the host a little).

    python -m benchmarks.profile_gpu_step --nanogpt .bench/nanoGPT --dtype bfloat16 [--compile]
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

import hetero_gpt as hg
from tools import fast_standin

p = argparse.ArgumentParser()
p.add_argument('--nanogpt', default='.bench/nanoGPT', help='a checkout of karpathy/nanoGPT (its model.py)')
p.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
p.add_argument('--compile', action='store_true')
p.add_argument('--rounds', type=int, default=5, help='turns of the five loops; a cell is the median')
p.add_argument('--steps', type=int, default=20, help='timed steps a turn (after 3 warm-up steps)')
p.add_argument('--kernels', action='store_true')
p.add_argument('--gaps', action='store_true')
a = p.parse_args()

# nanoGPT's model.py, from its checkout (not part of this repository), by its path
spec = importlib.util.spec_from_file_location('nanogpt_model', os.path.join(a.nanogpt, 'model.py'))
nano = sys.modules['nanogpt_model'] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nano)

cfg, _ = hg.parse_args(['--device', 'cuda', '--dtype', a.dtype, '--vocab_size', '50304', '--bias', 'False',
                        '--batch_size', '12', '--block_size', '1024', '--gradient_accumulation_steps', '1']
                       + (['--compile'] if a.compile else []))
cfg, run = hg.setup(cfg, set())
dev, dtype = run.device, run.dtype  # (TF32 on, as bench.py sets it)
torch.manual_seed(1337)
theirs = nano.GPT(nano.GPTConfig(block_size=1024, bias=False, dropout=0.0)).to(dev)
opt_t = theirs.configure_optimizers(1e-2, 1e-4, (0.9, 0.95), 'cuda')
ours = hg.GPT(hg.model_config(cfg)).to(dev)
opt_o = hg.make_optimizer(ours, cfg)
engine = hg.AutogradEngine(ours, dev, dtype, compile=a.compile)
step = hg.HeteroStep(ours, {'gpu': engine}, hg.Split(1, 0.0), optimizer=opt_o)
nowait = fast_standin.NoWaitStep(ours, {'gpu': engine}, hg.Split(1, 0.0), optimizer=opt_o)
fwd_t = torch.compile(theirs) if a.compile else theirs
x, y = (torch.randint(50304, (12, 1024), device=dev) for _ in range(2))
xh, yh = x.cpu(), y.cpu()


def plain(fwd, opt):  # bench.py's loop body
    def f():
        with engine.autocast:
            _, loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()
    return f


loops = {'nanoGPT': plain(fwd_t, opt_t), 'ours, plain': plain(engine.forward, opt_o),
         'ours, step': lambda: step.update(step([(x, y)]))['loss'],
         'ours, host batch': lambda: step.update(step([(xh, yh)]))['loss'],
         'ours, no wait': lambda: nowait.update(nowait([(x, y)]))['loss']}
ms = {k: [] for k in loops}
for r in range(a.rounds):  # in turns, so that a drift of the GPU's clocks touches all alike
    for name, fn in loops.items():
        for _ in range(3 if r else 10):  # warm-up (the first turn: compiling, cuBLAS's choices)
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            fn()
        torch.cuda.synchronize()
        ms[name].append(1000 * (time.perf_counter() - t0) / a.steps)
med = {k: statistics.median(v) for k, v in ms.items()}
print(f"dtype={a.dtype} compile={a.compile}: ms a step, the median of {a.rounds} turns of {a.steps} steps")
for name, v in ms.items():
    print(f"{name:17} {med[name]:8.3f} ms  ratio to nanoGPT {med[name] / med['nanoGPT']:.4f}  "
          f"less the plain loop {med[name] - med['ours, plain']:+.3f} ms  turns {' '.join(f'{t:.2f}' for t in v)}",
          flush=True)
if a.kernels:
    for name, m in (('nanoGPT', fwd_t), ('ours', engine.forward)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            plain(m, opt_t if name == 'nanoGPT' else opt_o)()
            torch.cuda.synchronize()
        print(f"==== {name}")
        print(prof.key_averages().table(sort_by='cuda_time_total', row_limit=22, max_name_column_width=70))
if a.gaps:
    for name, fn in loops.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, gaps, end = 0.0, [], ev[0][0]
        for (t0, t1, k), prev in zip(ev, [('', '', '')] + ev[:-1]):
            if t0 > end:
                gaps.append((t0 - end, prev[2][:40], k[:40]))
            busy += max(0.0, t1 - max(t0, end))
            end = max(end, t1)
        span = ev[-1][1] - ev[0][0]
        print(f"==== {name}: a step {span / 5000:.3f} ms, the GPU busy {busy / 5000:.3f} ms, idle {(span - busy) / 5000:.3f} "
              f"ms; the largest idle gaps (us, after -> before):")
        for g in sorted(gaps, reverse=True)[:8]:
            print(f"  {g[0]:8.1f}  {g[1]} -> {g[2]}")
