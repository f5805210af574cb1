"""export_ane.py --check (tools/ane_check.py): the stage runner, the report, the off-macOS run of the
real command, and the memory estimate the trainer's preflight uses."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tools import ane_check
import export_ane
import hetero_gpt as hg
from plumbing import memory

pytest.importorskip('coremltools')  # (the programs' stages export)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '8', '--vocab_size', '100']


def test_a_stage_that_hangs_dies_or_raises_is_reported_and_the_next_runs():
    stages = [('first', False, ''), ('hangs', False, ''), ('killed', False, ''), ('raises', False, ''),
              ('on_a_mac', True, ''), ('last', False, '')]
    targets = {'first': 'check_stages:ok', 'hangs': 'check_stages:hang', 'killed': 'check_stages:sigkill',
               'raises': 'check_stages:raises', 'on_a_mac': 'check_stages:ok', 'last': 'check_stages:ok'}
    records = ane_check.run_all({}, stages, timeout=10, log=lambda s: None, targets=targets)  # (a child starts in ~3 s)
    status = {r['name']: r['status'] for r in records}
    assert status == {'first': 'ok', 'hangs': 'timeout', 'killed': 'killed', 'raises': 'failed',
                      'on_a_mac': 'ok' if hg.ON_MAC else 'needs macOS', 'last': 'ok'}
    by = {r['name']: r for r in records}
    assert 'SIGKILL' in by['killed']['error'] and "ValueError: a stage's own error" == by['raises']['error']
    assert 10 <= by['hangs']['seconds'] < 60  # cut at its timeout
    assert by['last']['result'] == {'seen': ['first', 'hangs', 'killed', 'raises']}  # results reach later stages


def test_the_report_and_its_schema(tmp_path):
    ctx = dict(cfg={'n_layer': 1}, B=1, T=8, gpu_batch=2)
    records = [dict(name='environment', status='ok', seconds=1.0, result={'os': 'x', 'torch': '2'}),
               dict(name='probes', status='needs macOS', seconds=0.0),
               dict(name='coreml', status='killed', seconds=3.0, error='died (killed by SIGKILL)')]
    path = str(tmp_path / 'ane_check.json')
    doc = ane_check.write_report(records, dict(ctx, cfg=dict(hg.GPTConfig().__dict__)), path)
    saved = json.loads(open(path).read())
    assert saved == json.loads(json.dumps(doc)) and saved['heterogpt_check'] == 1
    assert set(saved) == {'heterogpt_check', 'when', 'config', 'ane_batch_size', 'block_size', 'gpu_batch', 'stages'}
    assert all({'name', 'status', 'seconds'} <= set(r) for r in saved['stages'])
    md = open(tmp_path / 'ane_check.md').read()
    assert '| coreml | killed |' in md and 'SIGKILL' in md
    ane_check.write_report(records, dict(ctx, cfg=dict(hg.GPTConfig().__dict__)), path)  # its own: rewritten
    mine = tmp_path / 'mine.json'
    mine.write_text('{"notes": 1}')
    with pytest.raises(hg.UserError, match='not written by this check'):
        ane_check.write_report(records, dict(ctx, cfg=dict(hg.GPTConfig().__dict__)), str(mine))
    assert mine.read_text() == '{"notes": 1}'


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
    assert res['projection']['memory']['total'] > 0 and res['environment']['torch'] == torch.__version__


@pytest.mark.parametrize('shape', ['4 256 256 16 512', '2 128 128 8 8000'])
def test_memory_estimate_against_a_measured_cpu_run(shape):
    # The estimate of a CPU run (GPU mode: autograd, AdamW) against its measured peak memory,
    # beyond what importing PyTorch took: within 25% (one layout activation-heavy, one
    # logit-heavy). The estimate counts the tensors by shape; the runtime's own is a constant.
    out = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'memory_probe.py'), *shape.split()],
                         capture_output=True, text=True, timeout=600)
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
