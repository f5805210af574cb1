"""
Does training on two engines cost model quality? The paper's claim: hetero (GPU + ANE)
matches GPU-only validation perplexity, and ANE-only (fp16) is slightly worse.

    python -m tools.compare --dataset shakespeare --seeds 3 [--margin 0.01] [--alpha 0.05]
        [--out_dir out/compare] [any hetero_gpt.py flag, e.g. --max_iters 2000]

For each seed 1..N and each mode (gpu, ane, hetero) this trains hetero_gpt.py once, into
out_dir/<mode>_s<seed>/. The same seed gives the same initial weights and the same
batches at every step in every mode, so the runs pair up by seed. Final validation
perplexity is measured on the full validation split (--eval_iters 0). Then:
  - per mode: mean, sd and 95% CI of final perplexity, and throughput,
  - hetero vs gpu: paired TOST equivalence test, margin +-m on the perplexity ratio,
  - ane vs gpu: paired two-sided t-test,
and writes out_dir/summary.json and out_dir/compare.png (if matplotlib is installed).

Resuming: a run directory whose metrics.jsonl already ends at max_iters with a validation
loss is reused, not retrained; an unfinished one with a checkpoint continues with
--resume. So an interrupted comparison picks up where it stopped when the same command
is run again. Each run directory records its settings (compare_config.json) and is
refused if the command's settings differ: change --out_dir or delete it.

WikiText-103 works the same way with --dataset wikitext103, once it is prepared
(`python prepare_data.py wikitext103`; hetero_gpt.py prepares it or says what is missing).
The statistics are written out below with numpy and math only (no scipy).
"""
import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np
import torch

import hetero_gpt as hg
from plumbing import progress  # defines: with_val

MODES = ('gpu', 'ane', 'hetero')
OWN_FLAGS = ('mode', 'seed', 'eval_iters', 'resume')  # this study sets or forbids these
UNCHECKED = ('quiet', 'resume', 'sample_tokens', 'ane_programs', 'device', 'dist_timeout',
             'wandb_log', 'wandb_project', 'wandb_run_name')  # may differ when reused
# (device too: finished runs made on a GPU machine can be summarized on another one)

# -----------------------------------------------------------------------------
# Statistics


def betainc(a, b, x):
    """Regularized incomplete beta I_x(a, b) = B(x; a, b) / B(a, b), B(x; a, b) = int_0^x u^(a-1) (1-u)^(b-1) du.
    Continued fraction:  I_x(a, b) = x^a (1-x)^b / (a B(a, b)) * 1 / (1 + d1 / (1 + d2 / (1 + ...))),
        d_(2m+1) = -(a+m)(a+b+m) x / ((a+2m)(a+2m+1)),   d_(2m) = m(b-m) x / ((a+2m-1)(a+2m)),
    evaluated by Lentz's method. It converges fast for x < (a+1)/(a+b+2); above that we use
    the symmetry I_x(a, b) = 1 - I_(1-x)(b, a)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)))
    tiny, f, C, D = 1e-300, 1.0, 1.0, 0.0  # f = 1 + d1/(1 + d2/(1 + ...)) = product of C*D ratios
    for j in range(1, 20000):
        m = j // 2
        d = (-(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)) if j % 2
             else m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)))
        D = 1.0 + d * D
        C = 1.0 + d / C
        D = 1.0 / (D if abs(D) > tiny else tiny)
        C = C if abs(C) > tiny else tiny
        f *= C * D
        if abs(C * D - 1.0) < 1e-15:
            break
    return front / (a * f)


def t_cdf(t, df):
    """P(T <= t), T ~ Student's t with df degrees of freedom. With x = df / (df + t^2) the
    two tails together are P(|T| > |t|) = I_x(df/2, 1/2), and each tail is half of that;
    equivalently P(|T| < |t|) = I_(1-x)(1/2, df/2). We use the form whose argument is at
    most 1/2, so that it is computed without cancellation (1 - x for x near 1 is not)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    if t * t >= df:
        tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    else:
        tail = 0.5 - 0.5 * betainc(0.5, df / 2, t * t / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p, df):
    """The t with t_cdf(t, df) = p (inverse CDF), by bisection: t_cdf is increasing in t."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {p}")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2
    while t_cdf(hi, df) < p:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, abs(lo)):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def summarize(x, level=0.95):
    """Mean, sample sd and the t-based CI mean +- t_((1+level)/2, n-1) * sd / sqrt(n)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2:
        raise ValueError(f"need at least 2 values for a standard deviation, got {x.size}")
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    h = t_ppf(0.5 + level / 2, x.size - 1) * sd / math.sqrt(x.size)
    return dict(n=int(x.size), mean=mean, sd=sd, ci=[mean - h, mean + h], level=level)


def log_ratios(test, ref):
    """d_i = ln(test_i / ref_i) for paired positive values (one pair per seed); mean, se."""
    test, ref = np.asarray(test, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if test.shape != ref.shape or test.ndim != 1 or test.size < 2:
        raise ValueError(f"need two equally long lists of at least 2 paired values, got {test.shape} and {ref.shape}")
    if not (np.all(np.isfinite(test) & (test > 0)) and np.all(np.isfinite(ref) & (ref > 0))):
        raise ValueError("perplexities must be positive and finite")
    d = np.log(test / ref)
    return d, float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))


def tost_paired(test, ref, margin=0.01, alpha=0.05):
    """Two one-sided tests (TOST) that test/ref lies within [1-margin, 1+margin].
    On d = ln(test/ref), bounds lo = ln(1-margin), hi = ln(1+margin):
      H0_lower: mean(d) <= lo, rejected when p_lower = P(T >= (mean - lo)/se) < alpha,
      H0_upper: mean(d) >= hi, rejected when p_upper = P(T <= (mean - hi)/se) < alpha,
    T with n-1 df. Equivalent iff both are rejected (p = max(p_lower, p_upper) < alpha), which
    is the same as the (1-2 alpha) CI exp(mean +- t_(1-alpha, n-1) se) lying inside the bounds.
    All ratios equal (se = 0, e.g. identical runs): equivalent, with p = 0, iff mean(d) is inside."""
    if not (0 < margin < 1 and 0 < alpha < 0.5):
        raise ValueError(f"need 0 < margin < 1 and 0 < alpha < 0.5, got {margin} and {alpha}")
    d, mean, se = log_ratios(test, ref)
    lo, hi, df = math.log(1 - margin), math.log(1 + margin), d.size - 1
    if se > 0:
        t_lo, t_hi = (mean - lo) / se, (mean - hi) / se
    else:
        t_lo, t_hi = (math.inf if mean > lo else -math.inf), (-math.inf if mean < hi else math.inf)
    p_lower, p_upper = t_cdf(-t_lo, df), t_cdf(t_hi, df)  # 1 - cdf(t) = cdf(-t), without cancellation
    h = t_ppf(1 - alpha, df) * se
    p = max(p_lower, p_upper)
    return dict(n=int(d.size), mean_ratio=math.exp(mean), ci=[math.exp(mean - h), math.exp(mean + h)],
                ci_level=1 - 2 * alpha, bounds=[1 - margin, 1 + margin], t_lower=t_lo, t_upper=t_hi,
                p_lower=p_lower, p_upper=p_upper, p=p, equivalent=bool(p < alpha), margin=margin, alpha=alpha)


def paired_ttest(test, ref, alpha=0.05):
    """Two-sided paired t-test of mean(ln(test/ref)) = 0: t = mean/se with n-1 df,
    p = 2 P(T <= -|t|)."""
    d, mean, se = log_ratios(test, ref)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    p = min(1.0, 2 * t_cdf(-abs(t), d.size - 1))
    direction = 'higher' if mean > 0 else ('lower' if mean < 0 else 'equal')
    return dict(n=int(d.size), mean_ratio=math.exp(mean), t=t, df=d.size - 1, p=p,
                direction=direction, significant=bool(p < alpha), alpha=alpha)

# -----------------------------------------------------------------------------
# Runs


def read_metrics(path):
    """metrics.jsonl, one row per step. A resumed run appends rows again from its last
    checkpoint, so the later row for a step wins; a half-written line is skipped."""
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            lines = f.readlines()
        for line in lines:
            try:
                r = json.loads(line)
                rows[r['step']] = r
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return [rows[s] for s in sorted(rows)]


def finished(rows, cfg):
    return bool(rows) and rows[-1]['step'] == cfg.max_iters and 'val_ppl' in rows[-1]


def run_one(flags, mode, seed, out_dir, drop_checkpoint=False, eval_seconds=0.0):
    """Train one (mode, seed), or reuse/resume what its directory holds. Returns metrics rows."""
    run_dir = os.path.join(out_dir, f'{mode}_s{seed}')
    defaults = ['--quiet', '--sample_tokens', '0', '--ane_programs', os.path.join(out_dir, 'ane_programs')]
    cfg, given = hg.parse_args(defaults + flags + ['--mode', mode, '--seed', str(seed), '--out_dir', run_dir,
                                                   '--eval_iters', '0'])
    cfg, _ = hg.setup(cfg, given, log=lambda s: None)  # fills in the CPU defaults, so max_iters is final
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in UNCHECKED}
    metrics, ckpt = os.path.join(run_dir, 'metrics.jsonl'), os.path.join(run_dir, 'ckpt.pt')
    saved_path, saved = os.path.join(run_dir, 'compare_config.json'), None
    if os.path.exists(saved_path):
        with open(saved_path) as f:
            saved = {k: v for k, v in json.load(f).items() if k not in UNCHECKED}
    if (os.path.exists(metrics) or os.path.exists(ckpt)) and saved != settings:
        diff = ', '.join(f'{k}: {(saved or {}).get(k)} there, {v} now' for k, v in settings.items()
                         if (saved or {}).get(k) != v)
        raise hg.UserError(f"{run_dir} holds a run with other settings ({diff}): use another --out_dir or delete it")
    rows = read_metrics(metrics)
    print(f"==== {mode}, seed {seed}: {run_dir}")
    if finished(rows, cfg):
        print(f"finished run found, reused (val_ppl {rows[-1]['val_ppl']:.4f})")
    else:
        os.makedirs(run_dir, exist_ok=True)
        with open(saved_path, 'w') as f:
            json.dump(settings, f, indent=1)
        start = 0.0  # the training seconds the run starts from
        if os.path.exists(ckpt):
            cfg.resume = True  # continue an interrupted run from its last checkpoint
            start = torch.load(ckpt, map_location='cpu', mmap=True, weights_only=True)['elapsed']
        elif os.path.exists(metrics):
            os.remove(metrics)  # stopped before its first checkpoint: start over
        hg.train(cfg, given, on_step=TimedEvals(eval_seconds, start) if eval_seconds > 0 else None)
        rows = read_metrics(metrics)
        if not finished(rows, cfg):
            raise hg.UserError(f"training in {run_dir} stopped at step {rows[-1]['step'] if rows else 0} of "
                               f"{cfg.max_iters}: run the same command again to resume")
    if drop_checkpoint and os.path.exists(ckpt):  # finished: its metrics are all the comparison reads
        os.remove(ckpt)
    return rows


class TimedEvals:
    """--eval_seconds, the trainer's on_step hook: an evaluation each time training time
    passes a multiple of `seconds`, for curves against time. Marks count from 0, so a
    resumed run is due where the run straight through was; each rank reads its own clock."""

    def __init__(self, seconds, start=0.0):  # start: the training seconds a resumed run has
        self.seconds = seconds
        self.next = (start // seconds + 1) * seconds  # the next mark

    def __call__(self, prog, row, evaluate):
        if prog.elapsed < self.next:
            return row
        at = self.next
        while self.next <= prog.elapsed:
            self.next += self.seconds
        if 'val_loss' not in row:
            row = progress.with_val(row, prog, evaluate())
        return row | dict(eval_at_seconds=at)


def curve(seed_rows, x):
    """Validation perplexity against column x (tokens or elapsed) over seeds: each seed's
    evaluations interpolated (linearly in log perplexity) onto the x values where any seed
    evaluated, within the range every seed covers. Returns x, and mean, min, max over seeds."""
    pts = [np.array([(r[x], math.log(r['val_ppl'])) for r in rows if 'val_ppl' in r]) for rows in seed_rows]
    grid = np.unique(np.concatenate([p[:, 0] for p in pts]))
    grid = grid[(grid >= max(p[0, 0] for p in pts)) & (grid <= min(p[-1, 0] for p in pts))]
    ppl = np.exp(np.array([np.interp(grid, p[:, 0], p[:, 1]) for p in pts]))
    return grid, ppl.mean(0), ppl.min(0), ppl.max(0)


def plot(runs, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for mode, seeds in runs.items():
        for ax, x in zip(axes, ('tokens', 'elapsed')):
            xs, mean, lo, hi = curve(seeds, x)
            line, = ax.plot(xs, mean, marker='.' if len(xs) <= 50 else None, label=f'{mode} (mean of {len(seeds)} seeds)')
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)  # min..max over seeds
    for ax, xl in zip(axes, ('tokens', 'training time (s, evaluation excluded)')):
        ax.set_xlabel(xl)
        ax.set_yscale('log')
        ax.grid(alpha=0.3, which='both')
    axes[0].set_ylabel('validation perplexity')
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return path


def seed_list(s):
    """'3' -> [1, 2, 3]; '1-4,9' -> [1, 2, 3, 4, 9]."""
    try:
        if s.isdigit():
            return list(range(1, int(s) + 1))
        out = []
        for part in s.split(','):
            a, _, b = part.partition('-')
            if int(b or a) < int(a):
                raise ValueError
            out += list(range(int(a), int(b or a) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give a count (3) or seeds and ranges (1-4,9)") from None
    if len(set(out)) != len(out) or min(out, default=1) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: seeds are positive and listed once")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[1], allow_abbrev=False,
                                     epilog="Other flags go to hetero_gpt.py (python hetero_gpt.py --help).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--seeds', type=seed_list, default='3',
                        help="N (seeds 1..N) or a list such as 1-4,9 (several machines can share a comparison)")
    parser.add_argument('--margin', type=float, default=0.01, help="equivalence margin on the perplexity ratio")
    parser.add_argument('--alpha', type=float, default=0.05, help="significance level")
    parser.add_argument('--out_dir', default='out/compare', help="runs, summary.json and compare.png")
    parser.add_argument('--eval_seconds', type=float, default=0.0,
                        help="also evaluate each time training time passes a multiple of this (0: off)")
    parser.add_argument('--drop_checkpoints', action='store_true',
                        help="delete a run's ckpt.pt once it has finished (GPT-2 124M: 1.5 GB a run)")
    args, flags = parser.parse_known_args(argv)
    try:
        return compare(args, flags)
    except hg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def compare(args, flags):
    clash = sorted({a[2:].split('=')[0] for a in flags if a.startswith('--')} & set(OWN_FLAGS))
    if clash:
        raise hg.UserError(f"tools.compare sets --{', --'.join(clash)} itself (seeds: --seeds N)")
    if len(args.seeds) < 2:
        raise hg.UserError(f"--seeds {args.seeds}: paired tests need at least 2 seeds (3 or more recommended)")
    if not (0 < args.margin < 1 and 0 < args.alpha < 0.5):
        raise hg.UserError("--margin must be in (0, 1) and --alpha in (0, 0.5)")
    if not (math.isfinite(args.eval_seconds) and args.eval_seconds >= 0):
        raise hg.UserError(f"--eval_seconds {args.eval_seconds}: must be a finite number >= 0")
    hg.parse_args(flags)  # unknown or malformed flags fail here, before any training
    seeds = args.seeds
    # seed by seed, so an interrupted comparison has whole seeds (every mode) done
    done = {(m, s): run_one(flags, m, s, args.out_dir, args.drop_checkpoints, args.eval_seconds) for s in seeds for m in MODES}
    runs = {m: [done[m, s] for s in seeds] for m in MODES}
    ppl = {m: np.array([rows[-1]['val_ppl'] for rows in runs[m]]) for m in MODES}
    modes = {}
    for m in MODES:
        tps = [np.mean([r['tokens_per_s'] for r in rows if 'tokens_per_s' in r]) for rows in runs[m]]
        modes[m] = summarize(ppl[m]) | dict(
            final_val_ppl=ppl[m].tolist(), tokens_per_s=float(np.mean(tps)),  # logged rows (wall time)
            tokens_per_train_s=float(np.mean([rows[-1]['tokens'] / rows[-1]['elapsed'] for rows in runs[m]])))
    tost = tost_paired(ppl['hetero'], ppl['gpu'], args.margin, args.alpha)
    ttest = paired_ttest(ppl['ane'], ppl['gpu'], args.alpha)

    last = runs['gpu'][0][-1]
    print(f"\nfinal validation perplexity (full validation split), {len(seeds)} seeds, "
          f"step {last['step']}, {last['tokens']:,} tokens per run")
    print(f"{'mode':8} {'mean':>10} {'sd':>9} {'95% CI':>23} {'tokens/s':>10} {'tokens/train s':>15}")
    for m, s in modes.items():
        ci = f"[{s['ci'][0]:.6g}, {s['ci'][1]:.6g}]"
        print(f"{m:8} {s['mean']:10.6g} {s['sd']:9.4g} {ci:>23} {s['tokens_per_s']:10.0f} {s['tokens_per_train_s']:15.0f}")
    verdict = (f"equivalent within +-{100 * args.margin:g}%" if tost['equivalent']
               else f"not shown equivalent within +-{100 * args.margin:g}%")
    print(f"hetero/gpu (paired TOST): ratio {tost['mean_ratio']:.4f}, {100 * tost['ci_level']:g}% CI "
          f"[{tost['ci'][0]:.4f}, {tost['ci'][1]:.4f}], p_lower {tost['p_lower']:.3g}, p_upper {tost['p_upper']:.3g}"
          f" -> {verdict} (p = {tost['p']:.3g}, alpha {args.alpha:g})")
    print(f"ane/gpu (paired t-test): ratio {ttest['mean_ratio']:.4f}, t = {ttest['t']:.3f}, df {ttest['df']}, "
          f"p = {ttest['p']:.3g} -> ANE-only perplexity {ttest['direction']}"
          + ("" if ttest['direction'] == 'equal' else f" than GPU-only ({'' if ttest['significant'] else 'not '}"
             f"significant at {args.alpha:g})"))

    summary = dict(seeds=list(seeds), margin=args.margin, alpha=args.alpha, flags=flags, modes=modes,
                   tost_hetero_vs_gpu=tost, ttest_ane_vs_gpu=ttest,
                   runs={m: [os.path.join(args.out_dir, f'{m}_s{s}') for s in seeds] for m in MODES})
    summary['plot'] = plot(runs, os.path.join(args.out_dir, 'compare.png'))
    with open(os.path.join(args.out_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    print(f"summary: {os.path.join(args.out_dir, 'summary.json')}")
    return summary


if __name__ == '__main__':
    main()
