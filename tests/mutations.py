"""Mutation check of the default test run: each mutation below is one exact text replacement,
applied to a clean temporary copy of this tree (tracked and untracked files, not ignored ones),
then the test files that target it run there; a mutation is caught when they fail.

    python3 tests/mutations.py            # every row, each with its tests (tests/README.md)
    python3 tests/mutations.py --full     # every row, each with the whole default run
    python3 tests/mutations.py O1batch    # some rows, by id

First the same selections run on the unchanged copy: they must pass, or nothing is reported.
Exit code 0 when every mutation is caught, 1 when one survives, 2 when a text is not found
exactly once (the code moved: update the row)."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPDATE = 'tests/test_update.py'

# (id, what it breaks, file, old text, new text, the tests that target it)
MUTATIONS = [
    ('O1batch', "every step trains on step 0's batch", 'hetero_gpt.py',
     'np.random.default_rng((cfg.seed, it)))', 'np.random.default_rng((cfg.seed, 0)))', [UPDATE]),
    ('OPTwd', "--weight_decay ignored (0.0)", 'hetero_gpt.py',
     "{'params': decay, 'weight_decay': cfg.weight_decay}",
     "{'params': decay, 'weight_decay': 0.0}",
     [UPDATE]),
    ('OPTbeta2', "--beta2 ignored (0.999)", 'hetero_gpt.py',
     'betas=(cfg.beta1, cfg.beta2)', 'betas=(cfg.beta1, 0.999)', [UPDATE]),
    ('OPTclip', "--grad_clip ignored (no clipping)", 'hetero_gpt.py',
     'step.update(result, cfg.grad_clip)', 'step.update(result)', [UPDATE]),
    ('OPTclip1', "--grad_clip fixed at 1.0", 'hetero_gpt.py',
     'step.update(result, cfg.grad_clip)', 'step.update(result, 1.0)', [UPDATE]),
    ('O5eval', "validation batches averaged without their sizes", 'hetero_gpt.py',
     '        total += loss.float() * x.numel()\n        count += x.numel()\n',
     '        total += loss.float()\n        count += 1\n', [UPDATE]),
    ('O6b', "the loop's same-weights check never runs", 'hetero_gpt.py',
     '                distributed.check_same_weights(model, prog.it)\n',
     '                distributed.check_same_weights(model, prog.it) if prog.it < 0 else None\n',
     ['tests/test_distributed.py']),
    ('SCcoreml', "one gradient x1.001 in the Core ML engine only", 'hetero_gpt.py',
     '        return torch.tensor(loss / calls), grads\n',
     "        grads['transformer.h.0.mlp.c_fc.weight'].mul_(1.001)\n"
     '        return torch.tensor(loss / calls), grads\n', ['tests/test_coreml.py']),
]


def clean_copy():
    """A temporary folder holding this tree's tracked and untracked (not ignored) files."""
    files = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split('\0')
    dest = tempfile.mkdtemp(prefix='mutant-')
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):  # (a file deleted but not yet staged is skipped)
            os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))
    return dest


def pytest(where, tests):
    """(passed, seconds, the last line) of the default run's selection `tests` in the folder."""
    t0 = time.time()
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE='1')
    cmd = [sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider', *tests]
    p = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    last = (p.stdout.strip().splitlines() or [''])[-1]
    return p.returncode == 0, time.time() - t0, last


def main(argv):
    full = '--full' in argv
    ids = [a for a in argv if not a.startswith('--')]
    rows = [m for m in MUTATIONS if not ids or m[0] in ids]
    if ids and len(rows) != len(ids):
        print(f"unknown ids: {sorted(set(ids) - {m[0] for m in MUTATIONS})}")
        return 2
    selections = [[]] if full else sorted({tuple(m[5]) for m in rows})
    base = clean_copy()
    try:
        for tests in selections:
            ok, secs, last = pytest(base, list(tests))
            name = ' '.join(tests) or '(the default run)'
            print(f"baseline {name}: {'pass' if ok else 'FAIL'} ({secs:.0f} s) {last}", flush=True)
            if not ok:
                return 2
    finally:
        shutil.rmtree(base)
    survived = 0
    print(f"{'id':9} {'result':9} {'secs':>5}  mutation; tests run")
    for name, what, path, old, new, tests in rows:
        where = clean_copy()
        try:
            target = os.path.join(where, path)
            text = open(target).read()
            if text.count(old) != 1:
                print(f"{name:9} {'NOT FOUND':9} {'':5}  {path}: the old text is there "
                      f"{text.count(old)} times")
                return 2
            with open(target, 'w') as f:
                f.write(text.replace(old, new))
            ok, secs, last = pytest(where, [] if full else tests)
        finally:
            shutil.rmtree(where)
        survived += ok
        print(f"{name:9} {'SURVIVED' if ok else 'caught':9} {secs:5.0f}  {what}; "
              f"{'the default run' if full else ' '.join(tests)}: {last}", flush=True)
    print(f"{len(rows) - survived} of {len(rows)} caught")
    return 1 if survived else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
