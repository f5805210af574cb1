"""The self-check (export_ane.py --check) under the macOS double: stopped by Ctrl-C, SIGTERM or
SIGHUP, its report re-run, its first stage on a Mac without MPS, the advice it and the trainer
give, its gates on the loss, the ANE's time and causal attention on MPS; and the MPS double's
slow GPU work that such tests stop."""
import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import hetero_gpt as hg
from tools import ane_check

pytest.importorskip('coremltools')
from test_macos import ROOT, mac  # noqa: E402

EXPORT = os.path.join(ROOT, 'export_ane.py')
# the quick check's model, smaller: aligned for the ANE (multiples of 32), a vocabulary of 512
CHECK_MODEL = ['--n_layer', '2', '--n_head', '2', '--n_embd', '64', '--block_size', '32', '--vocab_size', '512',
               '--ane_batch_size', '2', '--gpu_batch', '2']
CHECK_CFG = hg.GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=512)

SLOW_BACKWARD = """
    import json, os, signal, threading, time, torch
    w = torch.nn.Parameter(torch.ones(3).to('mps'))
    t0 = time.monotonic()
    (w * 2).sum().backward()  # queued: returns at once
    queued = time.monotonic() - t0
    g = w.grad.sum().item()  # waits for the queued work
    waited = time.monotonic() - t0
    (w * 2).sum().backward()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        torch.mps.synchronize()
        stopped = None
    except KeyboardInterrupt:
        stopped = time.monotonic() - t0
    print(json.dumps(dict(queued=queued, waited=waited, grad=g, stopped=stopped)))
"""


@pytest.mark.slow  # seconds of processes under the double
def test_slow_mps_backward_queues_work_that_the_next_read_waits_for(tmp_path):
    # MACOS_DOUBLE_MPS_SLOW=1.5: each backward queues 1.5 s; a read waits for it, and a Ctrl-C
    # meanwhile is handled after the wait, as after Metal's waitUntilCompleted
    r = mac(['-c', textwrap.dedent(SLOW_BACKWARD)], tmp_path, mps_slow=1.5)
    assert r.returncode == 0, r.stderr[-3000:]
    f = json.loads(r.stdout.splitlines()[-1])
    assert f['grad'] == 6.0 and f['queued'] < 0.5  # 3 ones times 2; the backward only queues
    assert f['waited'] >= 1.5  # at least the queued work, as the switch promises
    assert f['stopped'] is not None and f['stopped'] >= 1.5 - 0.2  # the signal came 0.2 s in


# ---- the environment stage, and the flags that advice names

@pytest.mark.slow  # seconds of processes under the double
def test_the_environment_stage_fails_at_once_on_a_mac_without_mps(tmp_path):
    # macOS 13.5 with torch 2.10 or newer: MPS built in but unavailable. The check says so in its
    # first stage, in the trainer's words but without the trainer's --device advice (export_ane.py
    # has no --device), and runs nothing after it
    r = mac([EXPORT, '--check', *CHECK_MODEL, '--check_report', 'out/quick_check.json'], tmp_path, version='13.5')
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    said = [line.strip() for line in r.stdout.splitlines()]
    line = next(s for s in said if s.startswith('environment:'))
    assert line.startswith(f"environment: fail (MPS is not available here (torch {torch.__version__} on macOS "
                           "13.5; torch 2.10 and newer need macOS 14 for MPS): update macOS to 14 or newer, or pip "
                           "install 'torch<2.10')"), line
    assert '--device' not in r.stdout + r.stderr and 'FAILED: environment' in said
    assert not [s for s in said if s.startswith('stage ') and not s.startswith('stage environment')]
    doc = json.load(open(tmp_path / 'out' / 'quick_check.json'))
    assert [s['status'] for s in doc['stages']] == ['ok'] + ['not run'] * (len(ane_check.STAGES) - 1)


def parser_flags(main, argv=()):
    """The --flags of the parser that main builds (its parse_args stopped before it parses)."""
    class Parsed(Exception):
        pass

    def caught(self, *a, **k):
        raise Parsed(self)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, 'parse_args', caught)
        m.setattr(argparse.ArgumentParser, 'parse_known_args', caught)
        try:
            main(list(argv))
        except Parsed as e:
            return {o for a in e.args[0]._actions for o in a.option_strings}
    raise AssertionError(f"{main} built no parser")


# a flag a text names, unless the text starts with it (the flag the user gave, echoed)
ADVICE = re.compile(r"(?<=.)(?<![\w-])(--[a-z_]+)", re.S)
COMMAND = re.compile(r"python3? ([a-z_]+\.py)\b([^`;)]*)")


def remedies(path):
    """[(function, script, flag)] of every flag that a string of the file names, by the innermost
    function around it: in a `python X.py ...` command, script is X.py; else None. Docstrings
    and the placeholder --flag are left out."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    parent = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # an f-string: its text, {} for each value
            text = ''.join(v.value if isinstance(v, ast.Constant) else '{}' for v in node.values)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and not isinstance(parent.get(node), (ast.JoinedStr, ast.Expr))):
            text = node.value
        else:
            continue
        fn = parent.get(node)
        while fn is not None and not isinstance(fn, (ast.FunctionDef, ast.ClassDef)):
            fn = parent.get(fn)
        name = fn.name if fn is not None else None
        for script, rest in COMMAND.findall(text):
            out += [(name, script, f) for f in re.findall(r'--[a-z_]+', rest)]
        out += [(name, None, f) for f in ADVICE.findall(COMMAND.sub('', text).lstrip('{} ')) if f != '--flag']
    return out


def test_every_remedy_names_a_flag_of_the_command_that_prints_it():
    # every --flag that an error or a note advises, against the flags of each command that can
    # print it: the trainer (and bench, which takes the trainer's flags) for the trainer's
    # settings; export_ane.py for the self-check and for the settings checks it calls too
    import bench
    import export_ane
    trainer = parser_flags(hg.parse_args)
    commands = {'hetero_gpt.py': trainer, 'export_ane.py': parser_flags(export_ane.main),
                'bench.py': parser_flags(lambda argv: hg.parse_args(argv, bench.BenchConfig)), 'sample.py': None}
    both = ('hetero_gpt.py', 'bench.py', 'export_ane.py')
    runs = ('hetero_gpt.py', 'bench.py')
    # which commands reach each file's functions (export_ane.py: its own checks, then the stages)
    reach = {'tools/ane_check.py': {None: ('export_ane.py',)},
             'export_ane.py': {None: ('export_ane.py',)},
             'hetero_gpt.py': {None: runs},
             'plumbing/settings.py': {None: runs, 'check_model': both, 'check_coreml': both,
                                      'check_ane_alignment': both, 'mac_without_ane': both, 'mps_missing': runs},
             'plumbing/memory.py': {None: runs},
             'plumbing/worker.py': {None: both},
             'plumbing/programs.py': {None: both},
             'plumbing/checkpoints.py': {None: runs},
             'plumbing/energy.py': {None: both}}
    wrong = []
    for path, by_function in reach.items():
        for fn, script, flag in remedies(path):
            if script is not None:  # `python X.py --flag`: X's flag
                names = [script] if commands.get(script) is not None else []
            else:
                names = by_function.get(fn, by_function[None])
            wrong += [f"{path} {fn}: {flag} ({n} has no such flag)" for n in names if flag not in commands[n]]
    assert not wrong, '\n'.join(sorted(set(wrong)))


# ---- stopping the check: at once, with every finished verdict kept, nothing left running

def test_a_rerun_stopped_early_keeps_every_finished_verdict(tmp_path):
    # a complete report, then a full re-run stopped in its second stage: the first stage's new
    # record replaces the old one, and every stage it did not finish keeps its earlier verdict
    from test_check import records
    ctx = dict(cfg=dict(hg.GPTConfig().__dict__), B=1, T=8, gpu_batch=2)
    path = str(tmp_path / 'quick_check.json')
    ane_check.write_report(records(), ctx, path)
    again = [dict(records()[0], seconds=2.0)] + [dict(name=r['name'], status='interrupted', seconds=0.0)
                                                 for r in records()[1:]]
    _, written, how = ane_check.write_report(again, ctx, path)
    stages = json.load(open(path))['stages']
    assert written == path and how == 'merged: environment re-run, the other stages kept from before'
    assert [(r['name'], r['status']) for r in stages] == [(r['name'], r['status']) for r in records()]
    assert stages[0]['seconds'] == 2.0
    assert [r.get('result') for r in stages[1:]] == [r.get('result') for r in records()[1:]]


def default_ctrl_c():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_stages(tmp_path, second):
    """check_stages.py's check (three stand-in stages), its second stage `second`, in a session of
    its own: (process, what it said until its second stage started)."""
    env = dict(os.environ, CHECK_STAGES_SECOND=second, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')]))
    # Ctrl-C heard as in a terminal, where a harness in the background would pass it on ignored
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, 'tests', 'check_stages.py'), str(tmp_path / 'c.json')],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, preexec_fn=default_ctrl_c)
    said = ''
    while 'stage second' not in said:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        said += line
    return proc, said


def session_left(sid):
    """The processes of session sid still there after up to 5 s (a resource tracker leaves as its pipe closes)."""
    for _ in range(50):
        ps = subprocess.run(['ps', '-o', 'pid=,args=', '-s', str(sid)], capture_output=True, text=True).stdout
        if not ps.strip():
            return ''
        time.sleep(0.1)
    return ps


SLOW = pytest.mark.slow  # (each a few seconds of processes: SIGINT's runs by default)


@pytest.mark.parametrize('sig, code, group', [(signal.SIGINT, 130, True),
                                              pytest.param(signal.SIGTERM, 143, False, marks=SLOW),
                                              pytest.param(signal.SIGHUP, 129, False, marks=SLOW)])
def test_a_stop_acts_within_a_second_even_when_the_stage_cannot_hear_it(tmp_path, sig, code, group):
    # the second stage is in a call no signal ends (its SIGTERM ignored, as a Core ML compile in C
    # would be): Ctrl-C to the terminal's group, or SIGTERM or SIGHUP to the check alone, ends the
    # check with one line and the signal's exit code, its stage's process killed. Within 10 s of
    # the signal: a second's grace, the kill, the report, the exit (on a 2-core machine running
    # two tests at once); a stop that waited for the stage would wait its hour
    proc, said = run_stages(tmp_path, 'deaf')
    time.sleep(3)  # the stage's process started, deaf
    t0 = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == code, (said + out, err)
    assert took < 10, took
    assert 'Traceback' not in err and 'Error' not in err, err
    assert [line for line in (said + out).splitlines() if 'interrupted' in line] == [
        f"interrupted in stage second: the stages before it are in {tmp_path / 'c.md'} (a new report)"]
    assert not session_left(proc.pid)  # the deaf stage's process killed
    doc = json.load(open(tmp_path / 'c.json'))
    assert [(r['name'], r['status']) for r in doc['stages']] == [('first', 'ok'), ('second', 'interrupted'),
                                                                 ('third', 'interrupted')]


@pytest.mark.slow  # eight runs of the check under the double
@pytest.mark.skipif(not os.path.isdir('/dev/shm'), reason="reads /proc and /dev/shm")
def test_sigterm_in_each_stage_leaves_nothing_running(tmp_path, exported):
    # `timeout` sends SIGTERM: in each stage of a tiny check under the double (each stage made
    # slow enough to be stopped in: an ANE compile of 5 s a load, 2 s of GPU work a backward,
    # sudo rights so that energy measures), the check ends with one line and 143, keeps its
    # report, prints no traceback, and leaves no process and no shared memory behind
    from test_macos import programs_in
    from test_ux import left_behind, shm
    out = programs_in(tmp_path, exported, CHECK_CFG, B=2, T=32)
    double = os.path.join(ROOT, 'tests', 'macos_double')
    env = dict(os.environ, HETERO_MACOS_DOUBLE='1', PYTHONPATH=os.pathsep.join([double, ROOT]),
               MACOS_DOUBLE_LOAD_SECONDS='5', MACOS_DOUBLE_MPS_SLOW='2', MACOS_DOUBLE_SUDO='1',
               MACOS_DOUBLE_LOG=str(tmp_path))
    for name, _, _ in ane_check.STAGES:
        before = shm()
        report = tmp_path / f'{name}.json'
        proc = subprocess.Popen([sys.executable, EXPORT, '--check', *CHECK_MODEL, '--out', out, '--stages', name,
                                 '--check_report', str(report)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        said = ''
        while f'stage {name}' not in said:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            said += line
        time.sleep(2.5 if name in ('coreml', 'concurrency', 'energy') else 1.0)  # inside the stage's own work
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, (name, said + rest, err[-3000:])
        assert 'Traceback' not in err and 'BrokenPipeError' not in err, (name, err[-3000:])
        assert [line for line in (said + rest).splitlines() if 'interrupted' in line] == [
            f"interrupted in stage {name}: the stages before it are in {report.with_suffix('.md')} (a new report)"]
        assert json.load(open(report))['stages'][0]['status'] == 'interrupted'
        assert not session_left(proc.pid), name  # the stage, its ANE worker, their threads
        assert not left_behind(before), name


# ---- the gates: the loss, the ANE's time, causal attention on MPS

def test_the_gradients_stage_judges_the_loss(exported, monkeypatch):
    # the chained programs' loss (fp16, NumPy's ANE mode here) against fp64 autograd's: within
    # 1e-2 relative (a mean of B*T cross-entropies, each an fp16 log-sum-exp with errors of a few
    # 4.9e-4 ulps that mostly cancel in the mean; 4e-4 measured here); a loss output x1.1 fails
    import helpers
    cfg = helpers.PROGRAMS['cfg']
    ctx = dict(cfg=dict(cfg.__dict__), B=2, T=8, out=exported(**helpers.PROGRAMS), gpu_batch=4, results={})
    pair = ane_check.gradient_pair(ctx)
    monkeypatch.setattr(ane_check, 'gradient_pair', lambda ctx: pair)
    good = ane_check.gradients(ctx)
    assert good['passed'] and abs(good['loss_ratio'] - 1) <= 1e-2, good['loss_ratio']
    monkeypatch.setattr(ane_check, 'gradient_pair', lambda ctx: (1.1 * pair[0],) + pair[1:])
    bad = ane_check.gradients(ctx)
    assert not bad['passed'] and bad['failures'][0] == 'loss' and bad['worst_cosine'] == good['worst_cosine']
    verdict, text = ane_check.verdict_of(dict(name='gradients', status='ok', seconds=1.0, result=bad))
    assert verdict == 'fail' and f"loss / fp64 loss {bad['loss_ratio']:.4f} (within 0.01)" in text


@pytest.mark.slow  # two coreml stages under the double
def test_a_fallback_the_compute_plan_hides_is_a_warning(tmp_path, exported):
    # programs on the CPU 10x slower than on the ANE: each program's CPU_AND_NE time is then about
    # a tenth of its CPU_ONLY time, and the stage passes, with room for a loaded machine's noise. With a fallback the plan hides, the plan
    # says 100% on the ANE, but CPU_AND_NE takes the CPU's time: a warning, naming each program
    from test_macos import programs_in
    out = programs_in(tmp_path, exported, CHECK_CFG, B=2, T=32)
    check = [EXPORT, '--check', *CHECK_MODEL, '--out', out, '--stages', 'coreml', '--check_report', 'c.json']
    verdicts = {}
    for fallback in ('0', 'hidden'):
        r = mac(check, tmp_path, cpu_slowdown=10, ane_fallback=fallback)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        rec = next(s for s in json.load(open(tmp_path / 'c.json'))['stages'] if s['name'] == 'coreml')
        assert all(v['placement']['ane_share_of_ops'] == 1.0 for v in rec['result'].values()), rec
        verdicts[fallback] = ane_check.verdict_of(rec)
    assert verdicts['0'][0] == 'pass', verdicts
    # (3 timed calls each on a shared machine: some program, not necessarily each, shows it)
    assert verdicts['hidden'][0] == 'warn' and 'not clearly faster on the ANE than on the CPU (at least 0.8x)' in \
        verdicts['hidden'][1], verdicts


CAUSAL = """
    import json, torch
    from plumbing import settings
    from tools import ane_check
    import hetero_gpt as hg
    cfg = hg.GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=64)  # 64 a head, as the runs
    env = ane_check.environment(dict(cfg=cfg.__dict__, T=64))
    refused = {}
    for d in (torch.float32, torch.float16, torch.bfloat16):
        try:
            settings.check_mps(d, False)
        except settings.UserError as e:
            refused[str(d)] = str(e)
    print(json.dumps(dict(sound=env['causal_attention'], verdict=ane_check.verdict_of(
        dict(name='environment', status='ok', seconds=1.0, result=env)), refused=refused)))
"""


@pytest.mark.slow  # seconds of processes under the double
def test_causal_attention_that_sees_later_tokens_on_mps_is_found_and_refused(tmp_path):
    # the double's MPS as torch before 2.14 (this torch is older): fp16 and bf16 causal attention
    # masks per group of four queries. The environment stage's probe finds it in each dtype, its
    # verdict warns, and the trainer's MPS check refuses those dtypes in one line; float32 is sound.
    # With the switch that makes the double's attention exact, all pass
    r = mac(['-c', textwrap.dedent(CAUSAL)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    f = json.loads(r.stdout.splitlines()[-1])
    assert f['sound'] == dict(float32=True, float16=False, bfloat16=False)
    assert f['verdict'][0] == 'warn' and 'causal attention in float16 and bfloat16 on MPS sees later' in f['verdict'][1]
    assert f['refused'] == {f'torch.{d}': f"--dtype {d} on MPS: this torch ({torch.__version__}) computes causal "
                            f"attention in {d} that sees later tokens (pytorch #195910): use --dtype float32"
                            for d in ('float16', 'bfloat16')}
    r = mac(['-c', textwrap.dedent(CAUSAL)], tmp_path, mps_sdpa='exact')
    f = json.loads(r.stdout.splitlines()[-1])
    assert f['sound'] == dict(float32=True, float16=True, bfloat16=True) and f['refused'] == {}, f
    assert f['verdict'][0] == 'pass'
