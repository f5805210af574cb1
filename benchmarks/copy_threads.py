"""One copy of GPT-2 124M's gradients (475 MiB of fp32) out of one NumPy block into another, as
the parent copies the ANE worker's gradients (plumbing/worker.py), with N of PyTorch's CPU threads:
alone, and beside a thread that keeps launching CUDA kernels (as the GPU engine's does). With a
thread on every core, the one that shares the busy thread's core finishes last.

    python -m benchmarks.copy_threads       # medians of 9 copies, ms
"""
import os
import statistics
import threading
import time

import numpy as np
import torch


def copy_ms(src, numpy=False):
    """One copy of src, as WorkerEngine.loss_and_grads copies the gradients: into memory faulted in first
    (while the worker computes), by PyTorch's copy_ on its threads (torch.set_num_threads), or with numpy
    by NumPy's copyto (one thread)."""
    dst = np.empty_like(src)
    dst.fill(0)
    t0 = time.perf_counter()
    if numpy:
        np.copyto(dst, src)
    else:
        torch.from_numpy(dst).copy_(torch.from_numpy(src))
    return 1e3 * (time.perf_counter() - t0)


def main():
    src, stop = np.ones(124_000_000, np.float32), threading.Event()

    def launching():  # a thread that feeds the GPU, as the GPU engine's does
        x = torch.randn(256, 256, device='cuda' if torch.cuda.is_available() else 'cpu')
        while not stop.is_set():
            for _ in range(50):
                x = x * 1.0001
            x.sum().item()

    cores = os.cpu_count()
    counts = [c for c in dict.fromkeys((cores, cores - 1, cores - 2, cores // 2)) if c > 0] + ['numpy']
    before = torch.get_num_threads()
    print(f"{cores} cores; 475 MiB a copy, the median of 9 (min-max), ms")
    for beside in (None, launching):
        if beside:
            stop.clear()
            th = threading.Thread(target=beside, daemon=True)
            th.start()
            time.sleep(0.2)
        for n in counts:
            if n != 'numpy':
                torch.set_num_threads(n)
            ts = [copy_ms(src, numpy=n == 'numpy') for _ in range(9)]
            print(f"{'beside a launching thread' if beside else 'alone':26} {n!s:>5} threads: "
                  f"{statistics.median(ts):7.2f} ({min(ts):.2f}-{max(ts):.2f})", flush=True)
        if beside:
            stop.set()
            th.join()
    torch.set_num_threads(before)


if __name__ == '__main__':
    main()
