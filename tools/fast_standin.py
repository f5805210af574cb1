"""
What only makes the off-Mac stand-in for the ANE faster. hetero_gpt.py is the reference;
this file specializes its eager engine, and deleting it breaks no mode: the plain
EagerEngine runs instead (and --fused_kernels says it needs this file).

FusedOps        the derivation's pieces by PyTorch's fused kernels, through public APIs:
                F.linear (the bias added in the GEMM's epilogue), torch.func.vjp over
                F.layer_norm, F.gelu and F.scaled_dot_product_attention (with a gradient
                to give, the dispatcher picks the training kernel: cuDNN's on an H200 in
                bf16/fp16, flash or memory-efficient elsewhere; the (B, H, T, T) matrix is
                never stored), the QKV projection as one (N, 3C) GEMM, log-sum-exp by the
                log-softmax kernel. Each overrides a whole forward/backward pair of
                hetero_gpt.Derivation, cache included; each is tested against fp64 autograd.
FastEagerEngine the eager engine with its step captured once as a CUDA graph and replayed
                (one launch where eager PyTorch makes ~100 per layer from Python, which
                leaves the GIL to the GPU engine's thread), on its own CUDA stream (so it
                overlaps the autograd engine's work on the same GPU instead of queueing
                behind it), and with one flat copy of the weights to another GPU.
"""
import contextlib
import functools

import torch
import torch.nn.functional as F

import hetero_gpt as hg


class FusedOps(hg.TorchOps):
    """TorchOps with whole pieces by fused kernels; fp32 statistics inside (layernorm,
    softmax), where the ANE's are fp16: faster, not the ANE's arithmetic."""

    def linear_forward(self, x, w, b):
        if b is None:
            return super().linear_forward(x, w, b)
        if self.dtype == torch.float16 and self.device.type == 'cpu':  # as TorchOps.matmul
            return F.linear(x.float(), w.float(), b.float()).half()
        return F.linear(x, w, b)

    # cache: the vjp function, which holds what the fused backward kernel needs (x, mean, rstd)
    def layernorm_forward(self, x, w, b, eps=1e-5):
        f = lambda x, w, *b: F.layer_norm(x, (x.shape[-1],), w, *b, eps=eps)
        return torch.func.vjp(f, x, w, *([] if b is None else [b]))

    def layernorm_backward(self, dy, w, cache):
        dx, dw, *db = cache(dy)
        return dx, dw, db[0] if db else None

    # cache: (y, vjp): y itself for the next matmul's weight gradient (as many bytes as t)
    def gelu_forward(self, x):
        y, vjp = torch.func.vjp(lambda x: F.gelu(x, approximate='tanh'), x)
        return y, (y, vjp)

    def gelu_output(self, cache):
        return cache[0]

    def gelu_backward(self, dy, cache):
        return cache[1](dy)[0]

    # cache: the vjp function (q, k, v, y and each row's log-sum-exp, for the backward kernel)
    def attention_forward(self, q, k, v, B, T, H):
        def f(q, k, v):
            y = F.scaled_dot_product_attention(self.heads(q, B, T, H), self.heads(k, B, T, H),
                                               self.heads(v, B, T, H), is_causal=True)
            return self.merge_heads(y, B, T)
        return torch.func.vjp(f, q, k, v)

    def attention_backward(self, dy, cache, B, T, H):
        return cache(dy)

    # one wide GEMM against the three weights stacked (nanoGPT's c_attn) runs faster than
    # three narrow ones; its backward is two GEMMs and one bias sum where three make six
    def qkv_forward(self, a, p):
        w = torch.cat([p['wq'], p['wk'], p['wv']])
        b = torch.cat([p['bq'], p['bk'], p['bv']]) if 'bq' in p else None
        return self.linear_forward(a, w, b).chunk(3, -1), (a, w)  # column blocks of (N, 3C), views

    def qkv_backward(self, dq, dk, dv, p, cache, d):
        a, w = cache
        da, dw, db = self.linear_backward(torch.cat([dq, dk, dv], -1), a, w)
        (d['wq'], d['wk'], d['wv']), (d['bq'], d['bk'], d['bv']) = dw.chunk(3, 0), db.chunk(3, 0)
        return da

    def logsumexp_forward(self, z):
        """One pass to read z and one to write, where the written-out ops make six.
        log softmax(z)_v = z_v - lse for every v, so lse = z_0 - log softmax(z)_0: exact
        enough in fp32 and fp64. In fp16/bf16 log softmax(z)_0 keeps ~3 digits and may be
        -30: take instead the column whose log softmax is largest, -log sum_v exp(z_v -
        max z) in [-log V, 0], so lse = max(z) - max(log softmax(z))."""
        ls = torch.log_softmax(z, -1)
        if z.dtype in (torch.float16, torch.bfloat16):
            return self.max(z, -1) - self.max(ls, -1)
        return z[:, :1] - ls[:, :1]


def flat_buffer(like, dtype, device):
    """One flat tensor and views of it shaped like the tensors in `like`."""
    like = list(like)
    flat = torch.empty(sum(t.numel() for t in like), dtype=dtype, device=device)
    return flat, [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in like]), like)]


_COMPILED = {}  # (backend class, piece name) -> its torch.compile'd function (CompiledOps.fused)


class CompiledOps(hg.TorchOps):
    """TorchOps with each piece (a block's forward, its backward, the head...) compiled whole by
    torch.compile (--compile): eager, a layernorm makes ~10 passes over memory, fused 2."""

    def fused(self, method):
        key = (type(self), method.__name__)
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(method.__func__, dynamic=False)
        return functools.partial(_COMPILED[key], self)


class FastEagerEngine(hg.EagerEngine):
    def __init__(self, cfg, device, dtype, scaler, compile=False, fused_kernels=False):
        # the fused pieces hold vjp functions in their caches, which torch.compile cannot
        # return from a compiled piece: with fused kernels the derivation runs uncompiled
        self.ops = FusedOps if fused_kernels else CompiledOps if compile else hg.TorchOps
        super().__init__(cfg, device, dtype, scaler)
        self.stream = torch.cuda.Stream(device) if device.type == 'cuda' else None
        self.use_graph = device.type == 'cuda' and self.ops is not CompiledOps
        self.graph = self.graph_key = self.staging = None
        self.label = self.label[:-1] + (", CUDA graph" if self.use_graph else "") + \
            (", fused kernels)" if fused_kernels else ")")

    def running(self):
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    @torch.no_grad()
    def load_weights(self, params):
        # once per step, into one flat buffer (and views of it) reused across steps. The
        # optimizer updated the weights on their GPU's default stream: this engine's stream
        # waits for that here, once, and not later, while the default stream runs the GPU
        # engine's work, which this engine must overlap. (The same wait orders this step's
        # allocations on this stream after the default stream's reads of the last step's.)
        src = next(iter(params.values())).device
        if self.w is None:
            self.flat, views = flat_buffer(params.values(), self.dtype, self.device)
            self.w = dict(zip(params, views))
            if self.flat.device != src:  # another GPU: cast where the weights are, move half the bytes
                self.staging, self.staging_w = flat_buffer(params.values(), self.dtype, src)
        if self.stream is not None and src.type == 'cuda':
            self.stream.wait_stream(torch.cuda.current_stream(src))
        with self.running():
            if self.staging is None:
                torch._foreach_copy_(list(self.w.values()), list(params.values()))
            else:
                torch._foreach_copy_(self.staging_w, list(params.values()))
                self.flat.copy_(self.staging)

    def capture(self, shape, scale):
        """The step for microbatches of `shape` at loss scale `scale`, as a CUDA graph (made
        again when either changes: the scale is a constant of the graph)."""
        self.graph = self.g_out = None  # the old graph's memory first
        self.g_idx = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.g_tgt = torch.zeros_like(self.g_idx)
        run = lambda: hg.eager_loss_and_grads(self.o, self.cfg, self.w, self.g_idx, self.g_tgt, scale)
        run()  # once outside the capture: cuBLAS picks its kernels and workspaces
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode='thread_local'):
            self.g_out = run()
        self.graph, self.graph_key = graph, (shape, scale)

    def loss_and_grads(self, idx, targets):
        """(loss, grads), tensors of the caller's own: copies of the graph's output
        buffers, which the next replay overwrites."""
        with self.running():
            key = (tuple(idx.shape), self.scaler.scale)
            if self.use_graph and self.graph_key != key:
                try:
                    self.capture(*key)
                except RuntimeError as e:  # e.g. out of memory: run op by op instead
                    self.use_graph, self.graph, self.g_out = False, None, None
                    self.label = self.label.replace(', CUDA graph', '')
                    print(f"{self.label}: CUDA graph capture failed ({e}); running the step op by op")
            if not self.use_graph:
                return super().loss_and_grads(idx, targets)
            self.g_idx.copy_(idx)
            self.g_tgt.copy_(targets)
            self.graph.replay()
            loss, grads = self.g_out
            return loss.clone(), {k: v.clone() for k, v in grads.items()}

