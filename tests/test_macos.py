"""The Mac user's commands, run here under a double of only what Linux lacks
(tests/macos_double: Core ML's native module under coremltools, the OS identity,
powermetrics and sudo). coremltools' own Python and all of the project run for real, in
every process: the trainer, its ANE worker, the self-check's stages. CI runs this file
twice: with the newest coremltools and with the oldest requirements.txt allows."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from plumbing import memory
from plumbing import settings

pytest.importorskip('coremltools')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, 'tests', 'macos_double')
# aligned as the ANE needs (multiples of 32: T, C, the head size), small enough for NumPy
TINY = ['--n_layer', '2', '--n_head', '2', '--n_embd', '64', '--block_size', '32']
TRAIN = ['--dataset', 'shakespeare', *TINY, '--batch_size', '2', '--gradient_accumulation_steps', '2',
         '--eval_interval', '2', '--eval_iters', '1', '--log_interval', '1', '--sample_tokens', '0', '--seed', '3']


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


@pytest.fixture(scope='module')
def shakespeare(tmp_path_factory):
    """A folder with data/shakespeare prepared once (offline), for each command's own copy."""
    root = tmp_path_factory.mktemp('mac')
    import prepare_data
    prepare_data.prepare('shakespeare', data_dir=str(root / 'data'))
    return root


def cwd_with_data(shakespeare, tmp_path):
    os.symlink(shakespeare / 'data', tmp_path / 'data')
    return tmp_path


def test_training_on_both_engines_through_core_ml(shakespeare, tmp_path):
    # hetero by default: the ANE's share in its worker, through CompiledMLModel from the
    # compile cache, never retired; its first step's loss is the GPU-only run's
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, '--max_iters', '2',
             '--ane_fraction', '0.5'], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'mode hetero' in r.stdout and 'Core ML programs' in r.stdout and 'retired' not in r.stdout + r.stderr
    log = coreml_log(cwd)
    compiled = [e for e in log if e[0] == 'compile']
    loads = [e for e in log if e[0] == 'load']
    assert len(compiled) == 3 and all(e[1].endswith('.mlpackage') for e in compiled)
    assert len(loads) == 3 and all(e[1].endswith('.mlmodelc') and '/compiled/' in e[1] and e[2] == 'CPU_AND_NE'
                                   for e in loads)
    hetero = rows(cwd)
    assert all('ane_loss' in row for row in hetero if 'loss' in row)  # the ANE's share, every step
    assert 'energy meter: powermetrics' in r.stdout and hetero[-1]['joules_per_token'] > 0
    g = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, '--max_iters', '1', '--mode', 'gpu', '--out_dir', 'gpu'], cwd)
    assert g.returncode == 0, g.stderr[-3000:]
    # the same weights and batch: the ANE's half in fp16 (rounding ~1e-3 of the loss)
    assert abs(hetero[0]['loss'] - rows(cwd, 'gpu')[0]['loss']) < 1e-2 * hetero[0]['loss']

    # resumed, with one cache entry damaged and no sudo rights: that entry alone is compiled
    # again; the run says once that it has no energy meter, and trains on
    entry = next(e[1] for e in loads if 'head-' in e[1])
    with open(os.path.join(cwd, entry, 'coremldata.bin'), 'wb') as f:
        f.write(b'damaged')
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, '--max_iters', '3', '--ane_fraction', '0.5', '--resume'],
            cwd, sudo=0)
    assert r.returncode == 0, r.stderr[-3000:]
    new = coreml_log(cwd)[len(log):]
    assert [e[1] for e in new if e[0] == 'compile'] == [os.path.join('out', 'ane_B2_T32', 'head.mlpackage')]
    assert r.stdout.count('a password is required') == 1 and 'energy meter: none' in r.stdout
    assert rows(cwd)[-1]['step'] == 3 and 'joules_per_token' not in rows(cwd)[-1]


@pytest.mark.parametrize('fail', ['load', 'sigkill'])
def test_a_failed_neural_engine_compile(shakespeare, tmp_path, fail):
    # an exception at load stops the run at start with one line that names it; a SIGKILL
    # at the first predict (coremltools #2758) retires the ANE engine and the GPU trains on
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, '--max_iters', '2', '--ane_fraction', '0.5'], cwd, fail=fail)
    if fail == 'load':
        err = error_lines(r)
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith('error: the ANE worker could not start')
        assert 'Core ML could not compile or load the program block_forward' in err[0] and '--mode gpu' in err[0]
        assert '(RuntimeError: Failed to build the model execution plan' in err[0]  # Core ML's description
        assert '#2758' not in err[0]
        r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *TRAIN, '--max_iters', '1', '--ane_worker', 'false'], cwd, fail=fail)
        err = error_lines(r)
        assert r.returncode == 2 and len(err) == 1 and 'Core ML could not compile or load' in err[0], r.stderr
    else:
        assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr[-3000:]
        assert 'killed by SIGKILL' in r.stdout + r.stderr and '#2758' in r.stdout + r.stderr
        assert rows(cwd)[-1]['step'] == 2 and rows(cwd)[-1]['microbatches'] == 2


def test_the_self_check_every_stage_passes_and_reuses_the_cache(tmp_path):
    check = [os.path.join(ROOT, 'export_ane.py'), '--check', *TINY, '--vocab_size', '512', '--gpu_batch', '2',
             '--ane_batch_size', '2']
    r = mac(check, tmp_path)
    doc = json.load(open(tmp_path / 'ane_check.json'))
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
    compiles = sum(e[0] == 'compile' and 'ane_programs' in e[1] for e in coreml_log(tmp_path))
    assert compiles == 3  # each program once: the timings load the cached model
    r = mac(check + ['--stages', 'coreml'], tmp_path)
    doc = json.load(open(tmp_path / 'ane_check.json'))
    assert r.returncode == 0 and [s['name'] for s in doc['stages']] == ['coreml'], r.stdout[-2000:]
    assert all(rec['cached'] for rec in doc['stages'][0]['result'].values())
    assert sum(e[0] == 'compile' and 'ane_programs' in e[1] for e in coreml_log(tmp_path)) == 3


def test_bench(shakespeare, tmp_path):
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = mac([os.path.join(ROOT, 'bench.py'), *TRAIN, '--bench_iters', '1', '--bench_repeats', '1',
             '--ane_fraction', '0.5'], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index('x GPU-only'):].splitlines()[1:4]
    assert [line.split()[0] for line in table] == ['gpu', 'ane', 'hetero']
    assert all(line.split()[3] != 'n/a' for line in table)  # joules per token: powermetrics


CACHE = """
import os, export_ane, hetero_gpt as hg
from plumbing import programs
export_ane.export_programs(hg.GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32, vocab_size=200), 2, 32, 'p')
path, cached = programs.compiled_model('p', 'head')
assert not cached and os.path.isfile(os.path.join(path, 'DONE')) and path.endswith('.mlmodelc')
assert programs.compiled_model('p', 'head') == (path, True)
os.remove(os.path.join(path, 'DONE'))  # as a crash mid-compile leaves it
assert programs.compiled_model('p', 'head') == (path, False)
with open(os.path.join(programs.program_path('p', 'head'), 'Manifest.json'), 'a') as f:
    f.write(' ')  # another program under the same name
gone, running = 'p/compiled/.head-0.tmp999999999.mlmodelc', f'p/compiled/.head-0.tmp{os.getppid()}.mlmodelc'
os.makedirs(gone), os.makedirs(running)  # temporaries: of a process that is gone, of one still running
new, cached = programs.compiled_model('p', 'head')
assert new != path and not cached and not os.path.exists(path)
assert not os.path.exists(gone) and os.path.exists(running)
print(sorted(os.listdir('p/compiled')))
"""


def test_compile_cache(tmp_path):
    # compiled once through coremltools' compile_model (into a name ending in .mlmodelc),
    # loaded from the cache after; a half-written entry and a changed program are compiled
    # again; another process's temporary is left alone unless that process is gone
    r = mac(['-c', CACHE], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sum(e[0] == 'compile' for e in coreml_log(tmp_path)) == 3


RELEASE = """
import sys, time, numpy as np, export_ane, hetero_gpt as hg, coremltools as ct
from plumbing import programs
cfg = hg.GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32, vocab_size=200)
export_ane.export_programs(cfg, 2, 32, 'p')
m = ct.models.CompiledMLModel(programs.compiled_model('p', 'head')[0], compute_units=ct.ComputeUnit.CPU_AND_NE)
inputs = lambda: {k: np.zeros(s, np.float32) for k, s in hg.piece_input_shapes(cfg, 2, 32, 'head').items()}
kept = inputs()
for _ in range(3):
    programs.coreml_predict(m, kept)  # the same buffers, through fresh views each call
time.sleep(1.5)
print('views: ok', flush=True)
if sys.argv[1] == 'temporary':
    m.predict(inputs())  # freed by the time Core ML releases it
    time.sleep(1.5)
else:
    m.predict(kept)
    m.predict(kept)  # still held by Core ML from the call before
print('survived', flush=True)
"""


@pytest.mark.parametrize('misuse', ['temporary', 'again'])
def test_core_ml_releases_its_inputs_late(tmp_path, misuse):
    # the double crashes where Core ML's late release, off the GIL, could corrupt the heap
    # (coremltools PRs #2827, #2829); coreml_predict's views never give it the chance
    r = mac(['-c', RELEASE, misuse], tmp_path)
    assert 'views: ok' in r.stdout and 'survived' not in r.stdout and r.returncode == -11, (r.stdout, r.stderr[-2000:])
    assert ('after the caller had freed it' if misuse == 'temporary' else 'still held by Core ML') in r.stderr


PLACEMENT = """
import sys, export_ane, hetero_gpt as hg
from plumbing import programs
export_ane.export_programs(hg.GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32, vocab_size=200), 2, 32, 'p')
print(programs.macos_placement(programs.compiled_model('p', 'head')[0]))
"""


@pytest.mark.parametrize('version,cpu_ops', [('14.2', ''), ('15.5', 'abs')])
def test_placement(tmp_path, version, cpu_ops):
    # the compute plan needs macOS 14.4; on 15.5 it names the ops Core ML puts on the CPU
    r = mac(['-c', PLACEMENT], tmp_path, version=version, cpu_ops=cpu_ops)
    assert r.returncode == 0, r.stderr[-3000:]
    placement = eval(r.stdout.strip().splitlines()[-1])
    if version == '14.2':
        assert placement == {'unavailable': 'the compute plan needs macOS 14.4 (this is 14.2)'}
    else:
        assert set(placement['not_on_ane']) == {'abs -> MLCPUComputeDevice'} and placement['ane_share_of_ops'] < 1


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


def test_export_without_core_ml_is_refused_in_one_line(tmp_path):
    r = mac([os.path.join(ROOT, 'export_ane.py'), *TINY], tmp_path, native=0)
    err = error_lines(r)
    assert r.returncode == 2 and len(err) == 1 and 'has no Core ML runtime' in err[0], r.stderr[-2000:]
    assert not os.path.exists(tmp_path / 'ane_programs')


def test_the_energy_meter_against_powermetrics(tmp_path):
    # 13.5 W in all, GPU counted once; closing stops the root powermetrics too (SIGTERM
    # through sudo); without sudo rights it fails at once, not after a timeout
    code = """
import time
from plumbing import energy
m = energy.PowermetricsMeter()
j0, t0 = m.joules(), time.perf_counter()
time.sleep(7.2)
print((m.joules() - j0) / (time.perf_counter() - t0), {k: round(v, 2) for k, v in m.parts.items()})
m.close()
"""
    r = mac(['-c', code], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    watts = float(r.stdout.split()[0])
    assert watts == pytest.approx(13.5, rel=0.08)  # (the window's edges: a 0.24 s sample each, of 7.2 s)
    time.sleep(1)
    assert not [f for f in os.listdir(tmp_path) if f.startswith('powermetrics.')]  # none left running
    t0 = time.monotonic()
    r = mac(['-c', 'from plumbing import energy; energy.PowermetricsMeter()'], tmp_path, sudo=0)
    assert 'powermetrics gave no samples (sudo: a password is required)' in r.stderr and time.monotonic() - t0 < 8


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
    import hetero_gpt as hg
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
