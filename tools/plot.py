"""
A run's curves as one picture, and bench.py's table as a bar chart. matplotlib draws them
(optional: pip install matplotlib); the trainer never imports this file.

    python -m tools.plot out [out2 ...] [--output FILE]

reads each out_dir's metrics.jsonl (a run still going, or resumed across processes) and writes
out/metrics.png (several runs overlaid: out/overlay.png), six panels:
  - training and validation loss against tokens, the best checkpoint marked;
  - tokens/s, the step's and each engine's alone in its share;
  - the ANE's share of each step's microbatches, steps with a dropped share or no update marked;
  - the ANE engine's loss scale; J/token where a meter ran; the gradient's norm.
"""
import argparse
import io
import json
import math
import os
import sys

NO_MATPLOTLIB = "matplotlib is not installed: pip install matplotlib"

# (panel, title, x label, y label); every axis says its unit
PANELS = (('loss', 'Loss', 'tokens trained', 'cross-entropy (nats/token)'),
          ('speed', 'Throughput', 'step', 'tokens/s'),
          ('share', "The ANE's share", 'step', 'ANE microbatches (% of the step)'),
          ('scale', 'Loss scale (fp16)', 'step', 'loss scale (x, log2 axis)'),
          ('energy', 'Energy', 'step', 'energy per token (J)'),
          ('norm', 'Gradient norm', 'step', 'L2 norm, before clipping'))
# what a panel says when no run has its values
EMPTY = dict(scale="no fp16 ANE engine in this run (modes ane and hetero have one)",
             energy="no energy meter ran: no J/token\n(powermetrics on a Mac, NVML, RAPL)",
             share="no ANE share logged")
# series drawn as marks, not lines: their marker
MARKS = {'best checkpoint': '*', 'no update (skipped)': 'X', 'gpu share dropped': 'v',
         'ane share dropped': 'v'}
LINES = ('-', '--', ':', '-.')  # a series' style when several runs share a colour


def pyplot():
    """matplotlib.pyplot on Agg (files, no window), or None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


# -----------------------------------------------------------------------------
# A run's rows, and what each panel draws of them

def read_rows(path):
    """metrics.jsonl's rows in step order. A half-written last line (a run still going) is
    left out; a row whose step is not past the one before starts a later process's segment,
    which replaces the rows from its step on (as --resume truncates the file)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                step = row['step']
            except (ValueError, KeyError, TypeError):
                continue
            while rows and rows[-1]['step'] >= step:
                rows.pop()
            rows.append(row)
    return rows


def own(row):
    """A row's per-rank values as one: under torchrun (row['ranks']) microbatches, dropped
    shares, rates and J/token summed over ranks; rank 0's skipped count and loss scale."""
    if 'ranks' not in row:
        return row
    ranks = row['ranks']
    out = dict(ranks[0])
    for k in ranks[0]:
        if k.endswith(('tokens_per_s', 'microbatches', 'joules_per_token')):
            out[k] = sum(r.get(k, 0) for r in ranks)
    out['dropped'] = {n: sum(r['dropped'].get(n, 0) for r in ranks) for n in ranks[0]['dropped']}
    return row | out


def new_counts(before, now):
    """How much a running count grew between two rows; it restarts from 0 in a resumed process."""
    return now - before if now >= before else now


def series(rows):
    """{panel: {label: (xs, ys)}}: what each panel draws of a run's rows."""
    rows = [own(r) for r in rows]
    trained = [r for r in rows if 'loss' in r]
    evals = [r for r in rows if 'val_loss' in r]
    logged = [r for r in rows if 'microbatches' in r]
    out = {p[0]: {} for p in PANELS}
    out['loss']['training'] = column(trained, 'tokens', 'loss')
    out['loss']['validation'] = column(evals, 'tokens', 'val_loss')
    best = best_row(rows)
    if best:
        out['loss']['best checkpoint'] = ([best['tokens']], [best['val_loss']])
    out['speed']['whole step'] = column(trained, 'step', 'tokens_per_s')
    engines = sorted({k[:-len('_tokens_per_s')] for r in rows for k in r
                      if k.endswith('_tokens_per_s')})
    for n in engines:
        out['speed'][f'{n}, alone in its share'] = column(rows, 'step', f'{n}_tokens_per_s')
    share = {r['step']: 100 * r['ane_microbatches'] / r['microbatches'] for r in logged}
    if logged:
        out['share']['ANE share'] = (list(share), list(share.values()))
    for label, marked in events(logged).items():
        out['share'][label] = (marked, [share[s] for s in marked])
    out['scale']['ANE'] = column(rows, 'step', 'loss_scale')
    out['energy']['J/token'] = column(rows, 'step', 'joules_per_token')
    out['norm']['gradient norm'] = column(trained, 'step', 'grad_norm')
    return {p: {k: v for k, v in s.items() if v[0]} for p, s in out.items()}


def column(rows, x, y):
    """(xs, ys) of the rows that hold y, finite."""
    pts = [(r[x], r[y]) for r in rows if y in r and r[y] is not None and math.isfinite(r[y])]
    return [p[0] for p in pts], [p[1] for p in pts]


def events(logged):
    """{label: [steps]}: the logged steps by which an engine's share was left out (dropped), or
    a step made no update (skipped), since the row before."""
    engines = sorted({n for r in logged for n in r['dropped']})
    found = {}
    before = {}
    for r in logged:
        counts = {f'{n} share dropped': r['dropped'].get(n, 0) for n in engines}
        counts['no update (skipped)'] = r['skipped']
        for label, count in counts.items():
            if new_counts(before.get(label, 0), count) > 0:
                found.setdefault(label, []).append(r['step'])
        before = counts
    return found


def best_row(rows):
    """The row of best.pt: the first of the lowest validation losses (None before one)."""
    evals = [r for r in rows if 'val_loss' in r and math.isfinite(r['val_loss'])]
    return min(evals, key=lambda r: r['val_loss'], default=None)


def title(name, rows):
    """One line about a run: its mode, steps, tokens, training time and best validation loss."""
    last = rows[-1]
    modes = [r['mode'] for r in rows if 'mode' in r]  # (an evaluation's own row has none)
    mode = modes[-1] if modes else '?'
    best = best_row(rows)
    best = f", best validation loss {best['val_loss']:.3f} (step {best['step']:,})" if best else ''
    seconds = last['elapsed']
    took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    return (f"{name}: mode {mode}, {last['step']:,} steps, {last['tokens']:,} tokens, "
            f"{took} of training{best}")


# -----------------------------------------------------------------------------
# The picture

def draw(runs, path, plt):
    """runs: {name: rows}. Writes the six panels to path (PNG, atomically); returns path."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter
    several = len(runs) > 1
    fig, axes = plt.subplots(3, 2, figsize=(12, 9.6))
    axes = dict(zip([p[0] for p in PANELS], axes.flat))
    drawn = {p[0]: {} for p in PANELS}  # panel: {label: its style}
    every = [series(rows) for rows in runs.values()]
    labels = {p[0]: list(dict.fromkeys(k for s in every for k in s[p[0]])) for p in PANELS}
    for i, run in enumerate(every):
        for panel, lines in run.items():
            for label, (xs, ys) in lines.items():
                j = labels[panel].index(label)  # a label's colour or style, the same in every run
                style = dict(color=f'C{i}' if several else f'C{j}', lw=1.5)
                if label in MARKS:
                    size = 12 if label == 'best checkpoint' else 8
                    style |= dict(marker=MARKS[label], ls='none', ms=size, mec='black', mew=0.6)
                else:
                    style |= dict(ls=LINES[j % len(LINES)] if several else '-',
                                  marker='o' if len(xs) <= 12 else None, ms=4)
                axes[panel].plot(xs, ys, **style)
                drawn[panel][label] = style
    for panel, head, xlabel, ylabel in PANELS:
        ax = axes[panel]
        ax.set_title(head, fontsize=11)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_formatter(EngFormatter(sep=''))
        if not drawn[panel]:
            empty(ax, EMPTY.get(panel, 'nothing logged'))
            continue
        gray = dict(color='0.3') if several else {}  # several runs: the colours are the runs'
        handles = [Line2D([], [], **(s | gray)) for s in drawn[panel].values()]
        ax.legend(handles, drawn[panel], fontsize=8, loc='best')
    axes['speed'].yaxis.set_major_formatter(EngFormatter(sep=''))
    axes['energy'].yaxis.set_major_formatter(EngFormatter(unit='J'))  # 2.6 mJ, not 0.0026
    axes['share'].set_ylim(-5, 105)
    if drawn['scale']:
        axes['scale'].set_yscale('log', base=2)
    heads = [title(name, rows) for name, rows in runs.items()]
    if several:
        colours = [Line2D([], [], color=f'C{i}') for i in range(len(runs))]
        fig.legend(colours, heads, loc='upper center', fontsize=9, frameon=False)
    else:
        fig.suptitle(heads[0], fontsize=11)
    top = 0.93 - 0.025 * len(runs) if several else 0.92  # room for the title or the runs
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.06, top=top, hspace=0.42, wspace=0.2)
    save(fig, path, plt)
    return path


def save(fig, path, plt):
    """The figure as a PNG at path, in 256 colours (a third of the bytes, the same to the eye),
    written whole (a tmp file, then renamed)."""
    from PIL import Image  # (matplotlib's own dependency)
    drawn = io.BytesIO()
    fig.savefig(drawn, format='png', dpi=100)
    plt.close(fig)
    tmp = path + '.tmp'
    image = Image.open(drawn).convert('RGB')
    image.quantize(256, method=Image.Quantize.FASTOCTREE).save(tmp, format='png')
    os.replace(tmp, path)


def fail(text):
    """A user's error: one line, exit 2."""
    print(f"error: {text}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    p = argparse.ArgumentParser(description="A run's curves as one PNG: loss, tokens/s, the ANE's "
                                            "share, loss scale, J/token, gradient norm.")
    p.add_argument('out_dirs', nargs='+', help="a run's out_dir (several: overlaid)")
    p.add_argument('--output', default='',
                   help="the PNG (default: the first out_dir's metrics.png; several: overlay.png)")
    args = p.parse_args(argv)
    plt = pyplot()
    if plt is None:
        fail(NO_MATPLOTLIB)
    runs = {}
    for d in args.out_dirs:
        path = os.path.join(d, 'metrics.jsonl')
        if not os.path.isfile(path):
            fail(f"{path} is missing: give a run's out_dir (written from its first logged step)")
        rows = read_rows(path)
        if not rows:
            fail(f"{path} has no rows yet: a run writes one every --log_interval steps")
        runs[os.path.normpath(d)] = rows
    name = 'metrics.png' if len(runs) == 1 else 'overlay.png'
    output = args.output or os.path.join(args.out_dirs[0], name)
    try:
        draw(runs, output, plt)
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror or e}")
    print(output)
    return output


# -----------------------------------------------------------------------------
# bench.py's table as a chart

def empty(ax, why):
    """A panel with nothing to draw says why, in gray, without ticks."""
    ax.text(0.5, 0.5, why, ha='center', va='center', transform=ax.transAxes, color='0.4')
    ax.set_xticks([])
    ax.set_yticks([])


def bench_bars(rows, against, base):
    """{panel: [(arm, value, its label)]}: bench.py's tokens/s (x base) and J/token (% vs base)
    per arm, against (bench.against) holding each arm's ratios to base; no J/token panel
    without a meter."""
    name = 'GPU-only' if base == 'gpu' else base
    speed = [(m, r['tok_s'], f"{r['tok_s']:,.0f}\n{against[m][0]:.3f}x {name}")
             for m, r in rows.items()]
    energy = []
    for m, r in rows.items():
        dj = against[m][1]  # None where the base's J/token is none or 0
        vs_base = '' if dj is None else f"\n{dj:+.1f}% vs {name}"
        if r['j_tok'] is not None:
            energy.append((m, r['j_tok'], f"{r['j_tok']:.3g}{vs_base}"))
    return {'tokens/s': speed, 'J/token': energy}


def bench_chart(rows, against, base, title, path):
    """bench.py's table (rows, each arm's ratios to base) as two bar panels in a PNG at path,
    under title (bench.py's overlap lines)."""
    plt = pyplot()
    bars = bench_bars(rows, against, base)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (unit, bs) in zip(axes, bars.items()):
        ax.set_ylabel(unit)
        ax.set_xlabel('arm')
        ax.grid(axis='y', alpha=0.3)
        if not bs:
            empty(ax, "no energy meter here: J/token n/a")
            continue
        colours = [f'C{i}' for i in range(len(bs))]
        drawn = ax.bar([b[0] for b in bs], [b[1] for b in bs], color=colours)
        ax.bar_label(drawn, [b[2] for b in bs], fontsize=9)
        ax.set_ylim(0, 1.3 * max(b[1] for b in bs))  # room for the labels
    axes[0].set_title('Tokens per second (higher is better)', fontsize=11)
    axes[1].set_title('Energy per token (lower is better)', fontsize=11)
    fig.suptitle(f"{title} (1.0: the engines overlap perfectly)", fontsize=11)
    fig.tight_layout()
    save(fig, path, plt)
    return path


if __name__ == '__main__':
    main()
