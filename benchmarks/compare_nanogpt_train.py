"""
A real training run, ours vs nanoGPT's train.py, side by side in one call on one GPU: Shakespeare,
GPT-2 124M, the same settings in both (batch 12 x 1024, 4 microbatches a step, bf16 or fp32,
eager or compiled, gradient clipping at 1.0, nanoGPT's config: vocabulary 50304, no biases), one
log line per step in both. Each run's cell is its median step time after 10 warm-up steps (nanoGPT:
the time between its step ends, as it prints it; ours: the step's training time, metrics.jsonl);
the programs take turns for --rounds rounds and a cell is the median of its rounds.

    python -m benchmarks.compare_nanogpt_train --nanogpt /path/to/nanoGPT [--dtype bfloat16] [--compile]

nanoGPT is not part of this repo: pass a checkout of github.com/karpathy/nanoGPT. Its train.py reads
our prepared data/shakespeare through links in <nanoGPT>/data/heterogpt_shakespeare (made here, the
one thing written into the checkout); both runs write into a temporary folder, removed after.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's
p = argparse.ArgumentParser()
p.add_argument('--nanogpt', required=True)
p.add_argument('--dtype', default='bfloat16')
p.add_argument('--compile', action='store_true')
p.add_argument('--iters', type=int, default=40, help='steps per run (the first 10 are not timed)')
p.add_argument('--rounds', type=int, default=3)
a = p.parse_args()
B, T, ACC, WARM = 12, 1024, 4, 10

data = os.path.join(a.nanogpt, 'data', 'heterogpt_shakespeare')
os.makedirs(data, exist_ok=True)
for split in ('train.bin', 'val.bin'):
    src, dst = os.path.join(root, 'data', 'shakespeare', split), os.path.join(data, split)
    if not os.path.exists(src):
        sys.exit(f"error: {src} is missing: run `python prepare_data.py --dataset shakespeare` first")
    if not os.path.islink(dst) or os.path.realpath(dst) != os.path.realpath(src):
        if os.path.lexists(dst):
            sys.exit(f"error: {dst} exists and is not a link to {src}; nothing was changed")
        os.symlink(src, dst)


def nanogpt(out):
    cmd = [sys.executable, 'train.py', '--dataset=heterogpt_shakespeare', f'--out_dir={out}', f'--batch_size={B}',
           f'--block_size={T}', f'--gradient_accumulation_steps={ACC}', f'--max_iters={a.iters}',
           f'--lr_decay_iters={a.iters}', '--warmup_iters=10', '--eval_interval=100000', '--eval_iters=5',
           '--log_interval=1', f'--dtype={a.dtype}', f'--compile={a.compile}', '--always_save_checkpoint=False']
    r = subprocess.run(cmd, cwd=a.nanogpt, capture_output=True, text=True)
    ms = [float(t) for i, t in re.findall(r'iter (\d+): loss [\d.]+, time ([\d.]+)ms', r.stdout) if int(i) >= WARM]
    return ms, r


def ours(out):
    cmd = [sys.executable, 'hetero_gpt.py', '--dataset', 'shakespeare', '--mode', 'gpu', '--device', 'cuda',
           '--dtype', a.dtype, '--batch_size', str(B), '--block_size', str(T), '--gradient_accumulation_steps',
           str(ACC), '--vocab_size', '50304', '--bias', 'False', '--max_iters', str(a.iters), '--warmup_iters', '10',
           '--eval_interval', '100000', '--eval_iters', '5', '--log_interval', '1', '--out_dir', out,
           '--sample_tokens', '0', '--patience', '0', '--quiet'] + (['--compile'] if a.compile else [])
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    rows = []
    if os.path.exists(os.path.join(out, 'metrics.jsonl')):
        rows = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    ms = [1000 * B * T * ACC / row['tokens_per_s'] for row in rows if 'tokens_per_s' in row and row['step'] > WARM]
    return ms, r


times = {'nanoGPT train.py': [], 'ours hetero_gpt.py --mode gpu': []}
for rnd in range(a.rounds):  # in turns, so that a drift of the GPU's clocks touches both alike
    for name, fn in zip(times, (nanogpt, ours)):
        with tempfile.TemporaryDirectory() as out:
            ms, r = fn(out)
        if len(ms) < a.iters - WARM - 1:
            print(f"{name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}", flush=True)
            continue
        times[name].append(statistics.median(ms))
        print(f"round {rnd + 1}: {name}: median {times[name][-1]:.1f} ms/step over {len(ms)} steps", flush=True)

med = {k: statistics.median(v) if v else None for k, v in times.items()}
tok = B * T * ACC
print(f"\n{a.dtype}{' + compile' if a.compile else ' eager'}, {B}x{T} x {ACC} microbatches a step; ms/step (tokens/s), "
      f"median of {a.rounds} rounds; ratio = ours / nanoGPT's step time, at most 1 is the goal")
for k, v in med.items():
    spread = (max(times[k]) - min(times[k])) / v if v and len(times[k]) > 1 else 0.0
    print(f"| {k} | {v:.1f} ({tok / v * 1000:,.0f}) | spread {100 * spread:.1f}% |" if v else f"| {k} | not run |")
n, o = med.values()
print(f"ratio {o / n:.3f}" if n and o else "ratio: -")
