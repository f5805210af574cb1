"""
GPU-only, ANE-only and hetero side by side in one process, on the same batches from the
same initial weights: the paper's table (tokens/s, x GPU-only, joules per token). As
nanoGPT's bench.py, it is the training loop's meat without the rest.

    python bench.py [any hetero_gpt.py flag] [--bench_iters 10] [--bench_repeats 3] [--fast]
    python bench.py --gpu_engine both    # a Mac: PyTorch MPS and MLX, alone and beside the ANE

--fast runs the classes of tools/fast_standin.py (the off-Mac speed) in place of the reference's.
--gpu_engine mlx runs the GPU engine in MLX (tools/mlx_engine.py), a Mac's fastest GPU-only
trainer: hetero with MLX against MLX alone is then the headline. both adds PyTorch's arms, and
the paper's ratio (hetero against PyTorch's GPU engine alone).
"""
import dataclasses
import gc
import math
import statistics
import time
from dataclasses import dataclass

import torch

import hetero_gpt as hg  # defines: Config, Classes, setup, load_data, build_run, step_batches, main
from plumbing import progress  # defines: Ticker, clock (each mode's time while it runs)
from tools import ane_check  # defines: gpu_engine_class, machine, machine_line

# The arms each --gpu_engine runs, in turn: a mode, and its GPU engine where MLX is in play
ARMS = {'torch': ('gpu', 'ane', 'hetero'),
        'mlx': ('gpu-mlx', 'ane', 'hetero-mlx'),
        'both': ('gpu-torch', 'gpu-mlx', 'ane', 'hetero-mlx', 'hetero-torch')}
# An M4's GPU throttles after ~8 s of load; llm.mojo idles 30 s between arms
MAC_COOLDOWN_S = 30.0  # (docs/coreml_and_ane.md section 6)
# The ratios printed, the headline first: (arm, against, what it says), where both arms ran
RATIOS = (('hetero-mlx', 'gpu-mlx', "headline, both engines against MLX alone"),
          ('gpu-mlx', 'gpu-torch', "MLX against PyTorch, each alone"),
          ('hetero-torch', 'gpu-torch', "the paper's ratio (1.419x on an M4 Pro)"),
          ('hetero', 'gpu', "the paper's ratio (1.419x on an M4 Pro)"))


@dataclass
class BenchConfig(hg.Config):
    bench_iters: int = hg.setting(10, "timed steps per mode and round (after >= 5 warm-up steps and 3 s)")
    bench_repeats: int = hg.setting(3, "rounds of each arm, which reports its median round")
    fast: bool = hg.setting(False, "run tools/fast_standin.py's model and stand-in")
    fused_kernels: bool = hg.setting(False, "with --fast: the stand-in's pieces as fused kernels")
    plot: str = hg.setting('', "also draw the table as bars in this PNG file (needs matplotlib)")
    gpu_engine: str = hg.setting('torch', "torch (PyTorch's autograd), mlx (tools/mlx_engine.py) "
                                          "or both: the GPU engine of the gpu and hetero arms")
    cooldown: str = hg.setting('auto', "seconds idle before each arm after the first, so each "
                                       "starts cool (auto: 30 on a Mac, whose GPU throttles; 0 "
                                       "elsewhere)")


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
        rd = dict(tok_s=[], joules=[], engine_s={}, step_s=[], ane_share=[])

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
                rd['ane_share'].append(out.ane_share)
                for n, res in out.shares.items():
                    rd['engine_s'].setdefault(n, []).append(res.seconds)
            sync()
            dt, j = time.perf_counter() - t0, meter.joules()
            rd['tok_s'].append(tok_per_step * cfg.bench_iters / dt)
            rd['joules'].append(None if j is None else j - j0)
        # the ANE's share that most timed steps took (a probe step takes another)
        split = f"{statistics.mode(rd['ane_share'])}/{step.split.microbatches}"
        return dict(tok_s=statistics.median(rd['tok_s']), rounds=[round(x) for x in rd['tok_s']],
                    j_tok=None if None in rd['joules'] else sum(rd['joules']) / n_tok,
                    split=split if mode == 'hetero' else '-',
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


def ratio(rows, arm, base):
    """arm against base: (its tokens/s over base's, its energy per token against base's in
    percent, None without a meter)."""
    a, b = rows[arm], rows[base]
    dj = 100 * (a['j_tok'] / b['j_tok'] - 1) if a['j_tok'] is not None and b['j_tok'] else None
    return a['tok_s'] / b['tok_s'], dj


def overlap(rows, gpu='gpu', hetero='hetero'):
    """hetero's tokens/s over the sum of its two engines' alone, `gpu` and the ANE's (1.0: the
    engines overlap perfectly)."""
    return rows[hetero]['tok_s'] / (rows[gpu]['tok_s'] + rows['ane']['tok_s'])


def cooldown_seconds(value):
    """--cooldown in seconds: auto is MAC_COOLDOWN_S on a Mac, 0 elsewhere."""
    if value == 'auto':
        return MAC_COOLDOWN_S if hg.ON_MAC else 0.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise hg.UserError(f"--cooldown {value}: use auto or a number of seconds >= 0")
    return seconds


def headline(rows, dtype):
    """A line per ratio of RATIOS whose two arms ran, the headline first: tokens/s and J/token."""
    lines = []
    for arm, base, what in RATIOS:
        if arm in rows and base in rows:
            x, dj = ratio(rows, arm, base)
            a, b = rows[arm], rows[base]
            joules = 'J/token n/a'
            if dj is not None:
                joules = f"J/token {a['j_tok']:.4g} against {b['j_tok']:.4g} ({dj:+.1f}%)"
            lines.append(f"{what}, {dtype}: {arm} / {base} = {x:.3f}x tokens/s "
                         f"({a['tok_s']:,.0f} against {b['tok_s']:,.0f}), {joules}")
    return lines


def split_line(rows, auto):
    """What each hetero arm gave the ANE. Under auto, none means that the GPU alone made the
    faster step on this machine (ProbingSplit)."""
    said = []
    for arm in (a for a in rows if a.startswith('hetero')):
        k, n = rows[arm]['split'].split('/')
        said.append(f"{arm} gives the ANE {k} of {n} microbatches")
        if auto and k == '0':
            said[-1] += " (here the GPU alone makes the faster step: a result, not a fault)"
    return f"split ({'auto' if auto else '--ane_fraction'}): " + '; '.join(said)


def baseline(rows):
    """The GPU-only arm that the table and the chart measure against: MLX alone where it ran."""
    return 'gpu-mlx' if 'gpu-mlx' in rows else 'gpu'


def against(rows):
    """{arm: ratio(rows, arm, baseline)}."""
    return {arm: ratio(rows, arm, baseline(rows)) for arm in rows}


def overlaps(rows):
    """A line per hetero arm: its tokens/s over its GPU engine's alone plus the ANE's alone."""
    lines = []
    for arm in (a for a in rows if a.startswith('hetero')):
        gpu = arm.replace('hetero', 'gpu')
        lines.append(f"{arm} / ({gpu} + ane alone) = {overlap(rows, gpu, arm):.3f}")
    return lines


def table(rows):
    """Every arm against the GPU-only baseline (MLX alone where it ran), then each hetero arm's
    overlap of its two engines."""
    base = baseline(rows)
    name = 'GPU-only' if base == 'gpu' else base
    w = max(8, *map(len, rows))
    ratios = against(rows)
    lines = [f"{'arm':{w}} {'tokens/s':>10} {'x ' + name:>10} {'J/token':>10} "
             f"{'energy vs ' + name:>18}  ANE share"]
    for arm, r in rows.items():
        x, dj = ratios[arm]
        jt = f"{r['j_tok']:.4g}" if r['j_tok'] is not None else 'n/a'
        dj = f"{dj:+.1f}%" if dj is not None else 'n/a'
        lines.append(f"{arm:{w}} {r['tok_s']:10.0f} {x:10.3f} {jt:>10} {dj:>18}  {r['split']}")
    for line in overlaps(rows):
        lines.append(line + " (the share of the two engines' summed speeds that hetero "
                     "reaches, 1.0 a perfect overlap)")
    if rows[base]['j_tok'] is None:
        lines.append("J/token n/a: no energy meter here (on a Mac, powermetrics needs `sudo -v`)")
    return lines


def bench(cfg, given):
    """Each arm in turn (ARMS[--gpu_engine]: gpu, ane, hetero by default) is built, warmed up,
    timed for bench_repeats rounds (its median round reported) and freed before the next, after
    a cooldown: on a Mac they would not fit at once in the 16-24 GB that the GPU and the ANE
    share with the host, and its GPU throttles under load."""
    if min(cfg.bench_iters, cfg.bench_repeats) < 1:
        raise hg.UserError("--bench_iters and --bench_repeats must be at least 1")
    chart = chart_maker(cfg.plot)  # --plot's needs, found before any benchmark
    if cfg.gpu_engine not in ARMS:
        raise hg.UserError(f"--gpu_engine {cfg.gpu_engine}: use torch, mlx or both")
    cooldown = cooldown_seconds(cfg.cooldown)
    mlx = None
    if cfg.gpu_engine != 'torch':  # MLX missing: one line, before anything runs
        mlx = ane_check.gpu_engine_class('mlx')
    cfg, run = hg.setup(cfg, given)
    if mlx and run.dtype not in (torch.float32, torch.bfloat16):  # (MLXEngine's own refusal)
        raise hg.UserError(f"--gpu_engine {cfg.gpu_engine}: the MLX engine trains in float32 or "
                           f"bfloat16, not {str(run.dtype).replace('torch.', '')}")
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
    for arm in ARMS[cfg.gpu_engine]:
        mode, _, engine = arm.partition('-')
        if rows and cooldown:
            print(f"cooling down for {cooldown:g} s (--cooldown), so {arm} starts cool", flush=True)
            time.sleep(cooldown)
        print(f"{arm}: building, warming up (5 steps and 3 s), then {cfg.bench_repeats} rounds of "
              f"{cfg.bench_iters} steps", flush=True)
        ticker = progress.Ticker(f"  {arm}: building").__enter__()
        try:
            arm_classes = classes
            if engine == 'mlx':
                arm_classes = dataclasses.replace(classes, gpu_engine=mlx)
            arm_run = dataclasses.replace(run, mode=mode)
            rows[arm] = bench_mode(cfg, arm_run, data, init, tok_per_step, n_tok, ticker,
                                   arm_classes)
        finally:
            ticker.__exit__()
        r = rows[arm]
        rounds = ', '.join(f'{x:,}' for x in r['rounds'])
        parts = ', '.join(f'{n} {v:.4g} ms' for n, v in r['ms_engines'].items())
        print(f"  {arm}: {r['tok_s']:,.0f} tokens/s (rounds: {rounds}), {r['ms_step']:.4g} ms a "
              f"step ({parts} in parallel), split {r['split']}, {r['engines']}", flush=True)
    dtype = str(run.dtype).replace('torch.', '')
    print()
    for line in headline(rows, dtype):
        print(line)
    print(split_line(rows, run.ane_fraction is None))
    print(f"machine: {ane_check.machine_line(ane_check.machine())}")
    print(f"settings: a {cfg.n_layer}-layer {cfg.n_embd}-wide GPT-2, microbatches of "
          f"{cfg.batch_size} x {cfg.block_size} tokens, {cfg.gradient_accumulation_steps} a step, "
          f"the GPU engines in {dtype}; rounds: {cfg.bench_repeats} of {cfg.bench_iters} steps "
          f"an arm (the median reported); cooldowns: {cooldown:g} s\n")
    for line in table(rows):
        print(line)
    if chart:
        title = '; '.join(overlaps(rows))
        print(f"chart: {chart(rows, against(rows), baseline(rows), title, cfg.plot)}")
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
