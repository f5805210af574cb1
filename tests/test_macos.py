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
from tools import ane_check
from plumbing import memory
from plumbing import programs as coreml_programs
from plumbing import settings

pytest.importorskip('coremltools')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, 'tests', 'macos_double')
# aligned as the ANE needs (multiples of 32: T, C, the head size), small enough for NumPy
TINY = ['--n_layer', '2', '--n_head', '2', '--n_embd', '64', '--block_size', '32']
TRAIN = ['--dataset', 'shakespeare', *TINY, '--batch_size', '2', '--gradient_accumulation_steps', '2',
         '--eval_interval', '2', '--eval_iters', '1', '--log_interval', '1', '--sample_tokens', '0', '--seed', '3']
# the trainer's programs for TRAIN's model, and a smaller model's for the scripts below: 2 x 32 tokens a call
TRAIN_MODEL = hg.GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)


def mac(args, cwd, timeout=600, **switches):
    """python ARGS on the double's Mac, in cwd; switches: MACOS_DOUBLE_* settings by suffix."""
    env = dict(os.environ, HETERO_MACOS_DOUBLE='1', PYTHONPATH=os.pathsep.join([DOUBLE, ROOT]),
               MACOS_DOUBLE_LOG=str(cwd), **{f'MACOS_DOUBLE_{k.upper()}': str(v) for k, v in switches.items()})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def coreml_log(cwd):
    path = os.path.join(cwd, 'coreml.log')
    return [line.split()[1:] for line in open(path)] if os.path.exists(path) else []


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


def test_training_on_both_engines_through_core_ml(shakespeare, exported, tmp_path):
    # hetero by default: the ANE's share in its worker, through CompiledMLModel from the
    # compile cache, never retired; its first step's loss is the GPU-only run's (the same
    # weights and batch: the ANE's half in fp16, rounding ~1e-3 of the loss)
    cwd = cwd_with_data(shakespeare, tmp_path)
    p = programs_in(cwd, exported, TRAIN_MODEL)
    r = train_through_core_ml(cwd, '--max_iters', '2', '--ane_fraction', '0.5', '--ane_programs', p)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'mode hetero' in r.stdout and 'Core ML programs' in r.stdout and 'retired' not in r.stdout + r.stderr
    log = coreml_log(cwd)
    compiled = [e for e in log if e[0] == 'compile']
    loads = [e for e in log if e[0] == 'load']
    assert sorted(e[1] for e in compiled) == [os.path.join(p, f'{piece}.mlpackage') for piece in sorted(hg.ANE_PIECES)]
    assert len(loads) == 3 and all(e[1].endswith('.mlmodelc') and '/compiled/' in e[1] and e[2] == 'CPU_AND_NE'
                                   for e in loads)
    hetero = rows(cwd)
    assert [r['step'] for r in hetero] == [1, 2] and all('ane_loss' in row for row in hetero)  # the ANE's share, every step
    assert 'energy meter: powermetrics' in r.stdout and all(row['joules_per_token'] > 0 for row in hetero)
    hg.train(*hg.parse_args(TRAIN + ['--data_dir', str(cwd / 'data'), '--out_dir', str(tmp_path / 'gpu'),
                                     '--max_iters', '1', '--mode', 'gpu', '--quiet']))  # (here: the same arithmetic)
    gpu = helpers.rows(tmp_path / 'gpu')
    assert abs(hetero[0]['loss'] - gpu[0]['loss']) < 1e-2 * hetero[0]['loss']
    assert hetero[0]['loss'] != gpu[0]['loss']  # (the ANE's half is its own)


@pytest.mark.slow
def test_a_resumed_run_recompiles_a_damaged_entry_and_trains_without_sudo(shakespeare, tmp_path):
    # the trainer's own programs, exported into out_dir; resumed with one cache entry damaged
    # and no sudo rights: that entry alone is compiled again; the run says once that it has no
    # energy meter, and trains on
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = train_through_core_ml(cwd, '--max_iters', '2', '--ane_fraction', '0.5')
    assert r.returncode == 0, r.stderr[-3000:]
    log = coreml_log(cwd)
    loads = [e for e in log if e[0] == 'load']
    assert [e[1] for e in log if e[0] == 'compile'] == [
        os.path.join('out', 'ane_B2_T32', f'{piece}.mlpackage') for piece in hg.ANE_PIECES]
    entry = next(e[1] for e in loads if 'head-' in e[1])
    with open(os.path.join(cwd, entry, 'coremldata.bin'), 'wb') as f:
        f.write(b'damaged')
    r = train_through_core_ml(cwd, '--max_iters', '3', '--ane_fraction', '0.5', '--resume', sudo=0)
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
        assert rows(cwd)[-1]['step'] == 2 and rows(cwd)[-1]['microbatches'] == 2
        assert rows(cwd)[-1]['ane_microbatches'] == 0  # retired: the GPU has every microbatch
        assert r.stdout.count('a password is required') == 1 and 'energy meter: none' in r.stdout
        assert 'powermetrics gave no samples (sudo: a password is required)' in r.stdout
        assert 'printed no power lines' not in r.stdout and 'joules_per_token' not in rows(cwd)[-1]


@pytest.mark.slow
def test_the_self_check_every_stage_passes_and_reuses_the_cache(tmp_path):
    check = [os.path.join(ROOT, 'export_ane.py'), '--check', *TINY, '--vocab_size', '512', '--gpu_batch', '2',
             '--ane_batch_size', '2']
    r = mac(check, tmp_path)
    doc = json.load(open(tmp_path / 'out' / 'ane_check.json'))  # beside the trainer's programs
    status = {s['name']: s['status'] for s in doc['stages']}
    assert r.returncode == 0 and set(status.values()) == {'ok'}, (status, r.stdout[-3000:])
    res = {s['name']: s['result'] for s in doc['stages']}
    assert res['environment']['macos'] == '15.5' and res['environment']['coreml_runtime'] == 'ok'
    assert res['environment']['powermetrics'] is True and res['environment']['chip'] == 'Apple M4 Pro'
    for piece, rec in res['coreml'].items():
        assert not rec['cached'] and rec['placement']['ane_share_of_ops'] == 1.0, piece
    assert res['gradients']['passed']
    # powermetrics reports CPU 3 W, GPU 9 W, ANE 1.5 W: each part counted once a sample, so
    # in the ratios of those watts whatever the window (the meter's own test checks watts)
    for engine in ('gpu', 'ane'):
        w = res['energy'][f'{engine}_alone_watts']
        assert w['CPU'] > 0 and w['GPU'] / w['CPU'] == pytest.approx(3.0, rel=0.02), w
        assert w['ANE'] / w['CPU'] == pytest.approx(0.5, rel=0.02), w
    assert res['projection']['hetero_tokens_per_s'] > 0
    trainers = os.path.join('out', 'ane_B2_T32')  # the folder the trainer reads for this run
    compiles = sum(e[0] == 'compile' and trainers in e[1] for e in coreml_log(tmp_path))
    assert compiles == 3  # each program once: the timings load the cached model
    r = mac(check + ['--stages', 'coreml'], tmp_path)
    doc = json.load(open(tmp_path / 'out' / 'ane_check.json'))  # merged: every stage still there
    assert r.returncode == 0 and [s['name'] for s in doc['stages']] == [s for s, _, _ in ane_check.STAGES], r.stdout[-2000:]
    assert all(rec['cached'] for rec in res_of(doc)['coreml'].values()) and 'merged: coreml re-run' in r.stdout
    assert sum(e[0] == 'compile' and trainers in e[1] for e in coreml_log(tmp_path)) == 3


def res_of(doc):
    return {s['name']: s.get('result') for s in doc['stages']}


@pytest.mark.slow
def test_bench(shakespeare, tmp_path):
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = mac([os.path.join(ROOT, 'bench.py'), *TRAIN, '--bench_iters', '1', '--bench_repeats', '1',
             '--ane_fraction', '0.5'], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index('x GPU-only'):].splitlines()[1:4]
    assert [line.split()[0] for line in table] == ['gpu', 'ane', 'hetero']
    assert all(line.split()[3] != 'n/a' for line in table)  # joules per token: powermetrics


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

# the compute plan
say('placement', programs.macos_placement(new))

# the energy meter; without sudo rights (the double's switch, read by its sudo)
m = energy.PowermetricsMeter()
time.sleep(1.0)
m.close()
say('energy', m.parts)
os.environ['MACOS_DOUBLE_SUDO'] = '0'
say('no sudo', energy.EnergyMeter(set()).missing)
del os.environ['MACOS_DOUBLE_SUDO']

# a Neural Engine compile that fails at load, in this process; one that kills the process at
# its first predict (coremltools #2758), in the worker (the double's switch, read at each)
spec = hg.ane_spec(hg.Config(**vars(cfg), batch_size=B, ane_programs='p'), torch.float16) | dict(threads=1)
os.environ['MACOS_DOUBLE_FAIL'] = 'load'
try:
    hg.ane_engine(spec)
except hg.UserError as e:
    say('load', str(e))
os.environ['MACOS_DOUBLE_FAIL'] = 'sigkill'
from plumbing import worker
w = worker.WorkerEngine(spec, hg.ane_engine, hg.LossScaler(256.0, 0), log=lambda s: None)
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
    # double's switch); before 14.4 there is none
    r, said, _ = parts
    assert set(said['placement']['not_on_ane']) == {'abs -> MLCPUComputeDevice'}, r.stderr[-3000:]
    assert 0 < said['placement']['ane_share_of_ops'] < 1
    monkeypatch.setattr(coreml_programs.platform, 'mac_ver', lambda: ('14.2', ('', '', ''), 'arm64'))
    assert coreml_programs.macos_placement('any') == {'unavailable': 'the compute plan needs macOS 14.4 (this is 14.2)'}


def test_the_energy_meter_against_powermetrics(parts):
    # powermetrics reports CPU 3 W, GPU 9 W (twice a sample), ANE 1.5 W: the meter counts each
    # part once a sample, so its parts stand in those ratios whatever the window (the watts of
    # a sample times its elapsed time: test_energy.py, on a captured text); closing stops the
    # root powermetrics too (SIGTERM through sudo)
    r, said, cwd = parts
    energy = said['energy']
    assert energy['CPU'] > 0 and energy['GPU'] / energy['CPU'] == pytest.approx(3.0, rel=1e-12), energy
    assert energy['ANE'] / energy['CPU'] == pytest.approx(0.5, rel=1e-12), energy
    assert not [f for f in os.listdir(cwd) if f.startswith('powermetrics.')]  # none left running
    # without sudo rights: no meter, and why, at once (not after powermetrics' wait for samples)
    assert said['no sudo'] == ['PowermetricsMeter: powermetrics gave no samples (sudo: a password is required)']


def test_a_failed_neural_engine_compile_in_short(parts):
    # an exception at load (the engine in this process) is one error that names the program and
    # Core ML's description; a SIGKILL at the first predict is the worker's death, named with
    # what it likely was and what to try (the trainer's runs of both: slow, above)
    r, said, _ = parts
    assert said['load'].startswith('Core ML could not compile or load the program block_forward (RuntimeError: '
                                   'Failed to build the model execution plan'), r.stderr[-3000:]
    assert 'killed by SIGKILL' in said['sigkill'] and '#2758' in said['sigkill']
    assert 'smaller --ane_batch_size' in said['sigkill'] and 'export_ane.py --check' in said['sigkill']


@pytest.mark.parametrize('misuse', [pytest.param('temporary', marks=pytest.mark.slow), 'again'])
def test_core_ml_releases_its_inputs_late(parts, exported, tmp_path, misuse):
    # the double crashes where Core ML's late release, off the GIL, could corrupt the heap
    # (coremltools PRs #2827, #2829); coreml_predict's views never give it the chance
    r, said, _ = parts if misuse == 'again' else run_parts(exported, tmp_path, misuse)
    assert said.get('views') == 'ok' and 'survived' not in said and r.returncode == -11, (r.stdout, r.stderr[-2000:])
    assert ('after the caller had freed it' if misuse == 'temporary' else 'still held by Core ML') in r.stderr


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
    ([], dict(machine='x86_64'), "the Neural Engine needs Apple Silicon"),
])
def test_refused_at_start_in_one_line(tmp_path, flags, switches, says):
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, *flags], tmp_path, **switches)
    err = error_lines(r)
    assert r.returncode == 2 and len(err) == 1 and says in err[0], r.stderr[-2000:]
    assert not os.path.exists(tmp_path / 'out')  # nothing written


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


def test_memory_estimate_counts_attention_on_mps():
    cfg = hg.Config(**hg.MAC_DEFAULTS)
    mps = memory.memory_estimate(cfg, 'hetero', torch.device('mps'), torch.float32, hg.model_sizes(cfg))
    cpu = memory.memory_estimate(cfg, 'hetero', torch.device('cpu'), torch.float32, hg.model_sizes(cfg))
    B, T, H, L = cfg.batch_size, cfg.block_size, cfg.n_head, cfg.n_layer
    assert mps['gpu_attention'] == 4 * L * B * H * T * T  # (B, H, T, T) fp32 per layer
    assert mps['total'] - cpu['total'] == mps['gpu_attention']
    assert mps['total'] < 0.6 * 16 * 2**30  # the Mac's defaults fit a 16 GB Mac


def test_core_ml_errors_in_one_line():
    # coremltools raises an NSError's userInfo as Foundation prints it (Utils::handleError)
    e = RuntimeError('{\n    NSLocalizedDescription = "Failed to build the model execution plan with error code: -5.";\n}')
    assert settings.one_line(e) == 'RuntimeError: Failed to build the model execution plan with error code: -5.'
    assert settings.one_line(ValueError('two\nlines')) == 'ValueError: two lines'
    nested = RuntimeError('{\n    NSLocalizedDescription = "The \\"head\\" failed.";\n    NSUnderlyingError = 0x6000 '
                          '{Error Domain=com.apple.CoreML Code=0 "(null)" UserInfo={NSLocalizedDescription=inner}};\n}')
    assert settings.one_line(nested) == 'RuntimeError: The "head" failed.'


@pytest.mark.slow  # a second trainer through Core ML: test_training_on_both_engines_through_core_ml is the fast one
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
