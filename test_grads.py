"""
The hand-derived backward against PyTorch's autograd, llm.c style: each piece, then the
whole model tensor by tensor, in fp64, fp32 and fp16 (with loss scaling), then a few
AdamW steps. `python test_grads.py` prints one row per parameter tensor and a final
PASS/FAIL line; `pytest test_grads.py` runs the same checks as tests.

Each gradient is judged by tools/gradcheck.py: its cosine and norm ratio against fp64
autograd, tensor by tensor and for each q/k/v third of c_attn (at initialisation the q and
k thirds hold ~1% of the v third's norm, so a whole-tensor cosine cannot see them), with
tolerances from the arithmetic (gradcheck.TOLERANCE):
- fp64 (unit roundoff 1.1e-16): the two computations differ only in the order of
  rounding, over sums of at most a few thousand terms, so errors stay near 1e-13
  relative; we allow 1e-10 (max abs difference / max abs value of the tensor).
- fp32 (unit roundoff 6e-8): the same sums give errors around 1e-6 relative; we allow
  1e-4, the bound for dot products of ~1e3 terms (n*u) with a margin of 10x.
- fp16 (unit roundoff 4.9e-4, max 65504): elementwise errors of 1e-3..1e-2 are normal,
  so directions (cosine >= 0.999) and sizes (norm within 2%) are judged, every value finite.
"""
import sys

import pytest
import torch
import torch.nn.functional as F

from hetero_gpt import GPT, GPTConfig, TorchOps, check_batch, eager_loss_and_grads, vocab_chunks
from tools import gradcheck  # defines: compare, failures, by_layer, check, TOLERANCE

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}  # elementwise: max abs difference / max abs value

# tiny configurations: several heads, T not a power of two, a vocabulary wider than one
# 16384-row chunk (so the chunked log-sum-exp is exercised), and a one-head one-layer case
CONFIGS = [
    dict(cfg=GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=4, n_embd=32), B=3, T=7),
    dict(cfg=GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=1, n_embd=16), B=2, T=8),
    # nanoGPT's bias=False: no bias in any linear layer or LayerNorm
    dict(cfg=GPTConfig(block_size=8, vocab_size=300, n_layer=2, n_head=2, n_embd=16, bias=False), B=2, T=5),
]
IDS = ['2L4H-V20000-T7', '1L1H-V50-T8', '2L2H-nobias-T5']


def config_from_params(params, n_head):
    """GPTConfig from the weights' shapes and n_head (which no shape holds)."""
    V, C = params['transformer.wte.weight'].shape
    n_layer = len({k.split('.')[2] for k in params if k.startswith('transformer.h.')})
    return GPTConfig(block_size=params['transformer.wpe.weight'].shape[0], vocab_size=V, n_layer=n_layer,
                     n_head=n_head, n_embd=C, bias='transformer.ln_f.bias' in params)


def manual_loss_and_grads(params, idx, targets, *, n_head, dtype=torch.float32, device='cpu',
                          loss_scale=1.0, ops=TorchOps):
    """Loss and gradients of GPT-2 by the hand derivation, run eagerly by PyTorch.
    params: {name: tensor} as GPT.named_parameters(). Returns (loss, grads): the mean
    cross-entropy (0-dim tensor) and {name: gradient}, unscaled. ops: the backend class."""
    cfg = config_from_params(params, n_head)
    check_batch(cfg, idx, targets)
    w = {k: v.detach().to(device=device, dtype=dtype) for k, v in params.items()}
    return eager_loss_and_grads(ops(dtype, device), cfg, w, idx.to(device), targets.to(device), loss_scale)


def rel_err(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()


def cosine(a, ref):  # of two tensors in fp64 (one number of what gradcheck judges)
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


def model_grads(case, dtype, loss_scale=1.0, ops=TorchOps, reference=None):
    """(loss, autograd's loss, grads, autograd's grads) for one config and dtype (reference:
    autograd_reference's result for the case, if made already)."""
    params, idx, targets, ref_loss, ref = reference or autograd_reference(case['cfg'], case['B'], case['T'])
    loss, grads = manual_loss_and_grads(params, idx, targets, n_head=case['cfg'].n_head, dtype=dtype,
                                        loss_scale=loss_scale, ops=ops)
    assert {k: g.shape for k, g in grads.items()} == {k: g.shape for k, g in ref.items()}, "keyed as GPT's"
    return loss.item(), ref_loss, grads, ref


def model_check(case, dtype, ops=TorchOps):
    """'' if loss and every gradient of the case pass at dtype's bounds, else what failed.
    fp64/fp32: each element (TOL) and each part by gradcheck; fp16 (loss scale 1024): each part
    by gradcheck, the loss (log-sum-exps of ~10 in fp16, a few 1e-4 relative) within 1e-2."""
    half = dtype in (torch.float16, torch.bfloat16)
    loss, ref_loss, grads, ref = model_grads(case, dtype, 1024.0 if dtype == torch.float16 else 1.0, ops)
    bad = [f'loss {loss} vs {ref_loss}'] if not abs(loss - ref_loss) <= (1e-2 if half else TOL[dtype]) * ref_loss else []
    bad += [] if half else [f'{k}: rel err {rel_err(grads[k], r):.2e}' for k, r in ref.items()
                            if not rel_err(grads[k], r) <= TOL[dtype]]
    return '; '.join(bad + [gradcheck.check(grads, ref, dtype)]).strip('; ')


# ---- each piece against autograd (fp64, random inputs, a random upstream gradient).
# Each check_* takes the backend class: TorchOps here, FusedOps in tests/test_standin.py,
# at the same bounds.

def check_piece(ops, forward, backward, reference, inputs):
    """forward(o, *inputs) -> (y, cache); backward(o, dy, cache, *inputs) -> grads of
    inputs; reference(*inputs) -> y computed by PyTorch's own ops, differentiated by autograd."""
    o = ops(torch.float64, 'cpu')
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


def check_linear(ops):
    x, w, b = torch.randn(10, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    check_piece(ops, lambda o, x, w, b: (o.linear_forward(x, w, b), None),
                lambda o, dy, _, x, w, b: o.linear_backward(dy, x, w), F.linear, [x, w, b])


def check_layernorm(ops, bias):
    x = torch.randn(10, 6, dtype=torch.float64) * 3 + 1
    w, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    if bias:
        check_piece(ops, lambda o, x, w, b: o.layernorm_forward(x, w, b),
                    lambda o, dy, cache, x, w, b: o.layernorm_backward(dy, w, cache),
                    lambda x, w, b: F.layer_norm(x, (6,), w, b), [x, w, b])
    else:  # bias=False: no b, and no db to return
        check_piece(ops, lambda o, x, w: o.layernorm_forward(x, w, None),
                    lambda o, dy, cache, x, w: o.layernorm_backward(dy, w, cache)[:2],
                    lambda x, w: F.layer_norm(x, (6,), w), [x, w])


def check_gelu(ops):
    # and gelu_output: the forward's y again, from the cache (the next matmul's input)
    x = torch.randn(10, 6, dtype=torch.float64) * 3

    def forward(o, x):
        y, cache = o.gelu_forward(x)
        assert rel_err(o.gelu_output(cache), y) < TOL[torch.float64]
        return y, cache
    check_piece(ops, forward, lambda o, dy, cache, x: (o.gelu_backward(dy, cache),),
                lambda x: F.gelu(x, approximate='tanh'), [x])


def check_attention(ops, B, T, H):
    q, k, v = (torch.randn(B * T, H * 4, dtype=torch.float64) for _ in range(3))

    def reference(q, k, v):
        sh = lambda t: t.view(B, T, H, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(sh(q), sh(k), sh(v), is_causal=True)
        return y.transpose(1, 2).reshape(B * T, -1)
    check_piece(ops, lambda o, q, k, v: o.attention_forward(q, k, v, B, T, H),
                lambda o, dy, cache, *_: o.attention_backward(dy, cache, B, T, H), reference, [q, k, v])


def check_qkv(ops, bias):
    # the QKV projection: three (C, C) matmuls against c_attn's thirds; gradients by name
    C, N = 6, 10
    a, w, b = torch.randn(N, C, dtype=torch.float64), torch.randn(3 * C, C, dtype=torch.float64), torch.randn(3 * C, dtype=torch.float64)
    names = ['wq', 'wk', 'wv'] + (['bq', 'bk', 'bv'] if bias else [])

    def forward(o, a, w, *b):
        weights = dict(zip(names, list(w.chunk(3)) + (list(b[0].chunk(3)) if b else [])))
        (q, k, v), cache = o.qkv_forward(a, weights)
        return torch.cat([q, k, v], -1), (weights, cache)

    def backward(o, dy, cache, *_):
        weights, c = cache
        da, d = o.qkv_backward(*dy.chunk(3, -1), weights, c)
        return [da, torch.cat([d[n] for n in names[:3]])] + ([torch.cat([d[n] for n in names[3:]])] if bias else [])
    check_piece(ops, forward, backward, lambda a, w, *b: F.linear(a, w, *b), [a, w] + ([b] if bias else []))


def check_logsumexp(ops):
    # forward only: its gradient, softmax(z), is the LM head's, tested in check_lm_head_loss
    z = torch.randn(10, 37, dtype=torch.float64) * 4 + 1000  # + 1000: exp() overflows fp64 without the max
    check_piece(ops, lambda o, z: (o.logsumexp_forward(z), None), lambda *_: (),
                lambda z: torch.logsumexp(z, -1, keepdim=True), [z])


def check_lm_head_loss(ops, pad):
    # a 37-row vocabulary in three chunks, as the program sees them (pad=5: the last chunk
    # has 5 zero rows past the vocabulary, masked); gradient w.r.t. x and W
    N, C, V = 6, 8, 37
    x, w = torch.randn(N, C, dtype=torch.float64), torch.randn(V, C, dtype=torch.float64)
    tgt = torch.randint(0, V, (N,))
    bounds = [(0, 14), (14, 28), (28, 37)] if pad else [(0, 10), (10, 25), (25, 37)]
    o = ops(torch.float64, 'cpu')
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(xr @ wr.T, tgt)
    ref_loss.backward()
    chunks = [w[a:b] for a, b in bounds]
    if pad:
        chunks[-1] = F.pad(chunks[-1], (0, 0, 0, pad))
    loss, cache = o.lm_head_forward(x, chunks, w[tgt], N, pad=pad)
    dx, dws, dw_tgt = o.lm_head_backward(chunks, w[tgt], cache, 1.0 / N)
    if pad:
        assert dws[-1][-pad:].abs().max() == 0  # exp(-1e4 - lse) is exactly 0
        dws[-1] = dws[-1][:-pad]
    dw = torch.cat(dws).index_add_(0, tgt, dw_tgt)  # the host's scatter-add of the target rows
    assert rel_err(loss.reshape(()), ref_loss) < TOL[torch.float64]
    assert rel_err(dx, xr.grad) < TOL[torch.float64]
    assert rel_err(dw, wr.grad) < TOL[torch.float64]


def test_linear():
    check_linear(TorchOps)


@pytest.mark.parametrize('bias', [True, False], ids=['bias', 'no bias'])
def test_layernorm(bias):
    check_layernorm(TorchOps, bias)


def test_gelu():
    check_gelu(TorchOps)


@pytest.mark.parametrize('B,T,H', [(2, 5, 3), (1, 8, 1)])
def test_attention(B, T, H):
    check_attention(TorchOps, B, T, H)


@pytest.mark.parametrize('bias', [True, False], ids=['bias', 'no bias'])
def test_qkv(bias):
    check_qkv(TorchOps, bias)


def test_logsumexp():
    check_logsumexp(TorchOps)


@pytest.mark.parametrize('pad', [0, 5])
def test_lm_head_loss(pad):
    check_lm_head_loss(TorchOps, pad)


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
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32, torch.float16], ids=['fp64', 'fp32', 'fp16'])
def test_model_grads(case, dtype):
    bad = model_check(case, dtype)
    assert not bad, f"{dtype}: {bad}"


def test_fp16_needs_loss_scale():
    # why the loss scale exists: with 4096 tokens each token's loss weighs 1/N = 2.4e-4,
    # and the gradients that flow back into the block, ~1e-6 to 1e-5 an element here,
    # sit below fp16's smallest normal number (6.1e-5): unscaled they keep only a few
    # significant bits or flush to zero (the first layernorm's weight gradient drops to
    # cosine ~0.99); seeded with 1024 they are normal numbers, and the host divides it out.
    case = dict(cfg=GPTConfig(block_size=256, vocab_size=4000, n_layer=1, n_head=2, n_embd=32), B=16, T=256)
    ref = autograd_reference(case['cfg'], case['B'], case['T'])
    unscaled, scaled = (gradcheck.compare(*model_grads(case, torch.float16, s, reference=ref)[2:]) for s in (1.0, 1024.0))
    assert gradcheck.failures(unscaled, *gradcheck.TOLERANCE[torch.float16]), "unscaled fp16 passed"
    assert not gradcheck.failures(scaled, *gradcheck.TOLERANCE[torch.float16])


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
        loss_b, grads = manual_loss_and_grads(dict(b.named_parameters()), idx, targets, n_head=case['cfg'].n_head,
                                              dtype=torch.float64)
        for k, p in b.named_parameters():
            p.grad = grads[k]
        opt_b.step()
        opt_b.zero_grad()
        assert abs(loss_a.item() - loss_b.item()) < 1e-10 * abs(loss_a.item()), step


# ---- bad input

def test_bad_input():
    case = CONFIGS[0]
    params, idx, targets, _, _ = autograd_reference(case['cfg'], case['B'], case['T'])
    mlg = lambda *a: manual_loss_and_grads(*a, n_head=case['cfg'].n_head)
    with pytest.raises(ValueError, match='outside'):
        mlg(params, idx, torch.full_like(targets, case['cfg'].vocab_size))
    long = torch.zeros(1, case['cfg'].block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match='longer than block_size'):
        mlg(params, long, long)
    with pytest.raises(ValueError, match='same shape|both be'):
        mlg(params, idx, targets[:, :-1])


def main():
    ok = True
    for i, case in enumerate(CONFIGS):
        for dtype in (torch.float64, torch.float32, torch.float16):
            bad = model_check(case, dtype)
            ok &= not bad
            loss, ref_loss, grads, ref = model_grads(case, dtype, 1024.0 if dtype == torch.float16 else 1.0)
            c = case['cfg']
            print(f"\n== config {i}: L{c.n_layer} H{c.n_head} C{c.n_embd} V{c.vocab_size} B{case['B']} T{case['T']}"
                  f" | {str(dtype)[6:]} | loss {loss:.6f} (autograd {ref_loss:.6f}) | {'ok' if not bad else 'FAIL: ' + bad}")
            print(f"{'tensor':45} {'rel err':>10} {'cosine':>14} {'norm ratio':>12}")
            for p in gradcheck.compare(grads, ref):
                name = p.name.split('[')[0]
                rel = f'{rel_err(grads[name], ref[name]):10.2e}' if name == p.name else ' ' * 10  # (a third: '')
                print(f"{p.name:45} {rel} {p.cosine:14.11f} {p.norm_ratio:12.9f}" + ('' if p.finite else '  NON-FINITE'))
            layers = gradcheck.by_layer(gradcheck.compare(grads, ref)).items()
            print('per layer (worst cosine, worst |norm ratio - 1|): '
                  + ', '.join(f"{'outside' if l is None else l}: {c:.9f} {n:.2e}" for l, (c, n) in layers))
    pieces = {'linear': test_linear, 'layernorm': lambda: test_layernorm(True),
              'layernorm, no bias': lambda: test_layernorm(False), 'gelu': test_gelu,
              'attention': lambda: test_attention(2, 5, 3), 'qkv': lambda: [test_qkv(b) for b in (True, False)],
              'logsumexp': test_logsumexp, 'lm_head': lambda: test_lm_head_loss(0),
              'lm_head, padded chunk': lambda: test_lm_head_loss(5), 'vocab_chunks': test_vocab_chunks,
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
