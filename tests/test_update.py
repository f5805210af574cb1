"""The trainer's options and its data, seen from outside its loop: the weights after a few
steps of the real train() against a plain AdamW written here, the batches each step draws
(recorded as the loop hands them to the step), and the validation loss over a split that
ends in a partial batch."""
import copy
import math

import numpy as np
import pytest
import torch

import hetero_gpt as hg
import helpers

# fp64 weights and engine on the CPU, three steps, a row a step, no evaluation before the end
FP64 = helpers.TINY | dict(mode='gpu', dtype='float64', max_iters=3, log_interval=1, eval_interval=100)
# every optimizer flag away from its default at once; 3 steps over warm-up 1 and max_iters 3 give
# the rates lr/2, lr and (lr + min_lr)/2, the warm-up's and the cosine's middle
OTHER = dict(learning_rate=2e-3, min_lr=4e-4, warmup_iters=1, weight_decay=0.3, beta1=0.8, beta2=0.9,
             grad_clip=0.5)
EPS = 1e-8  # AdamW's eps: the trainer gives no flag for it, so torch's default


def recorded(fn):
    """fn(classes): train's classes with a model that keeps its first weights, and a step that
    keeps the microbatches the loop gives it. (fn's result, {'weights': [...], 'batches': [...]})"""
    seen = dict(weights=[], batches=[])

    class Model(hg.GPT):
        def __init__(self, config):
            super().__init__(config)
            seen['weights'].append(copy.deepcopy(self.state_dict()))  # before .to(): fp32

    class Step(hg.HeteroStep):
        def __call__(self, microbatches):
            seen['batches'].append([(x.clone(), y.clone()) for x, y in microbatches])
            return super().__call__(microbatches)
    return fn(hg.Classes(model=Model, step=Step)), seen


def run(data_dir, out_dir, base=FP64, **settings):
    """helpers.train with recorded classes: (model, rows, seen)."""
    cfg, given = hg.parse_args(helpers.flags(data_dir, out_dir, base, **settings))
    model, seen = recorded(lambda classes: hg.train(cfg, given, classes))
    return model, helpers.rows(out_dir), seen


def resolved(data_dir, base=FP64, **settings):
    """The Config a run of these flags trains with (this machine's defaults for the rest)."""
    cfg, given = hg.parse_args(helpers.flags(data_dir, None, base, **settings))
    return hg.setup(cfg, given, log=lambda s: None)[0]


def plain_adamw(cfg, data, weights, lrs):
    """The weights after len(lrs) steps, written here from the definitions: each step's gradient
    is the mean of its microbatches' fp64 autograd gradients; its global norm is clipped to
    grad_clip (the factor torch's clip_grad_norm_ uses, clip / (norm + 1e-6)); then AdamW
    (Loshchilov and Hutter): the weight decay, decoupled, on the >= 2-D weights only, and Adam's
    bias-corrected moments. (weights, the norms before clipping)."""
    model = hg.GPT(hg.model_config(cfg)).double()
    model.load_state_dict(weights)
    params = dict(model.named_parameters())
    m = {k: torch.zeros_like(p) for k, p in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    norms = []
    for t, lr in enumerate(lrs, 1):
        mbs = hg.step_batches(cfg, data, t - 1)
        g = {k: torch.zeros_like(p) for k, p in params.items()}
        for x, y in mbs:
            model.zero_grad()
            model(x, y)[1].backward()
            for k, p in params.items():
                g[k] += p.grad
        g = {k: s / len(mbs) for k, s in g.items()}
        norm = math.sqrt(sum(float((s * s).sum()) for s in g.values()))
        norms.append(norm)
        norm = float(np.float32(norm))  # the step reads its norm to the host in fp32
        if 0 < cfg.grad_clip < norm:
            g = {k: s * (cfg.grad_clip / (norm + 1e-6)) for k, s in g.items()}
        with torch.no_grad():
            for k, p in params.items():
                if p.dim() >= 2:
                    p.mul_(1 - lr * cfg.weight_decay)
                m[k] = cfg.beta1 * m[k] + (1 - cfg.beta1) * g[k]
                v[k] = cfg.beta2 * v[k] + (1 - cfg.beta2) * g[k] * g[k]
                m_hat = m[k] / (1 - cfg.beta1 ** t)
                v_hat = v[k] / (1 - cfg.beta2 ** t)
                p.sub_(lr * m_hat / (v_hat.sqrt() + EPS))
    return {k: p.detach() for k, p in params.items()}, norms


def test_the_update_is_adamw_with_every_optimizer_flag(data_dir, tmp_path):
    # the real loop in fp64, its weights after 3 steps against plain_adamw's from the same first
    # weights and batches: at the defaults (but max_iters; the CPU's rate, min_lr and warm-up) and
    # with every optimizer flag changed. Every step clips (its norm is past grad_clip), and each
    # rate is the schedule's, by hand
    for name, flags in (('defaults', dict(warmup_iters=None)), ('changed', OTHER)):
        cfg = resolved(data_dir, **flags)
        lr, low, warm = cfg.learning_rate, cfg.min_lr, cfg.warmup_iters
        lrs = [lr / 2, lr, (lr + low) / 2] if warm == 1 else [lr * (i + 1) / (warm + 1) for i in range(3)]
        if name == 'defaults':  # (the rate, min_lr and warm-up: this machine's defaults, warm-up > 3)
            adamw = ('weight_decay', 'beta1', 'beta2', 'grad_clip')
            assert [getattr(cfg, f) for f in adamw] == [getattr(hg.Config(), f) for f in adamw] and warm > 3
        model, rows, seen = run(data_dir, tmp_path / name, **flags)
        assert [r['lr'] for r in rows] == pytest.approx(lrs, rel=1e-15)  # (fp64: a rounding or two)
        want, norms = plain_adamw(cfg, hg.load_data(cfg)['train'], seen['weights'][0], lrs)
        assert all(n > cfg.grad_clip for n in norms), (name, norms)  # so the clip is seen
        # the norm each row logs, read in fp32: within 2^-24 relative
        assert [r['grad_norm'] for r in rows] == [pytest.approx(n, rel=2.0 ** -23) for n in norms]
        got = dict(model.named_parameters())
        for k, w in want.items():
            # fp64 rounding: the gradients agree to ~1e-16 relative; Adam's m / (sqrt(v) + eps)
            # divides an element's rounding by at least eps, so the key biases, whose exact
            # gradient is 0 (rounding only), differ most: measured 4e-13 of lr. A flag ignored
            # moves some weight by 2.7e-3 of lr or more (measured: the default weight decay)
            err = (got[k].detach() - w).abs().max().item()
            assert err <= 1e-10 * lr, (name, k, err / lr)


def windows_of(data, x, y):
    """Whether each row of x is a window of data and y the same window one token on."""
    starts = np.lib.stride_tricks.sliding_window_view(np.asarray(data, np.int64), x.shape[1] + 1)
    rows = {tuple(w.tolist()) for w in starts}
    return all(tuple(a.tolist() + [b[-1].item()]) in rows and torch.equal(a[1:], b[:-1]) for a, b in zip(x, y))


def test_each_step_draws_its_own_batches_the_same_in_every_mode_and_after_resume(data_dir, tmp_path):
    # the microbatches the loop hands its step, recorded: 4 steps of GPU-only; of hetero (half
    # of each step on the stand-in); 2 steps, then --resume to 4; and another --seed
    tiny = helpers.TINY | dict(max_iters=4, eval_interval=2)
    runs = {name: run(data_dir, tmp_path / name, tiny, **flags)[2]['batches'] for name, flags in (
        ('gpu', dict(mode='gpu')), ('hetero', dict(mode='hetero', ane_dtype='float32', ane_fraction=0.5)),
        ('seed', dict(mode='gpu', seed=7, max_iters=2)), ('resumed', dict(mode='gpu', max_iters=2)))}
    runs['resumed'] += run(data_dir, tmp_path / 'resumed', tiny, mode='gpu', resume=True)[2]['batches']
    steps = [torch.cat([x for x, _ in mbs]) for mbs in runs['gpu']]
    assert len(steps) == 4 and all(s.shape == (2 * 2, 16) for s in steps)  # 2 microbatches of 2
    # consecutive steps (and any two) draw other windows, of the training split
    assert all(not torch.equal(a, b) for i, a in enumerate(steps) for b in steps[i + 1:])
    data = hg.load_data(resolved(data_dir))
    assert all(windows_of(data['train'], x, y) for mbs in runs['gpu'] for x, y in mbs)
    # the same seed, the same batches: in either mode, and after a resume; another seed, others
    for name in ('hetero', 'resumed'):
        assert len(runs[name]) == 4, name
        assert all(torch.equal(a, b) for s, t in zip(runs['gpu'], runs[name]) for p, q in zip(s, t)
                   for a, b in zip(p, q)), name
    assert not any(torch.equal(torch.cat([x for x, _ in mbs]), steps[i]) for i, mbs in enumerate(runs['seed']))


def test_a_full_validation_split_is_the_token_weighted_mean(data_dir, tmp_path):
    # --eval_iters 0: the whole validation split in windows of 16, 31 a batch. 526 tokens make
    # 32 windows, so the last batch holds one window: a mean of the batches' means would weigh
    # it as the other 31 together. The row's val_loss against the mean over every window's
    # tokens, in one forward of them all
    model, rows, _ = run(data_dir, tmp_path, max_iters=1, eval_iters=0, batch_size=31, gradient_accumulation_steps=1)
    val = hg.load_data(resolved(data_dir))['val']
    T = 16
    n = (len(val) - 1) // T
    assert n == 32 and n % 31 == 1
    xy = torch.from_numpy(val[:n * T + 1].astype(np.int64))
    with torch.no_grad():
        want = model(xy[:-1].view(n, T), xy[1:].view(n, T))[1].item()
    # each batch's mean loss is weighted and added in fp32: a few roundings of 2^-24 (6e-8),
    # measured 2e-8. A mean of the batches' means is off by about half the last window's distance
    # from the rest: here 9e-5 relative
    assert abs(rows[-1]['val_loss'] - want) <= 2.5e-7 * want, (rows[-1]['val_loss'], want)
