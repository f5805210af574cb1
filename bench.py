"""
GPU-only, ANE-only and hetero side by side in one process, on the same batches from the
same initial weights: the paper's table (tokens/s, x GPU-only, joules per token). As
nanoGPT's bench.py, it is the training loop's meat without the rest.

    python bench.py [any hetero_gpt.py flag] [--bench_iters 10] [--bench_repeats 3] [--fast]

--fast runs the classes of tools/fast_standin.py (the off-Mac speed) in place of the reference's.
"""
import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass

import torch

import hetero_gpt as hg  # defines: Config, Classes, setup, load_data, build_run, step_batches, main
from plumbing import progress  # defines: Ticker, clock (each mode's time while it runs)


@dataclass
class BenchConfig(hg.Config):
    bench_iters: int = hg.setting(10, "timed steps per mode and round (after >= 5 warm-up steps and 3 s)")
    bench_repeats: int = hg.setting(3, "rounds: the modes take turns, each reports its median round")
    fast: bool = hg.setting(False, "run tools/fast_standin.py's model and stand-in")
    fused_kernels: bool = hg.setting(False, "with --fast: the stand-in's pieces as fused kernels")
    plot: str = hg.setting('', "also draw the table as bars in this PNG file (needs matplotlib)")


def device_synchronize(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    elif device.type == 'mps':  # torch.mps.synchronize() holds the GIL while it waits (coreml_and_ane.md
        torch.ones((), device=device).item()  # section 1); .item() waits for MPS's one queue without it


def bench_mode(cfg, run, data, init, tok_per_step, n_tok, ticker, classes):
    """One mode built, warmed up, timed for bench_repeats rounds and freed: its row. ticker.what
    says which part runs."""
    model, optimizer, engines, step, meter = hg.build_run(cfg, run, classes=classes)
    device, mode = run.device, run.mode
    try:
        model.load_state_dict(init)
        threads = torch.get_num_threads()  # hetero with a CPU engine leaves a core free
        rd = dict(tok_s=[], joules=[], engine_s={}, step_s=[])

        def sync():  # every engine's work done, so that a round's time holds all of it
            for d in {device} | {e.device for e in engines.values()}:
                device_synchronize(d)

        def train_step(it):
            torch.set_num_threads(threads)
            return step.update(step(hg.step_batches(cfg, data['train'], it)))

        w, start = 0, time.perf_counter()  # warm-up: at least 5 steps and 3 s (clocks, allocator, the auto split)
        while w < 5 or time.perf_counter() - start < 3.0:
            ticker.what = f"  {mode}: warm-up step {w + 1}"
            train_step(w)
            w += 1
        for r in range(cfg.bench_repeats):
            sync()
            t0, j0 = time.perf_counter(), meter.joules()
            for i in range(cfg.bench_iters):
                ticker.what = f"  {mode}: round {r + 1}/{cfg.bench_repeats}, step {i + 1}/{cfg.bench_iters}"
                t = time.perf_counter()
                out = train_step(10**6 + r * cfg.bench_iters + i)  # the same batches in every mode
                rd['step_s'].append(time.perf_counter() - t)
                for n, res in out.shares.items():
                    rd['engine_s'].setdefault(n, []).append(res.seconds)
            sync()
            dt, j = time.perf_counter() - t0, meter.joules()
            rd['tok_s'].append(tok_per_step * cfg.bench_iters / dt)
            rd['joules'].append(None if j is None else j - j0)
        return dict(tok_s=statistics.median(rd['tok_s']), rounds=[round(x) for x in rd['tok_s']],
                    j_tok=None if None in rd['joules'] else sum(rd['joules']) / n_tok,
                    split=f"{out.ane_share}/{step.split.microbatches}" if mode == 'hetero' else '-',
                    engines=' + '.join(e.label for e in engines.values()), meter=meter.name,
                    # where a step's time goes: each engine's share (in parallel), the whole step
                    ms_step=1000 * statistics.median(rd['step_s']),
                    ms_engines={n: round(1000 * statistics.median(v), 1) for n, v in rd['engine_s'].items()})
    finally:
        meter.close()
        for e in engines.values():  # the ANE worker's process and shared memory, now
            if hasattr(e, 'close'):
                e.close()
        del model, optimizer, engines, step
        gc.collect()
        if device.type == 'mps':  # (its allocator keeps freed memory, which the host shares)
            torch.mps.empty_cache()


def compare(rows):
    """The paper's ratios: each mode's (tokens/s over GPU-only's, energy per token against
    GPU-only's in percent, None without a meter), and hetero's tokens/s over the sum of the
    two engines' alone (1.0: the engines overlap perfectly)."""
    g = rows['gpu']
    against_gpu = {mode: (r['tok_s'] / g['tok_s'],
                          100 * (r['j_tok'] / g['j_tok'] - 1) if r['j_tok'] is not None and g['j_tok'] else None)
                   for mode, r in rows.items()}
    return against_gpu, rows['hetero']['tok_s'] / (g['tok_s'] + rows['ane']['tok_s'])


def bench(cfg, given):
    """Each mode in turn (gpu, ane, hetero) is built, warmed up, timed for bench_repeats rounds
    (its median round reported) and freed before the next: on a Mac the three at once would
    not fit the 16-24 GB that the GPU and the ANE share with the host."""
    if min(cfg.bench_iters, cfg.bench_repeats) < 1:
        raise hg.UserError("--bench_iters and --bench_repeats must be at least 1")
    chart = chart_maker(cfg.plot)  # --plot's needs, found before any benchmark
    cfg, run = hg.setup(cfg, given)
    classes = hg.Classes()
    if cfg.fast:
        try:
            from tools import fast_standin  # defines: classes (its model, stand-in and step)
        except ImportError:
            raise hg.UserError("--fast needs tools/fast_standin.py, which is absent") from None
        classes = fast_standin.classes(cfg)
    data = hg.load_data(cfg)
    torch.manual_seed(cfg.seed)
    init = classes.model(hg.model_config(cfg)).state_dict()
    tok_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    n_tok = tok_per_step * cfg.bench_iters * cfg.bench_repeats
    rows = {}
    for mode in ('gpu', 'ane', 'hetero'):
        print(f"{mode}: building, warming up (5 steps and 3 s), then {cfg.bench_repeats} rounds of "
              f"{cfg.bench_iters} steps", flush=True)
        ticker = progress.Ticker(f"  {mode}: building").__enter__()
        try:
            rows[mode] = bench_mode(cfg, dataclasses.replace(run, mode=mode), data, init, tok_per_step, n_tok, ticker, classes)
        finally:
            ticker.__exit__()
        r = rows[mode]
        print(f"  {mode}: {r['tok_s']:,.0f} tokens/s (rounds: {', '.join(f'{x:,}' for x in r['rounds'])}), "
              f"{r['ms_step']:.4g} ms a step ({', '.join(f'{n} {v:.4g} ms' for n, v in r['ms_engines'].items())} "
              f"in parallel), split {r['split']}, {r['engines']}", flush=True)
    g, (against_gpu, overlap) = rows['gpu'], compare(rows)
    print(f"\n{'mode':8} {'tokens/s':>10} {'x GPU-only':>10} {'J/token':>10} {'energy vs GPU':>14}  ANE share")
    for mode, r in rows.items():
        x, dj = against_gpu[mode]
        jt = f"{r['j_tok']:.4g}" if r['j_tok'] is not None else 'n/a'
        dj = f"{dj:+.1f}%" if dj is not None else 'n/a'
        print(f"{mode:8} {r['tok_s']:10.0f} {x:10.3f} {jt:>10} {dj:>14}  {r['split']}")
    print(f"hetero / (gpu + ane alone) = {overlap:.3f} (the share of the two engines' summed "
          f"speeds that hetero reaches, 1.0 a perfect overlap; medians of {cfg.bench_repeats} rounds of "
          f"{cfg.bench_iters} steps per mode)" + ('' if g['j_tok'] else "; J/token n/a: no energy meter here "
                                                  "(on a Mac, powermetrics needs `sudo -v` first)"))
    if chart:
        print(f"chart: {chart(rows, against_gpu, overlap, cfg.plot)}")
    return rows


def chart_maker(path):
    """--plot: tools/plot.py's bench_chart, once it and matplotlib are found (else None)."""
    if not path:
        return None
    try:
        from tools import plot  # defines: bench_chart, pyplot, NO_MATPLOTLIB
    except ImportError:
        raise hg.UserError("--plot needs tools/plot.py, which is absent") from None
    if plot.pyplot() is None:
        raise hg.UserError(f"--plot: {plot.NO_MATPLOTLIB}")
    return plot.bench_chart


if __name__ == '__main__':
    hg.main(job=bench, cls=BenchConfig, description=__doc__)
