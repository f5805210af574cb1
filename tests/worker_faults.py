"""Evaluators for the ANE worker that fault on purpose (worker.make_engine's spec['predict']):
each runs the eager derivation and faults at the program call numbered spec['fault_call']."""
import os
import signal
import time

from plumbing import worker


def _at_call(cfg, B, T, spec, fault):
    inner, calls = worker.eager_predict(cfg, B, T, __import__('torch').float32), [0]

    def predict(piece, inputs):
        calls[0] += 1
        if calls[0] == spec['fault_call']:
            fault()
        return inner(piece, inputs)
    return predict


def sigkill(cfg, B, T, spec):  # as a failed ANE compile does at its first predict
    return _at_call(cfg, B, T, spec, lambda: os.kill(os.getpid(), signal.SIGKILL))


def hang(cfg, B, T, spec):
    return _at_call(cfg, B, T, spec, lambda: time.sleep(3600))


def raises(cfg, B, T, spec):
    def fault():
        raise RuntimeError("an evaluator's own error")
    return _at_call(cfg, B, T, spec, fault)


def cannot_start(cfg, B, T, spec):
    raise RuntimeError("no Neural Engine here")
