"""
What only makes training off a Mac faster. hetero_gpt.py is the reference; this file
specializes it with subclasses, and hetero_gpt.py never imports it: deleting it breaks no mode.

    python -m tools.fast_standin --mode hetero [any hetero_gpt.py flag] [--fused_kernels]
    python bench.py --fast ...                   # the modes side by side, with these classes

FusedOps        the derivation's pieces by PyTorch's fused kernels, through public APIs:
                F.linear, and torch.func.vjp over F.layer_norm, F.gelu and
                F.scaled_dot_product_attention (the (B, H, T, T) matrix is never stored).
                Each overrides a whole forward/backward pair, cache included.
CompiledOps     the block and LM-head pairs compiled whole by torch.compile.
FastEagerEngine the eager engine with its step captured once as a CUDA graph and replayed
                (one launch, which leaves the GIL to the GPU engine's thread), on its own
                CUDA stream (so it overlaps the GPU engine on the same GPU), and with one
                flat copy of the weights to another GPU.
PaddedHeadGPT   the GPU engine's LM head on the vocabulary padded to a multiple of 64.
NoWaitStep      the GPU engine alone without a host wait before the update.
classes(cfg)    these, as hetero_gpt.Classes for build_run and train.
"""
import contextlib
import dataclasses
import functools
import math
import time

import torch
import torch.nn.functional as F

import hetero_gpt as hg  # defines: TorchOps, EagerEngine, GPT, Config, HeteroStep, StepResult, Classes,
#   run_engine, eager_loss_and_grads, main, train
from plumbing import distributed  # defines: world


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
    def qkv_forward(self, a, w):
        wqkv = torch.cat([w['wq'], w['wk'], w['wv']])
        b = torch.cat([w['bq'], w['bk'], w['bv']]) if 'bq' in w else None
        return self.linear_forward(a, wqkv, b).chunk(3, -1), (a, wqkv)  # column blocks of (N, 3C), views

    def qkv_backward(self, dq, dk, dv, w, cache):
        a, wqkv = cache
        da, dw, db = self.linear_backward(torch.cat([dq, dk, dv], -1), a, wqkv)
        d = {}
        (d['wq'], d['wk'], d['wv']), (d['bq'], d['bk'], d['bv']) = dw.chunk(3, 0), db.chunk(3, 0)
        return da, d

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


def compiled(method):
    """method, compiled by torch.compile at its first call (whole: a layernorm's ~10 passes
    over memory become 2)."""
    fn = None

    @functools.wraps(method)
    def call(self, *args, **kw):
        nonlocal fn
        fn = fn or torch.compile(method, dynamic=False)
        return fn(self, *args, **kw)
    return call


class CompiledOps(hg.TorchOps):
    """TorchOps with its block and LM-head pairs each compiled whole."""
    block_forward = compiled(hg.TorchOps.block_forward)
    block_backward = compiled(hg.TorchOps.block_backward)
    lm_head_forward = compiled(hg.TorchOps.lm_head_forward)
    lm_head_backward = compiled(hg.TorchOps.lm_head_backward)


class FastEagerEngine(hg.EagerEngine):
    def __init__(self, cfg, device, dtype, scaler, fused_kernels=False, compile=False):
        super().__init__(cfg, device, dtype, scaler)
        self.fused_kernels, self.compile = fused_kernels, compile
        # the fused pieces hold vjp functions in their caches, which torch.compile cannot
        # return from a compiled piece: with fused kernels the derivation runs uncompiled
        ops = FusedOps if self.fused_kernels else CompiledOps if self.compile else hg.TorchOps
        self.ops = ops(dtype, device)
        self.stream = torch.cuda.Stream(device) if device.type == 'cuda' else None
        self.use_graph = device.type == 'cuda' and ops is not CompiledOps
        self.graph = self.graph_key = self.staging = None
        extras = [', CUDA graph'] * self.use_graph + [', fused kernels'] * self.fused_kernels
        self.label = f"eager derivation on {device} ({str(dtype).replace('torch.', '')}{''.join(extras)})"

    def running(self):  # this engine's stream (the current stream is per thread)
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

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
            torch._foreach_copy_(list(self.w.values()) if self.staging is None else self.staging_w,
                                 list(params.values()))
            if self.staging is not None:
                self.flat.copy_(self.staging)

    def capture(self, shape, scale):
        """The step for microbatches of `shape` at loss scale `scale`, as a CUDA graph (made
        again when either changes: the scale is a constant of the graph)."""
        self.graph = self.g_out = None  # the old graph's memory first
        self.g_idx = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.g_tgt = torch.zeros_like(self.g_idx)
        run = lambda: hg.eager_loss_and_grads(self.ops, self.cfg, self.w, self.g_idx, self.g_tgt, scale)
        run()  # once outside the capture: cuBLAS picks its kernels and workspaces
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode='thread_local'):
            self.g_out = run()
        self.graph, self.graph_key = graph, (shape, scale)

    def loss_and_grads(self, idx, targets):
        """(loss, grads), tensors of the caller's own: copies of the graph's output
        buffers, which the next replay overwrites. The engine's thread stays on its stream,
        so that the step's sums of these gradients run there too."""
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)
        with self.running():
            key = (tuple(idx.shape), self.scaler.scale)
            if self.use_graph and self.graph_key != key:
                try:
                    self.capture(*key)
                except torch.cuda.OutOfMemoryError as e:  # the capture ends cleanly; op by op needs less
                    self.use_graph, self.graph, self.g_out = False, None, None
                    print(f"{self.label}: CUDA graph capture failed ({e}); running the step op by op")
            if not self.use_graph:
                return super().loss_and_grads(idx, targets)
            self.g_idx.copy_(idx)
            self.g_tgt.copy_(targets)
            self.graph.replay()
            loss, grads = self.g_out
            return loss.clone(), {k: v.clone() for k, v in grads.items()}


class PaddedHeadGPT(hg.GPT):
    """GPT with its LM head on the vocabulary padded with zero rows to a multiple of 64:
    tensor cores want aligned rows, and GPT-2's 50257 takes a slow path. A constant bias of
    -inf on the padding rows drops them from the softmax and the gradients: GPT-2's loss."""

    def __init__(self, config):
        super().__init__(config)
        V, self.pad = config.vocab_size, -config.vocab_size % 64
        self.register_buffer('pad_logits', torch.cat([torch.zeros(V), torch.full((self.pad,), -math.inf)]),
                             persistent=False)  # not in the state dict

    def forward(self, idx, targets=None):
        if targets is None or not self.pad:
            return super().forward(idx, targets)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        w, dev = self.lm_head.weight, x.device.type
        if torch.is_autocast_enabled(dev) and w.dtype == torch.float32:  # pad autocast's half copy: half the bytes
            w = w.to(torch.get_autocast_dtype(dev))
        logits = F.linear(x, F.pad(w, (0, 0, 0, self.pad)), self.pad_logits)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits[..., :self.config.vocab_size], loss


@dataclasses.dataclass
class FastConfig(hg.Config):
    fused_kernels: bool = hg.setting(False, "the stand-in's pieces as fused kernels (fp32 statistics inside)")


class NoWaitStep(hg.HeteroStep):
    """The GPU engine alone, on one rank, with a fused AdamW on CUDA or the CPU: the host does not
    wait for the gradients before it queues the update. AdamW skips a non-finite step on the
    device, by `found_inf` as GradScaler hands it (torch/amp/grad_scaler.py); MPS's fused AdamW
    ignores it (docs/coreml_and_ane.md section 6). The host reads the norm once the update is queued."""

    def unwaited(self):
        groups = self.optimizer.param_groups if self.optimizer else []
        return (self.alive == {'gpu'} and distributed.world()[1] == 1 and self.device.type in ('cuda', 'cpu')
                and bool(groups) and all(g.get('fused') for g in groups))

    def __call__(self, microbatches):
        if not self.unwaited():
            return super().__call__(microbatches)
        self.split.next_share(self.alive)
        self.inputs = [(x.contiguous(), y.contiguous()) for x, y in microbatches]
        share = hg.run_engine(self.engines['gpu'], self.inputs, timed=False)
        for k, p in self.params.items():
            p.grad = share.grads[k] / share.n
        # loss and norm are read in update, after it is queued
        return hg.StepResult(share.loss / share.n, share.n, ['gpu'], math.nan, 0, {'gpu': share})

    def update(self, result, grad_clip=0.0):
        if not isinstance(result.loss, torch.Tensor):  # the reference's step: read already
            return super().update(result, grad_clip)
        grads = [p.grad for p in self.params.values()]
        norm = torch.nn.utils.get_total_norm(grads)
        if grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(grads, grad_clip, norm)
        bad = ~(norm + result.loss).isfinite()  # a non-finite loss or gradient skips the step
        self.optimizer.found_inf = bad.float()
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # this step's only, as GradScaler's
        self.optimizer.zero_grad(set_to_none=True)
        norm, loss = torch.stack([norm.float(), result.loss.float()]).tolist()  # the one wait
        self.inputs = None
        finite = math.isfinite(norm + loss)
        self.engines['gpu'].scaler.update(finite)
        if finite:
            return dataclasses.replace(result, loss=loss, grad_norm=norm)
        self.dropped['gpu'] += 1
        self.skipped += 1
        return dataclasses.replace(result, loss=math.nan, n=0, used=[], grad_norm=norm)


def classes(cfg):
    """This file's subclasses, for hetero_gpt.build_run."""
    engine = functools.partial(FastEagerEngine, fused_kernels=getattr(cfg, 'fused_kernels', False), compile=cfg.compile)
    return hg.Classes(model=PaddedHeadGPT, eager_engine=engine, step=NoWaitStep)


def train(cfg, given):
    return hg.train(cfg, given, classes(cfg))


if __name__ == '__main__':
    hg.main(job=train, cls=FastConfig)
