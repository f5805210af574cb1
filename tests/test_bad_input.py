"""Bad input, one test per kind: each is a one-line error (exit code 2) that names what is
wrong and what to do, and leaves every file that existed before byte for byte as it was.
tests/test_bad_input_cases.py runs many more cases as separate processes (slow tests)."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

import export_ane
import hetero_gpt as hg
import helpers


def files(folder):
    """{path under folder: sha256} of every file there."""
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, 'rb').read()).hexdigest()
    return out


def main(data_dir, out_dir, *flags):
    """hg.main on helpers.TINY and flags: its exit code (0 when it returns)."""
    try:
        hg.main(helpers.flags(data_dir, out_dir) + list(flags))
    except SystemExit as e:
        return e.code
    return 0


def error(capsys):
    """The one error line main printed (and that it was one line)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: '), err
    return err[0]


BAD_FLAGS = [('--learning_rate', '-1'), ('--min_lr', '-0.5'), ('--beta1', '1'), ('--beta2', '-0.1'),
             ('--weight_decay', '-0.1'), ('--grad_clip', '-1'), ('--eval_interval', '0'), ('--log_interval', '0'),
             ('--max_iters', '-1'), ('--eval_iters', '-3'), ('--warmup_iters', '-1'),
             ('--loss_scale', '0'), ('--scale_window', '0'), ('--sample_tokens', '-1'), ('--max_bad_steps', '-1'),
             ('--seed', '-1'), ('--learning_rate', 'nan'), ('--batch_size', '0'), ('--dtype', 'half'),
             ('--ane_dtype', 'float17'), ('--mode', 'tpu'), ('--device', 'tpu'), ('--ane_fraction', '2')]


def test_bad_settings_are_refused_before_anything_is_written(data_dir, tmp_path, capsys):
    # every setting PyTorch (or the loop) would reject late: one line naming the flag and
    # its value (as parsed: -1 for a float is -1.0), before the out_dir is made
    for flag, value in BAD_FLAGS:
        assert main(data_dir, tmp_path / 'o', flag, value) == 2, flag
        line = error(capsys)
        shown = getattr(hg.parse_args([flag, value])[0], flag[2:])
        assert f"{flag} {shown}:" in line or f"{flag} {shown!r}" in line or (
            flag in line and line.endswith(f"got {shown!r}")), line
    if not torch.cuda.is_available():
        assert main(data_dir, tmp_path / 'o', '--mode', 'hetero', '--ane_device', 'cuda') == 2
        assert '--ane_device cuda' in error(capsys)
    assert main(data_dir, tmp_path / 'o', '--resume', '--overwrite') == 2 and 'give one of them' in error(capsys)
    (tmp_path / 'afile').write_text('mine')
    for out in ('afile', 'afile/sub'):
        assert main(data_dir, tmp_path / out) == 2
        assert '--out_dir' in error(capsys)
    assert not (tmp_path / 'o').exists() and (tmp_path / 'afile').read_text() == 'mine'


def test_settings_that_do_not_apply_are_named_once(capsys):
    said = []
    cfg, given = hg.parse_args(['--device', 'cpu', '--mode', 'gpu', '--ane_programs', 'x',
                                '--ane_fraction', '0.5', '--loss_scale', '8', '--ane_evaluator', 'numpy', '--ane_batch_size', '2'])
    hg.setup(cfg, given, log=said.append)
    moot = [s for s in said if s.startswith('not used')]
    assert len(moot) == 1 and all(f in moot[0] for f in ('--ane_programs', '--ane_fraction', '--loss_scale',
                                                         '--ane_batch_size'))
    assert ('--ane_evaluator' in moot[0]) and ('no fp16 engine' in moot[0])
    said.clear()
    cfg, given = hg.parse_args(['--device', 'cpu', '--mode', 'ane', '--ane_loss_scale', '8'])
    hg.setup(cfg, given, log=said.append)  # the fp16 stand-in uses its loss scale: nothing to say
    assert not [s for s in said if s.startswith('not used')]
    cfg, given = hg.parse_args(['--device', 'cpu', '--mode', 'ane', '--loss_scale', '8'])
    hg.setup(cfg, given, log=said.append)  # --loss_scale is the GPU engine's, which mode ane has not
    assert [s for s in said if s.startswith('not used') and '--loss_scale' in s]
    said.clear()  # the worker runs the eager stand-in: no programs to export, no GPU model to compile
    cfg, given = hg.parse_args(['--device', 'cpu', '--mode', 'ane', '--ane_programs', 'x', '--compile'])
    hg.setup(cfg, given, log=said.append)
    assert [s for s in said if s.startswith('not used') and '--ane_programs' in s and '--compile' in s]
    said.clear()  # the CPU worker runs the eager stand-in a microbatch at a time: no ANE calls to size
    cfg, given = hg.parse_args(['--device', 'cpu', '--mode', 'hetero', '--ane_batch_size', '2', '--batch_size', '4'])
    assert hg.setup(cfg, given, log=said.append)[1].ane_in_worker
    assert [s for s in said if s.startswith('not used') and '--ane_batch_size' in s]
    with pytest.raises(hg.UserError, match='--ane_batch_size 3 must divide --batch_size 8'):
        hg.setup(*hg.parse_args(['--device', 'cpu', '--mode', 'ane', '--ane_batch_size', '3']))
    with pytest.raises(hg.UserError, match='--ane_evaluator'):
        hg.setup(*hg.parse_args(['--device', 'cpu', '--mode', 'ane', '--ane_evaluator', 'coreml']))


def test_devices_that_are_not_here(monkeypatch):
    # a GPU index past those PyTorch sees, MPS off a Mac: one line each, before anything is made
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    with pytest.raises(hg.UserError, match=r"--device cuda:1: PyTorch sees 1 CUDA GPU\(s\) here"):
        hg.settings.resolve_device('cuda:1')
    monkeypatch.setattr(torch.backends.mps, 'is_available', lambda: False)
    with pytest.raises(hg.UserError, match='--ane_device mps: MPS is not available here'):
        hg.settings.resolve_device('mps', '--ane_device')


def test_a_mac_takes_its_own_defaults_for_flags_not_given(monkeypatch):
    # on a Mac (its GPU: MPS) the microbatches that fit a 16 GB Mac, MAC_DEFAULTS, replace the
    # settings not given; a flag given wins. (The Mac's own checks, done elsewhere, pass here.)
    s = hg.settings
    monkeypatch.setattr(s, 'ON_MAC', True)
    monkeypatch.setattr(s, 'resolve_device', lambda name, flag='--device': torch.device('mps'))
    for check in ('check_mps', 'check_coreml', 'check_ane_alignment'):
        monkeypatch.setattr(s, check, lambda *a, **k: None)
    for flags, want in (([], hg.MAC_DEFAULTS), (['--batch_size', '4'], dict(hg.MAC_DEFAULTS, batch_size=4))):
        said = []
        given_cfg, given = hg.parse_args(flags)
        cfg, run = s.check(given_cfg, given, hg.CPU_DEFAULTS, hg.MAC_DEFAULTS, log=said.append)
        assert (run.device, run.dtype, run.ane_dtype, run.mode) == (torch.device('mps'), torch.float32, torch.float16, 'hetero')
        assert {k: getattr(cfg, k) for k in want} == want and cfg.mode == 'hetero'
        assert given_cfg == hg.parse_args(flags)[0]  # the Config given is left as it was
        assert said[0].startswith('on a Mac: a run sized for an hour') and 'batch_size=4' not in said[0]


@pytest.mark.parametrize('cuda', [False, True])
def test_help_says_what_replaces_the_defaults_without_a_gpu(capsys, monkeypatch, cuda):
    # a machine without a GPU (whatever this one has), then one with CUDA: GPT-2's defaults alone
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: cuda)
    with pytest.raises(SystemExit):
        hg.parse_args(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    if cuda:
        assert 'no GPU' not in text and 'default here' not in text and '(default: 12)' in text, text
    else:
        assert "GPT-2 124M's" in text and 'no GPU' in text and '(default here, no GPU: 4; with --preset gpt2: 12; with a CUDA GPU: 12)' in text


@pytest.mark.parametrize('damage', ['meta.json not JSON', 'token id past the vocabulary', 'short train.bin'])
def test_broken_data_names_the_command_that_rebuilds_it(data_dir, tmp_path, capsys, damage):
    bad = tmp_path / 'mydata'
    shutil.copytree(data_dir, bad)
    if damage == 'meta.json not JSON':
        (bad / 'tiny' / 'meta.json').write_text('{not json')
    elif damage == 'token id past the vocabulary':
        ids = np.fromfile(bad / 'tiny' / 'train.bin', dtype=np.uint16)
        ids[7] = 60000
        ids.tofile(bad / 'tiny' / 'train.bin')
    else:
        with open(bad / 'tiny' / 'train.bin', 'r+b') as f:
            f.truncate(64)
    before = files(bad)
    assert main(bad, tmp_path / 'o') == 2
    line = error(capsys)
    assert 'prepare_data.py --input' in line and f'--data_dir {bad}' in line and '--name tiny' in line, line
    assert files(bad) == before and not (tmp_path / 'o').exists()


def test_export_refuses_bad_shapes_and_paths_it_did_not_make(tmp_path, capsys):
    model = ['--n_layer', '1', '--n_head', '1', '--n_embd', '8', '--block_size', '8', '--vocab_size', '50']
    mine = tmp_path / 'notes.txt'
    mine.write_text('mine')
    folder = tmp_path / 'folder'
    folder.mkdir()
    (folder / 'keep').write_text('mine too')
    before = files(tmp_path)
    for flags, words in ((['--ane_batch_size', '-1'], '--ane_batch_size'), (['--block_size', '-3'], 'at least 1'),
                         (['--out', str(mine)], 'refusing to overwrite'), (['--out', str(folder)], 'refusing')):
        out = [] if '--out' in flags else ['--out', str(tmp_path / 'new.mlpackage')]
        assert export_ane.main(model + flags + out) == 2
        err = capsys.readouterr().err
        assert words in err and 'Traceback' not in err, err
    assert files(tmp_path) == before  # no package, no temporary one



@pytest.fixture
def run_dir(finished_run, tmp_path):
    """A copy of finished_run, for a test to try things on."""
    return shutil.copytree(finished_run, tmp_path / 'run')


def test_a_second_run_never_replaces_the_first(data_dir, run_dir, capsys):
    before = files(run_dir)
    assert main(data_dir, run_dir, '--max_iters', '10') == 2
    line = error(capsys)
    assert '--resume' in line and '--out_dir' in line and '--overwrite' in line
    assert files(run_dir) == before
    # --overwrite starts over: the old checkpoints and rows are gone, not mixed in
    assert main(data_dir, run_dir, '--max_iters', '5', '--overwrite') == 0
    rows = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
    assert [r['step'] for r in rows] == [5] and not (run_dir / 'ckpt.prev.pt').exists()
    assert torch.load(run_dir / 'ckpt.pt', weights_only=True)['iter_num'] == 5


def test_the_checkpoint_before_is_kept(run_dir):
    assert torch.load(run_dir / 'ckpt.pt', weights_only=True)['iter_num'] == 10
    assert torch.load(run_dir / 'ckpt.prev.pt', weights_only=True)['iter_num'] == 5
    assert not [f for f in os.listdir(run_dir) if f.endswith('.tmp')]


@pytest.mark.parametrize('damage', ['truncated', 'empty', 'random bytes', 'foreign dict', 'a tensor', 'other model'])
def test_a_broken_checkpoint_is_one_clear_line(data_dir, run_dir, capsys, damage):
    ck = run_dir / 'ckpt.pt'
    if damage == 'truncated':
        ck.write_bytes(ck.read_bytes()[:1000])
    elif damage == 'empty':
        ck.write_bytes(b'')
    elif damage == 'random bytes':
        ck.write_bytes(np.random.default_rng(0).bytes(4096))
    elif damage == 'foreign dict':
        torch.save({'model': {}, 'iter_num': 3}, ck)
    elif damage == 'a tensor':
        torch.save(torch.zeros(3), ck)
    if damage != 'other model':
        os.remove(run_dir / 'ckpt.prev.pt')
    before = files(run_dir)
    flags = ['--n_embd', '32'] if damage == 'other model' else []
    assert main(data_dir, run_dir, '--max_iters', '20', '--resume', *flags) == 2
    line = error(capsys)
    assert str(ck) in line and ('--overwrite' in line or 'flags of its model' in line), line
    assert files(run_dir) == before


def test_a_broken_checkpoint_resumes_from_the_one_before(data_dir, run_dir, capsys):
    # ckpt.pt damaged, ckpt.prev.pt fine: the run says so in one line and continues from step 5;
    # the damaged file is kept under another name, ckpt.prev.pt is not replaced by it
    (run_dir / 'ckpt.pt').write_bytes(b'\0' * 100)
    assert main(data_dir, run_dir, '--max_iters', '10', '--resume') == 0
    said = [line for line in capsys.readouterr().out.splitlines() if 'unusable' in line]
    assert len(said) == 1 and 'ckpt.prev.pt (step 5) instead' in said[0]
    assert (run_dir / 'ckpt.unusable.pt').read_bytes() == b'\0' * 100
    assert torch.load(run_dir / 'ckpt.pt', weights_only=True)['iter_num'] == 10
    assert torch.load(run_dir / 'ckpt.prev.pt', weights_only=True)['iter_num'] == 5


def test_resume_drops_the_rows_past_its_checkpoint(data_dir, run_dir, capsys):
    # killed after logging step 15 (and half a row) but before its checkpoint: the resumed
    # run logs steps 15 and 20 once each; and --ane_fraction given wins over the checkpoint's
    with open(run_dir / 'metrics.jsonl', 'a') as f:
        f.write(json.dumps({'step': 15, 'loss': 1.0}) + '\n{"step": 1')
    assert main(data_dir, run_dir, '--max_iters', '15', '--resume', '--mode', 'hetero', '--ane_fraction', '1',
                '--ane_dtype', 'float32') == 0
    assert '--ane_fraction 1 given' in capsys.readouterr().out
    rows = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
    assert [r['step'] for r in rows] == [5, 10, 15] and rows[2]['loss'] != 1.0
    assert rows[-1]['ane_microbatches'] == 2


def test_a_bad_batch_is_an_input_error_not_an_engine_fault():
    cfg = hg.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=4)
    model, cpu = hg.GPT(cfg), torch.device('cpu')
    engines = {'gpu': hg.AutogradEngine(model, cpu, torch.float32),
               'ane': hg.EagerEngine(cfg, cpu, torch.float32, hg.LossScaler(1.0, 0, enabled=False))}
    step = hg.HeteroStep(model, engines, hg.Split(2, 0.5))
    good = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    for bad in ((torch.full((1, 8), 16), good[1]), (good[0], torch.full((1, 8), -1)), (good[0], good[1][:, :4]),
                (torch.full((1, 8), float('nan')), good[1])):  # (NaN passes any comparison of bounds)
        with pytest.raises(hg.UserError, match='no valid input'):
            hg.check_microbatches(cfg, [good, bad])  # where step_batches makes them
        assert step.alive == {'gpu', 'ane'} and step.dropped == {'gpu': 0, 'ane': 0}
    assert step([good, good]).used == ['ane', 'gpu']


def test_a_bad_batch_in_training_stops_with_the_checkpoint_kept(data_dir, run_dir, capsys, monkeypatch):
    # from step 12 on, the batches made hold token ids below 0
    real_batches, real_batch = hg.step_batches, hg.get_batch
    bad = {'now': False}

    def batches(cfg, data, it):
        bad['now'] = it >= 12
        return real_batches(cfg, data, it)

    def batch(*a):
        x, y = real_batch(*a)
        return (x.clamp_max(0) - 1, y) if bad['now'] else (x, y)
    monkeypatch.setattr(hg, 'step_batches', batches)
    monkeypatch.setattr(hg, 'get_batch', batch)
    before = files(run_dir)
    assert main(data_dir, run_dir, '--max_iters', '20', '--resume', '--eval_interval', '100') == 2
    assert 'no valid input' in error(capsys)
    assert files(run_dir) == before  # (the rows of steps 11 to 19 were never logged)


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(data_dir, run_dir, capsys):
    # fp16 with a learning rate of 10: every step overflows, the loss scale halves to its
    # floor (8, 4, 2, 1); the run stops after max_bad_steps and writes no checkpoint of
    # that state (a checkpoint was due at step 15)
    before = files(run_dir)
    code = main(data_dir, run_dir, '--max_iters', '40', '--resume', '--mode', 'ane', '--learning_rate', '10',
                '--warmup_iters', '0', '--ane_loss_scale', '8', '--max_bad_steps', '5')
    assert code == 2
    line = error(capsys)
    assert '5 steps in a row' in line and 'learning_rate 10' in line and 'loss scale' in line, line
    assert files(run_dir)['ckpt.pt'] == before['ckpt.pt'] and files(run_dir)['ckpt.prev.pt'] == before['ckpt.prev.pt']


def test_no_checkpoint_after_a_dropped_step_but_the_last(data_dir, tmp_path, monkeypatch):
    # steps 5 and 10 of 10 (both due a checkpoint) have no usable gradient: step 5 writes
    # none (its state may be on its way to diverging), the run's last step does
    calls, real = [], hg.AutogradEngine.loss_and_grads

    def every_fifth_nan(self, idx, targets):  # two calls a step (gpu mode): every fifth step's second, NaN
        calls.append(1)
        loss, grads = real(self, idx, targets)
        if len(calls) % 10 == 0:
            grads['transformer.wte.weight'][0, 0] = float('nan')
        return loss, grads
    monkeypatch.setattr(hg.AutogradEngine, 'loss_and_grads', every_fifth_nan)
    assert main(data_dir, tmp_path / 'o', '--max_iters', '10', '--mode', 'gpu') == 0
    assert len(calls) == 20 and not (tmp_path / 'o' / 'ckpt.prev.pt').exists()
    assert torch.load(tmp_path / 'o' / 'ckpt.pt', weights_only=True)['iter_num'] == 10
