"""
The ANE engine in a worker process of its own.

Core ML's predict and its model load hold the GIL for the whole call (coreml_and_ane.md section 1):
in a thread of the training process, every Core ML call would stop the GPU engine's Python,
and the two engines would take turns. So the ANE engine (hetero_gpt.CoreMLEngine: its
programs, chained, and the host's sparse work around them) runs in a worker process,
started with spawn (Objective-C frameworks do not survive fork). The training process
exchanges with it once per microbatch, through shared memory allocated once: the weights
(fp32, written once per step), the batch (int64) and the gradients (fp32). The engine's
thread waits on a pipe, which releases the GIL.

A worker that dies (even by SIGKILL: a failed ANE compile kills the process at its first
predict, coremltools #2758), that does not answer within its timeout, or that raises,
raises WorkerFault here: HeteroStep retires the engine and the GPU engine runs its share.

Off macOS the same worker runs behind the same interface with a stand-in for Core ML: the
eager derivation on the CPU (speed) or the exported programs in NumPy (checks), so the
process boundary, the buffers, the timeouts and every fault path run everywhere.
"""
import dataclasses
import importlib
import math
import multiprocessing
import os
import signal
import time
import weakref
from multiprocessing import shared_memory

import numpy as np
import torch

import hetero_gpt as hg
from settings import one_line  # an exception in one line, Core ML's included


class WorkerFault(RuntimeError):
    """The worker died, hung or raised: the step retires the engine, the GPU takes its share."""




def exit_text(code):
    if code is None:
        return "still running"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class Buffers:
    """The shared memory of one worker, allocated once: weights and gradients (fp32, by
    nanoGPT's names and shapes, in one flat block each) and a batch (int64 idx and targets,
    (2, B, T) for up to B sequences). The training process creates them (names None);
    the worker attaches to them by name."""

    def __init__(self, cfg, B, T, names=None):
        shapes = {k: tuple(p.shape) for k, p in hg.GPT_param_shapes(cfg).items()}
        n = sum(math.prod(s) for s in shapes.values())
        sizes = dict(w=4 * n, g=4 * n, batch=8 * 2 * B * T)
        self.shm, self.owner = {}, names is None
        try:
            if self.owner and os.path.isdir('/dev/shm'):  # Linux: a full tmpfs fails at the first write (SIGBUS)
                st = os.statvfs('/dev/shm')
                if st.f_bavail * st.f_frsize < sum(sizes.values()):
                    raise OSError(f"/dev/shm has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free")
            for k, size in sizes.items():
                self.shm[k] = (shared_memory.SharedMemory(create=True, size=size) if self.owner
                               else shared_memory.SharedMemory(name=names[k]))
        except OSError as e:
            self.close()
            raise hg.UserError(f"could not allocate {sum(sizes.values()) / 2**20:.0f} MiB of shared memory for the "
                               f"ANE worker ({e}): free memory (or /dev/shm), use a smaller model, or run the ANE "
                               "engine in this process with --ane_worker false") from None
        self.w, self.g = (self._views(self.shm[k], shapes) for k in ('w', 'g'))
        self.batch = np.ndarray((2, B, T), np.int64, buffer=self.shm['batch'].buf)
        self.names = {k: m.name for k, m in self.shm.items()}

    @staticmethod
    def _views(m, shapes):
        flat, out, off = np.ndarray((m.size // 4,), np.float32, buffer=m.buf), {}, 0
        for k, s in shapes.items():
            out[k] = flat[off:off + math.prod(s)].reshape(s)
            off += math.prod(s)
        return out

    def close(self):
        self.w = self.g = self.batch = None  # the views first: a buffer with views cannot close
        for m in self.shm.values():
            try:
                m.close()
            except BufferError:  # a view still held somewhere: the mapping goes with the process
                pass
            if self.owner:
                m.unlink()
        self.shm = {}


def worker_spec(cfg, device, dtype, log=print):
    """What the worker builds, from the run's Config: plain values, sent to the new process.
    Its CPU threads: all cores but one for the thread that feeds the GPU, or half of them
    when the GPU engine is on the CPU too (this process then keeps the other half)."""
    import export_ane
    threads = max(1, hg.CPU_THREADS // 2 if device.type == 'cpu' else hg.CPU_THREADS - 1)
    if device.type == 'cpu':
        torch.set_num_threads(max(1, hg.CPU_THREADS - threads))
    evaluator = 'coreml' if hg.ON_MAC else cfg.ane_evaluator
    return dict(cfg=dataclasses.asdict(hg.model_config(cfg)), B=export_ane.ane_batch(cfg), T=cfg.block_size,
                max_batch=cfg.batch_size, evaluator=evaluator, dtype=str(dtype).split('.')[-1], threads=threads,
                programs=None if evaluator == 'eager' else export_ane.ensure_programs(cfg, log))


def eager_predict(cfg, B, T, dtype):
    """The ANE's programs as the derivation run eagerly by PyTorch on the CPU: run_piece(TorchOps)."""
    o = hg.TorchOps(dtype, torch.device('cpu'))

    @torch.no_grad()
    def predict(piece, inputs):
        out = hg.run_piece(o, cfg, B, T, piece, {k: torch.from_numpy(v).to(dtype) for k, v in inputs.items()})
        return {k: v.float().numpy() for k, v in out.items()}
    return predict


def make_engine(spec):
    """The worker's CoreMLEngine. spec['predict'], 'module:function', names another evaluator:
    function(cfg, B, T, spec) -> predict (tests use it to fault on purpose)."""
    import export_ane
    cfg, B, T = hg.GPTConfig(**spec['cfg']), spec['B'], spec['T']
    pieces, where = hg.ANE_PIECES, f"in worker process {os.getpid()}"
    if spec.get('predict'):
        module, name = spec['predict'].split(':')
        predict, label = getattr(importlib.import_module(module), name)(cfg, B, T, spec), f"{spec['predict']} {where}"
    elif spec['evaluator'] == 'eager':
        dtype = getattr(torch, spec['dtype'])
        predict, label = eager_predict(cfg, B, T, dtype), f"eager derivation on cpu ({spec['dtype']}) {where}"
    else:  # Core ML on macOS (compiling at the first start), the NumPy evaluator elsewhere
        pieces = export_ane.read_programs_meta(spec['programs'])['pieces']
        predict = hg.coreml_predict_fn(spec['programs'], pieces)
        label = f"Core ML programs {spec['programs']}{'' if hg.ON_MAC else ' (NumPy evaluator)'} {where}"
    return hg.CoreMLEngine(cfg, B, T, predict, pieces, scaler=hg.LossScaler(1.0, 0), label=label)


def serve(conn, names, spec):
    """The worker's loop: ('run', b, loss scale, new weights?) -> ('done', loss, peak, seconds)."""
    try:
        torch.set_num_threads(spec['threads'])
        bufs = Buffers(hg.GPTConfig(**spec['cfg']), spec['max_batch'], spec['T'], names)
        engine = make_engine(spec)
        params = {k: torch.from_numpy(v) for k, v in bufs.w.items()}
        conn.send(('ready', engine.label))
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
            engine.scaler.scale, engine.scaler.peak = scale, 0.0
            loss, grads = engine.loss_and_grads(*(torch.from_numpy(bufs.batch[i, :b]) for i in (0, 1)))
            for k, g in grads.items():
                np.copyto(bufs.g[k], g.numpy())
            conn.send(('done', float(loss), engine.scaler.peak, time.perf_counter() - t0))
        except Exception as e:
            conn.send(('error', one_line(e)))


class WorkerEngine(hg.Engine):
    """The ANE engine, seen from the training process: the Engine interface over a worker.
    The first answer (start and load: on a Mac the Neural Engine compile) may take up to
    load_timeout; later calls get timeout_factor times the slowest call per sequence so far,
    at least min_timeout seconds."""
    name = 'ane'
    device = torch.device('cpu')

    def __init__(self, spec, scaler, log=print, load_timeout=3600.0, timeout_factor=10.0, min_timeout=60.0):
        self.cfg, self.scaler, self.spec = hg.GPTConfig(**spec['cfg']), scaler, spec
        self.load_timeout, self.factor, self.min_timeout = load_timeout, timeout_factor, min_timeout
        self.label, self.new_weights = f"ANE worker ({spec['evaluator']})", False
        self.seconds, self.slowest = None, 0.0  # the worker's own time of the last call; the slowest a sequence
        self.bufs = Buffers(self.cfg, spec['max_batch'], spec['T'])
        ctx = multiprocessing.get_context('spawn')
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, self.bufs.names, spec), name='ane-worker', daemon=True)
        # stopped when this engine is freed, or at exit (a finalizer that holds no reference to it)
        self._stop = weakref.finalize(self, _shutdown, self.proc, self.conn, self.bufs)
        if hg.ON_MAC:
            log("starting the ANE worker: it compiles the Core ML programs for the Neural Engine, which the "
                "first time may take many minutes; later starts load them from the cache")
        try:
            self.proc.start()
            child.close()
            (self.label,) = self._wait(load_timeout, 'starting')
        except (WorkerFault, OSError) as e:
            self.close()
            raise hg.UserError(f"the ANE worker could not start: {e}; --mode gpu trains without it") from None

    def load_weights(self, params):
        w = self.bufs.w
        if {k: tuple(p.shape) for k, p in params.items()} != {k: v.shape for k, v in w.items()}:
            raise hg.UserError(f"the ANE worker was started for another model ({self.cfg})")
        for k, p in params.items():  # once per step; the worker reads them at its next call
            torch.from_numpy(w[k]).copy_(p.detach())
        self.new_weights = True

    def loss_and_grads(self, idx, targets):
        b, t = idx.shape
        if b > self.spec['max_batch'] or t != self.spec['T']:
            raise hg.UserError(f"the ANE worker takes up to {self.spec['max_batch']}x{self.spec['T']} tokens a "
                               f"call, not {b}x{t}")
        if self.proc is None or not self.proc.is_alive():
            raise self._fault("is not running (it stopped at an earlier fault)" if self.proc is None else
                              f"is not running ({exit_text(self.proc.exitcode)})")
        for i, t in enumerate((idx, targets)):
            np.copyto(self.bufs.batch[i, :b], t.cpu().numpy())
        self.conn.send(('run', b, float(self.scaler.scale), self.new_weights))
        self.new_weights = False
        timeout = max(self.min_timeout, self.factor * b * self.slowest) if self.seconds is not None else self.load_timeout
        loss, peak, seconds = self._wait(timeout, f"computing {b} sequences")
        self.seconds, self.slowest = seconds, max(self.slowest, seconds / b)
        self.scaler.peak = max(self.scaler.peak, peak)
        return torch.tensor(loss), {k: torch.from_numpy(v).clone() for k, v in self.bufs.g.items()}

    def _wait(self, timeout, what):
        """The worker's answer, waiting without the GIL (a pipe's poll); a fault if none comes."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise self._fault(f"died while {what} ({exit_text(self.proc.exitcode)})")
            if time.monotonic() >= deadline:
                raise self._fault(f"did not finish {what} within {timeout:.0f} s, so it was stopped")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):  # it is gone: its exit status comes once it is reaped
            self.proc.join(5)
            raise self._fault(f"died while {what} ({exit_text(self.proc.exitcode)})") from None
        if msg[0] == 'error':
            raise self._fault(f"raised while {what}: {msg[1]}")
        return msg[1:]

    def _fault(self, text):
        self.close()
        hint = ("; on a Mac that is what a failed Neural Engine compile does at the first predict (coremltools "
                "#2758), and a smaller --ane_batch_size makes smaller programs") if hg.ON_MAC and 'SIGKILL' in text else ''
        return WorkerFault(f"{self.label} {text}{hint}; `python export_ane.py --check` tests the ANE path alone")

    def close(self):
        """Stops the worker (asked first, then killed) and frees the shared memory. Idempotent."""
        self._stop()
        self.proc = self.bufs = None


def _shutdown(proc, conn, bufs):
    if proc.pid is not None and proc.is_alive():
        try:
            conn.send(('stop',))
        except OSError:
            pass
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    bufs.close()


def overlap(cfg, gpu_batch, ane_batch, device, evaluator='eager', programs=None, gpu_iters=30, ane_iters=5,
            watts=False, dtype=torch.float32, ane_dtype='float32', threads=None, ane_microbatch=None):
    """The Mac's structure, timed: the GPU engine (autograd on `device`, gpu_batch sequences a
    microbatch) in this process, the worker (`evaluator`, ane_microbatch sequences a call, run
    ane_batch at a time) in its own; each alone, then each while the other computes, in one
    run. Medians in seconds: {gpu,ane}_{alone,beside}; exchange_{alone,beside}: this side's wall
    time per call minus the worker's own; with watts, each part's watts (powermetrics) alone."""
    import threading
    import energy
    ane_microbatch = ane_microbatch or gpu_batch
    torch.manual_seed(0)
    model = hg.GPT(cfg).to(device)
    gpu = hg.AutogradEngine(model, device, dtype)
    spec = dict(cfg=dataclasses.asdict(cfg), B=ane_batch, T=cfg.block_size, max_batch=ane_microbatch,
                evaluator=evaluator, dtype=ane_dtype, threads=threads or max(1, hg.CPU_THREADS - 1), programs=programs)
    w = WorkerEngine(spec, hg.LossScaler(1.0, 0, enabled=False))
    rand = lambda b: tuple(torch.randint(0, cfg.vocab_size, (b, cfg.block_size)) for _ in range(2))
    gb, ab = rand(gpu_batch), rand(ane_microbatch)
    w.load_weights(dict(model.named_parameters()))
    phase, exchanges = ['warm-up'], {}

    def timed(engine, batch, n, stop=None, seconds=0.0):  # n calls and `seconds`, or until stop is set
        out = []
        while len(out) < n or sum(out) < seconds or (stop is not None and not stop.is_set()):
            t0 = time.perf_counter()
            float(engine.loss_and_grads(*batch)[0])  # waits for the device (releases the GIL)
            out.append(time.perf_counter() - t0)
            if engine is w:
                exchanges.setdefault(phase[0], []).append(out[-1] - w.seconds)
            if stop is None and len(out) >= n and sum(out) >= seconds:
                break
        return out

    try:
        timed(gpu, gb, 3), timed(w, ab, 1)  # warm-up: kernels, the allocator, the worker's first call
        phase[0], res, power = 'alone', {}, {}
        for name, engine, batch, n in (('gpu', gpu, gb, gpu_iters), ('ane', w, ab, ane_iters)):
            meter = energy.PowermetricsMeter() if watts else None
            t0, before = time.perf_counter(), dict(meter.parts) if meter else {}
            res[f'{name}_alone'] = timed(engine, batch, n, seconds=3.0 if meter else 0.0)  # (a dozen samples)
            if meter:
                dt = time.perf_counter() - t0
                power[f'{name}_alone_watts'] = {k: round((v - before.get(k, 0.0)) / dt, 2) for k, v in meter.parts.items()}
                meter.close()
        phase[0] = 'beside'
        for busy, measured in (((w, ab), (gpu, gb, gpu_iters, 'gpu')), ((gpu, gb), (w, ab, ane_iters, 'ane'))):
            stop = threading.Event()
            bg = threading.Thread(target=timed, args=(*busy, 1, stop))
            bg.start()
            time.sleep(0.5)  # the other engine well under way
            res[f'{measured[3]}_beside'] = timed(*measured[:3])
            stop.set()
            bg.join()
    finally:
        w.close()
    out = {k: float(np.median(v)) for k, v in res.items()}
    out |= {f'{k}_spread': float(np.std(v) / np.median(v)) for k, v in res.items() if k.endswith('alone')}
    out |= {f'exchange_{k}': float(np.median(v)) for k, v in exchanges.items() if k != 'warm-up'}
    return out | power | dict(gpu_label=gpu.label, ane_label=w.label)
