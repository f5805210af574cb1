"""The fixed cost of one exchange with the ANE worker: the parent's wall time per call
minus the worker's own, for a tiny model (grads of a 100-token vocabulary) and for
gradients of 13 MiB (GPT-2's vocabulary), at several worker thread counts; and the time
to copy those gradients out of shared memory.   python -m benchmarks.exchange_probe"""
import time

import numpy as np
import torch

import hetero_gpt as hg
from plumbing import worker

if __name__ == '__main__':
    for V, thr in ((100, 1), (50257, 1), (50257, 2), (50257, 8)):
        cfg = hg.GPTConfig(block_size=64, vocab_size=V, n_layer=2, n_head=2, n_embd=64)
        spec = hg.AneSpec(cfg, T=64, max_batch=1, threads=thr)
        w = worker.WorkerEngine(spec, hg.engine_from_spec, hg.LossScaler(1.0, 0, enabled=False))
        w.load_weights(dict(hg.GPT(cfg).named_parameters()))
        b = tuple(torch.randint(0, V, (1, 64)) for _ in range(2))
        ov, inner = [], []
        for i in range(60):
            t0 = time.perf_counter(); w.loss_and_grads(*b); ov.append(time.perf_counter() - t0 - w.seconds); inner.append(w.seconds)
        t0 = time.perf_counter()
        for i in range(20): {k: torch.from_numpy(v).clone() for k, v in w.bufs.g.items()}
        print(V, thr, 'overhead ms %.2f' % (np.median(ov[10:]) * 1e3), 'clone ms %.2f' % ((time.perf_counter() - t0) / 20 * 1e3), 'inner ms %.2f' % (np.median(inner) * 1e3), 'parent threads', torch.get_num_threads())
        w.close()
