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
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

ON_MAC = sys.platform == 'darwin'
ANE_MAX_DIM = 16384  # the ANE rejects tensors with any dimension above ~16384 (ANE_NOTES)
CPU_THREADS = torch.get_num_threads()  # PyTorch's default at start: one per core

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
    bias: bool = opt(True, "biases in linear layers and LayerNorms, as GPT-2 (False: nanoGPT's bias=False)")
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
    compile: bool = opt(False, "torch.compile the GPU engine's model and the eager engine's derivation")
    fused_kernels: bool = opt(False, "off macOS, the eager engine's attention, layernorm, GELU, bias adds, QKV "
                                     "projection and log-sum-exp by PyTorch's fused kernels (faster; fp32 "
                                     "statistics inside, where the ANE's are fp16)")
    # evaluation, logging, checkpoints
    eval_interval: int = opt(100, "evaluate validation loss and save a checkpoint every this many steps")
    eval_iters: int = opt(20, "validation batches per evaluation (0: the full validation split)")
    eval_seconds: float = opt(0.0, "also evaluate each time training time passes a multiple of this (0: off)")
    log_interval: int = opt(10, "print and log training metrics every this many steps")
    out_dir: str = opt('out', "checkpoints and metrics.jsonl go here")
    resume: bool = opt(False, "resume from out_dir/ckpt.pt")
    sample_tokens: int = opt(200, "tokens of text sampled at the end (0: none)")
    seed: int = opt(1337, "seed for weights and batch order")
    bench: bool = opt(False, "time gpu, ane and hetero side by side and print the table, then exit")
    bench_iters: int = opt(10, "timed steps per mode and round with --bench (after >= 5 warm-up steps and 3 s)")
    bench_repeats: int = opt(3, "rounds of --bench: the modes take turns, each reports its median round")
    quiet: bool = opt(False, "no progress bar")


# What the default run becomes on a machine with no accelerator, for settings the user
# did not give: a model small enough that a 2-core CPU shows progress within a minute.
CPU_DEFAULTS = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=8,
                    gradient_accumulation_steps=2, max_iters=300, learning_rate=1e-3,
                    min_lr=1e-4, warmup_iters=20, eval_interval=100, eval_iters=10)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="HeteroEngine: GPT-2 on GPU and ANE at once.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
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
# bias=False drops every bias (linear layers and LayerNorms), as nanoGPT's option does.
# No dropout: the hand-derived backward below does not model it.

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True  # biases in linear layers and LayerNorms (GPT-2); False: nanoGPT's option

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused attention
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate='tanh'))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
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
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        V, pad = config.vocab_size, -config.vocab_size % 64  # see forward; not in the state dict
        self.register_buffer('pad_logits', torch.cat([torch.zeros(V), torch.full((pad,), -math.inf)]) if pad else None,
                             persistent=False)
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
        # Tensor cores want aligned rows: with GPT-2's odd 50257, all three LM-head matmuls
        # (forward, d x, d W) take a slow path (bf16 on an H200: 62 vs 42 ms a step). So the
        # matmul runs on the weight padded with zero rows to a multiple of 64, and a constant
        # bias of 0, ..., 0, -inf, ..., -inf (added in the matmul's epilogue; no gradient)
        # makes the padded logits -inf: they drop out of the softmax (exp(-inf) = 0) and get
        # no gradient, so loss and gradients are GPT-2's, at the aligned speed. (Writing the
        # -inf into the logits in place instead costs autograd a copy of their whole gradient.)
        # Under autocast the padding copies the bf16/fp16 weight autocast makes anyway: half
        # the bytes of padding the fp32 master.
        V, pad = self.config.vocab_size, -self.config.vocab_size % 64
        if pad:
            w, dev = self.lm_head.weight, x.device.type
            if torch.is_autocast_enabled(dev) and w.dtype == torch.float32:  # (autocast leaves fp64 be)
                w = w.to(torch.get_autocast_dtype(dev))
            logits = F.linear(x, F.pad(w, (0, 0, 0, pad)), self.pad_logits)
        else:
            logits = self.lm_head(x)
        # under autocast the log-softmax inside cross_entropy runs in fp32, read straight
        # from the bf16/fp16 logits (autocast's policy for softmax ops)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits[..., :V], loss

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
#   o.softmax, o.reshape, o.transpose, o.causal_mask, o.pad_mask;
# and o.fused(fn), which may hand back a compiled version of a piece of the derivation.
# TorchOps runs the calls eagerly; MILOps (section 4) records them as a Core ML program.
# With --fused_kernels, TorchOps runs some whole pieces (attention, layernorm, GELU, a
# linear layer's bias add, the QKV projection as one matmul, log-sum-exp) by PyTorch's
# own fused kernels instead, called by hand (o.attention_kernel, o.fused_kernels): the
# same math in fewer passes over memory, each tested against its written-out twin's
# autograd reference. Every op the program records exists in MIL and runs on the ANE:
# no gather, scatter, one_hot, concat, or split (TorchOps.cat/split serve the fused
# QKV projection alone, which the program does not take). The sparse work (embedding
# lookup, picking each target's row, scatter-adding their gradients) is done by the host
# around the dense program (host_inputs/host_grads).
#
# Shapes: B sequences of T tokens, N = B*T rows, C = n_embd, H heads of D = C/H.
# Activations are (N, C) row matrices; attention works per head on (B, H, T, D).
# Layout note: Apple's ANE guide prefers (B, C, 1, S) with 1x1 convolutions for linear
# layers. We keep matmul with row matrices because the weights are program *inputs*
# (one compiled program for every step) and matmul takes non-constant operands in both
# backends unchanged; the per-head attention split is kept, as Apple recommends.


_COMPILED = {}  # derivation function -> its torch.compile'd version (TorchOps.fused)


@torch.compiler.assume_constant_result  # under torch.compile: decided once, while tracing
def sdp_choice(q, k, v):
    """scaled_dot_product_attention's own choice of kernel for causal attention on q, k, v
    (an SDPBackend value), from their shapes, dtype and device, as for training: only with
    q requiring a gradient does the dispatcher also check that the kernel has a backward
    for these shapes (the derivation runs under no_grad, where it would not)."""
    with torch.enable_grad():
        return torch._fused_sdp_choice(q.detach().requires_grad_(), k, v, None, 0.0, True)


class TorchOps:
    """PyTorch backend of the derivation: eager, no autograd, any device and dtype."""
    # Eager PyTorch keeps every cached tensor alive until the backward: the (B, H, T, T)
    # attention probabilities would be the largest of them (16 bytes per token per head
    # per context position in fp32), so this backend recomputes them in the backward.
    recompute_attention = True

    def __init__(self, dtype, device, compile=False, fused_kernels=False):
        self.dtype, self.device, self.compile = dtype, torch.device(device), compile
        # --fused_kernels: layernorm, GELU, the linear layers' bias add, the QKV projection
        # as one matmul and log-sum-exp by PyTorch's own fused kernels (one or two passes
        # over memory each, where the ops written out below make up to ten), called by hand
        # like every piece here; and attention, below (attention_kernel)
        self.fused_kernels = fused_kernels

    def fused(self, fn):
        # Eager, every op above is one kernel that reads and writes memory: a layernorm is
        # ~10 passes where a fused kernel makes 2. With compile, torch.compile turns a whole
        # piece of the derivation (a block's forward, its backward, the LM head) into fused
        # kernels: the same calls, the same math, less memory traffic.
        if not self.compile:
            return fn
        if fn not in _COMPILED:
            _COMPILED[fn] = torch.compile(fn, dynamic=False)
        return _COMPILED[fn]

    def matmul(self, a, b, ta=False, tb=False):
        a, b = (a.mT if ta else a), (b.mT if tb else b)
        if self.dtype == torch.float16 and self.device.type == 'cpu':
            # CPUs have no fast fp16 GEMM; fp16 operands, fp32 accumulation, fp16 result is
            # also what the ANE and GPU tensor cores compute, so the numerics are unchanged
            return (a.float() @ b.float()).half()
        return a @ b

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

    # Fused causal attention: y = softmax(q k^T / sqrt(D) + mask) v and its backward, the
    # math of attention_forward/attention_backward below, by the fused kernel pair that
    # PyTorch's own scaled_dot_product_attention would pick for these tensors in training
    # (on an H100/H200 in bf16/fp16 with a recent cuDNN: cuDNN's; elsewhere flash or
    # memory-efficient attention; under torch.compile the choice is made once, when
    # traced). They never build the (B, H, T, T) matrix P: the forward keeps each row's
    # log-sum-exp, the backward rebuilds P tile by tile from it. No autograd: both kernels are called by hand, as
    # every piece of the derivation is. Off by default: the fp16 stand-in for the ANE
    # should do attention in fp16 as the Core ML program does, and these kernels keep
    # fp32 softmax statistics inside.
    KERNELS = {SDPBackend.FLASH_ATTENTION.value: 'flash', SDPBackend.EFFICIENT_ATTENTION.value: 'efficient',
               SDPBackend.CUDNN_ATTENTION.value: 'cudnn'}

    def attention_kernel(self, q, k, v):
        """'flash', 'efficient' or 'cudnn': the kernel scaled_dot_product_attention's own
        dispatcher chooses for causal attention on q, k, v; None where fused kernels are
        off or it would fall back to plain ops (fp64 on CUDA, MPS): then the derivation's
        own ops run."""
        if not self.fused_kernels or self.device.type not in ('cpu', 'cuda'):
            return None
        return self.KERNELS.get(sdp_choice(q, k, v))

    def attention(self, kernel, q, k, v):
        """(y, saved): y (B, H, T, D), and what attention_grad needs besides q, k, v, y."""
        if self.device.type == 'cpu':  # the CPU has one fused kernel, 'flash'
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        if kernel == 'flash':
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
            return out[0], out[1:8]  # log-sum-exp, sequence bookkeeping, RNG state (unused: no dropout)
        if kernel == 'cudnn':
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)
            return out[0], out[1:8]
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        return out[0], out[1:4]

    def attention_grad(self, kernel, dy, q, k, v, y, saved):
        """(dq, dk, dv) for upstream dy, from the forward's q, k, v, y and saved."""
        if self.device.type == 'cpu':
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dy, q, k, v, y, saved, 0.0, True)
        if kernel == 'flash':
            lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dy, q, k, v, y, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset)
        if kernel == 'cudnn':  # dy as it comes: a (B, T, C) view, in y's own memory layout
            lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dy, q, k, v, y, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True)
        lse, seed, offset = saved
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dy, q, k, v, None, y, lse, seed, offset, 0.0, [True, True, True, False], True)[:3]

    # The fused pieces (fused_kernels), each the math of its written-out twin below:
    # layernorm_forward/backward, gelu_forward/backward, linear_forward, logsumexp_forward.
    def layernorm(self, x, w, b, eps):
        """(y, mean, rstd); mean and rstd per row, for layernorm_grad."""
        return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, eps)

    def layernorm_grad(self, dy, x, w, b, mean, rstd):
        """(dx, dw, db); db None without a bias (b None)."""
        return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b,
                                                         [True, True, b is not None])

    def gelu(self, x):
        return torch.ops.aten.gelu(x, approximate='tanh')

    def gelu_grad(self, dy, x):
        return torch.ops.aten.gelu_backward(dy, x, approximate='tanh')

    def cat(self, xs, axis=0):
        return torch.cat(xs, axis)

    def split(self, x, n, axis=-1):  # n equal parts, views
        return x.chunk(n, axis)

    def linear(self, x, w, b):
        """x W^T + b with the bias added in the matmul's epilogue (one pass fewer)."""
        if self.dtype == torch.float16 and self.device.type == 'cpu':  # as matmul: no fp16 GEMM on CPUs
            return F.linear(x.float(), w.float(), b.float()).half()
        return F.linear(x, w, b)

    def causal_mask(self, T):
        # additive mask: 0 on and below the diagonal, -1e4 above. -1e4 (not -inf) because
        # fp16 tops out at 65504 and -inf - -inf = nan; exp(-1e4) is exactly 0 in any dtype.
        return torch.full((T, T), -1e4, dtype=self.dtype, device=self.device).triu(1)

    def pad_mask(self, n, valid):
        # additive (n,) mask, a bias: 0 on the first `valid` columns, -1e4 on the rest
        mask = torch.zeros(n, dtype=self.dtype, device=self.device)
        mask[valid:] = -1e4
        return mask

    def logsumexp(self, z):
        """logsumexp_forward with PyTorch's fused log-softmax kernel: one pass to read z and
        one to write, where the written-out ops make four kernels and six passes.
        log softmax(z)_v = z_v - lse for every column v, so lse = z_0 - log softmax(z)_0:
        exact enough in fp32 and fp64. In fp16/bf16, log softmax(z)_0 is rounded to ~3
        significant digits and may be -30: there, take the one column whose log softmax
        is the largest, -log sum_v exp(z_v - max(z)) in [-log V, 0], so lse =
        max(z) - max(log softmax(z)), rounded no worse than the written-out twin's
        log(sum) (two more reads, still a pass fewer)."""
        ls = torch.log_softmax(z, -1)
        if z.dtype in (torch.float16, torch.bfloat16):
            return self.max(z, -1) - self.max(ls, -1)
        return z[:, :1] - ls[:, :1]


# ---- linear layer: y = x W^T + b, x (N, Cin), W (Cout, Cin) as in nn.Linear
def linear_forward(o, x, w, b):  # b None: no bias (bias=False)
    if b is not None and o.fused_kernels:  # the same, the add inside the matmul (TorchOps.linear)
        return o.linear(x, w, b)
    y = o.matmul(x, w, tb=True)
    return y if b is None else y + b


def linear_backward(o, dy, x, w):
    # dL/dx = dy W,  dL/dW = dy^T x,  dL/db = sum over rows of dy
    return o.matmul(dy, w), o.matmul(dy, x, ta=True), o.sum(dy, 0, keep=False)


# ---- layernorm over the last axis: y = xhat * w + b, xhat = (x - mean) * rstd
def layernorm_forward(o, x, w, b, eps=1e-5):
    if o.fused_kernels:  # the same y by one fused kernel (TorchOps.layernorm)
        y, mean, rstd = o.layernorm(x, w, b, eps)
        return y, (x, b, mean, rstd)
    xc = x - o.mean(x, -1)
    rstd = o.rsqrt(o.mean(xc * xc, -1) + eps)  # 1/sqrt(var + eps)
    xhat = xc * rstd
    return (xhat * w if b is None else xhat * w + b), (xhat, rstd)


def layernorm_backward(o, dy, w, cache):
    # with g = dy*w: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    # dw = sum over rows of dy*xhat, db = sum over rows of dy
    if o.fused_kernels:
        return o.layernorm_grad(dy, cache[0], w, *cache[1:])
    xhat, rstd = cache
    g = dy * w
    dx = (g - o.mean(g, -1) - xhat * o.mean(g * xhat, -1)) * rstd
    return dx, o.sum(dy * xhat, 0, keep=False), o.sum(dy, 0, keep=False)


# ---- GELU, tanh form written out (ANE_NOTES: avoid the gelu op in the ANE compiler)
GELU_K = math.sqrt(2.0 / math.pi)


def gelu_forward(o, x):
    # y = x/2 (1 + tanh(u)), u = k (x + 0.044715 x^3)
    # cache (x, t, None): the backward remakes y from t by one multiply-add (gelu_output);
    # fused, (x, None, y): the kernel's t stays inside it, so keep y itself (as many bytes)
    if o.fused_kernels:  # the same y by one fused kernel (TorchOps.gelu)
        y = o.gelu(x)
        return y, (x, None, y)
    t = o.tanh((x + 0.044715 * x * x * x) * GELU_K)
    return gelu_output(o, (x, t, None)), (x, t, None)


def gelu_output(o, cache):
    x, t, y = cache
    return y if y is not None else 0.5 * x * (1.0 + t)


def gelu_backward(o, dy, cache):
    # dy/dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 * 0.044715 x^2)
    x, t, _ = cache
    if t is None:
        return o.gelu_grad(dy, x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 0.134145 * x * x))


# ---- causal self-attention on one block's q, k, v (each (N, C))
def heads(o, x, B, T, H):  # (N, C) -> (B, H, T, D)
    return o.transpose(o.reshape(x, (B, T, H, -1)), (0, 2, 1, 3))


def merge_heads(o, x, B, T):  # (B, H, T, D) -> (N, C)
    return o.reshape(o.transpose(x, (0, 2, 1, 3)), (B * T, -1))


def attention_probs(o, q, k, T):
    # P = softmax(q k^T / sqrt(D) + mask), per head: (B, H, T, T)
    return o.softmax(o.matmul(q, k, tb=True) * (1.0 / math.sqrt(q.shape[-1])) + o.causal_mask(T), -1)


def attention_forward(o, q, k, v, B, T, H):
    # y = P v
    q, k, v = heads(o, q, B, T, H), heads(o, k, B, T, H), heads(o, v, B, T, H)
    kernel = o.attention_kernel(q, k, v)
    if kernel:  # the same y by a fused kernel, P never stored (TorchOps.attention)
        y, saved = o.attention(kernel, q, k, v)
        return merge_heads(o, y, B, T), (q, k, v, (kernel, y, saved))
    p = attention_probs(o, q, k, T)
    y = merge_heads(o, o.matmul(p, v), B, T)
    return y, (q, k, v, None if o.recompute_attention else p)


def attention_backward(o, dy, cache, B, T, H):
    # dv = P^T dy, dP = dy v^T, dS = P * (dP - rowsum(dP * P)) (softmax backward),
    # dq = dS k * scale, dk = dS^T q * scale. The mask is a constant: no gradient.
    dy = heads(o, dy, B, T, H)
    q, k, v, p = cache
    if isinstance(p, tuple):  # a fused kernel's forward: (kernel, y, saved)
        dq, dk, dv = o.attention_grad(p[0], dy, q, k, v, *p[1:])
        return merge_heads(o, dq, B, T), merge_heads(o, dk, B, T), merge_heads(o, dv, B, T)
    T, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    if p is None:
        p = attention_probs(o, q, k, T)
    dv = o.matmul(p, dy, ta=True)
    dp = o.matmul(dy, v, tb=True)
    ds = p * (dp - o.sum(dp * p, -1)) * scale
    dq, dk = o.matmul(ds, k), o.matmul(ds, q, ta=True)
    return merge_heads(o, dq, B, T), merge_heads(o, dk, B, T), merge_heads(o, dv, B, T)


# ---- one transformer block. Weights come in by the dense program's names (BLOCK_PARAMS).
# In the program, the QKV projection is three (C, C) matmuls: the host slices nanoGPT's
# (3C, C) c_attn weight into q/k/v rows, so it needs no split (forward) or concat
# (backward). Only TorchOps under --fused_kernels stacks them again (qkv_forward).
BLOCK_PARAMS = {  # dense name: (nanoGPT name under transformer.h.{l}., which third of rows)
    'ln1_w': ('ln_1.weight', None), 'ln1_b': ('ln_1.bias', None),
    'wq': ('attn.c_attn.weight', 0), 'wk': ('attn.c_attn.weight', 1), 'wv': ('attn.c_attn.weight', 2),
    'bq': ('attn.c_attn.bias', 0), 'bk': ('attn.c_attn.bias', 1), 'bv': ('attn.c_attn.bias', 2),
    'wo': ('attn.c_proj.weight', None), 'bo': ('attn.c_proj.bias', None),
    'ln2_w': ('ln_2.weight', None), 'ln2_b': ('ln_2.bias', None),
    'wfc': ('mlp.c_fc.weight', None), 'bfc': ('mlp.c_fc.bias', None),
    'wpr': ('mlp.c_proj.weight', None), 'bpr': ('mlp.c_proj.bias', None),
}


def qkv_forward(o, a, p):
    # q, k, v = a Wq^T + bq, a Wk^T + bk, a Wv^T + bv: three matmuls in the program (no
    # split). Fused (TorchOps.fused_kernels): one (N, 3C) matmul against the three
    # weights stacked, nanoGPT's c_attn: one wide GEMM runs faster than three narrow ones,
    # and its backward is two GEMMs and one bias sum where three make six and three.
    if o.fused_kernels:
        w, b = o.cat([p['wq'], p['wk'], p['wv']]), (o.cat([p['bq'], p['bk'], p['bv']]) if 'bq' in p else None)
        q, k, v = o.split(linear_forward(o, a, w, b), 3)  # column blocks of (N, 3C), views
        return q, k, v, w
    return (*(linear_forward(o, a, p['w' + c], p.get('b' + c)) for c in 'qkv'), None)


def qkv_backward(o, dq, dk, dv, a, p, w, d):
    """da; the weight and bias gradients into d. w: qkv_forward's stacked weight, or None."""
    if w is not None:  # fused: the two GEMMs of one linear layer, then its gradients split back
        da, dw, db = linear_backward(o, o.cat([dq, dk, dv], -1), a, w)
        (d['wq'], d['wk'], d['wv']), (d['bq'], d['bk'], d['bv']) = o.split(dw, 3, 0), o.split(db, 3, 0)
        return da
    da = None
    for c, dc in zip('qkv', (dq, dk, dv)):
        dac, d['w' + c], d['b' + c] = linear_backward(o, dc, a, p['w' + c])
        da = dac if da is None else da + dac
    return da


def block_forward(o, x, p, B, T, H):
    # x + attn(ln_1(x)), then + mlp(ln_2(.))
    # (a bias missing from p, under bias=False, is None: no bias)
    a, ln1 = layernorm_forward(o, x, p['ln1_w'], p.get('ln1_b'))
    q, k, v, wqkv = qkv_forward(o, a, p)
    y, att = attention_forward(o, q, k, v, B, T, H)
    x = x + linear_forward(o, y, p['wo'], p.get('bo'))
    m, ln2 = layernorm_forward(o, x, p['ln2_w'], p.get('ln2_b'))
    h = linear_forward(o, m, p['wfc'], p.get('bfc'))
    g, gelu = gelu_forward(o, h)
    x = x + linear_forward(o, g, p['wpr'], p.get('bpr'))
    return x, (a, ln1, wqkv, y, att, m, ln2, gelu)  # not g: gelu_output has it or remakes it


def block_backward(o, dx, p, cache, B, T, H):
    # the forward's calls in reverse; a residual add passes dx through unchanged
    a, ln1, wqkv, y, att, m, ln2, gelu = cache
    d = {}
    dg, d['wpr'], d['bpr'] = linear_backward(o, dx, gelu_output(o, gelu), p['wpr'])
    dh = gelu_backward(o, dg, gelu)
    dm, d['wfc'], d['bfc'] = linear_backward(o, dh, m, p['wfc'])
    dmx, d['ln2_w'], d['ln2_b'] = layernorm_backward(o, dm, p['ln2_w'], ln2)
    dx = dx + dmx
    dy, d['wo'], d['bo'] = linear_backward(o, dx, y, p['wo'])
    dq, dk, dv = attention_backward(o, dy, att, B, T, H)
    da = qkv_backward(o, dq, dk, dv, a, p, wqkv, d)
    dax, d['ln1_w'], d['ln1_b'] = layernorm_backward(o, da, p['ln1_w'], ln1)
    return dx + dax, {k: v for k, v in d.items() if k in p}  # no gradient for a bias that is not there


# ---- log-sum-exp over the last axis: lse = m + log sum_v exp(z_v - m), m = max_v z_v
# (subtracting the row max first: exp never overflows, and the largest term is exp(0) = 1)
def logsumexp_forward(o, z):
    if o.fused_kernels:  # the same (N, 1) by a fused softmax kernel (TorchOps.logsumexp)
        return o.logsumexp(z)
    m = o.max(z, -1)
    return m + o.log(o.sum(o.exp(z - m), -1))


# ---- tied LM head + mean cross-entropy, over vocabulary chunks of at most 16384 rows.
# loss = mean_n (lse_n - z_n[target_n]), lse_n = log sum_v exp(z_nv), z = x W^T.
# The vocabulary (50257) is wider than the ANE's 16384 limit, so W arrives in chunks:
# each chunk's own log-sum-exp lse_c, then lse = the log-sum-exp of the chunks' lse_c
# (log sum_v exp(z_v) = log sum_c exp(lse_c)). The target logit is x_n . W[target_n]:
# the host gathers those rows (wte_tgt) so the program has no gather.
# The last chunk ends in `pad` zero rows (vocab_chunks aligns the chunks): their logits
# get a -1e4 bias, so exp() makes them exactly 0 in the softmax and in every gradient.
def lm_head_forward(o, x, chunks, w_tgt, N, pad=0):
    Vc = chunks[-1].shape[0]
    biases = [None] * (len(chunks) - 1) + [o.pad_mask(Vc, Vc - pad) if pad else None]
    z = [linear_forward(o, x, w, b) for w, b in zip(chunks, biases)]  # (N, Vc) each
    lse_c = [logsumexp_forward(o, zc) for zc in z]  # (N, 1) each
    m = lse_c[0]
    for lc in lse_c[1:]:
        m = o.maximum(m, lc)
    s = None
    for lc in lse_c:
        sc = o.exp(lc - m)
        s = sc if s is None else s + sc
    lse = m + o.log(s)  # (N, 1)
    # (lse - z_target) / N before the sum: a sum of N losses of ~10 overflows fp16
    loss = o.sum((lse - o.sum(x * w_tgt, -1)) * (1.0 / N), 0)  # (1, 1)
    return loss, (x, z, lse_c, lse)


def lm_head_backward(o, chunks, w_tgt, cache, seed):
    # seed = loss_scale / N is dL/dloss_n. dz = seed * (softmax(z) - onehot(target)).
    # The softmax part, over the whole vocabulary, is exp(z - lse) = softmax_c(z) r per
    # chunk c, with softmax_c over the chunk alone (one fused kernel on either backend)
    # and r = seed exp(lse_c - lse) one number per row. r is never multiplied into the
    # (N, Vc) matrix: it scales rows of the (N, C) operands of the two matmuls instead,
    # dW_c = dz^T x = softmax_c^T (r x) and dx_c = dz W_c = r (softmax_c W_c), which
    # touches Vc/C = 16x fewer numbers. The onehot part only touches the target rows, so
    # it goes to dx as -seed * W[target] and to those rows as -seed * x.
    x, z, lse_c, lse = cache
    dx, dws = None, []
    for w, zc, lc in zip(chunks, z, lse_c):
        p, r = o.softmax(zc, -1), o.exp(lc - lse) * seed  # (N, Vc), (N, 1)
        dws.append(o.matmul(p, x * r, ta=True))  # dW_c = softmax_c^T (r x)
        dxc = o.matmul(p, w) * r                 # dx += r (softmax_c W_c)
        dx = dxc if dx is None else dx + dxc
    return dx - w_tgt * seed, dws, x * (-1.0) * seed


def dense_step(o, cfg, B, T, inp):
    """Forward, loss and backward of GPT-2 between the embedding lookup and the target
    pick. inp: dense inputs by name (see dense_input_shapes). Returns (loss, grads),
    grads by the same names; loss is the true mean loss, grads are multiplied by
    inp['loss_scale'] (so fp16 weight gradients do not flush to zero)."""
    N, H, L = B * T, cfg.n_head, cfg.n_layer
    blocks = [{k: inp[f'h{l}_{k}'] for k in BLOCK_PARAMS if f'h{l}_{k}' in inp} for l in range(L)]
    rows, spans = vocab_chunks(cfg.vocab_size)
    chunks = [inp[f'wte_{j}'] for j in range(len(spans))]
    block_fwd, block_bwd, head_fwd, head_bwd = map(o.fused, (block_forward, block_backward,
                                                             lm_head_forward, lm_head_backward))
    x, caches = inp['x0'], []
    for l in range(L):
        x, c = block_fwd(o, x, blocks[l], B, T, H)
        caches.append(c)
    xf, lnf = layernorm_forward(o, x, inp['lnf_w'], inp.get('lnf_b'))
    loss, head = head_fwd(o, xf, chunks, inp['wte_tgt'], N, pad=len(spans) * rows - cfg.vocab_size)
    # ---- backward: the same calls in reverse
    grads = {}
    dxf, dws, grads['wte_tgt'] = head_bwd(o, chunks, inp['wte_tgt'], head, inp['loss_scale'] * (1.0 / N))
    grads.update({f'wte_{j}': dw for j, dw in enumerate(dws)})
    dx, grads['lnf_w'], dlnf_b = layernorm_backward(o, dxf, inp['lnf_w'], lnf)
    if 'lnf_b' in inp:
        grads['lnf_b'] = dlnf_b
    for l in reversed(range(L)):
        dx, d = block_bwd(o, dx, blocks[l], caches[l], B, T, H)
        grads.update({f'h{l}_{k}': v for k, v in d.items()})
    grads['x0'] = dx
    return loss, grads


def vocab_chunks(V):
    """(rows, [(start, end)]): the vocabulary in n equal chunks of `rows` rows, at most
    ANE_MAX_DIM each. `rows` is rounded up to a multiple of 64, so every chunk's matrices
    have aligned rows (tensor cores and the ANE both want aligned last dimensions; GPT-2's
    odd 50257 makes every LM-head matmul take a slow path). The last chunk is padded
    with zero rows past the vocabulary, masked out of the softmax (lm_head_forward)."""
    n = -(-V // ANE_MAX_DIM)
    rows = (-(-V // n) + 63) // 64 * 64  # ceil(V / n), rounded up to a multiple of 64
    return rows, [(j * rows, min(V, (j + 1) * rows)) for j in range(n)]


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
    if not cfg.bias:
        shapes = {k: s for k, s in shapes.items() if not is_bias(k)}
    rows, spans = vocab_chunks(cfg.vocab_size)
    for j in range(len(spans)):
        shapes[f'wte_{j}'] = (rows, C)
    return shapes


def is_bias(name):
    """A dense input that bias=False leaves out: 'lnf_b', or a block's ('bq', 'h0_ln1_b', ...)."""
    k = name.split('_', 1)[1] if name[0] == 'h' and name[1:2].isdigit() else name  # h0_ln1_b -> ln1_b
    return k == 'lnf_b' or BLOCK_PARAMS.get(k, ('',))[0].endswith('.bias')


# ---- the host side: the sparse work the dense program leaves out
def host_weights(params, cfg):
    """The dense program's weight inputs from nanoGPT's names: the same tensors, with
    c_attn sliced into q/k/v rows and the (tied) embedding into vocabulary chunks."""
    inp = {'lnf_w': params['transformer.ln_f.weight']}
    if 'transformer.ln_f.bias' in params:  # biases only where the model has them (bias=False)
        inp['lnf_b'] = params['transformer.ln_f.bias']
    for l in range(cfg.n_layer):
        for k, (name, third) in BLOCK_PARAMS.items():
            if f'transformer.h.{l}.{name}' in params:
                w = params[f'transformer.h.{l}.{name}']
                inp[f'h{l}_{k}'] = w if third is None else w.chunk(3, 0)[third]
    rows, spans = vocab_chunks(cfg.vocab_size)
    for j, (a, b) in enumerate(spans):  # the last chunk padded with zero rows to `rows`
        inp[f'wte_{j}'] = F.pad(params['transformer.wte.weight'][a:b], (0, 0, 0, rows - (b - a)))
    return inp


def host_batch(wte, wpe, cfg, idx, targets, loss_scale):
    """The dense program's per-microbatch inputs: the sparse work done on the host.
    x0 = wte[idx] + wpe[:T] (embedding lookup), wte_tgt = wte[targets] (target rows)."""
    T = idx.shape[1]
    return {'x0': (wte[idx] + wpe[:T]).reshape(-1, cfg.n_embd),
            'wte_tgt': wte[targets.reshape(-1)],
            'loss_scale': (loss_scale.reshape(1, 1).to(wte.dtype) if torch.is_tensor(loss_scale) else
                           torch.full((1, 1), float(loss_scale), dtype=wte.dtype, device=wte.device))}


def host_inputs(params, cfg, idx, targets, loss_scale):
    return host_weights(params, cfg) | host_batch(params['transformer.wte.weight'],
                                                  params['transformer.wpe.weight'], cfg, idx, targets, loss_scale)


def host_grads(g, cfg, idx, targets, loss_scale, out_dtype):
    """Parameter gradients (nanoGPT names) from the dense program's outputs: scatter-add
    the embedding rows' gradients, sum positions over the batch, join q/k/v, unscale."""
    B, T = idx.shape
    C = cfg.n_embd
    g = {k: v.to(out_dtype) for k, v in g.items()}
    dwte = torch.cat([g[f'wte_{j}'][:b - a] for j, (a, b) in enumerate(vocab_chunks(cfg.vocab_size)[1])], 0)
    dwte.index_add_(0, idx.reshape(-1), g['x0'])        # d wte[idx[n]] += dx0[n]
    dwte.index_add_(0, targets.reshape(-1), g['wte_tgt'])  # d wte[target[n]] += dwte_tgt[n]
    dwpe = torch.zeros(cfg.block_size, C, dtype=out_dtype, device=dwte.device)
    dwpe[:T] = g['x0'].reshape(B, T, C).sum(0)           # every sequence uses wpe[:T]
    grads = {'transformer.wte.weight': dwte, 'transformer.wpe.weight': dwpe, 'transformer.ln_f.weight': g['lnf_w']}
    if 'lnf_b' in g:  # a gradient for every input the program had, biases only with bias=True
        grads['transformer.ln_f.bias'] = g['lnf_b']
    for l in range(cfg.n_layer):
        for k, (name, third) in BLOCK_PARAMS.items():
            full = f'transformer.h.{l}.{name}'
            if f'h{l}_{k}' not in g:
                continue
            if third is None:
                grads[full] = g[f'h{l}_{k}']
            elif third == 0:
                grads[full] = torch.cat([g[f'h{l}_{k[0]}{c}'] for c in 'qkv'], 0)
    if torch.is_tensor(loss_scale):  # a CUDA graph's input: divide on the device by what it holds
        torch._foreach_div_(list(grads.values()), loss_scale.reshape(()).to(out_dtype))
    elif loss_scale != 1.0:
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
    cfg = GPTConfig(block_size=block_size, vocab_size=V, n_layer=n_layer, n_head=n_head, n_embd=C,
                    bias='transformer.ln_f.bias' in params)
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
                          loss_scale=1.0, n_head=None, fused_kernels=False):
    """Loss and gradients of GPT-2 by the hand derivation, run eagerly by PyTorch.
    params: {name: tensor} as GPT.named_parameters(). Returns (loss, grads): the mean
    cross-entropy (0-dim tensor) and {name: gradient}, unscaled, in `dtype` (fp16 runs
    return fp32 gradients: unscaling in fp16 would flush small ones). Non-finite values
    are returned as they are: the caller checks (see grads_finite)."""
    cfg = config_from_params(params, n_head)
    check_batch(cfg, idx, targets)
    device = torch.device(device) if device is not None else params['transformer.wte.weight'].device
    w = {k: v.detach().to(device=device, dtype=dtype) for k, v in params.items()}
    return eager_loss_and_grads(cfg, w, idx.to(device), targets.to(device), dtype, device, loss_scale,
                                fused_kernels=fused_kernels)


def all_finite(grads):
    """A 0-d bool tensor on the device, so that the host need not wait for it. One fused
    pass: a tensor's norm is finite exactly when all its elements are."""
    return torch.stack(torch._foreach_norm(list(grads.values()))).isfinite().all()


def grads_finite(grads):
    return bool(all_finite(grads))


def eager_loss_and_grads(cfg, w, idx, targets, dtype, device, loss_scale, compile=False, fused_kernels=False):
    """manual_loss_and_grads without the checks: weights `w` already in `dtype` on `device`."""
    o = TorchOps(dtype, device, compile, fused_kernels)
    with torch.no_grad():
        loss, g = dense_step(o, cfg, idx.shape[0], idx.shape[1], host_inputs(w, cfg, idx, targets, loss_scale))
        out_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return loss.reshape(()).to(out_dtype), host_grads(g, cfg, idx, targets, loss_scale, out_dtype)

# -----------------------------------------------------------------------------
# 4. The Core ML program: the same dense_step, recorded by coremltools' MIL builder.
#
# MILOps mirrors TorchOps, but each call adds an op to a MIL program instead of
# computing. The result is one ML Program that takes the weights and one microbatch's
# dense inputs (fp16) and returns the loss and every gradient (fp16). Weights are inputs,
# not constants, so one compiled program serves every step. Opset macOS13: the first
# with fp16 inputs and outputs, so no fp32<->fp16 casts at the program's edges.


class MILTensor:
    """A MIL variable with Python's arithmetic operators, so dense_step's `a * b + c`
    records mul and add ops. Python floats become fp16 constants."""

    def __init__(self, var):
        self.v = var

    @property
    def shape(self):
        return tuple(self.v.shape)

    def _bin(self, op, other, swap=False):
        from coremltools.converters.mil import Builder as mb
        y = other.v if isinstance(other, MILTensor) else np.float16(other)
        x, y = (y, self.v) if swap else (self.v, y)
        return MILTensor(getattr(mb, op)(x=x, y=y))

    def __add__(self, o): return self._bin('add', o)
    def __radd__(self, o): return self._bin('add', o, swap=True)
    def __sub__(self, o): return self._bin('sub', o)
    def __rsub__(self, o): return self._bin('sub', o, swap=True)
    def __mul__(self, o): return self._bin('mul', o)
    def __rmul__(self, o): return self._bin('mul', o, swap=True)
    def __truediv__(self, o): return self._bin('real_div', o)


class MILOps:
    """MIL backend of the derivation: every op is one the ANE runs (ANE_NOTES)."""
    recompute_attention = False  # a graph compiler plans its own memory: keep P, skip the recompute

    fused_kernels = False  # the program spells every piece out in the derivation's ops

    def attention_kernel(self, q, k, v):
        return None

    def __init__(self):
        from coremltools.converters.mil import Builder as mb
        self.mb = mb

    def _u(self, op, x, **kw):
        return MILTensor(getattr(self.mb, op)(x=x.v, **kw))

    def fused(self, fn):  # Core ML's compiler fuses the whole program itself
        return fn

    def matmul(self, a, b, ta=False, tb=False):
        return MILTensor(self.mb.matmul(x=a.v, y=b.v, transpose_x=ta, transpose_y=tb))

    def exp(self, x): return self._u('exp', x)
    def log(self, x): return self._u('log', x)
    def tanh(self, x): return self._u('tanh', x)
    def rsqrt(self, x): return self._u('rsqrt', x)
    def sum(self, x, axis, keep=True): return self._u('reduce_sum', x, axes=[axis], keep_dims=keep)
    def mean(self, x, axis): return self._u('reduce_mean', x, axes=[axis], keep_dims=True)
    def max(self, x, axis): return self._u('reduce_max', x, axes=[axis], keep_dims=True)
    def softmax(self, x, axis): return self._u('softmax', x, axis=axis)
    def reshape(self, x, shape): return self._u('reshape', x, shape=list(shape))
    def transpose(self, x, perm): return self._u('transpose', x, perm=list(perm))

    def maximum(self, a, b):
        return MILTensor(self.mb.maximum(x=a.v, y=b.v))

    def causal_mask(self, T):  # constants of the program, as TorchOps' masks
        return MILTensor(self.mb.const(val=np.triu(np.full((T, T), -1e4, np.float16), 1)))

    def pad_mask(self, n, valid):
        return MILTensor(self.mb.const(val=np.where(np.arange(n) < valid, 0, -1e4).astype(np.float16)))


def import_coremltools():
    """coremltools, imported quietly: off macOS it warns that its Core ML runtime is
    missing, which is expected here (we only build, save and read programs)."""
    import logging
    if not ON_MAC:
        logging.getLogger('coremltools').setLevel(logging.ERROR)
    import coremltools
    return coremltools


PROGRAM_FORMAT = 3  # bump when the program's inputs, outputs or metadata change (3: bias in the metadata)


def build_coreml_program(cfg, B, T):
    """dense_step(MILOps) as a MIL Program: inputs dense_input_shapes(cfg, B, T) in fp16,
    outputs 'loss' (1, 1) and 'd_<input>' for every input but loss_scale."""
    ct = import_coremltools()
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types
    check_ane_shapes(cfg, B, T)
    shapes = dense_input_shapes(cfg, B, T)
    placeholders = {k: mb.placeholder(shape=s, dtype=types.fp16) for k, s in shapes.items()}
    with Function(placeholders, opset_version=ct.target.macOS13) as fn:
        loss, grads = dense_step(MILOps(), cfg, B, T, {k: MILTensor(v) for k, v in fn.inputs.items()})
        fn.set_outputs([mb.identity(x=loss.v, name='loss')] +
                       [mb.identity(x=grads[k].v, name='d_' + k) for k in shapes if k != 'loss_scale'])
    prog = Program()
    prog.add_function('main', fn)
    return prog


def check_ane_shapes(cfg, B, T):
    if B * T > ANE_MAX_DIM:
        raise UserError(f"microbatch of {B}x{T} = {B * T} tokens: the ANE program keeps tokens on one "
                        f"axis, which must be at most {ANE_MAX_DIM}; use a smaller --microbatch")
    if T > cfg.block_size:
        raise UserError(f"sequence length {T} is longer than block_size {cfg.block_size}")


def package_meta(cfg, B, T):
    return dict(format=PROGRAM_FORMAT, microbatch=B, seq_len=T, **dataclasses.asdict(cfg))


def export_coreml(cfg, B, T, path):
    """Builds the program and saves it as an .mlpackage at `path` (atomically: a crash
    leaves no half-written package under that name)."""
    import shutil
    ct = import_coremltools()
    prog = build_coreml_program(cfg, B, T)
    model = ct.convert(prog, convert_to='mlprogram', compute_precision=ct.precision.FLOAT16,
                       minimum_deployment_target=ct.target.macOS13, skip_model_load=True)
    model.user_defined_metadata['heterogpt'] = json.dumps(package_meta(cfg, B, T))
    model.short_description = f"HeteroEngine GPT-2 training step, microbatch {B}x{T}"
    tmp = path.rstrip('/') + '.tmp.mlpackage'  # coremltools insists on the extension
    shutil.rmtree(tmp, ignore_errors=True)
    model.save(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def read_package_meta(path):
    ct = import_coremltools()
    if not os.path.isdir(path):
        raise UserError(f"no Core ML package at {path}: make one with `python export_ane.py --out {path}`")
    try:
        spec = ct.utils.load_spec(path)
        return spec, json.loads(spec.description.metadata.userDefined['heterogpt'])
    except Exception as e:
        raise UserError(f"{path} is not a HeteroEngine Core ML package ({e}); re-export it with export_ane.py")


def load_coreml_program(path):
    """The saved package read back into a MIL Program (works on Linux)."""
    ct = import_coremltools()
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
    model = ct.models.MLModel(path, skip_model_load=True)
    spec = model.get_spec()
    return milproto_load(spec, specification_version=spec.specificationVersion,
                         file_weights_dir=model.weights_dir or '')


def numpy_predict(prog):
    """A stand-in for Core ML's predict off macOS: evaluates the program op by op in NumPy,
    each op's result rounded to the dtype the program declares (fp16 here), through the
    ops' own value_inference. Slow; for checking the program, not for training."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, types
    f = prog.functions['main']

    def plain(v):  # NumPy 2: loaded bool params are np.bool_, which reductions reject
        return bool(v) if isinstance(v, np.bool_) or (isinstance(v, np.ndarray) and v.dtype == np.bool_ and v.ndim == 0) else v

    def matmul(kw):  # fp16 operands, fp32 accumulation (as the ANE), fp16 result; and fast
        x, y = kw['x'].astype(np.float32), kw['y'].astype(np.float32)
        x = np.swapaxes(x, -1, -2) if kw.get('transpose_x') else x
        y = np.swapaxes(y, -1, -2) if kw.get('transpose_y') else y
        return (x @ y,)

    def predict(inputs):
        env = {}
        for name, var in f.inputs.items():
            a = np.asarray(inputs[name]).astype(types.nptype_from_builtin(var.dtype))
            if a.shape != tuple(var.shape):
                raise ValueError(f"input {name}: shape {a.shape}, program expects {tuple(var.shape)}")
            env[name] = a

        def val(v):
            return env[v.name] if v.name in env else v.val
        with Function({}, opset_version=f.opset_version):
            for op in f.operations:
                if op.op_type == 'const':
                    env[op.outputs[0].name] = op.outputs[0].val
                    continue
                kw = {k: [plain(val(x)) for x in v] if isinstance(v, (list, tuple)) else plain(val(v))
                      for k, v in op.inputs.items()}
                if op.op_type == 'matmul':
                    res = matmul(kw)
                else:
                    new = mb._add_op(type(op), name=op.name, **kw)  # runs the op's value_inference
                    res = tuple(o.val for o in (new if isinstance(new, (list, tuple)) else [new]))
                    if any(r is None for r in res):
                        raise NotImplementedError(f"no NumPy evaluation for MIL op {op.op_type}")
                for o, r in zip(op.outputs, res):
                    env[o.name] = np.asarray(r).astype(types.nptype_from_builtin(o.dtype))
        return {o.name: env[o.name] for o in f.outputs}
    return predict


def coreml_predict_fn(path):
    """THE macOS SEAM: Core ML's predict on CPU + Neural Engine. Everything else in this
    file runs anywhere. Off macOS we evaluate the saved program in NumPy instead."""
    if ON_MAC:
        ct = import_coremltools()
        return ct.models.MLModel(path, compute_units=ct.ComputeUnit.CPU_AND_NE).predict
    return numpy_predict(load_coreml_program(path))


class CoreMLEngine:
    """The ANE engine: the saved Core ML program, fed by the host's sparse work."""
    name, stream = 'ane', None
    device = torch.device('cpu')

    def __init__(self, path, predict=None, config=None, microbatch=None, scaler=None):
        _, meta = read_package_meta(path)
        if meta.get('format') != PROGRAM_FORMAT:
            raise UserError(f"{path} was exported by another version of HeteroEngine; re-export it")
        self.path, self.B, self.T = path, meta['microbatch'], meta['seq_len']
        self.cfg = GPTConfig(**{f.name: meta[f.name] for f in dataclasses.fields(GPTConfig)})
        self.check(config, microbatch)
        self.predict = predict or coreml_predict_fn(path)
        self.holds_gil = predict is None and ON_MAC  # Core ML's predict does (ANE_NOTES)
        self.scaler = scaler or LossScaler(1.0, 0, enabled=False)
        self.w, self.keep = None, None
        self.label = f"Core ML program {os.path.basename(path)}" + ('' if ON_MAC else ' (NumPy evaluator)')

    def check(self, config=None, microbatch=None):
        """Refuses a model configuration or microbatch shape other than the exported one."""
        c, (b, t) = config or self.cfg, tuple(microbatch or (self.B, self.T))
        if (c, b, t) != (self.cfg, self.B, self.T):
            raise UserError(
                f"{self.path} was exported for {self.cfg} and microbatch {self.B}x{self.T}, not {c} and {b}x{t}: "
                f"re-export with `python export_ane.py --n_layer {c.n_layer} --n_head {c.n_head} --n_embd {c.n_embd} "
                f"--block_size {c.block_size} --vocab_size {c.vocab_size} --bias {c.bias} --microbatch {b} --seq_len {t} "
                f"--out {self.path}`")

    def load_weights(self, params):
        # fp16 copies of the weights, refreshed once per step into the same buffers
        if self.w is None:  # first call: are these the weights of the exported model?
            try:
                self.check(config=config_from_params(params, n_head=self.cfg.n_head))
            except ValueError as e:
                raise UserError(f"{self.path}: {e}; re-export it with export_ane.py for this model") from None
        w = host_weights({k: p.detach() for k, p in params.items()}, self.cfg)
        if self.w is None:
            self.w = {k: np.empty(tuple(v.shape), np.float16) for k, v in w.items()}
        for k, v in w.items():
            np.copyto(self.w[k], v.float().cpu().numpy(), casting='same_kind')
        self.wte = params['transformer.wte.weight'].detach().float().cpu()
        self.wpe = params['transformer.wpe.weight'].detach().float().cpu()

    def loss_and_grads(self, idx, targets):
        if tuple(idx.shape) != (self.B, self.T):
            self.check(microbatch=tuple(idx.shape))
        idx, targets = idx.cpu(), targets.cpu()
        batch = host_batch(self.wte, self.wpe, self.cfg, idx, targets, self.scaler.scale)
        inputs = dict(self.w, **{k: v.numpy().astype(np.float16) for k, v in batch.items()})
        # Core ML frees input buffers later, on its own queue: keep this microbatch's
        # arrays alive until the next call (ANE_NOTES; coremltools #2827, #2829)
        self.keep = inputs
        out = self.predict(inputs)
        g = {k[2:]: torch.from_numpy(np.asarray(v, np.float32)) for k, v in out.items() if k.startswith('d_')}
        loss = torch.tensor(float(np.asarray(out['loss']).reshape(-1)[0]))
        return loss, host_grads(g, self.cfg, idx, targets, self.scaler.scale, torch.float32)

    def synchronize(self):
        pass


def ensure_coreml_package(cfg, log=print):
    """The package --mode ane/hetero needs: reused if one exported for this configuration
    exists, else exported now."""
    mcfg = model_config(cfg)
    path = cfg.ane_package or os.path.join(cfg.out_dir, f'ane_B{cfg.batch_size}_T{cfg.block_size}.mlpackage')
    if os.path.isdir(path):
        _, meta = read_package_meta(path)
        if meta == package_meta(mcfg, cfg.batch_size, cfg.block_size):
            return path
        log(f"{path} was exported for other shapes: exporting again")
    log(f"exporting the Core ML training program to {path} ...")
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    export_coreml(mcfg, cfg.batch_size, cfg.block_size, path)
    return path

# -----------------------------------------------------------------------------
# 5. Engines. Each computes (loss, grads) for one microbatch from the current weights:
#   loss_and_grads(idx, targets) -> (0-dim loss tensor, {param name: gradient}), fp32
#   (fp64 in fp64 runs) tensors of the caller's own: the concurrent step sums into them,
# and has name, label, device, stream (its own CUDA stream, or None), holds_gil, scaler
# (a LossScaler), load_weights(params) (once per step) and synchronize().
# AutogradEngine: nanoGPT's model + autograd (the GPU: MPS or CUDA; or the CPU).
# EagerEngine:    the derivation above run by PyTorch, no autograd. Off a Mac it stands
#                 in for the ANE, in fp16 by default so its arithmetic is the ANE's; on
#                 CUDA its step is one CUDA graph, replayed, as the ANE runs one program.
# CoreMLEngine:   the derivation as a Core ML program on the ANE (section 4).


def engine_stream(device):
    """The eager engine on a CUDA device gets its own stream, so that with the autograd
    engine on the same GPU (which uses the default stream, where the optimizer updates the
    weights) the two overlap instead of queueing behind each other."""
    return torch.cuda.Stream(device) if device.type == 'cuda' else None


def on_stream(stream):
    """Make an engine's own stream the current one (nothing to do without one)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class AutogradEngine:
    name, holds_gil = 'gpu', False

    def __init__(self, model, device, dtype, compile=False, scaler=None):
        self.model, self.device, self.stream = model, device, None  # the default stream
        self.forward = torch.compile(model) if compile else model
        # bf16/fp16: autocast over fp32 master weights; fp32/fp64: the weights' own dtype
        self.autocast = (torch.autocast(device.type, dtype=dtype) if dtype in (torch.bfloat16, torch.float16)
                         else contextlib.nullcontext())
        self.params = list(model.named_parameters())
        # fp16 autocast needs a loss scale, as the fp16 ANE engine does; bf16 and fp32 don't
        self.scaler = scaler if dtype == torch.float16 and scaler else LossScaler(1.0, 0, enabled=False)
        self.label = f"autograd on {device} ({str(dtype).replace('torch.', '')})"

    def load_weights(self, params):
        pass  # this engine's model *is* the master copy of the weights

    def loss_and_grads(self, idx, targets):
        for _, p in self.params:
            p.grad = None
        with self.autocast:  # the forward only: backward ops take their forward's dtypes
            _, loss = self.forward(idx.to(self.device, non_blocking=True),
                                   targets.to(self.device, non_blocking=True))
        if self.scaler.enabled:  # unscale in fp32: the master weights' gradients are fp32
            (loss * self.scaler.scale).backward()
            return loss.detach(), {n: p.grad / self.scaler.scale for n, p in self.params}
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in self.params}

    def synchronize(self):
        # its own work only: the default stream, not the whole device, which may also be
        # running the eager engine's stream
        device_synchronize(self.device, torch.cuda.current_stream(self.device) if self.device.type == 'cuda' else None)


class EagerEngine:
    name, holds_gil = 'ane', False

    def __init__(self, cfg, device, dtype, scaler, compile=False, graph_shape=None, fused_kernels=False):
        self.cfg, self.device, self.dtype, self.scaler, self.compile = cfg, device, dtype, scaler, compile
        self.fused_kernels = fused_kernels
        self.w, self.staging, self.stream = None, None, engine_stream(device)
        # On CUDA the whole step (B, T = graph_shape) is captured once as a CUDA graph and
        # replayed for every microbatch: one launch where eager PyTorch makes ~100 per
        # layer from Python. It is this stand-in's counterpart of the compiled Core ML
        # program, and it leaves the Python thread (the GIL) to the GPU engine, whose
        # kernel launches come from Python too: with both engines launching, each waits
        # for the other's turn at the interpreter.
        self.graph_shape = graph_shape if device.type == 'cuda' and not compile else None
        self.graph = None
        self.label = f"eager derivation on {device} ({str(dtype).replace('torch.', '')}" + \
                     (", CUDA graph" if self.graph_shape else "") + (", fused kernels)" if fused_kernels else ")")

    @torch.no_grad()
    def load_weights(self, params):
        # once per step, into one flat buffer (and views of it) reused across steps.
        # The optimizer updated the weights on their GPU's default stream: this engine's stream
        # waits for that here, once, and not later, when the default stream is busy with
        # the GPU engine's work, which this engine must overlap, not wait for.
        src = next(iter(params.values())).device  # the master weights' device (maybe another GPU)
        if self.w is None:
            self.flat, views = flat_buffer(params.values(), self.dtype, self.device)
            self.w = dict(zip(params, views))
            if self.flat.device != src:  # tensors' devices: 'cuda' is 'cuda:0' here
                self.staging, self.staging_w = flat_buffer(params.values(), self.dtype, src)
        if self.stream is not None and src.type == 'cuda':
            self.stream.wait_stream(torch.cuda.current_stream(src))
        with on_stream(self.stream):
            if self.staging is None:  # one fused copy (and cast) of every tensor
                torch._foreach_copy_(list(self.w.values()), list(params.values()))
            else:  # another device: cast where the weights are, then move half the bytes in one copy
                torch._foreach_copy_(self.staging_w, list(params.values()))
                self.flat.copy_(self.staging)
        if self.graph_shape and self.graph is None:
            try:
                self.capture()
            except RuntimeError as e:  # e.g. out of memory: run op by op instead
                self.graph, self.graph_shape = None, None
                self.label = self.label.replace(', CUDA graph', '')
                print(f"{self.label}: CUDA graph capture failed ({e}); running the step op by op")

    def capture(self):
        B, T = self.graph_shape
        self.g_idx = torch.zeros((B, T), dtype=torch.long, device=self.device)
        self.g_tgt = torch.zeros_like(self.g_idx)
        self.g_scale = torch.ones((), dtype=torch.float32, device=self.device)
        run = lambda: eager_loss_and_grads(self.cfg, self.w, self.g_idx, self.g_tgt, self.dtype, self.device,
                                           self.g_scale, fused_kernels=self.fused_kernels)
        with on_stream(self.stream):
            run()  # once outside the capture: cuBLAS picks its kernels and workspaces
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode='thread_local'):
            self.g_out = run()

    def loss_and_grads(self, idx, targets):
        """(loss, grads), tensors of the caller's own: under a CUDA graph, copies of the
        graph's output buffers, which the next replay overwrites."""
        with on_stream(self.stream):
            if self.graph is None or tuple(idx.shape) != self.graph_shape:
                return eager_loss_and_grads(self.cfg, self.w, idx.to(self.device), targets.to(self.device),
                                            self.dtype, self.device, self.scaler.scale, self.compile,
                                            self.fused_kernels)
            self.g_idx.copy_(idx)
            self.g_tgt.copy_(targets)
            self.g_scale.fill_(self.scaler.scale)
            self.graph.replay()
            loss, grads = self.g_out
            return loss.clone(), {k: v.clone() for k, v in grads.items()}

    def synchronize(self):
        device_synchronize(self.device, self.stream)


def flat_buffer(like, dtype, device):
    """One flat tensor and views of it shaped like the tensors in `like`."""
    like = list(like)
    flat = torch.empty(sum(t.numel() for t in like), dtype=dtype, device=device)
    return flat, unflatten(flat, like)


def unflatten(flat, like):
    """Views of the 1-D `flat`, shaped like the tensors in `like`, one after another."""
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in like]), like)]


def device_synchronize(device, stream=None):
    if stream is not None:
        stream.synchronize()
    elif device.type == 'cuda':
        torch.cuda.synchronize(device)
    elif device.type == 'mps':
        torch.mps.synchronize()


class LossScaler:
    """Dynamic loss scaling for an fp16 engine: the backward is seeded with `scale`, so
    small gradients do not flush to zero in fp16; the host divides it back out. After
    `window` finite steps in a row the scale doubles; a non-finite step halves it."""

    def __init__(self, scale, window, enabled=True):
        self.scale = float(scale) if enabled else 1.0
        self.window, self.enabled, self.good = window, enabled, 0

    def update(self, finite):
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good = max(self.scale / 2, 1.0), 0
        else:
            self.good += 1
            if self.good >= self.window:
                self.scale, self.good = min(self.scale * 2, 2.0 ** 24), 0


# -----------------------------------------------------------------------------
# 6. The concurrent step: both engines, one AdamW update.


class Split:
    """How many of a step's n microbatches go to the ANE engine. Fixed (`fraction`), or
    auto: from each engine's measured seconds per microbatch (smoothed), give each a share
    proportional to its speed, so that both finish together."""

    def __init__(self, n, fraction='auto'):
        self.n, self.auto = n, fraction == 'auto'
        self.k = n // 2 if self.auto else round(float(fraction) * n)
        self.sec = {}  # engine name -> smoothed seconds per microbatch
        self.steps = 0

    def current(self, alive):
        """The ANE's share of the microbatches, given which engines are alive."""
        return 0 if alive == {'gpu'} else self.n if alive == {'ane'} else self.k

    def assign(self, alive):
        """The ANE's share for the next step. In auto mode, every 20th step gives each
        engine at least one microbatch, so one the split left idle is measured again,
        unless one microbatch of it took longer than two whole steps of the other."""
        self.steps += 1
        k = self.current(alive)
        if self.auto and len(alive) == 2 and self.n >= 2 and self.steps % 20 == 0:
            worth = lambda idle, busy: self.sec.get(idle, 0) <= 2 * self.n * self.sec.get(busy, 0)
            if k == 0 and worth('ane', 'gpu'):
                k = 1
            elif k == self.n and worth('gpu', 'ane'):
                k = self.n - 1
        return k

    def observe(self, seconds_per_mb):
        for name, s in seconds_per_mb.items():
            self.sec[name] = s if name not in self.sec else 0.5 * self.sec[name] + 0.5 * s
        if self.auto and len(self.sec) == 2:
            r_gpu, r_ane = 1 / self.sec['gpu'], 1 / self.sec['ane']
            self.k = min(self.n, max(0, round(self.n * r_ane / (r_gpu + r_ane))))

    def state_dict(self):
        return dict(k=self.k, sec=self.sec, steps=self.steps)

    def load_state_dict(self, s):
        self.k, self.sec, self.steps = s['k'], s['sec'], s['steps']


def to_host_later(t):
    """Start copying a small CUDA tensor to pinned host memory and return (copy, event): the
    host waits on the event when it needs the values, not for everything queued after it."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def run_engine(engine, microbatches, out, wait_for=None, enqueued=None, defer=False):
    """Thread body: forward+backward of each microbatch, gradients summed. defer: leave the
    loss and the finiteness flag on the device, unread (see HeteroStep.update)."""
    try:
        if wait_for is not None:
            wait_for.wait(timeout=60)
        t0 = time.perf_counter()
        acc, loss = None, 0.0
        # Everything below runs on the engine's own stream, the sums too: a kernel on
        # another stream (this thread's default one) would read the gradients before the
        # engine's stream has finished writing them. CUDA orders work within a stream only.
        with on_stream(engine.stream):
            for i, (idx, targets) in enumerate(microbatches):
                l, g = engine.loss_and_grads(idx, targets)
                if acc is None:
                    # fp32 (fp64 in fp64 runs). No copy needed: every call returns gradient
                    # tensors of its own, which the sums may then be added into.
                    acc = g
                else:
                    torch._foreach_add_(list(acc.values()), list(g.values()))  # one launch
                loss = loss + l.float()  # a tensor: no wait for the device until the end
                if enqueued is not None and i == 0:
                    enqueued.set()
            finite = all_finite(acc | {'loss': loss})
        if defer:  # on their way to the host, read after the update is queued (HeteroStep.update)
            out['pending'] = to_host_later(torch.stack([loss.float(), finite.float()]))
        else:  # one wait for the device, then the loss and the flag are the host's
            engine.synchronize()
            loss, finite = float(loss), bool(finite)
        out.update(grads=acc, loss=loss, n=len(microbatches), t0=t0,
                   seconds=time.perf_counter() - t0, finite=finite)
    except Exception as e:  # reported by the caller; training goes on with the other engine
        out['error'] = e
    finally:
        if enqueued is not None:
            enqueued.set()


class HeteroStep:
    """One optimizer step over a list of microbatches, on one or both engines.

    Both engines start from the same weights (the ANE engine's copy is refreshed here,
    once per step), run in their own threads, and return summed gradients. All
    microbatches have B*T tokens, so the token-weighted mean is the sum over both engines
    divided by the count of microbatches that contributed. An engine whose gradients are
    not finite (fp16 overflow) is left out of that step: the mean is then over the other
    engine's microbatches alone, and is still an unbiased gradient. An engine that raises
    is retired, and its share of the step is run by the other one. update() then clips the
    mean gradient and takes the AdamW step."""

    def __init__(self, model, engines, split, log=print, optimizer=None):
        self.model, self.engines, self.split, self.log = model, engines, split, log
        self.optimizer = optimizer
        # With one engine and no loss scale there is nothing for the host to decide per
        # engine, so it need not wait for the device before the update: fused AdamW takes
        # the finiteness flag as a tensor (found_inf) and skips a bad step on the device.
        # Waiting there instead leaves the GPU idle while Python launches the update (on an
        # H200, GPT-2 124M, beside the host check: a difference within the benchmark's noise).
        self.can_defer = optimizer is not None and bool(optimizer.defaults.get('fused'))
        self.params = dict(model.named_parameters())
        self.alive = set(engines)
        # one long-lived thread per engine: a new thread every step would pay CUDA's
        # per-thread set-up (cuBLAS handles, workspaces) every step
        self.threads = {name: ThreadPoolExecutor(1, thread_name_prefix=name) for name in engines}
        self.dropped = {name: 0 for name in engines}  # steps an engine's grads were not used
        self.skipped = 0  # steps with no usable gradient at all (no update)

    def __call__(self, microbatches):
        """Gradients into p.grad; then update(out) takes the AdamW step and completes `out`
        (with one engine and no loss scale, its loss is read only there)."""
        k = self.split.assign(self.alive)
        shares = {'gpu': microbatches[k:], 'ane': microbatches[:k]}
        for name in self.alive:
            if name != 'gpu' and shares[name]:
                self.engines[name].load_weights(self.params)
        # Core ML's predict holds the GIL for its whole call (ANE_NOTES). While it runs,
        # the GPU thread cannot run Python, but kernels it has already enqueued keep the
        # GPU busy and loss.backward() runs in C++ without the GIL. So the GPU thread
        # starts first and the ANE thread waits until the GPU has enqueued its first
        # microbatch's forward and backward; then both accelerators are busy at once.
        working = sorted((n for n in self.alive if shares[n]), key=lambda n: n != 'gpu')
        results = {name: {} for name in working}
        if len(working) == 1:  # one engine: run it right here, no thread to hand off to
            engine = self.engines[working[0]]  # (on the default stream: AdamW reads it in order)
            run_engine(engine, shares[working[0]], results[working[0]],
                       defer=self.can_defer and not engine.scaler.enabled and engine.stream is None)
        else:
            enqueued = threading.Event()
            gil_bound = any(self.engines[n].holds_gil for n in working)
            futures = [self.threads[name].submit(run_engine, self.engines[name], shares[name], results[name],
                                                 enqueued if name != 'gpu' and gil_bound else None,
                                                 enqueued if name == 'gpu' else None) for name in working]
            for f in futures:
                f.result()
        self._recover(results, shares)
        return self._combine(results)

    def _recover(self, results, shares):
        """An engine that raised is reported once and retired; the other engine then runs
        its microbatches too, so the step still averages over its whole batch."""
        failed = [n for n, r in results.items() if 'error' in r]
        self.alive -= set(failed)
        for name in failed:
            error = results.pop(name)['error']
            self.dropped[name] += 1
            self.log(f"engine '{name}' ({self.engines[name].label}) failed: {error!r}; "
                     f"continuing with {sorted(self.alive) or 'nothing'}")
            if not self.alive:
                raise RuntimeError("both engines failed") from error
            other = next(iter(self.alive))
            if other != 'gpu' and not shares[other]:  # it had no share, so no weights of this step
                self.engines[other].load_weights(self.params)
            redo = {}
            run_engine(self.engines[other], shares[name], redo)
            if 'error' in redo:
                raise RuntimeError("both engines failed") from redo['error']
            r = results.setdefault(other, redo)
            if r is not redo:  # add the re-run microbatches to the other engine's sums
                for k, v in redo['grads'].items():
                    r['grads'][k] += v.to(r['grads'][k].device)
                r['loss'] += redo['loss']
                r['n'] += redo['n']
                r['finite'] = r['finite'] and redo['finite']

    def _combine(self, results):
        used, found_inf = {}, None
        for name, r in results.items():
            if torch.is_tensor(r['finite']):  # deferred (one engine): the update decides, on the device
                used[name], found_inf = r, (~r['finite']).float()
                continue
            eng = self.engines[name]
            eng.scaler.update(r['finite'])
            if r['finite']:
                used[name] = r
            else:
                self.dropped[name] += 1
        if len(results) == 2:
            self.split.observe({n: r['seconds'] / r['n'] for n, r in results.items()})
        n = sum(r['n'] for r in used.values())
        if n == 0:
            self.skipped += 1
            return dict(loss=float('nan'), used=[], results=results, found_inf=None)
        master = next(iter(self.params.values())).device
        total = None
        for r in used.values():  # the engines' sums are their own buffers: added to in place
            g = [r['grads'][pn] for pn in self.params]
            if g[0].device != master:  # another device: one transfer of one flat buffer
                g = unflatten(torch.cat([t.reshape(-1) for t in g]).to(master), g)
            if total is None:
                total = g
            else:
                torch._foreach_add_(total, g)
        if n > 1:
            torch._foreach_div_(total, float(n))
        for p, g in zip(self.params.values(), total):
            p.grad = g.to(p.dtype)
        if master.type == 'cuda' and any(self.engines[n].stream is not None for n in used):
            # an engine's gradient buffers were made on its own stream and are freed after
            # this step: let the default stream finish reading them before they are reused
            torch.cuda.current_stream(master).synchronize()
        return dict(loss=sum(r['loss'] for r in used.values()) / n, used=sorted(used), results=results,
                    found_inf=found_inf)

    def update(self, out, grad_clip=0.0):
        """The step's one AdamW update from the mean gradient (clipped to norm grad_clip
        when > 0), unless no engine's gradient was usable. Then the gradients are freed."""
        if out['used']:
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params.values(), grad_clip)
            if out['found_inf'] is not None:  # fused AdamW skips its update where found_inf is 1
                self.optimizer.found_inf = out['found_inf']
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.found_inf
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for r in out['results'].values():  # the sums are in p.grad or freed: not held into the next step
            r.pop('grads', None)
        if out['found_inf'] is not None:  # now, with the update queued, the host reads what it deferred
            (name, r), = out['results'].items()
            host, done = r.pop('pending')
            if done is not None:
                done.synchronize()  # the backward and the check, not the update behind them
            r['seconds'] = time.perf_counter() - r['t0']
            loss, finite = host.tolist()
            r['finite'], r['loss'] = finite == 1.0, loss
            out['found_inf'] = None
            if r['finite']:
                out['loss'] = r['loss'] / r['n']
            else:
                self.dropped[name] += 1
                self.skipped += 1
                out.update(loss=float('nan'), used=[])
        return out


# -----------------------------------------------------------------------------
# 7. Energy meters: joules() is the energy used so far (None where nothing is readable).


class NvmlMeter:
    """NVIDIA GPUs: NVML's total-energy counter (millijoules), read through ctypes."""

    def __init__(self, index=0):
        import ctypes
        self.ct = ctypes
        self.lib = ctypes.CDLL('libnvidia-ml.so.1')
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) != 0:
            raise OSError(f"no NVML device {index}")
        self.name = f"NVML (GPU {index})"
        self.joules()

    def joules(self):
        mj = self.ct.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, self.ct.byref(mj)) != 0:
            raise OSError("NVML energy counter unsupported")
        return mj.value / 1000.0


class RaplMeter:
    """Linux CPUs: RAPL package counters in /sys/class/powercap (microjoules, wrapping)."""

    def __init__(self):
        root = '/sys/class/powercap'
        self.zones = [os.path.join(root, z) for z in sorted(os.listdir(root))
                      if z.count(':') == 1 and z.startswith('intel-rapl')]
        if not self.zones:
            raise OSError("no RAPL zones")
        self.last = [self._read(z, 'energy_uj') for z in self.zones]  # raises if unreadable
        self.wrap = [self._read(z, 'max_energy_range_uj') for z in self.zones]
        self.total, self.name = 0.0, f"RAPL ({len(self.zones)} CPU packages)"

    @staticmethod
    def _read(zone, f):
        with open(os.path.join(zone, f)) as fh:
            return int(fh.read())

    def joules(self):
        for i, z in enumerate(self.zones):
            now = self._read(z, 'energy_uj')
            self.total += ((now - self.last[i]) % self.wrap[i]) / 1e6
            self.last[i] = now
        return self.total


class PowermetricsMeter:
    """macOS: CPU, GPU and ANE power sampled by powermetrics (needs root: sudo), integrated
    over time in a background thread."""

    def __init__(self, interval_ms=200):
        import re
        import subprocess
        self.proc = subprocess.Popen(
            ['sudo', '-n', 'powermetrics', '--samplers', 'cpu_power,gpu_power,ane_power',
             '-i', str(interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.dt, self.total, self.name = interval_ms / 1000, 0.0, "powermetrics (CPU+GPU+ANE)"
        self.pattern = re.compile(r'^(CPU|GPU|ANE) Power: (\d+) mW')
        first = threading.Event()

        def reader():
            for line in self.proc.stdout:
                m = self.pattern.match(line)
                if m:
                    self.total += int(m.group(2)) / 1000 * self.dt
                    first.set()
        threading.Thread(target=reader, daemon=True).start()
        if not first.wait(5):
            self.proc.kill()
            raise OSError("powermetrics gave no samples (run with sudo rights)")

    def joules(self):
        return self.total


class EnergyMeter:
    """The sum of every meter that works here: powermetrics on macOS, NVML for each CUDA
    device in use, RAPL when any engine runs on the CPU."""

    def __init__(self, devices):
        self.meters, self.missing = [], []
        kinds = []
        if ON_MAC:
            kinds.append(PowermetricsMeter)
        for d in sorted({d for d in devices if d.type == 'cuda'}, key=str):
            kinds.append(lambda i=(d.index or 0): NvmlMeter(i))
        if any(d.type == 'cpu' for d in devices) and not ON_MAC:
            kinds.append(RaplMeter)
        for make in kinds:
            try:
                self.meters.append(make())
            except Exception as e:
                self.missing.append(f"{getattr(make, '__name__', 'NVML')}: {e}")
        self.name = ' + '.join(m.name for m in self.meters) or 'none'

    def joules(self):
        return sum(m.joules() for m in self.meters) if self.meters else None


# -----------------------------------------------------------------------------
# 8. The training loop.


def resolve_device(name):
    if name == 'auto':
        if torch.backends.mps.is_available():
            return torch.device('mps')
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == 'cuda' and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but PyTorch sees no CUDA GPU")
    if dev.type == 'mps' and not torch.backends.mps.is_available():
        raise UserError("--device mps asked for, but MPS is not available")
    return dev


def resolve_dtype(name, device):
    if name == 'auto':
        return torch.bfloat16 if device.type == 'cuda' else torch.float32
    dtypes = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16,
              'float64': torch.float64}
    if name not in dtypes:
        raise UserError(f"unknown dtype {name!r}: use one of {', '.join(dtypes)}")
    return dtypes[name]


def load_data(cfg):
    """train/val token arrays (uint16 memmaps); prepares a known data set if missing."""
    folder = os.path.join(cfg.data_dir, cfg.dataset)
    if not os.path.exists(os.path.join(folder, 'meta.json')):
        import prepare_data
        if cfg.dataset not in prepare_data.DATASETS:
            raise UserError(f"no data set at {folder}/ ; make one with "
                            f"`python prepare_data.py --input FILE --name {cfg.dataset}`")
        print(f"{folder}/ is missing: running `python prepare_data.py {cfg.dataset}` first")
        try:
            prepare_data.prepare(cfg.dataset, data_dir=cfg.data_dir)
        except prepare_data.DataError as e:
            raise UserError(str(e)) from None
    data = {}
    with open(os.path.join(folder, 'meta.json')) as f:
        meta = json.load(f)
    for split in ('train', 'val'):
        path = os.path.join(folder, f'{split}.bin')
        size = os.path.getsize(path) if os.path.exists(path) else -1
        if size != 2 * meta.get(f'{split}_tokens', -2):
            raise UserError(f"{path} is missing or does not match meta.json (a broken or interrupted "
                            f"preparation?): run `python prepare_data.py {cfg.dataset}` again")
        data[split] = np.memmap(path, dtype=np.uint16, mode='r')
        if len(data[split]) < cfg.block_size + 2:
            raise UserError(f"block_size={cfg.block_size} is larger than the {split} split "
                            f"({len(data[split])} tokens): lower --block_size")
    if meta.get('vocab_size', cfg.vocab_size) > cfg.vocab_size:
        raise UserError(f"data set has vocab_size {meta['vocab_size']} > model's {cfg.vocab_size}")
    return data


def get_batch(data, n, T, rng):
    """n random windows of T+1 tokens: inputs and next-token targets, int64 on the CPU."""
    ix = rng.integers(0, len(data) - T - 1, n)
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    return xy[:, :-1], xy[:, 1:]


def step_batches(cfg, data, it):
    """The step's microbatches. Seeded by (seed, step), so every mode, split and resume
    sees the same batches at the same step."""
    x, y = get_batch(data, cfg.batch_size * cfg.gradient_accumulation_steps, cfg.block_size,
                     np.random.default_rng((cfg.seed, it)))
    return list(zip(x.split(cfg.batch_size), y.split(cfg.batch_size)))


@torch.no_grad()
def evaluate(model, engine, cfg, data):
    """Mean validation loss: over eval_iters fixed random batches, or with eval_iters=0
    over the whole validation split in consecutive windows (every token predicted once)."""
    model.eval()
    T, losses, weights = cfg.block_size, [], []
    if cfg.eval_iters > 0:
        rng = np.random.default_rng((cfg.seed, 2**32 - 1))  # not a training step's seed
        batches = [get_batch(data, cfg.batch_size, T, rng) for _ in range(cfg.eval_iters)]
    else:
        xy = torch.from_numpy(data[:(len(data) - 1) // T * T + 1].astype(np.int64))
        x, y = xy[:-1].view(-1, T), xy[1:].view(-1, T)
        batches = list(zip(x.split(cfg.batch_size), y.split(cfg.batch_size)))
    for x, y in batches:
        with engine.autocast:
            _, loss = model(x.to(engine.device), y.to(engine.device))
        losses.append(loss.float() * x.numel())
        weights.append(x.numel())
    model.train()
    return float(sum(losses)) / sum(weights)


def get_lr(cfg, it):
    """Linear warm-up, then cosine decay to min_lr at max_iters."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    ratio = min(1.0, (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model, cfg, device):
    """AdamW, nanoGPT's groups: weight decay on 2-D weights, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': cfg.weight_decay},
              {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                             fused=device.type == 'cuda')


def save_checkpoint(path, obj):
    """Atomic: a crash mid-write leaves the previous checkpoint intact."""
    tmp = path + '.tmp'
    torch.save(obj, tmp)
    os.replace(tmp, path)


def model_config(cfg):
    return GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, bias=cfg.bias)


def build_engines(cfg, model, device, dtype, mode, log=print):
    """The engines a mode needs: {'gpu': ..., 'ane': ...}."""
    engines = {}
    if mode in ('gpu', 'hetero'):
        engines['gpu'] = AutogradEngine(model, device, dtype, cfg.compile,
                                        scaler=LossScaler(cfg.loss_scale, cfg.scale_window))
    if mode in ('ane', 'hetero'):
        scaler = LossScaler(cfg.loss_scale, cfg.scale_window)
        if ON_MAC:
            engines['ane'] = CoreMLEngine(ensure_coreml_package(cfg, log), model.config, scaler=scaler)
        else:
            ane_dev = device if cfg.ane_device == 'auto' else resolve_device(cfg.ane_device)
            engines['ane'] = EagerEngine(model.config, ane_dev, resolve_dtype(cfg.ane_dtype, ane_dev), scaler,
                                         cfg.compile, graph_shape=(cfg.batch_size, cfg.block_size),
                                         fused_kernels=cfg.fused_kernels)
            if mode == 'hetero' and ane_dev.type == 'cpu' and device.type != 'cpu':
                # the CPU engine would take every core; leave one to the thread that feeds the
                # GPU, whose kernel launches would otherwise wait behind the CPU's math
                torch.set_num_threads(max(1, CPU_THREADS - 1))
            log(f"not on macOS: the ANE engine is the {engines['ane'].label}")
    return engines


def build_run(cfg, device, dtype, mode, log=print):
    """What a training run (and each --bench mode) needs: the model (fp32 master weights,
    fp64 under --dtype float64), AdamW, the mode's engines, the split, the step, a meter."""
    model = GPT(model_config(cfg)).to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    optimizer = make_optimizer(model, cfg, device)
    engines = build_engines(cfg, model, device, dtype, mode, log)
    split = Split(cfg.gradient_accumulation_steps, {'gpu': '0', 'ane': '1', 'hetero': cfg.ane_fraction}[mode])
    meter = EnergyMeter({device} | {e.device for e in engines.values()})
    return model, optimizer, engines, HeteroStep(model, engines, split, log=log, optimizer=optimizer), meter


def setup(cfg, given, log=print):
    """Checks the configuration and resolves what 'auto' means on this machine."""
    device = resolve_device(cfg.device)
    if device.type == 'cpu':
        changed = {k: v for k, v in CPU_DEFAULTS.items() if k not in given}
        for k, v in changed.items():
            setattr(cfg, k, v)
        if changed:
            log("no GPU: small model and short run for the CPU (any flag overrides): "
                + ' '.join(f'{k}={v}' for k, v in changed.items()))
    if cfg.mode == 'auto':
        cfg.mode = 'hetero' if ON_MAC else 'gpu'
    if cfg.mode not in ('gpu', 'ane', 'hetero'):
        raise UserError(f"unknown --mode {cfg.mode!r}: use gpu, ane or hetero")
    if cfg.ane_fraction != 'auto':
        try:
            ok = 0.0 <= float(cfg.ane_fraction) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise UserError(f"--ane_fraction must be auto or a number in [0, 1], got {cfg.ane_fraction!r}")
    for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'gradient_accumulation_steps',
              'bench_iters', 'bench_repeats'):
        if getattr(cfg, k) < 1:
            raise UserError(f"--{k} must be at least 1")
    model_config(cfg)  # raises if n_embd % n_head
    if device.type == 'cuda':  # as nanoGPT: fp32 matmuls on tensor cores (TF32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return device, resolve_dtype(cfg.dtype, device)


def train(cfg, given=frozenset()):
    device, dtype = setup(cfg, given)
    data = load_data(cfg)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    model, optimizer, engines, step, meter = build_run(cfg, device, dtype, cfg.mode, log=tqdm_write)
    split = step.split
    it, tokens, elapsed, best_val = 0, 0, 0.0, float('inf')
    if cfg.resume:
        if not os.path.exists(ckpt_path):
            raise UserError(f"--resume: no checkpoint at {ckpt_path}")
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        if {'bias': True, **ck['model_args']} != dataclasses.asdict(model.config):  # older ones lack bias
            raise UserError(f"checkpoint is for {ck['model_args']}, not {dataclasses.asdict(model.config)}")
        model.load_state_dict(ck['model'])
        optimizer.load_state_dict(ck['optimizer'])
        it, tokens, elapsed, best_val = ck['iter_num'], ck['tokens'], ck['elapsed'], ck['best_val_loss']
        split.load_state_dict(ck['split'])
        for n, e in engines.items():
            e.scaler.scale = ck['loss_scales'].get(n, e.scaler.scale)
        print(f"resumed from {ckpt_path} at step {it}")

    def checkpoint():
        save_checkpoint(ckpt_path, dict(
            model=model.state_dict(), optimizer=optimizer.state_dict(),
            model_args=dataclasses.asdict(model.config), iter_num=it, tokens=tokens, elapsed=elapsed,
            best_val_loss=best_val, config=dataclasses.asdict(cfg), split=split.state_dict(),
            loss_scales={n: e.scaler.scale for n, e in engines.items()}))

    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 {n_params / 1e6:.2f}M parameters | mode {cfg.mode} | "
          + ' | '.join(f"{n}: {e.label}" for n, e in engines.items()) + f" | energy meter: {meter.name}")
    tok_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    metrics = open(os.path.join(cfg.out_dir, 'metrics.jsonl'), 'a')
    evaluator = engines.get('gpu') or AutogradEngine(model, device, dtype)
    bar = make_bar(cfg, it)
    next_eval_s = (elapsed // cfg.eval_seconds + 1) * cfg.eval_seconds if cfg.eval_seconds > 0 else 0.0
    j0, t_log, tok_log = meter.joules(), elapsed, 0
    try:
        while it < cfg.max_iters:
            lr = get_lr(cfg, it)
            for g in optimizer.param_groups:
                g['lr'] = lr
            t0 = time.perf_counter()
            out = step.update(step(step_batches(cfg, data['train'], it)), cfg.grad_clip)
            it += 1
            tokens += tok_per_step
            tok_log += tok_per_step
            elapsed += time.perf_counter() - t0
            row = None
            if it % cfg.log_interval == 0 or it == cfg.max_iters:
                dt = elapsed - t_log  # training time only: evaluations and checkpoints excluded
                row = dict(step=it, loss=out['loss'], lr=lr, tokens=tokens, tokens_per_s=tok_log / dt,
                           elapsed=elapsed, mode=cfg.mode, ane_microbatches=split.current(step.alive),
                           microbatches=split.n, dropped=dict(step.dropped), skipped=step.skipped)
                for n, r in out['results'].items():
                    if 'seconds' in r:
                        row[f'{n}_tokens_per_s'] = r['n'] * cfg.batch_size * cfg.block_size / r['seconds']
                        row[f'{n}_loss'] = r['loss'] / r['n']  # each engine's own mean: a check on the other
                if 'ane' in engines:
                    row['loss_scale'] = engines['ane'].scaler.scale
                j = meter.joules()
                if j is not None:
                    row['joules_per_token'] = (j - j0) / tok_log
                    j0 = j
                t_log, tok_log = elapsed, 0
            timed_eval = cfg.eval_seconds > 0 and elapsed >= next_eval_s
            if timed_eval:  # at fixed training time (steps only; evaluation is not counted)
                row = (row or dict(step=it, tokens=tokens, elapsed=elapsed)) | dict(eval_at_seconds=next_eval_s)
                while next_eval_s <= elapsed:
                    next_eval_s += cfg.eval_seconds
            scheduled = it % cfg.eval_interval == 0 or it == cfg.max_iters
            if scheduled or timed_eval:
                val = evaluate(model, evaluator, cfg, data['val'])
                best_val = min(best_val, val)
                row = (row or dict(step=it, tokens=tokens, elapsed=elapsed)) | dict(
                    val_loss=val, val_ppl=math.exp(min(val, 50)))
            if row:  # the log first, then the checkpoint: a resumed run never lacks a row
                metrics.write(json.dumps(row) + '\n')
                metrics.flush()
                if scheduled:  # not at timed evaluations: those can come every few seconds
                    checkpoint()
                bar.set_postfix({k: (f'{v:.4g}' if isinstance(v, float) else v) for k, v in row.items()
                                 if k in ('loss', 'val_loss', 'tokens_per_s', 'ane_microbatches')})
                if bar.disable:
                    print(' '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}' for k, v in row.items()))
            bar.update(1)
    except KeyboardInterrupt:
        checkpoint()
        bar.close()
        print(f"\ninterrupted: checkpoint saved at step {it} in {ckpt_path}; continue with --resume")
        return model
    bar.close()
    metrics.close()
    if cfg.sample_tokens > 0:
        import prepare_data
        enc = prepare_data.get_encoding()
        start = torch.tensor([enc.encode('\n')], device=device)
        with evaluator.autocast:
            text = enc.decode(model.generate(start, cfg.sample_tokens)[0].tolist())
        print('---- sample ----\n' + text)
    return model


def bench(cfg, given):
    """GPU-only, ANE-only and hetero in this process, on the same batches from the same
    initial weights: the paper's table. The modes take turns (gpu, ane, hetero, gpu, ...)
    for bench_repeats rounds and each reports its median round, so a drift of the GPU's
    clocks over the run touches every mode alike."""
    device, dtype = setup(cfg, given)
    data = load_data(cfg)
    torch.manual_seed(cfg.seed)
    init = GPT(model_config(cfg)).state_dict()
    tok_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    runs, rounds, threads = {}, {}, {}
    for mode in ('gpu', 'ane', 'hetero'):
        model, optimizer, engines, step, meter = build_run(cfg, device, dtype, mode)
        model.load_state_dict(init)
        runs[mode] = (optimizer, engines, step, meter)
        threads[mode] = torch.get_num_threads()  # hetero with a CPU engine leaves a core free
        rounds[mode] = dict(tok_s=[], joules=[], engine_s={}, step_s=[])

    def sync():  # every engine's work done, so that a round's time holds all of it
        device_synchronize(device)
        for _, engines, _, _ in runs.values():
            for e in engines.values():
                e.synchronize()

    def train_step(mode, it):
        _, _, step, _ = runs[mode]
        torch.set_num_threads(threads[mode])
        return step.update(step(step_batches(cfg, data['train'], it)))

    for mode in runs:  # warm-up: at least 5 steps and 3 seconds (clocks, allocator, the auto split)
        w, start = 0, time.perf_counter()
        while w < 5 or time.perf_counter() - start < 3.0:
            train_step(mode, w)
            w += 1
    for r in range(cfg.bench_repeats):
        for mode, (_, _, step, meter) in runs.items():
            sync()
            t0, j0 = time.perf_counter(), meter.joules()
            for i in range(cfg.bench_iters):
                t = time.perf_counter()
                out = train_step(mode, 10**6 + r * cfg.bench_iters + i)  # the same batches in every mode
                rounds[mode]['step_s'].append(time.perf_counter() - t)
                for n, res in out['results'].items():
                    rounds[mode]['engine_s'].setdefault(n, []).append(res['seconds'])
            sync()
            dt, j = time.perf_counter() - t0, meter.joules()
            rounds[mode]['tok_s'].append(tok_per_step * cfg.bench_iters / dt)
            rounds[mode]['joules'].append(None if j is None else j - j0)
    rows = {}
    n_tok = tok_per_step * cfg.bench_iters * cfg.bench_repeats
    for mode, (_, engines, step, meter) in runs.items():
        rd = rounds[mode]
        rows[mode] = dict(tok_s=statistics.median(rd['tok_s']), rounds=[round(x) for x in rd['tok_s']],
                          j_tok=None if None in rd['joules'] else sum(rd['joules']) / n_tok,
                          split=f"{step.split.current(step.alive)}/{step.split.n}" if mode == 'hetero' else '-',
                          engines=' + '.join(e.label for e in engines.values()), meter=meter.name,
                          # where a step's time goes: each engine's share (in parallel), the whole step
                          ms_step=1000 * statistics.median(rd['step_s']),
                          ms_engines={n: round(1000 * statistics.median(v), 1) for n, v in rd['engine_s'].items()})
        print(f"{mode}: {rows[mode]}")
    g = rows['gpu']
    print(f"\n{'mode':8} {'tokens/s':>10} {'x GPU-only':>10} {'J/token':>10} {'energy vs GPU':>14}  ANE share")
    for mode, r in rows.items():
        jt = f"{r['j_tok']:.4g}" if r['j_tok'] is not None else 'n/a'
        dj = f"{100 * (r['j_tok'] / g['j_tok'] - 1):+.1f}%" if r['j_tok'] and g['j_tok'] else 'n/a'
        print(f"{mode:8} {r['tok_s']:10.0f} {r['tok_s'] / g['tok_s']:10.3f} {jt:>10} {dj:>14}  {r['split']}")
    s = rows['gpu']['tok_s'] + rows['ane']['tok_s']
    print(f"hetero / (gpu + ane alone) = {rows['hetero']['tok_s'] / s:.3f} "
          f"(medians of {cfg.bench_repeats} rounds of {cfg.bench_iters} steps per mode)")
    return rows


def make_bar(cfg, start):
    from tqdm import tqdm
    return tqdm(total=cfg.max_iters, initial=start, disable=cfg.quiet, dynamic_ncols=True, desc='train')


def tqdm_write(s):
    from tqdm import tqdm
    tqdm.write(s)


def main(argv=None):
    cfg, given = parse_args(argv)
    try:
        if cfg.bench:
            bench(cfg, given)
        else:
            train(cfg, given)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == '__main__':
    main()
