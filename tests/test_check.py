"""export_ane.py --check (tools/ane_check.py): the stage runner, the report, the off-macOS run of the
real command, and the memory estimate the trainer's preflight uses."""
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

from tools import ane_check
import export_ane
import hetero_gpt as hg
import helpers
from plumbing import memory

import coremltools  # noqa: F401  (the programs' stages export: a test requirement)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '8', '--vocab_size', '100']


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


def test_the_report_and_its_schema(tmp_path):
    ctx = dict(cfg={'n_layer': 1}, B=1, T=8, gpu_batch=2)
    records = [dict(name='environment', status='ok', seconds=1.0, result={'os': 'x', 'torch': '2'}),
               dict(name='probes', status='needs macOS', seconds=0.0),
               dict(name='coreml', status='killed', seconds=3.0, error='died (killed by SIGKILL)')]
    path = str(tmp_path / 'ane_check.json')
    doc = ane_check.write_report(records, dict(ctx, cfg=dict(hg.GPTConfig().__dict__)), path)
    saved = json.loads(open(path).read())
    assert saved['heterogpt_check'] == 1 and saved['when'] == doc['when']
    assert set(saved) == {'heterogpt_check', 'when', 'config', 'ane_batch_size', 'block_size', 'gpu_batch', 'stages'}
    assert all({'name', 'status', 'seconds'} <= set(r) for r in saved['stages'])
    # the report holds what it was given: every record as it was, the model, the shapes
    assert saved['stages'] == records and saved['config'] == dict(hg.GPTConfig().__dict__)
    assert (saved['ane_batch_size'], saved['block_size'], saved['gpu_batch']) == (1, 8, 2)
    md = open(tmp_path / 'ane_check.md').read()
    assert '| coreml | killed |' in md and 'SIGKILL' in md
    assert [line.split(' | ')[:3] for line in md.splitlines() if line.startswith('| ') and '---' not in line][1:] == [
        ['| environment', 'ok', '1.0'], ['| probes', 'needs macOS', '0.0'], ['| coreml', 'killed', '3.0']]
    assert 'os x, torch 2' in md  # the environment's summary
    ane_check.write_report(records, dict(ctx, cfg=dict(hg.GPTConfig().__dict__)), path)  # its own: rewritten
    mine = tmp_path / 'mine.json'
    mine.write_text('{"notes": 1}')
    with pytest.raises(hg.UserError, match='not written by this check'):
        ane_check.write_report(records, dict(ctx, cfg=dict(hg.GPTConfig().__dict__)), str(mine))
    assert mine.read_text() == '{"notes": 1}'


def test_the_stages_that_run_off_macos(exported):
    # the stages' own functions, in this process, on programs exported once (the programs
    # stage finds them there, for these shapes, and reuses them); the command runs each in a
    # process of its own (test_the_check_command_off_macos, slow)
    cfg = helpers.PROGRAMS['cfg']
    ctx = dict(cfg=dataclasses.asdict(cfg), B=2, T=8, out=exported(**helpers.PROGRAMS), gpu_batch=4, results={})
    env = ane_check.environment(ctx)
    assert env['torch'] == torch.__version__ and env['coremltools'] == ane_check.settings.import_coremltools().__version__
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
    run = hg.Config(**ctx['cfg'], batch_size=4, ane_batch_size=2)
    assert proj['memory'] == memory.memory_estimate(run, 'hetero', torch.device('mps' if hg.ON_MAC else 'cpu'),
                                                    torch.float32, hg.model_sizes(run))
    assert proj['tokens_per_s'] == 'needs macOS (the concurrency stage)'
    # with the concurrency stage's times (4 x 8 tokens a GPU microbatch): each engine's rate beside the
    # other, summed; the ANE's share of it
    ctx['results']['concurrency'] = dict(gpu_alone=0.08, gpu_beside=0.1, ane_alone=0.25, ane_beside=0.4)
    proj = ane_check.projection(ctx)
    assert {k: proj[k] for k in ('gpu_tokens_per_s', 'ane_tokens_per_s', 'hetero_tokens_per_s', 'ane_share')} == dict(
        gpu_tokens_per_s=400, ane_tokens_per_s=128, hetero_tokens_per_s=400, ane_share=0.2)


def test_the_check_fails_on_a_low_cosine_or_a_failed_stage(tmp_path, monkeypatch):
    said = []
    for grads, status, code, words in ((dict(passed=False, worst_cosine=0.9), 'ok', 1, 'gradients (worst cosine below'),
                                       (dict(passed=True, worst_cosine=0.9999), 'ok', 0, None),
                                       (dict(passed=True, worst_cosine=0.9999), 'killed', 1, 'programs')):
        records = [dict(name='programs', status=status, seconds=1.0),
                   dict(name='gradients', status='ok', seconds=1.0, result=grads)]
        monkeypatch.setattr(ane_check, 'run_all', lambda *a, **k: records)
        said.clear()
        cfg = hg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100)
        assert ane_check.main(cfg, 2, 8, str(tmp_path / 'p'), 4, str(tmp_path / 'c.json'), 60, log=said.append) == code
        failed = [s for s in said if s.startswith('FAILED')]
        assert (failed == [] if words is None else len(failed) == 1 and words in failed[0]), said
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
    run = hg.Config(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100, batch_size=4, ane_batch_size=2)
    assert res['projection']['memory'] == memory.memory_estimate(run, 'hetero', torch.device('cpu'), torch.float32,
                                                                 hg.model_sizes(run))
    assert res['projection']['memory']['total'] > 0 and res['environment']['torch'] == torch.__version__


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
    need = memory.memory_estimate(cfg, 'hetero', torch.device('cpu'), torch.float32, hg.model_sizes(cfg))['total']
    said = []
    monkeypatch.setattr(memory, 'total_memory', lambda: int(need / 0.8))
    memory.preflight(cfg, 'hetero', torch.device('cpu'), torch.float32, hg.model_sizes(cfg), log=said.append)
    assert len(said) == 1 and 'may swap' in said[0]
    monkeypatch.setattr(memory, 'total_memory', lambda: int(need / 1.5))
    with pytest.raises(hg.UserError, match='lower --batch_size .*--ane_batch_size'):
        memory.preflight(cfg, 'hetero', torch.device('cpu'), torch.float32, hg.model_sizes(cfg))
    # the Mac's defaults: GPT-2 124M in hetero mode fits 16 GB; its old microbatch of 8 would not
    mac = hg.Config(**hg.MAC_DEFAULTS)
    assert memory.memory_estimate(mac, 'hetero', torch.device('mps'), torch.float32, hg.model_sizes(mac))['total'] < 0.7 * 16 * 2**30
    assert memory.memory_estimate(hg.Config(), 'hetero', torch.device('mps'), torch.float32, hg.model_sizes(hg.Config()))['total'] > 0.9 * 16 * 2**30


def test_check_refuses_calls_that_do_not_divide_the_gpu_microbatch(tmp_path, capsys):
    # the worker runs the GPU engine's microbatch in calls of --ane_batch_size sequences
    rc = export_ane.main(['--check', *TINY, '--ane_batch_size', '4', '--gpu_batch', '2', '--out', str(tmp_path / 'p'),
                          '--check_report', str(tmp_path / 'check.json')])
    assert rc == 2 and '--ane_batch_size 4 must divide --gpu_batch 2' in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # nothing exported, no report
