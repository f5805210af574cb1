"""The Core ML program under what is known of the ANE's fp16 (ANE_NOTES section 2), imitated
by export_ane.numpy_predict(prog, ane=True): reduce_sum accumulating in fp16, matmul wide,
saturation instead of inf. fp16: unit roundoff u = 2^-11 = 4.9e-4, largest value 65504."""
import copy

import numpy as np
import pytest
import torch

import export_ane
import hetero_gpt as hg

pytest.importorskip('coremltools')  # (the machines that lend a GPU may not have it)

U = 2.0 ** -11


class ReduceOps(hg.MILOps):
    """MILOps with its sums and means as they were: reduce_sum and reduce_mean."""
    def sum(self, x, axis, keep=True): return self._u('reduce_sum', x, axes=[axis], keep_dims=keep)
    def mean(self, x, axis): return self._u('reduce_mean', x, axes=[axis], keep_dims=True)


class SquareOps(hg.MILOps):
    """MILOps with the derivation's layernorm forward, mean(xc * xc) (its means as matmuls)."""
    layernorm_forward = hg.Derivation.layernorm_forward


def program(fn, **shapes):
    """A MIL program of fn(**fp16 inputs of these shapes) -> {output name: MILTensor}."""
    ct = hg.import_coremltools()
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types
    with Function({k: mb.placeholder(shape=s, dtype=types.fp16) for k, s in shapes.items()},
                  opset_version=ct.target.macOS13) as f:
        out = fn(**{k: hg.MILTensor(v) for k, v in f.inputs.items()})
        f.set_outputs([mb.identity(x=v.v, name=k) for k, v in out.items()])
    prog = Program()
    prog.add_function('main', f)
    return prog


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def test_block_and_lm_head_at_gpt2_124m_shapes(tmp_path):
    # One block of GPT-2 124M (768 wide, 12 heads, 1024 tokens), the final layernorm and the
    # tied LM head at the real vocabulary (50257: four chunks of 12608 rows), one sequence:
    # the saved program, through CoreMLEngine, in the ANE mode, against fp64 autograd.
    # Every gradient: cosine >= 0.999 (fp16 compares by direction, as test_grads.py); the loss,
    # an fp16 output near 11 (spacing 2^-7), within two fp16 spacings.
    cfg = hg.GPTConfig(n_layer=1)
    path = str(tmp_path / 'gpt2_block.mlpackage')
    export_ane.export_coreml(cfg, 1, 1024, path)
    torch.manual_seed(0)
    model = hg.GPT(cfg).double()
    idx, targets = (torch.randint(0, cfg.vocab_size, (1, 1024)) for _ in range(2))
    _, loss = model(idx, targets)
    loss.backward()
    engine = hg.CoreMLEngine(path, predict=export_ane.numpy_predict(export_ane.load_coreml_program(path), ane=True),
                             scaler=hg.LossScaler(hg.Config.ane_loss_scale, 0))
    engine.load_weights(dict(model.named_parameters()))
    l, grads = engine.loss_and_grads(idx, targets)
    cos = {k: cosine(grads[k], p.grad) for k, p in model.named_parameters()}
    worst = min(cos, key=cos.get)
    print(f"loss {l.item():.5f} vs {loss.item():.5f}; worst cosine {cos[worst]:.6f} ({worst}); "
          f"largest scaled output {engine.scaler.peak:.1f}")
    assert abs(l.item() - loss.item()) <= 2 * 2.0 ** -7
    assert all(c >= 0.999 for c in cos.values()), cos
    assert engine.scaler.peak < hg.ANE_OVERFLOW / 4  # room for the loss scale to grow


@pytest.mark.parametrize('what', ['bias gradient', 'sum of exponentials'])
def test_sums_as_reduce_sum_lose_accuracy(what):
    # The same sum, once as the reduce_sum the program used to have, once as a matmul with a
    # ones vector (MILOps now), in the ANE mode, against fp64 on the same fp16 inputs.
    # The matmul rounds once: relative error <= u. The fp16 running sum loses far more.
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
    for ops in (ReduceOps, hg.MILOps):
        out = export_ane.numpy_predict(program(lambda x: {'y': fn(ops(), x)}, x=x.shape), ane=True)({'x': x})['y']
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
    # a few roundings of relative size u, so <= 8u relative to the largest value.
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
    prog = {name: program(lambda **i: step(ops, **i), x=x.shape, w=w.shape, b=b.shape, dy=dy.shape)
            for name, ops in (('old', SquareOps()), ('new', hg.MILOps()))}
    out = {name: export_ane.numpy_predict(p, ane=True)(dict(x=x, w=w, b=b, dy=dy)) for name, p in prog.items()}
    rel = {name: {k: (np.abs(o[k] - ref[k].numpy()).max() / ref[k].abs().max()).item() for k in ref}
           for name, o in out.items()}
    print(f"relative errors, derivation's layernorm: {rel['old']}; MILOps': {rel['new']}")
    assert all(np.isfinite(v).all() for v in out['old'].values())  # saturated, not inf: nothing to see
    assert rel['old']['y'] > 1  # xhat wrong by a factor, not a rounding
    assert all(e <= 8 * U for e in rel['new'].values()), rel['new']


def test_injected_overflow_is_caught_and_never_applied(tmp_path):
    # c_attn scaled 1000x: attention scores saturate in the ANE mode. Every output stays
    # finite (isfinite alone would pass this step: in IEEE fp16 it gives nan), but some reach
    # 2^14: CoreMLEngine marks the microbatch, the step drops the ANE's gradients, halves its
    # loss scale, and the update uses the GPU engine's gradient alone.
    cfg = hg.GPTConfig(block_size=8, vocab_size=300, n_layer=2, n_head=2, n_embd=32)
    path = str(tmp_path / 'tiny.mlpackage')
    export_ane.export_coreml(cfg, 2, 8, path)
    torch.manual_seed(0)
    model = hg.GPT(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(1000)
    evaluate, seen = export_ane.numpy_predict(export_ane.load_coreml_program(path), ane=True), []

    def predict(inputs):
        seen.append(evaluate(inputs))
        return seen[-1]
    engines = {'gpu': hg.AutogradEngine(model, torch.device('cpu'), torch.float32),
               'ane': hg.CoreMLEngine(path, predict=predict, scaler=hg.LossScaler(256.0, 200, limit=hg.ANE_OVERFLOW / 2))}
    step = hg.HeteroStep(model, engines, hg.Split(2, '0.5'), optimizer=torch.optim.AdamW(model.parameters()))
    microbatches = [tuple(torch.randint(0, cfg.vocab_size, (2, 8)) for _ in range(2)) for _ in range(2)]
    alone = copy.deepcopy(model)  # the GPU engine's gradient on its microbatch (the second), alone
    alone(*microbatches[1])[1].backward()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    out = step(microbatches)
    assert all(np.isfinite(v).all() for v in seen[0].values())
    assert max(np.abs(v).max() for v in seen[0].values()) >= hg.ANE_OVERFLOW
    with np.errstate(all='ignore'):
        ieee = export_ane.numpy_predict(export_ane.load_coreml_program(path))(engines['ane'].inputs)
    assert not all(np.isfinite(v).all() for v in ieee.values())  # what an IEEE fp16 engine would show
    assert out['used'] == ['gpu'] and step.dropped['ane'] == 1 and engines['ane'].scaler.scale == 128.0
    for (k, p), q in zip(model.named_parameters(), alone.parameters()):
        assert torch.equal(p.grad, q.grad), k
    step.update(out)
    ref = torch.optim.AdamW(alone.parameters())  # the same AdamW step from the GPU's gradient
    ref.step()
    for (k, p), q in zip(model.named_parameters(), alone.parameters()):
        assert torch.equal(p.detach(), q.detach()) and not torch.equal(p.detach(), before[k]), k


def test_ane_loss_scale_starts_at_256_and_stops_short_of_saturation():
    cfg = hg.Config(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50)
    model = hg.GPT(hg.model_config(cfg))
    engines = hg.build_engines(cfg, model, torch.device('cpu'), torch.float32, 'hetero', log=lambda s: None)
    assert engines['ane'].scaler.scale == 256.0 and engines['ane'].scaler.limit == hg.ANE_OVERFLOW / 2
    s = hg.LossScaler(256.0, 1, limit=hg.ANE_OVERFLOW / 2)
    for peak, scale in ((1000.0, 512.0), (3000.0, 1024.0), (5000.0, 1024.0), (4000.0, 2048.0)):
        s.peak = peak  # what CoreMLEngine reports: the largest scaled output since the last update
        s.update(True)  # doubling grows it only while 2 * peak < 8192: outputs stay <= 2^13
        assert s.scale == scale and s.peak == 0.0
