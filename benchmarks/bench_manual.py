"""
The hand-derived step (eager PyTorch, no autograd) against autograd's forward + backward
of the same GPT-2, side by side in one run: tokens/s and peak memory per step.
GPT-2 124M, batch 12 x 1024 by default; 3 warm-up and 10 timed steps each, median.

    python benchmarks/bench_manual.py            # on a CUDA GPU

Eager rows for fp32, bf16 and fp16; then, for --compiled dtypes, both sides under
torch.compile (autograd: the compiled model; manual: the derivation's pieces compiled by
TorchOps.fused, as `--compile` does for the eager engine).
Then rows with --fused_kernels and with the step replayed as a CUDA graph (as the hetero
engine runs it). Peak memory is what one step allocates above the weights (torch.cuda.max_memory_allocated
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
p.add_argument('--compiled', default='bfloat16,float16', help="dtypes to also time compiled ('' for none)")
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


def autograd(dtype, compile=False):
    ctx = torch.autocast('cuda', dtype=dtype) if dtype != torch.float32 else torch.autocast('cuda', enabled=False)
    forward = torch.compile(model) if compile else model

    def fn():
        for q in params.values():
            q.grad = None
        with ctx:
            _, loss = forward(x, y)
        loss.backward()
        return {k: q.grad for k, q in params.items()}
    return fn


def manual(dtype, scale, compile=False, fused=False):
    w = {k: v.detach().to(dtype) for k, v in params.items()}  # the engine's weight buffers
    return lambda: hg.eager_loss_and_grads(cfg, w, x, y, dtype, device, scale, compile, fused)[1]


def graphed(dtype, scale, fused):
    """The eager engine as hetero mode runs it on CUDA: its step captured once as a CUDA
    graph and replayed. Replays allocate nothing: the graph's pool was filled at capture,
    before measure() takes its baseline, so the capture's peak above the weight buffer is
    added to the row's peak (fn.held)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng = hg.EagerEngine(cfg, device, dtype, hg.LossScaler(scale, 10**9), graph_shape=(a.batch_size, a.block_size),
                         fused_kernels=fused)
    eng.load_weights(params)
    torch.cuda.synchronize()
    fn = lambda: eng.loss_and_grads(x, y)[1]
    fn.held = torch.cuda.max_memory_allocated() - before - eng.flat.numel() * eng.flat.element_size()
    return fn


names = {torch.float32: 'fp32 (TF32 matmuls)', torch.bfloat16: 'bf16 (autograd: autocast; manual: bf16 weights)',
         torch.float16: 'fp16 (autograd: autocast; manual: fp16, loss scale 1024)'}
scales = {torch.float32: 1.0, torch.bfloat16: 1.0, torch.float16: 1024.0}
# each row: (name, make autograd's step, make the manual step), made when the row is measured
rows = [(name, lambda d=d: autograd(d), lambda d=d: manual(d, scales[d])) for d, name in names.items()]
for fused in (False, True):  # compiled, with every piece spelled out or by PyTorch's fused kernels
    rows += [(names[d] + ', both compiled' + (', manual: fused kernels' if fused else ''),
              lambda d=d: autograd(d, True), lambda d=d, f=fused: manual(d, scales[d], True, f))
             for d in (getattr(torch, n) for n in a.compiled.split(',') if n)]
# --fused_kernels (every piece PyTorch has a fused kernel for: TorchOps.fused_kernels), eager and as
# the CUDA graph the hetero engine replays; autograd eager beside each
for tag, make in ((', manual: fused kernels', lambda d: manual(d, scales[d], fused=True)),
                  (', manual: fused kernels + CUDA graph', lambda d: graphed(d, scales[d], True)),
                  (', manual: CUDA graph', lambda d: graphed(d, scales[d], False))):
    rows += [(names[d] + tag, lambda d=d: autograd(d), lambda d=d, make=make: make(d)) for d in names]
print(f"GPT-2 {sum(q.numel() for q in params.values()) / 1e6:.1f}M, batch {a.batch_size} x {a.block_size}, "
      f"{torch.cuda.get_device_name()}")
print("| precision | autograd tok/s | manual tok/s | manual/autograd | autograd peak GiB | manual peak GiB |")
print("|---|---|---|---|---|---|")
for name, make_ag, make_mn in rows:
    ag = make_ag()
    ta, ma = measure(ag)
    del ag
    mn = make_mn()  # after autograd's row: a CUDA graph's pool is not held while autograd runs
    tm, mm = measure(mn)
    mm += getattr(mn, 'held', 0) / 2**30
    del mn
    torch.cuda.empty_cache()
    print(f"| {name} | {ta:,.0f} | {tm:,.0f} | {tm / ta:.2f}x | {ma:.2f} | {mm:.2f} |", flush=True)
