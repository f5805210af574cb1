"""The eager engine's device paths: its loss scale as a device tensor (runs everywhere), its
step replayed as a CUDA graph, and the engine on a second GPU (skipped without CUDA, as in
CI; on a GPU machine: python -m pytest -q tests/test_cuda.py)."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import hetero_gpt as hg

CFG = hg.GPTConfig(block_size=32, vocab_size=20000, n_layer=2, n_head=2, n_embd=32)  # 2 vocab chunks
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def model_and_batches(device, n, B=2, seed=0):
    torch.manual_seed(seed)
    model = hg.GPT(CFG).to(device)
    mbs = [(torch.randint(0, CFG.vocab_size, (B, CFG.block_size)),
            torch.randint(0, CFG.vocab_size, (B, CFG.block_size))) for _ in range(n)]
    return model, mbs


def close(a, b, rel):
    return (a - b).abs().max() <= rel * b.abs().max()


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=cuda)])
def test_loss_scale_as_a_tensor_matches_the_number(device):
    # a CUDA graph takes the loss scale as a device tensor, which the host can refill each
    # step; the result must be the float path's. Scale 8 (a power of two): scaling and
    # unscaling are exact, so the two agree to the last bit.
    model, [(x, y)] = model_and_batches(device, 1)
    w = {k: p.detach() for k, p in model.named_parameters()}
    dev = torch.device(device)
    l1, g1 = hg.eager_loss_and_grads(CFG, w, x.to(dev), y.to(dev), torch.float32, dev, 8.0)
    l2, g2 = hg.eager_loss_and_grads(CFG, w, x.to(dev), y.to(dev), torch.float32, dev,
                                     torch.tensor(8.0, device=dev))
    assert torch.equal(l1, l2)
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k


@cuda
@pytest.mark.parametrize('fused', [False, True], ids=['derivation', 'fused kernels'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_cuda_graph_replays_the_eager_step(dtype, fused):
    # the engine's graph against the eager derivation on the same weights and batch, for
    # two batches, two loss scales and weights changed between steps (the graph reads
    # them from its buffers, so a new load_weights must show). Same kernels on the same
    # data: fp32 to 1e-5 of the largest element (cuBLAS may pick another algorithm
    # outside the capture), fp16 to 1e-2 (fp16 rounding, 1e-3, over a few sums).
    dev = torch.device('cuda')
    model, mbs = model_and_batches(dev, 2)
    eng = hg.EagerEngine(CFG, dev, dtype, hg.LossScaler(8.0, 1000), graph_shape=(2, CFG.block_size),
                         fused_kernels=fused)
    params = dict(model.named_parameters())
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    for step, scale in enumerate((8.0, 64.0)):
        eng.scaler.scale = scale
        eng.load_weights(params)
        assert eng.graph is not None
        outs = [eng.loss_and_grads(x, y) for x, y in mbs]  # the caller's own: the 2nd replay leaves the 1st
        for (x, y), (l, g) in zip(mbs, outs):
            ref_l, ref_g = hg.manual_loss_and_grads(params, x, y, dtype=dtype, device=dev, loss_scale=scale,
                                                    fused_kernels=fused)
            assert close(l, ref_l, rel), (step, l, ref_l)
            for k in ref_g:
                assert close(g[k], ref_g[k], rel), (step, k)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)


@two_gpus
def test_engine_on_a_second_gpu_gives_the_one_gpu_step():
    # autograd on cuda:0 and the eager derivation (fp32, CUDA graph) on cuda:1, half of the
    # microbatches each, against autograd alone on cuda:0: the same averaged gradient, to
    # fp32 rounding over the two paths' different sums (1e-4 of the largest element)
    a, mbs = model_and_batches('cuda:0', 4)
    b, _ = model_and_batches('cuda:0', 4)
    d0, d1 = torch.device('cuda:0'), torch.device('cuda:1')
    het = hg.HeteroStep(a, {'gpu': hg.AutogradEngine(a, d0, torch.float32),
                            'ane': hg.EagerEngine(CFG, d1, torch.float32, hg.LossScaler(1.0, 0, enabled=False),
                                                  graph_shape=(2, CFG.block_size))}, hg.Split(4, '0.5'))
    one = hg.HeteroStep(b, {'gpu': hg.AutogradEngine(b, d0, torch.float32)}, hg.Split(4, '0'))
    for step in range(2):  # the second step reuses the engine's buffers and graph
        out_h, out_1 = het(mbs), one(mbs)
        assert out_h['used'] == ['ane', 'gpu'] and abs(out_h['loss'] - out_1['loss']) < 1e-5 * out_1['loss']
        for (k, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert pa.grad.device == d0 and close(pa.grad, pb.grad, 1e-4), (step, k)
        for m in (a, b):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
            m.zero_grad(set_to_none=True)


KERNELS = {'flash': SDPBackend.FLASH_ATTENTION, 'efficient': SDPBackend.EFFICIENT_ATTENTION,
           'cudnn': SDPBackend.CUDNN_ATTENTION}


@cuda
@pytest.mark.parametrize('dtype,kernel', [(torch.float32, 'efficient')] + [
    (d, k) for d in (torch.bfloat16, torch.float16) for k in ('flash', 'efficient', 'cudnn')])
def test_fused_kernels_on_cuda(dtype, kernel):
    # the CUDA kernels (each attention kernel pair that scaled_dot_product_attention may
    # pick, forced here one at a time; layernorm, GELU, log-sum-exp, the bias add in the
    # matmul) inside the whole step, against fp64 autograd on the CPU: fp32 to its bound
    # of test_grads.py (1e-4 relative), fp16/bf16 by cosine >= 0.999 per tensor as the
    # fp16 test there
    q = torch.randn(2, CFG.n_head, CFG.block_size, CFG.n_embd // CFG.n_head, dtype=dtype, device='cuda')
    with sdpa_kernel([KERNELS[kernel]]):
        try:  # with only that kernel allowed, the dispatcher raises where it cannot run
            chosen = hg.TorchOps(dtype, 'cuda', fused_kernels=True).attention_kernel(q, q, q)
        except RuntimeError:
            chosen = None
        if chosen != kernel:
            pytest.skip(f"{kernel} attention does not take these {dtype} tensors on this GPU")
    model, [(x, y)] = model_and_batches('cpu', 1)
    model = model.double()
    _, loss = model(x, y)
    loss.backward()
    params = {k: p.detach() for k, p in model.named_parameters()}
    scale = 1024.0 if dtype == torch.float16 else 1.0
    with sdpa_kernel([KERNELS[kernel]]):  # only that kernel pair: the fp64 reference above ran outside
        l, g = hg.manual_loss_and_grads(params, x, y, dtype=dtype, device='cuda', loss_scale=scale,
                                        fused_kernels=True)
    assert abs(l.item() - loss.item()) < 1e-2 * loss.item()
    for k, p in model.named_parameters():
        ref, got = p.grad, g[k].double().cpu()
        assert torch.isfinite(got).all(), k
        if dtype == torch.float32:
            assert close(got, ref, 1e-4), k
        else:
            assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) >= 0.999, k


@cuda
def test_deferred_check_on_cuda():
    # GPU-only on CUDA with fused AdamW: the loss and the finiteness flag come back through
    # pinned memory after the update is queued. A finite step updates exactly as the host
    # check does (same kernels, same data: bit for bit); an overflowing one is skipped on
    # the device and counted, its AdamW step count not advanced.
    dev = torch.device('cuda')
    got = []
    for defer in (True, False):
        model, mbs = model_and_batches(dev, 2)
        step = hg.HeteroStep(model, {'gpu': hg.AutogradEngine(model, dev, torch.float32)}, hg.Split(2, '0'),
                             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        step.can_defer = defer
        out = step(mbs)
        assert torch.is_tensor(out['found_inf']) == defer
        out = step.update(out, grad_clip=1.0)
        assert out['used'] == ['gpu'] and isinstance(out['loss'], float) and out['loss'] > 0
        got.append((out['loss'], [p.detach().clone() for p in model.parameters()]))
    assert got[0][0] == got[1][0] and all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))
    before = [p.detach().clone() for p in model.parameters()]
    step.can_defer = True
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float('inf')  # the forward overflows
    before[list(dict(model.named_parameters())).index('transformer.h.0.mlp.c_fc.weight')][0, 0] = float('inf')
    out = step.update(step(mbs), grad_clip=1.0)
    assert out['used'] == [] and step.skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(s['step'].item() == 1 for s in step.optimizer.state.values())
