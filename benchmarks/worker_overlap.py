"""
The Mac's structure where it can be measured: one process-bound engine beside the GPU.
The GPU engine (autograd, in this process) and the ANE worker (plumbing/worker.py, the eager
derivation on the CPU in its own process), each alone and then both at once, side by side
in one run; and the cost of one exchange with the worker beyond its own compute.

    python -m benchmarks.worker_overlap                          # GPT-2 124M; CUDA for the GPU engine
    python -m benchmarks.worker_overlap --n_layer 2 --n_embd 64 --n_head 2 --block_size 64 --gpu_batch 8

Prints, per engine, the median seconds per microbatch alone and while the other computes,
and their ratio (the goal: within 3%); per exchange, the parent's wall time minus the
worker's own, alone and beside the GPU engine (the goal: within 5 ms of alone), and the part
of it that is the copy of the gradients out of shared memory.
"""
import argparse
import dataclasses
import os
import sys

import numpy as np
import torch

import hetero_gpt as hg
from benchmarks import copy_threads
from plumbing import settings
from tools import ane_check


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
    r = ane_check.overlap(cfg, a.gpu_batch, a.ane_batch, dev, gpu_iters=a.gpu_iters, ane_iters=a.ane_iters,
                           dtype=getattr(torch, a.dtype), ane_dtype=a.ane_dtype, threads=a.threads,
                           ane_microbatch=a.ane_batch)
    print(f"GPU engine: {r['gpu_label']}, {a.gpu_batch}x{cfg.block_size} a microbatch; worker: {r['ane_label']}, "
          f"{a.ane_batch}x{cfg.block_size} a call, {a.threads} threads; {cfg}")
    for name in ('gpu', 'ane'):
        print(f"{name}: {r[name + '_alone'] * 1e3:9.2f} ms a microbatch alone, {r[name + '_beside'] * 1e3:9.2f} ms "
              f"beside the other (ratio {r[name + '_beside'] / r[name + '_alone']:.3f}; spread alone "
              f"{100 * r[name + '_alone_spread']:.1f}%)")
    nbytes = 4 * sum(p.numel() for n, p in hg.gpt_param_shapes(cfg).items() if n != 'lm_head.weight')
    src = np.ones(nbytes // 4, np.float32)
    copy = sum(copy_threads.copy_ms(src) for _ in range(5)) / 5 / 1e3  # seconds, the mean of 5
    print(f"copying {nbytes / 2**20:.0f} MiB of gradients out of shared memory: {copy * 1e3:.2f} ms "
          f"({nbytes / copy / 1e9:.1f} GB/s)")
    alone, beside = r['exchange_alone'], r['exchange_beside']
    print(f"exchange (the parent's wall time minus the worker's own), median: alone {alone * 1e3:.2f} ms, beside the "
          f"GPU engine {beside * 1e3:.2f} ms: {(beside - alone) * 1e3:+.2f} ms (goal: within 5); less the copy "
          f"{(alone - copy) * 1e3:.2f} / {(beside - copy) * 1e3:.2f} ms (GIL switch interval: {sys.getswitchinterval() * 1e3:.1f} ms, as training sets it)")


if __name__ == '__main__':
    main()
