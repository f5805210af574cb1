"""
Several HeteroEngine processes under torchrun: one per machine (on a Mac: its GPU and its
ANE), or one per GPU off a Mac. Without torchrun (no RANK in the environment) every
function here is a no-op and the trainer runs one process. The gradient averaging itself
stays in the trainer's step, which calls all_reduce_sum.

Which rank stopped a run: a collective that fails says only that some rank is gone (gloo:
"Connection closed by peer", or "Timed out" once --dist_timeout has passed), not which one.
So every rank keeps a counter in the key-value store torchrun already gives the ranks (at
MASTER_ADDR:MASTER_PORT; held by torchrun's agent, or by rank 0 when the ranks are started
without torchrun), and a thread of its own adds one to it every second. After a failure,
the ranks whose counter stands still for 3 s are the ones that died or hung. (A rank that
hangs inside a device call with Python's lock released still beats, and is not named; one
inside a single Core ML call of over 3 s, which holds the lock, would be named though alive.)
On one machine torchrun's agent stops the other ranks with SIGTERM once one has died; they
then say which rank stopped, too.
"""
import contextlib
import dataclasses
import datetime
import math
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from .settings import resolve_device


def world():
    """(rank, number of ranks): (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def join_ranks(cfg):
    """Under torchrun (it sets RANK, LOCAL_RANK, MASTER_ADDR, ...) joins the other ranks: NCCL
    when the GPU engine is on CUDA (rank r on cuda:LOCAL_RANK), gloo otherwise (CPU, and the
    Mac's MPS through host memory); the ranks but 0 write only what goes wrong, to stderr.
    (cfg for this rank, rank, world size)."""
    if 'RANK' not in os.environ:
        return (cfg, *world())
    device = resolve_device(cfg.device)
    if device.type == 'cuda' and device.index is None:
        cfg = dataclasses.replace(cfg, device=f"cuda:{os.environ['LOCAL_RANK']}")
        torch.cuda.set_device(cfg.device)
    if int(os.environ['RANK']):
        sys.stdout, cfg = open(os.devnull, 'w'), dataclasses.replace(cfg, quiet=True)
    dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo',
                            timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    start_heartbeat(dist.get_rank(), cfg.dist_timeout)
    return (cfg, *world())


def rank_share(microbatches):
    """This rank's contiguous share of a step's microbatches: [r*n//W, (r+1)*n//W)."""
    r, w = world()
    return microbatches[r * len(microbatches) // w:(r + 1) * len(microbatches) // w]


def all_reduce_sum(tensors):
    """Each tensor summed over the ranks: one all-reduce of one flat buffer, one network latency."""
    flat = torch.cat([t.flatten() for t in tensors])
    buf = flat.cpu() if dist.get_backend() == 'gloo' else flat  # gloo adds CPU tensors (MPS: via the host)
    dist.all_reduce(buf)
    return [b.view_as(t) for b, t in zip(buf.to(flat.device).split([t.numel() for t in tensors]), tensors)]


def sum_over_ranks(grads, n, loss, params):
    """A step's summed gradients ({name: tensor or None}), microbatch count and loss, each
    added over the ranks; as they are without torchrun. A rank with no usable share adds 0."""
    if world()[1] == 1:
        return grads, n, loss
    grads = {k: torch.zeros_like(p) if grads[k] is None else grads[k] for k, p in params.items()}
    device = next(iter(grads.values())).device
    count = torch.tensor([float(n)], device=device)
    loss = torch.as_tensor(loss, dtype=torch.float32, device=device).reshape(1)
    summed = all_reduce_sum(list(grads.values()) + [count, loss])
    grads = dict(zip(grads, summed))  # (zip stops at the gradients)
    return grads, round(summed[-2].item()), summed[-1][0]


def from_rank0(obj):
    """Rank 0's obj on every rank (a checkpoint, or fresh weights): all start from one state."""
    if world()[1] > 1:
        dist.broadcast_object_list(box := [obj])
        obj = box[0]
    return obj


def rank0_first(fn):
    """fn() on rank 0 first, then on the other ranks (what they all read, rank 0 makes)."""
    if world()[0] == 0:
        out = fn()
        from_rank0(None)
        return out
    from_rank0(None)
    return fn()


def gather(obj):
    """Every rank's obj, in rank order, on every rank ([obj] without torchrun)."""
    if world()[1] == 1:
        return [obj]
    dist.all_gather_object(objs := [None] * world()[1], obj)
    return objs


def check_same_weights(model, it):
    """Names the ranks whose weights parted from rank 0's, by an fp64 checksum of them. One
    AdamW step from one all-reduced gradient leaves them equal but for unlike machines' last
    bits; a missed step moves the checksum by far more than 1e-6."""
    if world()[1] == 1:
        return
    sums = gather(sum(float(p.sum() + p.square().sum()) for p in (q.detach().cpu().double()
                                                                  for q in model.parameters())))
    parted = [r for r, s in enumerate(sums) if not math.isclose(s, sums[0], rel_tol=1e-6)]
    if parted:
        raise RuntimeError(f"at step {it} the weights of ranks {parted} differ from rank 0's (checksums {sums})")


def leave():
    """Leaves the ranks' group, if this process joined one: at a run's end, or after Ctrl-C (every
    rank gets it). Called in a `finally`, it stays while an error goes up: exit_naming_stopped
    names the stopped ranks through the group, and leaving an NCCL group that lost a rank can hang."""
    error = sys.exc_info()[1]  # (what goes up through the caller's finally, if anything)
    if dist.is_initialized() and (error is None or isinstance(error, KeyboardInterrupt)
                                  or isinstance(error, SystemExit) and error.code == 130):  # (Ctrl-C mid-step)
        dist.destroy_process_group()


def store():
    return dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,
                         timeout=datetime.timedelta(seconds=5))


def start_heartbeat(rank, timeout):
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
