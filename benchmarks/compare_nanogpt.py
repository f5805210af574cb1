"""
Ours vs nanoGPT's bench.py, side by side in one run on one GPU: fp32 eager, bf16 eager,
bf16 + torch.compile (GPT-2 124M, batch 12 x 1024, 10 warm-up + 20 timed steps of forward,
backward and AdamW; mean ms/iter, as bench.py prints it). nanoGPT is not part of this
repo: pass the folder of a checkout of github.com/karpathy/nanoGPT (its model.py,
bench.py, configurator.py); nothing is copied.

    python benchmarks/compare_nanogpt.py --nanogpt /path/to/nanoGPT

nanoGPT's bench.py uses its GPTConfig defaults: vocabulary padded to 50304 and no biases
(bias=False). So each setting is timed like for like twice: ours with --bias False against
bench.py as it is, and ours as GPT-2 is published (biases) against bench.py --bias=True
(eager only: bench.py compiles the same way either way). Our vocabulary stays 50257 (the
LM-head matmul is padded internally).
"""
import argparse
import os
import re
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
p = argparse.ArgumentParser()
p.add_argument('--nanogpt', required=True)
a = p.parse_args()
pat = re.compile(r'time per iteration: ([\d.]+)ms')


def run(cmd, cwd=None):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    m = pat.search(out.stdout)
    print(out.stdout.strip().splitlines()[-1] if m else out.stdout[-2000:] + out.stderr[-3000:], flush=True)
    return float(m.group(1)) if m else None


rows = []
for dtype, compile in [('float32', False), ('bfloat16', False), ('bfloat16', True)]:
    nano = lambda bias: run([sys.executable, 'bench.py', '--real_data=False', f'--dtype={dtype}',
                             f'--compile={compile}', f'--bias={bias}'], cwd=a.nanogpt)
    ours = lambda bias, *more: run([sys.executable, os.path.join(here, 'bench_gpu.py'), '--dtype', dtype, '--bias', bias]
                                   + (['--compile'] if compile else []) + list(more))
    r = {'nanoGPT': nano(False), 'ours': ours('False')}
    if dtype == 'bfloat16' and not compile:  # the cost of waiting on the host for the finiteness check
        r['ours, host check'] = ours('False', '--host_check')
    r['nanoGPT bias'], r['ours bias'] = (None, None) if compile else (nano(True), ours('True'))
    rows.append((f"{dtype}{' + compile' if compile else ' eager'}", r))

tok = 12 * 1024
cell = lambda v: f"{v:.1f} ({tok / v * 1000:,.0f})" if v else 'not run'
ratio = lambda x, y: f"{x / y:.3f}" if x and y else '-'
print("\nms/iter (tokens/s); ratio = ours / nanoGPT, at most 1 is the goal")
print("| setting | nanoGPT bench.py (bias=False) | ours, --bias False | ratio | nanoGPT --bias=True | ours (GPT-2, biases) | ratio |")
print("|---|---|---|---|---|---|---|")
for name, r in rows:
    print(f"| {name} | {cell(r['nanoGPT'])} | {cell(r['ours'])} | {ratio(r['ours'], r['nanoGPT'])} "
          f"| {cell(r['nanoGPT bias'])} | {cell(r['ours bias'])} | {ratio(r['ours bias'], r['nanoGPT bias'])} |")
for name, r in rows:
    if 'ours, host check' in r:
        print(f"{name}, ours --bias False with the finiteness check read on the host before AdamW: "
              f"{cell(r['ours, host check'])}, ratio {ratio(r['ours, host check'], r['nanoGPT'])}")
