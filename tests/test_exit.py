"""How a run ends. A finished run exits 0 and leaves no thread. Ctrl-C mid-call gives exit 130
at once, with the ANE worker and its shared memory freed, however many Ctrl-C follow.

Why threads matter at exit: CPython ends any thread still alive once it finalizes. A thread
inside a PyTorch op then unwinds through C++ that may not unwind (pthread_exit's forced
unwind), and the process aborts: `terminate called without an active exception`, exit 134."""
import concurrent.futures
import contextlib
import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from test_worker import gone, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, 'tests', 'macos_double')
# the smallest run that trains, evaluates, saves best.pt and samples from it
TINY_RUN = ['--dataset', 'shakespeare', '--mode', 'gpu', '--n_layer', '1', '--n_head', '2',
            '--n_embd', '16', '--block_size', '16', '--batch_size', '1',
            '--gradient_accumulation_steps', '1', '--max_iters', '4', '--eval_interval', '2',
            '--eval_iters', '1', '--log_interval', '1', '--sample_tokens', '20']
TRAINER_PY = os.path.join(ROOT, 'hetero_gpt.py')


def mac_env():
    """The double's Mac, MPS included (tests/macos_double)."""
    return dict(os.environ, HETERO_MACOS_DOUBLE='1', PYTHONPATH=os.pathsep.join([DOUBLE, ROOT]))


def in_terminal(argv, cwd, env, timeout=600, columns=110):
    """(exit code, output) of argv in a pseudo-terminal of its own, as a person runs it."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a new session whose controlling terminal is the pty
        try:
            os.chdir(cwd)
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack('HHHH', 40, columns, 0, 0))
    out = bytearray()
    deadline = time.monotonic() + timeout
    while select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        out += chunk
    if time.monotonic() >= deadline:
        os.kill(pid, signal.SIGKILL)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors='replace')


@pytest.mark.slow
def test_twenty_finished_runs_exit_0(shakespeare, tmp_path):
    # A finished run in a terminal, with the progress bar, under the double's Mac with MPS:
    # trains, evaluates, samples, exits 0. An abort at exit is rare (1 in 6 was seen), so 20
    # runs, two at a time, each with a folder of its own.
    os.symlink(shakespeare[0] / 'data', tmp_path / 'data')

    def run(i):
        argv = [sys.executable, TRAINER_PY, *TINY_RUN, '--out_dir', f'out{i}']
        return in_terminal(argv, str(tmp_path), mac_env())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for rc, out in pool.map(run, range(20)):
            assert rc == 0, out[-2000:]
            assert 'terminate called' not in out and 'Traceback' not in out, out[-2000:]
            assert '---- sample from best.pt' in out


THREADS_LEFT = """
import runpy, sys, threading
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
print('threads left:', sorted(left))
"""


def test_a_finished_run_leaves_no_thread(shakespeare, tmp_path):
    # Once main returns, every thread the run started has ended: the engines' pools, tqdm's
    # monitor, the meter's reader. One left is what CPython may end inside a PyTorch op.
    os.symlink(shakespeare[0] / 'data', tmp_path / 'data')
    argv = [sys.executable, '-c', THREADS_LEFT, TRAINER_PY, *TINY_RUN, '--out_dir', 'out']
    rc, out = in_terminal(argv, str(tmp_path), mac_env())
    assert rc == 0, out[-2000:]
    assert 'threads left: []' in out, out[-2000:]


# A trainer as HeteroStep runs the ANE engine: a call in a thread of a pool, the main thread
# waiting, Ctrl-C handled as hetero_gpt.main does. The worker's call lasts an hour.
TRAINER = """
import concurrent.futures, functools, sys
import hetero_gpt as hg, test_worker as t, worker_faults
from plumbing import progress, worker
make = functools.partial(worker_faults.stalls, note=sys.argv[1])
w = worker.WorkerEngine(t.spec(), make, hg.LossScaler(1.0, 0, enabled=False), log=lambda s: None)
w.load_weights(dict(hg.GPT(t.CFG).named_parameters()))
print(w.proc.pid, *w.bufs.names.values(), flush=True)
pool = concurrent.futures.ThreadPoolExecutor(1)
with progress.ctrl_c_exits():
    pool.submit(w.loss_and_grads, *t.batches(1)[0]).result()
"""


@contextlib.contextmanager
def trainer(note):
    """The trainer above, in a process group of its own (a terminal's Ctrl-C reaches a group),
    once its worker is in the call: (process, the worker's pid, its shared memory's names).
    Whatever is left of the group is killed after, its memory unlinked."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')]))
    p = subprocess.Popen([sys.executable, '-c', TRAINER, str(note)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                         start_new_session=True)
    names = []
    try:
        pid, *names = p.stdout.readline().split()
        wait_for(note)
        yield p, int(pid), names
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the resource tracker too: so unlinked here
        except ProcessLookupError:
            pass
        p.communicate()
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f'/dev/shm/{n.lstrip("/")}')


def worker_gone(pid, names, seconds):
    """Waits until the worker is reaped and its shared memory unlinked; False after seconds."""
    t0 = time.monotonic()
    while os.path.exists(f'/proc/{pid}') or not gone(names):
        if time.monotonic() - t0 > seconds:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir('/dev/shm'), reason="reads /proc and /dev/shm")
@pytest.mark.parametrize('second', [None, 0.0, 0.3, 1.5])
def test_ctrl_c_mid_call_exits_130_at_once_and_frees_the_worker(tmp_path, second):
    # Ctrl-C while the worker computes: one line, exit 130 within 3 s (killing the worker and
    # reaping it takes milliseconds; asking a busy worker to stop waited 5 s). A second Ctrl-C
    # (second: seconds after the first, None for none) changes nothing: no traceback, no
    # abort. The worker and its shared memory are gone when the trainer is.
    with trainer(tmp_path / 'busy') as (p, pid, names):
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        if second is not None:
            time.sleep(second)
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:  # it had exited
                pass
        out = p.communicate(timeout=30)[0]
        took = time.monotonic() - t0
        assert p.returncode == 130, out
        assert out.strip() == 'interrupted', out
        assert took < 3.0 + (second or 0.0), took
        assert worker_gone(pid, names, 0.5)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir('/dev/shm'), reason="reads /proc and /dev/shm")
def test_a_killed_trainer_ends_its_worker_mid_call(tmp_path):
    # The trainer SIGKILLed (or ended by os._exit, no finalizer runs) while the worker computes:
    # the worker sees its parent gone and exits, though its call would last an hour. Its shared
    # memory goes with multiprocessing's resource tracker, which outlives both. Bounded at 10 s:
    # the exit is at once, the tracker's cleanup within a second.
    with trainer(tmp_path / 'busy') as (p, pid, names):
        p.kill()
        p.wait()
        assert worker_gone(pid, names, 10.0)
