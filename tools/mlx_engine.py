"""
The GPU engine in MLX: each microbatch's loss and gradients computed by MLX on a Mac's GPU.
PyTorch keeps the rest: the master weights, AdamW, clipping, evaluation, checkpoints, torchrun.
hetero_gpt.py never imports this file, and deleting it breaks no mode.

    pip install 'mlx>=0.32,<0.33'                 # macOS 14+, Python 3.10+ (Linux: 'mlx[cpu]')
    python -m tools.mlx_engine [any hetero_gpt.py flag] [--mlx_cache_gb 1]
    hg.Classes(gpu_engine=MLXEngine), or classes(cfg), for build_run and train

gpt_loss        GPT-2 as a pure function of {nanoGPT's parameter name: mx.array}.
make_step       mx.compile of its value_and_grad, every gradient made row-contiguous.
MLXEngine       the hetero_gpt.Engine that runs it on the torch model's own weights.
MLXConfig       hetero_gpt.Config and the MLX cache's limit.
classes(cfg)    hetero_gpt.Classes with this engine, for build_run and train (and bench.py).

The facts it relies on, each with its source, are in docs/mlx.md; "mlx.md N" cites them. What
an independent read against MLX's and PyTorch's sources should check (mlx.md section 7):
1. Weights on a Mac are MPS tensors imported by mx.asarray(copy=False), without a copy, and
   AdamW's in-place updates show through (mlx.md 2). Elsewhere each call copies them.
2. The one wait at the start of each call (an MPS .item(), GIL released) orders torch's queue
   before MLX: AdamW's writes are done before MLX reads, and torch no longer reads gradient
   buffers that MLX may reuse (mlx.md 3).
3. mx.eval before returning completes MLX's writes, so torch may read the gradients at once,
   and leaves nothing lazy for another thread (mlx.md 3, 4). On Metal torch copies them into
   its own memory, which Metal orders for it; MLX's buffers are untracked (mlx.md 3).
4. Gradients are row-contiguous with the parameters' strides, each in its own buffer, as
   fused AdamW ignores strides (mlx.md 5).
"""
import contextlib
import dataclasses
import functools
import math
import os
import queue
import threading
from concurrent.futures import Future

import numpy as np
import torch

import hetero_gpt as hg  # defines: Engine, LossScaler, UserError, Config, Classes, GELU_K,
#   setting, main, train
from plumbing import memory  # defines: total_memory, add_parts

os.environ.setdefault('MLX_ENABLE_TF32', '0')  # fp32 is fp32 on an M5's GPU too (mlx.md 6)
try:
    import mlx.core as mx
except ImportError:  # an error line when used, not at import (bench.py imports this file)
    mx = None

INSTALL = ("the MLX engine needs MLX: pip install 'mlx>=0.32,<0.33' (macOS 14+ on Apple "
           "silicon, Python 3.10+; on Linux 'mlx[cpu]==0.32.4', the CPU backend)")


def require_mlx():
    if mx is None:
        raise hg.UserError(INSTALL)


# -----------------------------------------------------------------------------
# GPT-2 in MLX: hetero_gpt.GPT's forward, as a function of its parameters.
# dtype None: fp32 throughout. bfloat16: as torch's autocast does, each linear and the
# attention in bf16 on casts of the fp32 weights, layernorms and the loss in fp32.


def linear(x, w, b, dtype):  # nn.Linear: x @ w.T + b
    if dtype is not None:
        x = x.astype(dtype)
        w = w.astype(dtype)
        b = None if b is None else b.astype(dtype)
    return x @ w.T if b is None else mx.addmm(b, x, w.T)


def gelu(x):  # tanh approximation, as GPT-2's
    return 0.5 * x * (1 + mx.tanh(hg.GELU_K * (x + 0.044715 * x ** 3)))


def block(p, x, i, n_head, dtype):
    B, T, C = x.shape
    D = C // n_head
    h = f'transformer.h.{i}.'

    def lin(x, name):  # p.get: bias=False has no biases
        return linear(x, p[h + name + '.weight'], p.get(h + name + '.bias'), dtype)

    def norm(x, name):
        return mx.fast.layer_norm(x, p[h + name + '.weight'], p.get(h + name + '.bias'), 1e-5)

    qkv = lin(norm(x, 'ln_1'), 'attn.c_attn')
    q, k, v = (t.reshape(B, T, n_head, D).transpose(0, 2, 1, 3) for t in mx.split(qkv, 3, axis=-1))
    y = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask='causal')
    x = x + lin(y.transpose(0, 2, 1, 3).reshape(B, T, C), 'attn.c_proj')
    return x + lin(gelu(lin(norm(x, 'ln_2'), 'mlp.c_fc')), 'mlp.c_proj')


def gpt_loss(p, idx, targets, n_layer, n_head, dtype=None):
    """Mean cross-entropy of GPT-2 on idx (B, T) against targets, p the torch model's
    named_parameters (the LM head tied to transformer.wte.weight)."""
    T = idx.shape[1]
    wte = p['transformer.wte.weight']
    x = wte[idx] + p['transformer.wpe.weight'][:T]  # (B, T, C), fp32 residual stream
    for i in range(n_layer):
        x = block(p, x, i, n_head, dtype)
    x = mx.fast.layer_norm(x, p['transformer.ln_f.weight'], p.get('transformer.ln_f.bias'), 1e-5)
    logits = linear(x, wte, None, dtype).astype(mx.float32)  # (B, T, V)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (mx.logsumexp(logits, axis=-1) - picked).mean()


def make_step(n_layer, n_head, dtype, traced):
    """(params, idx, targets) -> (loss, {name: gradient}), compiled once per input shape.
    traced() runs each time MLX traces it (mlx.md 6)."""
    loss_and_grads = mx.value_and_grad(
        functools.partial(gpt_loss, n_layer=n_layer, n_head=n_head, dtype=dtype))

    def step(params, idx, targets):
        traced()
        loss, grads = loss_and_grads(params, idx, targets)
        # weight gradients come as transposed views; fused AdamW ignores strides (mlx.md 5)
        return loss, {k: mx.contiguous(g) for k, g in grads.items()}
    return mx.compile(step)


# -----------------------------------------------------------------------------
# The engine.


class MLXThread:
    """The one thread that runs MLX, whichever thread calls the engine. MLX's streams and its
    compile cache are each thread's own, and a lazy array cannot cross threads (mlx.md 4)."""

    def __init__(self):
        self.jobs = queue.SimpleQueue()
        self.busy = False  # a job running
        # a daemon, so an engine never closed does not hold the process at exit; idle then
        self.thread = threading.Thread(target=self.serve, name='mlx', daemon=True)
        self.thread.start()

    def serve(self):
        mx.eval(mx.zeros(1) + 1)  # this thread's stream made before any compile (mlx.md 6)
        while True:
            job = self.jobs.get()
            if job is None:
                break
            self.busy = True
            job()
            self.busy = False
        mx.clear_cache()
        mx.clear_streams()  # before the thread ends (mlx.md 4)

    def run(self, fn, *args):
        """fn(*args) in the MLX thread; the caller waits without the GIL."""
        if not self.thread.is_alive():
            raise RuntimeError("the MLX engine is closed")
        future = Future()

        def job():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller raises it
                future.set_exception(e)
        self.jobs.put(job)
        return future.result()

    def close(self):
        """Frees MLX's cache and ends the thread, waiting: a daemon that wakes while Python
        exits aborts the process (mlx.md 4). Busy (Ctrl-C mid-step), it ends after its job,
        unwaited: the process then exits at once (progress.exit_now_if_busy)."""
        if self.thread.is_alive():
            self.jobs.put(None)
            if not self.busy:
                self.thread.join()


class MLXEngine(hg.Engine):
    """The GPU engine, in MLX, on the torch model's weights: HeteroStep's 'gpu' engine, which
    loads no weights; it reads the model's at each call. Called from the step's thread, the
    main thread and the self-check's, it runs MLX in a thread of its own (MLXThread)."""
    name = 'gpu'

    def __init__(self, model, device, dtype, compile=False, scaler=None, cache_gb=None):
        # compile: torch.compile's flag, which does not apply; mx.compile always runs
        # scaler: fp16's, which is refused
        require_mlx()
        if dtype not in (torch.float32, torch.bfloat16):  # no loss scaling; fp64: CPU only
            raise hg.UserError(f"the MLX engine trains in float32 or bfloat16, not "
                               f"{str(dtype).replace('torch.', '')}: pass --dtype float32")
        self.model = model
        self.device = device
        self.params = dict(model.named_parameters())  # the tied head once, as wte
        self.autocast = contextlib.nullcontext()  # for evaluate() and the sample, in torch
        if dtype == torch.bfloat16:
            self.autocast = torch.autocast(device.type, dtype=dtype)
        self.scaler = hg.LossScaler(1.0, 0, enabled=False)
        self.traces = 0  # times mx.compile traced the step: one per microbatch shape

        def traced():
            self.traces += 1
        cfg = model.config
        mlx_dtype = mx.bfloat16 if dtype == torch.bfloat16 else None
        self.step = make_step(cfg.n_layer, cfg.n_head, mlx_dtype, traced)
        self.alias = self.can_alias()  # the weights shared without a copy (mlx.md 2)
        self.w = None  # the shared weights, made in the first call
        self.ptrs = None  # their storage, which a re-made parameter would change
        self.dlpack = True  # gradients to torch by DLPack, until it fails
        # MLX's free-buffer cache, bounded: two allocators share a Mac's memory (mlx.md 6)
        cache = memory.total_memory() / 16 if cache_gb is None else cache_gb * 2**30
        mx.set_cache_limit(int(cache))
        copied = 0 if self.alias else 4 * sum(p.numel() for p in self.params.values())
        memory.add_parts(dict(gpu_mlx_cache=int(cache), gpu_mlx_weights=copied))
        how = 'weights shared' if self.alias else 'weights copied each call'
        kind = str(mx.default_device().type).rpartition('.')[2]  # gpu (Metal) or cpu
        self.label = f"MLX {mx.__version__} on {kind} ({str(dtype).replace('torch.', '')}, {how})"
        self.mlx = MLXThread()

    def can_alias(self):
        """Whether MLX can read the torch weights in place: MPS tensors in shared storage
        (torch >= 2.12) on mlx >= 0.32 (mlx.md 2). A CPU tensor is always copied."""
        if self.device.type != 'mps':
            return False
        try:
            mx.asarray(next(iter(self.params.values())).detach(), copy=False)
        except (ValueError, RuntimeError, TypeError) as e:
            print(f"MLX engine: the weights are copied each call, as MLX cannot share torch's "
                  f"MPS memory ({e}); torch >= 2.12 with mlx >= 0.32 shares it")
            return False
        return True

    def host_weights(self):
        """The model's weights now, on the host: read in the caller's thread, so that only it
        touches torch's MPS (mlx.md 4). None where MLX shares them."""
        if self.alias:
            return None
        return {k: p.detach().cpu() for k, p in self.params.items()}

    def weights(self, host):
        """{name: mx.array} of the model's weights now. Never a copy cached across steps: fused
        AdamW changes them without bumping a version counter (mlx.md 5)."""
        if host is not None:  # a copy into MLX's memory each call, from the host (mlx.md 2)
            return {k: mx.asarray(t, copy=True) for k, t in host.items()}
        ptrs = [p.data_ptr() for p in self.params.values()]
        if ptrs != self.ptrs:  # made once; AdamW's updates show through
            self.w = {k: mx.asarray(p.detach(), copy=False) for k, p in self.params.items()}
            self.ptrs = ptrs
        return self.w

    def mlx_step(self, host, idx, targets):
        """In the MLX thread: the loss and gradients, evaluated (mlx.md 3)."""
        idx = mx.array(idx, dtype=mx.int32)
        targets = mx.array(targets, dtype=mx.int32)
        loss, grads = self.step(self.weights(host), idx, targets)
        mx.eval(loss, grads)
        return loss, grads

    def loss_and_grads(self, idx, targets):
        if self.device.type == 'mps':  # torch's queue drained, GIL released (mlx.md 3)
            torch.ones((), device=self.device).item()
        host = self.host_weights()
        loss, grads = self.mlx.run(self.mlx_step, host, idx.cpu().numpy(), targets.cpu().numpy())
        out = {}
        seen = set()
        for k, p in self.params.items():
            g = self.to_torch(grads[k], p)
            if g.stride() != p.stride() or g.data_ptr() in seen:  # a guard; MLX's never are
                g = torch.empty_like(p).copy_(g)
            seen.add(g.data_ptr())
            out[k] = g
        return torch.tensor(loss.item(), device=self.device), out

    def to_torch(self, g, like):
        """An evaluated MLX array as a tensor on the engine's device. By DLPack: on the CPU
        MLX's memory itself; from Metal a copy into torch's own memory, laid out as `like`
        (mlx.md 3). Without DLPack a copy through the host, said once."""
        if self.dlpack:
            try:
                t = torch.from_dlpack(g)
            except (RuntimeError, TypeError, BufferError) as e:
                self.dlpack = False
                print(f"MLX engine: gradients copied through the host, as this torch cannot "
                      f"import MLX's arrays ({e})")
            else:
                if t.device.type != 'mps':
                    return t.to(self.device)
                # MLX's buffers are untracked by Metal: torch's passes would be unordered
                return torch.empty_like(like).copy_(t)
        return torch.from_numpy(np.array(g)).to(self.device)

    def close(self):
        self.w = None
        self.mlx.close()


@dataclasses.dataclass
class MLXConfig(hg.Config):
    mlx_cache_gb: float = hg.setting(math.nan, "MLX engine's cache of freed GPU buffers, GiB "
                                                "(nan: a 16th of this machine's memory)")


def classes(cfg):
    """hetero_gpt.Classes with the MLX engine as the GPU engine (an error line without MLX)."""
    require_mlx()
    cache = getattr(cfg, 'mlx_cache_gb', math.nan)
    if cache < 0:
        raise hg.UserError(f"--mlx_cache_gb {cache} is negative: pass a size in GiB (0: no cache)")
    engine = functools.partial(MLXEngine, cache_gb=None if math.isnan(cache) else cache)
    return hg.Classes(gpu_engine=engine)


def train(cfg, given):
    return hg.train(cfg, given, classes(cfg))


if __name__ == '__main__':
    hg.main(job=train, cls=MLXConfig)
