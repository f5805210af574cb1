"""What a person sees: Ctrl-C (a real SIGINT to the process group, as a terminal sends it) at the
ANE worker's start and mid-training, --resume taking the run's own settings, --help naming this
machine's defaults, and the log of a run whose output is not a terminal (lines, the projected time)."""
import contextlib
import io
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import hetero_gpt as hg
import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, 'tests', 'macos_double')


def start(args, cwd, mac=False, **switches):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(([DOUBLE] if mac else []) + [ROOT]))
    if mac:
        env |= dict(HETERO_MACOS_DOUBLE='1', MACOS_DOUBLE_LOG=str(cwd)) | switches
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def until(proc, words, timeout=300):
    """stdout's lines until one holds words."""
    said, t0 = '', time.monotonic()
    while words not in said:
        line = proc.stdout.readline()
        assert line and time.monotonic() - t0 < timeout, (said, proc.stderr.read())
        said += line
    return said


def shm():
    return set(glob.glob('/dev/shm/psm_*'))


def left_behind(before):
    """Shared memory made since `before` that no live process maps: left by the run's processes,
    not the segments of tests running beside this one (each mapped while in use). Read twice, a
    second apart, so that one being made or freed at the first read is not counted."""
    def unmapped():
        new = shm() - before
        for maps in glob.glob('/proc/[0-9]*/maps'):
            with contextlib.suppress(OSError):  # a process that has ended
                new -= set(re.findall(r'/dev/shm/psm_\w+', open(maps).read()))
        return new
    first = unmapped()
    time.sleep(1.0)
    return first & unmapped()


def ctrl_c(proc, after):
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return out, err


def no_children(proc):
    """Nothing of the process group left within 5 s (multiprocessing's resource tracker leaves as its pipe closes)."""
    for _ in range(50):
        ps = subprocess.run(['ps', '-o', 'pid=,args=', '-g', str(proc.pid)], capture_output=True, text=True).stdout
        if not ps.strip():
            return
        time.sleep(0.1)
    assert ps.strip() == '', ps


@pytest.mark.slow  # a real SIGINT to a process group: seconds of start-up each
@pytest.mark.skipif(not os.path.isdir('/proc/self'), reason="finds shared memory in use in /proc")
def test_ctrl_c_mid_training_saves_returns_at_once_and_exits_130(data_dir, tmp_path):
    # hetero with the ANE's stand-in in its worker: Ctrl-C while steps run saves a checkpoint, says so in
    # one line and exits 130 without waiting for the engines' threads; no worker, no shared memory left
    before = shm()
    flags = helpers.flags(data_dir, tmp_path / 'out', max_iters=100000, mode='hetero', ane_worker='true',
                          ane_fraction=0.5, log_interval=1, quiet=None)
    proc = start([os.path.join(ROOT, 'hetero_gpt.py'), *flags], tmp_path)
    said = until(proc, 'step 3/')
    out, err = ctrl_c(proc, 0.5)
    assert proc.returncode == 130, err
    assert 'Traceback' not in err and 'Exception ignored' not in err, err
    lines = [line for line in (said + out + err).splitlines() if 'interrupted' in line]
    assert len(lines) == 1 and lines[0].startswith('interrupted: saved step ') and 'continue with --resume' in lines[0]
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] >= 3
    no_children(proc)
    assert left_behind(before) == set()


@pytest.mark.slow  # a step of 32 s
@pytest.mark.skipif(not os.path.isdir('/proc/self'), reason="finds shared memory in use in /proc")
@pytest.mark.parametrize('sig, code', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_in_a_long_gpu_step_returns_within_seconds(data_dir, tmp_path, sig, code):
    # under the double's MPS each backward pass queues 4 s of GPU work, so a step of 8
    # microbatches takes 32 s. A signal 2 s into step 2 stops the engine after its microbatch:
    # one line, step 1's checkpoint, the signal's exit code, within 15 s of the 30 s left.
    # A second Ctrl-C a second later changes none of that; nothing is left running.
    before = shm()
    flags = helpers.flags(data_dir, tmp_path / 'out', max_iters=100, mode='gpu', device='mps',
                          batch_size=1, gradient_accumulation_steps=8, log_interval=1, quiet=None)
    proc = start([os.path.join(ROOT, 'hetero_gpt.py'), *flags], tmp_path, mac=True,
                 MACOS_DOUBLE_MPS_SLOW='4')
    until(proc, 'step 1/')
    time.sleep(2.0)
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # a second one, impatient
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == code, err[-3000:]
    assert took < 15, took
    assert 'Traceback' not in err and 'terminate called' not in err, err[-3000:]
    lines = [line for line in (out + err).splitlines() if 'interrupted' in line]
    assert len(lines) == 1 and lines[0].startswith('interrupted: saved step 1 '), out + err
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 1
    no_children(proc)
    assert left_behind(before) == set()


@pytest.mark.slow  # a real SIGINT to a process group: seconds of start-up each
@pytest.mark.skipif(not os.path.isdir('/proc/self'), reason="finds shared memory in use in /proc")
def test_ctrl_c_while_the_ane_worker_starts_is_one_line_and_130(shakespeare, tmp_path):
    # on the double's Mac, Ctrl-C while the worker compiles (the first start may take many minutes):
    # one line, exit 130, no traceback (the worker's start caught only its own faults), nothing left
    os.symlink(shakespeare[0] / 'data', tmp_path / 'data')
    before = shm()
    proc = start([os.path.join(ROOT, 'hetero_gpt.py'), '--dataset', 'shakespeare', '--n_layer', '2', '--n_head', '2',
                  '--n_embd', '64', '--block_size', '32', '--batch_size', '2', '--gradient_accumulation_steps', '2',
                  '--max_iters', '2'], tmp_path, mac=True)
    until(proc, 'starting the ANE worker')
    out, err = ctrl_c(proc, 0.5)
    assert proc.returncode == 130, err[-3000:]
    assert 'Traceback' not in err and 'KeyboardInterrupt' not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == 'interrupted'
    no_children(proc)
    assert left_behind(before) == set()


def test_resume_takes_the_runs_own_settings(data_dir, tmp_path, capsys):
    # a run of 2 microbatches of 2 (one block): --resume with only --max_iters continues it with its own
    # batch, model and schedule, naming the one flag given; a model flag that disagrees is refused at once
    helpers.train(data_dir, tmp_path / 'r', max_iters=4, mode='hetero', ane_fraction=0.5)
    capsys.readouterr()
    bare = ['--data_dir', data_dir, '--dataset', 'tiny', '--out_dir', str(tmp_path / 'r'), '--device', 'cpu',
            '--ane_worker', 'false', '--quiet', '--sample_tokens', '0', '--resume']
    cfg, given = hg.parse_args(bare + ['--max_iters', '6'])
    model = hg.train(cfg, given)
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if x.startswith('--resume: continuing'))
    assert line.startswith(f"--resume: continuing the run in {tmp_path / 'r'} with its own settings (")
    assert line.endswith("; given here instead: --max_iters 6 (was 4)")
    assert 'n_layer=1 ' in line and 'mode=hetero' in line  # what it restored, named
    assert 'not used' not in said  # no flag restored is called a flag given
    c, last = model.config, helpers.rows(tmp_path / 'r')[-1]
    assert (c.n_layer, c.n_embd, c.block_size, last['step'], last['mode']) == (1, 16, 16, 6, 'hetero')
    # its 2 microbatches of 2 sequences of 16 tokens a step, 1 of them the ANE's (--ane_fraction 0.5)
    assert (last['tokens'], last['microbatches'], last['ane_microbatches']) == (6 * 2 * 2 * 16, 2, 1)
    assert 'no GPU: small model' not in said  # the machine's defaults did not replace the run's
    assert 'replaces the checkpoint' not in said  # a setting restored is not a flag given: the split goes on
    cfg, given = hg.parse_args(bare + ['--n_layer', '2'])
    with pytest.raises(hg.UserError, match=r'--resume: .* holds a model of .*n_layer=1.*leave out --n_layer'):
        hg.train(cfg, given)


def test_help_names_this_machines_defaults(capsys):
    with pytest.raises(SystemExit):
        hg.parse_args(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    here = 'here, no GPU' if not (torch.cuda.is_available() or torch.backends.mps.is_available()) else None
    if here:
        assert f"transformer blocks (default {here}: {hg.CPU_DEFAULTS['n_layer']}; with --preset gpt2: 12; with a CUDA GPU: 12)" in text


def test_bench_help_shows_its_own_flags_first(capsys):
    import bench
    with pytest.raises(SystemExit):
        hg.parse_args(['--help'], bench.BenchConfig, bench.__doc__)
    text = capsys.readouterr().out
    assert text.index("own flags:") < text.index('--bench_iters BENCH_ITERS\n') < text.index("the trainer's flags")
    assert text.index("the trainer's flags") < text.index('--batch_size BATCH_SIZE\n')


@pytest.mark.slow  # a trainer process of its own
def test_a_log_that_is_not_a_terminal_is_lines_with_the_projected_time(data_dir, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'hetero_gpt.py'),
                        *helpers.flags(data_dir, tmp_path / 'o', max_iters=8, log_interval=2, eval_interval=4, quiet=None)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert '\r' not in r.stdout + r.stderr  # no progress bar redrawn in a file
    steps = [line for line in r.stdout.splitlines() if line.startswith('step ')]
    assert [s.split(',')[0] for s in steps] == ['step 2/8', 'step 4/8', 'step 6/8', 'step 8/8']
    assert all(' tokens/s' in s and 'loss ' in s for s in steps)
    projected = [line for line in r.stdout.splitlines() + r.stderr.splitlines() if line.startswith('projected: ')]
    assert len(projected) == 1 and 'steps left to --max_iters 8 take' in projected[0]


@pytest.mark.parametrize('flags', [[], ['--preset', 'gpt2'], ['--n_layer', '2', '--n_head', '2', '--n_embd', '64',
                                                               '--block_size', '32']])
def test_the_check_exports_where_the_trainer_reads(monkeypatch, flags):
    # export_ane.py --check's defaults are the trainer's on a Mac (model, microbatch, calls), and its
    # programs go to the very folder that run's trainer reads, so the check warms the trainer's cache
    import export_ane
    seen = {}
    monkeypatch.setattr(export_ane.ane_check, 'main', lambda cfg, B, T, out, gpu_batch, *a, **k: seen.update(
        cfg=cfg, B=B, T=T, out=out, gpu_batch=gpu_batch, run_tokens=k['run_tokens']) or 0)
    assert export_ane.main(['--check', *flags]) == 0
    monkeypatch.setattr(hg.settings, 'ON_MAC', True)
    monkeypatch.setattr(hg.settings, 'resolve_device', lambda name, flag='--device': torch.device('mps'))
    for check in ('check_mps', 'check_coreml', 'check_ane_alignment'):
        monkeypatch.setattr(hg.settings, check, lambda *a, **k: None)
    cfg, given = hg.parse_args(flags)
    cfg, run = hg.setup(cfg, given, log=lambda s: None)
    monkeypatch.setattr(hg.programs, 'ensure', lambda path, *a: path)
    monkeypatch.setattr(hg, 'ON_MAC', True)
    spec = hg.ane_spec(cfg, run)
    assert (seen['out'], seen['B'], seen['T'], seen['gpu_batch']) == (spec.programs, run.ane_batch_size, spec.T, cfg.batch_size)
    assert seen['cfg'] == hg.model_config(cfg)
    assert seen['run_tokens'] == cfg.max_iters * cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size


@pytest.mark.slow  # a real SIGINT to a process group: seconds of start-up each
def test_ctrl_c_in_bench_is_one_line_and_130(data_dir, tmp_path):
    proc = start([os.path.join(ROOT, 'bench.py'), *helpers.flags(data_dir, tmp_path / 'b', quiet=None),
                  '--bench_iters', '100000'], tmp_path)
    until(proc, 'gpu: building')
    out, err = ctrl_c(proc, 3)
    assert proc.returncode == 130, err
    assert 'Traceback' not in err and err.strip().splitlines()[-1] == 'interrupted', err
    no_children(proc)


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_the_bar_shows_one_eta_and_fits_110_columns(monkeypatch):
    # the bar's own remaining time (tqdm's, which counts the compiling first step) is not shown:
    # one projection, from the steps after the first, evaluations and checkpoints included;
    # the row's values under short names, so that J/token fits beside them at 110 columns; the
    # gradient's norm of every step (before clipping), logged row or not
    monkeypatch.setattr(hg.progress, 'no_bar', lambda quiet: False)
    monkeypatch.setattr(sys, 'stderr', Tty())
    monkeypatch.setenv(hg.progress.QUIET_ENV, '1')  # no first-step timer thread here
    cfg = hg.Config(max_iters=100, batch_size=2, block_size=16)
    said = []
    display = hg.progress.Display(cfg, hg.Progress(), log=said.append)
    row = dict(loss=10.87654, val_loss=10.5, tokens_per_s=123456.7, ane_microbatches=1,
               joules_per_token=0.00123)
    for it in range(1, 6):
        prog = hg.Progress(it=it)
        display.stepped(prog, row if it < 5 else {}, hg.StepResult(10.0, 2, ['gpu'], it + 0.25, 0, {}))
    bar = str(display.bar)
    display.close()
    assert 'mJ/tok=1.2' in bar and 'eta=' in bar and '<' not in bar, bar  # tqdm's ETA is '<remaining'
    assert 'norm=5.2,' in bar and 'loss=10.877' in bar, bar  # this step's norm; the last row's loss
    postfix = bar[bar.index('loss='):].rstrip(']')
    # the bar's fixed parts take ~28 columns at 1000 steps, the bar itself at least 10
    assert len(postfix) <= 110 - 28 - 10, postfix
    assert len(said) == 1 and said[0].startswith('projected: ') and 'with evaluations and checkpoints' in said[0]


def test_the_header_is_a_line_each_and_messages_never_glue_to_a_timer(capsys):
    class Eng:
        label = 'Core ML programs out/ane_B4_T256 (loaded in 1.2 s; 100% of ops on the Neural Engine)'

    class Meter:
        meters, missing, name = [1], [], 'powermetrics (CPU, GPU and ANE power)'
    model = hg.GPT(hg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50))
    lines = hg.progress.header(model, 'hetero', {'gpu': Eng(), 'ane': Eng()}, Meter()).splitlines()
    assert len(lines) == 4 and all(len(line) <= 100 for line in lines), lines
    stream = Tty()
    ticker = hg.progress.Ticker('concurrency', stream=stream)
    ticker.tty = True
    with ticker:
        stream.write('\rconcurrency: 6s')  # the timer's line, live
        hg.progress.say('starting the ANE worker')
    assert stream.getvalue().startswith('\rconcurrency: 6s\r\x1b[K'), repr(stream.getvalue())
    assert capsys.readouterr().out == 'starting the ANE worker\n'
