"""The timing loop the profile scripts share: warm-up calls, then the median of n calls,
each between two CUDA synchronizations (so it holds all of the call's device work)."""
import statistics
import time

import torch


def timeit(name, fn, n=10, warmup=3, width=50):
    ts = []
    for i in range(warmup + n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    print(f"{name:{width}} {1000 * statistics.median(ts[warmup:]):8.2f} ms", flush=True)
