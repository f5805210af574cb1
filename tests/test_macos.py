"""The Mac user's commands, run here under a double of only what Linux lacks
(tests/macos_double: Core ML's native module under coremltools, the OS identity,
powermetrics and sudo). coremltools' own Python and all of the project run for real, in
every process: the trainer, its ANE worker, the self-check's stages. CI runs this file
twice: with the newest coremltools and with the oldest requirements.txt allows."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import hetero_gpt as hg
import helpers
from plumbing import energy
from tools import ane_check
from plumbing import memory
from plumbing import programs as coreml_programs
from plumbing import settings
from tools import ane_check

import coremltools  # noqa: F401  (a test requirement)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, 'tests', 'macos_double')
# aligned as the ANE needs (multiples of 32: T, C, the head size), small enough for NumPy
TINY = ['--n_layer', '2', '--n_head', '2', '--n_embd', '64', '--block_size', '32']
TRAIN = ['--dataset', 'shakespeare', *TINY, '--batch_size', '2', '--gradient_accumulation_steps', '2',
         '--eval_interval', '2', '--eval_iters', '1', '--log_interval', '1', '--sample_tokens', '0', '--seed', '3']
# the trainer's programs for TRAIN's model, and a smaller model's for the scripts below: 2 x 32 tokens a call
TRAIN_MODEL = hg.GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)


def mac(args, cwd, timeout=600, **switches):
    """python ARGS on the double's Mac, in cwd; switches: MACOS_DOUBLE_* settings by suffix
    (no sudo rights unless sudo=1). Its stdin is a pipe, as a terminal would be: not /dev/null."""
    env = dict(os.environ, HETERO_MACOS_DOUBLE='1', PYTHONPATH=os.pathsep.join([DOUBLE, ROOT]),
               MACOS_DOUBLE_LOG=str(cwd), **{f'MACOS_DOUBLE_{k.upper()}': str(v) for k, v in switches.items()})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          input='')


def coreml_log(cwd):
    path = os.path.join(cwd, 'coreml.log')
    return [line.split()[1:] for line in open(path)] if os.path.exists(path) else []


def sudo_stdins(cwd):
    """What each sudo the double ran had as its stdin (bin/sudo notes it)."""
    path = os.path.join(cwd, 'sudo.log')
    return [line.split()[0] for line in open(path)] if os.path.exists(path) else []


def ane_shares(programs_dir, op_type):
    """Each program's share of ops left on the ANE when Core ML puts op_type on the CPU,
    counted from the saved programs themselves (program_report), not from Core ML."""
    reports = {p: coreml_programs.program_report(coreml_programs.load_coreml_program(
        coreml_programs.program_path(programs_dir, p))) for p in hg.ANE_PIECES}
    return {p: round(1 - r['op_types'].get(op_type, 0) / r['ops'], 4) for p, r in reports.items()}, \
        {p: r['op_types'].get(op_type, 0) for p, r in reports.items()}


def error_lines(r):
    """The lines of an 'error:' (coremltools' warnings and progress bars go to stderr too)."""
    assert 'Traceback' not in r.stderr, r.stderr[-3000:]
    return [line for line in r.stderr.splitlines() if line.startswith('error:')]


def rows(cwd, out_dir='out'):
    return [json.loads(line) for line in open(os.path.join(cwd, out_dir, 'metrics.jsonl'))]


def cwd_with_data(shakespeare, tmp_path):
    """tmp_path, with data/shakespeare (prepared once, offline: conftest.py) linked into it."""
    os.symlink(shakespeare[0] / 'data', tmp_path / 'data')
    return tmp_path


def programs_in(folder, exported, cfg=None, B=2, T=32):
    """A copy, in folder/p, of the programs for cfg at B x T tokens a call (exported once a test
    run; by default helpers.PROGRAMS): what is compiled for Core ML goes into the copy."""
    shutil.copytree(exported(cfg, B, T) if cfg else exported(**helpers.PROGRAMS), folder / 'p')
    return str(folder / 'p')


def train_through_core_ml(cwd, *flags, **switches):
    return mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, *flags], cwd, **switches)


@pytest.mark.slow  # two processes that import coremltools, then a trainer; parts' tests are the fast Core ML ones
def test_training_on_both_engines_through_core_ml(shakespeare, exported, tmp_path):
    # hetero by default: the ANE's share in its worker, through CompiledMLModel from the
    # compile cache, never retired; its first step's loss is the GPU-only run's (the same
    # weights and batch: the ANE's half in fp16, rounding ~1e-3 of the loss). Core ML puts
    # reduce_max on the CPU here: the start line says each program's share of ops on the
    # ANE, as counted from the programs, and training goes on. No sudo rights, as on most
    # Macs: no energy meter, said once, and sudo never got the terminal's stdin
    cwd = cwd_with_data(shakespeare, tmp_path)
    p = programs_in(cwd, exported, TRAIN_MODEL)
    r = train_through_core_ml(cwd, '--max_iters', '2', '--ane_fraction', '0.5', '--ane_programs', p, cpu_ops='reduce_max')
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert 'mode hetero' in r.stdout and 'Core ML programs' in r.stdout
    assert "engine 'ane'" not in out and 'continuing with' not in out  # what a retired engine prints
    shares, counts = ane_shares(p, 'reduce_max')
    assert all(0 < v < 1 for v in shares.values()) and all(counts.values()), counts
    start = next(line for line in r.stdout.splitlines() if line.startswith('  ane: '))
    assert 'ANE share of ops ' + ' '.join(f'{k} {v}' for k, v in shares.items()) in start, start
    assert 'the rest runs on the CPU' in start and re.search(r'loaded in \d+\.\d s', start)
    log = coreml_log(cwd)
    compiled = [e for e in log if e[0] == 'compile']
    loads = [e for e in log if e[0] == 'load']
    assert sorted(e[1] for e in compiled) == [os.path.join(p, f'{piece}.mlpackage') for piece in sorted(hg.ANE_PIECES)]
    assert len(loads) == 3 and all(e[1].endswith('.mlmodelc') and '/compiled/' in e[1] and e[2] == 'CPU_AND_NE'
                                   for e in loads)
    hetero = rows(cwd)
    assert [r['step'] for r in hetero] == [1, 2] and all('ane_loss' in row for row in hetero)  # the ANE's share, every step
    assert r.stdout.count('a password is required') == 1 and 'energy meter: none' in r.stdout
    assert 'joules_per_token' not in hetero[-1] and sudo_stdins(cwd) == ['devnull']
    hg.train(*hg.parse_args(TRAIN + ['--data_dir', str(cwd / 'data'), '--out_dir', str(tmp_path / 'gpu'),
                                     '--max_iters', '1', '--mode', 'gpu', '--quiet']))  # (here: the same arithmetic)
    gpu = helpers.rows(tmp_path / 'gpu')
    assert abs(hetero[0]['loss'] - gpu[0]['loss']) < 1e-2 * hetero[0]['loss']
    assert hetero[0]['loss'] != gpu[0]['loss']  # (the ANE's half is its own)


@pytest.mark.slow
def test_a_slow_neural_engine_load_that_falls_back_to_the_cpu_shows_at_start(shakespeare, exported, tmp_path):
    # each program's ANE compile at load takes 2 s, then Core ML runs it on the CPU without a
    # word (coremltools #1900, #2758): training goes on, and its start line says how long the
    # load took and that no op of any program is on the ANE
    cwd = cwd_with_data(shakespeare, tmp_path)
    p = programs_in(cwd, exported, TRAIN_MODEL)
    r = train_through_core_ml(cwd, '--max_iters', '1', '--ane_fraction', '0.5', '--ane_programs', p, load_seconds=2,
                              ane_fallback=1)
    assert r.returncode == 0, r.stderr[-3000:]
    start = next(line for line in r.stdout.splitlines() if line.startswith('  ane: '))
    assert float(re.search(r'loaded in (\d+\.\d) s', start).group(1)) >= 6, start  # 3 programs, 2 s each
    assert 'ANE share of ops block_forward 0.0 head 0.0 block_backward 0.0; the rest runs on the CPU' in start, start
    assert 'ane_loss' in rows(cwd)[-1]


@pytest.mark.slow
def test_a_resumed_run_recompiles_a_damaged_entry_and_trains_without_sudo(shakespeare, tmp_path):
    # the trainer's own programs, exported into out_dir, with sudo rights granted: joules per
    # token from powermetrics; resumed with one cache entry damaged and no sudo rights: that
    # entry alone is compiled again; the run says once that it has no energy meter, and trains on
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = train_through_core_ml(cwd, '--max_iters', '2', '--ane_fraction', '0.5', sudo=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'energy meter: powermetrics' in r.stdout and all(row['joules_per_token'] > 0 for row in rows(cwd))
    assert set(sudo_stdins(cwd)) == {'devnull'}
    log = coreml_log(cwd)
    loads = [e for e in log if e[0] == 'load']
    assert [e[1] for e in log if e[0] == 'compile'] == [
        os.path.join('out', 'ane_B2_T32', f'{piece}.mlpackage') for piece in hg.ANE_PIECES]
    entry = next(e[1] for e in loads if 'head-' in e[1])
    with open(os.path.join(cwd, entry, 'coremldata.bin'), 'wb') as f:
        f.write(b'damaged')
    r = train_through_core_ml(cwd, '--max_iters', '3', '--ane_fraction', '0.5', '--resume')
    assert r.returncode == 0, r.stderr[-3000:]
    new = coreml_log(cwd)[len(log):]
    assert [e[1] for e in new if e[0] == 'compile'] == [os.path.join('out', 'ane_B2_T32', 'head.mlpackage')]
    assert r.stdout.count('a password is required') == 1 and 'energy meter: none' in r.stdout
    assert rows(cwd)[-1]['step'] == 3 and 'joules_per_token' not in rows(cwd)[-1]


@pytest.mark.slow
@pytest.mark.parametrize('fail,worker', [('load', 'false'), ('load', 'true'), ('sigkill', 'true')])
def test_a_failed_neural_engine_compile(shakespeare, exported, tmp_path, fail, worker):
    # an exception at load stops the run at start with one line that names it (in the worker,
    # or in this process); a SIGKILL at the first predict (coremltools #2758) retires the ANE
    # engine and the GPU trains on. (That run has no sudo rights: it says once that it has no
    # energy meter, at once, not after powermetrics' wait, and trains on.)
    cwd = cwd_with_data(shakespeare, tmp_path)
    p = programs_in(cwd, exported, TRAIN_MODEL)
    r = train_through_core_ml(cwd, '--max_iters', '2', '--ane_fraction', '0.5', '--ane_programs', p,
                              '--ane_worker', worker, fail=fail, sudo=int(fail != 'sigkill'))
    if fail == 'load':
        err = error_lines(r)
        assert r.returncode == 2 and len(err) == 1 and 'Core ML could not compile or load the program block_forward' in err[0]
        assert '(RuntimeError: Failed to build the model execution plan' in err[0]  # Core ML's description
        assert '#2758' not in err[0]
        if worker == 'true':
            assert err[0].startswith('error: the ANE worker could not start') and '--mode gpu' in err[0]
        assert not os.path.exists(cwd / 'out' / 'metrics.jsonl')
    else:
        assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr[-3000:]
        assert 'killed by SIGKILL' in r.stdout + r.stderr and '#2758' in r.stdout + r.stderr
        assert "engine 'ane' (" in r.stdout and "continuing with ['gpu']" in r.stdout  # retired, as it says
        assert rows(cwd)[-1]['step'] == 2 and rows(cwd)[-1]['microbatches'] == 2
        assert rows(cwd)[-1]['ane_microbatches'] == 0  # retired: the GPU has every microbatch
        assert r.stdout.count('a password is required') == 1 and 'energy meter: none' in r.stdout
        assert 'powermetrics gave no samples (sudo: a password is required)' in r.stdout
        assert 'printed no power lines' not in r.stdout and 'joules_per_token' not in rows(cwd)[-1]


def test_a_stage_that_cannot_run_is_skipped_and_fails_nothing(tmp_path, monkeypatch):
    # a stage's {'skipped': why} is recorded as skipped with its reason; the check's verdict
    # and exit code leave it out (the energy stage's own: test_the_energy_meter_against_powermetrics)
    rec, = ane_check.run_all({}, [('energy', False, '')], timeout=300, log=lambda s: None,
                             targets={'energy': 'check_stages:skipped'})
    assert rec['status'] == 'skipped' and rec['error'] == 'powermetrics needs root (sudo -v first)' and 'result' not in rec
    said = []
    monkeypatch.setattr(ane_check, 'run_all', lambda *a, **k: [rec, dict(name='programs', status='ok', seconds=1.0)])
    cfg = hg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100)
    assert ane_check.main(cfg, 2, 8, str(tmp_path / 'p'), 4, str(tmp_path / 'c.json'), 60, log=said.append) == 0
    assert not [s for s in said if 'FAILED' in s], said


@pytest.mark.slow
def test_the_self_check_without_sudo_skips_energy_at_once_and_passes(tmp_path):
    # the check as most Macs run it: no sudo rights. Every stage passes but energy, which is
    # skipped before it measures anything (it took seconds, not a second concurrency run),
    # and the check passes. Core ML puts reduce_max on the CPU here: the coreml stage reports
    # each program's share of ops on the ANE, as counted from the programs themselves
    check = [os.path.join(ROOT, 'export_ane.py'), '--check', *TINY, '--vocab_size', '512', '--gpu_batch', '2',
             '--ane_batch_size', '2']
    r = mac(check, tmp_path, cpu_ops='reduce_max')
    doc = json.load(open(tmp_path / 'out' / 'ane_check.json'))  # beside the trainer's programs
    stages = {s['name']: s for s in doc['stages']}
    status = {k: s['status'] for k, s in stages.items()}
    assert r.returncode == 0 and 'FAILED' not in r.stdout, (status, r.stdout[-3000:])
    assert status == dict.fromkeys(status, 'ok') | {'energy': 'skipped'}, status
    assert 'a password is required' in stages['energy']['error'] and 'result' not in stages['energy']
    res = res_of(doc)
    assert res['environment']['macos'] == '15.5' and res['environment']['coreml_runtime'] == 'ok'
    assert res['environment']['powermetrics'] == 'sudo: a password is required'
    assert res['environment']['chip'] == 'Apple M4 Pro'
    shares, counts = ane_shares(tmp_path / 'out' / 'ane_B2_T32', 'reduce_max')
    for piece, rec in res['coreml'].items():
        assert not rec['cached'] and rec['placement']['ane_share_of_ops'] == shares[piece], (piece, rec, shares)
        assert rec['placement']['not_on_ane'] == {'reduce_max -> MLCPUComputeDevice': counts[piece]}, rec
    assert res['gradients']['passed'] and res['projection']['hetero_tokens_per_s'] > 0
    assert set(sudo_stdins(tmp_path)) == {'devnull'}  # the environment's probe and energy's, never the terminal
    trainers = os.path.join('out', 'ane_B2_T32')  # the folder the trainer reads for this run
    compiles = sum(e[0] == 'compile' and trainers in e[1] for e in coreml_log(tmp_path))
    assert compiles == 3  # each program once: the timings load the cached model
    # the energy stage alone decides before it measures: no worker, no program loaded
    loads = len(coreml_log(tmp_path))
    r = mac(check + ['--stages', 'energy'], tmp_path)
    assert r.returncode == 0 and 'energy: skipped (powermetrics cannot run (sudo: a password' in r.stdout, r.stdout
    assert len(coreml_log(tmp_path)) == loads

    # with sudo rights granted: powermetrics reports CPU 3 W, GPU 9 W, ANE 1.5 W, each part
    # counted once a sample, so in the ratios of those watts whatever the window (the meter's
    # own test checks watts)
    r = mac(check + ['--stages', 'energy'], tmp_path, sudo=1)
    energy = next(s for s in json.load(open(tmp_path / 'out' / 'ane_check.json'))['stages'] if s['name'] == 'energy')
    assert r.returncode == 0 and energy['status'] == 'ok', r.stdout[-2000:]
    for engine in ('gpu', 'ane'):
        w = energy['result'][f'{engine}_alone_watts']
        assert w['CPU'] > 0 and w['GPU'] / w['CPU'] == pytest.approx(3.0, rel=0.02), w
        assert w['ANE'] / w['CPU'] == pytest.approx(0.5, rel=0.02), w

    # the cache reused; then an ANE compile of 2 s a program at load that falls back to the
    # CPU silently, where predicts are 3x slower: the stage shows the load time, no ANE share
    # and CPU_AND_NE as slow as CPU_ONLY
    r = mac(check + ['--stages', 'coreml'], tmp_path)
    doc = json.load(open(tmp_path / 'out' / 'ane_check.json'))  # merged: every stage still there
    assert r.returncode == 0 and [s['name'] for s in doc['stages']] == [s for s, _, _ in ane_check.STAGES], r.stdout[-2000:]
    assert all(rec['cached'] for rec in res_of(doc)['coreml'].values()) and 'merged: coreml re-run' in r.stdout
    assert all(rec['placement']['ane_share_of_ops'] == 1.0 for rec in res_of(doc)['coreml'].values())
    assert sum(e[0] == 'compile' and trainers in e[1] for e in coreml_log(tmp_path)) == 3
    r = mac(check + ['--stages', 'coreml'], tmp_path, load_seconds=2, ane_fallback=1, cpu_slowdown=3)
    doc = json.load(open(tmp_path / 'out' / 'ane_check.json'))
    # nothing on the ANE: the check fails, naming the stage (the ANE's share is its figure)
    assert r.returncode == 1 and 'FAILED: coreml' in r.stdout, r.stdout[-2000:]
    for piece, rec in res_of(doc)['coreml'].items():
        assert rec['load_s'] >= 2 and rec['placement']['ane_share_of_ops'] == 0.0, (piece, rec)
        # both on the CPU, 3x slower than the ANE here: not the ANE's third of CPU_ONLY's time
        # (wall time of 3 calls each, under whatever load: a lower bound only)
        assert rec['CPU_AND_NE_ms'] / rec['CPU_ONLY_ms'] > 0.5, (piece, rec)


def res_of(doc):
    return {s['name']: s.get('result') for s in doc['stages']}


@pytest.mark.slow
def test_bench(shakespeare, tmp_path):
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = mac([os.path.join(ROOT, 'bench.py'), *TRAIN, '--bench_iters', '1', '--bench_repeats', '1',
             '--ane_fraction', '0.5', '--cooldown', '0.5'], cwd, sudo=1)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index('x GPU-only'):].splitlines()[1:4]
    assert [line.split()[0] for line in table] == ['gpu', 'ane', 'hetero']
    assert all(line.split()[3] != 'n/a' for line in table)  # joules per token: powermetrics
    # the machine it ran on, as macOS's tools say; the cooldowns before the second and third arms
    assert re.search(r'^machine: Apple M4 Pro, 20 GPU cores, [\d.]+ GiB, macOS 15.5, AC Power; Python ', r.stdout, re.M)
    assert r.stdout.count('cooling down for 0.5 s (--cooldown)') == 2


@pytest.mark.parametrize('version,layout', [('12.5', 'E-Cluster Power: 750 mW'),
                                            ('15.5', 'Combined Power (CPU + GPU + ANE): 13500 mW')])
def test_the_doubles_powermetrics_prints_a_real_layout(version, layout):
    # each macOS version's layout (test_energy.py parses excerpts of the real ones): the meter
    # reads CPU 3 W, GPU 9 W, ANE 1.5 W from either, each part once a sample
    env = dict(os.environ, MACOS_DOUBLE_ROOT='1', MACOS_DOUBLE_VERSION=version)
    env.pop('MACOS_DOUBLE_LOG', None)
    r = subprocess.run([sys.executable, os.path.join(DOUBLE, 'bin', 'powermetrics'), '--samplers',
                        'cpu_power,gpu_power,ane_power', '-i', '50', '-n', '2', '-b', '1'],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and layout in r.stdout and r.stdout.count('GPU Power: 9000 mW') == 4, r.stdout
    assert ('Combined' in r.stdout) == (version != '12.5')
    parts = energy.read_samples(r.stdout.splitlines(True), dict(CPU=0.0, GPU=0.0, ANE=0.0))
    assert parts['GPU'] / parts['CPU'] == pytest.approx(3.0, rel=1e-12) and parts['ANE'] / parts['CPU'] == pytest.approx(0.5, rel=1e-12)


# One process of the double, its parts each a test below (a process here costs seconds: it
# imports PyTorch and coremltools). The parts print [name, value] lines; the last part ends the
# process as Core ML's late release would (SIGSEGV), so it comes last.
PARTS = """
import json, os, sys, time, numpy as np, torch, coremltools as ct, hetero_gpt as hg
from plumbing import energy, programs
say = lambda part, value: print(json.dumps([part, value]), flush=True)
meta = programs.read_meta('p')
cfg, B, T = hg.GPTConfig(**{k: meta[k] for k in hg.GPTConfig().__dict__}), meta['ane_batch_size'], meta['seq_len']

# the compile cache
path, cached = programs.compiled_model('c', 'head')
assert not cached and os.path.isfile(os.path.join(path, 'DONE')) and path.endswith('.mlmodelc')
assert programs.compiled_model('c', 'head') == (path, True)
os.remove(os.path.join(path, 'DONE'))  # as a crash mid-compile leaves it
assert programs.compiled_model('c', 'head') == (path, False)
with open(os.path.join(path, 'coremldata.bin'), 'wb') as f:
    f.write(b'damaged')  # cached, but Core ML cannot load it: compiled again, once
load = lambda compiled: ct.models.CompiledMLModel(compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
programs.load_compiled('c', 'head', load)
assert programs.compiled_model('c', 'head') == (path, True)
with open(os.path.join(programs.program_path('c', 'head'), 'Manifest.json'), 'a') as f:
    f.write(' ')  # another program under the same name
gone, running = 'c/compiled/.head-0.tmp999999999.mlmodelc', f'c/compiled/.head-0.tmp{os.getppid()}.mlmodelc'
os.makedirs(gone), os.makedirs(running)  # temporaries: of a process that is gone, of one still running
new, cached = programs.compiled_model('c', 'head')
assert new != path and not cached and not os.path.exists(path)
assert not os.path.exists(gone) and os.path.exists(running)
say('cache', sorted(os.listdir('c/compiled')))

# the compute plan; of a program with a gather, which the ANE has no unit for
say('placement', programs.macos_placement(new))
from coremltools.converters.mil import Builder as mb
prog = hg.mil_program(lambda o, x: {'y': hg.MILTensor(mb.gather(x=x.var, indices=np.array([1, 0], np.int32), axis=0)) * 2.0},
                      {'x': (2, 32)})
ct.convert(prog, convert_to='mlprogram', minimum_deployment_target=ct.target.macOS13, skip_model_load=True).save('g.mlpackage')
ct.utils.compile_model('g.mlpackage', 'g.mlmodelc')
say('gather placement', programs.macos_placement('g.mlmodelc'))

# the energy meter, with sudo rights granted; without them (the double's switch, read by its sudo)
os.environ['MACOS_DOUBLE_SUDO'] = '1'
m = energy.PowermetricsMeter()
time.sleep(1.0)
t0 = time.monotonic()
m.close()
say('energy close seconds', time.monotonic() - t0)
say('energy', m.parts)
del os.environ['MACOS_DOUBLE_SUDO']
t0 = time.monotonic()
say('no sudo', energy.EnergyMeter(set()).missing + energy.EnergyMeter(set()).missing)
say('no sudo seconds', time.monotonic() - t0)
from tools import ane_check
loads = len(open('coreml.log').readlines())
say('energy stage', ane_check.energy({}))  # (an empty ctx: it must decide before it reads one)
say('energy stage loads', len(open('coreml.log').readlines()) - loads)

# the machine, as bench.py records it; on a Mac of 10 GPU cores running on its battery
say('machine', ane_check.machine())
os.environ['MACOS_DOUBLE_GPU_CORES'], os.environ['MACOS_DOUBLE_POWER'] = '10', 'battery'
say('machine on battery', ane_check.machine())
del os.environ['MACOS_DOUBLE_GPU_CORES'], os.environ['MACOS_DOUBLE_POWER']

# what --mode auto becomes on an Intel Mac and under Rosetta (the double's switches, read by
# platform.mac_ver and its sysctl)
import platform
from plumbing import settings
for machine, rosetta in (('x86_64', '0'), ('x86_64', '1'), ('arm64', '0')):
    os.environ['MACOS_DOUBLE_MACHINE'], os.environ['MACOS_DOUBLE_ROSETTA'] = machine, rosetta
    platform.mac_ver = lambda *a, m=machine: ('15.5', ('', '', ''), m)
    cfg_auto, lines = hg.Config(mode='auto', n_layer=2, n_head=2, n_embd=64, block_size=32), []
    cfg_auto, _ = settings.check(cfg_auto, set(), {}, {}, lines.append)
    say(f'auto {machine} {rosetta}', [cfg_auto.mode, [l for l in lines if l.startswith('mode auto')]])

# what the native layer makes of each kind of input (CoreMLPythonUtils.mm, CoreMLPythonArray.mm)
m = ct.models.CompiledMLModel(new, compute_units=ct.ComputeUnit.CPU_AND_NE)
rng = np.random.default_rng(0)
base = {k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in hg.piece_input_shapes(cfg, B, T, 'head').items()}
first = sorted(base)[0]
def answer(**changed):  # (arrays through coreml_predict's views; the rest fails before Core ML holds anything)
    try:
        arrays = all(isinstance(v, np.ndarray) for v in changed.values())
        out = programs.coreml_predict(m, base | changed) if arrays else m.predict({k: v.copy() for k, v in base.items()} | changed)
        return 'ok', float(sum(np.abs(v.astype(np.float64) - right[k]).max() for k, v in out.items()))
    except Exception as e:
        return 'error', str(e).replace(chr(10), ' ')
right = {k: v.astype(np.float64) for k, v in programs.coreml_predict(m, base).items()}
frozen = base[first].copy()
frozen.flags.writeable = False
strided = np.zeros((2,) + base[first].shape, np.float32)[1]
strided[...] = base[first]
say('inputs', {'big-endian': answer(**{first: base[first].astype('>f4')}),
               'read-only': answer(**{first: frozen}),
               'float64': answer(**{first: base[first].astype(np.float64)}),
               'strided view': answer(**{first: np.ascontiguousarray(np.stack([base[first]] * 2, -1))[..., 0]}),
               'python float': answer(**{first: 1.5}),
               'list': answer(**{first: base[first].tolist()}),
               'int64': answer(**{first: base[first].astype(np.int64)})})

# a Neural Engine compile that fails at load, in this process; one that kills the process at
# its first predict (coremltools #2758), in the worker (the double's switch, read at each)
cpu = torch.device('cpu')
run = settings.Run('ane', cpu, torch.float32, cpu, torch.float16, ane_in_worker=True, ane_programs=True, ane_batch_size=B)
spec = hg.ane_spec(hg.Config(**vars(cfg), batch_size=B, ane_programs='p'), run)
os.environ['MACOS_DOUBLE_FAIL'] = 'load'
try:
    hg.engine_from_spec(spec)
except hg.UserError as e:
    say('load', str(e))
os.environ['MACOS_DOUBLE_FAIL'] = 'sigkill'
from plumbing import worker
w = worker.WorkerEngine(spec, hg.engine_from_spec, hg.LossScaler(256.0, 0), log=lambda s: None)
w.load_weights(dict(hg.GPT(cfg).named_parameters()))
try:
    w.loss_and_grads(*(torch.zeros(B, T, dtype=torch.long) for _ in range(2)))
except worker.WorkerFault as e:
    say('sigkill', str(e))
del os.environ['MACOS_DOUBLE_FAIL']

# Core ML's late release of its inputs
m = ct.models.CompiledMLModel(new, compute_units=ct.ComputeUnit.CPU_AND_NE)
inputs = lambda: {k: np.zeros(s, np.float32) for k, s in hg.piece_input_shapes(cfg, B, T, 'head').items()}
kept = inputs()
for _ in range(3):
    programs.coreml_predict(m, kept)  # the same buffers, through fresh views each call
time.sleep(1.5)
say('views', 'ok')
if sys.argv[1] == 'temporary':
    m.predict(inputs())  # freed by the time Core ML releases it
    time.sleep(1.5)
elif sys.argv[1] == 'negative':
    m.predict({k: v[::-1] for k, v in inputs().items()})  # a negative stride
else:
    m.predict(kept)
    m.predict(kept)  # still held by Core ML from the call before
say('survived', True)
"""


def run_parts(exported, folder, misuse):
    """PARTS in folder, on two copies of helpers.PROGRAMS (c: the compile cache's; p): (the
    process, {part: value}, folder)."""
    programs_in(folder, exported)
    shutil.copytree(folder / 'p', folder / 'c')
    r = mac(['-c', PARTS, misuse], folder, cpu_ops='abs')  # (the compute plan puts abs on the CPU)
    said = [json.loads(line) for line in r.stdout.splitlines() if line.startswith('[')]
    return r, dict(said), folder


@pytest.fixture(scope='module')
def parts(exported, tmp_path_factory):
    return run_parts(exported, tmp_path_factory.mktemp('parts'), 'again')


def test_compile_cache(parts):
    # compiled once through coremltools' compile_model (into a name ending in .mlmodelc),
    # loaded from the cache after; a half-written entry, an entry Core ML cannot load and a
    # changed program are compiled again; another process's temporary is left alone unless
    # that process is gone
    r, said, cwd = parts
    assert 'cache' in said, r.stderr[-3000:]
    assert len(said['cache']) == 2 and said['cache'][0] == f'.head-0.tmp{os.getpid()}.mlmodelc'  # (this process's)
    assert re.fullmatch(r'head-[0-9a-f]{16}\.mlmodelc', said['cache'][1])
    assert sum(e[0] == 'compile' and e[1].startswith('c/') for e in coreml_log(cwd)) == 4


def test_placement(parts, monkeypatch):
    # on macOS 15.5 the compute plan names the ops Core ML puts on the CPU (here: abs, by the
    # double's switch; a gather, by default); before 14.4 there is none
    r, said, _ = parts
    assert set(said['placement']['not_on_ane']) == {'abs -> MLCPUComputeDevice'}, r.stderr[-3000:]
    assert 0 < said['placement']['ane_share_of_ops'] < 1
    # by default (no switch) the gather alone goes to the CPU, which the ANE has no unit for:
    # 2 of its 3 ops (gather, mul, the output's identity) on the ANE
    assert said['gather placement'] == {'ane_share_of_ops': 0.6667, 'ane_share_of_cost': 0.6667,
                                        'not_on_ane': {'gather -> MLCPUComputeDevice': 1}}, said['gather placement']
    monkeypatch.setattr(coreml_programs.platform, 'mac_ver', lambda: ('14.2', ('', '', ''), 'arm64'))
    assert coreml_programs.macos_placement('any') == {'unavailable': 'the compute plan needs macOS 14.4 (this is 14.2)'}


def test_the_energy_meter_against_powermetrics(parts):
    # powermetrics reports CPU 3 W, GPU 9 W (twice a sample), ANE 1.5 W: the meter counts each
    # part once a sample, so its parts stand in those ratios whatever the window (the watts of
    # a sample times its elapsed time: test_energy.py, on a captured text); closing stops the
    # root powermetrics too (SIGTERM through sudo), at once
    r, said, cwd = parts
    energy = said['energy']
    assert energy['CPU'] > 0 and energy['GPU'] / energy['CPU'] == pytest.approx(3.0, rel=1e-12), energy
    assert energy['ANE'] / energy['CPU'] == pytest.approx(0.5, rel=1e-12), energy
    assert not [f for f in os.listdir(cwd) if f.startswith('powermetrics.')]  # none left running
    # sudo relays the SIGTERM: the meter started it in a process group of its own (sudo 1.9.12
    # drops signals from the group it started in), so no 5 s wait and no SIGKILL
    assert said['energy close seconds'] < 2, said['energy close seconds']
    # without sudo rights: no meter, and why, at once (not after powermetrics' wait for
    # samples), the second meter without asking sudo again; sudo's stdin never the terminal's
    assert said['no sudo'] == ['PowermetricsMeter: powermetrics gave no samples (sudo: a password is required)'] * 2
    assert said['no sudo seconds'] < 5
    # the self-check's energy stage, without rights, is skipped before it reads its ctx or
    # loads a program; sudo's stdin is never the terminal's
    assert list(said['energy stage']) == ['skipped'] and said['energy stage loads'] == 0, said['energy stage']
    assert said['energy stage']['skipped'].startswith('powermetrics cannot run (sudo: a password is required); ')
    assert sudo_stdins(cwd) == ['devnull'] * 3


def test_the_machine_as_bench_records_it(parts):
    # macOS's own tools, as the double gives them: the chip (sysctl), its GPU cores (system_profiler
    # -json), the memory (sysctl hw.memsize), the version (sw_vers) and the power source (pmset)
    r, said, _ = parts
    m, battery = said['machine'], said['machine on battery']
    assert {k: m[k] for k in ('chip', 'gpu_cores', 'os', 'power')} == dict(
        chip='Apple M4 Pro', gpu_cores=20, os='macOS 15.5', power='AC Power'), m
    assert m['memory_gib'] == round(memory.total_memory() / 2**30, 1) and m['torch'] == torch.__version__
    assert battery['gpu_cores'] == 10 and battery['power'] == 'Battery Power'
    assert ane_check.machine_line(m).startswith('Apple M4 Pro, 20 GPU cores, ')


def test_inputs_as_the_native_layer_takes_them(parts):
    # coremltools 9.0 CoreMLPythonArray.mm and CoreMLPythonUtils.mm: fp32 in the other byte
    # order is taken as fp32 and read as native floats (garbage, no error); a read-only array,
    # int64 and a list fail (the list is dropped, so the input is missing); a Python float is a
    # feature of its own, which is no MultiArray; fp64 and strided views are taken, converted
    # by Core ML. (fp16 rounding of the same values: differences of 0)
    r, said, _ = parts
    inputs = said['inputs']
    assert inputs['float64'] == ['ok', 0.0] and inputs['strided view'] == ['ok', 0.0], r.stderr[-2000:]
    assert inputs['big-endian'][0] == 'ok' and not inputs['big-endian'][1] < 1e-3  # (nan too: not < 1e-3)
    assert inputs['read-only'] == ['error', 'value type not convertible'] == inputs['int64']
    assert inputs['list'][0] == 'error' and 'Required input feature not passed' in inputs['list'][1]
    assert inputs['python float'][0] == 'error' and 'MultiArray' in inputs['python float'][1]


def test_a_failed_neural_engine_compile_in_short(parts):
    # an exception at load (the engine in this process) is one error that names the program and
    # Core ML's description; a SIGKILL at the first predict is the worker's death, named with
    # what it likely was and what to try (the trainer's runs of both: slow, above)
    r, said, _ = parts
    assert said['load'].startswith('Core ML could not compile or load the program block_forward (RuntimeError: '
                                   'Failed to build the model execution plan'), r.stderr[-3000:]
    assert 'killed by SIGKILL' in said['sigkill'] and '#2758' in said['sigkill']
    assert 'smaller --ane_batch_size' in said['sigkill'] and 'export_ane.py --check' in said['sigkill']


@pytest.mark.parametrize('misuse', [pytest.param('temporary', marks=pytest.mark.slow), 'again',
                                    pytest.param('negative', marks=pytest.mark.slow)])
def test_core_ml_releases_its_inputs_late(parts, exported, tmp_path, misuse):
    # the double crashes where Core ML's late release, off the GIL, could corrupt the heap
    # (coremltools PRs #2827, #2829); coreml_predict's views never give it the chance. A
    # negative stride crashes too: the native layer reads it as ~2^62 elements
    r, said, _ = parts if misuse == 'again' else run_parts(exported, tmp_path, misuse)
    assert said.get('views') == 'ok' and 'survived' not in said and r.returncode == -11, (r.stdout, r.stderr[-2000:])
    assert {'temporary': 'after the caller had freed it', 'again': 'still held by Core ML',
            'negative': 'has a negative stride'}[misuse] in r.stderr


REFUSED = """
import sys, export_ane, hetero_gpt
try:
    hetero_gpt.main(sys.argv[1:])
except SystemExit as e:
    print('hetero_gpt.py', e.code, flush=True)
print('export_ane.py', export_ane.main(%r), flush=True)
""" % TINY


@pytest.mark.skipif(settings.ON_MAC, reason="a Mac's coremltools has its Core ML runtime")
def test_coremltools_without_core_ml_is_named():
    # Linux's coremltools has no Core ML runtime, as one installed from its source archive on a
    # Mac: the check every Mac command makes first says so, with what to do
    with pytest.raises(settings.UserError, match=r'has no Core ML runtime \(libcoremlpython\).*--mode gpu'):
        settings.check_coreml()


@pytest.mark.slow
def test_commands_without_core_ml_are_refused_in_one_line(tmp_path):
    # coremltools installed without its native libraries (from its source archive): the trainer
    # and the export each refuse at start in one line, and write nothing
    r = mac(['-c', REFUSED, *TRAIN], tmp_path, native=0)
    err = error_lines(r)
    codes = [line for line in r.stdout.splitlines() if line.startswith(('hetero_gpt.py ', 'export_ane.py '))]
    assert codes == ['hetero_gpt.py 2', 'export_ane.py 2'], (r.stdout, r.stderr[-2000:])
    assert len(err) == 2 and all('has no Core ML runtime (libcoremlpython)' in e for e in err), r.stderr[-2000:]
    assert os.listdir(tmp_path) == []  # no out, no ane_programs


@pytest.mark.slow
@pytest.mark.parametrize('flags,switches,says', [
    ([], dict(native=0), "has no Core ML runtime (libcoremlpython)"),
    (['--block_size', '48'], {}, "--block_size (tokens a sequence) is 48: the ANE's programs need a multiple of 32"),
    (['--mode', 'hetero'], dict(machine='x86_64'),
     "this Mac is x86_64 (Intel), and the Neural Engine needs Apple Silicon: train on the GPU alone"),
    (['--mode', 'hetero'], dict(machine='x86_64', rosetta=1),
     "this Python is an x86_64 build running under Rosetta on Apple Silicon, and the ANE engine needs an arm64 Python"),
])
def test_refused_at_start_in_one_line(tmp_path, flags, switches, says):
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, *flags], tmp_path, **switches)
    err = error_lines(r)
    assert r.returncode == 2 and len(err) == 1 and says in err[0], r.stderr[-2000:]
    assert not os.path.exists(tmp_path / 'out')  # nothing written


def test_auto_mode_is_gpu_where_there_is_no_neural_engine(parts):
    # --mode auto on an Intel Mac, or an x86_64 Python under Rosetta: gpu, said in one line
    # with why and what to do; on Apple Silicon: hetero, nothing said (the trainer's runs: slow, below)
    r, said, _ = parts
    intel, rosetta, arm = said['auto x86_64 0'], said['auto x86_64 1'], said['auto arm64 0']
    assert intel == ['gpu', ['mode auto: gpu alone (this Mac is x86_64 (Intel), and the Neural Engine needs Apple '
                             'Silicon)']], intel
    assert rosetta[0] == 'gpu' and len(rosetta[1]) == 1 and 'running under Rosetta on Apple Silicon' in rosetta[1][0]
    assert 'needs an arm64 Python' in rosetta[1][0] and arm == ['hetero', []]


@pytest.mark.slow
@pytest.mark.parametrize('switches,says', [
    (dict(machine='x86_64'), "this Mac is x86_64 (Intel)"),
    (dict(machine='x86_64', rosetta=1), "this Python is an x86_64 build running under Rosetta on Apple Silicon"),
])
def test_auto_mode_without_the_neural_engine_trains_on_the_gpu(shakespeare, tmp_path, switches, says):
    # an Intel Mac, or an x86_64 Python under Rosetta, has no way to the ANE: the default mode
    # trains on the GPU alone, and says so in one line, with why; no Core ML program is made
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, '--max_iters', '1'], cwd, **switches)
    assert r.returncode == 0 and error_lines(r) == [], r.stderr[-2000:]
    said = [line for line in r.stdout.splitlines() if line.startswith('mode auto: gpu alone (')]
    assert len(said) == 1 and says in said[0] and 'mode gpu' in r.stdout, r.stdout[-2000:]
    assert coreml_log(cwd) == [] and 'ane_loss' not in rows(cwd)[-1]


@pytest.mark.slow
def test_export_without_core_ml_is_refused_in_one_line(tmp_path):
    r = mac([os.path.join(ROOT, 'export_ane.py'), *TINY], tmp_path, native=0)
    err = error_lines(r)
    assert r.returncode == 2 and len(err) == 1 and 'has no Core ML runtime' in err[0], r.stderr[-2000:]
    assert not os.path.exists(tmp_path / 'ane_programs')


def test_mps_limits_refused_in_one_line():
    settings.check_mps(torch.bfloat16, False, '2.6.0', '14.0')
    settings.check_mps(torch.float32, True, '2.8.1', '13.5')
    with pytest.raises(settings.UserError, match='bfloat16 on MPS needs torch 2.6'):
        settings.check_mps(torch.bfloat16, False, '2.5.1', '15.0')
    with pytest.raises(settings.UserError, match='bfloat16 on MPS needs torch 2.6 or newer on macOS 14'):
        settings.check_mps(torch.bfloat16, False, '2.7.0', '13.6')
    with pytest.raises(settings.UserError, match='MPS has no float64'):
        settings.check_mps(torch.float64, False, '2.9.0', '15.0')
    with pytest.raises(settings.UserError, match='--compile on MPS needs torch 2.8'):
        settings.check_mps(torch.float32, True, '2.7.1', '15.0')


def test_memory_estimate_counts_what_attention_keeps_on_mps():
    # MPS takes SDPA's math path with grad (coreml_and_ane.md section 6), an op that returns the
    # (B, H, T, T) probabilities beside the output, in q's dtype (torch/_meta_registrations.py);
    # the CPU's math path, in fp32, saves the same for the backward, beyond q, k and v (counted
    # with the activations): each is the estimate's attention term per layer
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, T, H, C = 2, 64, 4, 64
    cfg = hg.Config(n_layer=3, n_head=H, n_embd=C, block_size=T, vocab_size=96, batch_size=B)
    per_layer = lambda dtype: memory.memory_estimate(cfg, 'gpu', torch.device('mps'), dtype,
                                                     hg.model_sizes(cfg), settings.ane_batch_size(cfg))['gpu_attention'] / cfg.n_layer
    for dtype in (torch.float32, torch.float16):
        q = torch.empty(B, H, T, C // H, dtype=dtype, device='meta')
        _, probs = torch.ops.aten._scaled_dot_product_attention_math_for_mps(q, q, q, is_causal=True)
        assert per_layer(dtype) == probs.numel() * probs.element_size() == B * H * T * T * dtype.itemsize
    saved = {}

    def pack(t):  # each storage once: softmax's output is also the second matmul's input
        if t.shape == (B, H, T, T):  # (and the causal mask, (T, T): 1/(B H) of it, left out)
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with sdpa_kernel(SDPBackend.MATH), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hg.CausalSelfAttention(cfg)(torch.randn(B, T, C, requires_grad=True))
    assert list(saved.values()) == [per_layer(torch.float32)]
    assert 'gpu_attention' not in memory.memory_estimate(cfg, 'gpu', torch.device('cpu'), torch.float32,
                                                          hg.model_sizes(cfg), settings.ane_batch_size(cfg))  # (the CPU's flash path keeps none)


def test_core_ml_errors_in_one_line():
    # coremltools raises an NSError's userInfo as Foundation prints it (Utils::handleError)
    e = RuntimeError('{\n    NSLocalizedDescription = "Failed to build the model execution plan with error code: -5.";\n}')
    assert settings.one_line(e) == 'RuntimeError: Failed to build the model execution plan with error code: -5.'
    assert settings.one_line(ValueError('two\nlines')) == 'ValueError: two lines'
    nested = RuntimeError('{\n    NSLocalizedDescription = "The \\"head\\" failed.";\n    NSUnderlyingError = 0x6000 '
                          '{Error Domain=com.apple.CoreML Code=0 "(null)" UserInfo={NSLocalizedDescription=inner}};\n}')
    assert settings.one_line(nested) == 'RuntimeError: The "head" failed.'


@pytest.mark.slow  # a second trainer through Core ML, beside test_training_on_both_engines_through_core_ml
def test_fine_tuning_gpt2_through_core_ml_then_sampling(shakespeare, tmp_path):
    # a tiny GPT-2 written by Hugging Face's code, aligned as the ANE needs; the Mac's default
    # run fine-tunes it on both engines, its programs exported and compiled for that size
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=32))
    hf.save_pretrained(tmp_path / 'hf')
    cwd = cwd_with_data(shakespeare, tmp_path)
    untiny = TRAIN[:2] + TRAIN[2 + len(TINY):]  # the size comes from the checkpoint
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *untiny, '--init_from', 'hf', '--max_iters', '4', '--ane_fraction',
             '0.5', '--learning_rate', '1e-3', '--warmup_iters', '0', '--min_lr', '1e-3'], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'mode hetero' in r.stdout and 'Core ML programs' in r.stdout
    assert sorted(e[1] for e in coreml_log(cwd) if e[0] == 'compile') == sorted(
        os.path.join('out', 'ane_B2_T32', f'{p}.mlpackage') for p in ('block_forward', 'block_backward', 'head'))
    vals = [row['val_loss'] for row in rows(cwd) if 'val_loss' in row]
    assert all('ane_loss' in row for row in rows(cwd) if 'loss' in row) and vals[-1] < vals[0]
    s = mac([os.path.join(ROOT, 'sample.py'), '--start', 'ROMEO:', '--num_samples', '1', '--max_new_tokens', '5'], cwd)
    assert s.returncode == 0 and s.stdout.startswith('ROMEO:') and 'best.pt' in s.stderr, s.stderr[-2000:]
