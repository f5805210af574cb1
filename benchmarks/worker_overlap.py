"""
The Mac's structure where it can be measured: one process-bound engine beside the GPU.
The GPU engine (autograd, in this process) and the ANE worker (ane_worker.py, the eager
derivation on the CPU in its own process), each alone and then both at once, side by side
in one run; and the cost of one exchange with the worker beyond its own compute.

    python benchmarks/worker_overlap.py                          # GPT-2 124M; CUDA for the GPU engine
    python benchmarks/worker_overlap.py --n_layer 2 --n_embd 64 --n_head 2 --block_size 64 --gpu_batch 8

Prints, per engine, the median seconds per microbatch alone and while the other computes,
and their ratio (the goal: within 3%); per exchange, the parent's wall time minus the
worker's own, and the part of it that is the copy of the gradients out of shared memory.
"""
import argparse
import dataclasses
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
import ane_worker  # noqa: E402
import hetero_gpt as hg  # noqa: E402
import settings  # noqa: E402


def median(xs):
    return float(np.median(xs))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_flags(p, hg.GPTConfig)
    p.add_argument('--gpu_batch', type=int, default=8, help="GPU engine's sequences per microbatch")
    p.add_argument('--ane_batch', type=int, default=1, help="worker's sequences per call")
    p.add_argument('--dtype', default='bfloat16', help="GPU engine's precision")
    p.add_argument('--ane_dtype', default='float32', help="worker's precision (CPU)")
    p.add_argument('--threads', type=int, default=max(1, os.cpu_count() - 1), help="worker's CPU threads")
    p.add_argument('--gpu_iters', type=int, default=30)
    p.add_argument('--ane_iters', type=int, default=5)
    a = p.parse_args()
    cfg = hg.GPTConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(hg.GPTConfig)})
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if dev.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = hg.GPT(cfg).to(dev)
    gpu = hg.AutogradEngine(model, dev, getattr(torch, a.dtype))
    spec = dict(cfg=dataclasses.asdict(cfg), B=a.ane_batch, T=cfg.block_size, max_batch=a.ane_batch,
                evaluator='eager', dtype=a.ane_dtype, threads=a.threads, programs=None)
    w = ane_worker.WorkerEngine(spec, hg.LossScaler(1.0, 0, enabled=False))
    print(f"GPU engine: {gpu.label}, {a.gpu_batch}x{cfg.block_size} a microbatch; worker: {w.label}, "
          f"{a.ane_batch}x{cfg.block_size} a call, {a.threads} threads; {cfg}")
    rand = lambda b: tuple(torch.randint(0, cfg.vocab_size, (b, cfg.block_size)) for _ in range(2))
    gb, ab = rand(a.gpu_batch), rand(a.ane_batch)
    w.load_weights(dict(model.named_parameters()))

    def gpu_times(n, stop=None):
        out = []
        while len(out) < n or (stop is not None and not stop.is_set()):
            t0 = time.perf_counter()
            loss, _ = gpu.loss_and_grads(*gb)
            float(loss)  # waits for the device (CUDA releases the GIL while it waits)
            out.append(time.perf_counter() - t0)
            if stop is None and len(out) >= n:
                break
        return out

    exchanges = {}  # phase -> [(the parent's wall time, the worker's own time)] per call

    def ane_times(n, stop=None):
        out = []
        while len(out) < n or (stop is not None and not stop.is_set()):
            t0 = time.perf_counter()
            w.loss_and_grads(*ab)
            out.append(time.perf_counter() - t0)
            exchanges.setdefault(phase, []).append((out[-1], w.per_seq[-1] * a.ane_batch))
            if stop is None and len(out) >= n:
                break
        return out

    phase = 'warm-up'
    gpu_times(5), ane_times(1)  # warm-up: kernels, allocator, the worker's first call
    phase = 'alone'
    res = {'gpu alone': gpu_times(a.gpu_iters), 'ane alone': ane_times(a.ane_iters)}
    phase = 'beside the GPU'  # (the GPU thread holds the GIL between kernel launches)
    for busy, measured, fn_busy, fn_measured, n in (('ane', 'gpu', ane_times, gpu_times, a.gpu_iters),
                                                     ('gpu', 'ane', gpu_times, ane_times, a.ane_iters)):
        stop = threading.Event()
        bg = threading.Thread(target=fn_busy, args=(1, stop))
        bg.start()
        time.sleep(0.5)  # the other engine well under way
        res[f'{measured} beside {busy}'] = fn_measured(n)
        stop.set()
        bg.join()
    for name in ('gpu', 'ane'):
        alone, beside = median(res[f'{name} alone']), median(res[f"{name} beside {'ane' if name == 'gpu' else 'gpu'}"])
        print(f"{name}: {alone * 1e3:9.2f} ms a microbatch alone, {beside * 1e3:9.2f} ms beside the other "
              f"(ratio {beside / alone:.3f}; spread alone {100 * np.std(res[f'{name} alone']) / alone:.1f}%)")
    nbytes = sum(v.nbytes for v in w.bufs.g.values())
    t0 = time.perf_counter()
    for _ in range(5):
        {k: torch.from_numpy(v).clone() for k, v in w.bufs.g.items()}
    copy = (time.perf_counter() - t0) / 5
    print(f"copying the {nbytes / 2**20:.0f} MiB of gradients out of shared memory: {copy * 1e3:.2f} ms "
          f"({nbytes / copy / 1e9:.1f} GB/s)")
    for ph in ('alone', 'beside the GPU'):
        over = median([wall - inner for wall, inner in exchanges[ph]])
        print(f"exchange {ph}: the parent's wall time minus the worker's own, median {over * 1e3:.2f} ms over "
              f"{len(exchanges[ph])} calls; less the copy: {1e3 * (over - copy):.2f} ms (Python's GIL switch "
              f"interval: {sys.getswitchinterval() * 1e3:.0f} ms)")
    w.close()


if __name__ == '__main__':
    main()
