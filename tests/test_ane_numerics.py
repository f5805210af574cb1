"""The Core ML program under what is known of the ANE's fp16 (coreml_and_ane.md section 2), imitated
by programs.numpy_predict(prog, ane=True): reduce_sum accumulating in fp16, matmul wide,
saturation instead of inf, inexact lookup tables. fp16: unit roundoff u = 2^-11 = 4.9e-4, largest value 65504."""
import copy

import coremltools  # noqa: F401  (a test requirement: requirements.txt)
import numpy as np
import pytest
import torch

import export_ane
import hetero_gpt as hg
import helpers
from plumbing import programs
from plumbing import settings
from test_grads import cosine  # fp64 cosine of two tensors

U = 2.0 ** -11


class ReduceOps(hg.MILOps):
    """MILOps with its sums and means as they were: reduce_sum and reduce_mean."""
    def sum(self, x, axis, keep=True): return self.unary('reduce_sum', x, axes=[axis], keep_dims=keep)
    def mean(self, x, axis): return self.unary('reduce_mean', x, axes=[axis], keep_dims=True)


class SquareOps(hg.MILOps):
    """MILOps with the derivation's layernorm forward, mean(xc * xc) (its means as matmuls)."""
    layernorm_forward = hg.Derivation.layernorm_forward


def fp64_reference(module_fn, inputs, dy):
    """(output, {name: gradient}) of module_fn(**inputs) in fp64 autograd, seeded with dy."""
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inputs.items()}
    y = module_fn(**t)
    if dy is not None:
        y.backward(torch.as_tensor(dy, dtype=torch.float64))
    else:
        y.backward()
    return y.detach(), {k: v.grad for k, v in t.items()}


@pytest.fixture(scope='module')
def gpt2_programs(tmp_path_factory):
    # GPT-2 124M's shapes (768 wide, 12 heads, 1024 tokens, the real vocabulary: four chunks of
    # 12608 rows): the block programs at the default ANE microbatch, the head at one sequence
    root = tmp_path_factory.mktemp('gpt2')
    out = {}
    for B in (settings.ANE_BATCH, 1):
        out[B] = str(root / f'B{B}')
        export_ane.export_programs(hg.GPTConfig(n_layer=1), B, 1024, out[B])
    return out


# M1's matmul flushes fp16 subnormals, below 2^-14 (programs.ane_switches; ane-guide). The
# programs keep their matmuls' operands above that: the ANE's loss scale starts at 4096, and the
# head's backward scales its softmax up (PROBS_UP). With 256 and no PROBS_UP, M1's flush cost
# ln_f's weight a cosine of 0.991 here, and the key bias's zero gradient came out at 25% of bq's.
SCALE = hg.Config.ane_loss_scale


@pytest.mark.slow
@pytest.mark.parametrize('subnormals', ['keep', 'matmul'])
def test_block_programs_at_gpt2_124m_shapes(subnormals, gpt2_programs, monkeypatch):
    # One block of GPT-2 124M at 4x1024 tokens, both programs in the ANE mode (its tables
    # inexact, programs.LUT_ERROR: 2^-10, about fp16's own rounding), against fp64
    # autograd on the same fp16-representable inputs: the forward's y and every gradient of
    # the backward (which recomputes the forward) by direction, cosine >= 0.999 (fp16
    # compares by direction, as test_grads.py). x: residual-stream values (RMS ~3); dy: a
    # gradient as the ANE's initial loss scale leaves it, about scale / N per element.
    monkeypatch.setenv('MACOS_DOUBLE_ANE_SUBNORMALS', subnormals)
    cfg, B, T = hg.GPTConfig(n_layer=1), settings.ANE_BATCH, 1024
    N, C = B * T, cfg.n_embd
    torch.manual_seed(0)
    block = hg.GPT(cfg).transformer.h[0].double()
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((N, C))).astype(np.float16).astype(np.float32)
    dy = (SCALE / N * rng.standard_normal((N, C))).astype(np.float16).astype(np.float32)
    params = {f'transformer.h.0.{k}': p for k, p in block.named_parameters()}
    weights = {k[3:]: v.detach().float().numpy() for k, v in hg.host_weights(
        params | {k: p for k, p in hg.gpt_param_shapes(cfg).items() if k not in params}, cfg).items() if k.startswith('h0_')}
    ref = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y64 = block(ref.view(B, T, C)).view(N, C)
    y64.backward(torch.tensor(dy, dtype=torch.float64))
    predict = programs.numpy_programs(gpt2_programs[B], ('block_forward', 'block_backward'), ane=True)
    y = predict('block_forward', {'x': x} | weights)['y']
    d = predict('block_backward', {'x': x, 'dy': dy} | weights)
    cos = {'y': cosine(torch.tensor(y.astype(np.float32)), y64.detach()), 'x': cosine(torch.tensor(d['d_x'].astype(np.float32)), ref.grad)}
    for k, (name, third) in hg.BLOCK_PARAMS.items():
        g = dict(block.named_parameters())[name].grad
        cos[k] = cosine(torch.tensor(d['d_' + k].astype(np.float32)), g if third is None else g.chunk(3, 0)[third])
    # the key bias's true gradient is 0 (it adds q . bk to a whole row of scores, which the
    # softmax ignores): no direction to compare; its rounding noise is tiny beside bq's gradient
    assert np.abs(d['d_bk']).max() < 1e-2 * np.abs(d['d_bq']).max()
    del cos['bk']
    print(f"block at {B}x{T}: worst cosine {min(cos.values()):.6f} ({min(cos, key=cos.get)})")
    assert all(c >= 0.999 for c in cos.values()), cos
    assert all(np.isfinite(v).all() and np.abs(v).max() < programs.ANE_OVERFLOW for v in d.values())


@pytest.mark.slow
@pytest.mark.parametrize('subnormals', ['keep', 'matmul'])
def test_head_program_at_the_real_vocabulary(subnormals, gpt2_programs, monkeypatch):
    # The final layernorm, the tied LM head over 50257 tokens (four chunks) and the loss, forward
    # and backward, at 1x1024 tokens in the ANE mode, against fp64 autograd: the loss (an fp16
    # output near 11, spacing 2^-7) within two fp16 spacings (the log table's error, 2^-10 of
    # each row's ~11, takes either sign row by row: the mean over 1024 rows keeps ~1/32 of it);
    # d x, d ln_f and the embedding's
    # gradient (the chunks' rows plus the target rows, as host_grads adds them) by cosine >= 0.999.
    monkeypatch.setenv('MACOS_DOUBLE_ANE_SUBNORMALS', subnormals)
    cfg, N = hg.GPTConfig(n_layer=1), 1024
    torch.manual_seed(0)
    model = hg.GPT(cfg)
    rng = np.random.default_rng(1)
    x = (3 * rng.standard_normal((N, cfg.n_embd))).astype(np.float16).astype(np.float32)
    targets = torch.randint(0, cfg.vocab_size, (N,))
    w = {k: p.detach() for k, p in model.named_parameters()}
    inp = {k: v.numpy() for k, v in hg.host_weights(w, cfg).items() if k.startswith(('lnf_', 'wte_'))}
    scale = SCALE
    inp |= {'x': x, 'wte_tgt': w['transformer.wte.weight'][targets].numpy(), 'loss_scale': np.full((1, 1), scale, np.float32)}
    out = programs.numpy_programs(gpt2_programs[1], ('head',), ane=True)('head', inp)

    def head(x, lnf_w, lnf_b, wte):
        logits = torch.nn.functional.layer_norm(x, (cfg.n_embd,), lnf_w, lnf_b) @ wte.T
        return torch.nn.functional.cross_entropy(logits, targets)
    loss, g = fp64_reference(head, dict(x=x, lnf_w=w['transformer.ln_f.weight'].numpy(),
                                        lnf_b=w['transformer.ln_f.bias'].numpy(), wte=w['transformer.wte.weight'].numpy()), None)
    rows, spans = hg.vocab_chunks(cfg.vocab_size)
    dwte = torch.cat([torch.tensor(out[f'd_wte_{j}'][:b - a], dtype=torch.float64) for j, (a, b) in enumerate(spans)])
    dwte.index_add_(0, targets, torch.tensor(out['d_wte_tgt'], dtype=torch.float64))
    cos = {'wte': cosine(dwte, g['wte'])} | {k: cosine(torch.tensor(out['d_' + k].astype(np.float32)), g[k])
                                             for k in ('x', 'lnf_w', 'lnf_b')}
    print(f"head at 1x1024, vocabulary {cfg.vocab_size}: loss {out['loss'].item():.4f} vs {loss.item():.4f}; "
          f"worst cosine {min(cos.values()):.6f} ({min(cos, key=cos.get)})")
    assert abs(out['loss'].item() - loss.item()) <= 2 * 2.0 ** -7
    assert all(c >= 0.999 for c in cos.values()), cos


@pytest.mark.parametrize('what', ['bias gradient', 'sum of exponentials'])
def test_sums_as_reduce_sum_lose_accuracy(what, monkeypatch):
    # The same sum, once as the reduce_sum the program used to have, once as a matmul with a
    # ones vector (MILOps now), in the ANE mode, against fp64 on the same fp16 inputs.
    # The matmul rounds once: relative error <= u. The fp16 running sum loses far more.
    # Subnormals kept: M1's flushing matmul drops the exponentials below 2^-14 (1.6e-3 here).
    monkeypatch.setenv('MACOS_DOUBLE_ANE_SUBNORMALS', 'keep')
    rng = np.random.default_rng(0)
    if what == 'bias gradient':  # over 4096 rows (B=4, T=1024) of gradients with a nonzero mean
        x = (rng.standard_normal((4096, 768)) * 0.01 + 0.005).astype(np.float16)
        fn = lambda ops, x: ops.sum(x, 0, keep=False)
        ref = x.astype(np.float64).sum(0)
    else:  # the LM head's: log sum_v exp(z_v) over one vocabulary chunk (12608 logits)
        x = (rng.standard_normal((16, 12608)) * 2).astype(np.float16)
        fn = lambda ops, x: ops.logsumexp_forward(x)
        ref = np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    err = {}
    for ops in (ReduceOps, hg.MILOps):  # exact tables (lut={}): this measures the sums alone
        out = programs.numpy_predict(hg.mil_program(lambda _, x: {'y': fn(ops(), x)}, {'x': x.shape}), ane=True,
                                     lut={})({'x': x})['y']
        err[ops.__name__] = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"{what}: max relative error {err['ReduceOps']:.2e} as reduce_sum, {err['MILOps']:.2e} as a matmul "
          f"({err['ReduceOps'] / err['MILOps']:.0f}x)")
    assert err['MILOps'] <= 2 * U  # one rounding of the sum, one of the log for the second
    assert err['ReduceOps'] >= 10 * err['MILOps']


def test_layernorm_of_rows_past_rms_256():
    # Rows of RMS ~1000 (GPT-2's residual stream has such values): the derivation's
    # mean(xc * xc) squares values past 256, whose squares pass 65504: in the ANE mode the
    # squares saturate, silently (everything stays finite, xhat ~4x too large; the means are
    # matmuls in both, so this is the squares' doing, not the sums'). MILOps scales
    # each row by its largest |xc| first: y and the backward's dx, dw, db (the derivation's
    # layernorm_backward, unchanged, on the new cache) within fp16 rounding of fp64:
    # a few roundings of relative size u and the rsqrt table's error (programs.LUT_ERROR,
    # 2u), so <= 8u relative to the largest value.
    rng = np.random.default_rng(0)
    C = 768
    x = (rng.standard_normal((32, C)) * 1000 + 300).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float16)
    b = (0.1 * rng.standard_normal(C)).astype(np.float16)
    dy = (256 * rng.standard_normal((32, C)) / 32).astype(np.float16)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in dict(x=x, w=w, b=b).items()}
    y64 = torch.nn.functional.layer_norm(t['x'], (C,), t['w'], t['b'], eps=1e-5)
    y64.backward(torch.tensor(dy, dtype=torch.float64))
    ref = dict(y=y64.detach(), dx=t['x'].grad, dw=t['w'].grad, db=t['b'].grad)

    def step(ops, x, w, b, dy):
        y, cache = ops.layernorm_forward(x, w, b)
        dx, dw, db = ops.layernorm_backward(dy, w, cache)
        return dict(y=y, dx=dx, dw=dw, db=db)
    prog = {name: hg.mil_program(lambda _, **i: step(ops, **i), dict(x=x.shape, w=w.shape, b=b.shape, dy=dy.shape))
            for name, ops in (('old', SquareOps()), ('new', hg.MILOps()))}
    out = {name: programs.numpy_predict(p, ane=True)(dict(x=x, w=w, b=b, dy=dy)) for name, p in prog.items()}
    rel = {name: {k: (np.abs(o[k] - ref[k].numpy()).max() / ref[k].abs().max()).item() for k in ref}
           for name, o in out.items()}
    print(f"relative errors, derivation's layernorm: {rel['old']}; MILOps': {rel['new']}")
    assert rel['old']['y'] > 1  # xhat wrong by a factor, not a rounding (saturated, so finite: no inf shows it)
    assert all(e <= 8 * U for e in rel['new'].values()), rel['new']


def test_injected_overflow_is_caught_and_never_applied(exported):
    # c_attn scaled 1000x: attention scores saturate in the ANE mode. Every output stays
    # finite (isfinite alone would pass this step: in IEEE fp16 it gives inf or nan), but some
    # reach 2^14: CoreMLEngine marks the microbatch, the step drops the ANE's gradients, halves
    # its loss scale, and the update uses the GPU engine's gradient alone.
    cfg = helpers.PROGRAMS['cfg']
    path = exported(**helpers.PROGRAMS)
    torch.manual_seed(0)
    model = hg.GPT(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(1000)
    seen = {'ane': [], 'ieee': []}

    def recording(ane):
        evaluate = programs.numpy_programs(path, hg.ANE_PIECES, ane=ane)
        return lambda piece, inputs: seen['ane' if ane else 'ieee'].append(evaluate(piece, inputs)) or seen['ane' if ane else 'ieee'][-1]
    engines = {'gpu': hg.AutogradEngine(model, torch.device('cpu'), torch.float32),
               'ane': helpers.open_programs(path, predict=recording(True),
                                               scaler=hg.LossScaler(256.0, 200, limit=programs.ANE_OVERFLOW / 2))}
    step = hg.HeteroStep(model, engines, hg.Split(2, 0.5), optimizer=torch.optim.AdamW(model.parameters()))
    microbatches = [tuple(torch.randint(0, cfg.vocab_size, (2, 8)) for _ in range(2)) for _ in range(2)]
    alone = copy.deepcopy(model)  # the GPU engine's gradient on its microbatch (the second), alone
    alone(*microbatches[1])[1].backward()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    ieee = helpers.open_programs(path, predict=recording(False), scaler=hg.LossScaler(256.0, 200))
    ieee.load_weights(dict(model.named_parameters()))
    out = step(microbatches)
    outputs = [v for o in seen['ane'] for v in o.values()]
    assert all(np.isfinite(v).all() for v in outputs) and max(np.abs(v).max() for v in outputs) >= programs.ANE_OVERFLOW
    assert max(np.abs(v).max() for o in seen['ane'] for k, v in o.items() if k == 'peaks') >= programs.ANE_OVERFLOW
    with np.errstate(all='ignore'):
        ieee.loss_and_grads(*microbatches[0])
    assert not all(np.isfinite(v).all() for o in seen['ieee'] for v in o.values())  # what IEEE fp16 would show
    assert out.used == ['gpu'] and step.dropped['ane'] == 1 and engines['ane'].scaler.scale == 128.0
    for (k, p), q in zip(model.named_parameters(), alone.parameters()):
        assert torch.equal(p.grad, q.grad), k
    step.update(out)
    ref = torch.optim.AdamW(alone.parameters())  # the same AdamW step from the GPU's gradient
    ref.step()
    for (k, p), q in zip(model.named_parameters(), alone.parameters()):
        assert torch.equal(p.detach(), q.detach()) and not torch.equal(p.detach(), before[k]), k


def test_ane_loss_scale_starts_at_4096_and_stops_short_of_saturation():
    # (the worker's scaler lives in the training process too: test_worker.py's trainer test)
    cfg = hg.Config(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50, ane_worker=False)
    model = hg.GPT(hg.model_config(cfg))
    cpu = torch.device('cpu')
    run = settings.Run('hetero', cpu, torch.float32, cpu, torch.float16, ane_in_worker=False, ane_programs=False,
                       ane_batch_size=settings.ane_batch_size(cfg))
    engines = hg.build_engines(cfg, model, run, log=lambda s: None)
    assert engines['ane'].scaler.scale == 4096.0 and engines['ane'].scaler.limit == programs.ANE_OVERFLOW / 2
    s = hg.LossScaler(256.0, 1, limit=programs.ANE_OVERFLOW / 2)
    for peak, scale in ((1000.0, 512.0), (3000.0, 1024.0), (5000.0, 1024.0), (4000.0, 2048.0)):
        s.peak = peak  # what CoreMLEngine reports: the largest scaled output since the last update
        s.update(True)  # doubling grows it only while 2 * peak < 8192: outputs stay <= 2^13
        assert s.scale == scale and s.peak == 0.0


def ane_mode(fn, inputs, lut=None):
    """fn(MILOps(), **inputs) as one program, run in the ANE mode with the switches set now."""
    prog = hg.mil_program(fn, {k: v.shape for k, v in inputs.items()})
    return programs.numpy_predict(prog, ane=True, lut=lut)(inputs)


@pytest.mark.parametrize('mode', ['matmul', 'keep', 'all'])
def test_subnormals_flush_in_the_matmul_as_on_m1(mode, monkeypatch):
    # ane-guide part 1 ch. 3: M1's elementwise path keeps fp16 subnormals (below 2^-14), its
    # matmul flushes them, in and out; M5 keeps them. x @ I with subnormals 2^-20 and 2^-15:
    # 0 in the matmul, kept by x + 0 (exact: no rounding). a @ b = 2^-7 * 2^-8 = 2^-15: flushed.
    monkeypatch.setenv('MACOS_DOUBLE_ANE_SUBNORMALS', mode)
    x = np.array([[2.0 ** -20, -2.0 ** -15, 2.0 ** -14, 1.0]], np.float16)
    inputs = dict(x=x, w=np.eye(4, dtype=np.float16), a=np.full((1, 1), 2.0 ** -7, np.float16),
                  b=np.full((1, 1), 2.0 ** -8, np.float16))
    fn = lambda o, x, w, a, b: {'mm': o.matmul(x, w), 'add': x + 0.0, 'ab': o.matmul(a, b)}
    out = ane_mode(fn, inputs)
    normal = np.array([[0, 0, 2.0 ** -14, 1.0]], np.float16)
    assert np.array_equal(out['mm'], x if mode == 'keep' else normal)
    assert np.array_equal(out['add'], normal if mode == 'all' else x)
    assert out['ab'].item() == (2.0 ** -15 if mode == 'keep' else 0.0)


@pytest.mark.parametrize('mode', ['engine', 'ieee'])
def test_nan_enters_as_the_clamp_and_no_result_is_nan(mode, monkeypatch):
    # ane-guide part 1 ch. 3 (M1): a NaN input becomes +inf, here saturated to +65504 as every
    # inf; the forms that give NaN in IEEE (log(-1), rsqrt(-1)) give +0. Exact tables (lut={}).
    monkeypatch.setenv('MACOS_DOUBLE_ANE_NAN', mode)
    x = np.array([[np.nan, -1.0, 4.0]], np.float16)
    fn = lambda o, x: {'id': x + 0.0, 'log': o.log(x), 'rsqrt': o.rsqrt(x)}
    out = ane_mode(fn, dict(x=x), lut={})
    if mode == 'ieee':
        assert np.isnan(out['id'][0, 0])
        assert np.isnan(out['log'][0, :2]).all() and np.isnan(out['rsqrt'][0, :2]).all()
        return
    assert out['id'].tolist() == [[65504.0, -1.0, 4.0]]
    assert out['log'][0, 1] == 0 and out['rsqrt'][0, 1] == 0
    assert out['log'][0, 0] == np.float16(np.log(np.float32(65504)))  # log(+65504), 11.09
    assert not any(np.isnan(v).any() for v in out.values())


def softmax(v):
    p = np.exp(v - v.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


EXACT = dict(exp=np.exp, log=np.log, tanh=np.tanh, rsqrt=lambda v: 1 / np.sqrt(v), softmax=softmax)


def table(name):
    return lambda o, x: {'y': o.softmax(x, -1) if name == 'softmax' else getattr(o, name)(x)}


@pytest.mark.parametrize('name', list(programs.LUT_ERROR))
def test_table_bias_has_one_sign_and_size(name, monkeypatch):
    # MACOS_DOUBLE_ANE_LUT_BIAS=b: on top of the table's error, exp, rsqrt and softmax are
    # (1 - b) times what they were, tanh and log b less (an origin bias, as gelu's and swish's,
    # both negative). Each result is rounded to fp16 once more: relative 2^-11 of it.
    b = 2.0 ** -8
    x = np.linspace(0.5, 3, 1024).astype(np.float16).reshape(16, 64)
    x[0, 0] = 0 if name == 'tanh' else 1  # the origin: tanh(0) = log(1) = 0
    fn = table(name)
    monkeypatch.setenv('MACOS_DOUBLE_ANE_LUT_BIAS', '0')
    plain = ane_mode(fn, dict(x=x))['y'].astype(np.float64)
    monkeypatch.setenv('MACOS_DOUBLE_ANE_LUT_BIAS', str(b))
    biased = ane_mode(fn, dict(x=x))['y'].astype(np.float64)
    if name in ('tanh', 'log'):
        assert biased[0, 0] == -b
        assert np.abs(biased - plain + b).max() <= 2 * U * np.abs(plain).max() * 1.01
    else:
        assert np.abs(biased / plain - (1 - b)).max() <= 2 * U * 1.01
    assert (biased < plain).all()


@pytest.mark.parametrize('name', list(programs.LUT_ERROR))
def test_table_error_between_knots_is_smooth_and_one_signed(name, monkeypatch):
    # MACOS_DOUBLE_ANE_LUT=knots (the default): a piecewise-linear table's relative error,
    # e * 4u(1 - u) between knots (u in [0, 1) across a segment), on one side of the curve.
    # e = 2^-5, far above fp16's rounding (u = 2^-11 a rounding, three at most: 3u).
    # Neighbouring fp16 inputs in [1, 2) (spacing 2^-10) move u by at most 2^-10 * 32 /
    # ln 2 = 0.045 (exp, log, rsqrt; tanh 0.004), so their errors differ by at most
    # 4 * 0.045 e = 0.18 e, plus the roundings. Hashed errors of neighbours differ by up to 2e.
    e = 2.0 ** -5
    x = (1 + np.arange(1, 1024) / 1024).astype(np.float16).reshape(1, 1023)  # not 1: log(1) = 0
    rel = {}
    for shape in ('knots', 'hash'):
        monkeypatch.setenv('MACOS_DOUBLE_ANE_LUT', shape)
        y = ane_mode(table(name), dict(x=x), lut={name: e})['y'].astype(np.float64)
        rel[shape] = (y / EXACT[name](x.astype(np.float64)) - 1).ravel()
    step = np.abs(np.diff(rel['knots']))
    assert step.max() <= 0.18 * e + 6 * U, step.max()
    assert np.abs(np.diff(rel['hash'])).max() > e
    assert (programs.LUT_CURVE[name] * rel['knots'] > -3 * U).all()  # one sign
    assert 0.9 * e <= np.abs(rel['knots']).max() <= e + 3 * U
