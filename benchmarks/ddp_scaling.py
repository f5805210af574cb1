"""
Data-parallel scaling, ours under torchrun against nanoGPT's own DDP (train.py under
torchrun), side by side in one run: tokens/s with 1 and with N ranks, and each one's
scaling efficiency against its own one-rank run (tokens/s at N / (N x tokens/s at 1)).
GPT-2 124M, the same per-rank batch (12 x 1024) and accumulation, bf16, eager or compiled.

    python -m benchmarks.ddp_scaling --nanogpt .bench/nano --nproc 2 [--compile]   # N GPUs
    python -m benchmarks.ddp_scaling --device cpu --tiny --nproc 2                 # a dry run

--nanogpt: a folder with nanoGPT's model.py, train.py and configurator.py (not part of this
repo); its data comes from ours (data/shakespeare's .bin files, copied beside it).
nanoGPT's DDP runs on CUDA only, so on the CPU only ours runs (through gloo).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
p = argparse.ArgumentParser()
p.add_argument('--nanogpt', default='')
p.add_argument('--nproc', type=int, default=2)
p.add_argument('--device', default='cuda')
p.add_argument('--compile', action='store_true')
p.add_argument('--iters', type=int, default=30, help='steps per run; the median of those after the 10th is timed')
p.add_argument('--accum', type=int, default=4, help='microbatches per rank and step')
p.add_argument('--tiny', action='store_true', help='a small model, for a dry run')
a = p.parse_args()
size = (['--n_layer', '2', '--n_head', '2', '--n_embd', '64', '--block_size', '64', '--batch_size', '4'] if a.tiny
        else ['--n_layer', '12', '--n_head', '12', '--n_embd', '768', '--block_size', '1024', '--batch_size', '12'])
dtype = 'bfloat16' if a.device == 'cuda' else 'float32'
torchrun = lambda n: [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={n}']
work = tempfile.mkdtemp()


def ours(n):
    out = os.path.join(work, f'ours_{n}')
    cmd = torchrun(n) + [os.path.join(here, 'hetero_gpt.py'), '--mode', 'gpu', '--device', a.device, '--dtype', dtype,
                         '--dataset', 'shakespeare', '--data_dir', os.path.join(here, 'data'), '--out_dir', out,
                         '--gradient_accumulation_steps', str(a.accum * n), '--max_iters', str(a.iters),
                         '--warmup_iters', '0', '--log_interval', '1', '--eval_interval', str(10 * a.iters),
                         '--eval_iters', '1', '--sample_tokens', '0', '--quiet'] + size + (['--compile'] if a.compile else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(l) for l in open(os.path.join(out, 'metrics.jsonl'))] if r.returncode == 0 else []
    tok = [row['tokens_per_s'] for row in rows if 'tokens_per_s' in row and row['step'] > 10]
    return statistics.median(tok) if tok else print(r.stderr[-2000:])


def nano(n):
    if a.device != 'cuda' or not a.nanogpt:
        return None
    data = os.path.join(a.nanogpt, 'data', 'shakespeare_gpt2')
    os.makedirs(data, exist_ok=True)
    for split in ('train', 'val'):
        shutil.copy(os.path.join(here, 'data', 'shakespeare', f'{split}.bin'), data)
    flags = dict(zip(size[::2], size[1::2]))
    cmd = torchrun(n) + ['train.py', '--dataset=shakespeare_gpt2', f'--out_dir={work}/nano_{n}', f'--dtype={dtype}',
                         f'--gradient_accumulation_steps={a.accum * n}', f'--max_iters={a.iters}', '--eval_iters=1',
                         f'--eval_interval={10 * a.iters}', '--always_save_checkpoint=False', f'--compile={a.compile}',
                         '--decay_lr=False', '--bias=True'] + [f'{k}={v}' for k, v in flags.items()]
    r = subprocess.run(cmd, cwd=a.nanogpt, capture_output=True, text=True)
    ms = [float(t) for i, t in re.findall(r'iter (\d+): loss [\d.]+, time ([\d.]+)ms', r.stdout) if int(i) > 10]
    tok_step = int(flags['--batch_size']) * int(flags['--block_size']) * a.accum * n
    return tok_step / (statistics.median(ms) / 1000) if ms else print(r.stdout[-1000:] + r.stderr[-2000:])


cell = lambda v: f"{v:,.0f}" if v else 'not run'
print(f"per rank {size[-1]} x {size[-3]} tokens x {a.accum} microbatches, {dtype}, compile {a.compile}, {a.device}")
print(f"| program | tokens/s, 1 rank | tokens/s, {a.nproc} ranks | scaling efficiency |")
print("|---|---|---|---|")
for name, fn in (('nanoGPT DDP', nano), ('ours, torchrun', ours)):
    one, many = fn(1), fn(a.nproc)
    eff = f"{many / (a.nproc * one):.3f}" if one and many else '-'
    print(f"| {name} | {cell(one)} | {cell(many)} | {eff} |", flush=True)
