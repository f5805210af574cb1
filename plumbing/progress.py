"""
What a person sees while a run works: a live elapsed time where progress cannot be counted
(a compile, a first step), the projected time to the end, a log line per logged step, and
Ctrl-C as one line and exit code 130. And what the run logs: metrics.jsonl's rows.
"""
import contextlib
import dataclasses
import json
import math
import os
import shlex
import signal
import sys
import threading
import time

from tqdm import tqdm

from .distributed import gather, world
from .memory import measured
from .settings import one_line

tqdm.monitor_interval = 0  # no monitor thread: every thread a run starts ends with it

INTERRUPTED = 130  # a shell's code for a process stopped by SIGINT (128 + 2)
QUIET_ENV = 'HETEROGPT_NO_TICKER'  # set in processes whose parent shows the time


def clock(seconds):
    """3725.0 -> '1h 02m', 83.0 -> '1m 23s', 4.2 -> '4s'."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


LIVE = set()  # the Tickers running now


class Ticker:
    """A thread that shows `what` and the time since it began: redrawn each second on one line
    of a terminal, else a line every `every` seconds. `what` may change (ticker.what = ...)."""

    def __init__(self, what, stream=None, every=15.0, tick=1.0):
        self.what, self.stream, self.every, self.tick = what, stream or sys.stderr, every, tick
        self.tty = self.stream.isatty() if hasattr(self.stream, 'isatty') else False
        self.t0, self.done, self.thread = time.monotonic(), threading.Event(), None

    def clear(self):
        """Clears the timer's line, so that a message printed now starts a line of its own."""
        if self.tty:
            self._write("\r\x1b[K")

    def __enter__(self):
        LIVE.add(self)
        if not os.environ.get(QUIET_ENV):
            self.thread = threading.Thread(target=self._run, daemon=True, name='ticker')
            self.thread.start()
        return self

    def _run(self):
        shown = 0.0
        while not self.done.wait(self.tick if self.tty else min(self.tick, self.every)):
            t = time.monotonic() - self.t0
            if self.tty:
                self._write(f"\r\x1b[K{self.what}: {clock(t)}")
            elif t - shown >= self.every:
                shown = t
                self._write(f"{self.what}: {clock(t)} so far\n")

    def _write(self, text):
        try:
            self.stream.write(text)
            self.stream.flush()
        except (ValueError, OSError):  # the stream closed under us at exit
            self.done.set()

    def __exit__(self, *exc):
        LIVE.discard(self)
        self.done.set()
        if self.thread:
            self.thread.join()
            if self.tty:
                self._write("\r\x1b[K")
        return False

    @property
    def seconds(self):
        return time.monotonic() - self.t0


class Display:
    """What a person sees of the loop: a progress bar (or a line per logged row), a live timer
    while the first step compiles and warms up, and one projected time to the end. The
    projection counts wall time, evaluations and checkpoints included, from the steps after
    the first; it is said once, as a line, and shown on the bar."""

    def __init__(self, cfg, prog, rank=0, log=print, after=3):
        self.total = cfg.max_iters
        self.start = prog.it
        self.rank = rank
        self.log = log if rank == 0 else None
        self.after = after  # steps timed before a projection
        self.tok_mb = cfg.batch_size * cfg.block_size
        self.t1 = None  # wall time at the end of the first step
        self.said = False
        self.postfix = {}  # what the bar shows beside it, kept between logged rows
        disable = no_bar(cfg.quiet) or rank != 0
        fmt = '{desc} |{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]'  # (no %: n/total says it)
        self.bar = tqdm(total=self.total, initial=prog.it, disable=disable, dynamic_ncols=True,
                        desc='train', bar_format=fmt)
        self.ticker = None
        if prog.it < self.total and rank == 0:
            self.ticker = Ticker("train: the first step (compiling, warming up)").__enter__()

    def stepped(self, prog, row, result):
        """After each step: the bar moved, the row shown, the projection once it is known."""
        if self.ticker:
            self.ticker.__exit__(None, None, None)
            self.ticker = None
        now = time.monotonic()
        if self.t1 is None:
            self.t1 = now
        left = self.left(prog.it, now)
        self.postfix |= {SHOWN[k][0]: SHOWN[k][1](v) for k, v in row.items() if k in SHOWN}
        self.postfix['norm'] = f'{result.grad_norm:.2g}'  # every step's, before clipping
        if left is not None:
            self.postfix['eta'] = clock(left)
        self.bar.set_postfix(self.postfix, refresh=False)
        if row and self.bar.disable and self.rank == 0:
            print(log_line(row, self.total), flush=True)
        if left is not None and not self.said and self.log:
            self.said = True
            self.log(self.projection(prog.it, now, left, result))
        self.bar.update(1)

    def left(self, it, now):
        """Seconds to max_iters at the pace of the steps after the first, or None yet."""
        done = it - self.start - 1
        if done < self.after or it >= self.total:
            return None
        return (self.total - it) * (now - self.t1) / done

    def projection(self, it, now, left, result):
        done = it - self.start - 1
        rate = done * self.tok_mb * result_microbatches(result) / (now - self.t1)
        per = ', '.join(f"{n} {v:,.0f}" for n, (v, _) in shares(result.shares, self.tok_mb).items())
        end = time.strftime('%H:%M', time.localtime(time.time() + left))
        alone = f" (alone in its share: {per})" if per else ''
        return (f"projected: {rate:,.0f} tokens/s{alone}; the {self.total - it:,} steps left to "
                f"--max_iters {self.total} take {clock(left)} with evaluations and checkpoints "
                f"(until about {end}); --patience may stop it sooner")

    def close(self):
        if self.ticker:
            self.ticker.__exit__(None, None, None)
            self.ticker = None
        self.bar.close()


# the row's values the bar shows: short names and numbers, so a 110-column terminal shows all
SHOWN = dict(loss=('loss', lambda v: f'{v:.3f}'), val_loss=('val', lambda v: f'{v:.3f}'),
             tokens_per_s=('tok/s', lambda v: f'{v / 1000:.0f}k'),
             ane_microbatches=('ane', str),
             joules_per_token=('mJ/tok', lambda v: f'{1000 * v:.2g}'))


def result_microbatches(result):
    """Microbatches a step ran on this rank, every engine's."""
    return sum(share.n for share in result.shares.values())


def shares(results, tok_per_microbatch):
    """Each engine's tokens/s and mean loss over its share of a step: {engine: (rate, loss)}.
    The one reader of a step's shares."""
    return {n: (r.n * tok_per_microbatch / r.seconds, float(r.loss) / r.n)
            for n, r in results.items() if r.seconds}


class Metrics:
    """metrics.jsonl, a row per logged step (rank 0's file; the other ranks' rows go nowhere).
    Rates are over training time since the row before: evaluations and checkpoints excluded."""

    def __init__(self, cfg, rank, engines, step, meter, prog):
        self.cfg = cfg
        self.device = step.device
        self.engines = engines
        self.step = step
        self.meter = meter
        path = os.path.join(cfg.out_dir, 'metrics.jsonl') if rank == 0 else os.devnull
        self.file = open(path, 'a')
        self.last = prog.elapsed, prog.tokens, prog.joules  # the last row's clock, tokens and joules
        self.tracker = Tracker(cfg) if rank == 0 and cfg.wandb_log else None

    def row(self, prog, lr, out):
        """A logged step's row: the step's values, and this rank's own; under torchrun, every
        rank's own, gathered (a collective: every rank calls this at every logged step)."""
        (t, tokens, joules), cfg, step = self.last, self.cfg, self.step
        row = dict(step=prog.it, loss=out.loss, lr=lr, tokens=prog.tokens,
                   tokens_per_s=(prog.tokens - tokens) / (prog.elapsed - t), elapsed=prog.elapsed, mode=cfg.mode,
                   grad_norm=out.grad_norm, memory=measured(self.device, self.engines.get('ane')))
        own = dict(ane_microbatches=out.ane_share, microbatches=step.split.microbatches, dropped=dict(step.dropped),
                   skipped=step.skipped)
        for n, (rate, loss) in shares(out.shares, cfg.batch_size * cfg.block_size).items():
            own |= {f'{n}_tokens_per_s': rate, f'{n}_loss': loss}  # each engine's own mean loss: a check on the other
        if 'ane' in self.engines:
            own['loss_scale'] = self.engines['ane'].scaler.scale
        if self.meter.meters:  # a meter ran: the steps' joules, as their seconds
            own['joules_per_token'] = (prog.joules - joules) / (prog.tokens - tokens)
        self.last = prog.elapsed, prog.tokens, prog.joules
        return row | (own if world()[1] == 1 else dict(ranks=gather(own)))

    def write(self, row):  # a row, if any, flushed: a resumed run reads it
        if row:
            self.file.write(json.dumps(row) + '\n')
            self.file.flush()
            if self.tracker:
                self.tracker.log(row)

    def close(self):
        self.file.close()
        if self.tracker:
            self.tracker.finish()


class Tracker:
    """--wandb_log, as nanoGPT's: the run's settings once, then metrics.jsonl's rows at the same
    steps, in a Weights & Biases run (WANDB_MODE=offline: files only). An error of wandb's stops
    its logging, said once; never the training."""

    def __init__(self, cfg):
        import wandb  # (settings.check found it at start)
        settings = dataclasses.asdict(cfg)
        self.run = self.guard(lambda: wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name,
                                                 config=settings))

    def guard(self, call):
        """call(), or None after one line if it raised: wandb logs no more."""
        try:
            return call()
        except Exception as e:
            say(f"wandb stopped logging ({one_line(e)}); training goes on, "
                "metrics.jsonl has every row")
            self.run = None
            return None

    def log(self, row):
        if self.run:
            self.guard(lambda: self.run.log(row, step=row['step']))

    def finish(self):
        if self.run:
            self.guard(self.run.finish)
            self.run = None


def say_plot_command(out_dir):
    """How to draw a run's curves, in a line, where tools/plot.py is (a fork may delete it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, 'tools', 'plot.py')):
        print(f"its curves as a picture: python -m tools.plot {shlex.quote(out_dir)}")


def with_val(row, prog, val):
    """row, or a row of its own, with an evaluation's loss and perplexity."""
    row = row or dict(step=prog.it, tokens=prog.tokens, elapsed=prog.elapsed)
    return row | dict(val_loss=val, val_ppl=math.exp(min(val, 50)))


def logger(rank):
    """Where the loop's messages go: above the bar on rank 0; stderr, named, on the others."""
    if rank == 0:
        return say
    return lambda s: print(f"rank {rank}: {s}", file=sys.stderr)


def say(text):
    """A line above the bar, after a live timer's line is cleared (never glued to it)."""
    for ticker in list(LIVE):
        ticker.clear()
    tqdm.write(text)


def no_bar(quiet):
    """No progress bar when asked, or when stdout is not a terminal (a file, a pipe): lines then."""
    return quiet or not sys.stdout.isatty()


def header(model, mode, engines, meter):
    """The run's first lines: its size and mode, each engine, the energy meter."""
    size = sum(p.numel() for p in model.parameters()) / 1e6
    lines = [f"GPT-2 {size:.2f}M parameters, mode {mode}"]
    lines += [f"  {n}: {e.label}" for n, e in engines.items()]
    lines.append(f"  {meter_text(meter)}")
    return '\n'.join(lines)


def meter_text(meter):
    if meter.meters or not meter.missing:
        return f"energy meter: {meter.name}"
    sudo = any('sudo' in m for m in meter.missing)  # (powermetrics needs root)
    return (f"energy meter: none, so no J/token ({'; '.join(meter.missing)})"
            + ("; `sudo -v` just before the run gives it" if sudo else ''))


def log_line(row, total):
    """A logged step as one line of text (nanoGPT's style), for a log that is not a terminal."""
    parts = [f"step {row['step']}/{total}"]
    if 'loss' in row:
        parts.append(f"loss {row['loss']:.4f}")
    if 'val_loss' in row:
        parts.append(f"val {row['val_loss']:.4f}")
    if 'grad_norm' in row:
        parts.append(f"norm {row['grad_norm']:.4f}")
    if 'tokens_per_s' in row:
        eng = ', '.join(f"{k[:-len('_tokens_per_s')]} {row[k]:,.0f}" for k in row
                        if k.endswith('_tokens_per_s') and k != 'tokens_per_s')
        parts.append(f"{row['tokens_per_s']:,.0f} tokens/s" + (f" ({eng})" if eng else ''))
    if 'ane_microbatches' in row and row.get('mode') != 'gpu':
        parts.append(f"ANE {row['ane_microbatches']}/{row['microbatches']} microbatches")
    if 'joules_per_token' in row:
        parts.append(f"{row['joules_per_token']:.3g} J/token")
    return ', '.join(parts)


ON_INTERRUPT = []  # what frees a process or memory at Ctrl-C (the ANE workers)
_stopped = []


def stop_run(save, where):
    """Training's Ctrl-C: `save()` keeps the run while a second Ctrl-C is ignored; one line.
    ctrl_c_exits then exits 130, at once if an engine's thread still computes."""
    text = f"interrupted: {where}; continue with --resume"
    with hold_ctrl_c():
        save()
    print(f"\n{text}", flush=True)
    _stopped.append(text)


@contextlib.contextmanager
def ctrl_c_exits():
    """Ctrl-C inside: one line and exit code 130, as after a run that stop_run stopped.
    SIGTERM and SIGHUP the same, with 143 and 129."""
    _stopped.clear()
    try:
        with stop_signals():
            yield
    except KeyboardInterrupt:
        interrupted()
    if _stopped:  # the workers stopped now, not by finalizers while the interpreter shuts down
        leave(exit_code())


class Stopped(KeyboardInterrupt):
    """SIGTERM (a kill, `timeout`) or SIGHUP (a closed terminal), raised as Ctrl-C is."""


_code = [INTERRUPTED]  # the exit code: 128 + the signal that stopped the run


def stop_like_ctrl_c(signum, frame):
    """A SIGTERM or SIGHUP handler: the run stops as at Ctrl-C, with 128 + signum."""
    _code[0] = 128 + signum
    raise Stopped(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals():
    """Inside, SIGTERM and SIGHUP stop the main thread as Ctrl-C does (Stopped)."""
    if threading.current_thread() is threading.main_thread():
        _code[0] = INTERRUPTED
    with handlers((signal.SIGTERM, signal.SIGHUP), stop_like_ctrl_c):
        yield


def exit_code():
    """130 after Ctrl-C, 143 after SIGTERM, 129 after SIGHUP."""
    return _code[0]


def interrupted(what="interrupted"):
    """After Ctrl-C: one line, then exit code 130 at once, without waiting for threads that
    still compute (a step's engines; their processes and memory were freed before)."""
    flush()
    print(f"\n{what}", file=sys.stderr, flush=True)
    leave(exit_code())


def leave(code):
    """The workers freed (a second Ctrl-C changes nothing now), then exit with code."""
    with hold_ctrl_c():
        for stop in ON_INTERRUPT:
            stop()
        exit_now_if_busy(code)
    sys.exit(code)


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):  # a stream closed under us
            pass


def exit_now_if_busy(code, wait=1.0):
    """Exits at once (os._exit) if a thread still computes a second from now: at exit,
    Python joins every thread, and an engine's may take minutes to finish its share."""
    deadline = time.monotonic() + wait
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    busy = [t for t in threading.enumerate() if t.is_alive() and not t.daemon
            and t is not threading.main_thread()]
    if busy:
        flush()
        os._exit(code)


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a run


@contextlib.contextmanager
def handlers(signums, handler):
    """Inside, handler for each of signums; the handlers before come back after. Only the main
    thread may set them: elsewhere nothing changes (yields None, else the handlers before)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    before = {s: signal.signal(s, handler) for s in signums}
    try:
        yield before
    finally:
        for s, old in before.items():
            signal.signal(s, old)


def children_ignore_ctrl_c():
    """Processes started inside ignore SIGINT from their first instruction (an ignored signal
    stays ignored across exec, and Python keeps it so): Ctrl-C reaches the terminal's whole
    group, and the parent stops its children in order, without their tracebacks."""
    return handlers((signal.SIGINT,), signal.SIG_IGN)


def hold_ctrl_c():
    """A second Ctrl-C (or SIGTERM, SIGHUP) while the first is being handled (a checkpoint
    saved) is ignored; the handlers come back after, so a caller that goes on can be stopped."""
    return handlers(STOPS, signal.SIG_IGN)


@contextlib.contextmanager
def defer_ctrl_c():
    """Ctrl-C (SIGTERM, SIGHUP) inside is raised as the block ends, not in the middle of it."""
    got = []
    with handlers(STOPS, lambda signum, frame: got.append(signum)) as before:
        yield
    if not got or before[got[0]] in (signal.SIG_IGN, None):
        return
    if before[got[0]] == signal.SIG_DFL:  # the signal's own default: sent again, now
        os.kill(os.getpid(), got[0])
    elif got[0] == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        before[got[0]](got[0], None)  # SIGTERM, SIGHUP: their handler, as if they came now
