"""
Bad input, tried as a new user would: bad flags, broken data, broken checkpoints,
interrupted runs and misplaced outputs, each case its own process on a tiny configuration
(CPU) in a folder of its own, one slow test a case.

    python -m pytest -q -m slow tests/test_bad_input_cases.py [-k WORD]

A case is clean when it exits non-zero with one `error:` line and no traceback, or exits
0 where the input is legitimately fine (a setting that does not apply, a resume); and, in
either case, every file that was there before is byte for byte as it was (except those
the case is meant to change: a resumed run's checkpoint and metrics). Takes a few minutes;
the fast per-kind checks are tests/test_bad_input.py.
"""
import contextlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest

from test_bad_input import files  # {path: sha256} of every file in a folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--dataset', 'tiny', '--data_dir', 'data', '--out_dir', 'out', '--max_iters', '10', '--n_layer', '1',
        '--n_head', '2', '--n_embd', '16', '--block_size', '16', '--batch_size', '2',
        '--gradient_accumulation_steps', '2', '--warmup_iters', '2', '--eval_iters', '1', '--sample_tokens', '0',
        '--quiet', '--device', 'cpu', '--log_interval', '5', '--eval_interval', '5']
ERROR_LINE = re.compile(r'^(\S+: )?error: ')  # ours, argparse's ("prog: error: ...") and prepare_data.py's


# runs the command after it, and presses Ctrl-C (SIGINT) once it has logged its first row
CTRL_C = """
import signal, subprocess, sys
p = subprocess.Popen([sys.executable] + sys.argv[1:], stdout=subprocess.PIPE, text=True)
for line in p.stdout:
    print(line, end='')
    if line.startswith('step '):
        p.send_signal(signal.SIGINT)
        break
print(p.communicate()[0], end='')
sys.exit(p.returncode)
"""


def python(*args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def train(*flags):
    return [os.path.join(ROOT, 'hetero_gpt.py'), *TINY, *flags]


def export(*flags):
    return [os.path.join(ROOT, 'export_ane.py'), '--n_layer', '1', '--n_head', '1', '--n_embd', '8',
            '--block_size', '8', '--vocab_size', '50', *flags]


def prepare(*flags):
    return [os.path.join(ROOT, 'prepare_data.py'), *flags]


# ---- what a case sets up in its folder (which already holds data/ and, with run=True, out/)

def write(path, data):
    def setup(d):
        os.makedirs(os.path.dirname(os.path.join(d, path)) or d, exist_ok=True)
        with open(os.path.join(d, path), 'wb') as f:
            f.write(data if isinstance(data, bytes) else data.encode())
    return setup


def truncate(path, size):
    def setup(d):
        with open(os.path.join(d, path), 'r+b') as f:
            f.truncate(size)
    return setup


def remove(*paths):
    def setup(d):
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(d, p))
    return setup


def both(*setups):
    def setup(d):
        for s in setups:
            s(d)
    return setup


def torch_save(path, make):
    def setup(d):
        python('-c', f"import torch; torch.save({make}, {os.path.join(d, path)!r})", cwd=d)
    return setup


def token_past_vocab(d):
    path = os.path.join(d, 'data', 'tiny', 'train.bin')
    with open(path, 'r+b') as f:
        f.seek(14)
        f.write((60000).to_bytes(2, 'little'))


class Evil:  # a pickle that runs a command when loaded: it must never run
    def __reduce__(self):
        return (os.system, ('touch PWNED',))


def evil_checkpoint(d):
    with open(os.path.join(d, 'out', 'ckpt.pt'), 'wb') as f:
        pickle.dump(Evil(), f)
    remove('out/ckpt.prev.pt')(d)


def rows_past_checkpoint(d):
    with open(os.path.join(d, 'out', 'metrics.jsonl'), 'a') as f:
        f.write(json.dumps({'step': 15, 'loss': 1.0}) + '\n{"step": 2')


def export_package(d):
    python(*export('--ane_batch_size', '2', '--out', 'pkg'), cwd=d)


def half_written_programs(d):  # as a crash during a copy would leave them: one program missing
    python(os.path.join(ROOT, 'export_ane.py'), '--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size',
           '16', '--ane_batch_size', '2', '--out', 'pkg', cwd=d)  # TINY's model, GPT-2's vocabulary
    shutil.rmtree(os.path.join(d, 'pkg', 'head.mlpackage'))


# ---- checks on what an exit-0 case did

def steps_once(d, p):
    try:
        steps = [json.loads(line)['step'] for line in open(os.path.join(d, 'out', 'metrics.jsonl'))]
    except (ValueError, KeyError) as e:
        return f"metrics.jsonl has a broken row ({e})"
    return '' if steps == sorted(set(steps)) else f"metrics steps {steps}"


def says(word):
    return lambda d, p: '' if word in p.stdout + p.stderr else f"does not say {word!r}"


def never_ran(d, p):
    return 'the pickle ran code' if os.path.exists(os.path.join(d, 'PWNED')) else ''


RESUMED = ('out/ckpt.pt', 'out/ckpt.prev.pt', 'out/best.pt', 'out/metrics.jsonl')  # what a resumed run may rewrite

# (name, command, 'error', 'ok' or 'interrupted', setup, needs the finished run in out/, files it may change, check)
CASES = [
    # bad flags
    ('negative learning rate', train('--learning_rate', '-1'), 'error'),
    ('negative min_lr', train('--min_lr', '-0.5'), 'error'),
    ('beta1 = 1', train('--beta1', '1'), 'error'),
    ('negative beta2', train('--beta2', '-0.1'), 'error'),
    ('negative weight decay', train('--weight_decay', '-1'), 'error'),
    ('negative grad_clip', train('--grad_clip', '-1'), 'error'),
    ('eval_interval 0', train('--eval_interval', '0'), 'error'),
    ('log_interval 0', train('--log_interval', '0'), 'error'),
    ('max_iters -1', train('--max_iters', '-1'), 'error'),
    ('max_iters 0', train('--max_iters', '0'), 'ok', None, False, (), says('no steps to train')),
    ('eval_iters -3', train('--eval_iters', '-3'), 'error'),
    ('negative warmup', train('--warmup_iters', '-1'), 'error'),
    ('loss_scale 0', train('--loss_scale', '0'), 'error'),
    ('scale_window 0', train('--scale_window', '0'), 'error'),
    ('negative sample_tokens', train('--sample_tokens', '-1'), 'error'),
    ('negative seed', train('--seed', '-1'), 'error'),
    ('negative max_bad_steps', train('--max_bad_steps', '-1'), 'error'),
    ('batch_size 0', train('--batch_size', '0'), 'error'),
    ('gradient_accumulation_steps 0', train('--gradient_accumulation_steps', '0'), 'error'),
    ('learning rate nan', train('--learning_rate', 'nan'), 'error'),
    ('learning rate inf', train('--learning_rate', 'inf'), 'error'),
    ('n_embd not divisible by n_head', train('--n_embd', '30', '--n_head', '4'), 'error'),
    ('n_layer 0', train('--n_layer', '0'), 'error'),
    ('block_size past the data', train('--block_size', '100000'), 'error'),
    ('vocab smaller than the data', train('--vocab_size', '100'), 'error'),
    ('unknown dtype', train('--dtype', 'half'), 'error'),
    ('unknown ane_dtype', train('--ane_dtype', 'float17', '--mode', 'ane'), 'error'),
    ('unknown ane_dtype, gpu mode', train('--ane_dtype', 'float17', '--mode', 'gpu'), 'error'),
    ('unknown device', train('--device', 'tpu'), 'error'),
    ('device cuda:7', train('--device', 'cuda:7'), 'error'),
    ('ane_device cuda:7', train('--ane_device', 'cuda:7', '--mode', 'hetero'), 'error'),
    ('unknown mode', train('--mode', 'tpu'), 'error'),
    ('ane_fraction 1.5', train('--ane_fraction', '1.5'), 'error'),
    ('ane_fraction abc', train('--ane_fraction', 'abc'), 'error'),
    ('max_iters abc', train('--max_iters', 'abc'), 'error'),
    ('unknown flag', train('--no_such_flag', '1'), 'error'),
    ('bool flag value', train('--quiet', 'maybe'), 'error'),
    ('--resume and --overwrite', train('--resume', '--overwrite'), 'error'),
    ('settings that do not apply', train('--mode', 'gpu', '--max_iters', '2', '--ane_programs', 'x',
                                         '--ane_fraction', '0.5', '--loss_scale', '8'), 'ok', None, False, (),
     says('not used')),
    # misplaced outputs
    ('out_dir is a file', train('--out_dir', 'notes.txt'), 'error', write('notes.txt', 'mine')),
    ('out_dir under a file', train('--out_dir', 'notes.txt/run'), 'error', write('notes.txt', 'mine')),
    ('second run into a finished run', train('--max_iters', '10'), 'error', None, True),
    ('out_dir empty: the current folder', train('--out_dir', '', '--max_iters', '2'), 'ok'),
    ('data_dir is a file', train('--data_dir', 'notes.txt'), 'error', write('notes.txt', 'mine')),
    ('second run with --overwrite', train('--max_iters', '5', '--overwrite'), 'ok', None, True, RESUMED),
    ('only metrics.jsonl, no --resume', train('--max_iters', '5'), 'error', remove('out/ckpt.pt', 'out/ckpt.prev.pt'),
     True),
    ('ane_batch_size not dividing batch_size', train('--mode', 'ane', '--ane_batch_size', '3'), 'error'),
    ('ane_evaluator unknown', train('--mode', 'ane', '--ane_evaluator', 'coreml'), 'error'),
    ('ane_load_timeout 0', train('--mode', 'ane', '--ane_load_timeout', '0'), 'error'),
    ('ANE programs missing one', train('--mode', 'ane', '--ane_evaluator', 'numpy', '--ane_programs', 'pkg'), 'error',
     half_written_programs, False, (), says('lacks head')),
    ('export: negative ane_batch_size', export('--ane_batch_size', '-1', '--out', 'a'), 'error'),
    ('export: negative block_size', export('--block_size', '-3', '--out', 'a'), 'error'),
    ('export: too many tokens', export('--ane_batch_size', '4000', '--out', 'a'), 'error'),
    ('export: n_embd not divisible', export('--n_embd', '30', '--n_head', '4', '--out', 'a'), 'error'),
    ('export: --out is a file', export('--out', 'notes.txt'), 'error', write('notes.txt', 'mine')),
    ('export: --out is a folder of files', export('--out', 'mine'), 'error', write('mine/keep.txt', 'mine')),
    ('export: --out in a new folder', export('--out', 'new/sub/a'), 'ok'),
    ('export: over its own package', export('--ane_batch_size', '3', '--out', 'pkg'), 'ok', export_package,
     False, ('pkg',)),
    # broken data
    ('no such data set', train('--dataset', 'nonesuch'), 'error'),
    ('data set folder without meta.json', train(), 'error', remove('data/tiny/meta.json')),
    ('meta.json not JSON', train(), 'error', write('data/tiny/meta.json', '{not json')),
    ('meta.json a list', train(), 'error', write('data/tiny/meta.json', '[1, 2]')),
    ('meta.json empty', train(), 'error', write('data/tiny/meta.json', '')),
    ('train.bin truncated', train(), 'error', truncate('data/tiny/train.bin', 100)),
    ('train.bin odd size', train(), 'error', truncate('data/tiny/train.bin', 101)),
    ('val.bin missing', train(), 'error', remove('data/tiny/val.bin')),
    ('token id past the vocabulary', train(), 'error', token_past_vocab),
    ('prepare: missing input', prepare('--input', 'nothing.txt'), 'error'),
    ('prepare: empty input', prepare('--input', 'empty.txt'), 'error', write('empty.txt', '')),
    ('prepare: not UTF-8', prepare('--input', 'latin.txt'), 'error', write('latin.txt', b'caf\xe9 ' * 100)),
    ('prepare: unknown set', prepare('nonesuch'), 'error'),
    # broken checkpoints
    ('resume without a checkpoint', train('--resume'), 'error'),
    ('resume: truncated checkpoint', train('--resume', '--max_iters', '20'), 'error',
     both(truncate('out/ckpt.pt', 1000), remove('out/ckpt.prev.pt')), True),
    ('resume: empty checkpoint', train('--resume', '--max_iters', '20'), 'error',
     both(write('out/ckpt.pt', b''), remove('out/ckpt.prev.pt')), True),
    ('resume: random bytes', train('--resume', '--max_iters', '20'), 'error',
     both(write('out/ckpt.pt', os.urandom(4096)), remove('out/ckpt.prev.pt')), True),
    ('resume: a dict of other things', train('--resume', '--max_iters', '20'), 'error',
     both(torch_save('out/ckpt.pt', "{'model': {}, 'iter_num': 3}"), remove('out/ckpt.prev.pt')), True),
    ('resume: a bare state dict', train('--resume', '--max_iters', '20'), 'error',
     both(torch_save('out/ckpt.pt', "torch.load('out/ckpt.pt')['model']"), remove('out/ckpt.prev.pt')), True),
    ('resume: a tensor', train('--resume', '--max_iters', '20'), 'error',
     both(torch_save('out/ckpt.pt', 'torch.zeros(3)'), remove('out/ckpt.prev.pt')), True),
    ('resume: a pickle that runs code', train('--resume', '--max_iters', '20'), 'error', evil_checkpoint, True, (),
     never_ran),
    ('resume: other model sizes', train('--resume', '--max_iters', '20', '--n_embd', '32'), 'error', None, True),
    ('resume: damaged, previous fine', train('--resume', '--max_iters', '20'), 'ok',
     truncate('out/ckpt.pt', 1000), True, RESUMED, says('ckpt.prev.pt (step 5) instead')),
    ('resume: ckpt.pt gone, previous there', train('--resume', '--max_iters', '20'), 'ok',
     remove('out/ckpt.pt'), True, RESUMED, says('ckpt.prev.pt (step 5) instead')),
    # interrupted runs
    ('resume after a kill mid-save', train('--resume', '--max_iters', '15'), 'ok',
     write('out/ckpt.pt.tmp', b'\0' * 999), True, RESUMED + ('out/ckpt.pt.tmp',), steps_once),
    ('Ctrl-C mid-run', ['-c', CTRL_C, *train('--max_iters', '100000')], 'interrupted', None, False, (),
     says('interrupted')),
    ('Ctrl-C mid-run, then resumed', ['-c', CTRL_C, *train('--max_iters', '100000', '--resume')], 'interrupted', None,
     True,
     RESUMED, steps_once),
    ('resume after rows past the checkpoint', train('--resume', '--max_iters', '15'), 'ok', rows_past_checkpoint, True,
     RESUMED, steps_once),
    ('resume past max_iters', train('--resume', '--max_iters', '5'), 'ok', None, True, RESUMED,
     says('no steps to train')),
    ('resume with --ane_fraction given', train('--resume', '--max_iters', '15', '--mode', 'hetero',
                                               '--ane_fraction', '1', '--ane_dtype', 'float32'), 'ok', None, True,
     RESUMED, says('--ane_fraction 1 given')),
    ('diverging fp16 run', train('--resume', '--max_iters', '40', '--mode', 'ane', '--learning_rate', '10',
                                 '--warmup_iters', '0', '--loss_scale', '8', '--max_bad_steps', '5'), 'error', None,
     True, ('out/metrics.jsonl',)),
    ('diverging fp32 run from the start', train('--max_iters', '40', '--learning_rate', '1000', '--warmup_iters', '0'),
     'error'),
]


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    """A folder with the tiny data set prepared, and a copy of it with a finished 10-step run."""
    root = str(tmp_path_factory.mktemp('bad_input'))
    lines = [f"The {w} of the {v} is {n} and the {v} is {w}." for n in range(40)
             for w, v in (('king', 'crown'), ('queen', 'court'), ('fool', 'jest'))]
    with open(os.path.join(root, 'tiny.txt'), 'w') as f:
        f.write('\n'.join(lines * 3) + '\n')
    base = os.path.join(root, 'base')
    r = python(*prepare('--input', os.path.join(root, 'tiny.txt'), '--data_dir', os.path.join(base, 'data')), cwd=root)
    assert r.returncode == 0, r.stderr
    finished = os.path.join(root, 'finished')
    shutil.copytree(base, finished)
    r = python(*train('--max_iters', '10'), cwd=finished)
    assert r.returncode == 0, r.stderr
    return base, finished


@pytest.mark.slow
@pytest.mark.parametrize('case', CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_loses_nothing(case, folders, tmp_path):
    name, cmd, want, *rest = case
    setup, with_run, may_change, check = (rest + [None, False, (), None][len(rest):])
    d = str(tmp_path / 'case')
    shutil.copytree(folders[1] if with_run else folders[0], d)
    if setup:
        setup(d)
    before = files(d)
    r = python(*cmd, cwd=d)
    after = files(d)
    said = f"exit {r.returncode}; stderr: {r.stderr[-3000:]}"
    assert 'Traceback' not in r.stderr, said
    lost = [f for f in before if after.get(f) != before[f] and not any(f == m or f.startswith(m + '/')
                                                                     for m in may_change)]
    assert not lost, f"changed: {lost}; {said}"
    if want in ('ok', 'interrupted'):  # Ctrl-C: 130, as shells expect after SIGINT
        assert r.returncode == (130 if want == 'interrupted' else 0), said
    else:
        err_lines = [line for line in r.stderr.splitlines() if ERROR_LINE.match(line)]
        assert r.returncode != 0 and len(err_lines) == 1, said
        assert name == 'unknown flag' or 'unrecognized arguments' not in r.stderr, f"a flag it needs is gone; {said}"
    problem = check(d, r) if check else ''
    assert not problem, f"{problem}; {said}"
