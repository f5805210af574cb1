"""
The ANE engine in a worker process of its own.

Core ML's predict and its model load hold the GIL for the whole call (docs/coreml_and_ane.md
section 1). In a thread of the training process, every Core ML call would stop the GPU
engine's Python, and the two engines would take turns. So the ANE engine (the trainer's
CoreMLEngine, built in the worker by the function the trainer hands over) runs in a worker
process, started with spawn, since Objective-C frameworks do not survive fork. The training
process exchanges with it once per microbatch, through shared memory allocated once:
- the weights, fp32, written once per step;
- the batch, int64;
- the gradients, fp32.
The engine's thread waits on a pipe, which releases the GIL.

A worker that dies (a failed ANE compile kills it by SIGKILL at its first predict,
docs/coreml_and_ane.md section 1), does not answer within its timeout, or raises, raises
WorkerFault here: HeteroStep retires the engine and the GPU engine runs its share.

Stopping it, however the trainer ends: close() asks an idle worker to stop and kills a busy
one, whose answer nobody wants; Ctrl-C calls close() for every worker (progress.ON_INTERRUPT).
A trainer that is killed or calls os._exit leaves a worker that exits on its own.

Off macOS the same worker runs the engine with a stand-in for Core ML (the eager derivation
on the CPU, or the exported programs in NumPy), so the process boundary, the buffers, the
timeouts and every fault path run everywhere.
"""
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import weakref
from multiprocessing import shared_memory

import numpy as np
import torch

from . import progress
from .memory import max_rss
from .settings import ON_MAC, UserError, one_line

# The GIL's switch interval for a process that trains with a worker.
# Each exchange call releases the GIL, then must take it back.
# The GPU engine's thread holds it between kernel launches.
# It yields to a waiter after one switch interval.
# So 0.5 ms, not CPython's 5 ms (set once, in hetero_gpt.build_engines).
# A thread is asked to yield only while another waits.
# CPython's source and the timings: benchmarks/RESULTS.md section 15.
SWITCH_S = 5e-4


class WorkerFault(RuntimeError):
    """The worker died, hung or raised: the step retires the engine, the GPU takes its share."""


def exit_text(code):
    if code is None:
        return "still running"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def views(flat, shapes):
    """{name: that stretch of a flat array, in its shape}: NumPy views, made without a copy or a
    release of the GIL."""
    out, off = {}, 0
    for k, s in shapes.items():
        out[k] = flat[off:off + math.prod(s)].reshape(s)
        off += math.prod(s)
    return out


class Buffers:
    """The shared memory of one worker, allocated once:
    - weights and gradients, fp32, in one flat block each, viewed by nanoGPT's names and shapes;
    - a batch, int64 idx and targets as (2, B, T), for up to B sequences.
    The training process creates them (names None); the worker attaches to them by name."""

    def __init__(self, shapes, B, T, names=None):
        n = sum(math.prod(s) for s in shapes.values())
        sizes = dict(w=4 * n, g=4 * n, batch=8 * 2 * B * T)
        self.shm = {}
        self.owner = names is None
        try:
            if self.owner and os.path.isdir('/dev/shm'):  # a full tmpfs fails later, by SIGBUS
                st = os.statvfs('/dev/shm')
                if st.f_bavail * st.f_frsize < sum(sizes.values()):
                    raise OSError(f"/dev/shm has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free")
            for k, size in sizes.items():
                if self.owner:
                    self.shm[k] = shared_memory.SharedMemory(create=True, size=size)
                else:
                    self.shm[k] = shared_memory.SharedMemory(name=names[k])
        except OSError as e:
            self.close()
            raise UserError(f"could not allocate {sum(sizes.values()) / 2**20:.0f} MiB of shared "
                            f"memory for the ANE worker ({e}): free memory (or /dev/shm), use a "
                            "smaller model, or train with the ANE engine in this process, "
                            "`python hetero_gpt.py --ane_worker false`") from None
        self.flat = {k: np.ndarray((n,), np.float32, buffer=self.shm[k].buf) for k in ('w', 'g')}
        self.w = views(self.flat['w'], shapes)
        self.g = views(self.flat['g'], shapes)
        self.batch = np.ndarray((2, B, T), np.int64, buffer=self.shm['batch'].buf)
        self.names = {k: m.name for k, m in self.shm.items()}

    def close(self):
        self.flat = self.w = self.g = self.batch = None  # views first: they block close
        for m in self.shm.values():
            try:
                m.close()
            except BufferError:  # a view still held; unmapped at exit
                pass
            if self.owner:
                m.unlink()
        self.shm = {}


CPU_THREADS = torch.get_num_threads()  # PyTorch's default at start, one per core


def share_cores(gpu_on_cpu):
    """(the worker's CPU threads, this process's); the caller sets them:
    - GPU engine on the CPU: half the cores each;
    - else: the worker gets all cores but one, left to the thread that feeds the GPU, and this
      process as many for its copy of the gradients, made while the worker waits. With one
      per core, the copy's thread on the feeding thread's core finishes last
      (benchmarks/RESULTS.md section 15)."""
    threads = max(1, CPU_THREADS // 2 if gpu_on_cpu else CPU_THREADS - 1)
    return threads, max(1, CPU_THREADS - threads) if gpu_on_cpu else threads


def exit_with_parent():
    """Ends the worker once the trainer is gone, even mid-call."""
    multiprocessing.parent_process().join()  # a pipe end only the trainer holds
    os._exit(1)


def serve(conn, names, spec, make):
    """The worker's loop:
    ('run', b, loss scale, new weights?) -> ('done', loss, peak, seconds, max_rss)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the trainer handles it
    threading.Thread(target=exit_with_parent, daemon=True, name='exit-with-parent').start()
    try:
        torch.set_num_threads(spec.threads)
        bufs = Buffers(spec.shapes, spec.max_batch, spec.T, names)
        engine = make(spec)
        params = {k: torch.from_numpy(v) for k, v in bufs.w.items()}
        conn.send(('ready', f"{engine.label} in worker process {os.getpid()}"))
    except BaseException as e:
        conn.send(('error', one_line(e)))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the training process is gone
            return
        if msg[0] == 'stop':
            return
        _, b, scale, new_weights = msg
        try:
            t0 = time.perf_counter()
            if new_weights:
                engine.load_weights(params)
            engine.scaler.scale = scale
            engine.scaler.peak = 0.0
            batch = (torch.from_numpy(bufs.batch[i, :b]) for i in (0, 1))
            loss, grads = engine.loss_and_grads(*batch)
            for k, g in grads.items():
                np.copyto(bufs.g[k], g.numpy())
            seconds = time.perf_counter() - t0
            conn.send(('done', float(loss), engine.scaler.peak, seconds, max_rss()))
        except Exception as e:
            conn.send(('error', one_line(e)))


_live = weakref.WeakSet()  # every worker up, for close_all


def close_all():
    for engine in list(_live):
        engine.close()


progress.ON_INTERRUPT.append(close_all)


class Link:
    """What stopping a worker needs: its process, pipe and buffers, and whether a call is
    under way. The finalizer holds this, not the engine."""

    def __init__(self, proc, conn, bufs):
        self.proc = proc
        self.conn = conn
        self.bufs = bufs
        self.lock = threading.Lock()  # one sender on the pipe at a time
        self.busy = False  # a call or the start is under way
        self.closed = False


class WorkerEngine:
    """The ANE engine, seen from the training process: the trainer's Engine interface over a
    worker that runs the engine make(spec) builds. make is a module-level function (or a partial
    of one), which spawn sends by name. Timeouts:
    - the first answer (start and load, on a Mac the Neural Engine compile): load_timeout;
    - later calls: timeout_factor x the slowest call per sequence so far, at least min_timeout.
    close() may come from another thread during a call: the call then ends with WorkerFault."""
    name = 'ane'
    device = torch.device('cpu')

    def __init__(self, spec, make, scaler, log=print, load_timeout=3600.0, timeout_factor=10.0,
                 min_timeout=60.0):
        self.scaler = scaler
        self.spec = spec
        self.shapes = spec.shapes  # worked out once
        self.load_timeout = load_timeout
        self.factor = timeout_factor
        self.min_timeout = min_timeout
        self.label = f"ANE worker ({spec.evaluator})"
        self.new_weights = False
        self.seconds = None  # the worker's seconds for the last call
        self.slowest = 0.0  # its slowest seconds per sequence
        self.max_rss = None  # its peak resident memory, bytes
        self.bufs = Buffers(self.shapes, spec.max_batch, spec.T)
        ctx = multiprocessing.get_context('spawn')
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, self.bufs.names, spec, make),
                                name='ane-worker', daemon=True)
        self.link = Link(self.proc, self.conn, self.bufs)
        # stopped when this engine is freed or at exit
        self._stop = weakref.finalize(self, _shutdown, self.link)
        _live.add(self)
        what = "starting the ANE worker"
        if ON_MAC:
            log(f"{what}: it compiles the Core ML programs for the Neural Engine, which the first "
                "time may take many minutes (Ctrl-C stops it safely); later starts load them "
                "from the cache")
            what += " (compiling for the Neural Engine)"
        try:
            with progress.Ticker(what):
                with progress.children_ignore_ctrl_c():  # the trainer stops it
                    self.proc.start()
                child.close()
                self.link.busy = True  # a close during the compile kills it
                (self.label,) = self._wait(load_timeout, 'starting')
                self.link.busy = False
        except (WorkerFault, OSError) as e:
            self.close()
            text = (f"the ANE worker could not start: {e}; "
                    "`python hetero_gpt.py --mode gpu` trains without it")
            raise UserError(text) from None
        except KeyboardInterrupt:  # Ctrl-C during the compile
            self.close()
            raise

    def load_weights(self, params):
        w = self.bufs.w
        if {k: tuple(p.shape) for k, p in params.items()} != {k: v.shape for k, v in w.items()}:
            raise UserError(f"the ANE worker was started for another model ({self.spec.cfg})")
        # one call a step, so the GIL is released once
        # why: benchmarks/RESULTS.md section 15
        with torch.no_grad():
            torch._foreach_copy_([torch.from_numpy(v) for v in w.values()], [params[k] for k in w])
        self.new_weights = True

    def loss_and_grads(self, idx, targets):
        b, t = idx.shape
        if b > self.spec.max_batch or t != self.spec.T:
            raise UserError(f"the ANE worker takes up to {self.spec.max_batch}x{self.spec.T} "
                            f"tokens a call, not {b}x{t}")
        link = self.link
        with link.lock:  # these views keep the memory mapped past close()
            closed = link.closed
            if not closed:
                batch = link.bufs.batch
                grads = link.bufs.flat['g']
        if closed:
            raise self._fault("is not running (it stopped at an earlier fault)")
        if not link.proc.is_alive():
            raise self._fault(f"is not running ({exit_text(link.proc.exitcode)})")
        for i, t in enumerate((idx, targets)):
            np.copyto(batch[i, :b], t.cpu().numpy())
        with link.lock:  # close() sends 'stop' under this lock too
            sent = not link.closed
            if sent:
                link.busy = True
                link.conn.send(('run', b, float(self.scaler.scale), self.new_weights))
        if not sent:
            raise self._fault("was stopped")
        self.new_weights = False
        # the gradients' new home, faulted in while the worker computes
        # NumPy memory gets huge pages on Linux
        # fill runs on one thread, without the GIL
        # so the copy below only copies (RESULTS.md section 15)
        try:
            flat = np.empty_like(grads)
            flat.fill(0)
        except BaseException:  # the worker's answer would be left unread
            self.close()
            raise
        if self.seconds is None:
            timeout = self.load_timeout
        else:
            timeout = max(self.min_timeout, self.factor * b * self.slowest)
        loss, peak, seconds, self.max_rss = self._wait(timeout, f"computing {b} sequences")
        link.busy = False
        self.seconds = seconds
        self.slowest = max(self.slowest, seconds / b)
        self.scaler.peak = max(self.scaler.peak, peak)
        # one copy of the whole block: copy_ releases the GIL
        # taking it back beside a busy thread waits a switch interval
        # from_numpy and views keep the GIL (RESULTS.md section 15)
        torch.from_numpy(flat).copy_(torch.from_numpy(grads))
        grads = {k: torch.from_numpy(v) for k, v in views(flat, self.shapes).items()}
        return torch.tensor(loss), grads

    def _wait(self, timeout, what):
        """The worker's answer, waiting without the GIL (a pipe's poll); a fault if none comes."""
        link = self.link
        proc = link.proc
        conn = link.conn
        deadline = time.monotonic() + timeout
        while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if link.closed:
                raise self._fault(f"was stopped while {what}")
            if not proc.is_alive() and not conn.poll(0):
                raise self._fault(f"died while {what} ({exit_text(proc.exitcode)})")
            if time.monotonic() >= deadline:  # killed: a hung worker reads no 'stop'
                proc.kill()
                raise self._fault(f"did not finish {what} within {timeout:.0f} s, so it was "
                                  "stopped")
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # it is gone
            if link.closed:
                raise self._fault(f"was stopped while {what}") from None
            proc.join(5)  # reaped, for its exit status
            raise self._fault(f"died while {what} ({exit_text(proc.exitcode)})") from None
        if msg[0] == 'error':
            raise self._fault(f"raised while {what}: {msg[1]}")
        return msg[1:]

    def _fault(self, text):
        self.close()
        hint = ''
        if ON_MAC and 'SIGKILL' in text:
            hint = ("; on a Mac that is what a failed Neural Engine compile does at the first "
                    "predict (coremltools #2758), and a smaller --ane_batch_size makes smaller "
                    "programs")
        return WorkerFault(f"{self.label} {text}{hint}; `python export_ane.py --check` tests the "
                           "ANE path alone")

    def close(self):
        """Stops the worker and frees the shared memory; idempotent, from any thread. A Ctrl-C
        meanwhile is ignored: a close cut short would leave both behind."""
        with progress.hold_ctrl_c():
            self._stop()
        self.proc = self.bufs = None


def _shutdown(link):  # weakref.finalize calls it at most once per worker
    proc = link.proc
    with link.lock:
        link.closed = True
        ask = proc.pid is not None and proc.is_alive() and not link.busy
        if ask:
            try:
                link.conn.send(('stop',))
            except OSError:
                pass
    if ask:
        proc.join(5)
    if proc.is_alive():  # busy or deaf: killed at once
        proc.kill()
        proc.join()
    link.bufs.close()


def set_process_threads(run):
    """This process's CPU threads and GIL switch interval for run's engines. Returns the
    ANE worker's threads."""
    threads = CPU_THREADS  # every core, unless the ANE engine shares them
    ane_threads = 1
    if run.mode != 'gpu' and run.ane_in_worker:
        ane_threads, threads = share_cores(run.device.type == 'cpu')
        sys.setswitchinterval(SWITCH_S)  # a worker's answer waits about 0.5 ms for the GIL, not 5
    elif run.mode == 'hetero' and not run.ane_programs and run.ane_device.type == 'cpu':
        if run.device.type != 'cpu':
            threads = share_cores(gpu_on_cpu=False)[1]  # a core left to the GPU's feeder
    torch.set_num_threads(threads)
    return ane_threads
