"""Which rank stopped a run under torchrun.

A collective that fails says only that some rank is gone (gloo: "Connection closed by
peer", or "Timed out" once --dist_timeout has passed), not which one. So every rank keeps
a counter in the key-value store that torchrun already gives the ranks (at
MASTER_ADDR:MASTER_PORT; held by torchrun's agent, or by rank 0 when the ranks are started
without torchrun) and a thread of its own adds one to it every second. After a failure,
the ranks whose counter stands still for 3 s are the ones that died or hung. (A rank that
hangs inside a device call with Python's lock released still beats, and is not named; one
inside a single Core ML call of over 3 s, which holds the lock, would be named though alive.)

On one machine torchrun's agent stops the other ranks with SIGTERM once one has died; they
then say which rank stopped, too. Without torchrun nothing here runs.
"""
import contextlib
import datetime
import os
import signal
import sys
import threading
import time

import torch.distributed as dist


def store():
    return dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,
                         timeout=datetime.timedelta(seconds=5))


def start(rank, timeout):
    """This rank's heartbeat; and on SIGTERM (torchrun stopping the ranks) the one line."""
    def beat(s):
        with contextlib.suppress(Exception):  # the store is gone, and with it the run
            while True:
                s.add(f'heartbeat/{rank}', 1)
                time.sleep(1)

    def stopped_by_torchrun(signum, frame):  # exits from here: no engine's error handling takes it
        exit_naming_stopped(RuntimeError("torchrun stopped this rank (SIGTERM)"), timeout)

    threading.Thread(target=beat, args=(store(),), daemon=True).start()
    signal.signal(signal.SIGTERM, stopped_by_torchrun)


def stopped(world, wait=3.0):
    """The ranks whose heartbeat did not move in `wait` seconds; [0] if the store is gone
    (it went with rank 0's machine, or with rank 0 itself when started without torchrun)."""
    try:
        s = store()
        seen = [s.add(f'heartbeat/{r}', 0) for r in range(world)]
        time.sleep(wait)
        return [r for r in range(world) if s.add(f'heartbeat/{r}', 0) == seen[r]]
    except RuntimeError:
        return [0]


def exit_naming_stopped(error, timeout):
    """Prints one line, `error: rank R: ranks [...] stopped ...: <error>`, and exits with 1;
    without torchrun (no process group), raises the error."""
    if not dist.is_initialized():
        raise error
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's, now: this line first, then the exit
    gone = stopped(dist.get_world_size())
    why = (f"ranks {gone} stopped (died, or hung past --dist_timeout {timeout:g} s; the last checkpoint is "
           "good: run the same command again with --resume): ") if gone else ''
    print(f"error: rank {dist.get_rank()}: {why}{error}".splitlines()[0], file=sys.stderr, flush=True)
    sys.exit(1)
