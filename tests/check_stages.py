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


def skipped(ctx):  # a stage that cannot run on this machine
    return {'skipped': "nothing to measure with here"}
