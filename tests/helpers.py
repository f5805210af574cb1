"""What the tests share: tiny training runs of the trainer, engines whose behaviour a test
controls, a clock a test advances, and fp64 autograd references."""
import contextlib
import copy
import json
import math
import os
import threading
import time

import torch

import hetero_gpt as hg

# ---- tiny runs of the trainer

# one block 16 wide, 2 microbatches of 2 sequences of 16 tokens a step, on the CPU; the ANE's
# stand-in in this process (the worker only where a test is about it); no progress bar, no sample
TINY = dict(dataset='tiny', n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2,
            gradient_accumulation_steps=2, warmup_iters=2, eval_iters=1, eval_interval=5, log_interval=5,
            sample_tokens=0, quiet=True, device='cpu', ane_worker=False)
# two blocks 32 wide, 2 microbatches of 4 sequences of 32 tokens: enough for the loss to fall
SMALL = TINY | dict(n_layer=2, n_embd=32, block_size=32, batch_size=4, learning_rate=3e-3, warmup_iters=5,
                    eval_iters=4)


def flags(data_dir=None, out_dir=None, base=TINY, **settings):
    """hetero_gpt.py's flags: base's settings, then settings (a value None leaves a flag out)."""
    s = base | dict(data_dir=data_dir, out_dir=out_dir) | settings
    return [f for k, v in s.items() if v is not None for f in (f'--{k}', str(v))]


def rows(out_dir):
    """metrics.jsonl, a row a line."""
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def state(rows):
    """The rows without what a run measures (its clock's rates and times, its meter's joules, its
    memory): what two runs of the same steps must agree on."""
    return [{k: v for k, v in r.items() if not k.endswith(('tokens_per_s', 'elapsed', 'joules_per_token', 'memory'))}
            for r in rows]


def train(data_dir, out_dir, base=TINY, **settings):
    """hg.train in this process: (the model, its metrics rows)."""
    cfg, given = hg.parse_args(flags(data_dir, out_dir, base, **settings))
    return hg.train(cfg, given), rows(out_dir)


def main(data_dir, out_dir, base=TINY, **settings):
    """hg.main in this process: its exit code (0 when it returns)."""
    try:
        hg.main(flags(data_dir, out_dir, base, **settings))
    except SystemExit as e:
        return e.code
    return 0


# the Core ML programs most tests share (conftest.py's exported): a model, and B sequences of T tokens a call
PROGRAMS = dict(cfg=hg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100), B=2, T=8)


# ---- engines and a clock the test controls

class Clock:
    """time.perf_counter for the module a test gives it (monkeypatch.setattr(module, 'time',
    clock)): each thread's own time, moved only by advance(). The rest of time is time's."""

    def __init__(self, tick=0.0):
        self.tick, self.local = tick, threading.local()

    def perf_counter(self):  # tick: seconds that pass at each reading
        self.local.t = getattr(self.local, 't', 0.0) + self.tick
        return self.local.t

    def advance(self, seconds):
        self.local.t = getattr(self.local, 't', 0.0) + seconds

    def __getattr__(self, name):
        return getattr(time, name)


class FakeEngine:
    """Takes `seconds` of `clock` per microbatch (a Clock: advanced, no wait) and returns the
    gradients grads(idx); with `meet` (a threading.Barrier) every call waits there for the
    other engine's call, so the step hangs (the barrier times out) unless both run at once."""

    def __init__(self, name, seconds, grads, fail=False, clock=None, meet=None):
        self.name, self.seconds, self.grads, self.fail, self.clock, self.meet = name, seconds, grads, fail, clock, meet
        self.label, self.device = f'fake {name}', torch.device('cpu')
        self.scaler = hg.LossScaler(1024.0, 2)
        self.calls = 0

    def load_weights(self, params):
        pass

    def loss_and_grads(self, idx, targets):
        self.calls += 1
        if self.fail:
            raise RuntimeError(f'{self.name} device lost')
        if self.meet:
            self.meet.wait()
        if self.clock:
            self.clock.advance(self.seconds)
        return torch.tensor(2.0), self.grads(idx)

    def running(self):
        return contextlib.nullcontext()

    def synchronize(self):
        pass


def tiny_model():
    torch.manual_seed(0)
    return hg.GPT(hg.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=4))


def const_grads(model, value):
    return lambda idx: {k: torch.full_like(p, value) for k, p in model.named_parameters()}


def microbatches(n):
    return [(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)) for _ in range(n)]


# ---- fp64 references

def autograd_fp64(model, idx, targets):
    """fp64 autograd on a copy of model: (the loss, {name: gradient})."""
    ref = copy.deepcopy(model).double()
    ref.zero_grad(set_to_none=True)
    _, loss = ref(idx, targets)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in ref.named_parameters()}


def lone_gpu_skips_a_nonfinite_update(step_cls, make_optimizer, fused, read_before):
    """A step of step_cls over the GPU engine alone, its gradients NaN, then 1: the NaN step
    changes no weight and takes no AdamW step; skipped, dropped and the loss scale count it.
    read_before: whether the host has read the flag when the step returns."""
    model, value = tiny_model(), {'v': float('nan')}
    eng = {'gpu': FakeEngine('gpu', 0, lambda idx: {k: torch.full_like(p, value['v'])
                                                    for k, p in model.named_parameters()})}
    opt = make_optimizer(model.parameters(), fused=fused)
    step = step_cls(model, eng, hg.Split(2, 0), optimizer=opt)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    out = step(microbatches(2))
    assert out.used == ([] if read_before else ['gpu'])
    out = step.update(out)
    assert out.n == 0 and out.used == [] and math.isnan(out.loss)
    assert step.skipped == 1 and step.dropped['gpu'] == 1 and eng['gpu'].scaler.scale == 512.0
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    assert all(int(s['step']) == 0 for s in opt.state.values())  # (a fused step skipped on the device: taken back)
    assert not hasattr(opt, 'found_inf')  # that step's only: a later opt.step() would skip by it
    value['v'] = 1.0
    out = step.update(step(microbatches(2)))
    assert out.n == 2 and out.loss == 2.0 and step.skipped == 1 and out.shares['gpu'].seconds > 0
    assert not any(torch.equal(p, before[k]) for k, p in model.named_parameters())


def open_programs(path, predict=None, scaler=None):
    """A CoreMLEngine on the programs in path (Core ML on a Mac, the NumPy evaluator elsewhere),
    or on another predict(piece, inputs) -> outputs."""
    engine = hg.coreml_engine(path, scaler)
    engine.predict = predict or engine.predict
    return engine
