"""The trainer end to end on a tiny configuration (CPU, a data set the test writes), and
the concurrent step with engines whose behaviour the test controls."""
import math
import signal
import threading

import pytest
import torch

import hetero_gpt as hg
import helpers
from helpers import SMALL, Clock, FakeEngine, const_grads, microbatches, tiny_model
from tools import gradcheck


def test_loss_falls_and_metrics_are_logged(data_dir, tmp_path):
    fast = dict(max_iters=15, eval_interval=10, log_interval=1, learning_rate=6e-3, min_lr=3e-3)
    _, rows = helpers.train(data_dir, tmp_path, SMALL, **fast)
    losses = [r['loss'] for r in rows if 'loss' in r]
    vals = [r['val_loss'] for r in rows if 'val_loss' in r]
    assert losses[-1] < losses[0] - 2.0, losses   # from ~ln(50257) = 10.8
    assert vals[-1] < vals[0], vals
    last = rows[-1]
    for k in ('step', 'loss', 'val_loss', 'val_ppl', 'lr', 'tokens_per_s', 'elapsed', 'tokens'):
        assert k in last
    assert last['step'] == 15 and math.isclose(last['val_ppl'], math.exp(last['val_loss']))
    assert (tmp_path / 'ckpt.pt').exists() and not (tmp_path / 'ckpt.pt.tmp').exists()
    # each row's rate is the schedule's at the step it took (the row comes after it)
    cfg, given = hg.parse_args(helpers.flags(base=SMALL, **fast))
    cfg, _ = hg.setup(cfg, given, log=lambda s: None)  # (the CPU's defaults for flags not given)
    assert [r['lr'] for r in rows] == [hg.get_lr(cfg, r['step'] - 1) for r in rows]
    assert [r['tokens'] for r in rows] == [r['step'] * 2 * 4 * 32 for r in rows]


def test_learning_rate_schedule():
    # linear warm-up over warmup_iters steps to learning_rate, then a cosine down to min_lr
    # at max_iters, and min_lr after it (values by hand: fp64 rounding, 1e-15 relative)
    cfg = hg.Config(learning_rate=1.0, min_lr=0.1, warmup_iters=4, max_iters=14)
    lr = [hg.get_lr(cfg, it) for it in range(20)]
    assert lr[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8], rel=1e-15)  # (it + 1) / (warmup + 1)
    assert lr[4] == 1.0 and lr[14] == pytest.approx(0.1, rel=1e-15) and lr[15:] == [lr[14]] * 5
    assert lr[9] == pytest.approx(0.55, rel=1e-15)  # halfway: the mean of the two
    assert lr[5] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 10)), rel=1e-15)
    assert all(a > b for a, b in zip(lr[4:14], lr[5:15]))  # falls at every step of the decay
    assert hg.get_lr(hg.Config(learning_rate=1.0, min_lr=0.1, warmup_iters=0, max_iters=0), 0) == 1.0


def test_interrupt_then_resume_continues_exactly(data_dir, finished_run, tmp_path, ctrl_c):
    # finished_run: 10 steps straight; here Ctrl-C at step 4 (a checkpoint is saved) then
    # --resume to 10: the same batches (seeded by step) and optimizer state give the same
    # weights, bit for bit on the CPU
    ctrl_c.at(4)
    handler = signal.getsignal(signal.SIGINT)
    helpers.train(data_dir, tmp_path / 'b', max_iters=10)
    # Ctrl-C is held only while the checkpoint is saved: the caller (and what it starts) can be stopped again
    assert signal.getsignal(signal.SIGINT) is handler
    ck = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=False)
    assert ck['iter_num'] == 4 and len(ck['optimizer']['state']) > 0
    ctrl_c.off()
    b, rows = helpers.train(data_dir, tmp_path / 'b', max_iters=10, resume=True)
    assert [r['step'] for r in rows] == [5, 10] and helpers.state(rows) == helpers.state(helpers.rows(finished_run))
    straight = torch.load(finished_run / 'ckpt.pt', weights_only=False)['model']
    for k, p in b.state_dict().items():
        assert torch.equal(p, straight[k]), k


def test_a_checkpoint_holds_the_counters_by_nanogpts_names(finished_run):
    # the run's Progress on disk as before (sample.py and older runs read these names): step 10,
    # its tokens and training time as its last row logged them, the lowest validation loss and
    # the evaluations since it
    ck, rows = torch.load(finished_run / 'ckpt.pt', weights_only=True), helpers.rows(finished_run)
    vals = [r['val_loss'] for r in rows if 'val_loss' in r]
    assert {k: ck[k] for k in ('iter_num', 'tokens', 'elapsed', 'best_val_loss', 'evals_since_best')} == dict(
        iter_num=10, tokens=rows[-1]['tokens'], elapsed=rows[-1]['elapsed'], best_val_loss=min(vals),
        evals_since_best=len(vals) - 1 - vals.index(min(vals)))


def test_loss_scales_are_restored_on_resume_unless_given(data_dir, tmp_path, ctrl_c):
    # both engines fp16 (autocast on the CPU, the fp16 stand-in), scales from 8, doubled after
    # every 2 finite steps: 8 16 16 32 | 32 64. Stopped at step 4 and resumed, a run goes on
    # from the checkpoint's 32; a --loss_scale or --ane_loss_scale given at the resume wins
    fp16 = dict(mode='hetero', dtype='float16', ane_fraction=0.5, loss_scale=8, ane_loss_scale=8, scale_window=2,
                log_interval=1, max_iters=6)
    _, straight = helpers.train(data_dir, tmp_path / 'a', **fp16)
    assert [r['loss_scale'] for r in straight] == [8, 16, 16, 32, 32, 64]
    ctrl_c.at(4)
    for run in 'bc':
        helpers.train(data_dir, tmp_path / run, **fp16)
    ctrl_c.off()
    _, resumed = helpers.train(data_dir, tmp_path / 'b', **fp16 | dict(loss_scale=None, ane_loss_scale=None),
                               resume=True)
    _, given = helpers.train(data_dir, tmp_path / 'c', **fp16, resume=True)
    assert [r['loss_scale'] for r in resumed] == [8, 16, 16, 32, 32, 64]
    assert [r['loss_scale'] for r in given] == [8, 16, 16, 32, 8, 16]
    scales = {run: torch.load(tmp_path / run / 'ckpt.pt', weights_only=True)['loss_scales'] for run in 'abc'}
    assert scales == {'a': {'gpu': 64, 'ane': 64}, 'b': {'gpu': 64, 'ane': 64}, 'c': {'gpu': 16, 'ane': 16}}


@pytest.mark.parametrize('bias', ['True', 'False'])
def test_hetero_fp32_matches_gpu_only(data_dir, tmp_path, bias):
    # eager engine in fp32 taking half of every step vs autograd alone: same batches, so the
    # same mean gradient, whose norm each row logs before clipping (grad_norm), a check on
    # what the step averages that AdamW's scale-free update cannot hide. fp32 rounding: 1e-7
    # relative per op, grown over 10 AdamW steps: 1e-4 for losses and norms alike.
    # GPT-2's biases and nanoGPT's bias=False alike
    _, gpu = helpers.train(data_dir, tmp_path / 'g', max_iters=10, mode='gpu', bias=bias, log_interval=1)
    _, het = helpers.train(data_dir, tmp_path / 'h', max_iters=10, mode='hetero', ane_dtype='float32',
                           ane_fraction=0.5, bias=bias, log_interval=1)
    assert [r['ane_microbatches'] for r in het] == [1] * 10 and [r['step'] for r in gpu] == list(range(1, 11))
    assert len(het) == len(gpu)  # (zip's strict= needs Python 3.10; a Mac's may be 3.9)
    for g, h in zip(gpu, het):
        assert abs(g['loss'] - h['loss']) < 1e-4 * g['loss'], (g, h)
        assert abs(g['grad_norm'] - h['grad_norm']) < 1e-4 * g['grad_norm'], (g, h)
        # each engine's own mean loss: microbatch 0 on the ANE, 1 on the GPU; their mean is the step's
        assert abs((h['ane_loss'] + h['gpu_loss']) / 2 - h['loss']) < 1e-6 * h['loss'] and h['ane_loss'] != h['gpu_loss']
    assert abs(gpu[-1]['val_loss'] - het[-1]['val_loss']) < 1e-4 * gpu[-1]['val_loss']


def test_grad_norm_is_the_mean_gradients_before_clipping():
    # every gradient element 1 (norm sqrt(P) over P elements), from both engines, clipped to
    # 0.5: the row's grad_norm is the mean's norm, sqrt(P), not the clipped 0.5 (fp32: 1e-6)
    model = tiny_model()
    eng = {n: FakeEngine(n, 0, const_grads(model, 1.0)) for n in ('gpu', 'ane')}
    step = hg.HeteroStep(model, eng, hg.Split(4, 0.5), optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    out = step.update(step(microbatches(4)), grad_clip=0.5)
    assert out.grad_norm == pytest.approx(sum(p.numel() for p in model.parameters()) ** 0.5, rel=1e-6)


def test_fp16_autograd_engine_scales_its_loss():
    # fp16 autocast (on the CPU here) with a loss scale: the gradients come back unscaled,
    # equal to fp32 autograd's up to fp16 rounding (gradcheck's fp16 bounds) at scales 1024 and 2^12;
    # a scale that overflows fp16 (2^40) gives inf, and the step halves it and uses none
    torch.manual_seed(0)
    model = hg.GPT(hg.GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=2, n_embd=32))
    idx, targets = (torch.randint(0, 300, (2, 16)) for _ in range(2))
    cpu = torch.device('cpu')
    ref = hg.AutogradEngine(model, cpu, torch.float32).loss_and_grads(idx, targets)[1]
    ref = {k: v.clone() for k, v in ref.items()}
    eng = hg.AutogradEngine(model, cpu, torch.float16, scaler=hg.LossScaler(1024.0, 100))
    for scale in (1024.0, 2.0 ** 12):
        eng.scaler.scale = scale
        _, grads = eng.loss_and_grads(idx, targets)
        assert not (bad := gradcheck.check(grads, ref, torch.float16)), (scale, bad)
    eng.scaler.scale = 2.0 ** 40
    before = {k: p.clone() for k, p in model.state_dict().items()}
    step = hg.HeteroStep(model, {'gpu': eng}, hg.Split(1, 0), log=lambda s: None,
                         optimizer=torch.optim.AdamW(model.parameters()))
    out = step.update(step([(idx, targets)]))  # (the lone engine's flag is read once AdamW is queued)
    assert out.n == 0 and step.skipped == 1 and eng.scaler.scale == 2.0 ** 39
    assert all(torch.equal(p, before[k]) for k, p in model.state_dict().items())  # no update
    assert not hg.AutogradEngine(model, cpu, torch.bfloat16, scaler=hg.LossScaler(1024.0, 100)).scaler.enabled


@pytest.mark.slow
def test_compiled_autograd_engine_gives_autograds_gradients():
    # --compile: the GPU engine's model through torch.compile, against eager autograd: the same
    # loss and gradients to fp32 rounding of fused kernels (test_grads.py's fp32 bound, 1e-4)
    import test_grads as tg
    torch.manual_seed(0)
    model = hg.GPT(hg.GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=2, n_embd=32))
    idx, targets = (torch.randint(0, 300, (2, 16)) for _ in range(2))
    cpu = torch.device('cpu')
    out = {}
    for compiled in (False, True):
        loss, grads = hg.AutogradEngine(model, cpu, torch.float32, compile=compiled).loss_and_grads(idx, targets)
        out[compiled] = loss.item(), {k: g.clone() for k, g in grads.items()}
    assert abs(out[True][0] - out[False][0]) <= tg.TOL[torch.float32] * out[False][0]
    assert max(tg.rel_err(out[True][1][k], g) for k, g in out[False][1].items()) <= tg.TOL[torch.float32]


def test_bad_flags_and_data(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        hg.parse_args(['--no_such_flag', '1'])
    cases = [(dict(n_embd=30, n_head=4), 'not divisible'),
             (dict(block_size=100000), 'larger than the'),
             (dict(mode='tpu'), 'unknown --mode'),
             (dict(ane_fraction=1.5), 'ane_fraction'),
             (dict(dataset='nonesuch'), 'prepare_data.py --input'),
             (dict(resume=True), 'no checkpoint')]
    for settings, message in cases:
        assert helpers.main(data_dir, tmp_path / 'x', **settings) == 2
        assert message in capsys.readouterr().err, settings


def test_corrupt_data_is_refused(data_dir, tmp_path, capsys):
    import shutil
    bad = tmp_path / 'data'
    shutil.copytree(data_dir, bad)
    with open(bad / 'tiny' / 'train.bin', 'r+b') as f:
        f.truncate(100)  # an interrupted copy
    assert helpers.main(bad, tmp_path / 'o') == 2
    assert 'does not match meta.json' in capsys.readouterr().err


def test_joules_per_token_and_the_meter_closed(data_dir, tmp_path, monkeypatch):
    # a meter that reads 0.5 J more at each reading, and 1000 J more in each evaluation: a step
    # spans one reading's 0.5 J (read at its start and its end), so each logged row's J/token is
    # 2 steps x 0.5 J over their tokens (exact in binary); the evaluations' joules count nowhere,
    # as their seconds don't; and the run closes the meter at its end
    made = []

    class Meter:
        name, missing, meters = 'test meter', [], [1]

        def __init__(self, devices):
            self.j, self.closed = 0.0, False
            made.append(self)

        def joules(self):
            self.j += 0.5
            return self.j

        def close(self):
            self.closed = True
    evaluate = hg.evaluate

    def burning(*args):  # an evaluation that costs 1000 J
        made[0].j += 1000.0
        return evaluate(*args)
    monkeypatch.setattr(hg.energy, 'EnergyMeter', Meter)
    monkeypatch.setattr(hg, 'evaluate', burning)
    _, rows = helpers.train(data_dir, tmp_path, max_iters=6, log_interval=2, eval_interval=2)
    assert [r['joules_per_token'] for r in rows] == [2 * 0.5 / (2 * 2 * 2 * 16)] * 3
    assert made[0].j > 3000 and len(made) == 1 and made[0].closed  # (the evaluations ran)


# ---- the concurrent step, with engines the test controls

def test_concurrency_is_real():
    # each call of either engine waits for a call of the other: the step finishes only if
    # both engines run at once (one after the other, the first waits for the barrier's
    # timeout, and fails)
    model = tiny_model()
    meet = threading.Barrier(2, timeout=60)
    eng = {n: FakeEngine(n, 0, const_grads(model, 1.0), meet=meet) for n in ('gpu', 'ane')}
    out = hg.HeteroStep(model, eng, hg.Split(4, 0.5), log=pytest.fail)(microbatches(4))
    assert out.used == ['ane', 'gpu'] and eng['gpu'].calls == eng['ane'].calls == 2 and not meet.broken


def test_gradients_are_token_weighted_means():
    # 3 microbatches of gradient 1 on the GPU, 1 of gradient 5 on the ANE: mean 2
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, const_grads(model, 5.0))}
    hg.HeteroStep(model, eng, hg.Split(4, 0.25))(microbatches(4))
    assert all(torch.allclose(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())


def test_auto_split_moves_toward_the_faster_engine(monkeypatch):
    # each engine's seconds on the step's clock (the test's): the GPU 0.01 s a microbatch,
    # the ANE 0.03 s. The split measures both and moves to 8 * (1/3) / (1 + 1/3) = 2
    monkeypatch.setattr(hg, 'time', clock := Clock())
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0.01, const_grads(model, 1.0), clock=clock),
           'ane': FakeEngine('ane', 0.03, const_grads(model, 1.0), clock=clock)}
    split = hg.Split(8)
    step = hg.HeteroStep(model, eng, split)
    assert split.ane_share == 4  # starts even
    step(microbatches(8))
    assert split.sec_per_microbatch == pytest.approx({'gpu': 0.01, 'ane': 0.03}, rel=1e-12)
    assert split.ane_share == 2
    for _ in range(4):
        step(microbatches(8))
    assert split.ane_share == 2 and eng['ane'].calls == 4 + 4 * 2


def test_auto_split_remeasures_an_idle_engine():
    # the split left the ANE idle (measured 7.5x slower than the GPU: 4 * 1/8.5 rounds to 0
    # of 4 microbatches); every 20th step it still gets one, so a change in its speed is
    # seen, unless one of its microbatches took longer than two whole GPU steps
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, const_grads(model, 1.0))}
    for ane_sec, probes in ((0.015, 1), (0.017, 0)):  # two GPU steps: 2 * 4 * 0.002 = 0.016 s
        split = hg.ProbingSplit(4)
        split.sec_per_microbatch, split.ane_share = {'gpu': 0.002, 'ane': ane_sec}, 0
        step = hg.HeteroStep(model, eng, split)
        calls = eng['ane'].calls
        for _ in range(20):
            step(microbatches(4))
        assert eng['ane'].calls == calls + probes, ane_sec


def test_auto_split_gives_the_ane_nothing_where_the_gpu_alone_is_faster():
    # beside each other the GPU engine takes 0.03 s a microbatch and the ANE 0.06 s (a share of
    # 1 of 4: round(4 * (1/0.06) / (1/0.03 + 1/0.06)) = 1); a step over both takes
    # max(3 * 0.03, 1 * 0.06) / 4 = 0.0225 s a microbatch. The GPU engine alone takes 0.02 s
    # (the engines share one GPU): from its timing at step 10 on, the ANE gets nothing but
    # at every 20th step. At 0.03 s alone (separate chips, as on a Mac) it keeps its share,
    # and only steps 10 and 110 time the GPU alone.
    for alone_s, want in ((0.02, lambda s: 1 if s % 20 == 0 else 0), (0.03, lambda s: 0 if s in (10, 110) else 1)):
        split, given = hg.ProbingSplit(4), []
        for s in range(1, 121):
            k = split.next_share({'gpu', 'ane'})
            given.append(k)
            ran = {'gpu': (4 - k, 0.03 * (4 - k)), 'ane': (k, 0.06 * k)} if k else {'gpu': (4, 4 * alone_s)}
            split.observe({name: hg.Share(torch.tensor(0.0), {}, n, s) for name, (n, s) in ran.items()}, k)
        assert given[0] == 2 and all(given[1:9]), given[:9]  # even, then by speed
        assert given[9:] == [want(s) for s in range(10, 121)], (alone_s, given)


def test_a_hetero_step_times_itself_for_the_split(monkeypatch):
    # each updated step over both engines reports its share and time to the split: step 10
    # runs the GPU engine alone (the ANE is not called), and both kinds of step are timed
    # (the step's clock is the test's: the GPU 0.01 s a microbatch, the ANE 0.02 s, so the
    # share is round(4 * (1/0.02) / (1/0.01 + 1/0.02)) = 1)
    clock = Clock()
    monkeypatch.setattr(hg, 'time', clock)
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0.01, const_grads(model, 1.0), clock=clock),
           'ane': FakeEngine('ane', 0.02, const_grads(model, 1.0), clock=clock)}
    step = hg.HeteroStep(model, eng, hg.ProbingSplit(4), optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    for s in range(1, 11):
        calls = eng['ane'].calls
        out = step.update(step(microbatches(4)))
        assert out.ane_share == (0 if s == 10 else eng['ane'].calls - calls) and out.n == 4
    assert eng['ane'].calls == calls
    # a step's seconds a microbatch, its slower share's over 4, halved toward each new one: both
    # engines at step 1 (2 each: 0.04 / 4), then 8 steps of 1 on the ANE (3 * 0.01 / 4 = 0.0075);
    # the GPU alone at step 10 (0.04 / 4). (fp64 sums of the clock's hundredths: 1e-12 relative)
    assert step.split.step_sec == pytest.approx({'both': 0.0075 + 0.0025 / 2 ** 8, 'alone': 0.01}, rel=1e-12)


def test_the_mean_is_exact_in_fp64_and_within_a_rounding_in_fp32():
    # three microbatches of gradient 1: their sum 3 over the count 3, divided (times 1/3
    # rounded would be 1 - 3e-8 off in fp64, 2^-24 in fp32), so SGD at lr 1 moves every weight
    # by 1 exactly in fp64; in fp32 the subtraction of the weights rounds, within 2^-23 of 1
    for dtype, tol in ((torch.float32, 2.0 ** -23), (torch.float64, 0.0)):
        model = tiny_model().to(dtype)
        before = [p.detach().clone() for p in model.parameters()]
        step = hg.HeteroStep(model, {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0))}, hg.Split(3, 0),
                             optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        step.update(step(microbatches(3)))
        for p, q in zip(model.parameters(), before):
            moved = (q - p.detach()).double()  # (fp32 weights: the subtraction rounds too, within 2^-23 of 1)
            assert ((moved - 1).abs() <= 2 * tol).all(), (dtype, (moved - 1).abs().max())


def test_nonfinite_gradients_are_skipped_and_counted():
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, const_grads(model, float('inf')))}
    step = hg.HeteroStep(model, eng, hg.Split(4, 0.5))
    out = step(microbatches(4))
    assert out.used == ['gpu'] and step.dropped['ane'] == 1
    assert eng['ane'].scaler.scale == 512.0  # halved on overflow
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())  # the GPU's mean alone
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_loss_scale_grows_after_a_window_of_finite_steps():
    s = hg.LossScaler(1024.0, 2)
    s.update(True)
    assert s.scale == 1024.0
    s.update(True)
    assert s.scale == 2048.0
    s.update(False)
    assert s.scale == 1024.0


def test_the_update_clips_the_gradient_norm():
    # every gradient element 1 (norm sqrt(P) over P elements), one SGD step of rate 1: the
    # weights move by the gradient, clipped to norm grad_clip when grad_clip is below its norm
    for clip, moved in ((0.5, 0.5), (0.0, None), (1e6, None)):
        model = tiny_model()
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        step = hg.HeteroStep(model, {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0))}, hg.Split(2, 0),
                             optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        step.update(step(microbatches(2)), grad_clip=clip)
        delta = before - torch.cat([p.detach().flatten() for p in model.parameters()])
        full = before.numel() ** 0.5
        # fp32: each element rounded once around ~0.3, the norm over 100 of them: 1e-6 relative
        assert delta.norm().item() == pytest.approx(moved or full, rel=1e-6), clip
        assert torch.allclose(delta, torch.full_like(delta, (moved or full) / full), rtol=1e-5, atol=1e-6)
        assert all(p.grad is None for p in model.parameters())  # freed after the update


def test_failing_engine_leaves_training_running():
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, None, fail=True)}
    said = []
    step = hg.HeteroStep(model, eng, hg.Split(4, 0.5), log=said.append)
    out = step(microbatches(4))  # the GPU runs its 2 microbatches, then the ANE's 2
    assert out.used == ['gpu'] and step.alive == {'gpu'} and out.shares['gpu'].n == 4
    assert eng['ane'].calls == 1 and eng['gpu'].calls == 4
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    out = step(microbatches(4))  # the next step runs on the GPU alone, all 4 microbatches
    assert out.used == ['gpu'] and eng['ane'].calls == 1 and eng['gpu'].calls == 4 + 4
    assert len(said) == 1 and 'device lost' in said[0]


@pytest.mark.parametrize('when', ['at once', 'redoing the share of the other'])
def test_both_engines_failed(when):
    # both raise in one step, or the GPU raises only when it redoes the failed ANE's share:
    # the step stops with "both engines failed", from the last engine's error
    model = tiny_model()
    calls = {'n': 0}

    def gpu_grads(idx):  # its own share (2 calls) then the redo
        calls['n'] += 1
        if calls['n'] > 2:
            raise RuntimeError('gpu device lost')
        return const_grads(model, 1.0)(idx)
    eng = {'gpu': FakeEngine('gpu', 0, gpu_grads, fail=when == 'at once'), 'ane': FakeEngine('ane', 0, None, fail=True)}
    said = []
    step = hg.HeteroStep(model, eng, hg.Split(4, 0.5), log=said.append)
    with pytest.raises(RuntimeError, match='both engines failed') as e:
        step(microbatches(4))
    cause = str(e.value.__cause__)
    assert len(said) == 1 and 'device lost' in cause  # the error logged is the cause, or the ANE's before the redo
    assert cause in said[0] if when == 'at once' else (cause == 'gpu device lost' and 'ane device lost' in said[0])
    assert all(p.grad is None for p in model.parameters())  # no update


def test_both_engines_failing_stops_the_trainer_with_its_checkpoint(data_dir, finished_run, tmp_path, monkeypatch):
    # without torchrun, main lets the error through (a traceback: an engine fault is no
    # setting to correct); the checkpoint of the last evaluation is kept as it was
    import shutil
    run = shutil.copytree(finished_run, tmp_path / 'run')
    before = (run / 'ckpt.pt').read_bytes()

    def lost(self, idx, targets):
        raise RuntimeError(f'{self.name} device lost')
    for cls in (hg.AutogradEngine, hg.EagerEngine):
        monkeypatch.setattr(cls, 'loss_and_grads', lost)
    with pytest.raises(RuntimeError, match='both engines failed'):
        helpers.main(data_dir, run, max_iters=20, resume=True, mode='hetero', ane_dtype='float32')
    assert (run / 'ckpt.pt').read_bytes() == before and [r['step'] for r in helpers.rows(run)] == [5, 10]


def test_engine_without_a_share_redoes_a_failed_step_on_this_steps_weights():
    # the split gives the eager engine nothing, so its weights were not loaded this step;
    # when the GPU engine then fails, it runs the step's microbatches on the current
    # weights: the same gradient as autograd's, to fp64 rounding
    cfg = hg.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=4)
    torch.manual_seed(0)
    model = hg.GPT(cfg).double()
    mbs = [(torch.randint(0, 16, (1, 8)), torch.randint(0, 16, (1, 8))) for _ in range(2)]
    eng = {'gpu': FakeEngine('gpu', 0, None, fail=True),
           'ane': hg.EagerEngine(cfg, torch.device('cpu'), torch.float64, hg.LossScaler(1.0, 0, enabled=False))}
    out = hg.HeteroStep(model, eng, hg.Split(2, 0), log=lambda s: None)(mbs)
    assert out.used == ['ane'] and out.shares['ane'].n == 2
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    sum(model(x, y)[1] for x, y in mbs).div(2).backward()
    for k, p in model.named_parameters():
        assert (got[k] - p.grad).abs().max() <= 1e-12 * p.grad.abs().max().clamp_min(1e-30), k


def test_hetero_step_equals_single_engine_step_fp64():
    # both engines in fp64 on the CPU: a hetero step over 4 microbatches (2 on autograd, 2
    # on the eager derivation) and an autograd-only step over the same 4 give the same
    # averaged gradient and the same weights after the update. fp64 rounding over a few
    # thousand terms: ~1e-14 relative, far below 1e-10. (The update is SGD: Adam's first
    # step is g/(|g| + 1e-8) per element, which turns 1e-16 of rounding in a gradient
    # element near 1e-8 into 1e-8 of update, whatever the engines.)
    cfg = hg.GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    a = hg.GPT(cfg).double()
    b = hg.GPT(cfg).double()
    b.load_state_dict(a.state_dict())
    mbs = [(torch.randint(0, cfg.vocab_size, (2, 9)), torch.randint(0, cfg.vocab_size, (2, 9))) for _ in range(4)]
    cpu = torch.device('cpu')
    het = hg.HeteroStep(a, {'gpu': hg.AutogradEngine(a, cpu, torch.float64),
                            'ane': hg.EagerEngine(cfg, cpu, torch.float64, hg.LossScaler(1.0, 0, enabled=False))},
                        hg.Split(4, 0.5))
    one = hg.HeteroStep(b, {'gpu': hg.AutogradEngine(b, cpu, torch.float64)}, hg.Split(4, 0))
    out, grads = {}, {}
    for name, model, step in (('hetero', a, het), ('single', b, one)):
        out[name] = step(mbs)
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters()}
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert out['hetero'].used == ['ane', 'gpu'] and out['single'].used == ['gpu']
    for k, g in grads['single'].items():
        assert (grads['hetero'][k] - g).abs().max() <= 1e-10 * g.abs().max(), k
    for (k, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa - pb).abs().max().item() < 1e-10, k


def test_bench_times_every_mode_in_turns(data_dir, capsys, monkeypatch):
    # bench.py on the tiny config, half of hetero's microbatches on each engine, on a clock of
    # the test's (each reading 1 s later: the warm-up's 3 s pass in 7 steps, a round of 2 steps
    # takes 5 readings, so 2 * 64 tokens / 5 s): each mode gets bench_repeats timed rounds, the
    # table names them all with the ratios of their rates, and hetero's row says how its step
    # split and where its time went (each engine's own seconds: a clock of the engines' threads
    # read twice a share, 0.25 s a reading). The meter draws a constant power per mode on the
    # round's clock, so J/token is watts over tokens/s
    import bench
    clock, watts = Clock(tick=1.0), iter([10.0, 4.0, 12.0])  # gpu, ane, hetero: built in turn

    class PowerMeter:
        name, missing, meters = 'constant power', [], [1]

        def __init__(self, devices):
            self.watts = next(watts)

        def joules(self):  # read without moving the clock: the round's joules are watts * its seconds
            return self.watts * getattr(clock.local, 't', 0.0)

        def close(self):
            pass

    monkeypatch.setattr(bench, 'time', clock)
    monkeypatch.setattr(hg, 'time', Clock(tick=0.25))
    monkeypatch.setattr(hg.energy, 'EnergyMeter', PowerMeter)
    cfg, given = hg.parse_args(helpers.flags(data_dir, bench_iters=2, bench_repeats=2, ane_fraction=0.5),
                               bench.BenchConfig)
    rows = bench.bench(cfg, given)
    assert set(rows) == {'gpu', 'ane', 'hetero'}
    for mode, r in rows.items():
        assert r['rounds'] == [26, 26] and r['tok_s'] == 2 * 64 / 5 and r['ms_step'] == 1000.0
    # 10 W at 25.6 tokens/s; rel 1e-12: a few fp64 roundings of sums of whole seconds
    assert [rows[m]['j_tok'] for m in ('gpu', 'ane', 'hetero')] == pytest.approx([10 / 25.6, 4 / 25.6, 12 / 25.6], rel=1e-12)
    assert {m: r['ms_engines'] for m, r in rows.items()} == {'gpu': {'gpu': 250.0}, 'ane': {'ane': 250.0},
                                                             'hetero': {'gpu': 250.0, 'ane': 250.0}}
    assert rows['hetero']['split'] == '1/2' and rows['gpu']['split'] == rows['ane']['split'] == '-'
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split() for line in out[out.index('x GPU-only'):].splitlines()[1:4]}
    assert {m: t[1:] for m, t in table.items()} == {'gpu': ['26', '1.000', '0.3906', '+0.0%', '-'],
                                                    'ane': ['26', '1.000', '0.1562', '-60.0%', '-'],
                                                    'hetero': ['26', '1.000', '0.4688', '+20.0%', '1/2']}
    assert 'hetero / (gpu + ane alone) = 0.500 ' in out


def test_bench_splits_by_the_engines_speeds(data_dir, monkeypatch):
    # bench.py with the auto split, on clocks of the test's: a microbatch takes the GPU engine 1 s
    # and the ANE's stand-in 3 s (each engine's own clock, in its thread). From hetero's second
    # step the split gives the ANE 4 * (1/3) / (1 + 1/3) = 1 of 4 microbatches, so each engine's
    # share takes 3 s; the retime (step 10) and probe steps (every 20th) come after bench's 9 steps
    import bench
    engine_clock = Clock()
    for cls, seconds in ((hg.AutogradEngine, 1.0), (hg.EagerEngine, 3.0)):
        def timed(self, idx, targets, inner=cls.loss_and_grads, seconds=seconds):
            engine_clock.advance(seconds)
            return inner(self, idx, targets)
        monkeypatch.setattr(cls, 'loss_and_grads', timed)
    monkeypatch.setattr(bench, 'time', Clock(tick=1.0))
    monkeypatch.setattr(hg, 'time', engine_clock)
    cfg, given = hg.parse_args(helpers.flags(data_dir, bench_iters=2, bench_repeats=2, gradient_accumulation_steps=4),
                               bench.BenchConfig)
    rows = bench.bench(cfg, given)
    assert rows['hetero']['split'] == '1/4'
    assert rows['hetero']['ms_engines'] == {'gpu': 3000.0, 'ane': 3000.0}  # both engines end together
    assert rows['gpu']['ms_engines'] == {'gpu': 4000.0} and rows['ane']['ms_engines'] == {'ane': 12000.0}


def test_bench_ratios_are_the_papers():
    # the paper's M4 Pro row as bench.py's rows: hetero at 1.419x GPU-only's tokens/s and
    # 30.9% less energy per token; the ANE alone at 600 tokens/s, so hetero reaches
    # 1419 / 1600 of the two engines' summed speeds. Without a meter: no energy column
    import bench
    rows = dict(gpu=dict(tok_s=1000.0, j_tok=0.01), ane=dict(tok_s=600.0, j_tok=0.004),
                hetero=dict(tok_s=1419.0, j_tok=0.00691))
    against_gpu = bench.against(rows)  # against GPU-only, as no MLX arm ran
    overlap = bench.overlap(rows)
    assert against_gpu['hetero'] == pytest.approx((1.419, -30.9), rel=1e-12)  # fp64 quotients
    assert against_gpu['ane'] == pytest.approx((0.6, -60.0), rel=1e-12) and against_gpu['gpu'] == (1.0, 0.0)
    assert overlap == pytest.approx(1419 / 1600, rel=1e-15)
    for r in rows.values():
        r['j_tok'] = None
    assert bench.against(rows)['hetero'] == (1.419, None)


def test_padded_lm_head_under_autocast_is_gpt2s():
    # vocabulary 100 is padded to 128 inside GPT.forward; under bf16 autocast the padding is
    # done on autocast's bf16 copy of the weight. Against the unpadded head under the same
    # autocast: the same bf16 products, so loss and gradients agree to bf16 rounding of the
    # logits (2^-8 relative), here checked at 1e-2 relative and gradcheck's bf16 bounds
    torch.manual_seed(0)
    m = hg.GPT(hg.GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16))
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))

    def unpadded():
        h = m.transformer.wte(x) + m.transformer.wpe(torch.arange(16))
        for block in m.transformer.h:
            h = block(h)
        logits = torch.nn.functional.linear(m.transformer.ln_f(h), m.lm_head.weight)
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, 100), y.view(-1))

    got = {}
    for name, fn in (('padded', lambda: m(x, y)), ('unpadded', unpadded)):
        m.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            logits, loss = fn()
        loss.backward()
        got[name] = (logits.float(), loss.item(), {k: p.grad.clone() for k, p in m.named_parameters()})
    (lp, a, ga), (lu, b, gb) = got['padded'], got['unpadded']
    assert lp.shape == lu.shape == (2, 16, 100) and (lp - lu).abs().max() <= 1e-2 * lu.abs().max()
    assert abs(a - b) <= 1e-2 * b
    assert all(g.dtype == torch.float32 for g in ga.values())
    assert not (bad := gradcheck.check(ga, gb, torch.bfloat16)), bad


@pytest.mark.parametrize('fused', [True, False])
def test_a_lone_gpu_step_skips_a_nonfinite_update(fused):
    # the GPU engine alone: the host reads its flag before the update, so a non-finite
    # gradient never reaches the weights, with any AdamW; the counters and loss scale follow
    helpers.lone_gpu_skips_a_nonfinite_update(hg.HeteroStep, torch.optim.AdamW, fused, read_before=True)


def test_the_autograd_engine_leaves_the_model_without_gradients():
    # its gradients are the caller's: none stay on the model to outlive the call (at the next
    # forward's peak they would be one more set), and a second call adds nothing to the first
    model = tiny_model()
    engine = hg.AutogradEngine(model, torch.device('cpu'), torch.float32)
    (x, y), = microbatches(1)
    _, first = engine.loss_and_grads(x, y)
    assert all(p.grad is None for p in model.parameters())
    _, second = engine.loss_and_grads(x, y)
    assert all(torch.equal(first[k], second[k]) for k in first) and first.keys() == dict(model.named_parameters()).keys()


@pytest.mark.parametrize('fused', [True, False])
def test_an_update_whose_check_fails_after_every_flag_passed_is_skipped_and_counted(fused):
    # each engine's flag (a norm per tensor) is finite: two tensors with one value of 1.5e19 each.
    # The update's check, the norm of all of them, is not: 1.5e19^2 * 2 = 4.5e38 is past fp32's
    # 3.4e38. No engine is dropped; the update is skipped (on the device, or by the host), counted
    model = tiny_model()

    def grads(idx):
        g = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        for t in list(g.values())[:2]:
            t.view(-1)[0] = 1.5e19
        return g
    eng = {n: FakeEngine(n, 0, grads) for n in ('gpu', 'ane')}
    step = hg.HeteroStep(model, eng, hg.Split(2, 0.5), optimizer=torch.optim.AdamW(model.parameters(), fused=fused))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    out = step.update(step(microbatches(2)))
    assert out.n == 0 and out.used == [] and math.isnan(out.loss)
    assert step.skipped == 1 and step.dropped == {'gpu': 0, 'ane': 0}
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
