"""Builders of the ANE engine for its worker (plumbing/worker.py) that fault on purpose: each
builds hetero_gpt's engine from the spec (the eager derivation) and faults at its call of
loss_and_grads numbered fault_call."""
import os
import signal
import time

import hetero_gpt as hg


def _at_call(spec, fault_call, fault):
    engine = hg.engine_from_spec(spec)
    inner, calls = engine.loss_and_grads, [0]

    def loss_and_grads(idx, targets):
        calls[0] += 1
        if calls[0] == fault_call:
            fault()
        return inner(idx, targets)
    engine.loss_and_grads = loss_and_grads
    return engine


def sigkill(spec, fault_call):  # as a failed ANE compile does at its first predict
    return _at_call(spec, fault_call, lambda: os.kill(os.getpid(), signal.SIGKILL))


def hang(spec, fault_call):
    return _at_call(spec, fault_call, lambda: time.sleep(3600))


def raises(spec, fault_call):
    def fault():
        raise RuntimeError("an evaluator's own error")
    return _at_call(spec, fault_call, fault)


def cannot_start(spec):
    raise RuntimeError("no Neural Engine here")


def stalls(spec, note):
    """A long call: notes its start in the file `note`, then computes for an hour."""
    def fault():
        open(note, 'w').close()
        time.sleep(3600)
    return _at_call(spec, 1, fault)
