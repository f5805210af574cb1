"""
Ours vs nanoGPT's bench.py, side by side in one run on one GPU: fp32 eager, bf16 eager,
bf16 + torch.compile. nanoGPT is not part of this repo: pass the folder of a checkout of
github.com/karpathy/nanoGPT (its model.py, bench.py, configurator.py); nothing is copied.

    python benchmarks/compare_nanogpt.py --nanogpt /path/to/nanoGPT

nanoGPT's bench.py uses its GPTConfig defaults: vocabulary padded to 50304 and no biases
(bias=False). Ours is GPT-2 as published (50257, biases); we also time ours at 50304.
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

settings = [('float32', False), ('bfloat16', False), ('bfloat16', True)]
pat = re.compile(r'time per iteration: ([\d.]+)ms')
rows = []
for dtype, compile in settings:
    r = {}
    out = subprocess.run([sys.executable, 'bench.py', '--real_data=False', f'--dtype={dtype}', f'--compile={compile}'],
                         cwd=a.nanogpt, capture_output=True, text=True)
    m = pat.search(out.stdout)
    r['nanoGPT'] = float(m.group(1)) if m else None
    if not m:
        print(out.stdout[-2000:], out.stderr[-2000:])
    for vocab in (50257, 50304):
        out = subprocess.run([sys.executable, os.path.join(here, 'bench_gpu.py'), '--dtype', dtype,
                              '--vocab_size', str(vocab)] + (['--compile'] if compile else []),
                             capture_output=True, text=True)
        print(out.stdout.strip())
        m = pat.search(out.stdout)
        r[f'ours V={vocab}'] = float(m.group(1)) if m else None
        if not m:
            print(out.stderr[-3000:])
    rows.append((f"{dtype}{' + compile' if compile else ' eager'}", r))

tok = 12 * 1024
print("\n| setting | nanoGPT bench.py ms/iter (tok/s) | ours V=50257 ms/iter (tok/s) | ours V=50304 ms/iter (tok/s) |")
print("|---|---|---|---|")
for name, r in rows:
    cell = lambda v: f"{v:.1f} ({tok / v * 1000:,.0f})" if v else 'failed'
    print(f"| {name} | {cell(r['nanoGPT'])} | {cell(r['ours V=50257'])} | {cell(r['ours V=50304'])} |")
