"""
The hand-derived backward against PyTorch's autograd, llm.c style: each piece, then the
whole model tensor by tensor, in fp64, fp32 and fp16 (with loss scaling), then a few
AdamW steps. `python test_grads.py` prints one row per parameter tensor and a final
PASS/FAIL line; `pytest test_grads.py` runs the same checks as tests.

Tolerances come from the arithmetic:
- fp64 (unit roundoff 1.1e-16): the two computations differ only in the order of
  rounding, over sums of at most a few thousand terms, so errors stay near 1e-13
  relative; we allow 1e-10 (max abs difference / max abs value of the tensor).
- fp32 (unit roundoff 6e-8): the same sums give errors around 1e-6 relative; we allow
  1e-4, the bound for dot products of ~1e3 terms (n*u) with a margin of 10x.
- fp16 (unit roundoff 4.9e-4, max 65504): elementwise errors of 1e-3..1e-2 are normal,
  so we compare directions: cosine similarity with fp64 autograd >= 0.999 per tensor,
  and every value finite.
"""
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from hetero_gpt import (GPT, GPTConfig, TorchOps, attention_backward, attention_forward, eager_loss_and_grads,
                        gelu_backward, gelu_forward, layernorm_backward, layernorm_forward, linear_backward, linear_forward,
                        lm_head_backward, lm_head_forward, logsumexp_forward, manual_loss_and_grads, vocab_chunks)

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
FP16_MIN_COSINE = 0.999

# tiny configurations: several heads, T not a power of two, a vocabulary wider than one
# 16384-row chunk (so the chunked log-sum-exp is exercised), and a one-head one-layer case
CONFIGS = [
    dict(cfg=GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=4, n_embd=32), B=3, T=7),
    dict(cfg=GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=1, n_embd=16), B=2, T=8),
    # nanoGPT's bias=False: no bias in any linear layer or LayerNorm
    dict(cfg=GPTConfig(block_size=8, vocab_size=300, n_layer=2, n_head=2, n_embd=16, bias=False), B=2, T=5),
]
IDS = ['2L4H-V20000-T7', '1L1H-V50-T8', '2L2H-nobias-T5']


def rel_err(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()


def cosine(a, ref):
    return F.cosine_similarity(a.double().flatten(), ref.double().flatten(), dim=0).item()


def autograd_reference(cfg, B, T, seed=0):
    """A GPT in fp64, its parameters, a batch, and autograd's loss and gradients."""
    torch.manual_seed(seed)
    model = GPT(cfg).double()
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    _, loss = model(idx, targets)
    loss.backward()
    params = dict(model.named_parameters())
    return params, idx, targets, loss.item(), {k: p.grad.clone() for k, p in params.items()}


def compare_model(case, dtype, loss_scale=1.0):
    """Rows (name, max abs diff, relative diff, cosine, finite) for one config and dtype."""
    params, idx, targets, ref_loss, ref = autograd_reference(case['cfg'], case['B'], case['T'])
    loss, grads = manual_loss_and_grads(params, idx, targets, dtype=dtype, device='cpu', loss_scale=loss_scale)
    assert set(grads) == set(ref), "grads must be keyed like GPT.named_parameters()"
    rows = [('loss', abs(loss.item() - ref_loss), abs(loss.item() - ref_loss) / abs(ref_loss), 1.0,
             math.isfinite(loss.item()))]
    for k in ref:
        assert grads[k].shape == ref[k].shape, k
        rows.append((k, (grads[k].double() - ref[k]).abs().max().item(), rel_err(grads[k], ref[k]),
                     cosine(grads[k], ref[k]), bool(torch.isfinite(grads[k]).all())))
    return rows


def rows_pass(rows, dtype):
    if dtype == torch.float16:
        return all(fin and cos >= FP16_MIN_COSINE for _, _, _, cos, fin in rows[1:]) and rows[0][2] < 1e-2
    return all(fin and rel <= TOL[dtype] for _, _, rel, _, fin in rows)


# ---- each piece against autograd (fp64, random inputs, a random upstream gradient)

def check_piece(forward, backward, reference, inputs, fused_kernels=False):
    """forward(o, *inputs) -> (y, cache); backward(o, dy, cache, *inputs) -> grads of
    inputs; reference(*inputs) -> y computed by PyTorch's own ops, differentiated by autograd."""
    o = TorchOps(torch.float64, 'cpu', fused_kernels=fused_kernels)
    xs = [t.clone().requires_grad_(True) for t in inputs]
    y_ref = reference(*xs)
    dy = torch.randn_like(y_ref)
    ref_grads = torch.autograd.grad(y_ref, xs, dy)
    with torch.no_grad():
        y, cache = forward(o, *inputs)
        grads = backward(o, dy, cache, *inputs)
    errs = [rel_err(y, y_ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errs) < TOL[torch.float64], errs
    return max(errs)


# fused: the same piece by PyTorch's fused kernels (--fused_kernels), at the same bound

@pytest.mark.parametrize('fused', [False, True], ids=['ops', 'fused'])
def test_linear(fused):
    x, w, b = torch.randn(10, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    check_piece(lambda o, x, w, b: (linear_forward(o, x, w, b), None),
                lambda o, dy, _, x, w, b: linear_backward(o, dy, x, w), F.linear, [x, w, b], fused)


@pytest.mark.parametrize('fused', [False, True], ids=['ops', 'fused'])
@pytest.mark.parametrize('bias', [True, False], ids=['bias', 'no bias'])
def test_layernorm(fused, bias):
    x = torch.randn(10, 6, dtype=torch.float64) * 3 + 1
    w, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    if bias:
        check_piece(layernorm_forward, lambda o, dy, cache, x, w, b: layernorm_backward(o, dy, w, cache),
                    lambda x, w, b: F.layer_norm(x, (6,), w, b), [x, w, b], fused)
    else:  # bias=False: no b, and no db to return
        check_piece(lambda o, x, w: layernorm_forward(o, x, w, None),
                    lambda o, dy, cache, x, w: layernorm_backward(o, dy, w, cache)[:2],
                    lambda x, w: F.layer_norm(x, (6,), w), [x, w], fused)


@pytest.mark.parametrize('fused', [False, True], ids=['ops', 'fused'])
def test_gelu(fused):
    x = torch.randn(10, 6, dtype=torch.float64) * 3
    check_piece(gelu_forward,
                lambda o, dy, cache, x: (gelu_backward(o, dy, cache),),
                lambda x: F.gelu(x, approximate='tanh'), [x], fused)


@pytest.mark.parametrize('fused', [False, True], ids=['derivation', 'fused kernels'])
@pytest.mark.parametrize('B,T,H', [(2, 5, 3), (1, 8, 1)])
def test_attention(B, T, H, fused):
    q, k, v = (torch.randn(B * T, H * 4, dtype=torch.float64) for _ in range(3))

    def reference(q, k, v):
        sh = lambda t: t.view(B, T, H, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(sh(q), sh(k), sh(v), is_causal=True)
        return y.transpose(1, 2).reshape(B * T, -1)
    check_piece(lambda o, q, k, v: attention_forward(o, q, k, v, B, T, H),
                lambda o, dy, cache, *_: attention_backward(o, dy, cache, B, T, H), reference, [q, k, v], fused)


@pytest.mark.parametrize('fused', [False, True], ids=['ops', 'fused'])
def test_logsumexp(fused):
    # forward only: its gradient, softmax(z), is the LM head's, tested in test_lm_head_loss
    z = torch.randn(10, 37, dtype=torch.float64) * 4 + 1000  # + 1000: exp() overflows fp64 without the max
    check_piece(lambda o, z: (logsumexp_forward(o, z), None), lambda *_: (),
                lambda z: torch.logsumexp(z, -1, keepdim=True), [z], fused)


@pytest.mark.parametrize('fused', [False, True], ids=['ops', 'fused'])
@pytest.mark.parametrize('pad', [0, 5])
def test_lm_head_loss(pad, fused):
    # a 37-row vocabulary in three chunks, as the program sees them (pad=5: the last chunk
    # has 5 zero rows past the vocabulary, masked); gradient w.r.t. x and W
    N, C, V = 6, 8, 37
    x, w = torch.randn(N, C, dtype=torch.float64), torch.randn(V, C, dtype=torch.float64)
    tgt = torch.randint(0, V, (N,))
    bounds = [(0, 14), (14, 28), (28, 37)] if pad else [(0, 10), (10, 25), (25, 37)]
    o = TorchOps(torch.float64, 'cpu', fused_kernels=fused)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(xr @ wr.T, tgt)
    ref_loss.backward()
    chunks = [w[a:b] for a, b in bounds]
    if pad:
        chunks[-1] = F.pad(chunks[-1], (0, 0, 0, pad))
    loss, cache = lm_head_forward(o, x, chunks, w[tgt], N, pad=pad)
    dx, dws, dw_tgt = lm_head_backward(o, chunks, w[tgt], cache, 1.0 / N)
    if pad:
        assert dws[-1][-pad:].abs().max() == 0  # exp(-1e4 - lse) is exactly 0
        dws[-1] = dws[-1][:-pad]
    dw = torch.cat(dws).index_add_(0, tgt, dw_tgt)  # the host's scatter-add of the target rows
    assert rel_err(loss.reshape(()), ref_loss) < TOL[torch.float64]
    assert rel_err(dx, xr.grad) < TOL[torch.float64]
    assert rel_err(dw, wr.grad) < TOL[torch.float64]


def test_vocab_chunks():
    for V in (50, 16384, 16385, 50257, 50304, 100000):
        rows, ch = vocab_chunks(V)
        assert rows % 64 == 0 and rows <= 16384 and len(ch) == -(-V // 16384)
        assert ch[0][0] == 0 and ch[-1][1] == V and all(b - a == rows for a, b in ch[:-1])
        assert all(ch[i][1] == ch[i + 1][0] for i in range(len(ch) - 1))
        assert 0 < ch[-1][1] - ch[-1][0] <= rows
    assert vocab_chunks(50257) == (12608, [(0, 12608), (12608, 25216), (25216, 37824), (37824, 50257)])


# ---- the whole model, every gradient tensor

@pytest.mark.parametrize('case', CONFIGS, ids=IDS)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_model_grads(case, dtype):
    rows = compare_model(case, dtype)
    bad = [r for r in rows if not (r[4] and r[2] <= TOL[dtype])]
    assert not bad, f"{dtype}: {bad[:3]}"


@pytest.mark.parametrize('fused', [False, True], ids=['ops', 'fused kernels'])
def test_compiled_derivation_matches_autograd(fused):
    # --compile runs the same derivation through torch.compile (TorchOps.fused): fused
    # kernels reorder fp32 sums, so it is held to the fp32 bound against fp64 autograd.
    # Each compiled piece must be one graph: a graph break splits it into eager parts
    case = CONFIGS[0]
    params, idx, targets, ref_loss, ref = autograd_reference(case['cfg'], case['B'], case['T'])
    w = {k: v.detach().float() for k, v in params.items()}
    torch._dynamo.utils.counters.clear()
    loss, grads = eager_loss_and_grads(case['cfg'], w, idx, targets, torch.float32, torch.device('cpu'), 1.0,
                                       compile=True, fused_kernels=fused)
    assert not torch._dynamo.utils.counters['graph_break'], dict(torch._dynamo.utils.counters['graph_break'])
    assert abs(loss.item() - ref_loss) / ref_loss < TOL[torch.float32]
    worst = max((rel_err(grads[k], ref[k]), k) for k in ref)
    assert worst[0] <= TOL[torch.float32], worst


@pytest.mark.parametrize('case', [CONFIGS[0], CONFIGS[2]], ids=[IDS[0], IDS[2]])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_fused_kernels_model_grads(dtype, case):
    # --fused_kernels: the same step with attention, layernorm, GELU, the bias adds, the
    # stacked QKV matmul and log-sum-exp by PyTorch's fused kernels, every gradient against
    # fp64 autograd at the same bounds as the derivation's own ops (with biases, and
    # without: bias=False); bf16 (8 significant bits, fp16 has 11) by the fp16 cosine
    params, idx, targets, ref_loss, ref = autograd_reference(case['cfg'], case['B'], case['T'])
    scale = 1024.0 if dtype == torch.float16 else 1.0
    loss, grads = manual_loss_and_grads(params, idx, targets, dtype=dtype, device='cpu', loss_scale=scale,
                                        fused_kernels=True)
    half = dtype in (torch.float16, torch.bfloat16)
    # loss: log-sum-exps of ~6 rounded to fp16 (relative 5e-4) or bf16 (4e-3), then averaged
    assert abs(loss.item() - ref_loss) / ref_loss < (1e-2 if half else TOL[dtype])
    for k in ref:
        assert torch.isfinite(grads[k]).all(), k
        if half:
            assert cosine(grads[k], ref[k]) >= FP16_MIN_COSINE, k
        else:
            assert rel_err(grads[k], ref[k]) <= TOL[dtype], k


@pytest.mark.parametrize('case', CONFIGS, ids=IDS)
def test_model_grads_fp16(case):
    rows = compare_model(case, torch.float16, loss_scale=1024.0)
    assert all(r[4] for r in rows), "non-finite value in fp16 gradients"
    worst = min(rows[1:], key=lambda r: r[3])
    assert worst[3] >= FP16_MIN_COSINE, worst
    assert rows[0][2] < 1e-2  # loss: fp16 log-sum-exp of ~10, relative error a few 1e-4


def test_fp16_needs_loss_scale():
    # why the loss scale exists: with 4096 tokens each token's loss weighs 1/N = 2.4e-4,
    # and the gradients that flow back into the block, ~1e-6 to 1e-5 an element here,
    # sit below fp16's smallest normal number (6.1e-5): unscaled they keep only a few
    # significant bits or flush to zero (the first layernorm's weight gradient drops to
    # cosine ~0.99); seeded with 1024 they are normal numbers, and the host divides it out.
    case = dict(cfg=GPTConfig(block_size=256, vocab_size=4000, n_layer=1, n_head=2, n_embd=32), B=16, T=256)
    unscaled = min(r[3] for r in compare_model(case, torch.float16, 1.0)[1:])
    scaled = min(r[3] for r in compare_model(case, torch.float16, 1024.0)[1:])
    assert unscaled < FP16_MIN_COSINE <= scaled, (unscaled, scaled)


def test_training_steps_match_autograd():
    # 5 AdamW steps driven by the manual gradients vs by autograd's, in fp64: same losses
    case = CONFIGS[0]
    torch.manual_seed(1)
    a = GPT(case['cfg']).double()
    b = GPT(case['cfg']).double()
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (a, b))
    for step in range(5):
        idx = torch.randint(0, case['cfg'].vocab_size, (case['B'], case['T']))
        targets = torch.randint(0, case['cfg'].vocab_size, (case['B'], case['T']))
        _, loss_a = a(idx, targets)
        loss_a.backward()
        opt_a.step()
        opt_a.zero_grad()
        loss_b, grads = manual_loss_and_grads(dict(b.named_parameters()), idx, targets, dtype=torch.float64)
        for k, p in b.named_parameters():
            p.grad = grads[k]
        opt_b.step()
        opt_b.zero_grad()
        assert abs(loss_a.item() - loss_b.item()) < 1e-10 * abs(loss_a.item()), step


# ---- bad input

def test_bad_input():
    case = CONFIGS[0]
    params, idx, targets, _, _ = autograd_reference(case['cfg'], case['B'], case['T'])
    with pytest.raises(ValueError, match='outside'):
        manual_loss_and_grads(params, idx, torch.full_like(targets, case['cfg'].vocab_size))
    long = torch.zeros(1, case['cfg'].block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match='longer than block_size'):
        manual_loss_and_grads(params, long, long)
    wrong = dict(params)
    wrong['transformer.h.0.mlp.c_fc.bias'] = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match='do not match'):
        manual_loss_and_grads(wrong, idx, targets)
    missing = {k: v for k, v in params.items() if k != 'transformer.ln_f.bias'}
    with pytest.raises(ValueError, match='do not match'):
        manual_loss_and_grads(missing, idx, targets)
    with pytest.raises(ValueError, match='same shape|both be'):
        manual_loss_and_grads(params, idx, targets[:, :-1])


def main():
    ok = True
    for i, case in enumerate(CONFIGS):
        for dtype, scale in ((torch.float64, 1.0), (torch.float32, 1.0), (torch.float16, 1024.0)):
            rows = compare_model(case, dtype, scale)
            passed = rows_pass(rows, dtype)
            ok &= passed
            c = case['cfg']
            print(f"\n== config {i}: L{c.n_layer} H{c.n_head} C{c.n_embd} V{c.vocab_size} B{case['B']} T{case['T']}"
                  f" | {str(dtype)[6:]} loss_scale {scale:g} | {'ok' if passed else 'FAIL'}")
            print(f"{'tensor':40} {'max abs diff':>13} {'rel diff':>10} {'cosine':>12}")
            for name, d, rel, cos, fin in rows:
                print(f"{name:40} {d:13.3e} {rel:10.2e} {cos:12.9f}" + ('' if fin else '  NON-FINITE'))
    pieces = {'linear': lambda: test_linear(False), 'layernorm': lambda: test_layernorm(False, True),
              'layernorm, no bias': lambda: test_layernorm(False, False), 'gelu': lambda: test_gelu(False),
              'attention': lambda: test_attention(2, 5, 3, False),
              'linear, layernorm, gelu, attention, fused kernels': lambda: [
                  test_linear(True), test_layernorm(True, True), test_layernorm(True, False), test_gelu(True),
                  test_attention(2, 5, 3, fused=True)],
              'whole model, fused kernels': lambda: [test_fused_kernels_model_grads(d, c) for d in
                                                     (torch.float64, torch.float32, torch.float16, torch.bfloat16)
                                                     for c in (CONFIGS[0], CONFIGS[2])],
              'logsumexp': lambda: [test_logsumexp(f) for f in (False, True)],
              'lm_head': lambda: [test_lm_head_loss(0, f) for f in (False, True)],
              'lm_head, padded chunk': lambda: [test_lm_head_loss(5, f) for f in (False, True)],
              'vocab_chunks': test_vocab_chunks,
              'compiled derivation': lambda: [test_compiled_derivation_matches_autograd(f) for f in (False, True)],
              'training steps': test_training_steps_match_autograd, 'bad input': test_bad_input}
    for name, t in pieces.items():
        try:
            t()
            print(f"ok   {name}")
        except AssertionError as e:
            ok = False
            print(f"FAIL {name}: {e}")
    print('\nPASS' if ok else '\nFAIL')
    return ok


if __name__ == '__main__':
    sys.exit(0 if main() else 1)
