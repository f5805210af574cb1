"""
The hand-derived step (eager PyTorch, no autograd) against autograd's forward + backward
of the same GPT-2, side by side in one run: tokens/s and peak memory per step.
GPT-2 124M, batch 12 x 1024 by default; 3 warm-up and 10 timed steps each, median.

    python -m benchmarks.bench_manual            # on a CUDA GPU, from the repository's root

Rows, each beside autograd eager in the same precision (fp32, bf16, fp16):
  written out       the reference derivation (hetero_gpt.TorchOps), as the Core ML program records it
  fused             tools/fast_standin.FusedOps: the pieces by PyTorch's fused kernels through public APIs
  fused, private    the same with attention and layernorm through the private entry points
                    (torch.ops.aten._scaled_dot_product_*, native_layer_norm): the comparison that
                    decides whether a private entry point earns a place in tools/fast_standin.py
  + CUDA graph      tools/fast_standin.FastEagerEngine: the step replayed as one CUDA graph, as
                    `python -m tools.fast_standin` and `bench.py --fast` run it on CUDA
                    (no Python in the replay: what remains is the kernels' time)
and, for --compiled dtypes, both sides under torch.compile (the written-out derivation).
Peak memory is what one step allocates above the weights (max_memory_allocated after a
reset, minus what was allocated before the step; a graph's pool is added to its row).
"""
import argparse
import statistics
import time

import torch

import hetero_gpt as hg
from tools import fast_standin as standin

p = argparse.ArgumentParser()
p.add_argument('--batch_size', type=int, default=12)
p.add_argument('--block_size', type=int, default=1024)
p.add_argument('--n_layer', type=int, default=12)
p.add_argument('--n_embd', type=int, default=768)
p.add_argument('--n_head', type=int, default=12)
p.add_argument('--iters', type=int, default=10)
p.add_argument('--dtypes', default='float32,bfloat16,float16')
p.add_argument('--compiled', default='bfloat16', help="dtypes to also time compiled ('' for none)")
a = p.parse_args()


class PrivateOps(standin.FusedOps):
    """FusedOps with attention and layernorm by their private ATen entry points, called by
    hand (the kernel pair the dispatcher would pick for training), for comparison only."""

    def layernorm_forward(self, x, w, b, eps=1e-5):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, eps)
        return y, (x, b, mean, rstd)

    def layernorm_backward(self, dy, w, cache):
        x, b, mean, rstd = cache
        return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b,
                                                         [True, True, b is not None])

    def attention_forward(self, q, k, v, B, T, H):
        q, k, v = self.heads(q, B, T, H), self.heads(k, B, T, H), self.heads(v, B, T, H)
        with torch.enable_grad():  # as for training: the dispatcher checks the backward too
            kernel = torch._fused_sdp_choice(q.detach().requires_grad_(), k, v, None, 0.0, True)
        if kernel == torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)
        elif kernel == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        else:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        return self.merge_heads(out[0], B, T), (kernel, q, k, v, out)

    def attention_backward(self, dy, cache, B, T, H):
        kernel, q, k, v, out = cache
        dy, y = self.heads(dy, B, T, H), out[0]
        if kernel == torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value:
            lse, cq, ck, mq, mk, seed, off = out[1:8]
            g = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dy, q, k, v, y, lse, seed, off, None, cq, ck, mq, mk, 0.0, True)
        elif kernel == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
            lse, cq, ck, mq, mk, seed, off = out[1:8]
            g = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dy, q, k, v, y, lse, cq, ck, mq, mk, 0.0, True, seed, off)
        else:
            lse, seed, off = out[1:4]
            g = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dy, q, k, v, None, y, lse, seed, off, 0.0, [True, True, True, False], True)[:3]
        return tuple(self.merge_heads(t, B, T) for t in g)


device = torch.device('cuda')
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
cfg = hg.GPTConfig(block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
torch.manual_seed(0)
model = hg.GPT(cfg).to(device)
params = dict(model.named_parameters())
x = torch.randint(cfg.vocab_size, (a.batch_size, a.block_size), device=device)
y = torch.randint(cfg.vocab_size, (a.batch_size, a.block_size), device=device)


def measure(fn):
    times = []
    for i in range(3 + a.iters):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base
        del out
    return a.batch_size * a.block_size / statistics.median(times[3:]), peak / 2**30


def autograd(dtype, compile=False):
    ctx = torch.autocast('cuda', dtype=dtype) if dtype != torch.float32 else torch.autocast('cuda', enabled=False)
    forward = torch.compile(model) if compile else model

    def fn():
        for q in params.values():
            q.grad = None
        with ctx:
            _, loss = forward(x, y)
        loss.backward()
        return {k: q.grad for k, q in params.items()}
    return fn


def manual(dtype, scale, ops=hg.TorchOps, compile=False):
    w = {k: v.detach().to(dtype) for k, v in params.items()}  # the engine's weight buffers
    o = ops(dtype, device, compile)
    return lambda: hg.eager_loss_and_grads(o, cfg, w, x, y, scale)[1]


def graphed(dtype, scale, ops):
    """The eager engine as hetero mode runs it on CUDA: captured once, replayed. Replays
    allocate nothing: the capture's peak above the weight buffer is added (fn.held)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng = standin.FastEagerEngine(cfg, device, dtype, hg.LossScaler(scale, 10**9), fused_kernels=True)
    eng.ops = ops(dtype, device)
    eng.load_weights(params)
    eng.loss_and_grads(x, y)  # captures
    torch.cuda.synchronize()
    fn = lambda: eng.loss_and_grads(x, y)[1]
    fn.held = torch.cuda.max_memory_allocated() - before - eng.flat.numel() * eng.flat.element_size()
    return fn


names = {torch.float32: 'fp32 (TF32 matmuls)', torch.bfloat16: 'bf16 (autograd: autocast; manual: bf16 weights)',
         torch.float16: 'fp16 (autograd: autocast; manual: fp16, loss scale 1024)'}
scales = {torch.float32: 1.0, torch.bfloat16: 1.0, torch.float16: 1024.0}
dtypes = [getattr(torch, n) for n in a.dtypes.split(',')]
variants = {'written out': lambda d: manual(d, scales[d]),
            'fused': lambda d: manual(d, scales[d], standin.FusedOps),
            'fused, private': lambda d: manual(d, scales[d], PrivateOps),
            'fused + CUDA graph': lambda d: graphed(d, scales[d], standin.FusedOps),
            'fused, private + CUDA graph': lambda d: graphed(d, scales[d], PrivateOps)}
rows = [(f"{names[d]}, manual: {tag}", lambda d=d: autograd(d), lambda d=d, m=make: m(d))
        for d in dtypes for tag, make in variants.items()]
rows += [(f"{names[d]}, both compiled (manual: written out)", lambda d=d: autograd(d, True),
          lambda d=d: manual(d, scales[d], compile=True)) for d in (getattr(torch, n) for n in a.compiled.split(',') if n)]
print(f"GPT-2 {sum(q.numel() for q in params.values()) / 1e6:.1f}M, batch {a.batch_size} x {a.block_size}, "
      f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("| precision, variant | autograd tok/s | manual tok/s | manual/autograd | autograd peak GiB | manual peak GiB |")
print("|---|---|---|---|---|---|")
for name, make_ag, make_mn in rows:
    try:
        ag = make_ag()
        ta, ma = measure(ag)
        del ag
        mn = make_mn()  # after autograd's row: a CUDA graph's pool is not held while autograd runs
        tm, mm = measure(mn)
        mm += getattr(mn, 'held', 0) / 2**30
        del mn
        print(f"| {name} | {ta:,.0f} | {tm:,.0f} | {tm / ta:.2f}x | {ma:.2f} | {mm:.2f} |", flush=True)
    except Exception as e:  # a row that cannot run here says why; the others still run
        print(f"| {name} | failed: {e!r} |", flush=True)
    torch.cuda.empty_cache()
