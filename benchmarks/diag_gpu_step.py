"""Where does the GPU engine's step time go? Times the layers of the training step one at
a time (bf16 autocast, GPT-2 124M, 12 x 1024): bare forward+backward, the engine's
loss_and_grads (with and without its own CUDA stream), the whole HeteroStep, + AdamW."""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hetero_gpt as hg  # noqa: E402

V = int(os.environ.get('VOCAB', 50304))
dev = torch.device('cuda')
torch.manual_seed(0)
model = hg.GPT(hg.GPTConfig(vocab_size=V)).to(dev)
x, y = (torch.randint(V, (12, 1024), device=dev) for _ in range(2))
params = list(model.parameters())


def timeit(name, fn, n=10):
    ts = []
    for i in range(3 + n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    print(f"{name:55} {1000 * statistics.median(ts[3:]):8.2f} ms", flush=True)


def bare():
    for p in params:
        p.grad = None
    with torch.autocast('cuda', dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()


timeit('bare fwd+bwd (backward outside autocast)', bare)
eng = hg.AutogradEngine(model, dev, torch.bfloat16)
timeit('AutogradEngine.loss_and_grads (own stream)', lambda: eng.loss_and_grads(x, y))
eng.stream = None
timeit('AutogradEngine.loss_and_grads (default stream)', lambda: eng.loss_and_grads(x, y))
eng = hg.AutogradEngine(model, dev, torch.bfloat16)
step = hg.HeteroStep(model, {'gpu': eng}, hg.Split(1, '0'))
timeit('HeteroStep (thread, sum, finite check, average)', lambda: step([(x, y)]))
opt = hg.make_optimizer(model, hg.Config(), dev)


def full():
    step([(x, y)])
    opt.step()
    opt.zero_grad(set_to_none=True)


timeit('HeteroStep + fused AdamW', full)
timeit('fused AdamW alone', lambda: opt.step())
g = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
timeit('grads_finite', lambda: hg.grads_finite(g))
