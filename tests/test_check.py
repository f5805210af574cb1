"""export_ane.py --check (tools/ane_check.py): the stage runner, the report, the off-macOS run of the
real command, and the memory estimate the trainer's preflight uses."""
import dataclasses
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tools import ane_check
import export_ane
import hetero_gpt as hg
import helpers
from plumbing import memory, settings

import coremltools  # noqa: F401  (the programs' stages export: a test requirement)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '8', '--vocab_size', '100']


@pytest.mark.slow  # four stage processes: the hang and pipe tests below are the fast ones
def test_a_stage_that_dies_or_raises_is_reported_and_the_next_runs():
    # each stage in a spawned process: one that raises is 'failed' with its error, one killed
    # (SIGKILL, as a failed ANE compile) is 'killed', and the stages after each still run and
    # see the results before them. The timeout is far past a spawn (300 s): no stage here hangs
    stages = [('killed', False, ''), ('raises', False, ''), ('on_a_mac', True, ''), ('last', False, '')]
    targets = {'killed': 'check_stages:sigkill', 'raises': 'check_stages:raises', 'on_a_mac': 'check_stages:ok',
               'last': 'check_stages:ok'}
    records = ane_check.run_all({}, stages, timeout=300, log=lambda s: None, targets=targets)
    status = {r['name']: r['status'] for r in records}
    assert status == {'killed': 'killed', 'raises': 'failed', 'on_a_mac': 'ok' if hg.ON_MAC else 'needs macOS',
                      'last': 'ok'}
    by = {r['name']: r for r in records}
    assert 'SIGKILL' in by['killed']['error'] and "ValueError: a stage's own error" == by['raises']['error']
    ran = ['killed', 'raises'] + (['on_a_mac'] if hg.ON_MAC else [])
    assert by['last']['result'] == {'seen': sorted(ran)}  # results reach later stages


def test_a_stage_that_hangs_is_stopped_at_its_timeout():
    # the timeout is what this is about: a stage that never answers is stopped once it has
    # passed (here 2 s), its process killed, and reported as a timeout
    rec = ane_check.run_stage('hangs', {'results': {}}, 2, 'check_stages:hang')
    assert rec['status'] == 'timeout' and rec['error'] == 'no answer within 2 s: stopped'
    assert rec['seconds'] >= 2
    assert not [p for p in multiprocessing.active_children() if p.name == 'check-hangs']  # killed and reaped


def test_a_stage_whose_pipe_closes_before_it_dies_is_killed_not_timed_out():
    # the child closes its end, then lives 0.5 s more and is SIGKILLed: the runner sees EOF while it is
    # alive, and only by waiting for it (join after EOFError) does it see how it ended
    rec = ane_check.run_stage('dies', {'results': {}}, 300, 'check_stages:closes_then_dies')
    assert rec['status'] == 'killed' and 'SIGKILL' in rec['error'], rec


def test_a_stage_that_returns_skipped_is_skipped_and_passes(tmp_path):
    rec = ane_check.run_stage('energy', {'results': {}}, 300, 'check_stages:skipped')
    assert rec['status'] == 'skipped' and rec['error'] == 'powermetrics needs root (sudo -v first)'
    assert ane_check.verdict_of(rec) == ('skipped', 'powermetrics needs root (sudo -v first)')


def records():
    """One record of each kind, with results shaped as the stages return them."""
    return [dict(name='environment', status='ok', seconds=1.0, result={'os': 'x', 'torch': '2', 'mps': True}),
            dict(name='probes', status='needs macOS', seconds=0.0),
            dict(name='coreml', status='ok', seconds=64.5, result={
                'block_forward': dict(placement={'ane_share_of_ops': 0.97}, CPU_AND_NE_ms=70.149, CPU_ONLY_ms=170.7),
                'head': dict(placement={}, CPU_AND_NE_ms=4962.97, CPU_ONLY_ms=5000.1)}),
            dict(name='gradients', status='ok', seconds=11.6, result=dict(worst_cosine=0.9987, worst='lm', passed=False)),
            dict(name='concurrency', status='ok', seconds=55.0, result=dict(
                gpu_alone=0.05596435500046937, gpu_beside=0.052288281999608444, ane_alone=5.331127303999892,
                ane_beside=5.731300086999909)),
            dict(name='energy', status='skipped', seconds=2.0, error='needs sudo'),
            dict(name='projection', status='ok', seconds=3.0, result=dict(
                memory_gib=0.47, machine_gib=16.0, gpu_tokens_per_s=2287, ane_tokens_per_s=24, hetero_tokens_per_s=2470,
                run=dict(gpu=8600, ane=819200, hetero=7962)))]


def test_the_report_and_its_schema(tmp_path):
    ctx = dict(cfg=dict(hg.GPTConfig().__dict__), B=1, T=8, gpu_batch=2)
    path = str(tmp_path / 'ane_check.json')
    doc, written, how = ane_check.write_report(records(), ctx, path)
    saved = json.loads(open(path).read())
    assert written == path and how == 'a new report'
    assert set(saved) == {'heterogpt_check', 'when', 'config', 'ane_batch_size', 'block_size', 'gpu_batch', 'stages'}
    # the JSON keeps every figure as it was measured, the time of each stage added
    assert [{k: v for k, v in r.items() if k != 'when'} for r in saved['stages']] == records()
    assert all(r['when'] == saved['when'] for r in saved['stages'])
    assert saved['config'] == dict(hg.GPTConfig().__dict__) and (saved['ane_batch_size'], saved['block_size']) == (1, 8)
    table = {line.split(' | ')[0][2:]: line.split(' | ')[1:] for line in open(tmp_path / 'ane_check.md')
             if line.startswith('| ') and '---' not in line}
    verdicts = {k: v[0] for k, v in table.items() if k != 'stage'}
    assert verdicts == {'environment': 'pass', 'probes': 'needs macOS', 'coreml': 'warn', 'gradients': 'fail',
                        'concurrency': 'pass', 'energy': 'skipped', 'projection': 'pass'}
    # README's figures, rounded: the ANE's share in %, the worst cosine, beside/alone in ms and as a ratio,
    # tokens/s and the run's time per mode; never a raw 17-digit second
    assert table['coreml'][2].startswith('block_forward: 97% of ops on the ANE, 70.15 ms (CPU alone 170.7 ms); '
                                         'head: ANE share unknown (needs macOS 14.4)')
    # the head's CPU_AND_NE time is 0.99x its CPU_ONLY time: it may run on the CPU, whatever its plan says
    assert 'head not clearly faster on the ANE than on the CPU (at least 0.8x)' in table['coreml'][2]
    assert 'worst cosine 0.998700' in table['gradients'][2]
    assert 'GPU step 52.29 ms beside the ANE, 55.96 ms alone (0.93x); ANE call 5731 ms beside the GPU, 5331 ms ' \
           'alone (1.08x)' in table['concurrency'][2]
    assert table['projection'][2].startswith('gpu: 2,287 tokens/s, the training run of these flags in 2h 23m; ane: 24 tokens/s, the '
                                             'training run of these flags in 227h 33m; hetero: 2,470 tokens/s, the training run of these flags in 2h 12m')
    assert table['energy'][2].strip(' |\n') == 'needs sudo' and table['coreml'][1] == '1m 04s'
    # engines that slow each other past 1.25x: a note, not a failure (the path works; hetero gains less)
    slow = dict(records()[4], result=dict(gpu_alone=0.01, gpu_beside=0.013, ane_alone=1.0, ane_beside=1.0))
    assert ane_check.verdict_of(slow)[0] == 'warn' and '(1.30x)' in ane_check.verdict_of(slow)[1]
    watts = dict(name='energy', status='ok', seconds=1.0, result=dict(gpu_alone_watts={'CPU': 3.04, 'GPU': 9.0}))
    assert ane_check.verdict_of(watts) == ('pass', 'GPU alone: CPU 3.0 W, GPU 9.0 W')
    assert not re.search(r'\d\.\d{6,}', open(tmp_path / 'ane_check.md').read().replace('0.998700', ''))
    mine = tmp_path / 'mine.json'
    mine.write_text('{"notes": 1}')
    with pytest.raises(hg.UserError, match='not written by this check'):
        ane_check.write_report(records(), ctx, str(mine))
    assert mine.read_text() == '{"notes": 1}'


def test_a_partial_rerun_merges_into_the_full_report_and_another_model_gets_its_own(tmp_path):
    ctx = dict(cfg=dict(hg.GPTConfig().__dict__), B=1, T=8, gpu_batch=2)
    path = str(tmp_path / 'ane_check.json')
    ane_check.write_report(records(), ctx, path)
    again = [dict(name='coreml', status='failed', seconds=2.0, error='RuntimeError: no')]
    _, written, how = ane_check.write_report(again, ctx, path)
    stages = json.load(open(path))['stages']
    assert written == path and how.startswith('merged: coreml re-run')
    assert [r['name'] for r in stages] == [r['name'] for r in records()]  # every stage still there
    assert [r['status'] for r in stages] == ['ok', 'needs macOS', 'failed', 'ok', 'ok', 'skipped', 'ok']
    other = dict(ctx, cfg=dict(hg.GPTConfig(n_layer=2).__dict__))
    _, written, how = ane_check.write_report(again, other, path)
    assert written == str(tmp_path / 'ane_check-L2-C768-B1-T8.json') and 'its own' in how
    assert [r['status'] for r in json.load(open(path))['stages']][2] == 'failed'  # the first report kept
    assert [r['name'] for r in json.load(open(written))['stages']] == ['coreml']


@pytest.mark.slow  # a real SIGINT to a process group
def test_ctrl_c_keeps_the_finished_stages_and_exits_130(tmp_path):
    # a real SIGINT to the check's process group (as Ctrl-C in a terminal) while its second stage runs:
    # the first stage's result is in the report, the rest 'interrupted', one line, exit code 130, no
    # traceback, and the stage's process is gone
    report = tmp_path / 'r' / 'check.json'
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, 'tests', 'check_stages.py'), str(report)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')])))
    said = ''
    while 'stage second' not in said:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        said += line
    time.sleep(3)  # the stage's process well started
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert 'Traceback' not in err and 'KeyboardInterrupt' not in err, err
    assert [line for line in (said + out).splitlines() if 'interrupted' in line] == [
        f"interrupted in stage second: the stages before it are in {report.with_suffix('.md')} (a new report)"]
    doc = json.load(open(report))
    assert [(r['name'], r['status']) for r in doc['stages']] == [('first', 'ok'), ('second', 'interrupted'),
                                                                 ('third', 'interrupted')]
    ps = subprocess.run(['ps', '-o', 'pid=', '-o', 'args=', '-g', str(proc.pid)], capture_output=True, text=True).stdout
    assert 'multiprocessing' not in ps, ps  # the stage's process stopped


def test_the_stages_that_run_off_macos(exported):
    # the stages' own functions, in this process, on programs exported once (the programs
    # stage finds them there, for these shapes, and reuses them); the command runs each in a
    # process of its own (test_the_check_command_off_macos, slow)
    cfg = helpers.PROGRAMS['cfg']
    ctx = dict(cfg=dataclasses.asdict(cfg), B=2, T=8, out=exported(**helpers.PROGRAMS), gpu_batch=4, results={})
    env = ane_check.environment(ctx)
    from importlib import metadata  # (the installed package's record, not the module the stage read)
    # (a CUDA build's record may leave out torch.__version__'s local label, +cu130)
    assert env['torch'].split('+')[0] == metadata.version('torch').split('+')[0]
    assert env['coremltools'] == metadata.version('coremltools')
    assert ('macos' in env) == hg.ON_MAC
    prog = ane_check.programs(ctx)
    # every matmul of the step, and one more forward of each block (its backward recomputes it): more than
    # the analytic count, less than 4/3 of it (a forward is a third of forward and backward)
    assert prog['off_ane'] == [] and 1 < prog['matmul_ratio'] < 4 / 3 and set(prog['per_program']) == set(hg.ANE_PIECES)
    grads = ane_check.gradients(ctx)
    # fp16 programs (NumPy here) against fp64 autograd: direction by cosine, the loss to 1e-2 relative
    assert grads['passed'] and grads['worst_cosine'] >= 0.999 and grads['finite']
    assert abs(grads['loss'] - grads['reference_loss']) <= 1e-2 * grads['reference_loss']
    proj = ane_check.projection(ctx)
    other = hg.Config(**ctx['cfg'], batch_size=8, ane_batch_size=2)  # twice the microbatch: more memory
    assert proj['memory']['total'] < memory.memory_estimate(other, 'hetero', torch.device('cpu'), torch.float32,
                                                            hg.model_sizes(other), settings.ane_batch_size(other))['total']
    # the run these flags start (ane_batch_size B, batch_size gpu_batch), in GiB to 2 decimals
    run = hg.Config(**ctx['cfg'], batch_size=4, ane_batch_size=2)
    mac = torch.device('mps' if hg.ON_MAC else 'cpu')  # the Mac's run
    assert proj['memory'] == memory.memory_estimate(run, 'hetero', mac, torch.float32, hg.model_sizes(run), 2)
    assert abs(proj['memory_gib'] - proj['memory']['total'] / 2**30) <= 0.005
    assert proj['tokens_per_s'] == 'needs macOS (the concurrency stage)'
    # with the concurrency stage's times (4 x 8 tokens a GPU microbatch): each engine's rate beside the
    # other, summed; the ANE's share of it
    ctx['results']['concurrency'] = dict(gpu_alone=0.08, gpu_beside=0.1, ane_alone=0.25, ane_beside=0.4)
    ctx['run_tokens'] = 32 * 8 * 1000  # the default run: 1000 steps of 32 x 8 tokens
    proj = ane_check.projection(ctx)
    assert {k: proj[k] for k in ('gpu_tokens_per_s', 'ane_tokens_per_s', 'hetero_tokens_per_s', 'ane_share')} == dict(
        gpu_tokens_per_s=400, ane_tokens_per_s=128, hetero_tokens_per_s=400, ane_share=0.2)
    assert proj['run'] == dict(gpu=640, ane=2000, hetero=640)  # 256,000 tokens at each rate


def test_the_check_fails_on_a_low_cosine_or_a_failed_stage(tmp_path, monkeypatch):
    said = []
    for grads, status, code, words in ((dict(passed=False, worst_cosine=0.9), 'ok', 1, 'gradients'),
                                       (dict(passed=True, worst_cosine=0.9999), 'ok', 0, None),
                                       (dict(passed=True, worst_cosine=0.9999), 'killed', 1, 'programs')):
        records = [dict(name='programs', status=status, seconds=1.0),
                   dict(name='gradients', status='ok', seconds=1.0, result=grads)]
        monkeypatch.setattr(ane_check, 'run_all', lambda *a, **k: records)
        said.clear()
        cfg = hg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100)
        assert ane_check.main(cfg, 2, 8, str(tmp_path / 'p'), 4, str(tmp_path / 'c.json'), 60, log=said.append) == code
        failed = [s for s in said if s.startswith('FAILED')]
        assert (failed == [] if words is None else failed == [f'FAILED: {words}']), said
    with pytest.raises(hg.UserError, match='--stages nonesuch: unknown'):
        ane_check.main(cfg, 2, 8, str(tmp_path / 'p'), 4, str(tmp_path / 'c.json'), 60, 'programs,nonesuch')


@pytest.mark.slow
def test_the_check_command_off_macos(tmp_path, capsys):
    # the real command at a tiny configuration: every stage that can run here runs; the
    # others say that they need macOS; the gradients of the chained programs in NumPy pass
    report = str(tmp_path / 'check.json')
    rc = export_ane.main(['--check', *TINY, '--ane_batch_size', '2', '--gpu_batch', '4', '--out', str(tmp_path / 'p'),
                          '--check_report', report, '--stage_timeout', '300'])
    doc = json.load(open(report))
    status = {r['name']: r['status'] for r in doc['stages']}
    expected = 'ok' if hg.ON_MAC else 'needs macOS'
    assert rc == 0, (status, capsys.readouterr())
    assert status == {'environment': 'ok', 'probes': expected, 'programs': 'ok', 'coreml': expected,
                      'gradients': 'ok', 'concurrency': expected, 'energy': expected, 'projection': 'ok'}
    res = {r['name']: r.get('result') for r in doc['stages']}
    assert res['gradients']['passed'] and res['gradients']['worst_cosine'] >= 0.999
    assert res['programs']['off_ane'] == [] and res['programs']['matmul_ratio'] > 1  # (the recompute)
    from importlib import metadata  # (the installed package's record, not the module the stage read)
    assert res['projection']['memory']['total'] > 0
    assert res['environment']['torch'].split('+')[0] == metadata.version('torch').split('+')[0]
    assert os.path.exists(tmp_path / 'check.md') and not os.path.exists(tmp_path / 'check-L1-C16-B2-T8.json')


@pytest.mark.slow
@pytest.mark.parametrize('shape', ['4 256 256 16 512', '2 128 128 8 8000'])
def test_memory_estimate_against_a_measured_cpu_run(shape):
    # The estimate of a CPU run (GPU mode: autograd, AdamW) against its measured peak memory,
    # beyond what importing PyTorch took: within 25% (one layout activation-heavy, one
    # logit-heavy). The estimate counts the tensors by shape; the runtime's own is a constant.
    out = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'memory_probe.py'), *shape.split()],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    measured, estimate = map(int, out.stdout.split()[-2:])
    print(f"{shape}: measured {measured / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB")
    assert abs(estimate / measured - 1) <= 0.25


def test_preflight_refuses_what_will_not_fit_and_warns_near_it(monkeypatch):
    cfg = hg.Config(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=1000, batch_size=8)
    need = memory.memory_estimate(cfg, 'hetero', torch.device('cpu'), torch.float32, hg.model_sizes(cfg), settings.ane_batch_size(cfg))['total']
    said = []
    monkeypatch.setattr(memory, 'total_memory', lambda: int(need / 0.8))
    cpu = torch.device('cpu')
    run = settings.Run('hetero', cpu, torch.float32, cpu, torch.float16, ane_in_worker=False, ane_programs=True,
                       ane_batch_size=settings.ane_batch_size(cfg))
    memory.preflight(cfg, run, hg.model_sizes(cfg), log=said.append)
    assert len(said) == 1 and 'may swap' in said[0]
    monkeypatch.setattr(memory, 'total_memory', lambda: int(need / 1.5))
    with pytest.raises(hg.UserError, match='lower --batch_size .*--ane_batch_size'):
        memory.preflight(cfg, run, hg.model_sizes(cfg))
    # the Mac's defaults: GPT-2 124M in hetero mode fits 16 GB; its old microbatch of 8 would not
    mac = hg.Config(**hg.MAC_DEFAULTS)
    assert memory.memory_estimate(mac, 'hetero', torch.device('mps'), torch.float32, hg.model_sizes(mac), settings.ane_batch_size(mac))['total'] < 0.7 * 16 * 2**30
    assert memory.memory_estimate(hg.Config(), 'hetero', torch.device('mps'), torch.float32, hg.model_sizes(hg.Config()), settings.ane_batch_size(hg.Config()))['total'] > 0.9 * 16 * 2**30


def test_check_refuses_calls_that_do_not_divide_the_gpu_microbatch(tmp_path, capsys):
    # the worker runs the GPU engine's microbatch in calls of --ane_batch_size sequences
    rc = export_ane.main(['--check', *TINY, '--ane_batch_size', '4', '--gpu_batch', '2', '--out', str(tmp_path / 'p'),
                          '--check_report', str(tmp_path / 'check.json')])
    assert rc == 2 and '--ane_batch_size 4 must divide --gpu_batch 2' in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # nothing exported, no report
