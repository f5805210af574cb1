"""Stand-in stages for ane_check's runner (tests/test_check.py): one of each way a stage ends."""
import os
import signal
import time


def ok(ctx):
    return {'seen': sorted(ctx['results'])}


def hang(ctx):
    time.sleep(3600)


def sigkill(ctx):  # as a failed ANE compile does at its first predict
    os.kill(os.getpid(), signal.SIGKILL)


def raises(ctx):
    raise ValueError("a stage's own error")


def closes_then_dies(ctx):  # its end of the pipe closed first: the runner sees EOF while it still lives
    import inspect
    inspect.currentframe().f_back.f_locals['conn'].close()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def deaf(ctx):  # busy in a call that no signal ends, as a Core ML compile in C
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    time.sleep(3600)


def skipped(ctx):
    return {'skipped': 'powermetrics needs root (sudo -v first)'}


if __name__ == '__main__':  # the check's main over these stages (a test sends it Ctrl-C): report, stages
    import functools
    import sys
    import hetero_gpt as hg
    from tools import ane_check
    names = ('first', 'second', 'third')
    ane_check.STAGES = tuple((n, False, f'stand-in {n}') for n in names)
    second = os.environ.get('CHECK_STAGES_SECOND', 'hang')  # how the second stage spends its time
    targets = dict(zip(names, ('check_stages:ok', f'check_stages:{second}', 'check_stages:ok')))
    ane_check.run_all = functools.partial(ane_check.run_all, targets=targets)
    cfg = hg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100)
    sys.exit(ane_check.main(cfg, 2, 8, 'programs', 4, sys.argv[1], 600))
