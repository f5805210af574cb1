"""The trainer end to end on a tiny configuration (CPU, a data set the test writes), and
the concurrent step with engines whose behaviour the test controls."""
import contextlib
import json
import math
import time

import pytest
import torch

import hetero_gpt as hg

TINY = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--block_size', '32', '--batch_size', '4',
        '--gradient_accumulation_steps', '2', '--learning_rate', '3e-3', '--warmup_iters', '5',
        '--eval_iters', '4', '--sample_tokens', '0', '--quiet', '--device', 'cpu', '--log_interval', '5']


def run(data_dir, out_dir, *extra):
    cfg, given = hg.parse_args(['--dataset', 'tiny', '--data_dir', data_dir, '--out_dir', str(out_dir)] + TINY + list(extra))
    model = hg.train(cfg, given)
    rows = [json.loads(l) for l in open(out_dir / 'metrics.jsonl')]
    return model, rows


def test_loss_falls_and_metrics_are_logged(data_dir, tmp_path):
    _, rows = run(data_dir, tmp_path, '--max_iters', '40', '--eval_interval', '20')
    losses = [r['loss'] for r in rows if 'loss' in r]
    vals = [r['val_loss'] for r in rows if 'val_loss' in r]
    assert losses[-1] < losses[0] - 2.0, losses   # from ~ln(50257) = 10.8
    assert vals[-1] < vals[0], vals
    last = rows[-1]
    for k in ('step', 'loss', 'val_loss', 'val_ppl', 'lr', 'tokens_per_s', 'elapsed', 'tokens'):
        assert k in last
    assert last['step'] == 40 and math.isclose(last['val_ppl'], math.exp(last['val_loss']))
    assert (tmp_path / 'ckpt.pt').exists() and not (tmp_path / 'ckpt.pt.tmp').exists()


def test_interrupt_then_resume_continues_exactly(data_dir, tmp_path, ctrl_c):
    # 20 steps straight vs Ctrl-C at step 7 (a checkpoint is saved) then --resume to 20:
    # the same batches (seeded by step) and optimizer state give the same weights, bit
    # for bit on the CPU
    a, _ = run(data_dir, tmp_path / 'a', '--max_iters', '20', '--eval_interval', '10')
    ctrl_c.at(7)
    run(data_dir, tmp_path / 'b', '--max_iters', '20', '--eval_interval', '100')
    ck = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=False)
    assert ck['iter_num'] == 7 and len(ck['optimizer']['state']) > 0
    ctrl_c.off()
    b, rows = run(data_dir, tmp_path / 'b', '--max_iters', '20', '--eval_interval', '10', '--resume')
    assert rows[-1]['step'] == 20
    for (k, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), k


@pytest.mark.parametrize('bias', ['True', 'False'])
def test_hetero_fp32_matches_gpu_only(data_dir, tmp_path, bias):
    # eager engine in fp32 taking half of every step vs autograd alone: same batches, and
    # losses within fp32 rounding (1e-7 relative per op, grown over 10 AdamW steps: 1e-4);
    # GPT-2's biases and nanoGPT's bias=False alike
    _, gpu = run(data_dir, tmp_path / 'g', '--max_iters', '10', '--eval_interval', '10', '--mode', 'gpu',
                 '--bias', bias)
    _, het = run(data_dir, tmp_path / 'h', '--max_iters', '10', '--eval_interval', '10', '--mode', 'hetero',
                 '--ane_dtype', 'float32', '--ane_fraction', '0.5', '--bias', bias)
    assert het[-1]['ane_microbatches'] == 1 and het[-1]['ane_loss'] > 0 and het[-1]['gpu_loss'] > 0
    for g, h in zip(gpu, het):
        assert abs(g['loss'] - h['loss']) < 1e-4 * g['loss'], (g, h)
    assert abs(gpu[-1]['val_loss'] - het[-1]['val_loss']) < 1e-4 * gpu[-1]['val_loss']


def test_fp16_autograd_engine_scales_its_loss():
    # fp16 autocast (on the CPU here) with a loss scale: the gradients come back unscaled,
    # equal to fp32 autograd's up to fp16 rounding (cosine >= 0.999), and the scale adapts
    torch.manual_seed(0)
    model = hg.GPT(hg.GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=2, n_embd=32))
    idx, targets = (torch.randint(0, 300, (2, 16)) for _ in range(2))
    cpu = torch.device('cpu')
    ref = hg.AutogradEngine(model, cpu, torch.float32).loss_and_grads(idx, targets)[1]
    ref = {k: v.clone() for k, v in ref.items()}
    eng = hg.AutogradEngine(model, cpu, torch.float16, scaler=hg.LossScaler(1024.0, 100))
    assert eng.scaler.enabled and eng.scaler.scale == 1024.0
    _, grads = eng.loss_and_grads(idx, targets)
    for k, g in grads.items():
        assert torch.nn.functional.cosine_similarity(g.flatten(), ref[k].flatten(), dim=0) >= 0.999, k
    assert not hg.AutogradEngine(model, cpu, torch.bfloat16, scaler=hg.LossScaler(1024.0, 100)).scaler.enabled


def test_bad_flags_and_data(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        hg.parse_args(['--no_such_flag', '1'])
    cases = [(['--n_embd', '30', '--n_head', '4'], 'not divisible'),
             (['--block_size', '100000'], 'larger than the'),
             (['--mode', 'tpu'], 'unknown --mode'),
             (['--ane_fraction', '1.5'], 'ane_fraction'),
             (['--dataset', 'nonesuch'], 'prepare_data.py --input'),
             (['--resume'], 'no checkpoint')]
    for flags, message in cases:
        with pytest.raises(SystemExit) as e:
            hg.main(['--dataset', 'tiny', '--data_dir', data_dir, '--out_dir', str(tmp_path / 'x')] + TINY + flags)
        assert e.value.code == 2
        assert message in capsys.readouterr().err, flags


def test_corrupt_data_is_refused(data_dir, tmp_path, capsys):
    import shutil
    bad = tmp_path / 'data'
    shutil.copytree(data_dir, bad)
    with open(bad / 'tiny' / 'train.bin', 'r+b') as f:
        f.truncate(100)  # an interrupted copy
    with pytest.raises(SystemExit):
        hg.main(['--dataset', 'tiny', '--data_dir', str(bad), '--out_dir', str(tmp_path / 'o')] + TINY)
    assert 'does not match meta.json' in capsys.readouterr().err


# ---- the concurrent step, with engines the test controls

class FakeEngine:
    """Takes `seconds` per microbatch (sleeping releases the GIL, as GPU kernels and
    PyTorch's C++ do) and returns gradients from `grads(idx)`."""

    def __init__(self, name, seconds, grads, fail=False):
        self.name, self.seconds, self.grads, self.fail = name, seconds, grads, fail
        self.label, self.device = f'fake {name}', torch.device('cpu')
        self.scaler = hg.LossScaler(1024.0, 2)
        self.calls = 0

    def load_weights(self, params):
        pass

    def loss_and_grads(self, idx, targets):
        self.calls += 1
        if self.fail:
            raise RuntimeError('device lost')
        time.sleep(self.seconds)
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


def test_concurrency_is_real():
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0.2, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0.2, const_grads(model, 1.0))}
    step = hg.HeteroStep(model, eng, hg.Split(4, '0.5'))
    t0 = time.perf_counter()
    step(microbatches(4))
    dt = time.perf_counter() - t0
    assert dt < 0.75 * (4 * 0.2), dt  # serial would be 0.8 s; concurrent about 0.4 s


def test_gradients_are_token_weighted_means():
    # 3 microbatches of gradient 1 on the GPU, 1 of gradient 5 on the ANE: mean 2
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, const_grads(model, 5.0))}
    hg.HeteroStep(model, eng, hg.Split(4, '0.25'))(microbatches(4))
    assert all(torch.allclose(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())


def test_auto_split_moves_toward_the_faster_engine():
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0.01, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0.03, const_grads(model, 1.0))}
    split = hg.Split(8, 'auto')
    step = hg.HeteroStep(model, eng, split)
    assert split.current(step.alive) == 4  # starts even
    for _ in range(5):
        step(microbatches(8))
    assert split.current(step.alive) == 2  # the ANE is 3x slower: 8 * (1/3) / (1 + 1/3) = 2


def test_auto_split_remeasures_an_idle_engine():
    # the split left the ANE idle (measured 7.5x slower than the GPU: 4 * 1/8.5 rounds to 0
    # of 4 microbatches); every 20th step it still gets one, so a change in its speed is
    # seen, unless one of its microbatches took longer than two whole GPU steps
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, const_grads(model, 1.0))}
    for ane_sec, probes in ((0.015, 1), (0.017, 0)):  # two GPU steps: 2 * 4 * 0.002 = 0.016 s
        split = hg.Split(4, 'auto')
        split.sec, split.k = {'gpu': 0.002, 'ane': ane_sec}, 0
        step = hg.HeteroStep(model, eng, split)
        calls = eng['ane'].calls
        for _ in range(20):
            step(microbatches(4))
        assert eng['ane'].calls == calls + probes, ane_sec


def test_nonfinite_gradients_are_skipped_and_counted():
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, const_grads(model, float('inf')))}
    step = hg.HeteroStep(model, eng, hg.Split(4, '0.5'))
    out = step(microbatches(4))
    assert out['used'] == ['gpu'] and step.dropped['ane'] == 1
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


def test_failing_engine_leaves_training_running():
    model = tiny_model()
    eng = {'gpu': FakeEngine('gpu', 0, const_grads(model, 1.0)), 'ane': FakeEngine('ane', 0, None, fail=True)}
    said = []
    step = hg.HeteroStep(model, eng, hg.Split(4, '0.5'), log=said.append)
    out = step(microbatches(4))  # the GPU runs its 2 microbatches, then the ANE's 2
    assert out['used'] == ['gpu'] and step.alive == {'gpu'} and out['results']['gpu']['n'] == 4
    assert eng['ane'].calls == 1 and eng['gpu'].calls == 4
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    out = step(microbatches(4))  # the next step runs on the GPU alone, all 4 microbatches
    assert out['used'] == ['gpu'] and eng['ane'].calls == 1 and eng['gpu'].calls == 4 + 4
    assert len(said) == 1 and 'device lost' in said[0]


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
    out = hg.HeteroStep(model, eng, hg.Split(2, '0'), log=lambda s: None)(mbs)
    assert out['used'] == ['ane'] and out['results']['ane']['n'] == 2
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
                        hg.Split(4, '0.5'))
    one = hg.HeteroStep(b, {'gpu': hg.AutogradEngine(b, cpu, torch.float64)}, hg.Split(4, '0'))
    out, grads = {}, {}
    for name, model, step in (('hetero', a, het), ('single', b, one)):
        out[name] = step(mbs)
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters()}
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert out['hetero']['used'] == ['ane', 'gpu'] and out['single']['used'] == ['gpu']
    for k, g in grads['single'].items():
        assert (grads['hetero'][k] - g).abs().max() <= 1e-10 * g.abs().max(), k
    for (k, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa - pb).abs().max().item() < 1e-10, k


def test_bench_times_every_mode_in_turns(data_dir, capsys):
    # bench.py on the tiny config: each mode gets bench_repeats timed rounds, the table names
    # them all, and hetero's row says how its step split and where its time went
    import bench
    cfg, given = hg.parse_args(['--dataset', 'tiny', '--data_dir', data_dir, '--bench_iters', '2',
                                '--bench_repeats', '2'] + TINY, bench.BenchConfig)
    rows = bench.bench(cfg, given)
    assert set(rows) == {'gpu', 'ane', 'hetero'}
    for mode, r in rows.items():
        assert len(r['rounds']) == 2 and r['tok_s'] > 0 and r['ms_step'] > 0
        assert set(r['ms_engines']) <= {'gpu', 'ane'} and r['ms_engines']
    assert rows['hetero']['split'] in ('0/2', '1/2', '2/2') and rows['gpu']['ms_engines'].keys() == {'gpu'}
    out = capsys.readouterr().out
    assert 'hetero / (gpu + ane alone) = ' in out and 'x GPU-only' in out


def test_padded_lm_head_under_autocast_is_gpt2s():
    # vocabulary 100 is padded to 128 inside GPT.forward; under bf16 autocast the padding is
    # done on autocast's bf16 copy of the weight. Against the unpadded head under the same
    # autocast: the same bf16 products, so loss and gradients agree to bf16 rounding of the
    # logits (2^-8 relative), here checked at 1e-2 relative / cosine 0.9999
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
    for k in ga:
        cos = torch.nn.functional.cosine_similarity(ga[k].flatten(), gb[k].flatten(), dim=0)
        assert ga[k].dtype == torch.float32 and cos >= 0.9999, (k, cos)


def test_a_lone_gpu_step_is_not_waited_for_and_skips_a_nonfinite_update():
    # the GPU engine alone: its flag stays on the device until the update is queued, and a
    # non-finite gradient never reaches the weights; the counters and loss scale follow
    model, value = tiny_model(), {'v': float('nan')}
    eng = {'gpu': FakeEngine('gpu', 0, lambda idx: {k: torch.full_like(p, value['v'])
                                                    for k, p in model.named_parameters()})}
    step = hg.HeteroStep(model, eng, hg.Split(2, '0'), optimizer=torch.optim.AdamW(model.parameters()))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    out = step(microbatches(2))
    assert torch.is_tensor(out['results']['gpu']['finite']) and out['used'] == ['gpu']  # not read yet
    step.update(out)
    assert out['n'] == 0 and out['used'] == [] and math.isnan(out['loss'])
    assert step.skipped == 1 and step.dropped['gpu'] == 1 and eng['gpu'].scaler.scale == 512.0
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    value['v'] = 1.0
    out = step.update(step(microbatches(2)))
    assert out['n'] == 2 and out['loss'] == 2.0 and step.skipped == 1 and out['results']['gpu']['seconds'] > 0
    assert not any(torch.equal(p, before[k]) for k, p in model.named_parameters())
