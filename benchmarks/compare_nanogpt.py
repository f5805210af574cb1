"""
Ours vs nanoGPT's bench.py, side by side in one run on one GPU: fp32 eager, bf16 eager,
bf16 + torch.compile (GPT-2 124M, batch 12 x 1024, 10 warm-up + 20 timed steps of forward,
backward and AdamW; mean ms/iter, as bench.py prints it). nanoGPT is not part of this
repo: pass the folder of a checkout of github.com/karpathy/nanoGPT (its model.py,
bench.py, configurator.py); nothing is copied.

    python -m benchmarks.compare_nanogpt --nanogpt /path/to/nanoGPT

nanoGPT's bench.py uses its GPTConfig defaults: vocabulary padded to 50304 and no biases
(bias=False). So ours takes the same config against bench.py as it is (--vocab_size 50304
--bias False: like for like), and GPT-2 as published (50257, biases) against bench.py
--bias=True (eager only: bench.py compiles the same way either way).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's
p = argparse.ArgumentParser()
p.add_argument('--nanogpt', required=True)
p.add_argument('--settings', default='float32,bfloat16,bfloat16+compile', help='which of the three rows')
p.add_argument('--rounds', type=int, default=1,
               help='nanoGPT and ours take turns this many times; a cell is the median of its rounds')
p.add_argument('--like_for_like', action='store_true',
               help='only bias=False against --bias False (no rows with biases)')
p.add_argument('--fast', action='store_true', help="ours (and --also) with tools/fast_standin.py's classes: padded LM head, no host wait")
p.add_argument('--also', default='', help="another tree of this repository (e.g. the commit before a change), "
               "timed like ours, --bias False, in the same turns")
a = p.parse_args()
pat = re.compile(r'time per iteration: ([\d.]+)ms')


def run(cmd, cwd=None):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    m = pat.search(out.stdout)
    print(out.stdout.strip().splitlines()[-1] if m else out.stdout[-2000:] + out.stderr[-3000:], flush=True)
    return float(m.group(1)) if m else None


def median(xs):
    xs = [x for x in xs if x is not None]  # a failed run prints why and counts as not run
    return statistics.median(xs) if xs else None


rows = []
for setting in a.settings.split(','):
    dtype, compile = setting.split('+')[0], setting.endswith('+compile')
    nano = lambda bias: run([sys.executable, 'bench.py', '--real_data=False', f'--dtype={dtype}',
                             f'--compile={compile}', f'--bias={bias}'], cwd=a.nanogpt)
    flags = (['--compile'] if compile else []) + (['--fast'] if a.fast else [])
    ours = lambda bias, *more: run([sys.executable, '-m', 'benchmarks.bench_gpu', '--dtype', dtype, '--bias', bias]
                                   + flags + list(more), cwd=root)
    padded = ['--vocab_size', '50304']  # nanoGPT's config pads the vocabulary: so does ours here
    cells = {'nanoGPT': lambda: nano(False), 'ours': lambda: ours('False', *padded)}
    if a.also:
        cells['also'] = lambda: run([sys.executable, '-m', 'benchmarks.bench_gpu', '--dtype', dtype,
                                     '--bias', 'False'] + flags + padded, cwd=a.also)
    if not a.like_for_like and not compile:  # bench.py compiles the same way either way
        cells |= {'nanoGPT bias': lambda: nano(True), 'ours bias': lambda: ours('True')}
    times = {k: [] for k in cells}
    for _ in range(a.rounds):  # in turns, so that a drift of the GPU's clocks touches both alike
        for k, fn in cells.items():
            times[k].append(fn())
    r = {'nanoGPT bias': None, 'ours bias': None, 'also': None} | {k: median(v) for k, v in times.items()}
    # the noise this run measures: the spread of each program's own rounds around their median
    ok = {k: [t for t in v if t] for k, v in times.items()}
    spread = {k: (max(v) - min(v)) / median(v) for k, v in ok.items() if len(v) > 1}
    rows.append((f"{dtype}{' + compile' if compile else ' eager'}", r, spread))
    if a.rounds > 1:
        print(f"{setting}: ms/iter per round: {times}", flush=True)

tok = 12 * 1024
cell = lambda v: f"{v:.1f} ({tok / v * 1000:,.0f})" if v else 'not run'
ratio = lambda x, y: f"{x / y:.3f}" if x and y else '-'
print("\nms/iter (tokens/s); ratio = ours / nanoGPT, at most 1 is the goal")
print("| setting | nanoGPT bench.py (bias=False) | ours, --bias False | ratio | nanoGPT --bias=True | ours (GPT-2, biases) | ratio |")
print("|---|---|---|---|---|---|---|")
for name, r, _ in rows:
    print(f"| {name} | {cell(r['nanoGPT'])} | {cell(r['ours'])} | {ratio(r['ours'], r['nanoGPT'])} "
          f"| {cell(r['nanoGPT bias'])} | {cell(r['ours bias'])} | {ratio(r['ours bias'], r['nanoGPT bias'])} |")
for name, r, _ in rows if a.also else []:
    print(f"{name}: {a.also} {cell(r['also'])}, ratio to nanoGPT {ratio(r['also'], r['nanoGPT'])}; "
          f"ours / it {ratio(r['ours'], r['also'])}")
for name, r, spread in rows:
    if spread:
        print(f"{name}: rounds' spread (max - min) / median: " + ', '.join(f"{k} {100 * v:.1f}%" for k, v in spread.items()))
