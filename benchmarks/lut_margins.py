"""
How large a lookup table's error the self-check's gradient gate tolerates, in the NumPy
evaluator's ANE mode (plumbing/programs.py numpy_predict), one function inexact at a time,
under each error model (docs/coreml_and_ane.md section 2, "Lookup tables"):

    hash   a relative error e hashed from each input's bits: neighbours unrelated
    knots  a piecewise-linear table's error, up to e between knots, one sign
    bias   hash at 2^-10 plus a systematic bias b of one sign (MACOS_DOUBLE_ANE_LUT_BIAS)

For each, the smallest size in SIZES at which the gate fails, and the last that passed.
The other switches keep their defaults unless set in the environment.

    python benchmarks/lut_margins.py --model small
    python benchmarks/lut_margins.py --model block --workers 16
"""
import argparse
import itertools
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {  # (GPTConfig's arguments, sequences, tokens each)
    'small': (dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=128), 2, 16),
    'block': (dict(n_layer=1), 1, 1024),  # one GPT-2 124M block, 4 vocabulary chunks
}
FUNCTIONS = ('exp', 'log', 'tanh', 'rsqrt', 'softmax', 'all')
ERRORS = ('hash', 'knots', 'bias')
SIZES = [2.0 ** -k for k in range(10, 0, -1)]
SWITCHES = ('MACOS_DOUBLE_ANE_LUT', 'MACOS_DOUBLE_ANE_LUT_BIAS')


def gate(ctx, lut, env):
    """Whether the gate passes with these tables and switches, and its worst figures."""
    from tools import ane_check
    for k in SWITCHES:
        os.environ.pop(k, None)
    os.environ.update(env)
    _, grads, _, ref, _ = ane_check.gradient_pair(dict(ctx, lut=lut))
    res = ane_check.judge_gradients(grads, ref)
    return res['passed'], res['worst_cosine'], res['worst_norm_ratio']


def sweep(job):
    """(function, error model) -> the first size that fails and the last that passed."""
    ctx, fn, error, sizes = job
    from plumbing import programs
    names = list(programs.LUT_ERROR) if fn == 'all' else [fn]
    last = None
    for size in sizes:
        e = programs.LUT_ERROR['exp'] if error == 'bias' else size
        env = {'MACOS_DOUBLE_ANE_LUT': 'knots' if error == 'knots' else 'hash'}
        env |= {'MACOS_DOUBLE_ANE_LUT_BIAS': str(size)} if error == 'bias' else {}
        passed, cosine, norm = gate(ctx, dict.fromkeys(names, e), env)
        verdict = 'pass' if passed else 'FAIL'
        print(f"  {fn} {error} {power(size)}: {verdict}, cosine {cosine}, norm {norm}", flush=True)
        if not passed:
            return dict(function=fn, error=error, fails=size, passed=last, cosine=cosine,
                        norm_ratio=norm)
        last = size
    return dict(function=fn, error=error, fails=None, passed=last)


def power(x):
    return '-' if x is None else f"2^{round(math.log2(x))}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', choices=MODELS, default='small')
    p.add_argument('--workers', type=int, default=1)
    p.add_argument('--functions', default=','.join(FUNCTIONS))
    p.add_argument('--errors', default=','.join(ERRORS))
    p.add_argument('--sizes', default=','.join(str(-round(math.log2(s))) for s in SIZES),
                   help='the sizes 2^-k tried, by k')
    p.add_argument('--json', help='also write the results here')
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix='lut_margins')
    try:
        run(args, MODELS[args.model], os.path.join(out, 'p'))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(args, model, path):
    import export_ane
    import hetero_gpt as hg
    from plumbing import programs
    cfg, B, T = model
    export_ane.export_programs(hg.GPTConfig(**cfg), B, T, path)
    ctx = dict(cfg=hg.GPTConfig(**cfg).__dict__, B=B, T=T, out=path)
    print('switches:', programs.ane_switches())
    sizes = [2.0 ** -int(k) for k in args.sizes.split(',')]
    pairs = itertools.product(args.functions.split(','), args.errors.split(','))
    jobs = [(ctx, fn, e, sizes) for fn, e in pairs]
    t0 = time.perf_counter()
    if args.workers > 1:
        os.environ['OMP_NUM_THREADS'] = '1'  # one core a worker
        with multiprocessing.get_context('spawn').Pool(args.workers) as pool:
            rows = pool.map(sweep, jobs, chunksize=1)
    else:
        rows = [sweep(j) for j in jobs]
    print(f"{args.model}: {time.perf_counter() - t0:.0f} s")
    for r in rows:
        fails, passed = power(r['fails']), power(r['passed'])
        print(f"{r['function']:8s} {r['error']:6s} gate fails at {fails} ({passed})")
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(model=args.model, switches=programs.ane_switches(), rows=rows), f,
                      indent=1)


if __name__ == '__main__':
    main()
