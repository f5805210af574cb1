"""How often the exchange with the ANE worker waits for the GIL, counted where it can be: beside
a thread that runs pure Python, which gives the GIL up only when the switch interval (set to 20
ms) has passed. A call that releases the GIL for longer than a thread takes to wake then waits an
interval to take it back, so (time beside - time alone) / interval counts those waits. This
process copies on one thread, so that the spinning thread and the copies each have a core. GPT-2 124M's shapes (148
tensors) at a context of 64, the eager derivation in the worker on the CPU.

    python -m benchmarks.gil_waits [--n_embd 64 --vocab_size 512]     # from the repository's root
"""
import argparse
import dataclasses
import statistics
import sys
import threading
import time

import torch

import hetero_gpt as hg
from plumbing import settings, worker

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_flags(p, hg.GPTConfig)
    p.set_defaults(block_size=64)
    cfg = hg.GPTConfig(**{f.name: getattr(p.parse_args(), f.name) for f in dataclasses.fields(hg.GPTConfig)})
    torch.set_num_threads(1)
    spec = hg.AneSpec(cfg, T=cfg.block_size, max_batch=1)
    w = worker.WorkerEngine(spec, hg.engine_from_spec, hg.LossScaler(1.0, 0, enabled=False))
    sys.setswitchinterval(interval := 0.02)  # the interval under test
    params = dict(hg.GPT(cfg).named_parameters())
    batch = tuple(torch.randint(0, cfg.vocab_size, (1, cfg.block_size)) for _ in range(2))
    calls = {'load_weights': lambda: w.load_weights(params),
             'loss_and_grads, minus the worker': lambda: w.loss_and_grads(*batch) and -w.seconds}
    stop, res = [False], {}

    def spin():  # pure Python: keeps the GIL until the interpreter asks for it
        while not stop[0]:
            pass
    try:
        for phase in ('alone', 'beside'):
            stop[0], t = False, threading.Thread(target=spin) if phase == 'beside' else None
            if t:
                t.start()
            for name, fn in calls.items():
                ts = []
                for _ in range(12):
                    t0 = time.perf_counter()
                    extra = fn() or 0.0
                    ts.append(time.perf_counter() - t0 + extra)
                res[name, phase] = statistics.median(ts[2:])
            stop[0] = True
            if t:
                t.join()
    finally:
        w.close()
    print(f"{len(params)} tensors; switch interval {interval * 1e3:.0f} ms")
    for name in calls:
        a, b = res[name, 'alone'], res[name, 'beside']
        print(f"{name:34} alone {a * 1e3:7.2f} ms, beside pure Python {b * 1e3:7.2f} ms: "
              f"{(b - a) / interval:5.1f} waits for the GIL")
