"""tools/plot.py, a run's curves as a picture and bench.py's table as a chart: what each panel
draws from known rows (a run resumed in a second process, an ANE share dropped, no energy meter,
torchrun's ranks, a half-written last line), the PNG written, one line and exit 2 without
matplotlib; --wandb_log, its rows read back from wandb's offline files; and the project
without tools/plot.py."""
import json
import os
import shutil
import subprocess
import sys
import types

import pytest

import hetero_gpt as hg
import helpers
from tools import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b'\x89PNG\r\n\x1a\n'  # a PNG file's first 8 bytes
needs_matplotlib = pytest.mark.skipif(plot.pyplot() is None, reason="needs matplotlib")


def row(step, loss, ane, dropped_ane=0, skipped=0, **more):
    """A metrics.jsonl row of a hetero run: 64 tokens a step, 2 microbatches, no energy meter."""
    r = dict(step=step, loss=loss, lr=1e-3, tokens=64 * step, tokens_per_s=1000.0 + step,
             elapsed=step / 10, mode='hetero', grad_norm=1.0 / step, memory=dict(rss=1),
             ane_microbatches=ane, microbatches=2, dropped=dict(gpu=0, ane=dropped_ane),
             skipped=skipped, gpu_tokens_per_s=600.0 + step, gpu_loss=loss,
             loss_scale=4096.0 / (1 + dropped_ane))
    if ane:
        r |= dict(ane_tokens_per_s=500.0 + step, ane_loss=loss)
    return r | more


# Process 1 logs steps 5 and 10 (the ANE's share dropped once by then; a checkpoint at 10).
# Process 2 resumes from it: its counts start again from 0; it skips an update by step 15 (no
# share for the ANE), drops the ANE's share again by step 20, and is writing step 25's row now.
WRITTEN = [row(5, 4.0, 1, val_loss=4.2), row(10, 3.5, 1, dropped_ane=1, val_loss=3.9),
           row(15, 3.4, 0, skipped=1), row(20, 3.2, 1, dropped_ane=1, skipped=1, val_loss=4.0)]
PARTIAL = '{"step": 25, "loss": 3.1, "tok'


def write_run(folder, rows=WRITTEN, tail=PARTIAL):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'metrics.jsonl'), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in rows)
        f.write(tail)
    return folder


def test_series_of_a_resumed_run_with_a_dropped_share(tmp_path):
    # the half-written line is left out; the ANE's dropped shares are marked where its count
    # grew (10, and 20 after the restart), the skipped update at 15; no J/token column: no
    # energy series. The values are the rows' own numbers, passed through (exact)
    rows = plot.read_rows(write_run(tmp_path / 'out') / 'metrics.jsonl')
    assert rows == WRITTEN
    s = plot.series(rows)
    assert s['loss'] == {'training': ([320, 640, 960, 1280], [4.0, 3.5, 3.4, 3.2]),
                         'validation': ([320, 640, 1280], [4.2, 3.9, 4.0]),
                         'best checkpoint': ([640], [3.9])}
    assert s['speed'] == {'whole step': ([5, 10, 15, 20], [1005.0, 1010.0, 1015.0, 1020.0]),
                          'ane, alone in its share': ([5, 10, 20], [505.0, 510.0, 520.0]),
                          'gpu, alone in its share': ([5, 10, 15, 20],
                                                      [605.0, 610.0, 615.0, 620.0])}
    assert s['share'] == {'ANE share': ([5, 10, 15, 20], [50.0, 50.0, 0.0, 50.0]),
                          'ane share dropped': ([10, 20], [50.0, 50.0]),
                          'no update (skipped)': ([15], [0.0])}
    assert s['scale'] == {'ANE': ([5, 10, 15, 20], [4096.0, 2048.0, 4096.0, 2048.0])}
    assert s['energy'] == {}
    assert s['norm'] == {'gradient norm': ([5, 10, 15, 20], [1 / 5, 1 / 10, 1 / 15, 1 / 20])}


def test_a_later_segment_replaces_the_rows_from_its_step_on(tmp_path):
    # rows past a checkpoint that a later process logged again (--resume truncates them first;
    # a copy made before it still holds them): the later rows win
    stale = [row(5, 4.0, 1), row(10, 3.5, 1), row(15, 3.3, 1), row(20, 3.1, 1)]
    again = [row(15, 3.4, 1), row(20, 3.2, 1)]
    rows = plot.read_rows(write_run(tmp_path, stale + again, tail='') / 'metrics.jsonl')
    assert rows == stale[:2] + again


def test_ranks_count_together():
    # under torchrun a row holds each rank's own values: microbatches, rates and dropped shares
    # add up over ranks, J/token too (each rank's meter over every rank's tokens)
    mine = dict(ane_microbatches=1, microbatches=2, dropped=dict(gpu=0, ane=1), skipped=0,
                gpu_tokens_per_s=100.0, ane_tokens_per_s=50.0, loss_scale=1024.0,
                joules_per_token=0.25)
    other = mine | dict(ane_microbatches=0, dropped=dict(gpu=0, ane=0), gpu_tokens_per_s=120.0,
                        joules_per_token=0.5)
    other.pop('ane_tokens_per_s')
    rows = [dict(step=10, loss=3.0, tokens=640, tokens_per_s=300.0, grad_norm=0.5,
                 ranks=[mine, other])]
    s = plot.series(rows)
    assert s['share'] == {'ANE share': ([10], [25.0]), 'ane share dropped': ([10], [25.0])}
    assert s['speed']['gpu, alone in its share'] == ([10], [220.0])
    assert s['energy'] == {'J/token': ([10], [0.75])}


@needs_matplotlib
def test_pictures_beside_the_metrics(tmp_path, capsys):
    # the resumed run above: metrics.png beside its metrics; with another: overlay.png in the
    # first one's folder; each path printed, no .tmp left
    first = write_run(tmp_path / 'a')
    write_run(tmp_path / 'b', [row(5, 4.1, 0), row(10, 3.6, 0, val_loss=3.8)], tail='')
    assert plot.main([str(first)]) == str(first / 'metrics.png')
    assert plot.main([str(first), str(tmp_path / 'b')]) == str(first / 'overlay.png')
    assert capsys.readouterr().out == f"{first / 'metrics.png'}\n{first / 'overlay.png'}\n"
    for name in ('metrics.png', 'overlay.png'):
        assert (first / name).read_bytes()[:8] == PNG
    assert sorted(os.listdir(first)) == ['metrics.jsonl', 'metrics.png', 'overlay.png']


def test_without_matplotlib_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)  # import matplotlib fails
    with pytest.raises(SystemExit) as e:
        plot.main([str(write_run(tmp_path / 'out'))])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: matplotlib is not installed: pip install matplotlib\n"
    assert os.listdir(tmp_path / 'out') == ['metrics.jsonl']


@needs_matplotlib
def test_a_folder_without_a_run_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith('error: ') and err.count('\n') == 1, err


def test_a_real_resumed_run(data_dir, finished_run, tmp_path, capsys):
    # the trainer's own file: a run of 10 steps (GPU alone), resumed to 15, logged every 5 steps
    # with an evaluation each; the resumed run's end names the command once
    out = tmp_path / 'run'
    shutil.copytree(finished_run, out)
    helpers.train(data_dir, out, max_iters=15, resume=True)
    said = capsys.readouterr().out
    assert said.count(f"its curves as a picture: python -m tools.plot {out}\n") == 1
    rows = plot.read_rows(out / 'metrics.jsonl')
    s = plot.series(rows)
    assert [r['tokens'] for r in rows] == [320, 640, 960]
    assert s['loss']['validation'][0] == s['loss']['training'][0] == [320, 640, 960]
    assert s['share']['ANE share'] == ([5, 10, 15], [0.0, 0.0, 0.0]) and s['scale'] == {}


# ---- bench.py's chart

PAPER = dict(gpu=dict(tok_s=1000.0, j_tok=0.01), ane=dict(tok_s=600.0, j_tok=0.004),
             hetero=dict(tok_s=1419.0, j_tok=0.00691))  # test_train's paper row


def test_bench_bars_are_the_tables_numbers():
    import bench
    bars = plot.bench_bars(PAPER, bench.against(PAPER), bench.baseline(PAPER))
    assert [b[:2] for b in bars['tokens/s']] == [('gpu', 1000.0), ('ane', 600.0),
                                                 ('hetero', 1419.0)]
    assert [b[:2] for b in bars['J/token']] == [('gpu', 0.01), ('ane', 0.004), ('hetero', 0.00691)]
    assert bars['tokens/s'][2][2] == "1,419\n1.419x GPU-only"
    assert bars['J/token'][2][2] == "0.00691\n-30.9% vs GPU-only"
    no_meter = {m: r | dict(j_tok=None) for m, r in PAPER.items()}
    assert plot.bench_bars(no_meter, bench.against(no_meter), 'gpu')['J/token'] == []
    # with MLX: each arm against MLX alone, named so
    mlx = dict(PAPER, **{'gpu-mlx': dict(tok_s=1892.0, j_tok=0.005)})
    bars = plot.bench_bars(mlx, bench.against(mlx), bench.baseline(mlx))
    assert bars['tokens/s'][2][2] == "1,419\n0.750x gpu-mlx"  # 1419 / 1892
    assert bars['J/token'][2][2] == "0.00691\n+38.2% vs gpu-mlx"  # 6.91 / 5 - 1


@needs_matplotlib
def test_bench_chart_is_written(tmp_path):
    import bench
    path = str(tmp_path / 'bench.png')
    title = '; '.join(bench.overlaps(PAPER))
    assert title == "hetero / (gpu + ane alone) = 0.887"  # 1419 / 1600
    assert plot.bench_chart(PAPER, bench.against(PAPER), 'gpu', title, path) == path
    assert open(path, 'rb').read(8) == PNG


@pytest.mark.slow  # bench.py's warm-up: 3 s a mode
@needs_matplotlib
def test_bench_plot_draws_its_table(data_dir, tmp_path, capsys):
    import bench
    path = str(tmp_path / 'bench.png')
    cfg, given = hg.parse_args(helpers.flags(data_dir, bench_iters=1, bench_repeats=1,
                                             ane_fraction=0.5, plot=path), bench.BenchConfig)
    bench.bench(cfg, given)
    assert capsys.readouterr().out.endswith(f"chart: {path}\n")
    assert open(path, 'rb').read(8) == PNG


def test_bench_plot_without_matplotlib_stops_before_benchmarking(data_dir, monkeypatch, capsys):
    # checked first: the data set named here does not exist, and is never reached
    import bench
    monkeypatch.setitem(sys.modules, 'matplotlib', None)
    with pytest.raises(SystemExit) as e:
        hg.main(['--dataset', 'nowhere', '--data_dir', data_dir, '--plot', 'b.png'],
                job=bench.bench, cls=bench.BenchConfig)
    assert e.value.code == 2
    said = capsys.readouterr().err
    assert said == "error: --plot: matplotlib is not installed: pip install matplotlib\n"


# ---- --wandb_log

class FakeRun:
    """A wandb run that keeps what it is given; its log raises from the `fails`-th call on."""

    def __init__(self, fails=None, **init):
        self.init = init
        self.rows = []
        self.fails = fails
        self.finished = False

    def log(self, row, step):
        if self.fails is not None and len(self.rows) >= self.fails:
            raise ConnectionError("wandb's service went away")
        self.rows.append((step, row))

    def finish(self):
        self.finished = True


def fake_wandb(monkeypatch, fails=None):
    """A wandb module whose init makes FakeRuns: the list of them."""
    runs = []

    def init(**settings):
        runs.append(FakeRun(fails, **settings))
        return runs[-1]
    monkeypatch.setitem(sys.modules, 'wandb', types.SimpleNamespace(init=init))
    return runs


def test_wandb_gets_the_rows_and_settings_and_never_stops_training(data_dir, tmp_path,
                                                                    monkeypatch, capsys):
    # the rows of metrics.jsonl at their steps, the run's settings once; a log that raises from
    # the second row on is said once, and training goes on to its end with every row in the file
    runs = fake_wandb(monkeypatch, fails=1)
    _, rows = helpers.train(data_dir, tmp_path / 'run', max_iters=15, wandb_log=True,
                            wandb_project='p', wandb_run_name='n')
    (run,) = runs
    assert run.init['project'] == 'p' and run.init['name'] == 'n'
    assert run.init['config']['max_iters'] == 15 and run.init['config']['n_embd'] == 16
    assert run.rows == [(5, rows[0])] and [r['step'] for r in rows] == [5, 10, 15]
    said = capsys.readouterr().out
    assert said.count("wandb stopped logging (ConnectionError: wandb's service went away); "
                      "training goes on, metrics.jsonl has every row\n") == 1
    assert not run.finished  # (it had stopped)


def test_wandb_logs_from_rank_0_alone(monkeypatch, tmp_path):
    from plumbing import progress
    runs = fake_wandb(monkeypatch)
    cfg = hg.Config(out_dir=str(tmp_path), wandb_log=True)
    meter = types.SimpleNamespace(joules=lambda: None, meters=[])
    prog = hg.Progress()
    for rank in (1, 0):
        m = progress.Metrics(cfg, rank, {}, types.SimpleNamespace(device='cpu'), meter, prog)
        m.write(dict(step=1))
        m.close()
    assert len(runs) == 1 and runs[0].rows == [(1, dict(step=1))] and runs[0].finished


def test_wandb_that_cannot_start_is_said_once(monkeypatch, capsys):
    # wandb.init raising (no login, say): one line, and the run logs to metrics.jsonl alone
    from plumbing import progress

    def init(**settings):
        raise RuntimeError("api_key not configured (no-tty)")
    monkeypatch.setitem(sys.modules, 'wandb', types.SimpleNamespace(init=init))
    tracker = progress.Tracker(hg.Config(wandb_log=True))
    tracker.log(dict(step=1))
    tracker.finish()
    assert tracker.run is None
    assert capsys.readouterr().out == ("wandb stopped logging (RuntimeError: api_key not configured "
                                       "(no-tty)); training goes on, metrics.jsonl has every row\n")


def test_wandb_log_without_wandb_stops_at_start(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb fails
    assert helpers.main(data_dir, tmp_path / 'run', wandb_log=True) == 2
    said = capsys.readouterr().err
    assert said == "error: --wandb_log needs wandb: pip install wandb, or leave --wandb_log out\n"
    assert not os.path.exists(tmp_path / 'run')


def flat(row, head=''):
    """A row as wandb keeps it: nested dicts' keys joined with dots."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out |= flat(v, f'{head}{k}.')
        else:
            out[f'{head}{k}'] = v
    return out


@pytest.mark.slow  # a process of its own, with wandb's service: ~5 s
def test_wandb_offline_files_hold_the_rows(data_dir, tmp_path):
    # a real wandb, offline (files only), in a process of its own: the run's file, read back by
    # wandb's own reader (`wandb leet inspect --json`), holds metrics.jsonl's rows at their
    # steps, equal to the last bit (both are the same floats through JSON), and the settings
    pytest.importorskip('wandb')
    env = dict(os.environ, WANDB_MODE='offline', WANDB_DIR=str(tmp_path), WANDB_SILENT='true',
               PYTHONPATH=ROOT)
    flags = helpers.flags(data_dir, tmp_path / 'run', max_iters=10, mode='hetero',
                          ane_fraction=0.5, wandb_log=True, wandb_project='heteroengine-test',
                          wandb_run_name='tiny')
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'hetero_gpt.py'), *flags], env=env,
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (run_dir,) = (tmp_path / 'wandb').glob('offline-run-*')
    reader = [sys.executable, '-m', 'wandb', 'leet', 'inspect', '--json', str(run_dir)]
    read = subprocess.run(reader, env=env, capture_output=True, text=True)
    assert read.returncode == 0, read.stderr[-2000:]
    records = [json.loads(line) for line in read.stdout.splitlines()]
    history = [rec['history'] for rec in records if rec['type'] == 'history']
    logged = [{k: v for k, v in h['item'].items() if not k.startswith('_')} for h in history]
    rows = helpers.rows(tmp_path / 'run')
    assert [r['step'] for r in rows] == [5, 10] and logged == [flat(r) for r in rows]
    assert [h['step']['num'] for h in history] == [5, 10]
    (start,) = [rec['run'] for rec in records if rec['type'] == 'run']
    assert start['project'] == 'heteroengine-test' and start['display_name'] == 'tiny'
    settings = start['config']['update']
    assert settings['max_iters'] == 10 and settings['mode'] == 'hetero' and settings['wandb_log']


# ---- the project without tools/plot.py

WITHOUT = """
import importlib.util, bench, hetero_gpt as hg, prepare_data
assert importlib.util.find_spec('tools.plot') is None
prepare_data.prepare('tiny', data_dir='data', input_path='tiny.txt')
hg.main(['--dataset', 'tiny', '--n_layer', '1', '--n_head', '2', '--n_embd', '16',
         '--block_size', '16', '--device', 'cpu', '--max_iters', '3', '--eval_iters', '1',
         '--sample_tokens', '0', '--quiet'])
try:
    hg.main(['--plot', 'b.png'], job=bench.bench, cls=bench.BenchConfig)
except SystemExit as e:
    print('bench --plot', e.code)
"""


def left_out(folder, names):
    """shutil.copytree's ignore: git, caches, runs, data, wandb's files, and tools/plot.py."""
    top = os.path.samefile(folder, ROOT)
    plot_py = os.path.join(ROOT, 'tools', 'plot.py')
    return [n for n in names if n in ('__pycache__', 'wandb') or os.path.join(folder, n) == plot_py
            or top and n.startswith(('.', 'out', 'data'))]


@pytest.mark.slow  # a copy of the project, trained in a process of its own: ~5 s
def test_the_project_without_plot_py(tmp_path):
    # deleted, nothing else changes: the trainer trains and names no command to draw the run;
    # bench.py says in one line what --plot lacks
    shutil.copytree(ROOT, tmp_path, ignore=left_out, dirs_exist_ok=True)
    lines = [f"line {i} of the king and the queen" for i in range(300)]
    (tmp_path / 'tiny.txt').write_text('\n'.join(lines))
    r = subprocess.run([sys.executable, '-c', WITHOUT], cwd=tmp_path, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.returncode == 0 and 'Traceback' not in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    assert 'step 3/3' in r.stdout and 'tools.plot' not in r.stdout
    assert 'bench --plot 2' in r.stdout
    assert 'error: --plot needs tools/plot.py, which is absent\n' in r.stderr
    assert [row['step'] for row in helpers.rows(tmp_path / 'out')] == [3]
