"""ckpt.pt is there and loads at every moment of a save, even if the process is killed; --resume
falls back to ckpt.prev.pt; best.pt keeps the lowest validation loss; --patience stops a run."""
import json
import os
import shutil
import signal
import time

import pytest
import torch

import hetero_gpt as hg
import helpers
from plumbing import checkpoints

BASE = ['--dataset', 'tiny', '--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '16',
        '--batch_size', '2', '--gradient_accumulation_steps', '2', '--eval_iters', '1', '--log_interval', '1',
        '--quiet', '--sample_tokens', '0', '--mode', 'hetero', '--ane_worker', 'false',
        '--ane_fraction', '0.5']  # (a fixed split: an auto one follows timings, so two runs' rows could differ)


def ckpt(step):
    """A small object with every key a checkpoint has; its step is in iter_num."""
    return {k: torch.full((4096,), float(step)) if k == 'model' else step for k in checkpoints.CKPT_KEYS}


def steps(d, names=('ckpt.pt', 'ckpt.prev.pt')):
    """iter_num of each of these run files in folder d (None: missing or unusable)."""
    out = {}
    for name in names:
        try:
            out[name] = checkpoints.read_checkpoint(str(d / name), 'cpu')['iter_num']
        except ValueError:
            out[name] = None
    return out


def save_killed_at(k, path, obj, links=True, best=False):
    """save_checkpoint in a forked child that SIGKILLs itself at its k-th file operation (a
    torch.save is killed halfway through its bytes). (True if it was killed before finishing,
    the operations it began: a line each in path + '.ops', 'fsync new' for the new file's.)"""
    log = path + '.ops'
    pid = os.fork()
    if pid == 0:
        calls, real_fsync = [0], os.fsync

        def point(op, *a):
            new = op == 'fsync' and os.path.exists(path + '.tmp') and os.fstat(a[0]).st_ino == os.stat(path + '.tmp').st_ino
            size = [str(os.fstat(a[0]).st_size)] if new else []  # the bytes the OS has: what fsync makes durable
            with open(log, 'a') as f:
                f.write(' '.join([op] + ['new'] * new + size + [os.path.basename(str(x)) for x in a if op != 'fsync']) + '\n')
            calls[0] += 1
            if calls[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)

        def hooked(name, fn):
            return lambda *a, **kw: (point(name, *a), fn(*a, **kw))[1]
        real_save = torch.save

        def half_save(o, f):
            if calls[0] + 1 == k:
                real_save(o, f)
                f.truncate(f.tell() // 2)
                f.flush()
            point('save')
            real_save(o, f)

        def no_link(*a):
            point('link', *a)
            raise OSError(1, 'Operation not permitted')
        for name in ('replace', 'remove', 'fsync'):
            setattr(os, name, hooked(name, getattr(os, name)))
        os.link = hooked('link', os.link) if links else no_link
        torch.save = half_save
        try:
            checkpoints.save_checkpoint(path, obj, best)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status), open(log).read().splitlines()


@pytest.mark.parametrize('best', [False, True], ids=['last', 'best'])
@pytest.mark.parametrize('links', [True, False], ids=['hard links', 'copies'])
def test_ckpt_is_there_and_loads_at_every_point_of_a_save(tmp_path, links, best):
    # killed at each file operation of a save in turn (however many it makes), until one finishes
    first = tmp_path / 'first'
    first.mkdir()
    for s in (1, 2):
        checkpoints.save_checkpoint(str(first / 'ckpt.pt'), ckpt(s), best=s == 1)
    every = ('ckpt.pt', 'ckpt.prev.pt', 'best.pt')
    assert steps(first, every) == {'ckpt.pt': 2, 'ckpt.prev.pt': 1, 'best.pt': 1}
    k, states = 0, []
    while True:
        k += 1
        d = tmp_path / f'k{k}'
        shutil.copytree(first, d)
        killed, ops = save_killed_at(k, str(d / 'ckpt.pt'), ckpt(3), links, best)
        s = steps(d, every)
        # best.pt: the old best, or (best) already the new one; whole, never missing
        assert s.pop('best.pt') in ((1, 3) if best else (1,)), (k, s)
        # at every point: ckpt.pt is the old or the new one, never missing or half written;
        # ckpt.prev.pt is the older one, or already a second name of ckpt.pt's file
        assert s['ckpt.pt'] in (2, 3) and s['ckpt.prev.pt'] in (1, 2) and s['ckpt.prev.pt'] <= s['ckpt.pt'], (k, s)
        checkpoints.save_checkpoint(str(d / 'ckpt.pt'), ckpt(4))  # the next save clears what the killed one left
        assert steps(d)['ckpt.pt'] == 4 and steps(d)['ckpt.prev.pt'] in (2, 3)
        if not killed:
            assert s == {'ckpt.pt': 3, 'ckpt.prev.pt': 2} and steps(d, every)['best.pt'] == (3 if best else 1)
            break
        states.append(s['ckpt.pt'])
        assert k < 100, 'the save never finished'
    # the old checkpoint up to one point (killed in the write, at least), the new one after it,
    # never back; and the new file reached the disk (fsync) before it took the name ckpt.pt
    assert states[0] == 2 and states == sorted(states), states
    synced = next(i for i, op in enumerate(ops) if op.startswith('fsync new '))
    assert synced < ops.index('replace ckpt.pt.tmp ckpt.pt'), ops
    # fsync found the whole file with the OS, none of it left in Python's buffer
    assert int(ops[synced].split()[2]) == os.path.getsize(d / 'ckpt.prev.pt'), ops  # (step 3's, now prev)


def run(data_dir, out, *flags):
    hg.main(BASE + ['--data_dir', data_dir, '--out_dir', str(out), *flags])
    return [json.loads(line) for line in open(out / 'metrics.jsonl')]


class ClockMeter:
    """An energy meter that measures as NVML does on a GPU: joules no two runs share."""
    name, missing, meters = 'clock', [], [1]

    def __init__(self, devices):
        pass

    def joules(self):
        return time.perf_counter()

    def close(self):
        pass


@pytest.mark.parametrize('damage', ['missing', 'truncated'])
def test_resume_falls_back_to_prev_and_keeps_the_unusable_file(data_dir, tmp_path, capsys, monkeypatch, damage):
    monkeypatch.setattr(hg.energy, 'EnergyMeter', ClockMeter)  # (rows with joules_per_token, as on CUDA)
    whole = run(data_dir, tmp_path / 'whole', '--max_iters', '6', '--eval_interval', '2')
    out = tmp_path / 'out'
    run(data_dir, out, '--max_iters', '4', '--eval_interval', '2')
    assert steps(out) == {'ckpt.pt': 4, 'ckpt.prev.pt': 2}
    if damage == 'missing':
        os.remove(out / 'ckpt.pt')
    else:
        with open(out / 'ckpt.pt', 'r+b') as f:
            f.truncate(1000)
    damaged = None if damage == 'missing' else (out / 'ckpt.pt').read_bytes()
    capsys.readouterr()
    rows = run(data_dir, out, '--max_iters', '6', '--eval_interval', '2', '--resume')
    said = capsys.readouterr().out
    assert "is unusable" in said and "ckpt.prev.pt (step 2) instead" in said
    assert ("kept as ckpt.unusable.pt" in said) == (damage == 'truncated')
    assert helpers.state(rows) == helpers.state(whole)  # continued exactly from step 2 (measurements aside)
    assert steps(out) == {'ckpt.pt': 6, 'ckpt.prev.pt': 4}
    if damaged is not None:  # not deleted: kept under another name by the first save
        assert (out / 'ckpt.unusable.pt').read_bytes() == damaged


def test_resume_with_neither_checkpoint_usable_is_one_line(data_dir, tmp_path, capsys):
    out = tmp_path / 'out'
    run(data_dir, out, '--max_iters', '2', '--eval_interval', '2')
    for name in ('ckpt.pt', 'ckpt.prev.pt'):
        (out / name).write_bytes(b'not a checkpoint')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as e:
        run(data_dir, out, '--max_iters', '4', '--resume')
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and 'start over with --overwrite' in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing changed


class ScriptedValidation:
    """evaluate() returning the given losses in turn: the curve the test needs."""

    def __init__(self, monkeypatch, losses):
        self.losses = list(losses)
        monkeypatch.setattr(hg, 'evaluate', lambda *a: self.losses.pop(0))


def test_best_checkpoint_and_patience(data_dir, tmp_path, monkeypatch, capsys, ctrl_c):
    curve = [5.0, 4.0, 4.5, 3.9, 4.1, 4.2, 3.0]  # evaluations at steps 2, 4, ..., 14; best at 8
    ScriptedValidation(monkeypatch, curve)
    out = tmp_path / 'out'
    rows = run(data_dir, out, '--max_iters', '20', '--eval_interval', '2', '--patience', '2')
    assert [r['val_loss'] for r in rows if 'val_loss' in r] == curve[:6]  # stopped after 4.1, 4.2
    assert rows[-1]['step'] == 12 and steps(out)['ckpt.pt'] == 12
    best = checkpoints.read_checkpoint(str(out / 'best.pt'), 'cpu')
    assert best['iter_num'] == 8 and best['best_val_loss'] == 3.9
    said = capsys.readouterr().out
    assert 'step 12: stopped early, 2 evaluations without a lower validation loss (--patience)' in said
    run(data_dir, out, '--max_iters', '20', '--eval_interval', '2', '--patience', '2', '--resume')
    assert 'step 12, 2 evaluations past the best (--max_iters 20, --patience 2): no steps to train' in capsys.readouterr().out

    # interrupted at step 7 and resumed: the same stop, the same best
    ScriptedValidation(monkeypatch, curve[:3])
    ctrl_c.at(7)
    with pytest.raises(SystemExit) as stopped:  # Ctrl-C: saved, then exit code 130
        run(data_dir, tmp_path / 'again', '--max_iters', '20', '--eval_interval', '2', '--patience', '2')
    assert stopped.value.code == 130
    ctrl_c.off()
    ScriptedValidation(monkeypatch, curve[3:])
    rows = run(data_dir, tmp_path / 'again', '--max_iters', '20', '--eval_interval', '2', '--patience', '2', '--resume')
    assert rows[-1]['step'] == 12 and checkpoints.read_checkpoint(str(tmp_path / 'again' / 'best.pt'), 'cpu')[
        'iter_num'] == 8
