"""
HeteroEngine: train GPT-2 on two accelerators at once.

Apple Silicon has a GPU and a Neural Engine (ANE) on one chip, sharing one memory.
PyTorch trains on the GPU only; the ANE is reachable only through Core ML, which runs
programs but has no autograd. So this file:

  1. defines GPT-2 (nanoGPT's layout, so checkpoints load),
  2. derives its backward pass by hand, once, over a tiny vocabulary of tensor ops,
  3. runs that derivation eagerly in PyTorch, or records it as a Core ML program,
  4. trains with both engines at once: every batch is split into microbatches, the GPU
     (autograd) and the ANE (the Core ML program) each run forward+backward on their
     share from the same weights, the gradients are averaged, one AdamW step follows.

Off a Mac the "ANE" engine is the same derivation run eagerly by PyTorch in fp16: the
ANE's arithmetic without the ANE. Everything macOS-only sits behind `coreml_predict_fn`.

Read top to bottom: config, model, hand-derived forward/backward, Core ML program,
engines, the concurrent step, energy meters, the training loop.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ON_MAC = sys.platform == 'darwin'
ANE_MAX_DIM = 16384  # the ANE rejects tensors with any dimension above ~16384 (ANE_NOTES)

# -----------------------------------------------------------------------------
# 1. Configuration: every setting, its default, and one line on what it does.
# `python hetero_gpt.py --name value` overrides any of them; --help lists them.


def opt(default, help):
    return field(default=default, metadata={'help': help})


@dataclass
class Config:
    # data
    dataset: str = opt('shakespeare', "data set under data/<name>/ (prepare_data.py makes it)")
    data_dir: str = opt('data', "folder that holds the prepared data sets")
    # model (defaults: GPT-2 124M)
    n_layer: int = opt(12, "transformer blocks")
    n_head: int = opt(12, "attention heads per block")
    n_embd: int = opt(768, "embedding width")
    block_size: int = opt(1024, "context length in tokens")
    vocab_size: int = opt(50257, "GPT-2 BPE vocabulary")
    # optimisation
    batch_size: int = opt(8, "sequences per microbatch")
    gradient_accumulation_steps: int = opt(4, "microbatches per optimizer step (hetero splits these)")
    max_iters: int = opt(1000, "optimizer steps")
    learning_rate: float = opt(3e-4, "peak learning rate")
    min_lr: float = opt(3e-5, "learning rate at the end of the cosine decay")
    warmup_iters: int = opt(100, "linear warm-up steps")
    weight_decay: float = opt(0.1, "AdamW weight decay (2-D weights only)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the averaged gradient's norm to this (0: off)")
    # engines
    mode: str = opt('auto', "gpu | ane | hetero | auto (hetero on macOS, gpu elsewhere)")
    device: str = opt('auto', "GPU engine device: auto (mps > cuda > cpu), cpu, cuda, cuda:1, mps")
    dtype: str = opt('auto', "GPU engine precision: auto (bf16 on CUDA, fp32 else), float32, bfloat16, float16")
    ane_device: str = opt('auto', "off macOS, device of the eager stand-in for the ANE (auto: the GPU engine's)")
    ane_dtype: str = opt('float16', "off macOS, precision of the eager stand-in (float16 = the ANE's)")
    ane_fraction: str = opt('auto', "share of microbatches for the ANE: a number in [0,1] or auto (rebalance)")
    ane_package: str = opt('', "Core ML package for the ANE (default: out_dir/ane_B{batch}_T{block}.mlpackage)")
    loss_scale: float = opt(1024.0, "initial fp16 loss scale (dynamic: x2 after scale_window finite steps, /2 on overflow)")
    scale_window: int = opt(200, "finite steps before the fp16 loss scale grows")
    compile: bool = opt(False, "torch.compile the GPU engine's model")
    # evaluation, logging, checkpoints
    eval_interval: int = opt(100, "evaluate validation loss every this many steps")
    eval_iters: int = opt(20, "validation batches per evaluation (0: the full validation split)")
    log_interval: int = opt(10, "print and log training metrics every this many steps")
    out_dir: str = opt('out', "checkpoints and metrics.jsonl go here")
    resume: bool = opt(False, "resume from out_dir/ckpt.pt")
    sample_tokens: int = opt(200, "tokens of text sampled at the end (0: none)")
    seed: int = opt(1337, "seed for weights and batch order")
    bench: bool = opt(False, "time gpu, ane and hetero side by side and print the table, then exit")
    bench_iters: int = opt(10, "timed steps per mode with --bench (after 3 warm-up steps)")
    quiet: bool = opt(False, "no progress bar")


# What the default run becomes on a machine with no accelerator, for settings the user
# did not give: a model small enough that a 2-core CPU shows progress within a minute.
CPU_DEFAULTS = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=8,
                    gradient_accumulation_steps=2, max_iters=300, learning_rate=1e-3,
                    min_lr=1e-4, warmup_iters=20, eval_interval=100, eval_iters=10)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="HeteroEngine: GPT-2 on GPU and ANE at once.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        if f.type in (bool, 'bool'):
            parser.add_argument(f'--{f.name}', type=_parse_bool, nargs='?', const=True,
                                default=f.default, help=f.metadata['help'])
        else:
            typ = {'int': int, 'float': float, 'str': str}.get(f.type, f.type)
            parser.add_argument(f'--{f.name}', type=typ, default=f.default, help=f.metadata['help'])
    args = parser.parse_args(argv)
    given = {a.split('=')[0][2:] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith('--')}
    return Config(**vars(args)), given


def _parse_bool(s):
    if s.lower() in ('1', 'true', 'yes'):
        return True
    if s.lower() in ('0', 'false', 'no'):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


class UserError(Exception):
    """Something the user can fix: printed as one line, no traceback."""


# -----------------------------------------------------------------------------
# 2. The model: GPT-2 as published, in nanoGPT's layout (same state-dict keys).
# Learned positions, pre-LayerNorm with bias, tanh-GELU MLP, tied embedding/LM head.
# No dropout: the hand-derived backward below does not model it.

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused attention
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate='tanh'))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        _KNOWN_CONFIGS.add(dataclasses.astuple(config))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} is longer than block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        flat = logits.view(-1, logits.size(-1))  # the loss in fp32 at least, even under autocast
        flat = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
        return logits, F.cross_entropy(flat, targets.view(-1))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=200):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :] / temperature
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float('inf')
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), 1)), dim=1)
        return idx


_KNOWN_CONFIGS = set()  # configs of every GPT built in this process (to infer n_head, below)

# -----------------------------------------------------------------------------
# 3. The hand-derived training step.
#
# Written ONCE, over a small vocabulary of tensor ops that both backends provide:
#   a @ b (o.matmul, optional transposes), + - * / with tensors or Python floats,
#   o.exp o.log o.tanh o.rsqrt, o.sum o.mean o.max over one axis (kept), o.maximum,
#   o.softmax, o.reshape, o.transpose, o.causal_mask.
# TorchOps runs the calls eagerly; MILOps (section 4) records them as a Core ML program.
# Every op here exists in MIL and runs on the ANE: no gather, scatter, one_hot, concat,
# or split. The sparse work (embedding lookup, picking each target's row, scatter-adding
# their gradients) is done by the host around the dense program (host_inputs/host_grads).
#
# Shapes: B sequences of T tokens, N = B*T rows, C = n_embd, H heads of D = C/H.
# Activations are (N, C) row matrices; attention works per head on (B, H, T, D).
# Layout note: Apple's ANE guide prefers (B, C, 1, S) with 1x1 convolutions for linear
# layers. We keep matmul with row matrices because the weights are program *inputs*
# (one compiled program for every step) and matmul takes non-constant operands in both
# backends unchanged; the per-head attention split is kept, as Apple recommends.


class TorchOps:
    """PyTorch backend of the derivation: eager, no autograd, any device and dtype."""

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device

    def matmul(self, a, b, ta=False, tb=False):
        return (a.mT if ta else a) @ (b.mT if tb else b)

    exp, log, tanh, rsqrt = (staticmethod(f) for f in (torch.exp, torch.log, torch.tanh, torch.rsqrt))
    maximum = staticmethod(torch.maximum)

    def sum(self, x, axis, keep=True):
        return x.sum(axis, keepdim=keep)

    def mean(self, x, axis):
        return x.mean(axis, keepdim=True)

    def max(self, x, axis):
        return x.amax(axis, keepdim=True)

    def softmax(self, x, axis):
        return torch.softmax(x, axis)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def transpose(self, x, perm):
        return x.permute(perm)

    def causal_mask(self, T):
        # additive mask: 0 on and below the diagonal, -1e4 above. -1e4 (not -inf) because
        # fp16 tops out at 65504 and -inf - -inf = nan; exp(-1e4) is exactly 0 in any dtype.
        return torch.full((T, T), -1e4, dtype=self.dtype, device=self.device).triu(1)


# ---- linear layer: y = x W^T + b, x (N, Cin), W (Cout, Cin) as in nn.Linear
def linear_forward(o, x, w, b):
    return o.matmul(x, w, tb=True) + b


def linear_backward(o, dy, x, w):
    # dL/dx = dy W,  dL/dW = dy^T x,  dL/db = sum over rows of dy
    return o.matmul(dy, w), o.matmul(dy, x, ta=True), o.sum(dy, 0, keep=False)


# ---- layernorm over the last axis: y = xhat * w + b, xhat = (x - mean) * rstd
def layernorm_forward(o, x, w, b, eps=1e-5):
    xc = x - o.mean(x, -1)
    rstd = o.rsqrt(o.mean(xc * xc, -1) + eps)  # 1/sqrt(var + eps)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd)


def layernorm_backward(o, dy, w, cache):
    # with g = dy*w: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    # dw = sum over rows of dy*xhat, db = sum over rows of dy
    xhat, rstd = cache
    g = dy * w
    dx = (g - o.mean(g, -1) - xhat * o.mean(g * xhat, -1)) * rstd
    return dx, o.sum(dy * xhat, 0, keep=False), o.sum(dy, 0, keep=False)


# ---- GELU, tanh form written out (ANE_NOTES: avoid the gelu op in the ANE compiler)
GELU_K = math.sqrt(2.0 / math.pi)


def gelu_forward(o, x):
    # y = x/2 (1 + tanh(u)), u = k (x + 0.044715 x^3)
    t = o.tanh((x + 0.044715 * x * x * x) * GELU_K)
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_backward(o, dy, cache):
    # dy/dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 * 0.044715 x^2)
    x, t = cache
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 0.134145 * x * x))


# ---- causal self-attention on one block's q, k, v (each (N, C))
def heads(o, x, B, T, H):  # (N, C) -> (B, H, T, D)
    return o.transpose(o.reshape(x, (B, T, H, -1)), (0, 2, 1, 3))


def merge_heads(o, x, B, T):  # (B, H, T, D) -> (N, C)
    return o.reshape(o.transpose(x, (0, 2, 1, 3)), (B * T, -1))


def attention_forward(o, q, k, v, B, T, H):
    # P = softmax(q k^T / sqrt(D) + mask), y = P v
    q, k, v = heads(o, q, B, T, H), heads(o, k, B, T, H), heads(o, v, B, T, H)
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = o.softmax(o.matmul(q, k, tb=True) * scale + o.causal_mask(T), -1)
    return merge_heads(o, o.matmul(p, v), B, T), (q, k, v, p, scale)


def attention_backward(o, dy, cache, B, T, H):
    # dv = P^T dy, dP = dy v^T, dS = P * (dP - rowsum(dP * P)) (softmax backward),
    # dq = dS k * scale, dk = dS^T q * scale. The mask is a constant: no gradient.
    q, k, v, p, scale = cache
    dy = heads(o, dy, B, T, H)
    dv = o.matmul(p, dy, ta=True)
    dp = o.matmul(dy, v, tb=True)
    ds = p * (dp - o.sum(dp * p, -1)) * scale
    dq, dk = o.matmul(ds, k), o.matmul(ds, q, ta=True)
    return merge_heads(o, dq, B, T), merge_heads(o, dk, B, T), merge_heads(o, dv, B, T)


# ---- one transformer block. Weights come in by the dense program's names (BLOCK_PARAMS).
# The QKV projection is three (C, C) matmuls: the host slices nanoGPT's (3C, C) c_attn
# weight into q/k/v rows, so the program needs no split (forward) or concat (backward).
BLOCK_PARAMS = {  # dense name: (nanoGPT name under transformer.h.{l}., which third of rows)
    'ln1_w': ('ln_1.weight', None), 'ln1_b': ('ln_1.bias', None),
    'wq': ('attn.c_attn.weight', 0), 'wk': ('attn.c_attn.weight', 1), 'wv': ('attn.c_attn.weight', 2),
    'bq': ('attn.c_attn.bias', 0), 'bk': ('attn.c_attn.bias', 1), 'bv': ('attn.c_attn.bias', 2),
    'wo': ('attn.c_proj.weight', None), 'bo': ('attn.c_proj.bias', None),
    'ln2_w': ('ln_2.weight', None), 'ln2_b': ('ln_2.bias', None),
    'wfc': ('mlp.c_fc.weight', None), 'bfc': ('mlp.c_fc.bias', None),
    'wpr': ('mlp.c_proj.weight', None), 'bpr': ('mlp.c_proj.bias', None),
}


def block_forward(o, x, p, B, T, H):
    # x + attn(ln_1(x)), then + mlp(ln_2(.))
    a, ln1 = layernorm_forward(o, x, p['ln1_w'], p['ln1_b'])
    q, k, v = (linear_forward(o, a, p['w' + c], p['b' + c]) for c in 'qkv')
    y, att = attention_forward(o, q, k, v, B, T, H)
    x = x + linear_forward(o, y, p['wo'], p['bo'])
    m, ln2 = layernorm_forward(o, x, p['ln2_w'], p['ln2_b'])
    h = linear_forward(o, m, p['wfc'], p['bfc'])
    g, gelu = gelu_forward(o, h)
    x = x + linear_forward(o, g, p['wpr'], p['bpr'])
    return x, (a, ln1, y, att, m, ln2, g, gelu)


def block_backward(o, dx, p, cache, B, T, H):
    # the forward's calls in reverse; a residual add passes dx through unchanged
    a, ln1, y, att, m, ln2, g, gelu = cache
    d = {}
    dg, d['wpr'], d['bpr'] = linear_backward(o, dx, g, p['wpr'])
    dh = gelu_backward(o, dg, gelu)
    dm, d['wfc'], d['bfc'] = linear_backward(o, dh, m, p['wfc'])
    dmx, d['ln2_w'], d['ln2_b'] = layernorm_backward(o, dm, p['ln2_w'], ln2)
    dx = dx + dmx
    dy, d['wo'], d['bo'] = linear_backward(o, dx, y, p['wo'])
    dq, dk, dv = attention_backward(o, dy, att, B, T, H)
    da = None
    for c, dc in zip('qkv', (dq, dk, dv)):
        dac, d['w' + c], d['b' + c] = linear_backward(o, dc, a, p['w' + c])
        da = dac if da is None else da + dac
    dax, d['ln1_w'], d['ln1_b'] = layernorm_backward(o, da, p['ln1_w'], ln1)
    return dx + dax, d


# ---- tied LM head + mean cross-entropy, over vocabulary chunks of at most 16384 rows.
# loss = mean_n (lse_n - z_n[target_n]), lse_n = log sum_v exp(z_nv), z = x W^T.
# The vocabulary (50257) is wider than the ANE's 16384 limit, so W arrives in chunks and
# the log-sum-exp is combined across chunks with a running max. The target logit is
# x_n . W[target_n]: the host gathers those rows (wte_tgt) so the program has no gather.
def lm_head_forward(o, x, chunks, w_tgt, N):
    z = [o.matmul(x, w, tb=True) for w in chunks]  # (N, Vc) each
    m = o.max(z[0], -1)
    for zc in z[1:]:
        m = o.maximum(m, o.max(zc, -1))
    s = None
    for zc in z:
        sc = o.sum(o.exp(zc - m), -1)
        s = sc if s is None else s + sc
    lse = m + o.log(s)  # (N, 1)
    # (lse - z_target) / N before the sum: a sum of N losses of ~10 overflows fp16
    loss = o.sum((lse - o.sum(x * w_tgt, -1)) * (1.0 / N), 0)  # (1, 1)
    return loss, (x, z, lse)


def lm_head_backward(o, chunks, w_tgt, cache, seed):
    # seed = loss_scale / N is dL/dloss_n. dz = seed * (softmax(z) - onehot(target)):
    # the softmax part is exp(z - lse) per chunk; the onehot part only touches the target
    # rows, so it goes to dx as -seed * W[target] and to those rows as -seed * x.
    x, z, lse = cache
    dx, dws = None, []
    for w, zc in zip(chunks, z):
        dz = o.exp(zc - lse) * seed
        dws.append(o.matmul(dz, x, ta=True))  # dW_chunk = dz^T x
        dxc = o.matmul(dz, w)                 # dx += dz W_chunk
        dx = dxc if dx is None else dx + dxc
    return dx - w_tgt * seed, dws, x * (-1.0) * seed


def dense_step(o, cfg, B, T, inp):
    """Forward, loss and backward of GPT-2 between the embedding lookup and the target
    pick. inp: dense inputs by name (see dense_input_shapes). Returns (loss, grads),
    grads by the same names; loss is the true mean loss, grads are multiplied by
    inp['loss_scale'] (so fp16 weight gradients do not flush to zero)."""
    N, H, L = B * T, cfg.n_head, cfg.n_layer
    blocks = [{k: inp[f'h{l}_{k}'] for k in BLOCK_PARAMS} for l in range(L)]
    chunks = [inp[f'wte_{j}'] for j in range(len(vocab_chunks(cfg.vocab_size)))]
    x, caches = inp['x0'], []
    for l in range(L):
        x, c = block_forward(o, x, blocks[l], B, T, H)
        caches.append(c)
    xf, lnf = layernorm_forward(o, x, inp['lnf_w'], inp['lnf_b'])
    loss, head = lm_head_forward(o, xf, chunks, inp['wte_tgt'], N)
    # ---- backward: the same calls in reverse
    grads = {}
    dxf, dws, grads['wte_tgt'] = lm_head_backward(o, chunks, inp['wte_tgt'], head,
                                                  inp['loss_scale'] * (1.0 / N))
    grads.update({f'wte_{j}': dw for j, dw in enumerate(dws)})
    dx, grads['lnf_w'], grads['lnf_b'] = layernorm_backward(o, dxf, inp['lnf_w'], lnf)
    for l in reversed(range(L)):
        dx, d = block_backward(o, dx, blocks[l], caches[l], B, T, H)
        grads.update({f'h{l}_{k}': v for k, v in d.items()})
    grads['x0'] = dx
    return loss, grads


def vocab_chunks(V):
    """[(start, end)] splitting the vocabulary into equal chunks of at most ANE_MAX_DIM."""
    n = -(-V // ANE_MAX_DIM)
    edges = [V * j // n for j in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def dense_input_shapes(cfg, B, T):
    """Name -> shape of every input of the dense program (its outputs are 'loss' plus a
    gradient for each of these but loss_scale)."""
    C, N = cfg.n_embd, B * T
    per_block = {'ln1_w': (C,), 'ln1_b': (C,), 'wq': (C, C), 'wk': (C, C), 'wv': (C, C),
                 'bq': (C,), 'bk': (C,), 'bv': (C,), 'wo': (C, C), 'bo': (C,),
                 'ln2_w': (C,), 'ln2_b': (C,), 'wfc': (4 * C, C), 'bfc': (4 * C,),
                 'wpr': (C, 4 * C), 'bpr': (C,)}
    shapes = {'x0': (N, C), 'wte_tgt': (N, C), 'loss_scale': (1, 1), 'lnf_w': (C,), 'lnf_b': (C,)}
    for l in range(cfg.n_layer):
        shapes.update({f'h{l}_{k}': s for k, s in per_block.items()})
    for j, (a, b) in enumerate(vocab_chunks(cfg.vocab_size)):
        shapes[f'wte_{j}'] = (b - a, C)
    return shapes


# ---- the host side: the sparse work the dense program leaves out
def host_inputs(params, cfg, idx, targets, loss_scale):
    """Dense inputs from the weights (nanoGPT names) and one microbatch: embedding lookup
    x0 = wte[idx] + wpe[:T], target rows wte[targets], q/k/v slices, vocab chunks."""
    T = idx.shape[1]
    wte = params['transformer.wte.weight']
    inp = {'x0': (wte[idx] + params['transformer.wpe.weight'][:T]).reshape(-1, cfg.n_embd),
           'wte_tgt': wte[targets.reshape(-1)],
           'loss_scale': torch.full((1, 1), float(loss_scale), dtype=wte.dtype, device=wte.device),
           'lnf_w': params['transformer.ln_f.weight'], 'lnf_b': params['transformer.ln_f.bias']}
    for l in range(cfg.n_layer):
        for k, (name, third) in BLOCK_PARAMS.items():
            w = params[f'transformer.h.{l}.{name}']
            inp[f'h{l}_{k}'] = w if third is None else w.chunk(3, 0)[third]
    for j, (a, b) in enumerate(vocab_chunks(cfg.vocab_size)):
        inp[f'wte_{j}'] = wte[a:b]
    return inp


def host_grads(g, cfg, idx, targets, loss_scale, out_dtype):
    """Parameter gradients (nanoGPT names) from the dense program's outputs: scatter-add
    the embedding rows' gradients, sum positions over the batch, join q/k/v, unscale."""
    B, T = idx.shape
    C = cfg.n_embd
    g = {k: v.to(out_dtype) for k, v in g.items()}
    dwte = torch.cat([g[f'wte_{j}'] for j in range(len(vocab_chunks(cfg.vocab_size)))], 0)
    dwte.index_add_(0, idx.reshape(-1), g['x0'])        # d wte[idx[n]] += dx0[n]
    dwte.index_add_(0, targets.reshape(-1), g['wte_tgt'])  # d wte[target[n]] += dwte_tgt[n]
    dwpe = torch.zeros(cfg.block_size, C, dtype=out_dtype, device=dwte.device)
    dwpe[:T] = g['x0'].reshape(B, T, C).sum(0)           # every sequence uses wpe[:T]
    grads = {'transformer.wte.weight': dwte, 'transformer.wpe.weight': dwpe,
             'transformer.ln_f.weight': g['lnf_w'], 'transformer.ln_f.bias': g['lnf_b']}
    for l in range(cfg.n_layer):
        for k, (name, third) in BLOCK_PARAMS.items():
            full = f'transformer.h.{l}.{name}'
            if third is None:
                grads[full] = g[f'h{l}_{k}']
            elif third == 0:
                grads[full] = torch.cat([g[f'h{l}_{k[0]}{c}'] for c in 'qkv'], 0)
    if loss_scale != 1.0:
        grads = {k: v / loss_scale for k, v in grads.items()}
    return grads


def config_from_params(params, n_head=None):
    """GPTConfig from the weights' shapes. n_head is not in any shape: take it from the
    argument, else from the one GPT of these shapes built in this process."""
    try:
        V, C = params['transformer.wte.weight'].shape
        block_size = params['transformer.wpe.weight'].shape[0]
    except KeyError as e:
        raise ValueError(f"params lacks {e}: expected the keys of GPT.named_parameters()") from None
    n_layer = len({k.split('.')[2] for k in params if k.startswith('transformer.h.')})
    if n_head is None:
        known = {c[3] for c in _KNOWN_CONFIGS if c[:3] == (block_size, V, n_layer) and c[4] == C}
        if len(known) != 1:
            raise ValueError("cannot tell n_head from the weights' shapes: pass n_head=")
        n_head = known.pop()
    cfg = GPTConfig(block_size=block_size, vocab_size=V, n_layer=n_layer, n_head=n_head, n_embd=C)
    expected = {k: tuple(v.shape) for k, v in GPT_param_shapes(cfg).items()}
    got = {k: tuple(v.shape) for k, v in params.items()}
    if expected != got:
        bad = sorted(set(expected) ^ set(got)) or [k for k in expected if expected[k] != got[k]]
        raise ValueError(f"params do not match a GPT-2 of {cfg}: check {bad[:4]}")
    return cfg


def GPT_param_shapes(cfg):
    with torch.device('meta'):
        return dict(GPT(cfg).named_parameters())


def check_batch(cfg, idx, targets):
    if idx.dim() != 2 or idx.shape != targets.shape:
        raise ValueError(f"idx and targets must both be (B, T); got {tuple(idx.shape)} and {tuple(targets.shape)}")
    if idx.shape[1] > cfg.block_size:
        raise ValueError(f"sequence length {idx.shape[1]} is longer than block_size {cfg.block_size}")
    for name, t in (('idx', idx), ('targets', targets)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.vocab_size):
            raise ValueError(f"{name} has token ids outside [0, {cfg.vocab_size})")


def manual_loss_and_grads(params, idx, targets, *, dtype=torch.float32, device=None,
                          loss_scale=1.0, n_head=None):
    """Loss and gradients of GPT-2 by the hand derivation, run eagerly by PyTorch.
    params: {name: tensor} as GPT.named_parameters(). Returns (loss, grads): the mean
    cross-entropy (0-dim tensor) and {name: gradient}, unscaled, in `dtype` (fp16 runs
    return fp32 gradients: unscaling in fp16 would flush small ones). Non-finite values
    are returned as they are: the caller checks (see grads_finite)."""
    cfg = config_from_params(params, n_head)
    check_batch(cfg, idx, targets)
    device = torch.device(device) if device is not None else params['transformer.wte.weight'].device
    idx, targets = idx.to(device), targets.to(device)
    w = {k: v.detach().to(device=device, dtype=dtype) for k, v in params.items()}
    o = TorchOps(dtype, device)
    with torch.no_grad():
        loss, g = dense_step(o, cfg, idx.shape[0], idx.shape[1],
                             host_inputs(w, cfg, idx, targets, loss_scale))
        out_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return loss.reshape(()).to(out_dtype), host_grads(g, cfg, idx, targets, loss_scale, out_dtype)


def grads_finite(grads):
    return bool(torch.stack([torch.isfinite(g).all() for g in grads.values()]).all())
