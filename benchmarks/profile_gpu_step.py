"""Where does our bf16 GPU step lose to nanoGPT's (same architecture: bias=True)? Times
forward+backward alone and the whole step (+ fused AdamW; ours through HeteroStep), then
prints the top CUDA kernels of one forward+backward of each model (torch.profiler).

    NANOGPT=.bench/nanoGPT python -m benchmarks.profile_gpu_step     # from the repository's root
"""
import importlib.util
import os
import sys

import torch

import hetero_gpt as hg
from benchmarks.cuda_timing import timeit

# nanoGPT's model.py, from its checkout (not part of this repository), by its path
nanogpt = os.environ.get('NANOGPT', '.bench/nanoGPT')
spec = importlib.util.spec_from_file_location('nanogpt_model', os.path.join(nanogpt, 'model.py'))
nano = sys.modules['nanogpt_model'] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nano)

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
dev = torch.device('cuda')
torch.manual_seed(0)
ours = hg.GPT(hg.GPTConfig()).to(dev)
theirs = nano.GPT(nano.GPTConfig(bias=True, dropout=0.0)).to(dev)
x, y = (torch.randint(50257, (12, 1024), device=dev) for _ in range(2))


def fwd_bwd(m):
    def f():
        m.zero_grad(set_to_none=True)
        with torch.autocast('cuda', dtype=torch.bfloat16):
            _, loss = m(x, y)
        loss.backward()
    return f


timeit('nanoGPT bias=True: forward+backward', fwd_bwd(theirs))
timeit('ours: forward+backward', fwd_bwd(ours))
opt_t = theirs.configure_optimizers(0.1, 6e-4, (0.9, 0.95), 'cuda')
cfg = hg.Config()
opt_o = hg.make_optimizer(ours, cfg, dev)
step = hg.HeteroStep(ours, {'gpu': hg.AutogradEngine(ours, dev, torch.bfloat16)}, hg.Split(1, '0'), optimizer=opt_o)


def theirs_step():
    fwd_bwd(theirs)()
    opt_t.step()


def ours_step():
    step.update(step([(x, y)]))


timeit('nanoGPT: forward+backward+AdamW', theirs_step)
timeit('ours: HeteroStep+AdamW', ours_step)
timeit('ours: HeteroStep alone', lambda: step([(x, y)]))
for name, m in (('nanoGPT', theirs), ('ours', ours)):
    f = fwd_bwd(m)
    f()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    print(f"==== {name}")
    print(prof.key_averages().table(sort_by='cuda_time_total', row_limit=22, max_name_column_width=70))
