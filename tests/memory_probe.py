"""A CPU training run's peak memory beside memory.memory_estimate (tests/test_check.py):
PYTHONPATH=. python tests/memory_probe.py L C T B V prints the measured and estimated bytes."""
import sys

import torch

import hetero_gpt as hg
from plumbing import memory, settings


def status(key):  # Linux: VmRSS, this process's resident memory now; VmHWM, its peak since the last reset
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


if __name__ == '__main__':
    L, C, T, B, V = map(int, sys.argv[1:6])
    cfg = hg.Config(n_layer=L, n_head=4, n_embd=C, block_size=T, batch_size=B, vocab_size=V,
                    gradient_accumulation_steps=1)
    torch.manual_seed(0)
    batch = [tuple(torch.randint(0, V, (B, T)) for _ in range(2))]
    base = status('VmRSS')  # PyTorch imported, nothing of the run made yet
    with open('/proc/self/clear_refs', 'w') as f:  # the peak from here on (importing a CUDA build peaks higher)
        f.write('5')
    cpu = torch.device('cpu')
    run = settings.Run('gpu', cpu, torch.float32, cpu, torch.float16, ane_in_worker=False, ane_programs=False,
                       ane_batch_size=settings.ane_batch_size(cfg), ane_fraction=0.0)
    model, opt, engines, step, meter = hg.build_run(cfg, run, log=lambda s: None)
    for _ in range(3):
        step.update(step(batch))
    peak = status('VmHWM')
    print(peak - base, memory.memory_estimate(cfg, 'gpu', torch.device('cpu'), torch.float32, hg.model_sizes(cfg), settings.ane_batch_size(cfg))['total'])
