"""The macOS double's sudo, memory and stdlib, and the project against them: sudo's tickets
belong to a terminal, sudo relays signals by either of its two rules, a 16 GB Mac is one
switch, and the double runs on a Python that lacks macOS-only modules. (The energy meter's
parsing: test_energy.py; the Mac user's commands: test_macos.py.)"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from plumbing import energy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, 'tests', 'macos_double')
GIB = 2**30

# Runs a command on a new pseudo-terminal, as a user's shell does: the command leads a session
# whose controlling terminal is the pty. Types a password at each prompt; prints what it shows.
IN_TERMINAL = """
import os, pty, sys
pid, fd = pty.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
out = b''
while True:
    try:
        chunk = os.read(fd, 4096)
    except OSError:  # EIO: the terminal's last process is gone
        break
    if not chunk:
        break
    out += chunk
    if out.endswith(b'Password:'):
        os.write(fd, b'secret\\n')
_, status = os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors='replace'))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def double_env(tmp_path, **switches):
    """The environment of a process on the double's Mac; switches: MACOS_DOUBLE_* by suffix.
    Its sudo keeps tickets in tmp_path/ts, and notes powermetrics in tmp_path."""
    return dict(os.environ, HETERO_MACOS_DOUBLE='1', PYTHONPATH=os.pathsep.join([DOUBLE, ROOT]),
                PATH=os.path.join(DOUBLE, 'bin') + os.pathsep + os.environ['PATH'],
                MACOS_DOUBLE_LOG=str(tmp_path), MACOS_DOUBLE_SUDO_TS=str(tmp_path / 'ts'),
                **{f'MACOS_DOUBLE_{k.upper()}': str(v) for k, v in switches.items()})


def in_terminal(script, env, timeout=120):
    """sh -c script on a terminal of its own: (exit code, what the terminal showed)."""
    r = subprocess.run([sys.executable, '-c', IN_TERMINAL, 'sh', '-c', script], env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout.replace('\r\n', '\n')


def running_powermetrics(folder):
    """Pids of the double's powermetrics still running (each notes its pid while it runs)."""
    return [int(f.split('.')[1]) for f in os.listdir(folder) if f.startswith('powermetrics.')]


def test_a_sudo_v_ticket_is_the_terminals(tmp_path):
    # sudoers' timestamp_type=tty: `sudo -v` asks for the password on the terminal and makes a
    # ticket for it; sudo -n then runs in that terminal's session, also with stdin elsewhere and
    # in a process group of its own; a new session has no terminal and finds no ticket; nor
    # does another terminal; without a terminal no password can be asked
    env = double_env(tmp_path)
    sudo_n = "os.execvp('sudo', ['sudo', '-n', 'true'])"
    python = f'{sys.executable} -c "import os; os.{{}}; {sudo_n}"'
    rc, shown = in_terminal('sudo -n true; echo "before $?"; sudo -v; echo "v $?"; '
                            'sudo -n true </dev/null; echo "after $?"; '
                            f'{python.format("setpgid(0, 0)")} </dev/null; echo "own group $?"; '
                            f'{python.format("setsid()")} </dev/null; echo "new session $?"', env)
    refused = 'sudo: a password is required'
    assert shown.splitlines() == [refused, 'before 1', 'Password:', 'v 0', 'after 0', 'own group 0',
                                  refused, 'new session 1'], shown
    assert rc == 0 and len(os.listdir(tmp_path / 'ts')) == 1
    rc, shown = in_terminal('sudo -n true', env)  # another terminal
    assert rc == 1 and 'sudo: a password is required' in shown
    r = subprocess.run(['sudo', '-v'], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, start_new_session=True)
    assert r.returncode == 1
    assert r.stderr.startswith('sudo: a terminal is required to read the password')


# The probe and the meter, in a process of the double's Mac on the terminal: [probe, meter]
PROBE_AND_METER = """
import json, time
from plumbing import energy
said = [energy.powermetrics_readable()]
try:
    m = energy.PowermetricsMeter(interval_ms=50)
    time.sleep(0.3)
    m.close()
    said.append(m.parts)
except OSError as e:
    said.append(str(e))
print(json.dumps(said))
"""


@pytest.mark.slow  # processes in a terminal, seconds each
def test_sudo_v_gives_the_meter_its_samples(tmp_path):
    # after `sudo -v` in a terminal, the probe and the meter both run powermetrics (CPU 3 W,
    # GPU 9 W, ANE 1.5 W: the parts stand in those ratios); without it both are refused, with
    # sudo's own line. A meter in a new session would find no ticket
    env = double_env(tmp_path)
    code = textwrap.dedent(PROBE_AND_METER).replace("'", "'\\''")
    rc, shown = in_terminal(f"sudo -v && {sys.executable} -c '{code}' </dev/null", env)
    probe, parts = json.loads(shown.splitlines()[-1])
    assert rc == 0 and probe == [True, ''], shown
    assert isinstance(parts, dict) and parts['CPU'] > 0, shown
    # 9 W and 3 W over the same samples' times: equal but for rounding
    assert parts['GPU'] / parts['CPU'] == pytest.approx(3.0, rel=1e-12)
    assert not running_powermetrics(tmp_path)
    rc, shown = in_terminal(f"{sys.executable} -c '{code}' </dev/null", env)
    probe, meter = json.loads(shown.splitlines()[-1])
    assert probe == [False, 'sudo: a password is required'], shown
    assert meter == 'powermetrics gave no samples (sudo: a password is required)'


@pytest.mark.parametrize('rule', ['old', 'new'])
def test_the_meter_stops_powermetrics_under_either_relay_rule(rule, tmp_path, monkeypatch):
    # sudo 1.9.12 drops a signal from the group it started in, 1.9.13 one from a group led by
    # sudo or the command; the meter's sudo leads its own group, so close()'s SIGTERM is
    # relayed under both: powermetrics ends at once, not after the 5 s wait and a SIGKILL
    for k, v in double_env(tmp_path, sudo=1, sudo_relay=rule).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(energy.PowermetricsMeter, 'refused', None)
    m = energy.PowermetricsMeter(interval_ms=50)
    assert running_powermetrics(tmp_path)
    t0 = time.monotonic()
    m.close()
    assert time.monotonic() - t0 < 2 and m.proc.returncode == 0  # (powermetrics' exit on SIGTERM)
    assert not running_powermetrics(tmp_path)


@pytest.mark.parametrize('rule', ['old', 'new'])
def test_the_doubles_sudo_relays_by_the_rule_it_is_given(rule, tmp_path):
    # sudo started in our own process group (no group of its own), our SIGTERM to it: 1.9.12
    # drops it (its ppgrp is ours) and lives on; 1.9.13 relays it (our group is led by neither
    # sudo nor the command). Either relays a SIGTERM from a process in another group
    env = double_env(tmp_path, sudo=1, sudo_relay=rule)
    sudo = subprocess.Popen(['sudo', '-n', 'powermetrics', '-i', '50'], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not running_powermetrics(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        sudo.terminate()
        try:
            sudo.wait(3)
        except subprocess.TimeoutExpired:
            pass
        assert (sudo.returncode is None) == (rule == 'old')
        if rule == 'old':
            subprocess.run(['kill', '-TERM', str(sudo.pid)], process_group=0, check=True)
            sudo.wait(5)
    finally:
        if sudo.poll() is None:
            sudo.kill()
            sudo.wait()
        for pid in running_powermetrics(tmp_path):
            os.kill(pid, signal.SIGTERM)
    assert sudo.returncode == 0 and not running_powermetrics(tmp_path)  # (powermetrics ended)


def test_close_leaves_no_thread_or_process(tmp_path, monkeypatch):
    # after close(), none of the meter's threads is alive and sudo and powermetrics are reaped,
    # whether it closed after samples or was interrupted (here: an exception from a timer's
    # signal) while it waited for its first sample (powermetrics at 3 s: -i 2500, 20% more)
    for k, v in double_env(tmp_path, sudo=1).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(energy, 'ON_MAC', True)
    monkeypatch.setattr(energy.PowermetricsMeter, 'refused', None)
    before = set(threading.enumerate())
    m = energy.EnergyMeter(set())
    assert len(m.meters) == 1 and len(threading.enumerate()) == len(before) + 1  # (the reader)
    proc = m.meters[0].proc
    m.close()
    assert set(threading.enumerate()) <= before and proc.returncode is not None
    assert not running_powermetrics(tmp_path)

    class Interrupted(BaseException):
        pass

    def interrupt(sig, frame):
        raise Interrupted
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(Interrupted):
            energy.PowermetricsMeter(interval_ms=2500)
        left = running_powermetrics(tmp_path)
        assert set(threading.enumerate()) <= before and not left
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        for pid in running_powermetrics(tmp_path):
            os.kill(pid, signal.SIGTERM)


@pytest.mark.slow  # processes in a terminal, seconds each
def test_a_meter_nobody_closes_ends_with_its_process(tmp_path):
    # a process that ends with its meter open (an exception before its close) leaves no
    # powermetrics running: here the next sample is due 3.6 s after the first (-i 3000, 20%
    # more), long after this process has ended
    code = "from plumbing import energy; energy.PowermetricsMeter(interval_ms=3000)"
    r = subprocess.run([sys.executable, '-c', code], env=double_env(tmp_path, sudo=1),
                       capture_output=True, text=True, timeout=300)
    left = running_powermetrics(tmp_path)
    for pid in left:
        os.kill(pid, signal.SIGTERM)
    assert r.returncode == 0 and not left, r.stderr[-2000:]


def test_nvml_and_rapl_meters_hold_no_thread_and_nvml_shuts_down(tmp_path, monkeypatch):
    # NVML: one nvmlShutdown for each nvmlInit, after a meter closes and after one fails to
    # start (no such device); RAPL reads files. Neither starts a thread
    import ctypes
    calls = []

    class Lib:
        def nvmlInit_v2(self):
            calls.append('init')
            return 0

        def nvmlShutdown(self):
            calls.append('shutdown')
            return 0

        def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
            return 0 if index == 0 else 1

        def nvmlDeviceGetTotalEnergyConsumption(self, handle, mj):
            return 0
    monkeypatch.setattr(ctypes, 'CDLL', lambda name: Lib())
    before = set(threading.enumerate())
    m = energy.NvmlMeter(0)
    assert m.joules() == 0.0
    m.close()
    m.close()
    with pytest.raises(OSError, match='no NVML device 1'):
        energy.NvmlMeter(1)
    assert calls == ['init', 'shutdown', 'init', 'shutdown']
    (tmp_path / 'intel-rapl:0').mkdir()
    (tmp_path / 'intel-rapl:0' / 'energy_uj').write_text('5\n')
    (tmp_path / 'intel-rapl:0' / 'max_energy_range_uj').write_text('99\n')
    energy.RaplMeter(root=str(tmp_path)).joules()
    assert set(threading.enumerate()) == before


def test_energy_meter_close_closes_every_meter_even_if_one_fails():
    closed = []

    class Meter:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise OSError(f'{self.name} failed')
    m = energy.EnergyMeter(set())
    m.meters = [Meter('a', fails=True), Meter('b')]
    with pytest.raises(OSError, match='a failed'):
        m.close()
    assert sorted(closed) == ['a', 'b']
    m.close()  # (again: nothing left to close)
    assert sorted(closed) == ['a', 'b']


# Memory as a 16 GB Mac reports it (MACOS_DOUBLE_MEMORY=16) and the preflight's line: GPT-2
# 124M in hetero mode, 2 x 1024 a microbatch on MPS and 2 a call on the ANE (test_mps.py
# counts its parts: ~11.5 GiB, between 70% and 90% of 16, so it warns)
MEMORY = """
import json, os, subprocess, types, torch
from plumbing import memory
C, L, V, T = 768, 12, 50257, 1024
block = 2 * C + C * 3 * C + 3 * C + C * C + C + 2 * C + C * 4 * C + 4 * C + 4 * C * C + C
P = V * C + T * C + L * block + 2 * C
cfg = types.SimpleNamespace(n_embd=C, n_layer=L, n_head=12, vocab_size=V, batch_size=2,
                            block_size=T)
run = types.SimpleNamespace(mode='hetero', device=torch.device('mps'), dtype=torch.float32,
                            ane_batch_size=2)
said = []
try:
    memory.preflight(cfg, run, (P, 4 * 12608), log=said.append)
except memory.UserError as e:
    said.append(str(e))
sysctl = subprocess.run(['sysctl', '-n', 'hw.memsize'], capture_output=True, text=True).stdout
pages = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
print(json.dumps(dict(sysctl=sysctl, sysconf=pages, total=memory.total_memory(), said=said)))
"""


@pytest.mark.parametrize('gib', [16, 8])
def test_a_16_gb_mac_is_one_switch(gib, tmp_path):
    # MACOS_DOUBLE_MEMORY: what sysctl's hw.memsize and os.sysconf's pages both say, and what
    # the project reads; the preflight warns on 16 GiB (~72%) and refuses on 8 (past 90%)
    r = subprocess.run([sys.executable, '-c', MEMORY], env=double_env(tmp_path, memory=gib),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert int(got['sysctl']) == got['sysconf'] == got['total'] == gib * GIB
    assert len(got['said']) == 1
    if gib == 16:
        assert got['said'][0].startswith('warning: this run needs ~11.')
        assert 'GiB of 16.0 GiB' in got['said'][0]
    else:
        assert "of this machine's 8.0 GiB" in got['said'][0]


def test_on_a_mac_the_project_reads_hw_memsize(tmp_path, monkeypatch):
    # on a Mac, sysctl's hw.memsize (here the double's, saying 16 GiB while this process's
    # os.sysconf says this machine's); where sysctl cannot be run, the pages
    from plumbing import memory
    monkeypatch.setattr(memory, 'ON_MAC', True)
    monkeypatch.setenv('MACOS_DOUBLE_MEMORY', '16')
    monkeypatch.setenv('PATH', os.path.join(DOUBLE, 'bin') + os.pathsep + os.environ['PATH'])
    pages = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    assert pages != 16 * GIB and memory.total_memory() == 16 * GIB
    monkeypatch.setenv('PATH', str(tmp_path))  # (no sysctl there)
    assert memory.total_memory() == pages


# A Python without ctypes.macholib (as Debian's and Ubuntu's): a finder that hides it, put in
# the path finder's place before the double is installed; then what ctypes.util finds
WITHOUT_MACHOLIB = """
import importlib.machinery, importlib.util, json, os, sys
hide = sys.argv[1] == 'hide'

class Hiding(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.startswith('ctypes.macholib'):
            return None
        return super().find_spec(name, path, target)
if hide:
    sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Hiding
sys.path.insert(0, sys.argv[2])
site = os.path.join(sys.argv[2], 'sitecustomize.py')
spec = importlib.util.spec_from_file_location('sitecustomize', site)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
import ctypes.util
found = {n: ctypes.util.find_library(n) for n in ('c', 'double_test', 'Double')}
import ctypes.macholib.dyld
if sys.argv[3] == 'dynamo':
    import torch._dynamo
print(json.dumps([sys.platform, found, ctypes.macholib.dyld.__spec__.origin is None]))
"""


def without_macholib(tmp_path, hide, dynamo=False):
    lib, framework = tmp_path / 'lib', tmp_path / 'Frameworks' / 'Double.framework'
    lib.mkdir(exist_ok=True)
    framework.mkdir(parents=True, exist_ok=True)
    (lib / 'libdouble_test.dylib').write_bytes(b'')
    (framework / 'Double').write_bytes(b'')
    env = dict(os.environ, HETERO_MACOS_DOUBLE='1', PYTHONPATH=ROOT, DYLD_LIBRARY_PATH=str(lib),
               DYLD_FRAMEWORK_PATH=str(tmp_path / 'Frameworks'))
    args = ['hide' if hide else 'keep', DOUBLE, 'dynamo' if dynamo else '-']
    r = subprocess.run([sys.executable, '-c', WITHOUT_MACHOLIB, *args], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1]), lib, framework


def test_ctypes_util_works_on_a_python_without_macholib(tmp_path):
    # ctypes.util's darwin path imports ctypes.macholib.dyld: where it is missing the double's
    # own takes its place, and finds what the real one finds on this file system (a dylib in
    # DYLD_LIBRARY_PATH, a framework in DYLD_FRAMEWORK_PATH; no libc.dylib on Linux)
    (platform, hidden, fallback), lib, framework = without_macholib(tmp_path, hide=True)
    (_, real, real_is_fallback), _, _ = without_macholib(tmp_path, hide=False)
    has_macholib = importlib.util.find_spec('ctypes.macholib') is not None  # (Debian's has not)
    assert platform == 'darwin' and fallback and real_is_fallback != has_macholib
    assert hidden == real == {'c': None, 'double_test': str(lib / 'libdouble_test.dylib'),
                              'Double': str(framework / 'Double')}


@pytest.mark.slow
def test_torch_dynamo_imports_on_a_python_without_macholib(tmp_path):
    # torch._dynamo's imports reach ctypes.util
    (platform, _, fallback), _, _ = without_macholib(tmp_path, hide=True, dynamo=True)
    assert platform == 'darwin' and fallback
